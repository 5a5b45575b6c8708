"""Episodes: multi-turn tasks where an environment answers each of the policy's turns.

An ``EpisodeTask`` opens an episode with a ``Prompt`` (``sample``, as any task) and then answers every turn of
the policy with a ``Turn``: an observation (a tool's output, a game's feedback) that the policy reads before its
next turn, or the end of the episode with its reward. ``turn`` may be a coroutine. It runs in the engine's
scoring processes (``inflight.trainer.rollout.scoring_pool``), each call under ``task.scoring``'s timeout and
memory cap, so an episode waiting on a tool never holds up decoding nor another episode.

An episode is one token sequence (``Transcript``)::

    prompt_ids | reply 1 (policy) | observation 1 (env) | reply 2 (policy) | ... | reply k
                 tagged, log-probs   masked from the loss

Each turn of the policy is a request that continues the episode's token ids (with prefix caching the history
is not prefilled again). Observation tokens are rendered by the model's chat template (``ObservationRenderer``:
the end of the policy's turn, the new message, the assistant's generation prompt), carry no log-prob, the
version of the token before them, and ``observation = True``: the loss never sees them (``loss.collate``).
Environments are functional: everything a turn needs is in the ``EpisodeView`` (the opening prompt, every reply
and observation so far, and ``state``, which a ``Turn`` may replace), so any scoring process can answer any
turn, and an episode survives the replacement of a worker that hung.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from inflight.trainer.tasks.task import ChatMode, EpisodeView, Prompt, Task, Turn, uses_chat


class EpisodeTask(Task):
    """Subclass this for a multi-turn task: ``sample`` opens an episode, ``turn`` answers it."""

    @abstractmethod
    def turn(self, episode: EpisodeView) -> Turn | Awaitable[Turn]:
        """The environment's answer to ``episode.reply``; ``done`` (with the reward) when
        ``episode.last``. Runs in a scoring process: raise, hang or run out of memory and the
        episode fails, never the engine."""



class RetokenizationDrift(ValueError):
    """A turn's prompt ids do not begin with the episode's token ids so far."""


def drift_position(prompt_ids: Sequence[int], context: Sequence[int]) -> int | None:
    """Where ``prompt_ids`` first leaves ``context`` (the episode's prompt and every reply and
    observation so far), or None where it begins with it exactly."""
    if list(prompt_ids[:len(context)]) == list(context):
        return None
    return next((i for i, (a, b) in enumerate(zip(prompt_ids, context, strict=False)) if a != b),
                min(len(prompt_ids), len(context)))


def check_turn(out: Any, *, last: bool) -> Turn:
    """``out`` as a ``Turn``; ValueError naming what is wrong otherwise (a turn that must end
    and does not is wrong)."""
    if not isinstance(out, Turn):
        text = repr(out)
        raise ValueError(f"{text[:60]} ({type(out).__name__}), not a Turn")
    if last and not out.done:
        raise ValueError("no Turn(done=True, reward=...) on the episode's last turn (task.episode.max_turns)")
    return out


class ObservationRenderer:
    """Token ids of an observation as the model reads it after a reply.

    With a chat template: what closes the policy's turn (the template's text after an
    assistant message, less the stop token the policy already sampled), then the message
    rendered by the template, then the assistant's generation prompt. Without one (or
    ``task.chat = "off"``): the observation's text as is. A turn's ``observation_ids`` are
    taken as they are, once checked against the vocabulary."""

    _MARK = "\x00reply\x00"

    def __init__(self, tokenizer: Any, chat: ChatMode) -> None:
        self.tokenizer, self.chat = tokenizer, uses_chat(tokenizer, chat)
        if self.chat:
            self._messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": self._MARK}]
            self._head = self._render(self._messages, generation=False)
            self.closing = self._head.split(self._MARK, 1)[1]  # "<|im_end|>\n"

    def _render(self, messages: list[dict], generation: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)

    def message_text(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The template's text for ``messages`` followed by the generation prompt."""
        full = self._render(self._messages + [dict(m) for m in messages], generation=True)
        if not full.startswith(self._head):
            raise ValueError("the chat template renders earlier messages differently once another follows; "
                             "set task.chat = 'off' and render observations yourself")
        return full[len(self._head):]

    def ids(self, turn: Turn, reply_ids: Sequence[int], finish_reason: str) -> list[int]:
        """The observation's token ids, to follow ``reply_ids`` (which ended with ``finish_reason``)."""
        if turn.observation_ids is not None:
            vocab = len(self.tokenizer)
            if any(i >= vocab for i in turn.observation_ids):
                raise ValueError(f"Turn.observation_ids holds {max(turn.observation_ids)}, past the "
                                 f"tokenizer's {vocab} ids")
            return list(turn.observation_ids)
        if not self.chat:
            return list(self.tokenizer(self.text(turn), add_special_tokens=False).input_ids)
        closing = self.closing
        if finish_reason == "stop" and reply_ids:
            stop_text = self.tokenizer.decode([reply_ids[-1]])
            if closing.startswith(stop_text):
                closing = closing[len(stop_text):]
        text = closing + self.message_text(turn.messages or [{"role": turn.role, "content": turn.observation}])
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def text(self, turn: Turn) -> str:
        """The observation as ``EpisodeView.observations`` shows it (messages: their contents, a line each)."""
        if turn.messages:
            return "\n".join(m["content"] for m in turn.messages)
        if turn.observation or turn.observation_ids is None:
            return turn.observation
        return self.tokenizer.decode(list(turn.observation_ids))


@dataclass
class Transcript:
    """One episode's tokens, in order, as it is sampled: what the sample will carry."""

    prompt: Prompt
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    observation: list[bool] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    state: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: str = ""
    hybrid_tokens: int = 0
    reward: float | None = None
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    """The last reply's tool calls (``EpisodeView.tool_calls``)."""
    reply_start: int = 0
    """Where the last reply begins in ``token_ids``."""
    routing_fields: Mapping[str, Any] = field(default_factory=dict)
    """A one-turn episode's routed experts (``loss.routing_replay``: ``RolloutSample``'s routing fields)."""

    @property
    def turns(self) -> int:
        return len(self.replies)

    def context_ids(self) -> list[int]:
        """The next turn's prompt: the opening prompt and everything since."""
        return self.prompt_ids + self.token_ids

    def room(self, max_tokens: int, max_model_len: int) -> int:
        """Tokens the next turn may sample: the episode's budget (``task.episode.max_tokens``)
        and the model's context; below 1, the turn just taken is the last."""
        return min(max_tokens - len(self.token_ids), max_model_len - len(self.prompt_ids) - len(self.token_ids))

    def add_reply(self, text: str, token_ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                  finish_reason: str, hybrid_tokens: int = 0) -> None:
        self.replies.append(text)
        self.reply_start = len(self.token_ids)
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.versions += versions
        self.observation += [False] * len(token_ids)
        self.finish_reason = finish_reason
        self.hybrid_tokens += hybrid_tokens

    def view(self, *, last: bool) -> EpisodeView:
        return EpisodeView(prompt=self.prompt, replies=tuple(self.replies), observations=tuple(self.observations),
                           state=dict(self.state), finish_reason=self.finish_reason, last=last,
                           reply_ids=tuple(self.token_ids[self.reply_start:]),
                           reply_logprobs=tuple(self.logprobs[self.reply_start:]), tool_calls=self.tool_calls)

    def add_observation(self, turn: Turn, ids: Sequence[int], text: str) -> None:
        """The environment's tokens (``ids``, shown as ``text``): no log-prob, the version of
        the token before them, masked."""
        version = self.versions[-1] if self.versions else 0
        self.observations.append(text)
        self.token_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)
        self.observation += [True] * len(ids)
        if turn.state is not None:
            self.state = dict(turn.state)

    def end(self, turn: Turn) -> None:
        self.reward = float(turn.reward)  # type: ignore[arg-type]  # checked by Turn

    def text(self) -> str:
        """The episode after its prompt, for logs: replies and observations interleaved."""
        parts = []
        for i, reply in enumerate(self.replies):
            parts.append(reply)
            if i < len(self.observations):
                parts.append(f"[{self.observations[i]}]")
        return " ".join(parts)
