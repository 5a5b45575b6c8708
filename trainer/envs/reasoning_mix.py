"""``reasoning_gym``: a weighted mix of reasoning-gym's procedural datasets.

Each prompt is one entry of reasoning-gym's ``CompositeDataset`` (the datasets named in
``[task.reasoning_gym]``, drawn by weight): its question as the user turn, after one of
reasoning-gym's system prompts. The reward is the entry's own dataset's ``score_answer`` on
the text inside the completion's last ``<answer>...</answer>`` (reasoning-gym's
``extract_answer``), so it is exactly what reasoning-gym's evaluations give.

Training entries come from ``seed``, the held-out ones from ``eval_seed``. reasoning-gym seeds
entry ``i`` with ``seed + i``, so two seeds share entries: a training entry whose question is
held out is never sampled, nor is one of the worked examples (``examples``: entries of
``eval_seed + 7919`` asked and answered before the problem). Each prompt carries its entry in
``Prompt.meta["entry"]``, so a scoring process needs nothing but the prompt. Install with
``pip install 'inflight[reasoning_gym]'``.
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Mapping, Sequence
from typing import Any

from inflight.trainer.tasks.task import Completion, Prompt, Task


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("task.name = 'reasoning_gym' needs the reasoning-gym package: "
                          "pip install 'inflight[reasoning_gym]'") from None
    return reasoning_gym


def check_dataset_names(names: Sequence[str]) -> None:
    """Each name must be a dataset reasoning-gym registers; the error names the closest ones."""
    registered = sorted(_reasoning_gym().factory.DATASETS)
    for name in names:
        if name not in registered:
            close = difflib.get_close_matches(name, registered, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else f" ({len(registered)} are registered)"
            raise ValueError(f"task.reasoning_gym.datasets: {name!r} is not a reasoning-gym dataset{hint}")


def composite(names: Sequence[str], weights: Sequence[float], options: Mapping[str, Mapping[str, Any]],
              *, size: int, seed: int) -> Any:
    """reasoning-gym's ``CompositeDataset`` of ``names`` (``weights`` empty: equal), each
    configured by ``options[name]``; a bad option fails naming the dataset."""
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    check_dataset_names(names)
    weights = list(weights) or [1.0] * len(names)
    specs = [DatasetSpec(name, float(w), dict(options.get(name, {}))) for name, w in zip(names, weights, strict=True)]
    try:
        return CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs))
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"task.reasoning_gym: reasoning-gym refused the mix {list(names)} with options "
                         f"{dict(options)}: {type(e).__name__}: {e}") from None


EXAMPLES_SEED = 7_919
"""The worked examples' entries come from ``eval_seed + EXAMPLES_SEED``."""


class ReasoningGymTask(Task):
    """Prompts, held-out set and reward from reasoning-gym (see the module docstring)."""

    def __init__(self, *, datasets: Sequence[str], weights: Sequence[float] = (),
                 options: Mapping[str, Mapping[str, Any]] | None = None, size: int = 100_000, seed: int = 1,
                 eval_seed: int = 1_000_000, system_prompt: str = "default", examples: int = 0,
                 chat: bool = True, eval_size: int = 0) -> None:
        rg = _reasoning_gym()
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if system_prompt and system_prompt not in SYSTEM_PROMPTS:
            raise ValueError(f"task.reasoning_gym.system_prompt={system_prompt!r} is not one of "
                             f"{sorted(SYSTEM_PROMPTS)} (or empty: none)")
        self.system = SYSTEM_PROMPTS[system_prompt] if system_prompt else ""
        self.chat = chat
        self.train = composite(datasets, weights, options or {}, size=size, seed=seed)
        shots = composite(datasets, weights, options or {}, size=max(examples, 1), seed=eval_seed + EXAMPLES_SEED)
        self.examples = [shots[i] for i in range(examples)]
        if examples and not chat:
            raise ValueError(f"task.reasoning_gym.examples={examples}: worked examples are chat turns; the model has "
                             "no chat template (or task.chat = 'off'): set examples = 0")
        self.held_out = [self.to_prompt(e) for e in composite(datasets, weights, options or {},
                                                              size=max(eval_size, 1), seed=eval_seed)][:eval_size]
        self.held_questions = {p.meta["entry"]["question"] for p in self.held_out}
        self.unsampled = self.held_questions | {e["question"] for e in self.examples}
        """Never a training prompt: the held-out questions, and the worked examples' (answered in the prompt)."""
        self._extract = rg.utils.extract_answer

    def to_prompt(self, entry: Mapping[str, Any]) -> Prompt:
        """One entry as a prompt: chat turns, or (``chat`` off) the system prompt and question as text."""
        question = entry["question"]
        if not self.chat:
            return Prompt(text=f"{self.system}\n\n{question}" if self.system else question,
                          answer=str(entry["answer"]), meta={"entry": entry})
        turns: tuple[dict[str, str], ...] = ({"role": "system", "content": self.system},) if self.system else ()
        for shot in self.examples:
            turns += ({"role": "user", "content": shot["question"]},
                      {"role": "assistant", "content": f"<answer>{shot['answer']}</answer>"})
        return Prompt(messages=(*turns, {"role": "user", "content": question}), answer=str(entry["answer"]),
                      meta={"entry": entry})

    def sample(self, rng: random.Random) -> Prompt:
        """A random training entry; a held-out one (or an example's) gives way to the next that is not."""
        start = rng.randrange(self.train.size)
        for step in range(self.train.size):
            entry = self.train[(start + step) % self.train.size]
            if entry["question"] not in self.unsampled:
                return self.to_prompt(entry)
        raise ValueError(f"task.reasoning_gym: every one of the {self.train.size} training entries is a held-out "
                         "question or an example (a larger task.reasoning_gym.size, or fewer eval.prompts)")

    def eval_prompts(self, n: int) -> list[Prompt]:
        return self.held_out[:n]

    def reward(self, prompt: Prompt, text: str) -> float:
        """The entry's dataset's ``score_answer`` on the completion's ``<answer>`` text (0 without one)."""
        answer = self._extract(text)
        if answer is None:
            return 0.0
        return float(self.train.score_answer(answer, prompt.meta["entry"]))

    def score(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list[float]:
        return [self.reward(p, c.text) for p, c in zip(prompts, completions, strict=True)]
