"""Flat layout of an update and how its bytes cross the data plane: where each tensor
lives, how the stream is cut into buckets, the per-bucket checksums, the streaming pack that
fills each bucket as it is sent, the frame before each bucket and what a bucket's MAC binds;
and the schema an update must match (``TensorSchema``).

An update is one flat byte stream. Each tensor occupies ``[offset, offset + nbytes)``
with offsets aligned to ``ALIGN`` bytes, so a receiver can view any tensor in place with
its dtype. Buckets are consecutive windows of at most ``bucket_bytes``; a tensor larger
than a bucket simply spans several, so any bucket size works with any model.

Streaming pack: the bytes of one bucket, read from the caller's tensors when it is sent.
``WindowFiller.fill`` writes exactly one window of the stream from the source tensors (cast
to the wire dtype, narrowed to a shard plan's box), so the trainer never holds more than the
buckets in flight: there is no flat copy of the model, and no pass over the whole model
before the announce. ``pack_into`` is its flat reference.

Bucket boundaries fall between elements: tensors start on ``ALIGN``-byte offsets and
``bucket_bytes`` is a multiple of ``ALIGN`` (``aligned_bucket_bytes``), and every wire dtype's
size divides ``ALIGN``. Alignment padding between tensors is written as zeros.

``Source`` is where a window's tensors come from: a mapping of tensors, or a sharded source
(``inflight.transport.sources``) that gathers each tensor across the trainer's ranks when a
bucket first needs it and lets it go once no bucket left to pack needs it.

Frames: a fixed-size header before each bucket, or an ``Abort`` in its place
(``frame``/``unframe``), and what a bucket's MAC binds (``mac_context``). Shared by the
sender and the receivers.
"""

from __future__ import annotations

import bisect
import functools
import zlib

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

import torch

from inflight.layer_groups import LayerGroups
from inflight.protocol import (DTYPE_ITEMSIZE, BucketSpec, ChecksumAlgo, FrameMessage, ProtocolError, ShardPlan, TensorSpec,
                               UpdateAnnounce, decode_frame, encode)
from inflight.transport.errors import UpdateRejected
from inflight.transport.group import WeightGroup

ALIGN = 64  # bytes; a cache line, and enough for every dtype's alignment on CPU and GPU

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
    return tuple(BucketSpec(index=i, offset=o, nbytes=n) for i, (o, n) in enumerate(bucket_windows(total_bytes, bucket_bytes)))


def aligned_bucket_bytes(nbytes: int) -> int:
    """``nbytes`` rounded down to a multiple of ``ALIGN`` (at least ``ALIGN``), so that no element
    of any wire dtype straddles two buckets."""
    return max(ALIGN, int(nbytes) // ALIGN * ALIGN)


_WSUM_CHUNK = 1 << 22  # int64 words per step: bounds the temporary to 32 MiB
WSUM_TEMP_BYTES = 2 * 8 * _WSUM_CHUNK
"""Device temporaries of one ``wsum64`` chunk (its weights and their products)."""


def checksum(data: torch.Tensor, algo: ChecksumAlgo) -> int:
    """Checksum of a 1-D uint8 tensor.

    ``xxh3`` (64-bit XXH3, CPU tensors; ~6 GB/s here, 4x zlib's crc32) is the default on gloo.
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
        for start in range(0, words.numel(), _WSUM_CHUNK):
            w = words[start:start + _WSUM_CHUNK]
            weights = torch.arange(w.numel(), dtype=torch.int64, device=data.device).mul_(2).add_(2 * (base + start) + 1)
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
                    raise ValueError(f"tensor {t.name!r}: shape {tuple(src.shape)} does not match layout {tuple(t.shape)}")
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
class TensorSchema:
    """Exactly what an update must contain: name -> (shape, wire dtype)."""

    tensors: Mapping[str, tuple[tuple[int, ...], str]]

    @functools.cached_property
    def layer_groups(self) -> LayerGroups:
        """The tensors' layer groups, computed once: each group of a layer-granular update is checked against them."""
        return LayerGroups.of(self.tensors)

    def check(self, announce: UpdateAnnounce, plan: ShardPlan | None = None) -> UpdateRejected | None:
        """Why ``announce`` is not exactly an update of these tensors (each whole, or, when it
        follows this worker's shard ``plan``, each the plan's box of it), or None."""
        if announce.plan_digest:
            if plan is None or announce.plan_digest != plan.digest:
                mine = "no shard plan" if plan is None else f"shard plan {plan.digest}"
                return UpdateRejected("bad_layout", f"v{announce.version} follows shard plan {announce.plan_digest}; "
                                                    f"this worker sent {mine}")
            boxes = {s.name: (tuple(s.start), tuple(s.length)) for s in plan.shards}
            for t in announce.tensors:
                if t.name in boxes and (tuple(t.start), tuple(t.shape)) != boxes[t.name]:
                    return UpdateRejected("bad_shape", f"{t.name}: box {tuple(t.start)}+{tuple(t.shape)}, this worker's plan "
                                                       f"reads {boxes[t.name][0]}+{boxes[t.name][1]}")
        elif any(t.start for t in announce.tensors):
            return UpdateRejected("bad_layout", f"v{announce.version} sends boxes without a shard plan")
        names = {t.name for t in announce.tensors}
        unknown = sorted(names - self.tensors.keys())
        if unknown:
            return UpdateRejected("unknown_tensor", f"v{announce.version} names tensors the engine does not have: {unknown[:5]}")
        expected = set(self.tensors)
        if announce.parts:  # one layer group: exactly its tensors, in this engine's grouping
            groups = self.layer_groups
            if announce.parts != len(groups):
                return UpdateRejected("bad_layout", f"v{announce.version} comes in {announce.parts} layer groups; this "
                                                    f"engine's model has {len(groups)}")
            expected = set(groups[announce.part])
            foreign = sorted(names - expected)
            if foreign:
                return UpdateRejected("bad_layout", f"group {announce.part} of v{announce.version} holds tensors of other "
                                                    f"groups: {foreign[:5]}")
        missing = sorted(expected - names)
        if missing:
            return UpdateRejected("missing_tensor", f"v{announce.version} lacks {len(missing)} tensors, e.g. {missing[:5]}")
        for t in announce.tensors:
            shape, dtype = self.tensors[t.name]
            if tuple(t.shape) != tuple(shape) and not announce.plan_digest:
                return UpdateRejected("bad_shape", f"{t.name}: shape {tuple(t.shape)}, engine has {tuple(shape)}")
            if t.dtype != dtype:
                return UpdateRejected("bad_dtype", f"{t.name}: dtype {t.dtype}, engine runs {dtype}")
        bound = sum(-(-t.nbytes // ALIGN) * ALIGN for t in announce.tensors)
        if announce.total_bytes > bound:
            return UpdateRejected("bad_layout", f"total_bytes={announce.total_bytes} exceeds the {bound} B its tensors need")
        return None
