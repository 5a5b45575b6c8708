"""A load plan: where each checkpoint tensor lands inside the parameters, learned once at start.

Why: an update of a 30-layer model goes through ~270 vLLM weight loaders, each a few
Python-level tensor ops (narrow, checks, copy). On an in-flight CPU engine they run on the
listener thread, which shares the engine's GIL with decoding: every op hands the GIL back
and forth with the decode thread, so the loaders cost far more wall time than their copies.
The plan replaces them with one ``torch._foreach_copy_`` per update (the GIL is released
once, for all the copies).

How: at start, each routed loader call runs once under a ``TorchDispatchMode`` on a real
scratch parameter and a real probe tensor, and the mode sees every ATen op the loader runs.
A checkpoint tensor is planned when every write of its loaders is a plain ``copy_`` of the
probe (or a view of it) into the parameter (or a view of it), with the same dtype: the plan
keeps those views' shapes, strides and offsets. Anything else (a cast, a computed tensor,
a write into any other tensor) keeps that tensor on its loader. Replaying the recorded
copies is exactly what the loader did, since a loader's routing depends on shapes and its
arguments, never on the values it loads; the engine tests check the result against
transformers after updates, with the plan and without it.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inflight.protocol import ShardPlan
from inflight.shard_plan import Box, bounding, box_of_view, make_plan, whole

View = tuple[tuple[int, ...], tuple[int, ...], int]  # shape, stride, element offset from the base's own offset


@dataclass(frozen=True)
class Write:
    """One recorded copy: ``target[key]`` viewed as ``dst`` receives ``weights[name]`` viewed as ``src``."""

    key: int
    name: str
    dst: View
    src: View | None  # None: the whole tensor, as staged


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _view_of(t: torch.Tensor, base: torch.Tensor) -> View:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset() - base.storage_offset()


def _whole(t: torch.Tensor, base: torch.Tensor) -> bool:
    return t.shape == base.shape and t.stride() == base.stride() and t.storage_offset() == base.storage_offset()


class _Recorder(TorchDispatchMode):
    """Runs every op as it is, noting the copies from ``probe`` into ``target``, constant fills of
    ``target``, and any other write."""

    def __init__(self, target: torch.Tensor, probe: torch.Tensor) -> None:
        super().__init__()
        self.target, self.probe = target, probe
        self.copies: list[tuple[View, View | None]] = []
        self.fills: list[tuple[View, float]] = []  # padding a loader zeroes (a vocabulary padded to a multiple)
        self.foreign: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            dst, src = (tuple(args) + (None, None))[:2]
            if (func is torch.ops.aten.copy_.default and isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor)
                    and _same_storage(dst, self.target)
                    and _same_storage(src, self.probe) and dst.dtype == src.dtype == self.target.dtype == self.probe.dtype
                    and dst.shape == src.shape):
                self.copies.append((_view_of(dst, self.target), None if _whole(src, self.probe) else _view_of(src, self.probe)))
            elif (func is torch.ops.aten.fill_.Scalar and isinstance(dst, torch.Tensor) and _same_storage(dst, self.target)
                    and dst.dtype == self.target.dtype):
                if dst.numel():  # an empty fill (no padding rows, the usual case) writes nothing
                    self.fills.append((_view_of(dst, self.target), float(src)))
            else:
                self.foreign.append(str(func))
        return func(*args, **kwargs)


@dataclass(frozen=True)
class LoadPlan:
    writes: tuple[Write, ...]
    """The planned copies, in checkpoint order."""
    loaded: frozenset[str]
    """Checkpoint tensors that still go through their loaders (anything the plan could not prove)."""
    fills: tuple[tuple[int, str, View, float], ...] = ()
    """(key, name, view, value): constant writes of ``name``'s planned loaders, replayed after its copies."""

    def writes_by_name(self) -> dict[str, list[int]]:
        """Indices into ``writes`` of each planned tensor's copies (for a plan run tensor by tensor)."""
        out: dict[str, list[int]] = {}
        for i, w in enumerate(self.writes):
            out.setdefault(w.name, []).append(i)
        return out

    @classmethod
    def record(cls, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
               routes: Mapping[str, Iterable[tuple[int, Callable[[torch.Tensor, torch.Tensor], object]]]],
               scratch: Mapping[int, torch.Tensor]) -> LoadPlan:
        """``routes[name]``: (key, call) pairs, ``call(target, tensor)`` running the loader;
        ``scratch[key]``: a parameter of that key's pre-processing shape to record into."""
        writes: list[Write] = []
        fills: list[tuple[int, str, View, float]] = []
        loaded: set[str] = set()
        for name, (shape, dtype) in shapes.items():
            probe = torch.empty(shape, dtype=dtype)  # real memory: the recorded views must be real views
            found: list[Write] = []
            found_fills: list[tuple[int, str, View, float]] = []
            for key, call in routes[name]:
                target = scratch[key]
                rec = _Recorder(target, probe)
                with torch.no_grad(), rec:
                    call(target, probe)
                if rec.foreign or not rec.copies:
                    loaded.add(name)
                    break
                found += [Write(key, name, dst, src) for dst, src in rec.copies]
                found_fills += [(key, name, view, value) for view, value in rec.fills]
            else:
                writes += found
                fills += found_fills
        return cls(tuple(writes), frozenset(loaded), tuple(fills))

    def fill(self, targets: Mapping[int, torch.Tensor], names: Container[str] | None = None) -> None:
        """Replay the constant writes (of ``names``' loaders only, if given)."""
        for key, name, (shape, stride, offset), value in self.fills:
            if names is not None and name not in names:
                continue
            base = targets[key].data
            base.as_strided(shape, stride, base.storage_offset() + offset).fill_(value)

    def destinations(self, targets: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """The views the planned copies write, into ``targets`` (key -> parameter)."""
        out = []
        for w in self.writes:
            base = targets[w.key].data
            shape, stride, offset = w.dst
            out.append(base.as_strided(shape, stride, base.storage_offset() + offset))
        return out

    def shard_plan(self, shapes: Mapping[str, tuple[int, ...]]) -> ShardPlan:
        """What these loaders read of each checkpoint tensor (``inflight.shard_plan``): the
        bounding box of its planned copies' sources; a tensor left on its loaders, or read
        through a view that is not a box of it, is a fallback (whole)."""
        boxes: dict[str, list[Box]] = {}
        fallbacks = set(self.loaded)
        for w in self.writes:
            full = shapes[w.name]
            box = whole(full) if w.src is None else box_of_view(*w.src, full)
            if box is None:
                fallbacks.add(w.name)
            else:
                boxes.setdefault(w.name, []).append(box)
        # a tensor no loader reads (none routed it) is sent whole too: the update names every tensor
        return make_plan({n: whole(shape) if n in fallbacks or n not in boxes else bounding(boxes[n])
                          for n, shape in shapes.items()}, fallbacks)

    def sources(self, weights: Mapping[str, torch.Tensor], indices: Iterable[int] | None = None,
                boxes: Mapping[str, tuple[Box, tuple[int, ...]]] | None = None) -> list[torch.Tensor]:
        """What the planned copies read from ``weights`` (those at ``indices`` only, if given).
        ``boxes``: name -> (box, full shape) for tensors staged as the box this worker's plan
        asked for (``shard_plan``) rather than whole: each copy then reads the same elements
        at their place inside the box."""
        out = []
        for w in self.writes if indices is None else (self.writes[i] for i in indices):
            t = weights[w.name]
            boxed = boxes.get(w.name) if boxes is not None else None
            if boxed is not None and tuple(t.shape) != boxed[1]:
                (start, _), full = boxed
                src = whole(full) if w.src is None else box_of_view(*w.src, full)
                assert src is not None, f"{w.name}: a copy reading outside a box was planned as a box"
                for d, (s, n) in enumerate(zip(*src)):
                    t = t.narrow(d, s - start[d], n)
            elif w.src is not None:
                shape, stride, offset = w.src
                t = t.as_strided(shape, stride, t.storage_offset() + offset)
            out.append(t)
        return out
