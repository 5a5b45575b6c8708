"""What a push reads: a module, a mapping or an iterator of ``(name, tensor)``, or a module
sharded over the trainer's ranks (FSDP2 ``fully_shard``, or DTensor tensor parallelism).

``weights_of`` turns the first three into the tensors by checkpoint name, read in place.

``ShardedSource`` is built on every trainer rank over a gloo process group of its own (not
the one training's collectives use, so a gather in the push's thread never interleaves with
FSDP's all-gathers in the training thread, and never on a GPU beside them: it gathers on
the host). Rank 0's pusher reads it; every other rank calls
``follow``. Ordering invariants, which keep the ranks in lockstep so none can hang another:
- for each push, rank 0 broadcasts exactly one order message ``(version, names)`` (empty if
  the push ends before any bucket), then runs exactly ``len(names)`` gathers in that order;
  ``follow`` runs the same gathers in the same order;
- a tensor is gathered when the first bucket that holds part of it is packed, once, and kept
  until every destination's buckets are past it: the trainer holds the buckets in flight and
  the gathered tensors they span, never the whole model;
- a push that stops early (an engine refused it, the group broke) still completes the order's
  gathers on rank 0, so the followers return; a rank that dies makes every other rank's
  gather fail, raised as ``SourceError`` naming the push.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, Union

import torch
import torch.distributed as dist


class SourceError(RuntimeError):
    """Reading the update's tensors failed mid-stream; the engines were told to drop it and keep
    their last good version. The group is in step: the next push may go on."""


Weights = Union[torch.nn.Module, Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]], "ShardedSource"]
"""Anything ``WeightPusher.push`` accepts."""


@torch.no_grad()
def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's tensors by checkpoint name, each shared tensor once: what ``save_pretrained``
    writes, so a tied LM head travels as the input embedding it is.

    The engine's schema comes from the checkpoint, so names and layouts must be the
    checkpoint's, not the in-memory module's: transformers 5 fuses some weights at load
    (a MoE layer's experts become one ``experts.gate_up_proj`` of shape (E, 2I, H) where the
    checkpoint has ``experts.{e}.gate_proj.weight`` ...). transformers' own
    ``revert_weight_conversion``, the step ``save_pretrained`` applies, undoes that for every
    architecture it knows; the split experts are copies (one expert each, made once here)."""
    return checkpoint_form(model, {name: p.detach() for name, p in model.named_parameters()})


def checkpoint_form(model: torch.nn.Module, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model``'s in-memory tensors ``named`` (its ``named_parameters`` names, gathered or
    not) by checkpoint name and layout (``named_weights``): a tensor transformers fused at
    load comes back split, as copies; any other is ``named``'s own."""
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a trainer without transformers: its modules are already in checkpoint form
        return named
    if isinstance(model, PreTrainedModel):
        named = revert_weight_conversion(model, named)
    return named


def weights_of(weights: Any) -> dict[str, torch.Tensor] | Mapping[str, torch.Tensor]:
    """The tensors of a module (``named_weights``), a mapping, or an iterator of pairs; refuses
    DTensors, which only a ``ShardedSource`` can read (every rank must take part)."""
    if isinstance(weights, torch.nn.Module):
        named: Mapping[str, torch.Tensor] = named_weights(weights)
    elif isinstance(weights, Mapping):
        named = weights
    elif isinstance(weights, Iterable) and not isinstance(weights, (str, bytes, torch.Tensor)):
        named = {}
        for item in weights:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"an iterator of weights yields (name, tensor) pairs, not {type(item).__name__}")
            if item[0] in named:
                raise ValueError(f"the iterator yields {item[0]!r} twice")
            named[item[0]] = item[1]
    else:
        raise TypeError(f"cannot push a {type(weights).__name__}: pass a module, a mapping or an iterator of "
                        "(name, tensor) pairs, or a ShardedSource")
    for name, t in named.items():
        if _is_dtensor(t):
            raise ValueError(f"{name} is a DTensor (a sharded trainer): wrap the module in "
                             "ShardedSource(module, group) on every trainer rank, and call follow() on the others")
    return named


def _is_dtensor(t: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _memory(t: torch.Tensor) -> int:
    """The address of the storage holding ``t`` (a DTensor: its local shard's)."""
    local = t._local_tensor if _is_dtensor(t) else t
    return local.untyped_storage().data_ptr()


def _copies(module: torch.nn.Module, named: Mapping[str, torch.Tensor]) -> list[str]:
    """The tensors of ``named`` (``module``'s checkpoint form) that live in none of its
    parameters' or buffers' memory: copies, which an optimizer step leaves behind."""
    live = {_memory(t) for t in (*module.parameters(), *module.buffers())}
    return [n for n, t in named.items() if t.device.type != "meta" and _memory(t) not in live]


class ShardedSource:
    """A module (or mapping) whose tensors may be DTensors on a 1-D device mesh, read by rank 0's
    pusher one gathered tensor at a time. Plain tensors are taken as replicated (rank 0 reads
    its own). Build it on every trainer rank with the same ``group``."""

    def __init__(self, weights: torch.nn.Module | Mapping[str, torch.Tensor], group: dist.ProcessGroup) -> None:
        named = named_weights(weights) if isinstance(weights, torch.nn.Module) else dict(weights)
        if not named:
            raise ValueError("ShardedSource of no tensors")
        if isinstance(weights, torch.nn.Module) and (copies := _copies(weights, named)):
            raise ValueError(f"ShardedSource({type(weights).__name__}): its checkpoint form differs from its modules' "
                             f"({', '.join(copies[:3])}{' ...' if len(copies) > 3 else ''} hold no parameter's "
                             "memory: transformers converted weights at load, e.g. fused MoE experts), so they would "
                             "be copies made once, stale after the first optimizer step: pass its live tensors "
                             "({n: p.detach() for n, p in model.named_parameters()}) and convert each gathered "
                             "tensor set with checkpoint_form (inflight.trainer.ranks.GatheredWeights does)")
        check_gather_backend(str(dist.get_backend(group)))
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group)
        for name, t in named.items():
            if _is_dtensor(t):
                _check_layout(name, t, ranks)
        self.named = named
        self.meta = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in named.items()}
        """Every tensor's global shape and dtype (what the announce lays out)."""
        self._order: list[str] | None = None  # rank 0, during a push: the gathers announced
        self._gathered = 0
        self._version = -1
        self._uses: Counter[str] = Counter()
        self._held: dict[str, torch.Tensor] = {}

    # -- rank 0 (the pusher calls these) ------------------------------------------------------
    def begin(self, version: int, takes: list[str]) -> None:
        """Announce this push's gathers to the other ranks: ``takes`` is every ``take`` the pack
        will make, in order (``packing.first_use_order``); each tensor is gathered once."""
        self._uses = Counter(takes)
        self._order = list(dict.fromkeys(takes))
        self._gathered, self._version = 0, version
        self._held = {}
        self._broadcast([version, self._order])

    def take(self, name: str) -> torch.Tensor:
        if name in self._held:
            return self._held[name]
        if self._order is None or self._gathered >= len(self._order) or self._order[self._gathered] != name:
            raise SourceError(f"v{self._version}: {name!r} was not the next gather announced to the trainer's ranks")
        self._gathered += 1
        self._held[name] = self._gather(name)
        return self._held[name]

    def drop(self, name: str) -> None:
        self._uses[name] -= 1
        if self._uses[name] <= 0:
            self._held.pop(name, None)

    def finish(self, version: int) -> None:
        """End rank 0's part of a push: a push that never began tells the followers so; one that
        stopped early runs the gathers it announced, so the followers return."""
        try:
            if self._order is None:
                self._broadcast([version, []])
                return
            while self._gathered < len(self._order):
                self._gather(self._order[self._gathered])
                self._gathered += 1
        except SourceError:  # a rank is gone: the push already failed, and no follower is left waiting on this one
            pass
        finally:
            self._order, self._held, self._uses = None, {}, Counter()

    # -- every other rank ----------------------------------------------------------------------
    def follow(self, version: int) -> int:
        """Take part in rank 0's push of ``version``: run its gathers, in its order. Returns how
        many tensors were gathered (0: the push ended before any bucket)."""
        if self.rank == 0:
            raise ValueError("rank 0 pushes (WeightPusher.push(version, source)); the other ranks follow")
        self._version = version
        pushed, order = self._broadcast(None)
        if pushed != version:
            raise SourceError(f"trainer rank {self.rank} follows the push of v{version}, rank 0 pushes v{pushed}")
        for name in order:
            self._gather(name)
        return len(order)

    # -- the collectives ----------------------------------------------------------------------
    def _broadcast(self, message: list | None) -> list:
        box = [message]
        try:
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        except Exception as e:  # a dead rank breaks the group: every live rank says which push
            raise SourceError(f"trainer rank {self.rank}: the push's order message failed (a trainer rank "
                              f"died or left?): {e}") from e
        return box[0]

    def _gather(self, name: str) -> torch.Tensor:
        t = self.named[name]
        try:
            return _gather_dtensor(t, self.group, self.world) if _is_dtensor(t) else t
        except Exception as e:
            raise SourceError(f"trainer rank {self.rank}: gathering {name!r} for v{self._version} failed (a trainer "
                              f"rank died or left?): {e}") from e


def check_gather_backend(backend: str) -> None:
    """The source's group gathers over gloo, on the host: its gathers run in the push's thread
    while training's own collectives run in the training thread, and two NCCL communicators
    with collectives in flight on one GPU can deadlock each other (NCCL's documentation)."""
    if "gloo" not in backend.lower():
        raise ValueError(f"ShardedSource's group has backend {backend!r}: it gathers on the host, beside training's "
                         "NCCL collectives, so it needs gloo (dist.new_group(backend='gloo'), or 'cpu:gloo,cuda:nccl')")


def _check_layout(name: str, t: Any, ranks: list[int]) -> None:
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"{name}: a {mesh.ndim}-D device mesh; ShardedSource reads 1-D meshes (FSDP2 or TP alone)")
    if mesh.mesh.tolist() != ranks:
        raise ValueError(f"{name}: its mesh spans ranks {mesh.mesh.tolist()}, the source's group {ranks}")
    if not isinstance(t.placements[0], (Shard, Replicate)):
        raise ValueError(f"{name}: placement {t.placements[0]} (only Shard and Replicate can be gathered)")


def _gather_dtensor(t: Any, group: dist.ProcessGroup, world: int) -> torch.Tensor:
    """The global tensor of a DTensor sharded on dim d (``torch.chunk`` layout, as DTensor and
    FSDP2 shard) or replicated, on the group's rank 0 (``group``, not the mesh's own group),
    on the host (``check_gather_backend``): each rank's shard goes to rank 0 alone (a gather,
    not an all-gather), so the other ranks return their own shard. A GPU shard is copied out
    first, on the push's stream."""
    from torch.distributed.tensor import Replicate

    local = t.to_local()
    placement = t.placements[0]
    if isinstance(placement, Replicate):
        return local
    local = local.cpu()
    d, full = placement.dim, t.shape[placement.dim]
    chunk = -(-full // world)
    sizes = [max(0, min(chunk, full - r * chunk)) for r in range(world)]
    padded = local.new_zeros((*local.shape[:d], chunk, *local.shape[d + 1:]))
    padded.narrow(d, 0, local.shape[d]).copy_(local)
    root = dist.get_rank(group) == 0
    parts = [torch.empty_like(padded) for _ in range(world)] if root else None
    dist.gather(padded, parts, group=group, group_dst=0)
    if not root:
        return local
    return torch.cat([p.narrow(d, 0, n) for p, n in zip(parts, sizes)], dim=d)
