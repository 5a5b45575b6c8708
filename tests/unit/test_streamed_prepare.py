"""Preparing an update bucket by bucket, while the rest of it is on the wire.

- ``completed_by_bucket`` lists every tensor exactly once, with the bucket holding its last
  byte (checked against a byte-by-byte reference on awkward layouts: buckets of 1 byte,
  tensors of no bytes, tensors spanning many buckets);
- ``Countdown`` names a layer complete exactly when the last tensor writing any of its
  parameters arrived (tied parameters included), and refuses a tensor twice;
- the listener hands each bucket's tensors to ``prepare_part`` once they verified, in order,
  while later buckets have not landed yet (seen in the staging buffer itself), and
  ``prepare`` still gets the whole version;
- a NaN in a middle bucket, or a ``prepare_part`` that raises, refuses the update: nothing
  after it is fed, the target discards what it prepared, and the live version stays.
"""

from __future__ import annotations

import random

import pytest
import torch

from inflight.engine.commit.swap import Dependencies
from inflight.protocol import BucketSpec
from inflight.transport.bucket import completed_by_bucket, plan_tensors
from inflight.transport.peer import DictTarget
from inflight.transport.pusher import PushRejected
from inflight.transport.schema import TensorSchema
from tests.helpers import ListenerPair, state_dict_of


def _buckets(total: int, size: int) -> list[BucketSpec]:
    return [BucketSpec(index=i, offset=o, nbytes=min(size, total - o))
            for i, o in enumerate(range(0, total, size))]


@pytest.mark.parametrize("seed", range(6))
def test_each_tensor_is_due_once_with_the_bucket_holding_its_last_byte(seed: int) -> None:
    rng = random.Random(seed)
    shapes = [(f"t{i}", (rng.choice([0, 1, 3, 17, 64, 1000]),), rng.choice(["float32", "bfloat16", "int64"]))
              for i in range(rng.randint(1, 12))]
    tensors, total = plan_tensors(shapes)
    if total == 0:
        assert completed_by_bucket(tensors, []) == []
        return
    for size in (1, 7, 64, 100, total, total + 5):
        buckets = _buckets(total, size)
        due = completed_by_bucket(tensors, buckets)
        owner = [b.index for b in buckets for _ in range(b.nbytes)]  # byte -> bucket, the slow way
        want: list[list[str]] = [[] for _ in buckets]
        for t in tensors:
            last = t.offset + t.nbytes - 1 if t.nbytes else t.offset
            want[owner[min(last, total - 1)]].append(t.name)
        assert due == want
        assert sorted(n for names in due for n in names) == sorted(t.name for t in tensors)


def test_a_layer_is_complete_when_the_last_tensor_of_its_parameters_arrives() -> None:
    # keys: 1 = fused qkv (q, k, v), 2 = o, 3 = embedding, tied into the LM head (layer 2)
    writers = {"q": [1], "k": [1], "v": [1], "o": [2], "embed": [3]}
    deps = Dependencies(writers, [[1, 2], [3], [3], []])
    c = deps.countdown()
    assert c.ready_at_start() == [3]  # holds no parameter
    assert c.arrived(["q", "o"]) == []
    assert c.arrived(["k"]) == []
    assert c.arrived(["embed"]) == [1, 2]  # the embedding and the LM head tied to it
    assert c.arrived(["v"]) == [0]
    assert c.missing() == []
    with pytest.raises(ValueError, match="arrived twice"):
        c.arrived(["q"])
    with pytest.raises(KeyError, match="not part of"):
        deps.countdown().arrived(["lm_head.weight"])
    with pytest.raises(ValueError, match="no checkpoint tensor writes"):
        Dependencies(writers, [[4]])


BUCKET_MB = 0.05  # ~26 buckets for the tiny Qwen2 (1.3 MB)


class Recording(DictTarget):
    """Notes each ``prepare_part`` call and, reading the staging buffer its views live in,
    whether tensors at least two buckets further on had landed by then (they cannot have:
    the receiver posts only the next bucket before it hands this one over)."""

    def __init__(self, named: dict[str, torch.Tensor], fail_at: int | None = None) -> None:
        super().__init__()
        self.parts: list[list[str]] = []
        self.ahead: list[tuple[int, bool]] = []  # per call: (tensors two buckets on, any of them landed)
        self.prepared: list[list[str]] = []
        self.discards = 0
        self.fail_at = fail_at
        self.expect(named)

    def expect(self, named: dict[str, torch.Tensor]) -> None:
        self.named = named
        specs, _ = plan_tensors((n, tuple(t.shape), "float32") for n, t in named.items())  # the pusher's layout
        self.layout = {t.name: t for t in specs}

    def prepare_part(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.parts.append(list(weights))
        if self.fail_at is not None and len(self.parts) == self.fail_at:
            raise RuntimeError("re-pack failed")
        for name, t in weights.items():
            assert torch.equal(t, self.named[name]), f"{name} fed before its bytes verified"
        # the staging buffer
        flat = torch.empty(0, dtype=torch.uint8).set_(next(iter(weights.values())).untyped_storage())
        end = max(self.layout[n].offset + self.layout[n].nbytes for n in weights)
        later = [t for t in self.layout.values() if t.offset >= end + 2 * int(BUCKET_MB * (1 << 20))]
        landed = any(torch.equal(flat[t.offset:t.offset + t.nbytes].view(torch.float32).view(t.shape),
                                 self.named[t.name])
                     for t in later)
        self.ahead.append((len(later), landed))

    def prepare(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.prepared.append(list(weights))

    def discard(self) -> None:
        self.discards += 1


@pytest.fixture
def model(tiny_qwen):
    sd = state_dict_of(tiny_qwen)
    return sd, TensorSchema({k: (tuple(v.shape), "float32") for k, v in sd.items()})


def _version(sd: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
    return {name: t + k for name, t in sd.items()}  # every tensor differs from every other version's


def test_buckets_are_fed_as_they_verify_while_later_ones_are_on_the_wire(model, port) -> None:
    sd, schema = model
    target = Recording(_version(sd, 1))
    pair = ListenerPair(port, schema, target=target, bucket_mb=BUCKET_MB)
    try:
        for v in (1, 2, 3):  # the staging buffers rotate: a landed check against stale bytes would show
            named = _version(sd, v)
            target.expect(named)
            target.parts.clear(), target.ahead.clear()
            pair.pusher.push(v, named)
            fed = [n for part in target.parts for n in part]
            assert fed == list(named), "every tensor fed once, in stream order"
            streamed = [landed for n_later, landed in target.ahead if n_later]
            assert len(streamed) >= 5, f"{target.ahead}: the update was not fed while it was received"
            assert not any(streamed), target.ahead
            assert target.prepared[-1] == list(named)
            assert target.live_version == v and all(torch.equal(target.live[n], named[n]) for n in sd)
        assert target.discards == 0 and pair.error is None
    finally:
        pair.close()


@pytest.mark.parametrize("fault", ["nan", "prepare_part"])
def test_a_fault_mid_stream_refuses_the_update_and_feeds_nothing_after_it(model, port, fault: str) -> None:
    sd, schema = model
    good = _version(sd, 1)
    target = Recording(good)
    pair = ListenerPair(port, schema, target=target, bucket_mb=BUCKET_MB)
    try:
        pair.pusher.push(1, good)
        bad = _version(sd, 2)
        middle = list(bad)[len(bad) // 2]
        if fault == "nan":
            bad[middle].view(-1)[0] = float("nan")
        target.expect(bad)
        target.parts.clear()
        target.fail_at = 3 if fault == "prepare_part" else None
        with pytest.raises(PushRejected, match=r"\[nonfinite\]" if fault == "nan" else r"\[prepare_failed\]") as exc:
            pair.pusher.push(2, bad)
        assert exc.value.codes == {"nonfinite" if fault == "nan" else "prepare_failed"}
        fed = [n for part in target.parts for n in part]
        if fault == "nan":
            assert middle not in fed and fed == list(bad)[:len(fed)] and fed
        else:
            assert len(target.parts) == 3
        assert target.discards >= 1
        assert len(target.prepared) == 1, "the refused version reached prepare"
        assert target.live_version == 1 and all(torch.equal(target.live[n], good[n]) for n in sd)
        target.fail_at = None
        target.expect(_version(sd, 3))
        pair.pusher.push(3, target.named)  # the next good update goes through
        assert target.live_version == 3 and pair.error is None
    finally:
        pair.close()


def test_an_update_of_empty_tensors_has_no_bucket_and_still_stages(port) -> None:
    """Nothing to stream: the finite check, ``prepare_part`` and ``prepare`` still run once each,
    after the (empty) receive."""
    target = Recording({"empty": torch.zeros(0), "none": torch.zeros(0, 3)})
    pair = ListenerPair(port, None, target=target, bucket_mb=BUCKET_MB)
    try:
        pair.pusher.push(1, target.named)
        assert target.parts == [["empty", "none"]] and target.prepared == [["empty", "none"]]
        assert target.live_version == 1 and pair.error is None
    finally:
        pair.close()
