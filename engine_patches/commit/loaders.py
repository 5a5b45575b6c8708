"""How checkpoint tensors reach the parameters: the model's own loaders, learned once at
start, replayed per update, and vLLM's processing of freshly loaded weights re-run after them.

The loader map (``LoaderMap``, for the ``swap`` commit): the model's own ``load_weights``, run once at start on
meta tensors with recording loaders (``LoaderMap.record``), learns for each checkpoint name which parameter's
loader takes it and with which arguments, positional or keyword (FusedMoE: ``loaded_weight=``, ``expert_id=``,
...). A model whose ``load_weights`` transforms tensors on the way (anything but a plain loader call, or a view
reading the same elements) is refused with ``LoaderMapError``, and the caller falls back to ``reload``.

The load plan (``LoadPlan``): where each checkpoint tensor lands inside the parameters, learned once at start by
running each routed loader call under a ``TorchDispatchMode`` on a real scratch parameter and probe tensor, and
replayed per update as one ``torch._foreach_copy_``. Invariant: a tensor is planned only when every write of its
loaders is a plain ``copy_`` of the probe (or a view of it) into the parameter (or a view of it), with the same
dtype; anything else keeps it on its loader. Replaying is exactly what the loader did, since where a loader
writes depends on shapes and its arguments, never on the values it loads. Why and how: docs/design.md.

Post-load processing (``process_after_loading``): vLLM runs each layer's ``process_weights_after_loading`` once,
after the first load (the CPU oneDNN prepack, the CPU MoE grouped-GEMM pack, quantization); a weight update
re-runs what that step derived from the weights, on whichever module holds the new ones. ``copy_refusals``
names the layers for which a plain copy, with no such processing, would be wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from inflight.protocol import ShardPlan
from inflight.shard_plan import Box, bounding, box_of_view, make_plan, whole

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
"""Checkpoint name -> (shape, dtype): what an update carries, as the strategies are built with."""


# the loader map ---------------------------------------------------------------------------

class LoaderMapError(RuntimeError):
    """The model's load_weights does more than route tensors to loaders."""


# Placeholders in a recorded loader call: the parameter it writes into, the tensor it loads.
_PARAM = object()
_TENSOR = object()


@dataclass(frozen=True)
class LoaderCall:
    param_id: int  # id() of the live parameter the loader writes into
    args: tuple  # the loader's positional arguments, with _PARAM / _TENSOR where those went
    kwargs: dict  # its keyword arguments, likewise (FusedMoE: param=, loaded_weight=, expert_id=, ...)

    def call(self, loader: Any, target: torch.Tensor, tensor: torch.Tensor) -> Any:
        def fill(v: Any) -> Any:
            return target if v is _PARAM else tensor if v is _TENSOR else v
        return loader(*(fill(a) for a in self.args), **{k: fill(v) for k, v in self.kwargs.items()})


def _same_elements(loaded: Any, probe: torch.Tensor) -> bool:
    """``loaded`` reads exactly ``probe``'s elements in ``probe``'s layout: ``probe`` itself or
    a trivial view of it (FusedMoE's loader hands each expert on as ``t.unsqueeze(0).unbind()[0]``)."""
    if loaded is probe:
        return True
    return (isinstance(loaded, torch.Tensor) and loaded._base is probe and loaded.shape == probe.shape
            and loaded.stride() == probe.stride() and loaded.storage_offset() == probe.storage_offset())


@dataclass
class LoaderMap:
    calls: dict[str, list[LoaderCall]]  # checkpoint name -> loader calls

    @classmethod
    def record(cls, model: torch.nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> LoaderMap:
        params = {id(p): p for p in model.parameters()}  # each shared parameter once
        # a loader is an attribute of the parameter, or (vLLM's v2 parameters) a property over
        # a private one: both are put back as they were, or the live model loads with ours
        saved = {pid: ("weight_loader" in p.__dict__, getattr(p, "weight_loader", None)) for pid, p in params.items()}
        calls: list[tuple[int, tuple, dict]] = []

        def recorder(pid: int):
            # Loaders are called positionally (``loader(param, w, shard_id)``) or by keyword
            # (FusedMoE: ``loader(param=, loaded_weight=, weight_name=, shard_id=, expert_id=,
            # return_success=True)``): record the call as made.
            def record(*args: Any, **kwargs: Any) -> bool | None:
                calls.append((pid, args, kwargs))
                return True if kwargs.get("return_success") else None  # "loaded": the caller goes on as at load
            return record

        calls_of: dict[str, list[LoaderCall]] = {}
        try:
            for pid, p in params.items():
                try:
                    p.weight_loader = recorder(pid)
                except AttributeError as e:  # a parameter class with a read-only loader property
                    raise LoaderMapError(f"cannot intercept the loader of a {type(p).__name__}: {e}") from None
            for name, (shape, dtype) in shapes.items():
                probe = torch.empty(shape, dtype=dtype, device="meta")
                calls.clear()
                model.load_weights(iter([(name, probe)]))
                calls_of[name] = [cls._call_of(model, name, params[pid], pid, probe, args, kwargs)
                                  for pid, args, kwargs in calls]
            covered = {r.param_id for rs in calls_of.values() for r in rs}
            bare = [n for n, p in model.named_parameters() if id(p) not in covered]
            if bare:  # a shadow of these would stay uninitialised
                raise LoaderMapError(f"no checkpoint tensor loads {bare[:3]}")
        finally:
            for pid, p in params.items():
                own, loader = saved[pid]
                if own:
                    p.__dict__["weight_loader"] = loader
                else:
                    p.__dict__.pop("weight_loader", None)
                    if loader is not None and getattr(p, "weight_loader", None) is not loader:
                        p.weight_loader = loader  # through the property
        return cls(calls_of)

    @staticmethod
    def _call_of(model: torch.nn.Module, name: str, param: torch.Tensor, pid: int, probe: torch.Tensor,
               args: tuple, kwargs: dict) -> LoaderCall:
        def mark(v: Any) -> Any:
            if v is param:
                return _PARAM
            return _TENSOR if _same_elements(v, probe) else v
        args, kwargs = tuple(mark(a) for a in args), {k: mark(v) for k, v in kwargs.items()}
        marks = [v for v in (*args, *kwargs.values()) if v is _PARAM or v is _TENSOR]
        if marks.count(_PARAM) != 1 or marks.count(_TENSOR) != 1:
            # a slice, a transpose, a concatenation: the loader gets something else than the tensor
            raise LoaderMapError(f"{type(model).__name__}.load_weights transforms {name!r} before loading")
        if any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values())):
            raise LoaderMapError(f"{type(model).__name__}.load_weights passes other tensors along with {name!r}")
        return LoaderCall(pid, args, kwargs)


# the load plan ------------------------------------------------------------------------------
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
                    and _same_storage(src, self.probe)
                    and dst.dtype == src.dtype == self.target.dtype == self.probe.dtype
                    and dst.shape == src.shape):
                self.copies.append((_view_of(dst, self.target),
                                    None if _whole(src, self.probe) else _view_of(src, self.probe)))
            elif (func is torch.ops.aten.fill_.Scalar and isinstance(dst, torch.Tensor)
                    and _same_storage(dst, self.target) and dst.dtype == self.target.dtype):
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
               calls_of: Mapping[str, Iterable[tuple[int, Callable[[torch.Tensor, torch.Tensor], object]]]],
               scratch: Mapping[int, torch.Tensor]) -> LoadPlan:
        """``calls_of[name]``: (key, call) pairs, ``call(target, tensor)`` running the loader;
        ``scratch[key]``: a parameter of that key's pre-processing shape to record into."""
        writes: list[Write] = []
        fills: list[tuple[int, str, View, float]] = []
        loaded: set[str] = set()
        for name, (shape, dtype) in shapes.items():
            probe = torch.empty(shape, dtype=dtype)  # real memory: the recorded views must be real views
            found: list[Write] = []
            found_fills: list[tuple[int, str, View, float]] = []
            for key, call in calls_of[name]:
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


# post-load processing -----------------------------------------------------------------------

def process_after_loading(module: torch.nn.Module) -> None:
    """Re-run ``module``'s processing of freshly loaded weights, as a weight update needs it.

    vLLM's unquantized FusedMoE method knows a first load from an update: on an update
    (its expert kernel already built) it copies the loaded weights into the live storage,
    which CUDA graphs captured, and skips the experts' own processing. On CPU that step is
    the grouped-GEMM prepack (``CPUUnquantizedExperts.process_weights_after_loading``), so
    an update (vLLM's layerwise reload included) would leave unpacked bytes in a packed
    layout: measured here, log-probs off by 1.06 on a tiny Qwen3-MoE. Run it here, after the
    method, on whatever module holds the new weights (the live layer, or a swap's twin)."""
    method = getattr(module, "quant_method", None)
    if method is None or not hasattr(method, "process_weights_after_loading"):
        return
    method.process_weights_after_loading(module)
    kernel = getattr(method, "moe_kernel", None)
    if kernel is not None and cpu_unquantized_moe(method):
        kernel.fused_experts.process_weights_after_loading(module)


def cpu_unquantized_moe(method: Any) -> bool:
    """Whether ``method`` is vLLM's unquantized FusedMoE method on its CPU backend."""
    try:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without these: nothing of this kind to repair
        return False
    return isinstance(method, UnquantizedFusedMoEMethod) and method.unquantized_backend == UnquantizedMoeBackend.CPU


def reprocess(modules: list[torch.nn.Module]) -> None:
    """``process_after_loading`` on each of ``modules``."""
    for module in modules:
        process_after_loading(module)


def modules_sharing_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules holding a parameter another module holds too (a tied LM head and its
    embedding): a reload gives the head no tensor of its own, so its derived state must be
    rebuilt from the embedding it shares."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(module)
    return [m for ms in owners.values() if len(ms) > 1 for m in ms]


KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".prob_scale")
"""Checkpoint tensors an FP8 KV cache reads: attention's processing derives its float scales from them."""


def copy_refusals(model: torch.nn.Module, names: Collection[str] = ()) -> list[str]:
    """The layer kinds of ``model`` that a plain copy commit (``load_weights`` into the live
    storage, no post-load processing) would leave wrong on a GPU, by name; ``names``: the
    checkpoint's tensors (what an update carries).

    vLLM's post-load processing derives state from weights: MLA attention keeps ``W_UK_T`` and
    ``W_UV`` computed from ``kv_b_proj``; FlashInfer MoE backends re-lay the experts (CUTLASS
    swaps the w1/w3 halves, TRTLLM re-blocks); quantized methods repack. A copy leaves that
    state at the old version, silently. Proven to need none on CUDA: unquantized linear and
    embedding layers (their processing only prepacks on CPU), layers with no processing of
    their own (norms), and plain ``Attention`` while the checkpoint holds no KV-cache scales
    (its processing derives float scales from them: with scales in an update, a copy would
    leave those at the old version). Anything else is named here, and the copy commit is not
    used."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    copy_safe_methods = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    scales = any(n.endswith(KV_SCALE_SUFFIXES) for n in names)
    found: set[str] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if module._parameters and method is not None and type(method) not in copy_safe_methods:
            found.add(f"{type(module).__name__} ({type(method).__name__})")
        elif type(module) is Attention and scales:
            found.add("Attention (KV-cache scales in the checkpoint)")
        elif type(module) is not Attention and any("process_weights_after_loading" in vars(c)
                                                   for c in type(module).__mro__ if c is not torch.nn.Module):
            found.add(type(module).__name__)
    return sorted(found)
