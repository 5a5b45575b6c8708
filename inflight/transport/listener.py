"""Worker side of a weight update: a state machine that stages while the engine decodes.

``UpdateListener.run``, one background thread per engine worker, reads control messages in order, lands buckets in a
staging buffer, checks and prepares each tensor as its bucket verifies (``StreamPreparer``) and hands a verified
version, or layer group (``_on_layer_announce``), to a ``CommitTarget``, which swaps it in at a step boundary.

Ordering invariants:
- live weights are touched only by ``CommitTarget.commit``, only for a version whose every bucket arrived and
  matched its checksum, and only after the trainer's ``Commit``; the target then owns the staged version: the
  listener never touches the live version or the rollback copy (the worker's ``StagingPool`` holds it, not one
  listener), so losing the trainer between its ``Commit`` and the outcome leaves both right;
- a version is accepted only if newer than the live one and matching the schema (names, shapes, dtypes);
- a failure before the commit drops the staging buffer and leaves the last good version live; a commit that
  fails restores the previous weights before replying ``Rejected``; on ``Shutdown`` the worker lets go of
  the trainer's store before it answers ``Left`` (``leave``);
- layer path: group k of v is accepted only after groups 0..k-1 of v were and none failed; after a failure
  every later group of v is refused (the engine serves the hybrid of the verified groups that committed). At
  most ``staged_groups`` groups are staged on this rank, and group k's outcome is read before k+1 is handed
  over (one commit in the engine's hands at a time; with 1, before k+1 is accepted). A group that fails its
  check or preparation never goes live; those handed over before it still commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from inflight.engine.commit.base import CommitFailed, CommitTarget
from inflight.protocol import (
    Abort,
    Accepted,
    AuthError,
    Commit,
    Committed,
    Left,
    ProtocolError,
    RejectCode,
    Rejected,
    ShardPlan,
    Shutdown,
    Staged,
    UpdateAnnounce,
)
from inflight.staging import StagedVersion, StagingPool
from inflight.transport.bucket import BucketReceiver, completed_by_bucket, tensor_views
from inflight.transport.delta import DeltaDecoder, base_mismatch, result_announce
from inflight.transport.errors import TransportError, UpdateRejected
from inflight.transport.group import Phase, WeightGroup, WorkerControl
from inflight.transport.schema import TensorSchema

__all__ = ["ListenerStats", "StreamPreparer", "UpdateListener",
           "nonfinite"]

log = logging.getLogger("inflight.listener")


class StreamPreparer:
    """One update's checks and preparation, bucket by bucket as the receive verifies them.

    Each tensor is handled once, when the bucket holding its last byte has passed its
    checksum (and every bucket before it): its finite check, then the target's
    ``prepare_part``, while the next bucket is on the wire. ``finish`` runs after the last
    bucket: ``prepare`` with every tensor. The first failure stops the feeding and is
    reported by ``finish``; the receive goes on regardless, keeping the group in step.

    A sparse update (``decoder``) is checked and prepared as the weights it rebuilds: each
    verified bucket's wire tensors are first decoded onto the base, and ``announce`` and
    ``views`` are the rebuilt weights' (``result_announce``)."""

    def __init__(self, target: CommitTarget, announce: UpdateAnnounce, flat: torch.Tensor, check_finite: bool,
                 decoder: DeltaDecoder | None = None) -> None:
        self.target, self.check_finite = target, check_finite
        self.decoder = decoder
        self.announce = announce if decoder is None else result_announce(announce)
        self.views = tensor_views(flat, announce.tensors) if decoder is None else decoder.result
        self._due = completed_by_bucket(announce.tensors, announce.buckets)
        self._error: UpdateRejected | None = None

    def verified(self, index: int) -> None:
        if self._error is not None:
            return
        names = self._due[index]
        if self.decoder is not None:
            try:
                names = self.decoder.decode(names)
            except UpdateRejected as e:
                self._error = e
                return
        self._take({name: self.views[name] for name in names})

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
        # no buckets at all (empty tensors, or nothing changed): check what there is
        if self._error is None and not self._due:
            try:
                names = list(self.views) if self.decoder is None else self.decoder.decode(list(self.decoder.wire))
            except UpdateRejected as e:
                return e
            self._take({name: self.views[name] for name in names})
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


@dataclass
class _Handoff:
    """A group handed to the engine whose outcome this rank has not read yet."""

    seq: int
    announce: UpdateAnnounce
    pending: Any  # the target's handle (``EngineTarget.PendingCommit``)
    first_step: int


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
        if staged_groups not in (1, 2):
            raise ValueError(f"staged_groups={staged_groups} must be 1 or 2")
        self._window = staged_groups
        """Layer-granular updates (announces with ``parts``): ``staged_groups`` groups staged at most."""
        self._layer_version = -1
        self._next_part = 0
        self._layer_failed = ""
        self._handed: deque[_Handoff] = deque()
        """Groups handed to the engine whose outcome this rank has not read yet."""
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
                    self._on_layer_announce(seq, msg)
                elif isinstance(msg, UpdateAnnounce):
                    self._settle_layers(keep=0)
                    self._on_announce(seq, msg)
                elif isinstance(msg, Commit):
                    self._on_commit(seq, msg)
                elif isinstance(msg, Abort):
                    self._abort_layers(msg.version, msg.reason)
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
        base = self.pool.base_for() if a.delta is not None else None
        if error is None and a.delta is not None and (why := base_mismatch(
                a, None if base is None else base.views, None if base is None else base.announce.version)):
            error = UpdateRejected("wrong_base", why)
        if error is None and (why := self.receiver.fits(a)) is not None:
            error = UpdateRejected("no_memory", why)
        flat = result = None
        if error is None:
            try:  # before Accepted: a buffer that cannot be had refuses the update, not the group
                flat = self._buffer(a.total_bytes)
                result = self._buffer(a.delta.result_bytes) if a.delta is not None else None
            except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
                if flat is not None:
                    self.pool.give(flat)
                error = UpdateRejected("no_memory", f"v{a.version}: no staging buffer of {a.total_bytes} B: {e}")
        if error is not None:
            self._reject(seq, a.version, error.code, error.reason)
            self.receiver.receive_abort(a.version)
            return
        self.control.reply(seq, Accepted(rank=self.group.rank, version=a.version))
        t0 = time.perf_counter()
        rebuild = None if a.delta is None else (result, base.views)  # type: ignore[union-attr]
        error, staged = self.receive_update(a, flat, rebuild)
        if error is not None:  # nothing live was touched
            self.pool.give(staged.flat)
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
                                       receive_ms=1e3 * (time.perf_counter() - t0), steps_during_transfer=steps),
                           phase="staged")

    def receive_update(self, a: UpdateAnnounce, flat: torch.Tensor,
                       rebuild: tuple[torch.Tensor, Mapping[str, torch.Tensor]] | None = None,
                       ) -> tuple[UpdateRejected | None, StagedVersion]:
        """Receive ``a``'s buckets into ``flat``, checking and preparing its tensors as they
        verify: (why it is refused, or None; the staged version, whose bytes the caller gives
        back if refused). A sparse update (``rebuild``: the buffer its weights are rebuilt in,
        and the base's views) stages the rebuilt weights, and ``flat``, its wire bytes, goes
        back to the pool. A transport failure gives the buffers back, drops what was prepared
        and raises (half received: the bytes are unused)."""
        first_step: list[int] = []
        decoder = None if rebuild is None else DeltaDecoder(a, flat, rebuild[0], rebuild[1])
        stream = StreamPreparer(self.target, a, flat, self.check_finite, decoder)
        error: UpdateRejected | None
        try:
            self.receiver.receive(a, flat,
                                  on_bucket=lambda i: first_step.append(self.target.steps()) if i == 0 else None,
                                  on_verified=stream.verified)
            error = stream.finish()
        except UpdateRejected as e:
            error = e
        except TransportError:
            self.pool.give(flat)
            if rebuild is not None:
                self.pool.give(rebuild[0])
            self.target.discard()
            self.stats.dropped_staging += 1
            raise
        first = first_step[0] if first_step else self.target.steps()  # an update of no bytes has no bucket
        if rebuild is not None:
            self.pool.give(flat)  # the wire bytes: the rebuilt weights are what stages
            flat = rebuild[0]
        return error, StagedVersion(stream.announce, flat, first, stream.views)

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
            steps_since_first_bucket=max(0, info.step - staged.first_bucket_step),
            tokens_at_commit=info.tokens_at_commit,
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

    # -- layer-granular updates (announces with ``parts``) --------------------------------
    def _on_layer_announce(self, seq: int, a: UpdateAnnounce) -> None:
        """Take group ``a.part`` of ``a.version``: check, accept, receive, prepare, hand over."""
        self._drop()  # a whole version staged but never committed is superseded
        if a.part == 0 or a.version != self._layer_version:
            self._settle_layers(keep=0)  # what is left of the last update
            self._layer_version, self._next_part, self._layer_failed = a.version, 0, ""
        if self._window == 1:
            self._settle_layers(keep=0)  # room for one group: the last one is live before this one lands
        error = self._layer_out_of_order(a) or self._check_announce(a)
        if error is None and (why := self.receiver.fits(a)) is not None:
            error = UpdateRejected("no_memory", why)
        flat = None
        if error is None:
            try:
                flat = self.pool.take(a.total_bytes)
            except (RuntimeError, MemoryError) as e:
                error = UpdateRejected("no_memory", f"group {a.part} of v{a.version}: no staging buffer of "
                                                    f"{a.total_bytes} B: {e}")
        if error is not None:
            self._settle_layers(keep=0)  # the groups before it go live (or fail) and are answered first
            self._refuse_layer(seq, a, error, phase="ack")
            self.receiver.receive_abort(a.version)
            return
        self.control.reply(seq, Accepted(rank=self.group.rank, version=a.version))
        staged = self._receive_layer(seq, a, flat)
        if staged is None:
            return
        self._settle_layers(keep=0)  # the engine takes one group at a time: the one before goes live first
        if self._layer_failed:  # it did not: this group may not go live over it
            self.pool.give(flat)
            self.target.discard()
            self._refuse_layer(seq, a, UpdateRejected("incomplete",
                                                      f"group {a.part - 1} of v{a.version} did not commit"))
            return
        pending = self.target.begin_commit(a.version, staged, self.pool, a.part, a.parts)
        self._handed.append(_Handoff(seq, a, pending, staged.first_bucket_step))
        self._next_part = a.part + 1
        if self._next_part == a.parts:
            self._settle_layers(keep=0)  # the last group: the update ends with every outcome relayed

    def _receive_layer(self, seq: int, a: UpdateAnnounce, flat: Any) -> StagedVersion | None:
        """Receive, verify and prepare the group (``UpdateListener.receive_update``); None if refused."""
        error, staged = self.receive_update(a, flat)
        if error is not None:
            self._settle_layers(keep=0)  # the group before it is in the engine's hands: let it land first
            self.pool.give(flat)
            self.target.discard()
            # every rank accepted it, so the others may hand it over: their coordinator hears now
            self.target.refuse_commit(a.version, a.part, a.parts, f"[{error.code}] {error.reason}")
            if error.code != "aborted":
                self._refuse_layer(seq, a, error)
            else:
                self._layer_failed = error.reason
                self.stats.note_abort(a.version, error.reason)
            return None
        return staged

    def _settle_layers(self, keep: int) -> None:
        """Read the outcomes of the groups handed over until ``keep`` remain, replying to each."""
        while len(self._handed) > keep:
            h = self._handed.popleft()
            a = h.announce
            try:
                info = self.target.finish_commit(h.pending)
            except CommitFailed as e:
                self.target.discard()
                self._refuse_layer(h.seq, a, UpdateRejected("commit_failed", str(e)))
                continue
            if a.part + 1 == a.parts:
                self.stats.committed += 1
            self.control.reply(h.seq, Committed(
                rank=self.group.rank, version=a.version, step=info.step, commit_ms=info.commit_ms,
                steps_since_first_bucket=max(0, info.step - h.first_step), tokens_at_commit=info.tokens_at_commit,
                part=a.part, parts=a.parts, label=info.label), phase="staged")

    def _abort_layers(self, version: int, reason: str) -> None:
        """The trainer called ``version`` off: no further group of it is taken."""
        if version == self._layer_version and not self._layer_failed:
            self._layer_failed = f"aborted by the trainer: {reason}"

    def _layer_out_of_order(self, a: UpdateAnnounce) -> UpdateRejected | None:
        if self._layer_failed:
            return UpdateRejected("incomplete", f"group {a.part} of v{a.version} after the update stopped: "
                                                f"{self._layer_failed}")
        if a.part != self._next_part:
            return UpdateRejected("bucket_order", f"group {a.part} of v{a.version}, expected group {self._next_part}")
        return None

    def _refuse_layer(self, seq: int, a: UpdateAnnounce, error: UpdateRejected, phase: str = "staged") -> None:
        if not self._layer_failed:
            self._layer_failed = f"group {a.part}: [{error.code}] {error.reason}"
        self._reject(seq, a.version, error.code, f"group {a.part} of {a.parts}: {error.reason}",
                              phase=phase)  # type: ignore[arg-type]

    # -- helpers ----------------------------------------------------------------------
    _nonfinite = staticmethod(nonfinite)

    def _check_announce(self, a: UpdateAnnounce) -> UpdateRejected | None:
        if a.version <= self.target.live_version:
            note = " (versions start at 1: 0 names the weights the engine loaded)" if a.version == 0 else ""
            return UpdateRejected("stale_version", f"v{a.version} is not newer than the live "
                                                   f"v{self.target.live_version}{note}")
        if self.schema is None:
            return None
        return self.schema.check(a if a.delta is None else result_announce(a), self.plan)

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
