"""The ``copy`` commit one layer group at a time (``InflightConfig(commit_unit="layer")`` on
a GPU engine, or a CPU engine with ``INFLIGHT_CPU_PLAIN_GEMM=1``).

Each group's commit replays the load plan's copies of that group's tensors only (one
``torch._foreach_copy_`` into views of the live storage, on the forward's stream: see
``inflight.staging.ordered_commit``), its fills, and the live loaders of its fallback
tensors. The copy is chosen only where vLLM's post-load processing derives nothing from the
weights (``postload.copy_refusals``), so a group needs no processing after its copy.

Ordering invariants:
- prepared groups are applied in the order they were prepared (a FIFO), which is the order
  the listener hands them to the engine, one at a time;
- a group's previous bytes are copied aside when it is prepared, off the stall: the group's
  parameters change only by its own commits, which come one update after another, so
  these are the bytes the commit overwrites. ``undo`` (another rank failed this group) puts
  them back; once the engine keeps the commit they are dropped. So a rank holds at most
  ``window`` groups' copies beside the live weights, never a model's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from inflight.engine.commit.in_storage import InStorageApplier, Shapes
from inflight.engine.commit.routing_plan import RoutingError
from inflight.layer_groups import LayerGroups
from inflight.staging import copy_into


class LayerCopyApplier(InStorageApplier):
    """``copy``, committing one layer group per commit."""

    needs_rollback_copy = False  # each group's previous bytes are copied aside at prepare

    def __init__(self, model_runner: Any, shapes: Shapes, *, window: int = 2) -> None:
        super().__init__(model_runner, "copy", shapes)
        if self.load_plan is None:
            raise RoutingError("the copy commit could not record a load plan for this model (see the log)")
        self.window = window
        self.groups = LayerGroups.of(shapes)
        writes = self.load_plan.writes_by_name()
        self._writes_of_group = [[i for n in names for i in writes.get(n, ())] for names in self.groups]
        self._params_of_group = [sorted({pid for n in names for pid in self._routes.get(n, ())}) for names in self.groups]
        self._prepared: deque[tuple[int, Mapping[str, torch.Tensor], list[torch.Tensor], dict[int, torch.Tensor]]] = deque()
        self._applied: dict[int, torch.Tensor] | None = None

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
