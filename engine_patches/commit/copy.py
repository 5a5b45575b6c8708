"""The ``copy`` commit: the staged tensors are written into the live storage at the commit,
inside the stall, for the whole model (``CopyStrategy``) or one layer group at a time
(``LayerCopyStrategy``, ``InflightConfig(commit_unit="layer")``).

``copy`` (CUDA, unquantized; CPU with ``INFLIGHT_CPU_PLAIN_GEMM=1``) replays the model's own loaders' writes from
a load plan (``inflight.engine.commit.loaders``) recorded at start against the live parameters: one
``torch._foreach_copy_`` from the staged tensors into views of the live storage (which CUDA graphs captured), the
loaders' constant fills, and the real loaders for the tensors the plan could not prove. Each tensor-parallel rank
stages (and keeps as its rollback copy) only the boxes its loaders read; a model whose loaders cannot be recorded
falls back to ``model.load_weights`` on whole tensors (logged). A layer group's commit replays the same for its
tensors only, on the forward's stream (``inflight.staging.ordered_commit``).

Invariants: the copy is right only where vLLM's processing of loaded weights derived nothing from them
(``loaders.copy_refusals``; on CPU, no prepacking GEMM: ``commit.base.cpu_gemm_prepacking``), so the live
parameters keep the checkpoint's layout and the recorded views stay valid for the engine's life. One layer
group at a time: prepared groups are applied in the order they were prepared (a FIFO, the order the listener
hands them over, one at a time); a group's previous bytes are copied aside when it is prepared, off the
stall (its parameters change only by its own commits, one update after another, so these are the bytes
the commit overwrites): ``undo`` (another rank failed this group) puts them back, and once the engine keeps
the commit they are dropped, so a rank holds at most ``window`` groups' copies beside the live weights.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from inflight.engine.commit.loaders import LoaderCall, LoaderMap, LoaderMapError, LoadPlan, Shapes
from inflight.layer_groups import LayerGroups
from inflight.protocol import ShardPlan
from inflight.shard_plan import Box
from inflight.staging import copy_into

log = logging.getLogger("inflight.commit")

Loader = Callable[[torch.Tensor, torch.Tensor], None]


class _CpuScratch(Mapping[int, torch.Tensor]):
    """id of a live parameter -> a fresh, uninitialised CPU tensor with its shape, strides,
    dtype, class and attributes (so its bound weight loader), made on each access and never
    kept. Why: a load plan records view geometry (shape, strides, offset), which does not
    depend on the device, and ``LoadPlan.record`` asks for one target per loader call, so a
    GPU engine records its plan with at most one parameter's bytes of host memory at a time
    instead of a model-sized copy."""

    def __init__(self, params: Mapping[int, torch.Tensor]) -> None:
        self._params = params

    def __getitem__(self, key: int) -> torch.Tensor:
        live = self._params[key]
        scratch = torch.empty_strided(tuple(live.shape), tuple(live.stride()), dtype=live.dtype, device="cpu")
        scratch.__class__ = live.__class__  # vLLM's parameter classes carry their loading methods
        scratch.__dict__ = live.__dict__.copy()
        return scratch

    def __iter__(self) -> Iterator[int]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


def _loader_call(route: LoaderCall) -> Loader:
    """``route``'s loader call on a given target (as ``SwapStrategy._loader_call``)."""
    def call(target: torch.Tensor, tensor: torch.Tensor) -> None:
        loader = getattr(target, "weight_loader", None)  # vLLM's v2 parameters expose it as a property
        if loader is None:
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader
        route.call(loader, target, tensor)
    return call


class CopyStrategy:
    """``copy``: the staged tensors are written into the live storage at commit, replaying
    the load plan (see the module docstring), or running ``load_weights`` where no plan
    could be recorded. Invariant (with a plan): the destination views are computed once, at
    start, from the live parameters; nothing replaces those parameters afterwards (the copy
    strategy is chosen only where vLLM's post-load processing leaves them as loaded).
    """

    name = "copy"

    def __init__(self, model_runner: Any, shapes: Shapes | None = None) -> None:
        self.runner = model_runner
        model = model_runner.get_model()
        self._weights: Mapping[str, torch.Tensor] | None = None
        self._sources: list[torch.Tensor] = []  # the prepared version's copy sources (views of its staged bytes)
        self.load_plan: LoadPlan | None = None
        self._params: dict[int, torch.Tensor] = {}
        self._destinations: list[torch.Tensor] = []
        self._fallbacks: dict[str, list[tuple[torch.Tensor, Loader]]] = {}
        self._params_of_name: dict[str, list[int]] = {}  # checkpoint name -> ids of the parameters its loaders write
        self._shard_plan: ShardPlan | None = None
        self._boxes: dict[str, tuple[Box, tuple[int, ...]]] = {}
        if shapes is not None:
            try:
                self._record(model, shapes)
            except Exception as e:  # load_weights on whole tensors is always right
                self.load_plan, self._params, self._destinations, self._fallbacks = None, {}, [], {}
                log.warning("inflight: no load plan for the copy commit of %s (%r): every rank stages whole tensors "
                            "and the commit runs load_weights", type(model).__name__, e)

    @classmethod
    def build(cls, model_runner: Any, shapes: Shapes, *, window: int = 2) -> CopyStrategy:
        """The strategy registry's constructor (``commit.base.make_strategy``); the whole
        model commits at once, so ``window`` is not used."""
        return cls(model_runner, shapes)

    def _record(self, model: torch.nn.Module, shapes: Shapes) -> None:
        """Record the load plan against the live parameters (CPU scratch in their geometry),
        its destination views into them, and the live loader calls of what it could not prove."""
        params = {id(p): p for p in model.parameters()}  # a tied parameter once, as LoaderMap keys it
        loader_map = LoaderMap.record(model, shapes)
        calls = {name: [(r.param_id, _loader_call(r)) for r in rs] for name, rs in loader_map.calls.items()}
        plan = LoadPlan.record(shapes, calls, _CpuScratch(params))
        self._destinations = plan.destinations(params)
        self._fallbacks = {name: [(params[pid], call) for pid, call in calls[name]] for name in plan.loaded}
        self._params = params
        self._params_of_name = {name: [r.param_id for r in rs] for name, rs in loader_map.calls.items()}
        self._shard_plan = plan.shard_plan({n: shape for n, (shape, _) in shapes.items()})
        # a tensor staged as the box this rank's plan asked for: its copies read inside the box
        self._boxes = {s.name: ((s.start, s.length), shapes[s.name][0]) for s in self._shard_plan.shards}
        self.load_plan = plan

    def feed(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Nothing to do per bucket: the commit writes every tensor at once."""

    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Keep the staged views; ``copy`` with a plan also builds its copy sources now, on the
        listener thread, so the stall runs only the copies."""
        self._sources = [] if self.load_plan is None else self.load_plan.sources(weights, None, self._boxes)
        self._weights = weights

    def shard_plan(self) -> ShardPlan | None:
        """What the recorded loaders read of each checkpoint tensor; without a plan: None,
        vLLM's loaders take whole checkpoint tensors."""
        return self._shard_plan

    def held_bytes(self) -> int:
        """The copy writes straight into the live storage: nothing (its recording scratch
        exists only at start, one parameter at a time)."""
        return 0

    def close(self) -> None:
        """No thread of its own."""

    def discard(self) -> None:
        self._weights, self._sources = None, []

    @torch.no_grad()
    def apply(self) -> None:
        if self._weights is None:
            raise RuntimeError("commit without a prepared version")
        weights, sources = self._weights, self._sources
        self._weights, self._sources = None, []
        if self.load_plan is None:
            self._write(weights)
        else:
            self._replay(weights, sources)

    def _write(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Whole checkpoint tensors through vLLM's ``load_weights`` (no plan could be recorded)."""
        self.runner.get_model().load_weights(iter(weights.items()))

    def _replay(self, weights: Mapping[str, torch.Tensor], sources: list[torch.Tensor]) -> None:
        """The plan's copies (``sources`` read ``weights``, whole or boxed), its fills, then the
        live loaders for the tensors it left to them (staged whole: the shard plan's fallbacks)."""
        assert self.load_plan is not None
        if self._destinations:
            copy_into(self._destinations, sources)
        self.load_plan.fill(self._params)
        for name, calls in self._fallbacks.items():
            for param, call in calls:
                call(param, weights[name])

    def release_rollback(self) -> None:
        """Nothing is held beyond the staged bytes, which the listener owns."""

    @torch.no_grad()
    def restore(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        """Put the last good weights back: the live version's bytes, kept in memory
        (``keep_rollback``; the weights the engine loaded are read into them at start, as this
        rank's boxes where the copy has a shard plan)."""
        if previous is None:
            raise RuntimeError("no rollback copy (keep_rollback=False)")
        if self.load_plan is None:
            self._write(previous)
        else:
            self._replay(previous, self.load_plan.sources(previous, None, self._boxes))

    undo = restore  # taking back a successful apply writes the same previous weights back


class LayerCopyStrategy(CopyStrategy):
    """``copy``, committing one layer group per commit."""

    needs_rollback_copy = False  # each group's previous bytes are copied aside at prepare

    def __init__(self, model_runner: Any, shapes: Shapes, *, window: int = 2) -> None:
        super().__init__(model_runner, shapes)
        if self.load_plan is None:
            raise LoaderMapError("the copy commit could not record a load plan for this model (see the log)")
        self.window = window
        self.groups = LayerGroups.of(shapes)
        writes = self.load_plan.writes_by_name()
        self._writes_of_group = [[i for n in names for i in writes.get(n, ())] for names in self.groups]
        self._params_of_group = [sorted({pid for n in names for pid in self._params_of_name.get(n, ())})
                                 for names in self.groups]
        self._prepared: deque[tuple[int, Mapping[str, torch.Tensor], list[torch.Tensor],
                                    dict[int, torch.Tensor]]] = deque()
        self._applied: dict[int, torch.Tensor] | None = None

    @classmethod
    def build(cls, model_runner: Any, shapes: Shapes, *, window: int = 2) -> LayerCopyStrategy:
        """The strategy registry's constructor (``commit.base.make_strategy``)."""
        return cls(model_runner, shapes, window=window)

    def group_bytes(self) -> list[int]:
        """Each group's parameter bytes on this rank (what its copy aside holds)."""
        sizes = {pid: p.numel() * p.element_size() for pid, p in self._params.items()}
        return [sum(sizes[pid] for pid in pids) for pids in self._params_of_group]

    def held_bytes(self) -> int:
        """``window`` groups' previous bytes, copied aside for ``undo``."""
        return self.window * max(self.group_bytes(), default=0)

    @torch.no_grad()
    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Group ``g``'s copy sources (views of its staged bytes) and its live bytes, aside."""
        assert self.load_plan is not None
        g = self.groups.group_of_update(weights)
        sources = self.load_plan.sources(weights, self._writes_of_group[g], self._boxes)
        aside = {pid: self._params[pid].detach().clone() for pid in self._params_of_group[g]}
        self._prepared.append((g, weights, sources, aside))

    def discard(self) -> None:
        """Drop every prepared group (the listener calls it when nothing is in the engine's hands)."""
        self._prepared.clear()
        super().discard()

    @torch.no_grad()
    def apply(self) -> None:
        """Copy the oldest prepared group in (call inside ``ordered_commit``, under the coordinator's lock)."""
        assert self.load_plan is not None
        if not self._prepared:
            raise RuntimeError("layer commit without a prepared group")
        g, weights, sources, aside = self._prepared.popleft()
        self._applied = aside
        destinations = [self._destinations[i] for i in self._writes_of_group[g]]
        if destinations:
            copy_into(destinations, sources)
        names = set(self.groups[g])
        self.load_plan.fill(self._params, names)
        for name, calls in self._fallbacks.items():
            if name in names:
                for param, call in calls:
                    call(param, weights[name])

    @torch.no_grad()
    def restore(self, previous: object) -> None:
        """After a failed ``apply``: put the group's bytes back from its copy aside."""
        self.undo(previous)

    @torch.no_grad()
    def undo(self, previous: object) -> None:
        """Take back the last applied group (another rank of the engine failed it)."""
        if self._applied is None:
            raise RuntimeError("no applied group to take back")
        for pid, saved in self._applied.items():
            self._params[pid].data.copy_(saved)
        self._applied = None

    def release_rollback(self) -> None:
        self._applied = None
