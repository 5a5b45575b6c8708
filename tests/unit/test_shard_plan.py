"""Shard plans from recorded loaders: the boxes a tensor-parallel rank's loaders read of each
checkpoint tensor, the fallbacks, and the checks both sides run on a plan.
(The plans of a real TP=2 engine: ``tests/engine/test_engine_tp.py``.)"""

from __future__ import annotations

import msgspec
import pytest
import torch

from inflight.engine.commit.loaders import LoadPlan
from inflight.protocol import BucketSpec, Joined, decode_reply, encode
from inflight.shard_plan import box_of_view, check_plan, make_plan, plan_bytes, whole


def _box(t: torch.Tensor, base: torch.Tensor):
    return box_of_view(tuple(t.shape), tuple(t.stride()), t.storage_offset() - base.storage_offset(), tuple(base.shape))


def test_boxes_of_views() -> None:
    t = torch.empty(6, 4, 3)
    assert _box(t, t) == ((0, 0, 0), (6, 4, 3))
    assert _box(t.narrow(0, 2, 3), t) == ((2, 0, 0), (3, 4, 3))  # column parallel: rows
    assert _box(t.narrow(1, 1, 2), t) == ((0, 1, 0), (6, 2, 3))  # row parallel: a strided box
    assert _box(t[1:3, 1:3, 2:3], t) == ((1, 1, 2), (2, 2, 1))
    assert _box(t.transpose(0, 1), t) is None  # not a box: the loader re-lays the tensor
    assert _box(t.view(24, 3), t) is None
    assert _box(t[::2], t) is None  # every other row: a box would overstate nothing, but it is not one


def _record(shapes: dict, loaders: dict) -> LoadPlan:
    """A plan recorded from plain loaders writing into parameters of their own shapes."""
    targets = {name: torch.empty(shape) for name, (shape, _) in loaders.items()}
    calls_of = {name: [(name, lambda target, w, fn=fn: fn(target, w))] for name, (_, fn) in loaders.items()}
    return LoadPlan.record({n: (s, torch.float32) for n, s in shapes.items()}, calls_of, targets)


def test_a_plan_from_loaders_that_narrow_copy_whole_or_transpose() -> None:
    shapes = {"col": (8, 4), "row": (4, 8), "norm": (4,), "rot": (4, 6)}
    rank = 1

    def col(p, w):  # rows 4..8: the second of two ranks
        p.copy_(w.narrow(0, rank * 4, 4))

    def row(p, w):
        p.copy_(w.narrow(1, rank * 4, 4))

    def norm(p, w):
        p.copy_(w)

    def rot(p, w):  # re-laid: this rank needs the whole tensor
        p.copy_(w.t())
    plan = _record(shapes, {"col": ((4, 4), col), "row": ((4, 4), row), "norm": ((4,), norm), "rot": ((6, 4), rot)})
    sp = plan.shard_plan(shapes)
    boxes = {s.name: (s.start, s.length) for s in sp.shards}
    assert boxes == {"col": ((4, 0), (4, 4)), "row": ((0, 4), (4, 4)), "norm": ((0,), (4,)), "rot": ((0, 0), (4, 6))}
    assert sp.fallbacks == ("rot",)
    schema = {n: (s, "float32") for n, s in shapes.items()}
    check_plan(sp, schema, "rank 1")
    b = plan_bytes(sp, schema)
    assert (b.sharded, b.replicated, b.fallback) == (2 * 16 * 4, 4 * 4, 24 * 4)


def test_a_plan_is_checked_by_its_digest_and_against_the_checkpoint() -> None:
    schema = {"a": ((8, 4), "float32"), "b": ((4,), "float32")}
    plan = make_plan({"a": ((0, 0), (4, 4)), "b": whole((4,))}, [])
    check_plan(plan, schema, "rank 1")
    again = decode_reply(encode(Joined(rank=1, live_version=0, incarnation="x", plan=plan)))
    assert again.plan == plan  # it travels in the hello as it is
    altered = msgspec.structs.replace(plan, shards=(msgspec.structs.replace(plan.shards[0], length=(8, 4)),)
                                      + plan.shards[1:])
    with pytest.raises(ValueError, match="digest .* does not match its shards"):
        check_plan(altered, schema, "rank 1")
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        check_plan(plan, schema | {"c": ((2,), "float32")}, "rank 1")
    outside = make_plan({"a": ((6, 0), (4, 4)), "b": whole((4,))}, [])
    with pytest.raises(ValueError, match="shard of a .* is not inside its shape"):
        check_plan(outside, schema, "rank 1")
    assert make_plan({"b": whole((4,)), "a": ((0, 0), (4, 4))}, []).digest == plan.digest  # order-free


def test_copies_replayed_from_a_box_write_what_they_write_from_the_whole_tensor() -> None:
    """A rank staged only the box its plan asked for: the recorded copies, replayed from the
    box, land exactly the values they land from the whole tensor."""
    shapes = {"col": (8, 6), "row": (6, 8), "norm": (6,)}

    def col(p, w):  # two copies from one tensor: rows 4..6 and 6..8 into the two halves of p
        p.narrow(0, 0, 2).copy_(w.narrow(0, 4, 2))
        p.narrow(0, 2, 2).copy_(w.narrow(0, 6, 2))

    def row(p, w):
        p.copy_(w.narrow(1, 4, 4))

    def norm(p, w):
        p.copy_(w)
    plan = _record(shapes, {"col": ((4, 6), col), "row": ((6, 4), row), "norm": ((6,), norm)})
    sp = plan.shard_plan(shapes)
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    boxed = {}
    for s in sp.shards:
        t = full[s.name]
        for d, (b, n) in enumerate(zip(s.start, s.length)):
            t = t.narrow(d, b, n)
        boxed[s.name] = t.contiguous()  # as it lands in staging
    assert boxed["col"].shape == (4, 6) and boxed["row"].shape == (6, 4) and boxed["norm"].shape == (6,)
    boxes = {s.name: ((s.start, s.length), shapes[s.name]) for s in sp.shards}
    from_full, from_box = plan.sources(full), plan.sources(boxed, boxes=boxes)
    assert len(from_full) == len(from_box) == 4
    for a, b in zip(from_full, from_box):
        assert torch.equal(a, b)


def test_an_announce_is_checked_against_the_workers_own_plan() -> None:
    """A point-to-point announce must follow the plan this worker sent: its digest, and for
    every tensor exactly the box the plan names; boxes without a plan are refused too."""
    from inflight.protocol import UpdateAnnounce
    from inflight.transport.bucket import plan_tensors
    from inflight.transport.schema import TensorSchema

    schema = TensorSchema({"a": ((8, 4), "float32"), "b": ((4,), "float32")})
    plan = make_plan({"a": ((4, 0), (4, 4)), "b": whole((4,))}, [])

    def announce(boxes: dict, digest: str) -> UpdateAnnounce:
        tensors, total = plan_tensors(((n, b[1], "float32") for n, b in boxes.items()),
                                      starts={n: b[0] for n, b in boxes.items()})
        return UpdateAnnounce(version=1, total_bytes=total, bucket_bytes=1 << 20, checksum_algo="crc32",
                              tensors=tensors, buckets=(BucketSpec(index=0, offset=0, nbytes=total),),
                              plan_digest=digest)
    good = {"a": ((4, 0), (4, 4)), "b": ((0,), (4,))}
    assert schema.check(announce(good, plan.digest), plan) is None
    wrong_box = schema.check(announce({"a": ((0, 0), (4, 4)), "b": ((0,), (4,))}, plan.digest), plan)
    assert wrong_box is not None and wrong_box.code == "bad_shape" and "plan reads (4, 0)+(4, 4)" in wrong_box.reason
    other = schema.check(announce(good, "0" * 32), plan)
    assert other is not None and other.code == "bad_layout" and "follows shard plan 000" in other.reason
    unplanned = schema.check(announce(good, plan.digest), None)
    assert (unplanned is not None and unplanned.code == "bad_layout"
            and "this worker sent no shard plan" in unplanned.reason)
    boxes_only = schema.check(announce(good, ""), plan)
    assert (boxes_only is not None and boxes_only.code == "bad_layout"
            and "boxes without a shard plan" in boxes_only.reason)
