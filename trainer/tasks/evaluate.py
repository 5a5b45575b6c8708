"""Greedy evaluation of the trainer's own weights on the task's held-out prompts.

The trainer runs it (Hugging Face ``generate``, greedy) on exactly the version it is about
to push, so the figure belongs to one version; prompts are encoded and completions cut at
end-of-sequence the same way the engine does, and scored by the task's own ``score`` (a
multi-turn task plays whole episodes, its environment called here: ``greedy_episodes``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inflight.trainer.tasks.episode import ObservationRenderer, Transcript, check_turn
from inflight.trainer.tasks.task import ChatMode, Completion, Prompt, Task, encode_prompt, is_episodic, model_stop_ids
from inflight.trainer.tasks.tool_calls import ToolCallParser

if TYPE_CHECKING:
    from inflight.trainer.config import TrainConfig

log = logging.getLogger("inflight.eval")


def _correct(task: Task, reward: float) -> bool:
    judge = getattr(task, "correct", None)  # a duck-typed user task may not define it
    return bool(judge(reward)) if callable(judge) else reward >= 1.0


def _generate(model: Any, tokenizer: Any, contexts: Sequence[list[int]], *, pad: int, max_new_tokens: int,
              stop_ids: Sequence[int]) -> list[Completion]:
    """Greedy completions of left-padded ``contexts``, cut after the first end-of-sequence token."""
    device = next(model.parameters()).device
    width = max(len(ids) for ids in contexts)
    input_ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(contexts):  # left padding: every completion starts at column `width`
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        mask[i, width - len(ids):] = 1
    out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids), pad_token_id=pad,
                         temperature=None, top_p=None, top_k=None)
    completions = []
    for row in out[:, width:].tolist():
        end = next((i for i, t in enumerate(row) if t in stop_ids), None)
        tokens = row if end is None else row[: end + 1]
        text = tokenizer.decode(tokens[:end] if end is not None else tokens, skip_special_tokens=True)
        completions.append(Completion(text, tokens, "length" if end is None else "stop"))
    return completions


def _run_turn(task: Any, view: Any) -> Any:
    out = task.turn(view)
    if inspect.isawaitable(out):
        async def wait() -> Any:
            return await out
        out = asyncio.run(wait())
    return check_turn(out, last=view.last)


def greedy_episodes(model: Any, tokenizer: Any, task: Any, prompts: Sequence[Prompt], *, chat: ChatMode,
                    max_new_tokens: int, stop_ids: Sequence[int], max_turns: int, max_tokens: int, max_model_len: int,
                    pad: int, tool_calls: Callable[[str], tuple] | None = None) -> tuple[list[float], list[str]]:
    """Greedy multi-turn episodes (``EpisodeTask``), the environment called in this process:
    each episode's reward (0 where the environment failed, logged) and transcript.
    ``tool_calls``: a reply's calls (``ToolCallParser.parse``), as the engine reads them."""
    episodes = [Transcript(p, encode_prompt(tokenizer, p, chat)) for p in prompts]
    renderer = ObservationRenderer(tokenizer, chat)
    active = list(range(len(episodes)))
    while active:
        rooms = [min(max_new_tokens, episodes[i].room(max_tokens, max_model_len)) for i in active]
        replies = _generate(model, tokenizer, [episodes[i].context_ids() for i in active], pad=pad,
                            max_new_tokens=max(rooms), stop_ids=stop_ids)
        still = []
        for i, c, room in zip(active, replies, rooms):
            e = episodes[i]
            if len(c.token_ids) > room:  # each turn within its episode's budget, as the engine caps it
                c = Completion(tokenizer.decode(c.token_ids[:room], skip_special_tokens=True), c.token_ids[:room],
                               "length")
            e.add_reply(c.text, c.token_ids, [0.0] * len(c.token_ids), [0] * len(c.token_ids), c.finish_reason)
            e.tool_calls = tool_calls(c.text) if tool_calls is not None else ()
            last = e.turns >= max_turns or e.room(max_tokens, max_model_len) < 1  # the engine's rule
            try:
                turn = _run_turn(task, e.view(last=last))
            except Exception as err:  # an evaluation episode that fails scores 0
                log.warning("eval: %s.turn failed on %r: %s: %s", type(task).__name__, e.prompt.display[:60],
                            type(err).__name__, err)
                e.reward = 0.0
                continue
            if turn.done:
                e.end(turn)
                continue
            try:
                ids, text = renderer.ids(turn, e.token_ids, e.finish_reason), renderer.text(turn)
            except ValueError as err:
                log.warning("eval: %s's observation could not be rendered: %s", type(task).__name__, err)
                e.reward = 0.0
                continue
            e.add_observation(turn, ids, text)
            if e.room(max_tokens, max_model_len) < 1:  # the engine fails such an episode too
                log.warning("eval: %s's observation left no room for another turn", type(task).__name__)
                e.reward = 0.0
                continue
            still.append(i)
        active = still
    return [float(e.reward or 0.0) for e in episodes], [e.text() for e in episodes]


@torch.no_grad()
def greedy_eval(model: Any, tokenizer: Any, task: Task, prompts: Sequence[Prompt], *, chat: ChatMode,
                max_new_tokens: int, stop_ids: Sequence[int], batch_size: int = 16, max_turns: int = 1,
                max_tokens: int = 1 << 30, max_model_len: int = 1 << 30,
                tool_calls: Callable[[str], tuple] | None = None) -> dict[str, Any]:
    """``eval_accuracy`` (share of prompts the task counts as solved), ``eval_reward`` (mean),
    ``eval_prompts`` (how many) and ``eval_examples`` (the first three, for the log). A
    multi-turn task (``EpisodeTask``) plays whole episodes of at most ``max_turns`` turns."""
    was_training = model.training
    model.eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    rewards: list[float] = []
    texts: list[str] = []
    try:
        for start in range(0, len(prompts), batch_size):
            batch = list(prompts[start:start + batch_size])
            if is_episodic(task):
                got, shown = greedy_episodes(model, tokenizer, task, batch, chat=chat, max_new_tokens=max_new_tokens,
                                             stop_ids=stop_ids, max_turns=max_turns, max_tokens=max_tokens,
                                             max_model_len=max_model_len, pad=pad, tool_calls=tool_calls)
            else:
                completions = _generate(model, tokenizer, [encode_prompt(tokenizer, p, chat) for p in batch], pad=pad,
                                        max_new_tokens=max_new_tokens, stop_ids=stop_ids)
                got, shown = [float(r) for r in task.score(batch, completions)], [c.text for c in completions]
            rewards += got
            texts += shown
    finally:
        model.train(was_training)
    return {"eval_accuracy": sum(_correct(task, r) for r in rewards) / len(rewards),
            "eval_reward": sum(rewards) / len(rewards), "eval_prompts": len(rewards),
            "eval_examples": [{"prompt": p.display, "completion": c, "reward": r}
                              for p, c, r in list(zip(prompts, texts, rewards))[:3]]}


class Evaluator:
    """``eval.every``'s evaluation: the task's held-out prompts, fixed for the whole run."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any, task: Task, model_dir: Path) -> None:
        self.every, self.last_step = cfg.eval.every, cfg.run.steps
        self.tokenizer, self.task, self.chat = tokenizer, task, cfg.task.chat
        self.max_new_tokens = cfg.task.completion_tokens
        self.max_turns, self.max_tokens = cfg.task.episode.max_turns, cfg.task.episode.max_tokens
        self.max_model_len = cfg.engine.max_model_len
        self.prompts = task.eval_prompts(cfg.eval.prompts)
        self.stop_ids = model_stop_ids(model_dir, tokenizer)
        self.tool_calls = ToolCallParser(cfg.task.tool_parser, tokenizer).parse if cfg.task.tool_parser else None

    def due(self, step: int) -> bool:
        """After optimizer step ``step`` (1-based): every ``every`` steps, and after the last."""
        return step % self.every == 0 or step == self.last_step

    def __call__(self, model: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        result = greedy_eval(model, self.tokenizer, self.task, self.prompts, chat=self.chat,
                             max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids, max_turns=self.max_turns,
                             max_tokens=self.max_tokens, max_model_len=self.max_model_len, tool_calls=self.tool_calls)
        return {**result, "eval_ms": 1e3 * (time.perf_counter() - t0)}
