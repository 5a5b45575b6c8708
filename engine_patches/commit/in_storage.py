"""The ``reload`` and ``copy`` commits: the staged tensors are written into the live storage
at the commit, inside the stall.

- ``reload`` (compiled CPU, quantized models): vLLM's layerwise reload, which re-runs each
  layer's processing (the CPU re-pack, quantization) into the original storage. It takes
  whole checkpoint tensors (the reload materializes each layer in checkpoint format and
  runs its loaders on them), so it has no shard plan: every rank stages every tensor whole.
  A plain ``load_weights`` after start-up is wrong on a prepacking CPU engine: it writes
  into empty prepacked placeholders.
- ``copy`` (CUDA, unquantized; CPU with ``INFLIGHT_CPU_PLAIN_GEMM=1``): the model's own
  loaders' writes, replayed from a load plan (``inflight.engine.commit.load_plan``) recorded
  at start against the live parameters: one ``torch._foreach_copy_`` from the staged tensors
  into views of the live storage (which CUDA graphs captured), the loaders' constant fills,
  and the real loaders for the tensors the plan could not prove. The plan's shard plan is
  what each tensor-parallel rank is sent and stages (and keeps as its rollback copy): only
  the boxes its loaders read. A model whose loaders cannot be recorded falls back to
  ``model.load_weights`` on whole tensors (logged).

The copy is right only where vLLM's processing of loaded weights derived nothing from them
(``postload.copy_refusals``; on CPU, no prepacking GEMM: ``commit.base.cpu_gemm_prepacking``),
so the live parameters keep the checkpoint's layout after start and the recorded views stay
valid for the engine's life.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from inflight.engine.commit.load_plan import LoadPlan
from inflight.engine.commit.postload import cpu_unquantized_moe, modules_sharing_parameters, reprocess
from inflight.engine.commit.routing_plan import Route, RoutingPlan
from inflight.protocol import ShardPlan
from inflight.settings import InStorageCommit
from inflight.shard_plan import Box
from inflight.staging import copy_into

log = logging.getLogger("inflight.commit")

Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
Loader = Callable[[torch.Tensor, torch.Tensor], None]


class _ExpectedNoWeights(logging.Filter):
    """Drops the layerwise reload's "<Layer>: Failed to load weights" warning for layers that
    never get checkpoint tensors (rotary embeddings, a tied LM head): it fires on every commit."""

    def __init__(self, layer_names: set[str]) -> None:
        super().__init__()
        self.layer_names = layer_names

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.layer_names)


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


def _loader_call(route: Route) -> Loader:
    """``route``'s loader call on a given target (as ``SwapApplier._loader_call``)."""
    def call(target: torch.Tensor, tensor: torch.Tensor) -> None:
        loader = getattr(target, "weight_loader", None)  # vLLM's v2 parameters expose it as a property
        if loader is None:
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader
        route.call(loader, target, tensor)
    return call


def reload_peak_bytes(model: torch.nn.Module) -> int:
    """What vLLM's layerwise reload holds beyond the live model on a GPU (vLLM 0.32,
    ``model_executor/model_loader/reload/layerwise.py``): each module with weights of its own
    is materialized anew while its weights load, processed, and copied back into the original
    storage; a checkpoint whose order interleaves two modules holds two at once (vLLM warns
    then). So the two largest modules' own parameters and buffers, not the model again."""
    sizes = sorted((sum(t.numel() * t.element_size() for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
                    for m in model.modules()), reverse=True)
    return sum(sizes[:2])


class InStorageApplier:
    """``reload`` and ``copy``: the staged tensors are written into the live storage at commit.

    ``reload`` is vLLM's layerwise reload (re-runs each layer's processing: the CPU re-pack,
    quantization); ``copy`` replays the load plan (see the module docstring), or runs
    ``load_weights`` where no plan could be recorded. Invariant (``copy`` with a plan): the
    destination views are computed once, at start, from the live parameters; nothing
    replaces those parameters afterwards (the copy strategy is chosen only where vLLM's
    post-load processing leaves them as loaded).
    """

    def __init__(self, model_runner: Any, strategy: InStorageCommit, shapes: Shapes | None = None) -> None:
        self.runner = model_runner
        self.strategy = strategy
        model = model_runner.get_model()
        # CPU MoE experts whose re-pack vLLM's reload skips (``process_after_loading``), packed once each
        self._experts = [m for m in model.modules() if cpu_unquantized_moe(getattr(m, "quant_method", None))]
        # modules sharing a parameter, other than those experts: a GLM-4.5 router shares its bias with
        # the routed experts, and reprocessing those as tied too packed their bytes twice
        self._tied = [m for m in modules_sharing_parameters(model) if not any(m is e for e in self._experts)]
        quiet = {type(m).__name__ for m in self._tied} | {
            type(m).__name__ for m in model.modules() if not m._parameters and "Rotary" in type(m).__name__
        }
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedNoWeights(quiet))
        self._weights: Mapping[str, torch.Tensor] | None = None
        self._sources: list[torch.Tensor] = []  # the prepared version's copy sources (views of its staged bytes)
        self.load_plan: LoadPlan | None = None
        self._params: dict[int, torch.Tensor] = {}
        self._destinations: list[torch.Tensor] = []
        self._fallbacks: dict[str, list[tuple[torch.Tensor, Loader]]] = {}
        self._routes: dict[str, list[int]] = {}  # checkpoint name -> ids of the parameters its loaders write
        self._shard_plan: ShardPlan | None = None
        self._boxes: dict[str, tuple[Box, tuple[int, ...]]] = {}
        if strategy == "copy" and shapes is not None:
            try:
                self._record(model, shapes)
            except Exception as e:  # noqa: BLE001  load_weights on whole tensors is always right
                self.load_plan, self._params, self._destinations, self._fallbacks = None, {}, [], {}
                log.warning("inflight: no load plan for the copy commit of %s (%r): every rank stages whole tensors "
                            "and the commit runs load_weights", type(model).__name__, e)

    def _record(self, model: torch.nn.Module, shapes: Shapes) -> None:
        """Record the load plan against the live parameters (CPU scratch in their geometry),
        its destination views into them, and the live loader calls of what it could not prove."""
        params = {id(p): p for p in model.parameters()}  # a tied parameter once, as RoutingPlan keys it
        routing = RoutingPlan.record(model, shapes)
        calls = {name: [(r.param_id, _loader_call(r)) for r in rs] for name, rs in routing.routes.items()}
        plan = LoadPlan.record(shapes, calls, _CpuScratch(params))
        self._destinations = plan.destinations(params)
        self._fallbacks = {name: [(params[pid], call) for pid, call in calls[name]] for name in plan.loaded}
        self._params = params
        self._routes = {name: [r.param_id for r in rs] for name, rs in routing.routes.items()}
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
        """``copy``: what the recorded loaders read of each checkpoint tensor; ``reload`` (and
        a copy without a plan): None, vLLM's loaders take whole checkpoint tensors."""
        return self._shard_plan

    def held_bytes(self) -> int:
        """``reload`` on CPU: measured on a CPU engine (``inflight.bench.staging_memory``), the commit's
        peak grows the engine's memory by the model's parameter bytes (the re-pack makes new
        packed weights). ``reload`` on a GPU: ``reload_peak_bytes``. ``copy`` writes straight
        into the live storage: nothing (its recording scratch exists only at start, one
        parameter at a time)."""
        if self.strategy == "copy":
            return 0
        model = self.runner.get_model()
        if torch.device(self.runner.device).type != "cpu":
            return reload_peak_bytes(model)
        unique = {p.untyped_storage().data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
        return sum(unique.values())

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
        """Whole checkpoint tensors through vLLM: the layerwise reload, or ``load_weights``."""
        if self.strategy == "reload":
            self.runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
            # a tied LM head gets no tensors of its own, so its derived state (the CPU
            # prepacked copy) must be rebuilt from the embedding it shares
            reprocess(self._tied)
            self._repack_experts()
        else:
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

    def _repack_experts(self) -> None:
        """The reload ran the MoE method's update path, which left the new expert weights
        unpacked in the live storage: pack them (see ``process_after_loading``)."""
        for module in self._experts:
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)

    undo = restore  # taking back a successful apply writes the same previous weights back
