"""Where each checkpoint tensor goes: the model's own ``load_weights``, run once at start on
meta tensors with recording loaders (``RoutingPlan.record``), for the ``swap`` commit.

For each checkpoint name it learns which parameter's loader takes it and with which
arguments, positional or keyword (FusedMoE: ``loaded_weight=``, ``expert_id=``, ...). A
model whose ``load_weights`` transforms tensors on the way (anything but plain routing, or a
view reading the same elements) is refused with ``RoutingError``, and the caller falls back
to ``reload``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


class RoutingError(RuntimeError):
    """The model's load_weights does more than route tensors to loaders."""


# Placeholders in a recorded loader call: the parameter it writes into, the tensor it loads.
_PARAM = object()
_TENSOR = object()


@dataclass(frozen=True)
class Route:
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
class RoutingPlan:
    routes: dict[str, list[Route]]  # checkpoint name -> loader calls

    @classmethod
    def record(cls, model: torch.nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> RoutingPlan:
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

        routes: dict[str, list[Route]] = {}
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
                routes[name] = [cls._route(model, name, params[pid], pid, probe, args, kwargs) for pid, args, kwargs in calls]
            covered = {r.param_id for rs in routes.values() for r in rs}
            bare = [n for n, p in model.named_parameters() if id(p) not in covered]
            if bare:  # a shadow of these would stay uninitialised
                raise RoutingError(f"no checkpoint tensor loads {bare[:3]}")
        finally:
            for pid, p in params.items():
                own, loader = saved[pid]
                if own:
                    p.__dict__["weight_loader"] = loader
                else:
                    p.__dict__.pop("weight_loader", None)
                    if loader is not None and getattr(p, "weight_loader", None) is not loader:
                        p.weight_loader = loader  # through the property
        return cls(routes)

    @staticmethod
    def _route(model: torch.nn.Module, name: str, param: torch.Tensor, pid: int, probe: torch.Tensor,
               args: tuple, kwargs: dict) -> Route:
        def mark(v: Any) -> Any:
            if v is param:
                return _PARAM
            return _TENSOR if _same_elements(v, probe) else v
        args, kwargs = tuple(mark(a) for a in args), {k: mark(v) for k, v in kwargs.items()}
        marks = [v for v in (*args, *kwargs.values()) if v is _PARAM or v is _TENSOR]
        if marks.count(_PARAM) != 1 or marks.count(_TENSOR) != 1:
            # a slice, a transpose, a concatenation: the loader gets something else than the tensor
            raise RoutingError(f"{type(model).__name__}.load_weights transforms {name!r} before loading")
        if any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values())):
            raise RoutingError(f"{type(model).__name__}.load_weights passes other tensors along with {name!r}")
        return Route(pid, args, kwargs)
