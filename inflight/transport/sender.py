"""Trainer's side of the data plane: ``BucketSender`` lays updates out and streams them.

``pack`` / ``pack_each`` give the announces without reading a byte; ``send_each`` then packs
each bucket from a ``Source`` of the caller's tensors as it goes out
(``inflight.transport.packing``). The sender keeps no update between the two: the caller
hands the announces and their source to ``send_each``.

Ordering invariants:
- buckets go round-robin over the destinations (bucket 0 of each, then bucket 1, ...), at
  most two in flight per destination: bucket i is packed into the buffer bucket i - 2 used,
  after that send completed, so the trainer holds two buckets per destination;
- every read of the caller's tensors happens before ``on_read_done`` runs (it runs once the
  last bucket is packed, before the last sends complete): from then on the caller may write
  its parameters (``optimizer.step``) while the update is still on the wire;
- a source that fails mid-stream sends every destination with buckets left an ``Abort`` frame
  in place of its next header, and nothing after it: the receivers stop in step, and the
  pusher can go on with the group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from inflight.auth import bucket_mac
from inflight.protocol import Abort, BucketHeader, BucketSpec, ChecksumAlgo, ShardPlan, UpdateAnnounce
from inflight.shard_plan import inside
from inflight.transport.frames import frame, mac_context
from inflight.transport.group import WeightGroup
from inflight.transport.layout import ALIGN, bucket_windows, checksum, dtype_name, plan_tensors
from inflight.transport.packing import MappingSource, Source, WindowFiller


@dataclass(frozen=True)
class SendStats:
    version: int
    nbytes: int
    """The update's bytes: once for a broadcast, each worker's own summed for point-to-point."""
    buckets: int
    pack_s: float
    """Time spent filling, checksumming and sealing buckets (inside ``send_s``)."""
    send_s: float
    read_s: float = 0.0
    """From the first bucket until the last one was packed: how long the caller's tensors were read."""
    delivered_bytes: int = 0
    """The bytes the workers received: a broadcast's once per member (a tensor parallel
    engine without shard plans gets the whole update on each of its T workers)."""


# A fault-injection seam for tests and drills: may replace a bucket's header and bytes.
Tamper = Callable[[BucketHeader, torch.Tensor], tuple[BucketHeader, torch.Tensor]]


class SourceError(RuntimeError):
    """Reading the update's tensors failed mid-stream; the engines were told to drop it and keep
    their last good version. The group is in step: the next push may go on."""


def _buckets(total: int, bucket_bytes: int) -> tuple[BucketSpec, ...]:
    return tuple(BucketSpec(index=i, offset=o, nbytes=n) for i, (o, n) in enumerate(bucket_windows(total, bucket_bytes)))



def _wire_dtypes(named: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                 dtypes: Mapping[str, str] | None) -> dict[str, str]:
    """Each tensor's wire dtype: ``dtypes``' for the names it holds, else ``dtype`` (None: the tensor's own)."""
    return {name: (dtypes or {}).get(name) or dtype_name(dtype or t.dtype) for name, t in named.items()}

class BucketSender:
    """Rank 0: two bucket buffers per destination, reused across versions."""

    def __init__(self, group: WeightGroup, *, bucket_bytes: int, checksum_algo: ChecksumAlgo) -> None:
        if group.rank != 0:
            raise ValueError("only rank 0 sends weights")
        if bucket_bytes <= 0 or bucket_bytes % ALIGN:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be a positive multiple of {ALIGN} "
                             "(bucket boundaries fall between elements)")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.checksum_algo = checksum_algo
        self._buffers: dict[int | None, list[torch.Tensor]] = {}

    def pack(self, version: int, named: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
             dtypes: Mapping[str, str] | None = None) -> UpdateAnnounce:
        """Lay ``named`` out (cast to ``dtype`` if given; ``dtypes``: the wire dtype of the
        tensors the engine keeps in a dtype of their own, ``Joined.wire_dtypes``) and describe
        it from names, shapes and dtypes alone; nothing is read until ``send``."""
        wire = _wire_dtypes(named, dtype, dtypes)
        tensors, total = plan_tensors((name, tuple(t.shape), wire[name]) for name, t in named.items())
        return UpdateAnnounce(version=version, total_bytes=total, bucket_bytes=self.bucket_bytes,
                              checksum_algo=self.checksum_algo, tensors=tensors, buckets=_buckets(total, self.bucket_bytes))

    def pack_each(self, version: int, named: Mapping[str, torch.Tensor], plans: Mapping[int, ShardPlan | None],
                  dtype: torch.dtype | None = None, dtypes: Mapping[str, str] | None = None) -> dict[int, UpdateAnnounce]:
        """For each worker, lay out the boxes of ``named`` its shard plan asks for (in the
        update's tensor order), or the whole of ``named`` for a worker without a plan (``pack``):
        one announce per worker, nothing read until ``send_each``."""
        wire = _wire_dtypes(named, dtype, dtypes)
        out = {}
        for rank, plan in plans.items():
            if plan is None:
                out[rank] = self.pack(version, named, dtype, dtypes)
                continue
            boxes = {s.name: (s.start, s.length) for s in plan.shards}
            # a tensor the plan has no box for that fits goes whole (start ()): the worker refuses
            # the update naming it, as it would a broadcast one
            fit = {n: b for n, b in boxes.items() if n in named and inside(*b, named[n].shape)}
            tensors, total = plan_tensors(((n, fit[n][1] if n in fit else tuple(t.shape), wire[n]) for n, t in named.items()),
                                          starts={n: fit[n][0] if n in fit else () for n in named})
            out[rank] = UpdateAnnounce(version=version, total_bytes=total, bucket_bytes=self.bucket_bytes,
                                       checksum_algo=self.checksum_algo, tensors=tensors,
                                       buckets=_buckets(total, self.bucket_bytes), plan_digest=plan.digest)
        return out

    def send(self, announce: UpdateAnnounce, source: Source | Mapping[str, torch.Tensor], *,
             tamper: Tamper | None = None) -> SendStats:
        """Broadcast every bucket of ``announce`` (``pack``) read from ``source``; returns when all
        broadcasts completed."""
        return self.send_each({None: announce}, source, tamper=tamper)

    def send_each(self, announces: Mapping[int | None, UpdateAnnounce], source: Source | Mapping[str, torch.Tensor], *,
                  tamper: Tamper | None = None, on_read_done: Callable[[], None] | None = None) -> SendStats:
        """Pack, from ``source`` (a ``Source``, or the tensors by name), and send every bucket of
        ``{None: announce}`` (``pack``: broadcast) or ``{rank: announce}`` (``pack_each``: each
        worker its own), round-robin, at most two buckets in flight per destination. Raises
        ``SourceError`` (after aborting the stream) if reading the tensors fails."""
        t0 = time.perf_counter()
        if isinstance(source, Mapping):
            source = MappingSource(source)
        fillers = {r: WindowFiller(a.tensors, source) for r, a in announces.items()}
        in_flight: dict[int | None, list[list[tuple]]] = {r: [] for r in announces}
        sent = dict.fromkeys(announces, 0)
        pack_s, read_s = 0.0, 0.0
        try:
            for i in range(max((len(a.buckets) for a in announces.values()), default=0)):
                for rank, announce in announces.items():
                    if i >= len(announce.buckets):
                        continue
                    while len(in_flight[rank]) >= 2:  # bucket i reuses bucket i - 2's buffer
                        for p in in_flight[rank].pop(0):
                            self.group.wait(p)
                    tp = time.perf_counter()
                    header, data = self._pack_bucket(rank, announce, i, fillers[rank])
                    pack_s += time.perf_counter() - tp
                    if tamper is not None:
                        header, data = tamper(header, data)
                    in_flight[rank].append(self._post_bucket(rank, header, data, len(announce.buckets)))
                    sent[rank] = i + 1
            read_s = time.perf_counter() - t0
        except _SourceFailed as e:
            self._abort_rest(announces, sent, in_flight, str(e.__cause__))
            raise SourceError(f"v{e.version}: {e}") from e.__cause__
        finally:
            for filler in fillers.values():
                filler.close()
            if on_read_done is not None:
                on_read_done()
        for pending in in_flight.values():
            for pair in pending:
                for p in pair:
                    self.group.wait(p)
        first = next(iter(announces.values()))
        delivered = sum(a.total_bytes * (len(self.group.roster) if r is None else 1) for r, a in announces.items())
        return SendStats(first.version, sum(a.total_bytes for a in announces.values()),
                         sum(len(a.buckets) for a in announces.values()), pack_s, time.perf_counter() - t0, read_s,
                         delivered)

    def _pack_bucket(self, rank: int | None, announce: UpdateAnnounce, i: int,
                     filler: WindowFiller) -> tuple[BucketHeader, torch.Tensor]:
        b = announce.buckets[i]
        buffers = self._buffers.get(rank)
        if buffers is None or buffers[0].numel() < self.bucket_bytes:
            buffers = self._buffers[rank] = [torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
                                             for _ in range(2)]
        data = buffers[i % 2][:b.nbytes]
        try:
            filler.fill(data, b.offset, last=i == len(announce.buckets) - 1)
        except Exception as e:
            to = "" if rank is None else f" for rank {rank}"
            raise _SourceFailed(announce.version, f"reading the tensors of bucket {i}{to} failed: {e}") from e
        mac = b""
        if self.group.secret is not None:
            mac = bucket_mac(self.group.secret, mac_context(self.group, announce.version, i, rank), data)
        return BucketHeader(version=announce.version, index=i, offset=b.offset, nbytes=b.nbytes,
                            checksum=checksum(data, self.checksum_algo), mac=mac), data

    def _post_bucket(self, rank: int | None, header: BucketHeader, data: torch.Tensor, n: int) -> list[tuple]:
        to, v = ("" if rank is None else f" to rank {rank}"), header.version
        return [self._post(frame(header, self.group.device), rank, f"header of bucket {header.index} of v{v}{to}"),
                self._post(data, rank, f"bucket {header.index}/{n} of v{v}{to} ({data.numel()} B)")]

    def _abort_rest(self, announces: Mapping[int | None, UpdateAnnounce], sent: Mapping[int | None, int],
                    in_flight: Mapping[int | None, list[list[tuple]]], reason: str) -> None:
        """End the stream of every destination that still expects buckets with an ``Abort`` frame."""
        for rank, announce in announces.items():
            if sent[rank] < len(announce.buckets):
                version = announce.version
                in_flight[rank].append([self._post(frame(Abort(version=version, reason=reason[:120]), self.group.device),
                                                   rank, f"abort frame of v{version}")])
        for pending in in_flight.values():
            for pair in pending:
                for p in pair:
                    self.group.wait(p)

    def _post(self, tensor: torch.Tensor, rank: int | None, what: str) -> tuple:
        if rank is None:
            return self.group.start_broadcast(tensor, what=what)
        return self.group.start_send(tensor, rank, what=what)

    def send_abort(self, version: int, reason: str) -> None:
        """The single ``Abort`` frame that replaces the buckets of a refused update: broadcast,
        or sent to each worker in a point-to-point generation."""
        data = frame(Abort(version=version, reason=reason[:120]), self.group.device)
        ranks = list(self.group.roster) if self.group.point_to_point else [None]
        for pending in [self._post(data, r, f"abort frame of v{version}") for r in ranks]:
            self.group.wait(pending)


class _SourceFailed(Exception):
    def __init__(self, version: int, message: str) -> None:
        super().__init__(message)
        self.version = version
