"""``repeat_digit``: prompt ``repeat: D``, a completion made of the digit D (the CPU demo task).

Per completion token (up to ``completion_tokens``; tokens after end-of-sequence count 0):
``digit_credit`` if the token's text is all digits, 1.0 if it is all the digit D. The
reward is the mean over the positions, so it ranges over [0, 1]. It is checked by string
comparison only: verifiable, no learned judge. There are only ten prompts, so evaluation
runs on all ten and nothing is held out.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from inflight.trainer.tasks.task import Completion, Prompt, Task


class RepeatDigit(Task):
    def __init__(self, tokenizer: Any, completion_tokens: int, digit_credit: float = 0.5) -> None:
        self.tokenizer = tokenizer
        self.completion_tokens = completion_tokens
        self.digit_credit = digit_credit
        self._piece: dict[int, str] = {}

    def sample(self, rng: random.Random) -> Prompt:
        d = str(rng.randrange(10))
        return Prompt(f"repeat: {d}", d)

    def eval_prompts(self, n: int) -> list[Prompt]:
        return [Prompt(f"repeat: {d}", str(d)) for d in range(min(n, 10))]

    def _text(self, token_id: int) -> str:
        if token_id not in self._piece:
            self._piece[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=True).strip()
        return self._piece[token_id]

    def reward(self, prompt: Prompt, token_ids: Sequence[int]) -> float:
        score = 0.0
        for t in token_ids[: self.completion_tokens]:
            piece = self._text(t)
            if piece and piece.isdigit():
                score += 1.0 if set(piece) == {prompt.answer} else self.digit_credit
        return score / self.completion_tokens

    def score(self, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> list[float]:
        return [self.reward(p, c.token_ids) for p, c in zip(prompts, completions, strict=True)]
