"""Worker side of a weight update: a state machine that stages while the engine decodes.

``UpdateListener.run`` is the body of one background thread per engine worker. It reads
control messages in order, lands buckets in a staging buffer, and hands a complete,
verified version to a ``CommitTarget``, which swaps it in at a step boundary.

Ordering invariants:
- live weights are touched only by ``CommitTarget.commit``, only for a version whose every
  bucket arrived and matched its checksum, and only after the trainer's ``Commit``;
- a version is accepted only if it is newer than the live one and matches the schema
  (names, shapes, dtypes) exactly, so nothing unknown, missing or mis-shaped is staged;
- any failure before the commit drops the staging buffer and leaves the last good version
  live; a commit that fails restores the previous weights before replying ``Rejected``;
- on ``Commit`` the staged version is handed to the target, which owns it from then on
  (``CommitTarget.commit``): the listener never touches the live version or the rollback
  copy, so losing the trainer between its ``Commit`` and the outcome leaves both right;
- the rollback copy belongs to the worker's ``StagingPool``, not to one listener, so a
  listener of the group's next generation can still roll back to the live version;
- on ``Shutdown`` the worker lets go of the trainer's store before it answers ``Left``
  (``leave``), so the trainer can close its store without a peer's read failing.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from inflight.protocol import (
    Abort,
    Accepted,
    AuthError,
    Commit,
    Committed,
    Left,
    ProtocolError,
    Rejected,
    RejectCode,
    ShardPlan,
    Shutdown,
    Staged,
    UpdateAnnounce,
)
from inflight.staging import StagedVersion, StagingPool
from inflight.transport.receiver import BucketReceiver
from inflight.transport.control import Phase, WorkerControl
from inflight.transport.errors import TransportError, UpdateRejected
from inflight.transport.group import WeightGroup
from inflight.transport.layer_listener import LayerUpdates
from inflight.transport.stream_check import CommitFailed, CommitInfo, CommitTarget, Streamed, nonfinite
from inflight.transport.layout import TensorSchema

__all__ = ["CommitFailed", "CommitInfo", "CommitTarget", "ListenerStats", "UpdateListener"]

log = logging.getLogger("inflight.listener")


@dataclass
class ListenerStats:
    """Counters of one worker, kept across the group generations it serves."""

    committed: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    last_error: str = ""
    rejoins: int = 0
    """Times the worker joined a new generation after losing its group."""
    dropped_staging: int = 0
    """Versions staged (or half received) and then discarded because the group failed."""
    aborted: int = 0
    """Updates the trainer called off after this worker accepted them (another worker refused
    one, or the trainer's source failed mid-stream: a sharded trainer's rank died)."""

    def note_abort(self, version: int, reason: str) -> None:
        """An update this worker accepted was called off by the trainer."""
        self.aborted += 1
        self.last_error = f"[aborted] v{version}: {reason}"


class UpdateListener:
    """One worker's update loop. ``run`` blocks; start it in a daemon thread."""

    def __init__(
        self, group: WeightGroup, target: CommitTarget, schema: TensorSchema | None, *,
        stale_timeout_s: float = 60.0, check_finite: bool = True, stats: ListenerStats | None = None,
        pool: StagingPool | None = None, plan: ShardPlan | None = None, staged_groups: int = 2,
    ) -> None:
        self.group = group
        self.target = target
        self.schema = schema
        self.stale_timeout_s = stale_timeout_s
        self.check_finite = check_finite
        self.control = WorkerControl(group)
        self.pool = pool if pool is not None else StagingPool(group.device)
        self.plan = plan
        """This worker's shard plan (sent in its hello): a point-to-point announce must follow it."""
        self.receiver = BucketReceiver(group, self.pool.windows)
        self._staged: StagedVersion | None = None
        self.layers = LayerUpdates(self, staged_groups)
        """Layer-granular updates (announces with ``parts``), ``staged_groups`` groups staged at most."""
        self.stats = stats if stats is not None else ListenerStats()
        self.trainer_left = False
        """The trainer said ``Shutdown`` (and this worker answered ``Left``)."""

    # -- the loop ---------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Serve until ``Shutdown`` or ``stop``; a transport failure drops staging and raises."""
        try:
            while not stop.is_set():
                timeout = None if self._staged is None else self.stale_timeout_s
                try:
                    seq, msg = self.control.next(timeout, stop)
                except ProtocolError as e:  # unreadable or unauthenticated: refused, and the data plane kept in step
                    code: RejectCode = "unauthenticated" if isinstance(e, AuthError) else "bad_message"
                    self._reject(seq=self.control.seq - 1, version=self.target.live_version, code=code, reason=str(e))
                    self.receiver.receive_abort(self.target.live_version)
                    continue
                if isinstance(msg, UpdateAnnounce) and msg.parts:
                    self.layers.on_announce(seq, msg)
                elif isinstance(msg, UpdateAnnounce):
                    self.layers.settle(keep=0)
                    self._on_announce(seq, msg)
                elif isinstance(msg, Commit):
                    self._on_commit(seq, msg)
                elif isinstance(msg, Abort):
                    self.layers.abort(msg.version, msg.reason)
                    if self._staged is not None and self._staged.announce.version == msg.version:
                        log.info("rank %d: v%d aborted by the trainer: %s", self.group.rank, msg.version, msg.reason)
                        self.stats.note_abort(msg.version, msg.reason)
                        self._drop()
                elif isinstance(msg, Shutdown):
                    self._leave(seq, msg.reason)
                    return
            self._say_left()
        except InterruptedError:
            self._say_left()
            return
        except TransportError as e:
            # The trainer vanished or stalled mid-update: nothing staged may go live, and the
            # caller rejoins the group's next generation.
            if self._staged is not None:
                self.stats.dropped_staging += 1
            self._drop()
            self.stats.last_error = f"[transport] {e}"
            raise

    def _on_announce(self, seq: int, a: UpdateAnnounce) -> None:
        self._drop()  # a new announce supersedes anything staged but not committed
        error = self._check_announce(a)
        if error is None and (why := self.receiver.fits(a)) is not None:
            error = UpdateRejected("no_memory", why)
        flat = None
        if error is None:
            try:  # before Accepted: a buffer that cannot be had refuses the update, not the group
                flat = self._buffer(a.total_bytes)
            except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                error = UpdateRejected("no_memory", f"v{a.version}: no staging buffer of {a.total_bytes} B: {e}")
        if error is not None:
            self._reject(seq, a.version, error.code, error.reason)
            self.receiver.receive_abort(a.version)
            return
        self.control.reply(seq, Accepted(rank=self.group.rank, version=a.version))
        t0 = time.perf_counter()
        error, staged = self.receive_update(a, flat)
        if error is not None:  # nothing live was touched
            self.pool.give(flat)
            self.target.discard()  # the tensors fed so far
            if error.code != "aborted":
                self._reject(seq, a.version, error.code, error.reason, phase="staged")
            else:  # refused by another worker first, or its source failed mid-stream
                self.stats.note_abort(a.version, error.reason)
            return
        self._staged = staged
        first = staged.first_bucket_step
        steps = self.target.steps() - first
        self.control.reply(seq, Staged(rank=self.group.rank, version=a.version,
                                       receive_ms=1e3 * (time.perf_counter() - t0), steps_during_transfer=steps), phase="staged")

    def receive_update(self, a: UpdateAnnounce, flat: torch.Tensor) -> tuple[UpdateRejected | None, StagedVersion]:
        """Receive ``a``'s buckets into ``flat``, checking and preparing its tensors as they
        verify: (why it is refused, or None; the staged version). A transport failure gives
        ``flat`` back, drops what was prepared and raises (half received: the bytes are unused)."""
        first_step: list[int] = []
        stream = Streamed(self.target, a, flat, self.check_finite)
        error: UpdateRejected | None
        try:
            self.receiver.receive(a, flat, on_bucket=lambda i: first_step.append(self.target.steps()) if i == 0 else None,
                                  on_verified=stream.verified)
            error = stream.finish()
        except UpdateRejected as e:
            error = e
        except TransportError:
            self.pool.give(flat)
            self.target.discard()
            self.stats.dropped_staging += 1
            raise
        first = first_step[0] if first_step else self.target.steps()  # an update of no bytes has no bucket
        return error, StagedVersion(a, flat, first, stream.views)

    def _on_commit(self, seq: int, c: Commit) -> None:
        staged = self._staged
        if staged is None or staged.announce.version != c.version:
            have = "nothing" if staged is None else f"v{staged.announce.version}"
            self._reject(seq, c.version, "incomplete", f"commit of v{c.version} but {have} is fully staged")
            return
        self._staged = None  # the target's from here on, whatever the outcome
        try:
            info = self.target.commit(c.version, staged, self.pool)
        except CommitFailed as e:
            self.target.discard()  # the engine's window is over (or never opened): nothing reads what prepare built
            self._reject(seq, c.version, "commit_failed", str(e))
            return
        # (the commit consumed what prepare built: nothing to discard)
        self.stats.committed += 1
        self.control.reply(seq, Committed(
            rank=self.group.rank, version=c.version, step=info.step, commit_ms=info.commit_ms,
            steps_since_first_bucket=max(0, info.step - staged.first_bucket_step), tokens_at_commit=info.tokens_at_commit,
        ))

    def _leave(self, seq: int, reason: str) -> None:
        """The trainer is leaving: release every hold on its store, answer ``Left`` (the last
        read or write of it), and say so once."""
        self._drop()
        self.target.leave()
        self.group.stop_beating()
        self.control.reply(seq, Left(rank=self.group.rank))
        self.trainer_left = True
        log.warning("inflight: rank %d: the trainer left (%s); serving v%d until a new trainer comes", self.group.rank,
                    reason or "no reason given", self.target.live_version)

    def _say_left(self) -> None:
        """The engine stops first: tell the trainer, so its goodbye does not wait for this worker."""
        try:
            key = f"left/{self.group.rank}"
            self.group.store.set(key, b"1")
        except (RuntimeError, AttributeError):  # the trainer is gone too
            pass

    # -- helpers ----------------------------------------------------------------------
    _nonfinite = staticmethod(nonfinite)

    def _check_announce(self, a: UpdateAnnounce) -> UpdateRejected | None:
        if a.version <= self.target.live_version:
            note = " (versions start at 1: 0 names the weights the engine loaded)" if a.version == 0 else ""
            return UpdateRejected("stale_version", f"v{a.version} is not newer than the live v{self.target.live_version}{note}")
        return self.schema.check(a, self.plan) if self.schema is not None else None

    def _buffer(self, nbytes: int) -> torch.Tensor:
        return self.pool.take(nbytes)

    def _drop(self) -> None:
        if self._staged is not None:
            self.pool.give(self._staged.flat)
            self._staged = None
            self.target.discard()

    def _reject(self, seq: int, version: int, code: RejectCode, reason: str, phase: Phase = "ack") -> None:
        self.stats.rejections[code] = self.stats.rejections.get(code, 0) + 1
        self.stats.last_error = f"[{code}] {reason}"
        log.warning("rank %d: refused v%d: [%s] %s", self.group.rank, version, code, reason)
        self.control.reply(seq, Rejected(rank=self.group.rank, version=version, code=code, reason=reason,
                                         live_version=self.target.live_version), phase=phase)
