"""A step's samples cut into micro-batches under ``optim.micro_batch_tokens``.

Samples stay whole and in the batch's order; a micro-batch is a run of consecutive rows. Its
tokens are counted as its layout holds them: padded rows count their padding, packed samples
their input tokens, and a prefix-shared sample only what it adds to its group's prefix tree.
A sample longer than the budget is a micro-batch of its own. On several trainer ranks every
rank runs the same number of passes (FSDP's and expert parallelism's collectives pair up):
``plan`` splits micro-batches, then adds empty ones, to reach ``passes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from inflight.protocol import RolloutSample
from inflight.settings import Packing
from inflight.trainer.packed_batch import added_tokens


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``start..stop`` of the step's batch, holding ``tokens`` as laid out (an empty one,
    ``start == stop``, is a pass that only joins the ranks' collectives)."""

    start: int
    stop: int
    tokens: int

    @property
    def empty(self) -> bool:
        return self.start == self.stop


def _inputs(s: RolloutSample) -> np.ndarray:
    return np.asarray([*s.prompt_ids, *s.token_ids[:-1]], dtype=np.int64)


class _Tally:
    """The tokens of a run of rows as ``packing`` lays them out, grown one sample at a time."""

    def __init__(self, packing: Packing) -> None:
        self.packing, self.rows, self.prompt, self.completion, self.total = packing, 0, 0, 0, 0
        self.seen: dict[int, list[np.ndarray]] = {}

    def adding(self, s: RolloutSample, group: int) -> int:
        """The tokens with ``s`` added (nothing is added yet)."""
        if self.packing == "padded":
            return (self.rows + 1) * (max(self.prompt, len(s.prompt_ids)) + max(self.completion, len(s.token_ids)))
        return self.total + added_tokens(_inputs(s), self.seen.get(group, []), self.packing == "prefix_shared")

    def add(self, s: RolloutSample, group: int) -> None:
        self.total = self.adding(s, group)
        self.rows += 1
        self.prompt, self.completion = max(self.prompt, len(s.prompt_ids)), max(self.completion, len(s.token_ids))
        self.seen.setdefault(group, []).append(_inputs(s))


def layout_tokens(samples: Sequence[RolloutSample], groups: Sequence[int], packing: Packing) -> int:
    """The tokens ``samples`` (with their group indices ``groups``) hold as ``packing`` lays them out."""
    tally = _Tally(packing)
    for s, g in zip(samples, groups):
        tally.add(s, g)
    return tally.total


def plan(samples: Sequence[RolloutSample], groups: Sequence[int], packing: Packing, budget: int,
         passes: int | None = None) -> list[MicroBatch]:
    """``samples`` (the batch's rows; ``groups[i]`` the group of row i) cut greedily into runs
    under ``budget`` tokens; with ``passes``, exactly that many micro-batches."""
    out: list[MicroBatch] = []
    start, tally = 0, _Tally(packing)
    for i, (s, g) in enumerate(zip(samples, groups)):
        if tally.rows and tally.adding(s, g) > budget:
            out.append(MicroBatch(start, i, tally.total))
            start, tally = i, _Tally(packing)
        tally.add(s, g)
    if tally.rows:
        out.append(MicroBatch(start, len(samples), tally.total))
    if passes is None:
        return out
    if passes < len(out):
        raise ValueError(f"{len(out)} micro-batches do not fit in {passes} passes")
    while len(out) < passes:
        widest = max(range(len(out)), key=lambda j: out[j].stop - out[j].start) if out else -1
        if widest < 0 or out[widest].stop - out[widest].start < 2:
            out.append(MicroBatch(len(samples), len(samples), 0))
            continue
        mb = out[widest]
        mid = (mb.start + mb.stop) // 2
        halves = [MicroBatch(a, b, layout_tokens(samples[a:b], groups[a:b], packing))
                  for a, b in ((mb.start, mid), (mid, mb.stop))]
        out[widest:widest + 1] = halves
    return out
