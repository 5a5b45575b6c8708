"""What a task is: prompts to sample, a held-out set to evaluate on, and a verifier.

A task yields ``Prompt``s (plain text, or chat messages) carrying whatever its verifier
needs (``answer``, ``meta``), and scores completions in batches. The engine turns a prompt
into token ids with ``encode_prompt`` (the model's chat template when it has one), samples
until the model's end-of-sequence token or ``task.completion_tokens``, and calls
``Task.score``; the trainer calls the same ``encode_prompt`` and ``score`` for evaluation,
so what is evaluated is exactly what is trained.
"""

from __future__ import annotations

import importlib
import math
import random
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal


@dataclass(frozen=True)
class Prompt:
    """One problem. ``messages`` (chat turns) wins over ``text`` when given."""

    text: str = ""
    """Plain-text prompt; on a chat model it becomes the single user turn."""
    answer: str = ""
    """What the verifier compares against (the digit D, a number, a reference string)."""
    messages: tuple[Mapping[str, str], ...] = ()
    """Chat turns ``{"role": ..., "content": ...}``."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """Anything else a verifier needs."""
    tools: tuple[Mapping[str, Any], ...] = ()
    """JSON schemas of the tools the model may call (``inflight.trainer.tasks.tool_calls``),
    given to the chat template as ``tools=``."""

    def __post_init__(self) -> None:
        if not self.text and not self.messages:
            raise ValueError("a Prompt needs text or messages")

    @property
    def display(self) -> str:
        """A one-line rendering for logs (``RolloutSample.prompt_text``)."""
        return self.text or " | ".join(f"{m['role']}: {m['content']}" for m in self.messages)


@dataclass(frozen=True)
class Completion:
    """What the engine sampled for one prompt."""

    text: str
    token_ids: Sequence[int]
    finish_reason: str = ""
    """``stop`` (end-of-sequence) or ``length`` (hit ``task.completion_tokens``)."""


ROLES = ("user", "tool")


@dataclass(frozen=True)
class Turn:
    """The environment's answer to one turn of the policy."""

    observation: str = ""
    """What the policy reads before its next turn (ignored when ``done``), rendered by the chat template."""
    observation_ids: Sequence[int] | None = None
    """The observation as token ids, appended exactly as given instead of rendering ``observation``
    (so they carry any turn markers themselves); ``observation`` is then only its text for
    ``EpisodeView.observations`` and logs (empty: the ids decoded)."""
    role: str = "tool"
    """The observation's chat role: ``tool`` (a tool's output) or ``user`` (feedback)."""
    messages: tuple[Mapping[str, str], ...] = ()
    """Several messages in place of ``observation``/``role`` (one ``role: tool`` message per
    tool call: ``{"role", "content"}``), rendered one after the other."""
    done: bool = False
    """The episode ends here, with ``reward``."""
    reward: float | None = None
    """The episode's reward: a finite number when ``done``, None before."""
    state: Mapping[str, Any] | None = None
    """Replaces the episode's state for the next turn (None: keep it). Must pickle."""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Turn.role={self.role!r} must be one of {list(ROLES)}")
        for m in self.messages:
            if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"Turn.messages holds {m!r}: each a {{'role': one of {list(ROLES)}, 'content': str}}")
        if self.messages and self.observation_ids is not None:
            raise ValueError("Turn: give messages or observation_ids, not both")
        object.__setattr__(self, "messages", tuple({"role": m["role"], "content": m["content"]} for m in self.messages))
        if self.observation_ids is not None:
            ids = tuple(self.observation_ids)
            if not all(type(i) is int and i >= 0 for i in ids):
                bad = next(i for i in ids if type(i) is not int or i < 0)
                raise ValueError(f"Turn.observation_ids holds {bad!r}: token ids are non-negative ints")
            object.__setattr__(self, "observation_ids", ids)
        if self.done:
            if self.reward is None or isinstance(self.reward, bool) or not math.isfinite(float(self.reward)):
                raise ValueError(f"Turn(done=True) needs a finite reward, not {self.reward!r}")
        elif self.reward is not None:
            raise ValueError(f"Turn.reward={self.reward!r} before the episode is done: give it with done=True")


@dataclass(frozen=True)
class EpisodeView:
    """An episode as its environment sees it when the policy ends a turn."""

    prompt: Prompt
    replies: tuple[str, ...]
    """The policy's turns so far, decoded; the last is the one to answer."""
    observations: tuple[str, ...]
    """What the environment answered to each earlier reply (one fewer than ``replies``)."""
    state: Mapping[str, Any] = field(default_factory=dict)
    finish_reason: str = ""
    """The last reply's: ``stop`` (the model ended its turn) or ``length`` (cut at ``task.completion_tokens``)."""
    last: bool = False
    """The episode may take no more turns (``task.episode.max_turns``): answer with ``done``."""
    reply_ids: tuple[int, ...] = ()
    """The last reply's token ids, as sampled."""
    reply_logprobs: tuple[float, ...] = ()
    """Their log-probs under the policy that sampled them."""
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    """The last reply's tool calls, ``{"name", "arguments"}``, as vLLM's tool parser read them
    (``task.tool_parser``; empty without one, or when the reply calls nothing)."""

    @property
    def reply(self) -> str:
        return self.replies[-1]


class Task(ABC):
    """Subclass this for a task of your own (``task.name = "module:factory"``). A task answers
    the policy's replies in one of two ways: ``score`` (a single-turn task: every episode is
    one reply, its reward) or ``turn`` (``EpisodeTask``: the environment answers each reply
    until the episode ends). A concrete task defines one of them."""

    renders_prompt: ClassVar[bool] = False
    """The environment renders each episode's opening prompt itself (a verifiers harness): the
    rollout asks it for the first turn's token ids instead of encoding ``sample``'s prompt."""

    @abstractmethod
    def sample(self, rng: random.Random) -> Prompt:
        """A training prompt. Must never return one of ``eval_prompts``' prompts."""

    def score(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list[float]:
        """One reward per (prompt, completion) pair, in order. Called once per GRPO group."""
        raise NotImplementedError(f"{type(self).__name__} defines turn(), not score(): its episodes take turns")

    def turn(self, episode: EpisodeView) -> Turn | Awaitable[Turn]:
        """The environment's answer to ``episode.reply``. A single-turn task's episode is one
        reply: it ends here, rewarded by ``score``."""
        completion = Completion(episode.reply, episode.reply_ids, episode.finish_reason)
        return Turn(done=True, reward=float(self.score([episode.prompt], [completion])[0]))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        abstract = any(getattr(getattr(cls, name, None), "__isabstractmethod__", False) for name in ("sample", "turn"))
        if not abstract and cls.score is Task.score and cls.turn is Task.turn:
            raise TypeError(f"{cls.__name__} defines neither score() (a single-turn task) nor turn() (an EpisodeTask)")

    def eval_prompts(self, n: int) -> list[Prompt]:
        """The fixed held-out set greedy evaluation runs on (the same list on every call).
        By default ``n`` prompts from a fixed seed: override it to hold them out of ``sample``."""
        rng = random.Random(0xE7A1)
        return [self.sample(rng) for _ in range(n)]

    def correct(self, reward: float) -> bool:
        """Whether a reward counts as a solved problem for the accuracy figure."""
        return reward >= 1.0


def is_episodic(task: Any) -> bool:
    """Whether ``task``'s episodes take turns (it defines ``turn``); else each is one reply, scored."""
    return type(task).turn is not Task.turn


ChatMode = Literal["auto", "off"]


def uses_chat(tokenizer: Any, chat: ChatMode) -> bool:
    """Chat models (a tokenizer with a chat template) get their template unless ``chat = "off"``."""
    return chat == "auto" and bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, prompt: Prompt, chat: ChatMode) -> list[int]:
    """Token ids of the prompt as the model sees it.

    With the chat template, the rendered text already holds the special tokens the model
    was trained with, so the tokenizer must not add its own again.
    """
    if uses_chat(tokenizer, chat):
        messages = [dict(m) for m in prompt.messages] or [{"role": "user", "content": prompt.text}]
        text = tokenizer.apply_chat_template(messages, tools=[dict(t) for t in prompt.tools] or None, tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    if prompt.tools:
        raise ValueError(f"prompt {prompt.display!r} offers tools but the model has no chat template (or task.chat = "
                         "'off'): tools reach the model through the template's tools= (task.chat_template)")
    if prompt.messages:
        raise ValueError(f"prompt {prompt.display!r} has chat messages but the model has no chat template "
                         "(or task.chat = 'off'): give it text instead")
    return list(tokenizer(prompt.text).input_ids)


def stop_token_ids(tokenizer: Any, generation_eos: int | Sequence[int] | None = None) -> list[int]:
    """Every end-of-sequence id the model may emit: the tokenizer's and its generation config's
    (chat models often end a turn with a token, e.g. ``<|im_end|>``, that only one names)."""
    ids: list[int] = []
    for eos in (tokenizer.eos_token_id, generation_eos):
        for i in ([eos] if isinstance(eos, int) else list(eos or ())):
            if i is not None and i not in ids:
                ids.append(int(i))
    return ids


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The answer a completion commits to, GSM8K-style: the number after the last ``####``
    if there is one, else the last number in the text; commas dropped, ``42.0`` -> ``42``.
    None when there is no number."""
    tail = text.rsplit("####", 1)[1] if "####" in text else text
    found = _NUMBER.findall(tail)
    if not found:
        return None
    number = found[0] if "####" in text else found[-1]
    number = number.replace(",", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return "0" if number in ("-0", "") else number


_LONE_NUMBER = re.compile(r"[\s`*]*(-?\d[\d,]*(?:\.\d+)?)[\s`*]*\.?[\s`*]*")


def lone_number(text: str) -> str | None:
    """``final_number`` of a text that holds a number and nothing else (markdown ``*``,
    backticks, whitespace and a final period aside), else None: ``" **42.** "`` -> ``"42"``,
    ``"My guess is 42"`` -> None."""
    found = _LONE_NUMBER.fullmatch(text)
    return None if found is None else final_number(found.group(1))


def model_stop_ids(model_dir: Any, tokenizer: Any) -> list[int]:
    """``stop_token_ids`` with the end-of-sequence ids of the model directory's generation config."""
    from transformers import GenerationConfig

    try:
        generation_eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS is all there is
        generation_eos = None
    return stop_token_ids(tokenizer, generation_eos)


def load_factory(dotted: str) -> Any:
    """``"pkg.module:factory"`` -> the callable. The working directory is importable, as it is
    for ``python -m``, and so is a config file's directory (``inflight.trainer.config_files``): a task
    file next to the config, or where the run starts, works without installing it."""
    module_name, _, attr = dotted.partition(":")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.append(str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"task.name={dotted!r}: cannot import {module_name!r} ({e})") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ValueError(f"task.name={dotted!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ValueError(f"task.name={dotted!r}: {attr!r} is not callable")
    return factory
