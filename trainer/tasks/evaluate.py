"""Greedy evaluation of the trainer's own weights on the task's held-out prompts.

The trainer runs it (Hugging Face ``generate``, greedy) on exactly the version it is about
to push, so the figure belongs to one version; prompts are encoded and completions cut at
end-of-sequence the same way the engine does, and scored by the task's own ``score``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainer.tasks.base import ChatMode, Completion, Prompt, Task, encode_prompt, model_stop_ids

if TYPE_CHECKING:
    from trainer.config import TrainConfig


def _correct(task: Task, reward: float) -> bool:
    judge = getattr(task, "correct", None)  # a duck-typed user task may not define it
    return bool(judge(reward)) if callable(judge) else reward >= 1.0


@torch.no_grad()
def greedy_eval(model: Any, tokenizer: Any, task: Task, prompts: Sequence[Prompt], *, chat: ChatMode,
                max_new_tokens: int, stop_ids: Sequence[int], batch_size: int = 16) -> dict[str, Any]:
    """``eval_accuracy`` (share of prompts the task counts as solved), ``eval_reward`` (mean),
    ``eval_prompts`` (how many) and ``eval_examples`` (the first three, for the log)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    completions: list[Completion] = []
    try:
        for start in range(0, len(prompts), batch_size):
            encoded = [encode_prompt(tokenizer, p, chat) for p in prompts[start:start + batch_size]]
            width = max(len(ids) for ids in encoded)
            input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for i, ids in enumerate(encoded):  # left padding: every completion starts at column `width`
                input_ids[i, width - len(ids):] = torch.tensor(ids)
                mask[i, width - len(ids):] = 1
            out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids), pad_token_id=pad,
                                 temperature=None, top_p=None, top_k=None)
            for row in out[:, width:].tolist():
                end = next((i for i, t in enumerate(row) if t in stop_ids), None)
                tokens = row if end is None else row[: end + 1]
                text = tokenizer.decode(tokens[:end] if end is not None else tokens, skip_special_tokens=True)
                completions.append(Completion(text, tokens, "length" if end is None else "stop"))
    finally:
        model.train(was_training)
    rewards = [float(r) for r in task.score(list(prompts), completions)]
    return {"eval_accuracy": sum(_correct(task, r) for r in rewards) / len(rewards),
            "eval_reward": sum(rewards) / len(rewards), "eval_prompts": len(rewards),
            "eval_examples": [{"prompt": p.display, "completion": c.text, "reward": r}
                              for p, c, r in list(zip(prompts, completions, rewards))[:3]]}


class Evaluator:
    """``eval.every``'s evaluation: the task's held-out prompts, fixed for the whole run."""

    def __init__(self, cfg: TrainConfig, tokenizer: Any, task: Task, model_dir: Path) -> None:
        self.every, self.last_step = cfg.eval.every, cfg.run.steps
        self.tokenizer, self.task, self.chat = tokenizer, task, cfg.task.chat
        self.max_new_tokens = cfg.task.completion_tokens
        self.prompts = task.eval_prompts(cfg.eval.prompts)
        self.stop_ids = model_stop_ids(model_dir, tokenizer)

    def due(self, step: int) -> bool:
        """After optimizer step ``step`` (1-based): every ``every`` steps, and after the last."""
        return step % self.every == 0 or step == self.last_step

    def __call__(self, model: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        result = greedy_eval(model, self.tokenizer, self.task, self.prompts, chat=self.chat,
                             max_new_tokens=self.max_new_tokens, stop_ids=self.stop_ids)
        return {**result, "eval_ms": 1e3 * (time.perf_counter() - t0)}
