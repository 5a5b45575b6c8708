"""``arithmetic``: integer expressions with a verifiable answer, difficulty by settings.

``What is 47 + 8? Answer with just the number.`` -> reward 1 if the completion's final
number (``base.final_number``: the last number, or the one after ``####``) equals the
value, else 0. Difficulty: ``digits`` (every operand has exactly this many digits; 1 means
0-9), ``terms`` (operands per expression), ``ops`` (any of ``+ - *``, evaluated left to
right with the usual precedence of ``*``).

The held-out set is drawn once from its own seed, and ``sample`` never returns one of its
problems, so evaluation measures problems the policy was never trained on.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from inflight.trainer.tasks.task import Completion, Prompt, Task, final_number

EVAL_SEED = 0x5EED_E7A1
OPS = ("+", "-", "*")


class Arithmetic(Task):
    def __init__(self, *, digits: int = 1, terms: int = 2, ops: Sequence[str] = ("+",),
                 template: str = "What is {expr}? Answer with just the number.", eval_size: int = 0) -> None:
        if digits < 1 or terms < 2:
            raise ValueError(f"arithmetic: digits={digits} must be >= 1 and terms={terms} >= 2")
        if not ops or set(ops) - set(OPS):
            raise ValueError(f"arithmetic: ops={list(ops)} must be a non-empty subset of {list(OPS)}")
        if "{expr}" not in template:
            raise ValueError(f"arithmetic: template={template!r} has no {{expr}} placeholder")
        self.lo, self.hi = (0 if digits == 1 else 10 ** (digits - 1)), 10 ** digits - 1
        self.terms, self.ops, self.template = terms, tuple(ops), template
        space = (self.hi - self.lo + 1) ** terms * len(self.ops) ** (terms - 1)
        if eval_size > space // 2:
            raise ValueError(f"arithmetic: eval.prompts={eval_size} would hold out more than half of the "
                             f"{space} distinct problems at digits={digits}, terms={terms}, ops={list(ops)}")
        self._eval = self._draw_distinct(random.Random(EVAL_SEED), eval_size)
        self._held_out = {p.meta["expr"] for p in self._eval}

    def _problem(self, rng: random.Random) -> Prompt:
        numbers = [rng.randint(self.lo, self.hi) for _ in range(self.terms)]
        ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
        expr = str(numbers[0]) + "".join(f" {op} {n}" for op, n in zip(ops, numbers[1:]))
        value = eval(expr, {"__builtins__": {}})  # digits and + - * only, built above
        return Prompt(self.template.format(expr=expr), str(value), meta={"expr": expr})

    def _draw_distinct(self, rng: random.Random, n: int) -> list[Prompt]:
        seen: dict[str, Prompt] = {}
        while len(seen) < n:
            p = self._problem(rng)
            seen.setdefault(p.meta["expr"], p)
        return list(seen.values())

    def sample(self, rng: random.Random) -> Prompt:
        while True:
            p = self._problem(rng)
            if p.meta["expr"] not in self._held_out:
                return p

    def eval_prompts(self, n: int) -> list[Prompt]:
        if n > len(self._eval):
            raise ValueError(f"arithmetic: {n} eval prompts asked, {len(self._eval)} held out")
        return self._eval[:n]

    def score(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list[float]:
        return [float(final_number(c.text) == p.answer) for p, c in zip(prompts, completions, strict=True)]
