"""A recorded copy plan for the ``lora`` commit's slot images: ``prepare`` in a few tensor ops.

vLLM's path from PEFT tensors to a slot (``LoRAModel.from_lora_tensors``, q/k/v and
gate/up packing, alpha/r folded into B, each wrapper's ``set_lora`` with its tensor-parallel
slice and zero padding) moves elements and multiplies some by a scale; it computes nothing
else. So it is recorded once, at start, by running that very path on two probes in float64
on the host: every element holding its own (1-based) index, then every element 1.0, which
leaves each slot element's scale. Read back, per image: runs of consecutive elements (source
tensor, source offset, slot offset, length, scale), or, where runs are short (an adapter of
a lower rank than the slot pads every row of B), an index into all sources.

Applying it is a zero fill, one ``_foreach_copy_``, one ``_foreach_mul_`` per scale and an
``index_select`` per indexed image: a few tensor ops of the listener thread's time, and of
the GIL it shares with the engine thread, instead of a Python loop over every wrapped layer.
``LoRASlotStrategy`` trusts a plan only once it wrote, from the first version, bit for bit
what vLLM's own load wrote into the live slot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

Images = Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]
"""vLLM's path, recorded: float64 host tensors by PEFT name -> the slot's images, in order."""

SHORT_RUN = 16  # mean elements per run below which an image is gathered through an index


@dataclass(frozen=True)
class _Runs:
    src: list[int]  # per run: index into the plan's names
    src_at: list[int]
    dst_at: list[int]  # offset in the flat image buffer
    length: list[int]
    scale: list[float]


class SlotPlan:
    """Where each slot element comes from; ``images`` applies it to one version's tensors."""

    def __init__(self, names: list[str], shapes: list[torch.Size], dtype: torch.dtype, device: torch.device,
                 runs: _Runs, indexed: list[tuple[int, torch.Tensor, float]],
                 images: list[tuple[int, torch.Size]]) -> None:
        self.names, self._shapes, self.dtype, self.device = names, shapes, dtype, device
        self._runs, self._indexed, self._images = runs, indexed, images
        self.numel = sum(s.numel() for _, s in images)
        self._by_scale: dict[float, list[int]] = {}
        for i, s in enumerate(runs.scale):
            if s != 1.0:
                self._by_scale.setdefault(s, []).append(i)

    @classmethod
    def record(cls, tensors: Mapping[str, torch.Tensor], run_vllm: Images, dtype: torch.dtype,
               device: torch.device) -> SlotPlan:
        """Record vLLM's path on ``tensors``' names and shapes. Raises ``ValueError`` where it
        does more than move and scale elements (the caller keeps vLLM's path then)."""
        names = sorted(tensors)
        shapes = [tensors[n].shape for n in names]
        starts = torch.tensor([0] + [s.numel() for s in shapes], dtype=torch.float64).cumsum(0)
        ids = {n: torch.arange(starts[i] + 1, starts[i + 1] + 1, dtype=torch.float64).view(shapes[i])
               for i, n in enumerate(names)}
        with torch.no_grad():
            by_id = run_vllm(ids)
            scales = run_vllm({n: torch.ones(s, dtype=torch.float64) for n, s in zip(names, shapes)})
        runs = _Runs([], [], [], [], [])
        indexed: list[tuple[int, torch.Tensor, float]] = []
        images, at = [], 0
        for image, scale in zip(by_id, scales):
            v, w = image.reshape(-1), scale.reshape(-1)
            pos = torch.nonzero(w).reshape(-1)
            if not torch.equal(torch.nonzero(v).reshape(-1), pos):
                raise ValueError("a slot element that is not a scaled copy of one adapter element")
            gid = torch.round(v[pos] / w[pos]).to(torch.int64)  # 1-based, over every source
            if (bool((gid < 1).any()) or bool((gid > starts[-1]).any())
                    or not torch.equal(gid.double() * w[pos], v[pos])):
                raise ValueError("a slot element is not an adapter element times its scale")
            breaks = _breaks(pos, gid, w[pos], starts)
            if pos.numel() and pos.numel() < SHORT_RUN * int(breaks.sum()):
                if not bool((w[pos] == w[pos[0]]).all()):
                    raise ValueError("an image gathered through an index has more than one scale")
                index = torch.zeros(v.numel(), dtype=torch.int64)
                index[pos] = gid  # 0: the zero in front of the concatenated sources
                small = torch.int32 if starts[-1] < 2**31 else torch.int64
                indexed.append((at, index.to(device=device, dtype=small), float(w[pos[0]])))
            else:
                _add_runs(runs, pos, gid, w[pos], starts, at, breaks)
            images.append((at, image.shape))
            at += v.numel()
        return cls(names, shapes, dtype, device, runs, indexed, images)

    def counts(self) -> tuple[int, int]:
        """(copied runs, images gathered through an index)."""
        return len(self._runs.length), len(self._indexed)

    def index_bytes(self) -> int:
        return sum(i.numel() * i.element_size() for _, i, _ in self._indexed)

    @torch.no_grad()
    def images(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """One version's slot images, views of one new buffer; ``tensors`` in the plan's
        dtype and device, by PEFT name (the staged views)."""
        flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        src = [tensors[n].reshape(-1) for n in self.names]
        r = self._runs
        dst = [flat.narrow(0, d, n) for d, n in zip(r.dst_at, r.length)]
        if dst:
            torch._foreach_copy_(dst, [src[s].narrow(0, a, n) for s, a, n in zip(r.src, r.src_at, r.length)])
        for scale, which in self._by_scale.items():
            torch._foreach_mul_([dst[i] for i in which], scale)
        if self._indexed:
            every = torch.cat([flat.new_zeros(1)] + [t.to(self.device) for t in src])
            for at, index, scale in self._indexed:
                out = flat.narrow(0, at, index.numel())
                torch.index_select(every, 0, index, out=out)
                if scale != 1.0:
                    out.mul_(scale)
        return [flat.narrow(0, at, shape.numel()).view(shape) for at, shape in self._images]


def _breaks(pos: torch.Tensor, gid: torch.Tensor, scale: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """Where a new run starts: the slot or the source position jumps, or the source tensor or
    the scale changes."""
    src = torch.searchsorted(starts, gid.double() - 1, right=True)
    jump = (pos.diff() != 1) | (gid.diff() != 1) | (src.diff() != 0) | (scale.diff() != 0)
    return torch.cat([torch.ones(1, dtype=torch.bool), jump])


def _add_runs(runs: _Runs, pos: torch.Tensor, gid: torch.Tensor, scale: torch.Tensor, starts: torch.Tensor,
              at: int, breaks: torch.Tensor) -> None:
    if not pos.numel():
        return
    first = torch.nonzero(breaks).reshape(-1)
    ends = torch.cat([first[1:], torch.tensor([pos.numel()])])
    src = torch.searchsorted(starts, gid[first].double() - 1, right=True) - 1
    runs.src.extend(src.tolist())
    runs.src_at.extend((gid[first] - 1 - starts[src].to(torch.int64)).tolist())
    runs.dst_at.extend((pos[first] + at).tolist())
    runs.length.extend((ends - first).tolist())
    runs.scale.extend(scale[first].tolist())
