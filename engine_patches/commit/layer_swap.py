"""The ``swap`` commit one layer group at a time (``InflightConfig(commit_unit="layer")``).

Each layer group (``inflight.layer_groups``) is prepared as the whole model is by
``SwapApplier``: its staged tensors are copied into fresh shadow parameters by the load plan
recorded at start (boxes of this rank's shard plan included), its modules are re-packed on
shallow copies, and the commit swaps the prepared parameters and attributes into the live
modules of that group only. So a rank holds the shadows of at most ``window`` groups, not of
a model, and a commit's stall is one group's swap.

Ordering invariants:
- groups are prepared and applied in the order they arrive (a FIFO): the listener hands the
  engine one group at a time, so ``apply`` always takes the oldest prepared group;
- a group's modules are exactly the modules whose parameters its tensors fill, each module in
  one group, and every parameter of those modules is filled by the group's tensors (checked
  at start, or the model is refused with the reason): a swap never leaves a module half new;
- the modules a commit swapped out are kept until the engine keeps the commit (``undo`` puts
  them back inside the commit's window when another rank failed), then freed off the engine
  thread, at the next ``prepare``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import torch

from inflight.engine.commit.routing_plan import RoutingError
from inflight.engine.commit.swap import SwapApplier, _ModuleState
from inflight.layer_groups import LayerGroups


class LayerSwapApplier(SwapApplier):
    """``swap``, committing one layer group per commit."""

    strategy = "swap"

    def __init__(self, model: torch.nn.Module, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *,
                 window: int = 2) -> None:
        super().__init__(model, shapes, load_plan=True)
        self.window = window
        self.groups = LayerGroups.of(shapes)
        owner_keys = [[self._slot_key[(id(m), n)] for n, p in m._parameters.items() if p is not None] for m in self._owners]
        filled = [{r.param_id for n in names for r in self.plan.routes[n]} for names in self.groups]
        self._members: list[list[int]] = [[] for _ in self.groups]
        for i, keys in enumerate(owner_keys):
            hit = sorted(g for g, ks in enumerate(filled) if ks & set(keys))
            if len(hit) > 1:
                raise RoutingError(f"{type(self._owners[i]).__name__} holds parameters of layer groups {hit}: a "
                                   "layer-granular commit needs each module in one group")
            if hit:
                self._members[hit[0]].append(i)
        self._keys: list[set[int]] = []
        for g, members in enumerate(self._members):
            keys = {k for i in members for k in owner_keys[i]}
            if not keys <= filled[g]:
                raise RoutingError(f"layer group {g} ({self.groups[g][0]}, ...) leaves parameters of its modules unfilled")
            self._keys.append(keys)
        self._writes_of_group = [[i for n in names for i in self._writes_of.get(n, ())] for names in self.groups]
        self._ready_groups: deque[tuple[int, list[_ModuleState]]] = deque()

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
