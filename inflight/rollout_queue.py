"""The rollout queue: engines produce ``RolloutGroup``s, the trainer consumes them.

``RolloutQueue`` is a bounded FIFO on the weight group's TCPStore (torch.distributed), so it works on one
machine and across machines alike. ``RolloutBuffer`` is the trainer's end: it validates every group, drops
the malformed and the too stale (max-lag admission), and hands out batches.

Ordering invariants:
- items are consumed in the order their sequence numbers were claimed; one consumer;
- a producer claims a sequence number only while ``tail - head < capacity`` (several producers may overshoot
  by at most their number minus one), so a slow trainer stalls the engines instead of growing the queue;
- a claimed slot is filled exactly once, by ``compare_set`` (first writer wins): the producer's item, or the
  consumer's ``HOLE`` when the producer stalled or died between claim and write (``skip_stalled``); a producer
  that finds its slot holed re-puts the item under a new number: a frozen engine blocks no one, loses nothing;
- the buffer admits a group only if every token's version is within ``admit_lag`` of the trainer's, and (with
  ``mask_lag``, the loss's max lag) one token at least is within ``mask_lag``: a group the loss would mask
  whole is dropped as stale, not trained on as an empty batch. What it admitted but not yet handed out
  (``pending``) and its counters are saved in checkpoints: a resumed run neither repeats nor drops a sample;
- with a shared secret (``INFLIGHT_SECRET``) every item is sealed for its slot in this store's incarnation
  (the trainer's, published by the consumer; producers wait for it), so a client of the store without it
  cannot queue samples the trainer would train on, nor replay an item sealed for an earlier run's store.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec
from torch.distributed import Store

from inflight.auth import read_secret, seal, unseal
from inflight.protocol import (
    AuthError,
    EngineReport,
    ProtocolError,
    RolloutGroup,
    Sampling,
    decode_group,
    decode_report,
    encode,
)
from inflight.transport.errors import TransportTimeout
from inflight.transport.poll import poll_until
from inflight.transport.store import wait_key

_POLL_S = 0.002
HOLE = b"\x00hole"
"""What the consumer writes where a producer never wrote its item (never a valid msgpack group)."""


class RolloutQueue:
    """Both ends of the queue; ``put`` from engines, ``get`` from the single trainer."""

    def __init__(self, store: Store, capacity: int, *, secret: bytes | None | Literal["env"] = "env",
                 incarnation: str | None = None) -> None:
        """``incarnation``: the consumer passes its store's (``WeightGroup.incarnation``) and
        publishes it; producers leave it None and read the published one."""
        if capacity < 1:
            raise ValueError(f"RolloutQueue capacity={capacity} must be >= 1")
        self.store = store
        self.capacity = capacity
        self.secret = read_secret() if secret == "env" else secret
        self.incarnation = incarnation
        if incarnation is not None:
            store.set("incarnation", incarnation.encode())
        self._head = store.add("head", 0)  # consumer's next sequence number
        self._reports_read = 0  # consumer: reports taken so far

    def depth(self) -> int:
        return self.store.add("tail", 0) - self.store.add("head", 0)

    def publish_version(self, version: int) -> None:
        """Consumer: the version its next batch will be trained at (producers pace themselves by it)."""
        self.store.set("consumer_version", str(version))

    def consumer_version(self) -> int | None:
        """Producer: the consumer's last ``publish_version``; None before the first, or if unreadable
        (a stray client's bytes must not stop an engine)."""
        if not self.store.check(["consumer_version"]):
            return None
        try:
            return int(self.store.get("consumer_version"))
        except ValueError:
            return None

    def put(self, group: RolloutGroup, *, timeout_s: float | None = None, stop: threading.Event | None = None) -> int:
        """Enqueue; blocks while the queue is full. Returns the sequence number."""
        data = encode(group)
        while True:
            try:
                incarnation = poll_until(self._room, timeout_s=timeout_s, stop=stop, what="room in the rollout queue",
                                         who="rollout producer", max_pause_s=_POLL_S)
            except TransportTimeout:
                raise TimeoutError(f"rollout queue full ({self.capacity}) for {timeout_s:.1f}s, or no consumer: is the "
                                   "trainer alive?") from None
            seq = self.store.add("tail", 1) - 1
            sealed = seal(data, self.secret, f"rollout/{incarnation}/item/{seq}")
            if self.store.compare_set(f"item/{seq}", "", sealed) == sealed:
                return seq
            # the consumer holed this slot while we were stopped between claim and write: again

    def _room(self) -> str | None:
        """The incarnation to seal for, once there is room (and, with a secret, a consumer that
        published its incarnation); else None."""
        if self.depth() >= self.capacity:
            return None
        if self.secret is None:
            return ""
        return self.store.get("incarnation").decode() if self.store.check(["incarnation"]) else None

    def put_raw(self, data: bytes) -> int:
        """Enqueue bytes as they are (fault drills: the consumer must survive anything)."""
        seq = self.store.add("tail", 1) - 1
        self.store.set(f"item/{seq}", data)
        return seq

    def fill_holes(self) -> int:
        """Consumer: mark as lost every slot a producer claimed but has not written (``put``
        claims, then writes), so ``get`` does not wait for them forever. Call when no producer
        is live (after an engine died, before its restart samples)."""
        return sum(self._hole(seq) for seq in range(self._head, self.store.add("tail", 0)))

    def skip_stalled(self) -> bool:
        """Consumer: hole the head slot if it was claimed but is still empty while a later slot
        is already written (its producer stalled or died mid-put; the others moved on).
        True if it holed the slot; its producer, should it wake up, puts the item again."""
        tail = self.store.add("tail", 0)
        if tail <= self._head + 1 or self.store.check([f"item/{self._head}"]):
            return False
        if not any(self.store.check([f"item/{seq}"]) for seq in range(self._head + 1, tail)):
            return False
        return self._hole(self._head)

    def _hole(self, seq: int) -> bool:
        return self.store.compare_set(f"item/{seq}", "", HOLE) == HOLE

    def try_get(self) -> bytes | None:
        """The next item's bytes if it is already in the queue, else None (never waits)."""
        key = f"item/{self._head}"
        if not self.store.check([key]):
            return None
        return self._take(key)

    def _take(self, key: str) -> bytes:
        data = self.store.get(key)
        self.store.delete_key(key)
        self._head += 1
        self.store.add("head", 1)
        if data == HOLE:
            return data
        try:
            return unseal(data, self.secret, f"rollout/{self.incarnation or ''}/{key}")
        except AuthError as e:
            return _Refused(str(e).encode())

    def get(self, *, timeout_s: float | None, stop: threading.Event | None = None) -> bytes:
        """The next item's bytes, in order; raises ``TransportTimeout`` after ``timeout_s``."""
        key = f"item/{self._head}"
        wait_key(self.store, key, timeout_s=timeout_s, stop=stop, what=f"rollout #{self._head}", who="trainer")
        return self._take(key)


    def report(self, report: EngineReport) -> None:
        """Producer: post ``report`` for the consumer (``reports``), sealed like an item."""
        n = self.store.add("reports", 1)
        incarnation = self.store.get("incarnation").decode() if self.store.check(["incarnation"]) else ""
        self.store.set(f"report/{n}", seal(encode(report), self.secret, f"rollout/{incarnation}/report/{n}"))

    def reports(self) -> list[EngineReport]:
        """Consumer: the reports posted since the last call, in order (never waits); one that
        fails authentication or decoding becomes a report saying so."""
        out = []
        while self._reports_read < self.store.add("reports", 0):
            key = f"report/{self._reports_read + 1}"
            if not self.store.check([key]):
                break  # counted, not yet written: the next call reads it
            self._reports_read += 1
            try:
                out.append(decode_report(unseal(self.store.get(key), self.secret,
                                                f"rollout/{self.incarnation or ''}/{key}")))
            except ProtocolError as e:  # AuthError included: a stray client's bytes
                out.append(EngineReport(engine_id="?", message=f"an unreadable engine report at {key}: {e}"))
        return out


class _Refused(bytes):
    """An item that failed authentication (its bytes are the reason)."""


def _undecodable(data: bytes) -> str:
    """Why a group failed to decode, as a code: its tokens, log-probs and tags disagree in
    length (a producer's bug), or anything else (bytes from nowhere)."""
    try:
        raw = msgspec.msgpack.decode(data)
        samples = raw.get("samples", []) if isinstance(raw, dict) else []
        if any(isinstance(x, dict) and len({len(x.get(k) or ()) for k in ("token_ids", "logprobs", "versions")}) > 1
               for x in samples):
            return "length_mismatch"
    except (msgspec.DecodeError, TypeError):
        pass
    return "bad_message"


def check_group(group: RolloutGroup, *, group_size: int | None, current_version: int,
                sampling: Sampling | None = None) -> str | None:
    """Why a decoded group is unusable, or None. (Length mismatches fail at decode.)
    ``sampling``: the distribution the trainer scores (None: the temperature alone, any)."""
    if group_size is not None and len(group.samples) != group_size:
        return "group_size"
    if group.sampling is not None and (group.sampling.transforms() if sampling is None else group.sampling != sampling):
        # behaviour log-probs of a distribution the trainer's log-probs do not reproduce
        return "sampling_mismatch"
    for s in group.samples:
        if not s.token_ids:
            return "empty"
        if not math.isfinite(s.reward):
            return "nonfinite_reward"
        if not all(math.isfinite(x) for x in s.logprobs):
            return "nonfinite_logprob"
        if any(x > 1e-4 for x in s.logprobs):
            return "positive_logprob"
        if max(s.versions) > current_version:
            return "future_version"
    return None


class RolloutBuffer:
    """The trainer's end: validate, admit by lag, batch."""

    def __init__(self, queue: RolloutQueue, *, admit_lag: int, mask_lag: int | None = None,
                 group_size: int | None = None, sampling: Sampling | None = None,
                 pending: Iterable[RolloutGroup] = (), stats: Mapping[str, object] | None = None) -> None:
        """``sampling``: the distribution the trainer scores (``check_group``); ``pending`` and
        ``stats`` (a checkpoint's ``stats()``) continue a resumed run's buffer."""
        if admit_lag < 0:
            raise ValueError(f"admit_lag={admit_lag} must be >= 0")
        if mask_lag is not None and mask_lag < 0:
            raise ValueError(f"mask_lag={mask_lag} must be >= 0")
        self.queue = queue
        self.admit_lag = admit_lag
        self.mask_lag = admit_lag if mask_lag is None else mask_lag
        self.group_size = group_size
        self.sampling = sampling
        self.pending: list[RolloutGroup] = list(pending)
        self.rejected: Counter[str] = Counter()
        self.dropped_stale = 0
        self.dropped_ids: list[str] = []
        """Ids of groups dropped as stale since the caller last cleared it (for the run's log)."""
        self.admitted = 0
        self.holes = 0
        """Queue slots a dead producer claimed but never filled."""
        if stats:
            self.admitted = int(stats.get("admitted", 0))  # type: ignore[arg-type]
            self.dropped_stale = int(stats.get("dropped_stale", 0))  # type: ignore[arg-type]
            self.rejected.update(dict(stats.get("rejected", {})))  # type: ignore[arg-type]
            self.holes = int(stats.get("queue_holes", 0))  # type: ignore[arg-type]

    def _admit(self, data: bytes, current_version: int) -> None:
        if data == HOLE:
            self.holes += 1
            return
        if isinstance(data, _Refused):
            self.rejected["unauthenticated"] += 1
            return
        try:
            group = decode_group(data)
        except ProtocolError:
            self.rejected[_undecodable(data)] += 1
            return
        reason = check_group(group, group_size=self.group_size, current_version=current_version, sampling=self.sampling)
        if reason is not None:
            self.rejected[reason] += 1
            return
        self.admitted += 1
        self.pending.append(group)

    def next_batch(self, n_groups: int, current_version: int, *, timeout_s: float | None,
                   stop: threading.Event | None = None) -> list[RolloutGroup]:
        """``n_groups`` admitted groups, oldest first; stale pending ones are dropped first."""
        while True:
            oldest_ok, newest_ok = current_version - self.admit_lag, current_version - self.mask_lag
            fresh = [g for g in self.pending if min(min(s.versions) for s in g.samples) >= oldest_ok
                     and max(max(s.versions) for s in g.samples) >= newest_ok]
            self.dropped_stale += len(self.pending) - len(fresh)
            if len(fresh) < len(self.pending):
                keep = {id(g) for g in fresh}
                self.dropped_ids.extend(g.group_id for g in self.pending if id(g) not in keep)
            self.pending = fresh
            if len(self.pending) >= n_groups:
                batch, self.pending = self.pending[:n_groups], self.pending[n_groups:]
                return batch
            self._admit(self.queue.get(timeout_s=timeout_s, stop=stop), current_version)

    def drain(self, current_version: int) -> int:
        """Admit every group already in the queue, without waiting; returns how many were read.

        A checkpoint calls this first, so the groups that were queued (they live in the
        trainer's store and die with it) are saved as ``pending`` and a resumed run trains
        on them: nothing queued before a checkpoint is lost or repeated.
        """
        n = 0
        while (data := self.queue.try_get()) is not None:
            self._admit(data, current_version)
            n += 1
        return n

    def stats(self) -> dict[str, object]:
        return {"admitted": self.admitted, "dropped_stale": self.dropped_stale, "rejected": dict(self.rejected),
                "pending": len(self.pending), "queue_holes": self.holes}
