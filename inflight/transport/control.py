"""Control plane on the group's TCPStore: numbered control messages and their replies.

Ordering invariant: the trainer posts message ``seq`` only after collecting every reply it
needs for earlier messages, and each worker reads messages strictly in ``seq`` order, so
both sides agree on the sequence without any further handshake. Keys:

- ``msg/<seq>``: a control message (``UpdateAnnounce``, ``Commit``, ``Abort``, ``Shutdown``),
  or ``ForEachRank`` when each worker's differs: worker ``rank`` reads ``msg/<seq>/<rank>``,
  written before the marker;
- ``rep/<seq>/<phase>/<rank>``: worker ``rank``'s reply to message ``seq`` (see ``Phase``).

With a shared secret (``INFLIGHT_SECRET``) every message and reply is sealed with an HMAC
over its bytes, its key and the group's incarnation and generation
(``inflight.protocol.seal``): a client of the store without the secret can neither forge
nor replay one. A message that fails the check is answered ``Rejected(unauthenticated)``.
"""

from __future__ import annotations

import threading
import time
from typing import Literal

from inflight.protocol import (
    ControlMessage,
    ForEachRank,
    ProtocolError,
    ReplyMessage,
    decode_control,
    decode_reply,
    encode,
)
from inflight.auth import seal, unseal
from inflight.transport.errors import GaveUp, TransportError, TransportTimeout, member
from inflight.transport.group import WeightGroup
from inflight.transport.store import wait_key

Phase = Literal["ack", "staged"]
"""An announce gets two replies: ``ack`` (accepted or not) and ``staged`` (buckets verified or not)."""


def _wait_key(group: WeightGroup, key: str, timeout_s: float | None, stop: threading.Event | None, what: str,
              give_up=None) -> bytes:
    return wait_key(group.store, key, timeout_s=timeout_s, stop=stop, what=what, who=f"rank {group.rank}", give_up=give_up)


class TrainerControl:
    """Rank 0's side: post control messages, collect replies from every worker."""

    def __init__(self, group: WeightGroup) -> None:
        if group.rank != 0:
            raise ValueError("TrainerControl belongs to rank 0")
        self.group = group
        self.seq = 0
        self._each: set[int] = set()  # messages posted per worker

    def post(self, msg: ControlMessage) -> int:
        seq = self.seq
        self._set(f"msg/{seq}", msg)
        self.seq += 1
        return seq

    def post_each(self, msgs: dict[int, ControlMessage]) -> int:
        """One message per worker (every member of the generation), under one number."""
        seq = self.seq
        for rank, msg in msgs.items():
            self._set(f"msg/{seq}/{rank}", msg)
        self._each.add(seq)
        return self.post(ForEachRank())

    def _set(self, key: str, msg: ControlMessage) -> None:
        self.group.store.set(key, seal(encode(msg), self.group.secret, self.group.auth_context(key)))

    def replies(self, seq: int, timeout_s: float, what: str, phase: Phase = "ack") -> dict[int, ReplyMessage]:
        """Each worker's reply to message ``seq``; raises naming the worker that stayed silent."""
        out: dict[int, ReplyMessage] = {}
        deadline = time.monotonic() + timeout_s
        for rank in self.group.peers:
            left = max(deadline - time.monotonic(), 0.001)
            key = f"rep/{seq}/{phase}/{rank}"
            try:
                raw = _wait_key(self.group, key, left, None, f"reply from worker rank {rank} to {what}")
            except TransportTimeout as e:
                raise TransportTimeout(str(e), ranks=(rank,)) from e
            out[rank] = self.read_reply(key, raw, f"worker rank {rank}'s reply to {what}")
        for rank in self.group.peers:
            self.group.store.delete_key(f"rep/{seq}/{phase}/{rank}")
        if seq > 0:  # every worker has read everything before ``seq``
            self.group.store.delete_key(f"msg/{seq - 1}")
            if seq - 1 in self._each:
                self._each.discard(seq - 1)
                for rank in self.group.peers:
                    self.group.store.delete_key(f"msg/{seq - 1}/{rank}")
        return out

    def read_reply(self, key: str, raw: bytes, what: str) -> ReplyMessage:
        """Authenticate and decode one reply; ``AuthError``/``ProtocolError`` name the reply."""
        try:
            return decode_reply(unseal(raw, self.group.secret, self.group.auth_context(key)))
        except ProtocolError as e:
            raise type(e)(f"{what}: {e}") from None


class WorkerControl:
    """A worker's side: read control messages in order, reply to each."""

    def __init__(self, group: WeightGroup) -> None:
        if group.rank == 0:
            raise ValueError("WorkerControl belongs to a worker rank")
        self.group = group
        self.seq = 0

    def next(self, timeout_s: float | None, stop: threading.Event | None = None) -> tuple[int, ControlMessage]:
        """The next message; ``timeout_s=None`` waits until one arrives or ``stop`` is set.

        Raises ``ProtocolError`` for an undecodable message, ``AuthError`` for one that fails
        authentication (its sequence number is consumed either way, so the worker can reply
        and stay in step with the trainer).
        """
        seq = self.seq
        # A worker dropped from its generation (it was stopped, or too slow) would wait here
        # forever: the trainer writes to the next generation's keys. It notices and rejoins.
        try:
            raw = _wait_key(self.group, f"msg/{seq}", timeout_s, stop, f"control message #{seq} from the trainer",
                            give_up=self.group.superseded)
        except GaveUp as e:
            raise GaveUp(f"{e}: the trainer opened a newer generation of the group") from None
        self.seq += 1
        msg = decode_control(unseal(raw, self.group.secret, self.group.auth_context(f"msg/{seq}")))
        if isinstance(msg, ForEachRank):  # this worker's own is there already
            key = f"msg/{seq}/{self.group.rank}"
            try:
                raw = self.group.store.get(key)
            except RuntimeError as e:
                raise TransportError(f"{member(self.group.rank)}: control message #{seq} for this rank: {e}") from e
            msg = decode_control(unseal(raw, self.group.secret, self.group.auth_context(key)))
        return seq, msg

    def reply(self, seq: int, msg: ReplyMessage, phase: Phase = "ack") -> None:
        key = f"rep/{seq}/{phase}/{self.group.rank}"
        self.group.store.set(key, seal(encode(msg), self.group.secret, self.group.auth_context(key)))
