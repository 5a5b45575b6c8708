"""Streaming pack (``inflight.transport.bucket``) against the flat reference (``pack_into``):
every window of every bucket size is byte-identical to the same window of the whole-update
copy, on awkward shapes (non-contiguous, boxes of a shard plan, casts, 0-d and empty
tensors), and each tensor is taken once per stream in the order ``first_use_order`` says."""

from __future__ import annotations

import pytest
import torch

from inflight.protocol import ALIGN
from inflight.transport.bucket import (
    MappingSource,
    WindowFiller,
    aligned_bucket_bytes,
    bucket_windows,
    copy_elements,
    first_use_order,
    pack_into,
    plan_tensors,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(37, 53, generator=g)
    return {
        "transposed": base.t(),  # non-contiguous
        "narrow_cols": base[:, 5:41],  # a row-parallel box is a view like this
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 7),
        "experts": torch.randn(5, 11, 13, generator=g)[:, 2:9],  # 3-D, non-contiguous middle dim
        "vector": torch.randn(1001, generator=g),
        "bf16": torch.randn(17, 19, generator=g).to(torch.bfloat16),
    }


class _Recording(MappingSource):
    def __init__(self, named):
        super().__init__(named)
        self.takes: list[str] = []
        self.held: set[str] = set()

    def take(self, name):
        assert name not in self.held, f"{name} taken twice in one stream"
        self.takes.append(name)
        self.held.add(name)
        return super().take(name)

    def drop(self, name):
        self.held.remove(name)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("wire", [None, "float32", "bfloat16", "float64"])
@pytest.mark.parametrize("bucket", [64, 192, 4096, 1 << 20])
def test_windows_match_the_flat_copy(wire: str | None, bucket: int, device: str) -> None:
    """On CUDA, the source tensors and the bucket buffers are device tensors (the NCCL data
    plane packs on the trainer's GPU); the flat reference is packed on the CPU."""
    named = _tensors()
    starts = {"narrow_cols": (3, 4), "experts": (1, 0, 2)}
    boxes = {"narrow_cols": (30, 20), "experts": (3, 7, 11)}
    specs, total = plan_tensors(((n, boxes.get(n, tuple(t.shape)), wire or str(t.dtype).removeprefix("torch."))
                                 for n, t in named.items()), starts={n: starts.get(n, ()) for n in named})
    flat = torch.zeros(total, dtype=torch.uint8)
    pack_into(flat, specs, named)
    source = _Recording({n: t.to(device) for n, t in named.items()})
    filler = WindowFiller(specs, source)
    cuts = bucket_windows(total, bucket)
    window = torch.full((bucket,), 0xAB, dtype=torch.uint8, device=device)  # stale bytes must not leak into padding
    for i, (o, n) in enumerate(cuts):
        filler.fill(window[:n], o, last=i == len(cuts) - 1)
        assert torch.equal(window[:n].cpu(), flat[o:o + n]), f"bucket {i} at {o}"
    assert not source.held, "every tensor is dropped after its last window"
    assert source.takes == first_use_order([specs], [cuts]) == [t.name for t in specs]


def test_round_robin_order_takes_once_per_destination() -> None:
    named = _tensors()
    a, ta = plan_tensors((n, tuple(t.shape), "float32") for n, t in named.items())
    b, tb = plan_tensors((n, tuple(t.shape), "float32") for n, t in list(named.items())[::-1])
    ca, cb = bucket_windows(ta, 256), bucket_windows(tb, 512)
    sources = [_Recording(named), _Recording(named)]
    fillers = [WindowFiller(a, sources[0]), WindowFiller(b, sources[1])]
    takes: list[str] = []
    for s in sources:  # one log, in the order the round-robin makes the takes
        s.takes = takes
    buf = torch.empty(512, dtype=torch.uint8)
    for i in range(max(len(ca), len(cb))):
        for filler, cuts in zip(fillers, (ca, cb)):
            if i < len(cuts):
                o, n = cuts[i]
                filler.fill(buf[:n], o, last=i == len(cuts) - 1)
    assert takes == first_use_order([a, b], [ca, cb])
    assert sorted(takes) == sorted(list(named) * 2)


def test_copy_elements_reads_any_range_without_a_copy_of_the_source() -> None:
    src = torch.arange(4 * 5 * 6, dtype=torch.float64).view(4, 5, 6).transpose(0, 2)  # (6, 5, 4), non-contiguous
    ref = src.reshape(-1)
    for e0, e1 in [(0, 120), (3, 4), (7, 61), (19, 20), (20, 40), (1, 119), (59, 60)]:
        out = torch.empty(e1 - e0, dtype=torch.float32)
        copy_elements(out, src, e0, e1)
        assert torch.equal(out, ref[e0:e1].float()), (e0, e1)


def test_bucket_bytes_round_down_to_the_alignment() -> None:
    assert (aligned_bucket_bytes(3000) == 2944 and aligned_bucket_bytes(1) == ALIGN
            and aligned_bucket_bytes(4096) == 4096)
