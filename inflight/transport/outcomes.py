"""What a push laid out (``Packed``) and what it came to (``PushResult``, ``PushRejected``):
shared by whole-model pushes (``inflight.transport.pusher``) and layer-granular ones
(``inflight.transport.layer_pusher``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from inflight.protocol import Committed, Rejected, ReplyMessage, Staged, UpdateAnnounce
from inflight.transport.sender import SendStats
from inflight.transport.sources import ShardedSource


@dataclass(frozen=True)
class Packed:
    """An update laid out: ``{None: announce}`` (broadcast) or ``{rank: announce}`` (each worker
    its own), and what its buckets are read from: the caller's tensors by name, or a sharded
    source that gathers them."""

    announces: dict[int | None, UpdateAnnounce]
    source: Mapping[str, torch.Tensor] | ShardedSource
    groups: tuple[dict[int | None, UpdateAnnounce], ...] = ()
    """A layer-granular update: one layout per layer group (``announces`` is the first)."""

    @property
    def sharded(self) -> ShardedSource | None:
        return self.source if isinstance(self.source, ShardedSource) else None

    @property
    def version(self) -> int:
        return next(iter(self.announces.values())).version


class PushRejected(RuntimeError):
    """At least one worker refused the update; the engines keep their last good version."""

    def __init__(self, version: int, phase: str, rejections: dict[int, Rejected]) -> None:
        detail = "; ".join(f"worker rank {r}: [{m.code}] {m.reason}" for r, m in sorted(rejections.items()))
        super().__init__(f"update v{version} refused at {phase}: {detail}")
        self.version = version
        self.phase = phase
        self.rejections = rejections

    @property
    def codes(self) -> set[str]:
        return {m.code for m in self.rejections.values()}


@dataclass(frozen=True)
class PushResult:
    version: int
    send: SendStats
    staged: dict[int, Staged]
    commits: dict[int, Committed]
    stage_wait_s: float
    commit_wait_s: float
    groups: tuple[dict[int, Committed], ...] = ()
    """A layer-granular update: every rank's ``Committed`` for each layer group, in order."""

    @property
    def stall_ms(self) -> float:
        """What the engine spent committing (lowest rank): the commit, or every group's."""
        commits = self.groups or (self.commits,)
        return sum(c[min(c)].commit_ms for c in commits)

    @property
    def step(self) -> int:
        """Engine step after which ``version`` went live (lowest rank's engine)."""
        return self.commits[min(self.commits)].step


def _split(replies: dict[int, ReplyMessage], want: type) -> tuple[dict[int, object], dict[int, Rejected]]:
    good = {r: m for r, m in replies.items() if isinstance(m, want)}
    bad = {r: m for r, m in replies.items() if isinstance(m, Rejected)}
    odd = {r: m for r, m in replies.items() if r not in good and r not in bad}
    if odd:
        raise RuntimeError(f"protocol violation: expected {want.__name__}, got {odd}")
    return good, bad


