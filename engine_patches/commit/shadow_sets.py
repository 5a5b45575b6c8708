"""Where a ``swap`` commit's prepared weights are written, reused across updates.

Why: allocating fresh shadow parameters for every update costs a page fault per 4 KiB on
first touch (the kernel zeroes each page: ~0.1-0.2 s per 0.5 GB here), and a load plan's
destination views would have to be rebuilt per update (Python per tensor, on the engine's
GIL). Reused buffers have neither cost.

Which buffers can be reused, learned from the first update:
- *consumed* parameters: the CPU re-pack reads them into its own packed copy (a oneDNN
  handle, a packed MoE weight) and the prepared module no longer holds them. One scratch
  set serves every update: nothing live reads it.
- *kept* parameters (embeddings, norms, biases): the prepared module holds them, so they
  become live. They rotate through two sets: the live version's and the one being
  prepared. Inside a commit's window the second holds the swapped-out version (for a
  rollback); the engine keeping the commit releases it (``released``) before the next
  update is prepared into it, so a third set is made only if one is ever still held then.

A re-pack that replaces a parameter's storage in place (``param.data = ...``), or that
keeps a tensor sharing a consumed buffer among the module's attributes, would make reuse
wrong: either one turns reuse off for good (fresh buffers every update, as before).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from inflight.engine.commit.load_plan import LoadPlan

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

    # the applier's transitions ------------------------------------------------------------
    def applied(self) -> None:
        self.previous, self.live, self.prepared = self.live, self.prepared, None

    def rolled_back(self) -> None:
        self.live, self.previous = self.previous, self.live

    def released(self) -> None:
        self.previous = None

    def discard(self) -> None:
        self.prepared = None
