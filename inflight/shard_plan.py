"""Shard plans: which part of each checkpoint tensor one engine worker consumes.

A tensor-parallel rank's weight loaders read only its part of most tensors (a column- or
row-parallel linear's rows or columns, a vocabulary range of the embedding) and the whole of
a few (norms, biases of row-parallel layers). A worker derives its plan from the copies its
loaders make, recorded once at start (``LoadPlan.shard_plan`` in
``inflight.engine.commit.loaders``): for each tensor the bounding box of every region its
copies read. A tensor whose loaders do anything but copy boxes of it (a transpose, a cast, a
computed value) is a *fallback*: it needs the whole tensor, and is counted as such.

The plan travels to the trainer in the worker's ``Joined`` with a digest of its shards,
which the trainer checks (``check_plan``) and will echo in what it sends, so both sides
agree on the bytes of every transfer. This module holds what both sides compute: boxes,
bytes, the digest and the check; it imports no engine code.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from inflight.protocol import DTYPE_ITEMSIZE, ShardPlan, TensorShard

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(start, length) along every dim of a tensor."""


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def box_of_view(shape: Sequence[int], stride: Sequence[int], offset: int, full: Sequence[int]) -> Box | None:
    """The box a view (``shape``, ``stride``, element ``offset``) of a contiguous tensor of
    shape ``full`` reads, or None if the view is not a box of it (other rank, transposed,
    overlapping strides)."""
    if len(shape) != len(full) or any(n == 0 for n in shape):
        return None
    cstride = contiguous_strides(full)
    if any(n > 1 and s != c for n, s, c in zip(shape, stride, cstride)):
        return None
    start, rest = [], offset
    for c in cstride:
        start.append(rest // c)
        rest %= c
    if rest or any(s + n > f for s, n, f in zip(start, shape, full)):
        return None
    return tuple(start), tuple(shape)


def inside(start: Sequence[int], length: Sequence[int], shape: Sequence[int]) -> bool:
    """The box ``start`` + ``length`` lies inside a tensor of ``shape``."""
    return len(start) == len(length) == len(shape) and all(b + n <= f for b, n, f in zip(start, length, shape))


def bounding(boxes: Iterable[Box]) -> Box:
    boxes = list(boxes)
    lo = tuple(min(b[0][i] for b in boxes) for i in range(len(boxes[0][0])))
    hi = tuple(max(b[0][i] + b[1][i] for b in boxes) for i in range(len(boxes[0][0])))
    return lo, tuple(h - s for s, h in zip(lo, hi))


def whole(shape: Sequence[int]) -> Box:
    return tuple(0 for _ in shape), tuple(shape)


def plan_digest(shards: Sequence[TensorShard], fallbacks: Sequence[str]) -> str:
    body = msgspec.msgpack.encode((list(shards), list(fallbacks)))
    return hashlib.sha256(body).hexdigest()[:32]


def make_plan(boxes: Mapping[str, Box], fallbacks: Iterable[str]) -> ShardPlan:
    """A plan of ``boxes`` (by tensor name), in name order, with its digest."""
    shards = tuple(TensorShard(name=n, start=tuple(b[0]), length=tuple(b[1])) for n, b in sorted(boxes.items()))
    falls = tuple(sorted(fallbacks))
    return ShardPlan(shards=shards, fallbacks=falls, digest=plan_digest(shards, falls))


Schema = Mapping[str, tuple[tuple[int, ...], str]]
"""name -> (shape, wire dtype), as ``TensorSchema.tensors``."""


def check_digest(plan: ShardPlan, who: str) -> None:
    """Raise ``ValueError`` unless ``plan``'s digest is that of its shards."""
    if plan.digest != plan_digest(plan.shards, plan.fallbacks):
        raise ValueError(f"{who}: shard plan digest {plan.digest!r} does not match its shards (corrupted or altered)")


def check_plan(plan: ShardPlan, schema: Schema, who: str) -> None:
    """Raise ``ValueError`` naming what is wrong unless ``plan`` has its digest and one box,
    inside the tensor, for every tensor of ``schema``."""
    check_digest(plan, who)
    names = [s.name for s in plan.shards]
    if sorted(names) != sorted(schema) or len(set(names)) != len(names):
        missing, extra = sorted(set(schema) - set(names)), sorted(set(names) - set(schema))
        raise ValueError(f"{who}: shard plan does not cover the checkpoint: missing {missing[:3]}, unknown {extra[:3]}")
    for s in plan.shards:
        shape = schema[s.name][0]
        if not inside(s.start, s.length, shape) or 0 in s.length:
            raise ValueError(f"{who}: shard of {s.name} {s.start}+{s.length} is not inside its shape {shape}")
    bad = sorted(set(plan.fallbacks) - set(schema))
    if bad:
        raise ValueError(f"{who}: shard plan falls back on unknown tensors {bad[:3]}")


def shard_nbytes(shard: TensorShard, dtype: str) -> int:
    return math.prod(shard.length) * DTYPE_ITEMSIZE[dtype]


@dataclass(frozen=True)
class PlanBytes:
    """What a worker consumes of an update, by kind: its part of the tensors split across its
    engine's ranks, the tensors every rank reads whole, and fallbacks (whole, by necessity)."""

    sharded: int
    replicated: int
    fallback: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.fallback


def plan_bytes(plan: ShardPlan, schema: Schema) -> PlanBytes:
    fallbacks = set(plan.fallbacks)
    sharded = replicated = fallback = 0
    for s in plan.shards:
        shape, dtype = schema[s.name]
        n = shard_nbytes(s, dtype)
        if s.name in fallbacks:
            fallback += n
        elif tuple(s.length) == tuple(shape):
            replicated += n
        else:
            sharded += n
    return PlanBytes(sharded, replicated, fallback)
