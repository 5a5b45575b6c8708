"""The worker's side of a layer-granular update: one announce per layer group, each group
committed by the engine as soon as it is staged and verified on every rank.

A ``commit_unit="layer"`` update of version v arrives as ``parts`` announces (group 0, 1, ...
in the order of ``inflight.layer_groups``), each with its own buckets. For each group the
listener receives, verifies (checksums, finite check) and prepares it exactly like a whole
version, then hands it to the engine (``CommitTarget.begin_commit``) without a ``Commit`` from
the trainer: the engine's coordinator commits it at the next step boundary once every rank
handed it over. The trainer gets one reply per group: ``Committed`` (with the label the
engine serves from then on) or ``Rejected``.

Ordering invariants:
- groups are taken in order: group k of v is accepted only after groups 0..k-1 of v were
  accepted and none failed; after a failure every later group of v is refused, so the
  engine serves the hybrid of the groups that committed (each verified) and the next
  update completes the model;
- at most ``window`` groups are staged on this rank: with 2, group k+1 arrives while group
  k waits for its step boundary; group k's outcome is read before group k+1 is handed over
  (one commit in the engine's hands at a time), and with 1 before group k+1 is accepted.
  The trainer sends a group only once every rank accepted it, so its sending is paced by
  the engine's commits and staging never grows with the model;
- a group that arrived whole but fails its check or preparation is refused and never goes
  live; groups handed over before it still commit (the engine may already have).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from inflight.protocol import Accepted, Committed, UpdateAnnounce
from inflight.staging import StagedVersion
from inflight.transport.errors import UpdateRejected
from inflight.transport.stream_check import CommitFailed


@dataclass
class _Handed:
    """A group handed to the engine whose outcome this rank has not read yet."""

    seq: int
    announce: UpdateAnnounce
    pending: Any  # the target's handle (``EngineTarget.PendingCommit``)
    first_step: int


class LayerUpdates:
    """The layer-granular updates of one listener (see the module docstring)."""

    def __init__(self, listener: Any, window: int) -> None:
        """``listener``: the ``UpdateListener`` this serves (its group, control, pool, receiver, target)."""
        if window not in (1, 2):
            raise ValueError(f"staged_groups={window} must be 1 or 2")
        self.listener = listener
        self.window = window
        self.version = -1
        self.next_part = 0
        self.failed = ""
        self.handed: deque[_Handed] = deque()

    def on_announce(self, seq: int, a: UpdateAnnounce) -> None:
        """Take group ``a.part`` of ``a.version``: check, accept, receive, prepare, hand over."""
        lis = self.listener
        lis._drop()  # a whole version staged but never committed is superseded
        if a.part == 0 or a.version != self.version:
            self.settle(keep=0)  # what is left of the last update
            self.version, self.next_part, self.failed = a.version, 0, ""
        if self.window == 1:
            self.settle(keep=0)  # room for one group: the last one is live before this one lands
        error = self._out_of_order(a) or lis._check_announce(a)
        if error is None and (why := lis.receiver.fits(a)) is not None:
            error = UpdateRejected("no_memory", why)
        flat = None
        if error is None:
            try:
                flat = lis.pool.take(a.total_bytes)
            except (RuntimeError, MemoryError) as e:
                error = UpdateRejected("no_memory", f"group {a.part} of v{a.version}: no staging buffer of "
                                                    f"{a.total_bytes} B: {e}")
        if error is not None:
            self.settle(keep=0)  # the groups before it go live (or fail) and are answered first
            self._refuse(seq, a, error, phase="ack")
            lis.receiver.receive_abort(a.version)
            return
        lis.control.reply(seq, Accepted(rank=lis.group.rank, version=a.version))
        staged = self._receive(seq, a, flat)
        if staged is None:
            return
        self.settle(keep=0)  # the engine takes one group at a time: the one before goes live first
        if self.failed:  # it did not: this group may not go live over it
            lis.pool.give(flat)
            lis.target.discard()
            self._refuse(seq, a, UpdateRejected("incomplete", f"group {a.part - 1} of v{a.version} did not commit"))
            return
        pending = lis.target.begin_commit(a.version, staged, lis.pool, a.part, a.parts)
        self.handed.append(_Handed(seq, a, pending, staged.first_bucket_step))
        self.next_part = a.part + 1
        if self.next_part == a.parts:
            self.settle(keep=0)  # the last group: the update ends with every outcome relayed

    def _receive(self, seq: int, a: UpdateAnnounce, flat: Any) -> StagedVersion | None:
        """Receive, verify and prepare the group (``UpdateListener.receive_update``); None if refused."""
        lis = self.listener
        error, staged = lis.receive_update(a, flat)
        if error is not None:
            self.settle(keep=0)  # the group before it is in the engine's hands: let it land first
            lis.pool.give(flat)
            lis.target.discard()
            # every rank accepted it, so the others may hand it over: their coordinator hears now
            lis.target.refuse_commit(a.version, a.part, a.parts, f"[{error.code}] {error.reason}")
            if error.code != "aborted":
                self._refuse(seq, a, error)
            else:
                self.failed = error.reason
                lis.stats.note_abort(a.version, error.reason)
            return None
        return staged

    def settle(self, keep: int) -> None:
        """Read the outcomes of the groups handed over until ``keep`` remain, replying to each."""
        lis = self.listener
        while len(self.handed) > keep:
            h = self.handed.popleft()
            a = h.announce
            try:
                info = lis.target.finish_commit(h.pending)
            except CommitFailed as e:
                lis.target.discard()
                self._refuse(h.seq, a, UpdateRejected("commit_failed", str(e)))
                continue
            if a.part + 1 == a.parts:
                lis.stats.committed += 1
            lis.control.reply(h.seq, Committed(
                rank=lis.group.rank, version=a.version, step=info.step, commit_ms=info.commit_ms,
                steps_since_first_bucket=max(0, info.step - h.first_step), tokens_at_commit=info.tokens_at_commit,
                part=a.part, parts=a.parts, label=info.label), phase="staged")

    def abort(self, version: int, reason: str) -> None:
        """The trainer called ``version`` off: no further group of it is taken."""
        if version == self.version and not self.failed:
            self.failed = f"aborted by the trainer: {reason}"

    def _out_of_order(self, a: UpdateAnnounce) -> UpdateRejected | None:
        if self.failed:
            return UpdateRejected("incomplete", f"group {a.part} of v{a.version} after the update stopped: {self.failed}")
        if a.part != self.next_part:
            return UpdateRejected("bucket_order", f"group {a.part} of v{a.version}, expected group {self.next_part}")
        return None

    def _refuse(self, seq: int, a: UpdateAnnounce, error: UpdateRejected, phase: str = "staged") -> None:
        if not self.failed:
            self.failed = f"group {a.part}: [{error.code}] {error.reason}"
        self.listener._reject(seq, a.version, error.code, f"group {a.part} of {a.parts}: {error.reason}",
                              phase=phase)  # type: ignore[arg-type]

