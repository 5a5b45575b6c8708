"""Streaming pack: the bytes of one bucket, read from the caller's tensors when it is sent.

An update's layout (``plan_tensors``) is a flat byte stream; a bucket is one window of it.
``fill_window`` writes exactly that window from the source tensors (cast to the wire dtype,
narrowed to a shard plan's box), so the trainer never holds more than the buckets in flight:
there is no flat copy of the model, and no pass over the whole model before the announce.

Bucket boundaries fall between elements: tensors start on ``ALIGN``-byte offsets and
``bucket_bytes`` is a multiple of ``ALIGN`` (``aligned_bucket_bytes``), and every wire dtype's
size divides ``ALIGN``. Alignment padding between tensors is written as zeros.

``Source`` is where a window's tensors come from: a mapping of tensors, or a sharded source
(``inflight.transport.sources``) that gathers each tensor across the trainer's ranks when a
bucket first needs it and lets it go once no bucket left to pack needs it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from inflight.protocol import TensorSpec
from inflight.transport.layout import ALIGN, torch_dtype


def aligned_bucket_bytes(nbytes: int) -> int:
    """``nbytes`` rounded down to a multiple of ``ALIGN`` (at least ``ALIGN``), so that no element
    of any wire dtype straddles two buckets."""
    return max(ALIGN, int(nbytes) // ALIGN * ALIGN)


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
