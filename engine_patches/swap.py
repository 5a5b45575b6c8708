"""The ``swap`` commit: all the work of loading a version happens before the commit, off
the engine's critical path, and the commit itself only swaps module attributes.

Why it is needed: on CPU a commit through vLLM's layerwise reload re-packs every linear
weight for oneDNN inside the stall (tens of ms even for a tiny model; creating the oneDNN
handles alone is ~5 ms per layer here). vLLM routes each checkpoint tensor through a
per-parameter ``weight_loader`` that writes into whatever parameter it is handed, and the
CPU GEMM dispatch keeps its result in plain module attributes (``cpu_linear``, an empty
``weight``). So, in the listener thread:

1. ``RoutingPlan.record`` (once, at start): run the model's own ``load_weights`` with
   recording loaders to learn, for each checkpoint name, which parameter's loader takes it
   and with which shard arguments. A model whose ``load_weights`` transforms tensors on the
   way (anything but plain routing) is refused, and the caller falls back to ``reload``.
2. ``SwapApplier.prepare``: materialise shadow parameters from the pre-processing metadata
   vLLM recorded at model construction, feed the staged tensors through the real loaders
   into them, and run each layer's ``process_weights_after_loading`` on a shallow copy of
   the layer (the re-pack). Live modules are not touched; a failure here refuses the update.
3. ``SwapApplier.apply`` (under the step gate's lock): assign the prepared parameters and
   attributes to the live modules, keeping the previous ones for an instant rollback.

Only for eager CPU engines: compiled graphs and CUDA graphs capture parameter storage, so
there the copy-into-storage commits are the right ones.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_STRUCTURAL = frozenset({"_parameters", "_buffers", "_modules"})


class RoutingError(RuntimeError):
    """The model's load_weights does more than route tensors to loaders."""


@dataclass(frozen=True)
class _Route:
    param_id: int  # id() of the live parameter the loader writes into
    args: tuple
    kwargs: dict


@dataclass
class RoutingPlan:
    routes: dict[str, list[_Route]]  # checkpoint name -> loader calls

    @classmethod
    def record(cls, model: torch.nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> RoutingPlan:
        params = {id(p): p for p in model.parameters()}  # each shared parameter once
        saved = {pid: p.__dict__.get("weight_loader") for pid, p in params.items()}
        calls: list[tuple[int, torch.Tensor, tuple, dict]] = []

        def recorder(pid: int):
            def record(param, loaded, *args, **kwargs):
                calls.append((pid, loaded, args, kwargs))
            return record

        routes: dict[str, list[_Route]] = {}
        try:
            for pid, p in params.items():
                try:
                    p.weight_loader = recorder(pid)
                except AttributeError as e:  # a parameter class with a read-only loader property
                    raise RoutingError(f"cannot intercept the loader of a {type(p).__name__}: {e}") from None
            for name, (shape, dtype) in shapes.items():
                probe = torch.empty(shape, dtype=dtype, device="meta")
                calls.clear()
                model.load_weights(iter([(name, probe)]))
                for pid, loaded, args, kwargs in calls:
                    if loaded is not probe:
                        raise RoutingError(f"{type(model).__name__}.load_weights transforms {name!r} before loading")
                routes[name] = [_Route(pid, args, kwargs) for pid, _, args, kwargs in calls]
            covered = {r.param_id for rs in routes.values() for r in rs}
            bare = [n for n, p in model.named_parameters() if id(p) not in covered]
            if bare:  # a shadow of these would stay uninitialised
                raise RoutingError(f"no checkpoint tensor loads {bare[:3]}")
        finally:
            for pid, p in params.items():
                if saved[pid] is None:
                    p.__dict__.pop("weight_loader", None)
                else:
                    p.weight_loader = saved[pid]
        return cls(routes)


@dataclass
class _ModuleState:
    module: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    attrs: dict[str, Any] = field(default_factory=dict)


_MISSING = object()


class SwapApplier:
    strategy = "swap"

    def __init__(self, model: torch.nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.model = model
        self.plan = RoutingPlan.record(model, shapes)
        self._owners: list[torch.nn.Module] = [m for m in model.modules() if m._parameters]
        # Slots are (module, name), fixed now: a swap replaces the parameter objects, and a
        # tied parameter's slots share one key (the id of the object they shared at start).
        self._slot_key: dict[tuple[int, str], int] = {}
        # pre-processing templates per key: what the parameter looked like before the CPU
        # re-pack, with the module whose bound weight loader it carries
        self._templates: dict[int, tuple[torch.Tensor, torch.nn.Module]] = {}
        for m in self._owners:
            meta_params, _ = get_layerwise_info(m).restore_metadata
            for name, live in m._parameters.items():
                if live is None:
                    continue
                self._slot_key[(id(m), name)] = id(live)
                self._templates.setdefault(id(live), (meta_params.get(name, live), m))
        self._prepared: list[_ModuleState] | None = None
        self._previous: list[_ModuleState] | None = None

    def prepared_bytes(self) -> int:
        """Bytes of one set of shadow parameters (before the CPU re-pack, which holds about as much again)."""
        return sum(t.numel() * t.element_size() for t, _ in self._templates.values())

    @staticmethod
    def _shadow(template: torch.Tensor, owner: torch.nn.Module) -> torch.nn.Parameter:
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        if template.is_meta:  # recorded metadata: its loaders were unbound from the layer
            return restore_layer_refs(materialize_meta_tensor(template), owner)
        shadow = torch.empty_like(template, device="cpu")
        shadow.__class__ = template.__class__
        shadow.__dict__ = template.__dict__.copy()
        return shadow

    @torch.no_grad()
    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load and process ``weights`` into shadow modules; live modules are untouched."""
        shadows = {pid: self._shadow(t, owner) for pid, (t, owner) in self._templates.items()}
        for name, tensor in weights.items():
            for route in self.plan.routes[name]:
                target = shadows[route.param_id]
                loader = getattr(target, "weight_loader", None)  # vLLM's v2 parameters expose it as a property
                if loader is None:
                    from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader
                loader(target, tensor, *route.args, **route.kwargs)
        states: list[_ModuleState] = []
        for live in self._owners:
            twin = copy.copy(live)  # new __dict__; give it its own parameter and buffer dicts
            twin._parameters = {n: (shadows[self._slot_key[(id(live), n)]] if p is not None else None)
                                for n, p in live._parameters.items()}
            twin._buffers = dict(live._buffers)
            before = dict(twin.__dict__)
            method = getattr(live, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(twin)  # e.g. the oneDNN re-pack, into twin's attributes
            attrs = {k: v for k, v in twin.__dict__.items()
                     if k not in _STRUCTURAL and before.get(k, _MISSING) is not v}
            states.append(_ModuleState(live, dict(twin._parameters), attrs))
        self._prepared = states

    def discard(self) -> None:
        self._prepared = None

    def apply(self) -> None:
        """Swap the prepared state in (call under the step gate's lock)."""
        if self._prepared is None:
            raise RuntimeError("swap commit without a prepared version")
        previous = self._swap(self._prepared)
        self._prepared, self._previous = None, previous

    def rollback(self) -> bool:
        """Swap the version before the last commit back in; False if there is none."""
        if self._previous is None:
            return False
        self._previous = self._swap(self._previous)
        return True

    def restore(self, previous: object) -> None:
        """After a failed ``apply``: nothing to do, it swapped every module or none (``_swap``)."""

    def undo(self, previous: object) -> None:
        """Take back a successful ``apply`` (another rank of the engine failed its commit)."""
        if not self.rollback():
            raise RuntimeError("no applied version to take back")
        self._previous = None  # what rollback swapped out is the refused version: never to be swapped back

    def release_rollback(self) -> None:
        """The engine committed: drop the previous weights (``keep_rollback=False``)."""
        self._previous = None

    @classmethod
    def _swap(cls, states: list[_ModuleState]) -> list[_ModuleState]:
        old = [_ModuleState(s.module, {n: s.module._parameters[n] for n in s.params},
                            {k: s.module.__dict__.get(k, _MISSING) for k in s.attrs}) for s in states]
        done = 0
        try:
            for s in states:
                cls._assign(s)
                done += 1
        except BaseException:
            for s in old[:done]:  # all or nothing
                cls._assign(s)
            raise
        return old

    @staticmethod
    def _assign(s: _ModuleState) -> None:
        m = s.module
        m._parameters.update(s.params)
        for k, v in s.attrs.items():
            if v is _MISSING:
                m.__dict__.pop(k, None)
            else:
                m.__dict__[k] = v
