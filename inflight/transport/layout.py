"""Flat layout of an update: where each tensor lives, how the stream is cut into buckets,
and the per-bucket checksums; and the schema an update must match (``TensorSchema``).

An update is one flat byte stream. Each tensor occupies ``[offset, offset + nbytes)``
with offsets aligned to ``ALIGN`` bytes, so a receiver can view any tensor in place with
its dtype. Buckets are consecutive windows of at most ``bucket_bytes``; a tensor larger
than a bucket simply spans several, so any bucket size works with any model.
"""

from __future__ import annotations

import bisect
import functools
import zlib

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

import torch

from inflight.layer_groups import LayerGroups
from inflight.protocol import DTYPE_ITEMSIZE, BucketSpec, ChecksumAlgo, ShardPlan, TensorSpec, UpdateAnnounce
from inflight.transport.errors import UpdateRejected

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
