"""``jsonl``: prompts and reference answers from a JSON-lines file.

One object per line: ``{"prompt": "..."}`` or ``{"messages": [{"role": ..., "content": ...}, ...]}``,
and ``"answer"`` (a string or a number); other keys travel in ``Prompt.meta``. Blank lines
are skipped; anything else that is not such an object fails the load with the file and
line number. ``match``:

- ``number``: the completion's final number (``base.final_number``) equals the answer's,
  so a GSM8K answer ``"... #### 42"`` and a completion ``"... so she has 42 apples"`` or
  ``"#### 42"`` agree;
- ``exact``: the completion equals the answer after stripping surrounding whitespace.

- ``reward = "module:function"``: your function instead, ``function(prompt, completion) ->
  float`` with the record as a ``Prompt`` (``answer``, and its other keys in ``meta``) and the
  completion's text; the answer may then be any string. It runs in the scoring processes like
  any reward (a timeout, a memory cap; one that raises or returns NaN fails its group).

The held-out set is ``eval_path`` when given, else the last ``eval.prompts`` records of
``path`` (the rest are the training prompts).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from inflight.trainer.tasks.task import Completion, Prompt, Task, final_number, load_factory

Match = Literal["number", "exact"]
"""number: the final number equals the answer's; exact: the stripped texts are equal."""

SAMPLE = Path(__file__).parent / "data" / "sample_gsm.jsonl"
"""A small sample in the repository: GSM8K-style word problems with ``#### N`` answers."""


class JsonlFormatError(ValueError):
    """A line of a task file that is not ``{"prompt"|"messages": ..., "answer": ...}``."""


def to_prompt(obj: object, where: str, match: str) -> Prompt:
    """One record (a JSON object, a dataset row) as a prompt; ``JsonlFormatError`` naming
    ``where`` and what is wrong."""
    if not isinstance(obj, dict):
        raise JsonlFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if ("prompt" in obj) == ("messages" in obj):
        raise JsonlFormatError(f"{where}: needs exactly one of 'prompt' or 'messages', has keys {sorted(obj)}")
    if "answer" not in obj:
        raise JsonlFormatError(f"{where}: no 'answer'")
    answer = obj["answer"]
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise JsonlFormatError(f"{where}: 'answer' must be a string or a number, got {answer!r}")
    answer = str(answer)
    if match == "number" and final_number(answer) is None:
        raise JsonlFormatError(f"{where}: match = 'number' but the answer {answer!r} holds no number")
    meta = {k: v for k, v in obj.items() if k not in ("prompt", "messages", "answer")}
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise JsonlFormatError(f"{where}: 'prompt' must be a non-empty string")
        return Prompt(obj["prompt"], answer, meta=meta)
    msgs = obj["messages"]
    if (not isinstance(msgs, list) or not msgs
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in msgs)):
        raise JsonlFormatError(f"{where}: 'messages' must be a non-empty list of {{'role': str, 'content': str}}")
    return Prompt(answer=answer, messages=tuple({"role": m["role"], "content": m["content"]} for m in msgs), meta=meta)


def load_jsonl(path: str | Path, match: str = "number") -> list[Prompt]:
    """Every record of ``path``, as prompts; a bad line raises ``JsonlFormatError`` naming it."""
    path = Path(path)
    prompts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line.rstrip("\r\n"))  # columns then count within the line
            except json.JSONDecodeError as e:
                raise JsonlFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            prompts.append(to_prompt(obj, where, match))
    if not prompts:
        raise JsonlFormatError(f"{path}: no records")
    return prompts


class RecordsTask(Task):
    """Prompts with reference answers, held in memory (a ``jsonl`` file's or a dataset's), and
    their reward: ``match`` or a ``reward`` function (``"module:function"``)."""

    def __init__(self, *, match: Match = "number", reward: str = "", where: str = "jsonl") -> None:
        if match not in ("number", "exact"):
            raise ValueError(f"{where}: match={match!r} is not number or exact")
        self.match = match
        self.reward_fn: Callable[[Prompt, str], float] | None = None
        if reward:
            try:
                self.reward_fn = load_factory(reward)
            except ValueError as e:
                raise ValueError(f"{where}: reward={reward!r}: {str(e).split(': ', 1)[-1]}") from None
        self.check = "exact" if self.reward_fn is not None else match  # any answer string goes to a function
        self.train: list[Prompt] = []
        self.held_out: list[Prompt] = []

    def hold_out(self, records: list[Prompt], eval_size: int, source: str, key: str) -> None:
        """Train on ``records`` less their last ``eval_size``, which are held out."""
        if eval_size >= len(records):
            raise ValueError(f"{source} has {len(records)} records; holding out eval.prompts={eval_size} "
                             f"would leave none to train on (set {key} or fewer eval.prompts)")
        cut = len(records) - eval_size
        self.train, self.held_out = records[:cut], records[cut:]

    def sample(self, rng: random.Random) -> Prompt:
        return self.train[rng.randrange(len(self.train))]

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self.held_out[:n]

    def reward(self, prompt: Prompt, text: str) -> float:
        if self.reward_fn is not None:
            return self.reward_fn(prompt, text)
        if self.match == "exact":
            return float(text.strip() == prompt.answer.strip())
        got = final_number(text)
        return float(got is not None and got == final_number(prompt.answer))

    def score(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list[float]:
        return [self.reward(p, c.text) for p, c in zip(prompts, completions, strict=True)]


class JsonlTask(RecordsTask):
    def __init__(self, path: str | Path = SAMPLE, *, match: Match = "number", reward: str = "",
                 eval_path: str | Path | None = None, eval_size: int = 0) -> None:
        super().__init__(match=match, reward=reward)
        records = load_jsonl(path, self.check)
        if eval_path:
            self.train, self.held_out = records, load_jsonl(eval_path, self.check)
        else:
            self.hold_out(records, eval_size, f"jsonl: {path}", "task.jsonl.eval_path")
