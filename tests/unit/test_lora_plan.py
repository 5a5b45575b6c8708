"""The ``lora`` commit's copy plan (``inflight.engine.commit.lora_plan``) against the path it
records, here pure-torch stand-ins for vLLM's: packing, a tensor-parallel slice, B scaled by
an alpha/r that is not a power of two, zero padding to a larger slot rank. The plan's images
must equal the path's bit for bit on real values; a path that computes rather than moves
elements is refused. On a real engine: ``tests/engine/test_lora_engine.py``."""

from __future__ import annotations

import pytest
import torch

from inflight.engine.commit.lora_plan import SlotPlan

SCALE = 32 / 12  # alpha / r


def _tensors(rank: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q.lora_A.weight": (rank, 6), "q.lora_B.weight": (10, rank), "k.lora_A.weight": (rank, 6),
              "k.lora_B.weight": (4, rank), "o.lora_A.weight": (rank, 10), "o.lora_B.weight": (6, rank)}
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes.items()}


def _path(slot_rank: int, tp_rank: int = 1):
    """Like vLLM's: q and k packed into one wrapper (two slices), B scaled, the column-parallel
    B sliced by rows and the row-parallel A by columns (TP=2, this rank's half), zero padding."""
    def run(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        dtype = t["q.lora_A.weight"].dtype
        r = t["q.lora_A.weight"].shape[0]
        images = []
        for a, b in (("q.lora_A.weight", "q.lora_B.weight"), ("k.lora_A.weight", "k.lora_B.weight")):
            out = t[b].shape[0] // 2
            img_a = torch.zeros(slot_rank, 6, dtype=dtype)
            img_a[:r] = t[a]
            img_b = torch.zeros(out, slot_rank, dtype=dtype)
            img_b[:, :r] = (t[b] * SCALE)[tp_rank * out:(tp_rank + 1) * out]
            images += [img_a, img_b]
        img_a = torch.zeros(slot_rank, 5, dtype=dtype)
        img_a[:r] = t["o.lora_A.weight"][:, tp_rank * 5:(tp_rank + 1) * 5]
        img_b = torch.zeros(6, slot_rank, dtype=dtype)
        img_b[:, :r] = t["o.lora_B.weight"] * SCALE
        return images + [img_a, img_b]
    return run


@pytest.mark.parametrize("rank, slot_rank, indexed", [(8, 8, 1), (3, 8, 4)])
def test_the_plan_writes_the_paths_images_bit_for_bit(rank: int, slot_rank: int, indexed: int) -> None:
    path = _path(slot_rank)
    tensors = _tensors(rank)
    plan = SlotPlan.record(tensors, path, torch.float32, torch.device("cpu"))
    # gathered through an index: the row-parallel A's column slice (runs of 5), and with rank 3
    # in a slot of 8 every B too (runs of 3); the rest copied as runs
    assert plan.counts()[1] == indexed
    for seed in range(3):
        tensors = _tensors(rank, seed=seed)
        got, want = plan.images(tensors), path(tensors)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w)


def test_a_path_that_computes_is_refused() -> None:
    def summed(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        a = t["q.lora_A.weight"].reshape(-1)
        return [a[:-1] + a[1:]]  # neighbours added: no element is a copy of one adapter element

    with pytest.raises(ValueError, match="scale"):
        SlotPlan.record(_tensors(8), summed, torch.float32, torch.device("cpu"))

    def two_scales(t: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        img = torch.zeros(8, 8, dtype=t["q.lora_B.weight"].dtype)
        img[:, :3] = t["q.lora_B.weight"][:8] * 2.0
        img[:2, 4:7] = t["k.lora_B.weight"][:2] * 3.0
        return [img]

    with pytest.raises(ValueError, match="more than one scale"):
        SlotPlan.record(_tensors(3), two_scales, torch.float32, torch.device("cpu"))
