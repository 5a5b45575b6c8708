"""The ``swap`` commit: all the work of loading a version happens before the commit, off
the engine's critical path, and the commit itself only swaps module attributes.

Only for eager CPU engines (compiled and CUDA graphs capture parameter storage). Why and how: docs/design.md.
- listener thread (``SwapStrategy.feed``, bucket by bucket, then ``prepare``): fill shadow parameters by the
  load plan recorded at start (``inflight.engine.commit.loaders``) into reused buffers (``ShadowSets``), and
  re-pack each layer on a shallow copy as soon as the last tensor it reads is in (``Dependencies``,
  ``Countdown``). Live modules are not touched; a failure here refuses the update;
- commit (``SwapStrategy.apply``, under the coordinator's lock): assign the prepared parameters and attributes
  to the live modules, keeping the previous ones for an instant rollback in the commit's window.

Invariants:
- one spare set of modules exists at a time: the swapped-out one inside a commit's window (let go once the
  engine keeps the commit, ``release_rollback``), the one being prepared outside it;
- ``ShadowSets``: parameters the re-pack consumes share one scratch set (nothing live reads it); kept ones
  (embeddings, norms, biases) rotate through two sets, the live version's and the one being prepared. A
  re-pack that replaces a parameter's storage, or keeps a tensor sharing a consumed buffer, turns reuse off;
- layer groups (``LayerSwapStrategy``) are prepared and applied in arrival order (a FIFO); a group's modules
  are exactly those its tensors fill, wholly (checked at start): a swap never leaves a module half new; the
  swapped-out modules are kept until the engine keeps the commit (``undo`` puts them back), then freed.
"""

from __future__ import annotations

import copy
import types
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from inflight.engine.commit.loaders import (
    LoaderCall,
    LoaderMap,
    LoaderMapError,
    LoadPlan,
    Shapes,
    process_after_loading,
)
from inflight.layer_groups import LayerGroups
from inflight.protocol import ShardPlan

_STRUCTURAL = frozenset({"_parameters", "_buffers", "_modules"})


@dataclass
class _ModuleState:
    module: torch.nn.Module
    params: dict[str, torch.nn.Parameter]
    attrs: dict[str, Any] = field(default_factory=dict)


_MISSING = object()



_NOT_HOLDERS = (torch.nn.Module, type, types.FunctionType, types.MethodType, types.ModuleType)
"""What ``parameter_aliases`` does not look inside: modules (walked on their own), classes,
functions and Python modules."""


def parameter_aliases(model: torch.nn.Module,
                      owners: list[torch.nn.Module]) -> dict[tuple[int, str], list[tuple[Any, str]]]:
    """Where else ``model`` holds a parameter object than in its module's ``_parameters``: an
    attribute of a module, or of a plain object a module holds (vLLM 0.32's MoE routers and
    routed experts keep the gate's ``e_score_correction_bias``), by the parameter's slot
    (``(id(module), name)``). A swap replaces the parameter objects, and must replace these
    references too: a router that kept the old object would route with the old bias."""
    slot_of = {id(p): (id(m), n) for m in owners for n, p in m._parameters.items() if p is not None}
    found: dict[tuple[int, str], list[tuple[Any, str]]] = {}
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 2:
            return
        seen.add(id(obj))
        for attr, value in list(vars(obj).items()):
            if attr in _STRUCTURAL:
                continue
            if isinstance(value, torch.Tensor):
                if id(value) in slot_of:
                    found.setdefault(slot_of[id(value)], []).append((obj, attr))
            elif hasattr(value, "__dict__") and not isinstance(value, _NOT_HOLDERS):
                visit(value, depth + 1)

    for module in model.modules():
        visit(module, 0)
    return found


def parameter_views(model: torch.nn.Module, owners: list[torch.nn.Module]) -> list[str]:
    """The buffers of ``model`` that read a parameter's storage (vLLM 0.32's Mamba2 mixer keeps
    ``conv_weights``, a view of ``conv1d.weight``), as ``"buffer <- parameter"``. A swap gives
    the parameter new storage and such a buffer would go on reading the old weights."""
    storage_of = {p.untyped_storage().data_ptr(): f"{type(m).__name__}.{n}" for m in owners
                  for n, p in m._parameters.items() if p is not None and p.device.type != "meta" and p.numel()}
    views = []
    for module_name, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and b.device.type != "meta" and b.numel():
                param = storage_of.get(b.untyped_storage().data_ptr())
                if param is not None:
                    views.append(f"{module_name}.{name} <- {param}")
    return views


# which layers are complete (readiness) -------------------------------------------------------

class Dependencies:
    def __init__(self, writers: Mapping[str, Iterable[int]], layers: Sequence[Iterable[int]]) -> None:
        """``writers[name]``: the parameter keys ``name``'s loaders write; ``layers[i]``: the
        parameter keys layer ``i`` holds. Every key a layer holds must have a writer."""
        self._keys_of_name = {name: frozenset(keys) for name, keys in writers.items()}
        names_per_key: dict[int, int] = {}
        for keys in self._keys_of_name.values():
            for k in keys:
                names_per_key[k] = names_per_key.get(k, 0) + 1
        self._names_per_key = names_per_key
        self._layers_of_key: dict[int, list[int]] = {}
        self._keys_per_layer: list[int] = []
        for i, keys in enumerate(layers):
            keys = frozenset(keys)
            unwritten = [k for k in keys if k not in names_per_key]
            if unwritten:
                raise ValueError(f"layer {i} holds parameters no checkpoint tensor writes ({len(unwritten)})")
            for k in keys:
                self._layers_of_key.setdefault(k, []).append(i)
            self._keys_per_layer.append(len(keys))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._keys_of_name)

    def countdown(self) -> Countdown:
        return Countdown(self)


class Countdown:
    """One update's progress: feed it the tensors that arrived, it names the layers they completed."""

    def __init__(self, deps: Dependencies) -> None:
        self._deps = deps
        self._key_left = dict(deps._names_per_key)
        self._layer_left = list(deps._keys_per_layer)
        self.seen: set[str] = set()

    def ready_at_start(self) -> list[int]:
        """Layers that hold no parameter at all: complete before any tensor."""
        return [i for i, n in enumerate(self._layer_left) if n == 0]

    def arrived(self, names: Iterable[str]) -> list[int]:
        """Mark ``names`` as loaded; return the layers that became complete, in order."""
        done: list[int] = []
        for name in names:
            if name in self.seen:
                raise ValueError(f"checkpoint tensor {name!r} arrived twice in one update")
            keys = self._deps._keys_of_name.get(name)
            if keys is None:
                raise KeyError(f"checkpoint tensor {name!r} is not part of this model's updates")
            self.seen.add(name)
            for k in keys:
                self._key_left[k] -= 1
                if self._key_left[k] == 0:
                    for layer in self._deps._layers_of_key.get(k, ()):
                        self._layer_left[layer] -= 1
                        if self._layer_left[layer] == 0:
                            done.append(layer)
        return sorted(done)

    def missing(self) -> list[str]:
        return sorted(self._deps.names - self.seen)

# reused shadow buffers -----------------------------------------------------------------------

_SETS = 3  # live, previous (inside a commit's window only), being prepared


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class ShadowSets:
    def __init__(self) -> None:
        self.reuse = True
        self._consumed: frozenset[int] | None = None  # learned from the first update
        self._sets: list[dict[int, torch.nn.Parameter]] = []
        self._destinations: list[list[torch.Tensor]] = []
        self._ptrs: list[dict[int, int]] = []
        self.live: int | None = None
        self.previous: int | None = None
        self.prepared: int | None = None

    def take(self, make: Callable[[torch.Tensor, torch.nn.Module], torch.nn.Parameter],
             templates: Mapping[int, tuple[torch.Tensor, torch.nn.Module]],
             plan: LoadPlan) -> tuple[dict[int, torch.nn.Parameter], list[torch.Tensor]]:
        """The shadow parameters to prepare the next version into, and the plan's views of them."""
        if not self.reuse:
            shadows = {k: make(t, owner) for k, (t, owner) in templates.items()}
            self.prepared = None
            return shadows, plan.destinations(shadows)
        s = next(i for i in range(_SETS) if i not in (self.live, self.previous))
        if s == len(self._sets):  # sets are made in index order, on first need
            scratch = {} if not self._sets else {k: self._sets[0][k] for k in self._consumed or ()}
            shadows = {k: scratch[k] if k in scratch else make(t, owner) for k, (t, owner) in templates.items()}
            self._sets.append(shadows)
            self._destinations.append(plan.destinations(shadows))
            self._ptrs.append({k: _ptr(p) for k, p in shadows.items()})
        self.prepared = s
        return self._sets[s], self._destinations[s]

    def settle(self, shadows: Mapping[int, torch.nn.Parameter], states: list[Any]) -> None:
        """After the re-pack of a version prepared into ``take``'s buffers: learn (first
        update) which buffers it consumed, and turn reuse off if it broke the assumptions."""
        if not self.reuse or self.prepared is None:
            return
        moved = [k for k, p in shadows.items() if _ptr(p) != self._ptrs[self.prepared][k]]
        held = {id(p) for st in states for p in st.params.values() if p is not None}
        attr_ptrs = {_ptr(v) for st in states for v in st.attrs.values() if isinstance(v, torch.Tensor)}
        consumed = frozenset(k for k, p in shadows.items() if id(p) not in held)
        if moved or any(_ptr(shadows[k]) in attr_ptrs for k in consumed):
            self._off()
            return
        if self._consumed is None:
            self._consumed = consumed
        elif consumed != self._consumed:  # the re-pack changed its mind: trust nothing reused
            self._off()

    def _off(self) -> None:
        self.reuse = False
        # the buffers stay referenced by whatever live or previous state holds them; drop ours
        self._sets, self._destinations, self._ptrs = [], [], []
        self.live = self.previous = self.prepared = None

    # the strategy's transitions ------------------------------------------------------------
    def applied(self) -> None:
        self.previous, self.live, self.prepared = self.live, self.prepared, None

    def rolled_back(self) -> None:
        self.live, self.previous = self.previous, self.live

    def released(self) -> None:
        self.previous = None

    def discard(self) -> None:
        self.prepared = None

# the whole-model swap ------------------------------------------------------------------------

@dataclass
class _Update:
    """The version being prepared: its shadow parameters, the plan's views of them, and progress."""

    shadows: dict[int, torch.nn.Parameter]
    destinations: list[torch.Tensor]
    countdown: Countdown
    states: dict[int, _ModuleState] = field(default_factory=dict)  # layer index -> re-packed state
    repacks: list[Future] = field(default_factory=list)  # the re-pack thread's work for this update


class SwapStrategy:
    name = "swap"
    needs_rollback_copy = False  # it swaps the old modules back

    def __init__(self, model: torch.nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
                 load_plan: bool = True) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.model = model
        self._owners: list[torch.nn.Module] = [m for m in model.modules() if m._parameters]
        if views := parameter_views(model, self._owners):
            raise LoaderMapError(f"buffers read parameters' storage, which a swap replaces: {', '.join(views[:3])}"
                                 + (f" and {len(views) - 3} more" if len(views) > 3 else ""))
        self.plan = LoaderMap.record(model, shapes)
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
        self._aliases = parameter_aliases(model, self._owners)
        self._prepared: list[_ModuleState] | None = None
        self._previous: list[_ModuleState] | None = None
        self._released: list[_ModuleState] | None = None  # swapped out by a kept commit, not yet freed
        self.load_plan = self._record_load_plan(shapes) if load_plan else None
        self._writes_of = self.load_plan.writes_by_name() if self.load_plan is not None else {}
        self._shard_plan = None if self.load_plan is None else self.load_plan.shard_plan(
            {n: shape for n, (shape, _) in shapes.items()})
        # where a tensor arrives as the box this rank's plan asked for, its copies read inside the box
        self._boxes = {} if self._shard_plan is None else {
            s.name: ((s.start, s.length), shapes[s.name][0]) for s in self._shard_plan.shards}
        self._targets = ShadowSets()
        self._deps = Dependencies(
            {name: [r.param_id for r in rs] for name, rs in self.plan.calls.items()},
            [[self._slot_key[(id(m), n)] for n, p in m._parameters.items() if p is not None] for m in self._owners])
        self._update: _Update | None = None
        self._pool: ThreadPoolExecutor | None = None  # the re-pack thread, started on the first update

    @classmethod
    def build(cls, model_runner: Any, shapes: Shapes, *, window: int = 2) -> SwapStrategy:
        """The strategy registry's constructor (``commit.base.make_strategy``); the whole
        model commits at once, so ``window`` is not used."""
        return cls(model_runner.get_model(), shapes)

    def _loader_call(self, route: LoaderCall):
        def call(target: torch.Tensor, tensor: torch.Tensor) -> None:
            loader = getattr(target, "weight_loader", None)  # vLLM's v2 parameters expose it as a property
            if loader is None:
                from vllm.model_executor.model_loader.weight_utils import default_weight_loader as loader
            route.call(loader, target, tensor)
        return call

    def _record_load_plan(self, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> LoadPlan:
        scratch = self._shadows()
        calls_of = {name: [(r.param_id, self._loader_call(r)) for r in rs] for name, rs in self.plan.calls.items()}
        return LoadPlan.record(shapes, calls_of, scratch)

    def shard_plan(self) -> ShardPlan | None:
        """What the recorded load plan reads of each checkpoint tensor (None without a plan)."""
        return self._shard_plan

    def held_bytes(self) -> int:
        """What one prepared version holds beside the live modules, at most: its shadow
        parameters, and the re-packed copies the CPU GEMM keeps of the ones it consumes (a
        bound: the kept parameters, embeddings and norms, have no re-packed copy). One such
        version exists at a time (the swapped-out one, inside a commit's window, in its place)."""
        return 2 * sum(t.numel() * t.element_size() for t, _ in self._templates.values())

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
    def feed(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load these tensors of the version being staged (verified, each once) into the shadow
        parameters, and re-pack every layer they complete (``Countdown``); live
        modules are untouched. The listener calls it bucket by bucket, during the receive."""
        u = self._current()
        if not weights:
            return
        if self.load_plan is None:
            self._load(weights, u.shadows)
        else:
            planned = [i for name in weights for i in self._writes_of.get(name, ())]
            if planned:
                self._copy([u.destinations[i] for i in planned], self.load_plan.sources(weights, planned, self._boxes))
            self.load_plan.fill(u.shadows, weights.keys())
            self._load({n: t for n, t in weights.items() if n in self.load_plan.loaded}, u.shadows)
        for layer in u.countdown.arrived(weights):
            self._submit(u, layer)
        self._raise_failed(u)  # a failed re-pack refuses the update now, not after the last bucket

    @torch.no_grad()
    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Finish the version: feed what ``feed`` has not had yet, wait for every layer's
        re-pack, and check every layer is ready."""
        u = self._current()
        self.feed({n: t for n, t in weights.items() if n not in u.countdown.seen})
        for f in u.repacks:
            f.result()  # re-raises a re-pack's error: the listener refuses the update and discards
        missing = u.countdown.missing()
        if missing or len(u.states) != len(self._owners):
            raise RuntimeError(f"prepare without {len(missing)} checkpoint tensors, e.g. {missing[:3]}")
        states = [u.states[i] for i in range(len(self._owners))]
        self._update = None
        if self.load_plan is not None:
            self._targets.settle(u.shadows, states)
        self._prepared = states

    def _current(self) -> _Update:
        """The update being prepared; the first tensor of a version begins it."""
        return self._update if self._update is not None else self._begin()

    def _begin(self) -> _Update:
        self._released = None  # what the last kept commit swapped out: freed here, off the engine thread
        if self.load_plan is None:
            shadows, destinations = self._shadows(), []
        else:
            shadows, destinations = self._targets.take(self._shadow, self._templates, self.load_plan)
        u = _Update(shadows, destinations, self._deps.countdown())
        self._update = u
        for layer in u.countdown.ready_at_start():
            self._submit(u, layer)
        return u

    # The re-pack runs on its own thread, one layer at a time, in the order layers complete:
    # the listener thread meanwhile verifies, checks and copies the next buckets. Both drop
    # the GIL in their heavy calls (oneDNN's handle creation, ``_foreach_copy_``), so on an
    # idle engine the two overlap on two cores; beside decoding they cost the same CPU as
    # one thread would. The thread is started by the listener thread (the first update), so it
    # inherits that thread's nice value (``InflightConfig.listener_nice``).
    def _submit(self, u: _Update, layer: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-repack")
        u.repacks.append(self._pool.submit(self._repack_into, u, layer))

    @torch.no_grad()  # grad mode is per thread
    def _repack_into(self, u: _Update, layer: int) -> None:
        u.states[layer] = self._repack_one(self._owners[layer], u.shadows)

    @staticmethod
    def _raise_failed(u: _Update) -> None:
        for f in u.repacks:
            if f.done() and f.exception() is not None:
                raise f.exception()

    def _settle_repacks(self) -> None:
        """Wait out the re-packs of an update being dropped: none may still read shadow
        buffers that the next update will write into."""
        if self._update is not None:
            wait(self._update.repacks)
        self._update = None

    def close(self) -> None:
        self._settle_repacks()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @staticmethod
    def _copy(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        torch._foreach_copy_(destinations, sources)  # one call: the GIL is released once for every copy

    def _shadows(self) -> dict[int, torch.nn.Parameter]:
        return {pid: self._shadow(t, owner) for pid, (t, owner) in self._templates.items()}

    def _load(self, weights: Mapping[str, torch.Tensor], shadows: dict[int, torch.nn.Parameter]) -> None:
        """The model's own loaders (without a load plan, or for what the plan could not prove)."""
        for name, tensor in weights.items():
            for route in self.plan.calls[name]:
                self._loader_call(route)(shadows[route.param_id], tensor)

    def _repack_one(self, live: torch.nn.Module, shadows: Mapping[int, torch.nn.Parameter]) -> _ModuleState:
        twin = copy.copy(live)  # new __dict__; give it its own parameter and buffer dicts
        twin._parameters = {n: (shadows[self._slot_key[(id(live), n)]] if p is not None else None)
                            for n, p in live._parameters.items()}
        twin._buffers = dict(live._buffers)
        before = dict(twin.__dict__)
        process_after_loading(twin)  # e.g. the oneDNN or MoE re-pack, into twin's attributes
        attrs = {k: v for k, v in twin.__dict__.items()
                 if k not in _STRUCTURAL and before.get(k, _MISSING) is not v}
        return _ModuleState(live, dict(twin._parameters), attrs)

    def discard(self) -> None:
        self._settle_repacks()
        self._prepared = self._released = None
        self._targets.discard()

    def apply(self) -> None:
        """Swap the prepared state in (call under the commit coordinator's lock)."""
        if self._prepared is None:
            raise RuntimeError("swap commit without a prepared version")
        previous = self._swap(self._prepared)
        self._release(self._previous)  # none: the last commit was kept (``release_rollback``) or taken back
        self._prepared, self._previous = None, previous
        self._targets.applied()

    def rollback(self) -> bool:
        """Swap the version before the last commit back in; False if there is none."""
        if self._previous is None:
            return False
        self._previous = self._swap(self._previous)
        self._targets.rolled_back()
        return True

    def restore(self, previous: object) -> None:
        """After a failed ``apply``: nothing to do, it swapped every module or none (``_swap``)."""

    def undo(self, previous: object) -> None:
        """Take back a successful ``apply`` (another rank of the engine failed its commit)."""
        if not self.rollback():
            raise RuntimeError("no applied version to take back")
        self._previous = None  # what rollback swapped out is the refused version: never to be swapped back
        self._targets.released()

    def release_rollback(self) -> None:
        """The engine kept the commit: the swapped-out modules are never swapped back (a
        rollback happens only in the commit's own window), so let them go."""
        self._release(self._previous)
        self._previous = None
        self._targets.released()

    def _release(self, states: list[_ModuleState] | None) -> None:
        """Free ``states`` later, on the listener thread (``_begin``, ``discard``): freeing a
        model's packed weights is munmap work, tens of ms measured on a 0.5 GB model, which
        the engine's stall would otherwise pay."""
        if states is not None:
            self._released = (self._released or []) + states

    def _swap(self, states: list[_ModuleState]) -> list[_ModuleState]:
        old = [_ModuleState(s.module, {n: s.module._parameters[n] for n in s.params},
                            {k: s.module.__dict__.get(k, _MISSING) for k in s.attrs}) for s in states]
        done = 0
        try:
            for s in states:
                self._assign(s)
                done += 1
        except BaseException:
            for s in old[:done]:  # all or nothing
                self._assign(s)
            raise
        return old

    def _assign(self, s: _ModuleState) -> None:
        m = s.module
        m._parameters.update(s.params)
        for name, p in s.params.items():  # the same object wherever else the model holds it
            for holder, attr in self._aliases.get((id(m), name), ()):
                vars(holder)[attr] = p
        for k, v in s.attrs.items():
            if v is _MISSING:
                m.__dict__.pop(k, None)
            else:
                m.__dict__[k] = v

# one layer group at a time -------------------------------------------------------------------

class LayerSwapStrategy(SwapStrategy):
    """``swap``, committing one layer group per commit."""

    name = "swap"

    def __init__(self, model: torch.nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
                 window: int = 2) -> None:
        super().__init__(model, shapes, load_plan=True)
        self.window = window
        self.groups = LayerGroups.of(shapes)
        owner_keys = [[self._slot_key[(id(m), n)] for n, p in m._parameters.items() if p is not None]
                      for m in self._owners]
        filled = [{r.param_id for n in names for r in self.plan.calls[n]} for names in self.groups]
        self._members: list[list[int]] = [[] for _ in self.groups]
        for i, keys in enumerate(owner_keys):
            hit = sorted(g for g, ks in enumerate(filled) if ks & set(keys))
            if len(hit) > 1:
                raise LoaderMapError(f"{type(self._owners[i]).__name__} holds parameters of layer groups {hit}: a "
                                   "layer-granular commit needs each module in one group")
            if hit:
                self._members[hit[0]].append(i)
        self._keys: list[set[int]] = []
        for g, members in enumerate(self._members):
            keys = {k for i in members for k in owner_keys[i]}
            if not keys <= filled[g]:
                raise LoaderMapError(f"layer group {g} ({self.groups[g][0]}, ...) leaves parameters of its modules "
                                     "unfilled")
            self._keys.append(keys)
        self._writes_of_group = [[i for n in names for i in self._writes_of.get(n, ())] for names in self.groups]
        self._ready_groups: deque[tuple[int, list[_ModuleState]]] = deque()

    @classmethod
    def build(cls, model_runner: Any, shapes: Shapes, *, window: int = 2) -> LayerSwapStrategy:
        """The strategy registry's constructor (``commit.base.make_strategy``)."""
        return cls(model_runner.get_model(), shapes, window=window)

    def group_bytes(self) -> list[int]:
        """Each group's parameter bytes on this rank (what its shadows hold)."""
        return [sum(self._templates[k][0].numel() * self._templates[k][0].element_size() for k in keys)
                for keys in self._keys]

    def held_bytes(self) -> int:
        """At most ``window`` prepared groups beside the live modules: their shadows and the
        re-packed copies the CPU GEMM keeps (a bound, as for the whole model)."""
        return 2 * self.window * max(self.group_bytes(), default=0)

    @torch.no_grad()
    def feed(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Nothing per bucket: a group is small, and is prepared whole in ``prepare``."""

    @torch.no_grad()
    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Build group ``g``'s new modules from its staged tensors (exactly that group's)."""
        self._released = None  # what the last kept commit swapped out: freed here, off the engine thread
        g = self.groups.group_of_update(weights)
        shadows = {k: self._shadow(*self._templates[k]) for k in self._keys[g]}
        planned = self._writes_of_group[g]
        if planned:
            self._copy(self._views(shadows, planned), self.load_plan.sources(weights, planned, self._boxes))
        self.load_plan.fill(shadows, weights.keys())
        self._load({n: t for n, t in weights.items() if n in self.load_plan.loaded}, shadows)
        self._ready_groups.append((g, [self._repack_one(self._owners[i], shadows) for i in self._members[g]]))

    def _views(self, shadows: Mapping[int, torch.Tensor], indices: list[int]) -> list[torch.Tensor]:
        out = []
        for i in indices:
            w = self.load_plan.writes[i]
            base = shadows[w.key].data
            shape, stride, offset = w.dst
            out.append(base.as_strided(shape, stride, base.storage_offset() + offset))
        return out

    def discard(self) -> None:
        """Drop every prepared group (the listener calls it when nothing is in the engine's hands)."""
        self._ready_groups.clear()
        self._released = None

    def apply(self) -> None:
        """Swap the oldest prepared group in (call under the commit coordinator's lock)."""
        if not self._ready_groups:
            raise RuntimeError("layer commit without a prepared group")
        _, states = self._ready_groups.popleft()
        previous = self._swap(states)
        self._release(self._previous)
        self._previous = previous

    def undo(self, previous: object) -> None:
        """Take back a successful ``apply`` (another rank of the engine failed this group)."""
        if self._previous is None:
            raise RuntimeError("no applied group to take back")
        self._swap(self._previous)
        self._previous = None

    def release_rollback(self) -> None:
        self._release(self._previous)
        self._previous = None

    def close(self) -> None:
        self.discard()
        super().close()
