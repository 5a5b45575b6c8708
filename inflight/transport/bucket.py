"""The bucket, as one unit: how an update is laid out as one flat byte stream, cut into
buckets, packed as each bucket goes out, framed, checksummed and MACed; the ``BucketSender``
that streams a version's buckets and the ``BucketReceiver`` that lands them.

Layout. Each tensor occupies ``[offset, offset + nbytes)`` of the stream, offsets aligned to ``ALIGN`` bytes, so
a receiver views any tensor in place with its dtype; padding is zeros. Buckets are consecutive windows of at most
``bucket_bytes``, a multiple of ``ALIGN`` (``aligned_bucket_bytes``): every wire dtype's size divides ``ALIGN``, so
bucket boundaries fall between elements and any bucket size works with any model.
Packing. ``WindowFiller.fill`` (flat reference: ``pack_into``) writes one window of the stream from a ``Source``
(cast to the wire dtype, narrowed to a shard plan's box) when its bucket is sent: the trainer never holds more
than the buckets in flight, and reads nothing before the announce.

Sending (``BucketSender.send_each``): round-robin over the destinations, at most two buckets in flight per
destination (bucket i reuses bucket i - 2's buffer once that send completed); every read of the caller's
tensors happens before ``on_read_done``; a source that fails mid-stream sends each destination with buckets
left one ``Abort`` frame in place of its next header, and nothing after it, so the receivers stop in step.
Receiving (``BucketReceiver.receive``): exactly as many buckets as announced, each of its header's size, even
after a bad one (landed over the refused update's own bytes), so the group stays in lockstep and the caller
gets one ``UpdateRejected`` at the end; or it stops at an ``Abort`` frame. Each bucket's checksum and MAC come
in its header (``frame``) and are checked against the bytes that landed before ``on_verified`` runs.
"""

from __future__ import annotations

import bisect
import hmac
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import xxhash

from inflight.auth import bucket_mac
from inflight.memory import WSUM_CHUNK_WORDS, BucketWindows
from inflight.protocol import (
    ALIGN,
    DTYPE_ITEMSIZE,
    Abort,
    BucketHeader,
    BucketSpec,
    ChecksumAlgo,
    FrameMessage,
    ProtocolError,
    ShardPlan,
    TensorSpec,
    UpdateAnnounce,
    decode_frame,
    encode,
)
from inflight.shard_plan import inside
from inflight.transport.errors import TransportError, UpdateRejected, member
from inflight.transport.group import WeightGroup
from inflight.transport.sources import SourceError

_TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_ITEMSIZE}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, refusing dtypes the wire does not carry."""
    name = str(dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES:
        raise ValueError(f"dtype {dtype} cannot travel on the wire (supported: {sorted(_TORCH_DTYPES)})")
    return name


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown wire dtype {name!r}") from None


def plan_tensors(specs: Iterable[tuple[str, Sequence[int], str]],
                 starts: Mapping[str, Sequence[int]] | None = None) -> tuple[tuple[TensorSpec, ...], int]:
    """Lay out ``(name, shape, dtype)`` in the given order; return the specs and total bytes.
    ``starts``: for boxes of tensors (a shard plan's), where each starts; ``shape`` is the box's."""
    out: list[TensorSpec] = []
    offset = 0
    for name, shape, dtype in specs:
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * DTYPE_ITEMSIZE[dtype]
        start = tuple(int(s) for s in starts[name]) if starts is not None else ()
        out.append(TensorSpec(name=name, shape=tuple(int(d) for d in shape), dtype=dtype, offset=offset, nbytes=nbytes,
                              start=start))
        offset += -(-nbytes // ALIGN) * ALIGN
    return tuple(out), offset


def bucket_windows(total_bytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each bucket; the last one may be short."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
    return [(o, min(bucket_bytes, total_bytes - o)) for o in range(0, total_bytes, bucket_bytes)]


def bucket_specs(total_bytes: int, bucket_bytes: int) -> tuple[BucketSpec, ...]:
    """The ``BucketSpec`` of each of ``bucket_windows``: what an announce lists."""
    return tuple(BucketSpec(index=i, offset=o, nbytes=n)
                 for i, (o, n) in enumerate(bucket_windows(total_bytes, bucket_bytes)))


def aligned_bucket_bytes(nbytes: int) -> int:
    """``nbytes`` rounded down to a multiple of ``ALIGN`` (at least ``ALIGN``), so that no element
    of any wire dtype straddles two buckets."""
    return max(ALIGN, int(nbytes) // ALIGN * ALIGN)


def checksum(data: torch.Tensor, algo: ChecksumAlgo) -> int:
    """Checksum of a 1-D uint8 tensor.

    ``xxh3`` (64-bit XXH3, CPU tensors) is the default on gloo.
    ``crc32`` (zlib, CPU tensors) catches every burst error up to 32 bits. Both release the GIL,
    so verifying a bucket does not hold up the engine's decode thread. ``wsum64`` runs on any
    device without a host copy: the sum of ``word_i * (2i + 1)`` over little-endian int64
    words (zero-padded), modulo 2**64; odd weights make it sensitive to swapped words.
    """
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"checksum wants a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    if algo in ("xxh3", "crc32"):
        if data.device.type != "cpu":
            raise ValueError(f"{algo} checksums need a CPU tensor; use wsum64 on GPU")
        if algo == "xxh3":
            return xxhash.xxh3_64_intdigest(data.numpy())
        return zlib.crc32(data.numpy()) & 0xFFFFFFFF
    if algo == "wsum64":
        return _wsum64(data)
    raise ValueError(f"unknown checksum algorithm {algo!r}")


def _wsum64(data: torch.Tensor) -> int:
    n = data.numel()
    tail = n % 8
    if tail:  # zero-pad the last partial word without copying the whole buffer
        last = torch.zeros(8, dtype=torch.uint8, device=data.device)
        last[:tail] = data[n - tail:]
        words_parts = [data[: n - tail].view(torch.int64), last.view(torch.int64)]
    else:
        words_parts = [data.view(torch.int64)]
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    base = 0
    for words in words_parts:
        for start in range(0, words.numel(), WSUM_CHUNK_WORDS):
            w = words[start:start + WSUM_CHUNK_WORDS]
            weights = torch.arange(w.numel(), dtype=torch.int64,
                                   device=data.device).mul_(2).add_(2 * (base + start) + 1)
            # int64 arithmetic wraps modulo 2**64 on every torch backend
            total += (w * weights).sum()
        base += words.numel()
    return int(total.item()) & 0xFFFFFFFFFFFFFFFF


def completed_by_bucket(tensors: Sequence[TensorSpec], buckets: Sequence[BucketSpec]) -> list[list[str]]:
    """For each bucket, the tensors whose last byte it holds: once buckets ``0..i`` verified,
    every tensor listed up to ``i`` is complete. A tensor of no bytes goes with the bucket
    holding its offset (the last bucket if it sits at the end); with no buckets, none."""
    out: list[list[str]] = [[] for _ in buckets]
    if not buckets:
        return out
    ends = [b.offset + b.nbytes for b in buckets]
    for t in tensors:
        last = t.offset + t.nbytes - 1 if t.nbytes else t.offset
        out[min(bisect.bisect_right(ends, last), len(buckets) - 1)].append(t.name)
    return out


def tensor_views(flat: torch.Tensor, tensors: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """Views of each tensor inside a flat uint8 buffer laid out by ``plan_tensors``; no copies."""
    out: dict[str, torch.Tensor] = {}
    for t in tensors:
        out[t.name] = flat[t.offset:t.offset + t.nbytes].view(torch_dtype(t.dtype)).view(t.shape)
    return out


def pack_into(flat: torch.Tensor, tensors: Sequence[TensorSpec], named: Mapping[str, torch.Tensor]) -> None:
    """Copy (and cast, once) each named tensor into its place in ``flat``."""
    views = tensor_views(flat, tensors)
    starts = {t.name: t.start for t in tensors if t.start}
    with torch.no_grad():
        for name, view in views.items():
            src = named[name]
            for d, s in enumerate(starts.get(name, ())):  # a box of the tensor: only its part goes
                src = src.narrow(d, s, view.shape[d])
            if tuple(src.shape) != tuple(view.shape):
                raise ValueError(f"tensor {name!r}: shape {tuple(src.shape)} does not match layout {tuple(view.shape)}")
            view.copy_(src.detach())


class Source(Protocol):
    """Where the pack reads an update's tensors, one at a time, in layout order per destination."""

    def take(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` (global shape), readable until ``drop(name)``."""
        ...

    def drop(self, name: str) -> None:
        """The pack is done with one use of ``name`` (a sharded source frees a gathered copy)."""
        ...


class MappingSource:
    """Tensors the caller holds: read in place, nothing to free."""

    def __init__(self, named: Mapping[str, torch.Tensor]) -> None:
        self.named = named

    def take(self, name: str) -> torch.Tensor:
        return self.named[name]

    def drop(self, name: str) -> None:
        pass


def copy_elements(out: torch.Tensor, src: torch.Tensor, e0: int, e1: int) -> None:
    """``out[:] = src.flatten()[e0:e1]`` (cast to ``out``'s dtype) without materializing more
    than ``out``: full leading-dimension rows are copied as one strided block, partial ones by
    recursing into the row. ``src`` may be non-contiguous (a shard box, a transposed view)."""
    if e0 >= e1:
        return
    if src.dim() <= 1:
        out.copy_(src.reshape(-1)[e0:e1])  # a 0-d or 1-d tensor: reshape is a view
        return
    row = src.numel() // src.shape[0]
    r0, r1 = e0 // row, (e1 - 1) // row
    if r0 == r1:
        copy_elements(out, src[r0], e0 - r0 * row, e1 - r0 * row)
        return
    pos = 0
    if e0 % row:  # the tail of a first, partial row
        pos = row - e0 % row
        copy_elements(out[:pos], src[r0], e0 % row, row)
        r0 += 1
    full_end = e1 // row
    if full_end > r0:
        n = (full_end - r0) * row
        out[pos:pos + n].view((full_end - r0, *src.shape[1:])).copy_(src[r0:full_end])
        pos += n
    if e1 % row:  # the head of a last, partial row
        copy_elements(out[pos:], src[full_end], 0, e1 % row)


def _box(src: torch.Tensor, start: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    for d, s in enumerate(start):
        src = src.narrow(d, s, shape[d])
    return src


class WindowFiller:
    """Fills consecutive windows of one destination's stream from a ``Source``. Each tensor is
    taken when the first window that holds part of it is filled and dropped after the last."""

    def __init__(self, tensors: Sequence[TensorSpec], source: Source) -> None:
        self.tensors = sorted(tensors, key=lambda t: t.offset)
        self.source = source
        self._next = 0  # the first tensor not yet written to its end
        self._held: dict[str, torch.Tensor] = {}

    def fill(self, window: torch.Tensor, start: int, *, last: bool = False) -> None:
        """Write bytes ``[start, start + len(window))`` of the stream into ``window`` (1-D uint8).
        Windows come in order; ``last``: this window ends the stream (it also takes the tensors
        of no bytes that sit at its end)."""
        end = start + window.numel()
        cursor = start
        for t in self.tensors[self._next:]:
            if t.offset >= end and not last:
                break
            lo, hi = max(start, t.offset), min(end, t.offset + t.nbytes)
            if lo > cursor:
                window[cursor - start:lo - start].zero_()
            src = self._held.get(t.name)
            if src is None:
                src = self._held[t.name] = _box(self.source.take(t.name), t.start, t.shape)
                if tuple(src.shape) != tuple(t.shape):
                    raise ValueError(f"tensor {t.name!r}: shape {tuple(src.shape)} does not match layout "
                                     f"{tuple(t.shape)}")
            if hi > lo:
                dtype = torch_dtype(t.dtype)
                with torch.no_grad():
                    copy_elements(window[lo - start:hi - start].view(dtype), src.detach(),
                                  (lo - t.offset) // dtype.itemsize, (hi - t.offset) // dtype.itemsize)
                cursor = hi
            if t.offset + t.nbytes > end:  # the tensor goes on in the next window
                break
            del self._held[t.name]
            self.source.drop(t.name)
            self._next += 1
        if cursor < end:
            window[cursor - start:].zero_()

    def close(self) -> None:
        """Drop what a stopped pack still holds."""
        for name in list(self._held):
            del self._held[name]
            self.source.drop(name)


def first_use_order(streams: Sequence[Sequence[TensorSpec]], cuts: Sequence[Sequence[tuple[int, int]]]) -> list[str]:
    """The order in which a round-robin pack (bucket 0 of every destination, then bucket 1, ...)
    first takes each tensor, once per destination that needs it (``WindowFiller``'s rule): the
    order a sharded source's ranks gather in, so they gather in lockstep."""
    order: list[str] = []
    ordered = [sorted(ts, key=lambda t: t.offset) for ts in streams]
    positions = [0] * len(ordered)
    for i in range(max((len(c) for c in cuts), default=0)):
        for d, tensors in enumerate(ordered):
            if i >= len(cuts[d]):
                continue
            end, last = cuts[d][i][0] + cuts[d][i][1], i == len(cuts[d]) - 1
            while positions[d] < len(tensors) and (last or tensors[positions[d]].offset < end):
                order.append(tensors[positions[d]].name)
                positions[d] += 1
    return order


def mac_context(group: WeightGroup, version: int, index: int, rank: int | None = None) -> str:
    """What a bucket's MAC binds: its version and index, and, when it goes to one worker
    alone, that worker (a bucket sent to one rank cannot be replayed to another)."""
    return group.auth_context(f"bucket/{version}/{index}" if rank is None else f"bucket/{version}/{rank}/{index}")


FRAME_BYTES = 256  # header frame: 4-byte little-endian length + msgpack, zero padded


def frame(msg: FrameMessage, device: torch.device) -> torch.Tensor:
    """``msg`` as one ``FRAME_BYTES`` tensor on ``device``."""
    body = encode(msg)
    if len(body) > FRAME_BYTES - 4:
        raise ValueError(f"frame of {len(body)} bytes does not fit {FRAME_BYTES} bytes")
    raw = len(body).to_bytes(4, "little") + body
    out = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out.to(device)


def unframe(data: torch.Tensor) -> FrameMessage:
    """The message a received frame holds; ``ProtocolError`` if it holds none."""
    raw = data.cpu().numpy().tobytes()
    n = int.from_bytes(raw[:4], "little")
    if not 0 < n <= FRAME_BYTES - 4:
        raise ProtocolError(f"frame declares {n} bytes")
    return decode_frame(raw[4: 4 + n])


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
    dense_bytes: int = 0
    """What the update laid out dense would be: ``nbytes`` unless it went sparse."""
    changed_frac: float | None = None
    """A sparse update: the fraction of elements that changed against its base (None: dense)."""
    encode_s: float = 0.0
    """A sparse update: the trainer's time to encode it against its base."""

    def __add__(self, other: SendStats) -> SendStats:
        return SendStats(version=self.version, nbytes=self.nbytes + other.nbytes, buckets=self.buckets + other.buckets,
                         pack_s=self.pack_s + other.pack_s, send_s=self.send_s + other.send_s,
                         read_s=self.read_s + other.read_s,
                         delivered_bytes=self.delivered_bytes + other.delivered_bytes,
                         dense_bytes=self.dense_bytes + other.dense_bytes)


# A fault-injection seam for tests and drills: may replace a bucket's header and bytes. It is a
# sender's private hook (``BucketSender._tamper``, set by ``tests/helpers.py``'s ``tampering``),
# never an argument of a push.
Tamper = Callable[[BucketHeader, torch.Tensor], tuple[BucketHeader, torch.Tensor]]




def wire_dtypes(named: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
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
        self._tamper: Tamper | None = None  # the fault-injection seam: runs on each bucket before it is sent

    def lay_out(self, version: int, named: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
             dtypes: Mapping[str, str] | None = None) -> UpdateAnnounce:
        """Lay ``named`` out (cast to ``dtype`` if given; ``dtypes``: the wire dtype of the
        tensors the engine keeps in a dtype of their own, ``Joined.wire_dtypes``) and describe
        it from names, shapes and dtypes alone; nothing is read until ``send``."""
        wire = wire_dtypes(named, dtype, dtypes)
        tensors, total = plan_tensors((name, tuple(t.shape), wire[name]) for name, t in named.items())
        return UpdateAnnounce(version=version, total_bytes=total, bucket_bytes=self.bucket_bytes,
                              checksum_algo=self.checksum_algo, tensors=tensors,
                              buckets=bucket_specs(total, self.bucket_bytes))

    def lay_out_each(self, version: int, named: Mapping[str, torch.Tensor], plans: Mapping[int, ShardPlan | None],
                  dtype: torch.dtype | None = None,
                  dtypes: Mapping[str, str] | None = None) -> dict[int, UpdateAnnounce]:
        """For each worker, lay out the boxes of ``named`` its shard plan asks for (in the
        update's tensor order), or the whole of ``named`` for a worker without a plan (``lay_out``):
        one announce per worker, nothing read until ``send_each``."""
        wire = wire_dtypes(named, dtype, dtypes)
        out = {}
        for rank, plan in plans.items():
            if plan is None:
                out[rank] = self.lay_out(version, named, dtype, dtypes)
                continue
            boxes = {s.name: (s.start, s.length) for s in plan.shards}
            # a tensor the plan has no box for that fits goes whole (start ()): the worker refuses
            # the update naming it, as it would a broadcast one
            fit = {n: b for n, b in boxes.items() if n in named and inside(*b, named[n].shape)}
            tensors, total = plan_tensors(((n, fit[n][1] if n in fit else tuple(t.shape), wire[n])
                                           for n, t in named.items()),
                                          starts={n: fit[n][0] if n in fit else () for n in named})
            out[rank] = UpdateAnnounce(version=version, total_bytes=total, bucket_bytes=self.bucket_bytes,
                                       checksum_algo=self.checksum_algo, tensors=tensors,
                                       buckets=bucket_specs(total, self.bucket_bytes), plan_digest=plan.digest)
        return out

    def send(self, announce: UpdateAnnounce, source: Source | Mapping[str, torch.Tensor]) -> SendStats:
        """Broadcast every bucket of ``announce`` (``lay_out``) read from ``source``; returns when all
        broadcasts completed."""
        return self.send_each({None: announce}, source)

    def send_each(self, announces: Mapping[int | None, UpdateAnnounce], source: Source | Mapping[str, torch.Tensor], *,
                  on_read_done: Callable[[], None] | None = None) -> SendStats:
        """Pack, from ``source`` (a ``Source``, or the tensors by name), and send every bucket of
        ``{None: announce}`` (``lay_out``: broadcast) or ``{rank: announce}`` (``lay_out_each``: each
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
                    if self._tamper is not None:
                        header, data = self._tamper(header, data)
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
                in_flight[rank].append([self._post(frame(Abort(version=version, reason=reason[:120]),
                                                         self.group.device),
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


class BucketReceiver:
    """A worker: receives announced buckets into caller-provided flat storage."""

    def __init__(self, group: WeightGroup, windows: BucketWindows | None = None) -> None:
        self.group = group
        # two header frames: the next bucket's header is posted while this bucket's bytes arrive
        self._frames = [torch.zeros(FRAME_BYTES, dtype=torch.uint8, device=group.device) for _ in range(2)]
        # reserved at the worker's start (``inflight.memory``), or allocated on need (tests, peers)
        self.windows = windows
        # host staging on a device data plane: buckets land here (NCCL writes device memory
        # only), are verified, then copied to the host destination; two, like the frames
        self._landing: list[torch.Tensor] = [] if windows is None else windows.landing

    def fits(self, announce: UpdateAnnounce) -> str | None:
        """Why this receiver cannot land ``announce``'s buckets in what it reserved, or None."""
        w = self.windows
        if w is None or announce.bucket_bytes <= w.bucket_bytes:
            return None
        return (f"v{announce.version} comes in buckets of {announce.bucket_bytes} B, larger than the "
                f"{w.bucket_bytes} B this worker reserved (InflightConfig.max_bucket_mb; the trainer's bucket_mb "
                "must not exceed it)")

    def _landing_for(self, index: int, nbytes: int, bucket_bytes: int) -> torch.Tensor:
        if not self._landing or self._landing[0].numel() < bucket_bytes:  # sized once per bucket size
            self._landing = [torch.empty(bucket_bytes, dtype=torch.uint8, device=self.group.device) for _ in range(2)]
        return self._landing[index % 2][:nbytes]

    def _refused_window(self, dest: torch.Tensor, nbytes: int, announce: UpdateAnnounce) -> torch.Tensor:
        """Where a bucket of a refused update lands so the group stays in step: the update's
        own staging buffer (nothing reads it again: feeding stopped at the first error), so
        no scratch memory is ever needed. A bucket larger than the whole buffer means the
        sender is not speaking this protocol."""
        if nbytes > dest.numel():
            raise TransportError(f"{member(self.group.rank)}: a bucket of v{announce.version} declares {nbytes} B, "
                                 f"more than the whole update ({announce.total_bytes} B); the data plane is out "
                                 "of step")
        return dest[:nbytes]

    def receive(
        self,
        announce: UpdateAnnounce,
        dest: torch.Tensor,
        *,
        on_bucket: Callable[[int], None] | None = None,
        on_verified: Callable[[int], None] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Fill ``dest[:total_bytes]`` with the update; raise ``UpdateRejected`` if any bucket is bad.

        ``on_bucket(i)`` runs when bucket i has landed; ``on_verified(i)`` once buckets 0..i
        all passed their checksums (in order, never after a bad one), while bucket i + 1 is
        already on the wire: work done there overlaps the transfer. Neither may raise.

        ``dest`` lives on the data plane's device, or in host memory while the data plane is
        on CUDA (host staging): each bucket then lands on the device and is copied to the
        host once its checksum matched. Transport failures (timeouts, a dead peer) raise ``TransportError`` instead: the
        group is then out of step and must be rebuilt.
        """
        if dest.dtype != torch.uint8 or dest.dim() != 1 or dest.numel() < announce.total_bytes:
            raise ValueError(f"dest must be a 1-D uint8 tensor of >= {announce.total_bytes} bytes")
        to_host = dest.device.type == "cpu" and self.group.device.type == "cuda"
        if dest.device != self.group.device and not to_host:
            raise ValueError(f"dest on {dest.device}, group data plane on {self.group.device}")
        v = announce.version
        first_error: UpdateRejected | None = None
        landed: tuple[BucketSpec, BucketHeader, torch.Tensor] | None = None  # received, not yet verified
        n = len(announce.buckets)
        next_header = self.group.start_frame(self._frames[0], what=f"header of bucket 0 of v{v}")
        for spec in announce.buckets:
            self.group.wait(next_header, timeout_s)
            header, error = self._header(spec, announce)
            nbytes = spec.nbytes if header is None else header.nbytes
            first_error = first_error or error
            good = first_error is None
            if to_host:
                window = self._landing_for(spec.index, nbytes, announce.bucket_bytes)
            elif good:
                window = dest[spec.offset: spec.offset + nbytes]
            else:  # the update is refused: its bytes are garbage from here on, and land over its own
                window = self._refused_window(dest, nbytes, announce)
            pending = self.group.start_frame(window, what=f"bucket {spec.index}/{n} of v{v}")
            if spec.index + 1 < n:
                next_header = self.group.start_frame(
                    self._frames[(spec.index + 1) % 2], what=f"header of bucket {spec.index + 1} of v{v}"
                )
            if landed is not None:  # verify the previous bucket while this one is on the wire
                first_error = first_error or self._settle(landed, announce, dest if to_host else None, on_verified)
            self.group.wait(pending, timeout_s)
            landed = (spec, header, window) if good and header is not None else None
            if on_bucket is not None:
                on_bucket(spec.index)
        if landed is not None:
            first_error = first_error or self._settle(landed, announce, dest if to_host else None, on_verified)
        if first_error is not None:
            raise first_error

    def _header(self, spec: BucketSpec, announce: UpdateAnnounce) -> tuple[BucketHeader | None, UpdateRejected | None]:
        """Bucket ``spec``'s header as it landed, None where unreadable, and the refusal it earns.
        An ``Abort`` in its place raises ``UpdateRejected``; a declared size above
        ``bucket_bytes`` raises ``TransportError``: the sender is not speaking this protocol,
        there is no safe place to land the bucket, and the group must be rebuilt."""
        v = announce.version
        header: BucketHeader | None = None
        try:
            frame = unframe(self._frames[spec.index % 2])
        except ProtocolError as e:
            error: UpdateRejected | None = UpdateRejected("bad_message", f"bucket {spec.index}: {e}")
        else:
            if isinstance(frame, Abort):  # called off: refused elsewhere, or its source failed mid-stream
                raise UpdateRejected("aborted", f"v{v} aborted by the trainer before bucket {spec.index}: "
                                                f"{frame.reason}")
            header = frame
            error = self._check_header(header, spec, v)
        nbytes = spec.nbytes if header is None else header.nbytes
        if nbytes > announce.bucket_bytes:
            raise TransportError(f"{member(self.group.rank)}: bucket {spec.index} of v{v} declares {nbytes} B > "
                                 f"bucket_bytes {announce.bucket_bytes}; the data plane is out of step")
        return header, error

    def _settle(self, landed: tuple[BucketSpec, BucketHeader, torch.Tensor], announce: UpdateAnnounce,
                host: torch.Tensor | None, on_verified: Callable[[int], None] | None) -> UpdateRejected | None:
        """Verify the bucket that landed last; with host staging, copy it to the host once it
        verified (synchronously: its landing slot is reused two buckets later); then
        ``on_verified``. Returns its refusal, or None."""
        spec, header, window = landed
        error = self._verify(header, window, announce) or self._authenticate(header, window, announce.version)
        if error is None and host is not None:
            host[spec.offset: spec.offset + spec.nbytes].copy_(window)
        if error is None and on_verified is not None:
            on_verified(spec.index)
        return error

    @staticmethod
    def _verify(header: BucketHeader, window: torch.Tensor, announce: UpdateAnnounce) -> UpdateRejected | None:
        if checksum(window, announce.checksum_algo) == header.checksum:
            return None
        return UpdateRejected("checksum", f"bucket {header.index} of v{announce.version}: "
                                          f"{announce.checksum_algo} mismatch")

    def _authenticate(self, header: BucketHeader, window: torch.Tensor, version: int) -> UpdateRejected | None:
        """With a secret, the bucket's bytes must carry the trainer's MAC (a valid checksum is not
        proof: anyone who reaches the data plane can match a linear one)."""
        secret = self.group.secret
        if secret is None:
            return None
        if window.device.type != "cpu" and self.windows is not None and self.windows.mac_host is not None:
            window = self.windows.mac_host[:window.numel()].copy_(window)  # the reserved host copy, not a new one
        rank = self.group.rank if self.group.point_to_point else None
        if hmac.compare_digest(header.mac,
                               bucket_mac(secret, mac_context(self.group, version, header.index, rank), window)):
            return None
        return UpdateRejected("unauthenticated", f"bucket {header.index} of v{version}: its bytes do not carry the "
                                                 "trainer's MAC (forged or altered in transit; INFLIGHT_SECRET)")

    def receive_abort(self, version: int, timeout_s: float | None = None) -> None:
        """Join the single abort frame that follows an announce this worker refused."""
        self.group.wait(self.group.start_frame(self._frames[0], what=f"abort frame of v{version}"), timeout_s)
        try:
            frame = unframe(self._frames[0])
        except ProtocolError as e:
            raise TransportError(f"{member(self.group.rank)}: expected the abort frame of v{version}: {e}") from None
        if not isinstance(frame, Abort):
            raise TransportError(f"{member(self.group.rank)}: refused v{version} but the trainer sent buckets anyway")

    @staticmethod
    def _check_header(header: BucketHeader, spec: BucketSpec, version: int) -> UpdateRejected | None:
        if header.version != version:
            return UpdateRejected("bucket_order", f"bucket header says v{header.version}, update is v{version}")
        if header.index != spec.index:
            return UpdateRejected(
                "bucket_order", f"expected bucket {spec.index} of v{version}, got bucket {header.index} "
                                f"(duplicate or out of order)"
            )
        if header.nbytes < spec.nbytes:
            return UpdateRejected("short_bucket", f"bucket {spec.index} of v{version}: {header.nbytes} B, "
                                                  f"announced {spec.nbytes} B")
        if header.offset != spec.offset or header.nbytes != spec.nbytes:
            return UpdateRejected("bad_layout", f"bucket {spec.index} of v{version}: header does not match "
                                                "the announce")
        return None
