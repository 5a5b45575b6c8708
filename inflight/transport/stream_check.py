"""What the listener hands a staged update to (``CommitTarget``), and the per-bucket checks and
preparation of an update as its buckets verify (``Streamed``): shared by whole-model updates
(``inflight.transport.listener``) and layer-granular ones (``inflight.transport.layer_listener``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from inflight.protocol import UpdateAnnounce
from inflight.staging import StagedVersion, StagingPool
from inflight.transport.errors import UpdateRejected
from inflight.transport.layout import completed_by_bucket, tensor_views


@dataclass(frozen=True)
class CommitInfo:
    step: int
    commit_ms: float
    tokens_at_commit: dict[str, int] = field(default_factory=dict)
    label: str = ""
    """The engine's version label after the commit (a hybrid after a layer group's)."""


class CommitFailed(RuntimeError):
    """The commit did not take; the target already restored the previous weights."""


class CommitTarget(Protocol):
    """What the listener commits into: an engine worker, or a plain dict in tests."""

    @property
    def live_version(self) -> int: ...

    def steps(self) -> int:
        """Engine steps run so far (monotone), to measure decoding during a transfer."""
        ...

    def prepare(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Do everything the commit can do ahead of time (off the critical path); live weights
        stay untouched. Raising refuses the update."""
        ...

    def prepare_part(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Called during the receive with each bucket's newly complete tensors (verified and
        finite, each once), so the target can do their share of ``prepare`` while later
        buckets are on the wire; ``prepare`` follows with every tensor. Raising refuses the
        update, like ``prepare``."""
        ...

    def discard(self) -> None:
        """Drop what ``prepare`` built (the update was aborted or superseded)."""
        ...

    def commit(self, version: int, staged: StagedVersion, pool: StagingPool) -> CommitInfo:
        """Make ``staged.views`` live at a step boundary; on failure restore the previous
        weights and raise ``CommitFailed``. ``staged`` is the target's from the call on: it
        gives its buffer back to ``pool`` once nothing needs it."""
        ...

    def leave(self) -> None:
        """Called on the trainer's ``Shutdown`` before the worker answers it: release whatever
        else of the worker's holds the trainer's store (the engine's coordinator)."""
        ...

    def begin_commit(self, version: int, staged: StagedVersion, pool: StagingPool, part: int = 0,
                     parts: int = 0) -> Any:
        """Layer-granular updates: hand group ``part`` over for the engine to commit at its next
        step boundary without waiting (``inflight.transport.layer_listener``); returns a handle."""
        ...

    def finish_commit(self, pending: Any) -> CommitInfo:
        """The outcome of a ``begin_commit``; ``CommitFailed`` if it did not go live."""
        ...

    def refuse_commit(self, version: int, part: int, parts: int, reason: str) -> None:
        """Layer-granular: this rank refused group ``part`` that the other ranks may hand over."""
        ...


class Streamed:
    """One update's checks and preparation, bucket by bucket as the receive verifies them.

    Each tensor is handled once, when the bucket holding its last byte has passed its
    checksum (and every bucket before it): its finite check, then the target's
    ``prepare_part``, while the next bucket is on the wire. ``finish`` runs after the last
    bucket: ``prepare`` with every tensor. The first failure stops the feeding and is
    reported by ``finish``; the receive goes on regardless, keeping the group in step."""

    def __init__(self, target: CommitTarget, announce: UpdateAnnounce, flat: torch.Tensor, check_finite: bool) -> None:
        self.target, self.check_finite = target, check_finite
        self.announce = announce
        self.views = tensor_views(flat, announce.tensors)
        self._due = completed_by_bucket(announce.tensors, announce.buckets)
        self._error: UpdateRejected | None = None

    def verified(self, index: int) -> None:
        if self._error is None:
            self._take({name: self.views[name] for name in self._due[index]})

    def _take(self, named: dict[str, torch.Tensor]) -> None:
        v = self.announce.version
        try:
            bad = nonfinite(named) if self.check_finite else None
            if bad is not None:
                self._error = UpdateRejected("nonfinite", f"v{v}: {bad} has NaN or Inf values")
            elif named:
                self.target.prepare_part(v, named)
        except Exception as e:  # the target's work failed: nothing live was touched
            self._error = UpdateRejected("prepare_failed", f"v{v}: {e!r}")

    def finish(self) -> UpdateRejected | None:
        if self._error is None and not self._due:
            self._take(self.views)  # no buckets at all (an update of empty tensors): check what there is
        if self._error is not None:
            return self._error
        try:
            self.target.prepare(self.announce.version, self.views)
        except Exception as e:
            return UpdateRejected("prepare_failed", f"v{self.announce.version}: {e!r}")
        return None


_FP8_NAN_BITS = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}
"""The bits that are all set in an FP8 NaN (e4m3fn has no inf) or non-finite (e5m2) value,
sign aside: torch has no ``isfinite`` or norm for FP8 tensors."""


def nonfinite(named: Mapping[str, torch.Tensor]) -> str | None:
    for name, t in named.items():
        if (bits := _FP8_NAN_BITS.get(t.dtype)) is not None and bool(((t.view(torch.uint8) & bits) == bits).any()):
            return name
    floats = [(name, t) for name, t in named.items() if t.is_floating_point() and t.dtype not in _FP8_NAN_BITS]
    if not floats:
        return None
    # One fused pass per bucket's tensors. The 2-norm is NaN or Inf whenever some element is, and runs
    # at memory speed (measured on 0.5 GB fp32, one core: 26 ms, where the inf-norm, exact
    # but not vectorised on CPU, took 466 ms). It can also overflow on finite values
    # (|x| ~ 1e19): the exact per-tensor search below then settles it, so nothing
    # non-finite passes and nothing finite is refused.
    norms = torch.stack(torch._foreach_norm([t for _, t in floats], 2))  # (n_tensors,)
    if bool(torch.isfinite(norms).all()):
        return None
    return next((name for name, t in floats if not bool(torch.isfinite(t).all())), None)
