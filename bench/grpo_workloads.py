"""What the requests of ``inflight.bench.grpo``'s groups hold (``--workload``).

- ``fresh``: every group has a fresh prompt of P random tokens. The prefix cache can help only
  among a group's 8 siblings, within one version, so exact invalidation never costs anything.
- ``system``: one system prompt of S tokens (``--system-tokens``), shared by every group, then
  a fresh question of P tokens per group. A group admitted after a commit must not be served
  the shared prefix's blocks of the earlier weights: each version prefills it once, and
  in-flight's exact invalidation, native's salt and native's reset all pay for that.
- ``multi-turn``: each of a group's 8 episodes runs ``--turns`` turns. A turn's prompt is the
  previous turn's prompt, its T sampled tokens and a fresh tool answer of R tokens
  (``--tool-tokens``), so a history grows across commits, and a turn admitted after one
  prefills its history again.

Every mode of a run sees the same prompts, system prompts and tool answers for a seed (the
sampled tokens differ). Pure: ``tests/unit/test_bench_grpo.py``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("fresh", "system", "multi-turn")


def random_tokens(key: str, length: int, vocab: int) -> list[int]:
    """``length`` token ids drawn from ``random.Random(key)``, clear of the low ids where
    tokenizers keep their special tokens (the top three quarters of a tiny vocabulary)."""
    rng = random.Random(key)
    low = min(256, vocab // 4)
    return [rng.randrange(low, vocab) for _ in range(length)]


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A workload of ``KINDS``, validated once; ``system_tokens`` only for ``system``,
    ``turns`` and ``tool_tokens`` only for ``multi-turn``."""

    kind: str = "fresh"
    """One of ``KINDS``."""
    system_tokens: int = 0
    """``system``: the shared system prompt's length, tokens (>= 1)."""
    turns: int = 1
    """``multi-turn``: turns per episode (>= 2)."""
    tool_tokens: int = 0
    """``multi-turn``: each tool answer's length, tokens (>= 1)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload {self.kind!r} is not one of {KINDS}")
        if (self.kind == "system") != (self.system_tokens > 0) or self.system_tokens < 0:
            raise ValueError(f"system_tokens={self.system_tokens}: >= 1 with workload 'system', 0 otherwise")
        multi = self.kind == "multi-turn"
        if ((multi and (self.turns < 2 or self.tool_tokens < 1))
                or (not multi and (self.turns, self.tool_tokens) != (1, 0))):
            raise ValueError(f"turns={self.turns}, tool_tokens={self.tool_tokens}: >= 2 and >= 1 with workload "
                             "'multi-turn', 1 and 0 otherwise")

    def first_prompt(self, seed: int, group: int, length: int, vocab: int) -> list[int]:
        """The prompt of group ``group``'s first turn: its question of ``length`` tokens, after
        the shared system prompt in ``system``."""
        question = random_tokens(f"{seed}/{group}", length, vocab)
        if self.kind == "system":
            return random_tokens(f"{seed}/system", self.system_tokens, vocab) + question
        return question

    def next_prompt(self, seed: int, group: int, episode: int, turn: int, prompt: list[int], sampled: list[int],
                    vocab: int) -> list[int] | None:
        """After turn ``turn`` (0-based) of an episode, whose ``prompt`` sampled ``sampled``:
        the next turn's prompt (the history and a fresh tool answer), or None when it was the last."""
        if turn + 1 >= self.turns:
            return None
        return prompt + sampled + random_tokens(f"{seed}/{group}/{episode}/{turn}/tool", self.tool_tokens, vocab)

    def max_len(self, prompt: int, completion: int) -> int:
        """The longest sequence a request of this workload holds: system, question, every turn's
        sampled tokens and tool answers."""
        return self.system_tokens + prompt + self.turns * completion + (self.turns - 1) * self.tool_tokens
