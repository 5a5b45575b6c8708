"""What an update must contain, on one engine worker: ``TensorSchema``, each tensor's name,
shape and wire dtype, and the check of an announce against it (whole tensors, a shard plan's
boxes, or one layer group's tensors).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from inflight.layer_groups import LayerGroups
from inflight.protocol import ALIGN, ShardPlan, UpdateAnnounce
from inflight.transport.errors import UpdateRejected


@dataclass(frozen=True)
class TensorSchema:
    """Exactly what an update must contain: name -> (shape, wire dtype)."""

    tensors: Mapping[str, tuple[tuple[int, ...], str]]

    @functools.cached_property
    def layer_groups(self) -> LayerGroups:
        """The tensors' layer groups, computed once: each group of a layer-granular update is checked against them."""
        return LayerGroups.of(self.tensors)

    def check(self, announce: UpdateAnnounce, plan: ShardPlan | None = None) -> UpdateRejected | None:
        """Why ``announce`` is not exactly an update of these tensors (each whole, or, when it
        follows this worker's shard ``plan``, each the plan's box of it), or None."""
        if announce.plan_digest:
            if plan is None or announce.plan_digest != plan.digest:
                mine = "no shard plan" if plan is None else f"shard plan {plan.digest}"
                return UpdateRejected("bad_layout", f"v{announce.version} follows shard plan {announce.plan_digest}; "
                                                    f"this worker sent {mine}")
            boxes = {s.name: (tuple(s.start), tuple(s.length)) for s in plan.shards}
            for t in announce.tensors:
                if t.name in boxes and (tuple(t.start), tuple(t.shape)) != boxes[t.name]:
                    return UpdateRejected("bad_shape", f"{t.name}: box {tuple(t.start)}+{tuple(t.shape)}, this "
                                                       f"worker's plan reads {boxes[t.name][0]}+{boxes[t.name][1]}")
        elif any(t.start for t in announce.tensors):
            return UpdateRejected("bad_layout", f"v{announce.version} sends boxes without a shard plan")
        names = {t.name for t in announce.tensors}
        unknown = sorted(names - self.tensors.keys())
        if unknown:
            return UpdateRejected("unknown_tensor", f"v{announce.version} names tensors the engine does not have: "
                                                    f"{unknown[:5]}")
        expected = set(self.tensors)
        if announce.parts:  # one layer group: exactly its tensors, in this engine's grouping
            groups = self.layer_groups
            if announce.parts != len(groups):
                return UpdateRejected("bad_layout", f"v{announce.version} comes in {announce.parts} layer groups; this "
                                                    f"engine's model has {len(groups)}")
            expected = set(groups[announce.part])
            foreign = sorted(names - expected)
            if foreign:
                return UpdateRejected("bad_layout", f"group {announce.part} of v{announce.version} holds tensors of "
                                                    f"other groups: {foreign[:5]}")
        missing = sorted(expected - names)
        if missing:
            return UpdateRejected("missing_tensor", f"v{announce.version} lacks {len(missing)} tensors, e.g. "
                                                    f"{missing[:5]}")
        for t in announce.tensors:
            shape, dtype = self.tensors[t.name]
            if tuple(t.shape) != tuple(shape) and not announce.plan_digest:
                return UpdateRejected("bad_shape", f"{t.name}: shape {tuple(t.shape)}, engine has {tuple(shape)}")
            if t.dtype != dtype:
                return UpdateRejected("bad_dtype", f"{t.name}: dtype {t.dtype}, engine runs {dtype}")
        bound = sum(-(-t.nbytes // ALIGN) * ALIGN for t in announce.tensors)
        if announce.total_bytes > bound:
            return UpdateRejected("bad_layout", f"total_bytes={announce.total_bytes} exceeds the {bound} B its "
                                                "tensors need")
        return None
