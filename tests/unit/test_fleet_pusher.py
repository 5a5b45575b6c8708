"""A fleet on a communicator per engine (``FleetPusher``): two real engine processes, each in a
weight group of its own with the trainer, both groups on one store.

- every push lands on both engines, each with its own group's ranks;
- one engine frozen (SIGSTOP) in the middle of its transfer does not hold the other back:
  the other engine's update commits while the frozen one still cannot move (it is thawed
  only after), in about the time an update of both takes, not after the timeout; the
  frozen engine then finishes its own update late;
- re-forming one engine's group touches only that group: the other keeps its generation;
- a push one engine refuses lands on the other and is reported as failed on the first
  (``FleetPushError``), which keeps serving its last good version; bad input for any engine
  raises before anything is sent to any.
Signals are sent from the pusher's own seam between two buckets, never on a timer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import msgspec
import pytest
from safetensors.torch import load_file

from inflight.transport.fleet_pusher import FleetPusher, FleetPushError, collect
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig
from tests.engine_harness import idle_engine, perturbed
from tests.helpers import tampering

TIMEOUT_S = 120.0  # far above an update's time here: an engine waiting on another would show


@pytest.fixture
def fleet(tiny_qwen, port):
    base = GroupConfig(port=port, timeout_s=TIMEOUT_S)
    ctx = mp.get_context("spawn")
    ready = [ctx.Event() for _ in range(2)]
    procs = [ctx.Process(target=idle_engine, args=(str(tiny_qwen), base.for_engine(e, 1), 1, ready[e]), daemon=True)
             for e in range(2)]
    for p in procs:
        p.start()
    pusher = FleetPusher(base, [1, 1], PushConfig(dtype="float32", bucket_mb=0.05, reply_timeout_s=TIMEOUT_S),
                         join_timeout_s=600)
    try:
        for e in ready:
            assert e.wait(600), "an engine did not start"
        yield pusher, procs, load_file(str(tiny_qwen / "model.safetensors"))
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
        pusher.close()
        for p in procs:
            p.kill()
            p.join(30)


def test_a_frozen_engine_holds_back_only_its_own_update(fleet) -> None:
    pusher, procs, base = fleet
    assert pusher.engine_versions == {0: {1: 0}, 1: {1: 0}}  # each engine is rank 1 of its own group
    t0 = time.perf_counter()
    both = pusher.push(1, perturbed(base, seed=1, scale=0.01))
    normal_s = time.perf_counter() - t0
    assert sorted(both) == [0, 1] and all(sorted(r.commits) == [1] for r in both.values())
    assert all(r.send.buckets > 4 for r in both.values())  # room to freeze one in the middle

    frozen = {}

    def freeze_engine_1(header, data):  # engine 1's pusher, between two of its buckets
        if header.index == 2 and not frozen:
            os.kill(procs[1].pid, signal.SIGSTOP)
            frozen["at"] = time.perf_counter()
        return header, data

    generation_0 = pusher.pushers[0].group.identity
    t0 = time.perf_counter()
    with tampering(pusher.pushers[1], freeze_engine_1):
        futures = pusher.push_async(2, perturbed(base, seed=2, scale=0.01))
        landed_0 = futures[0].result(timeout=TIMEOUT_S)
        alone_s = time.perf_counter() - t0
        assert frozen, "engine 1 was not frozen mid-transfer"
        assert not futures[1].done(), "engine 1 finished while frozen"  # so engine 0 did not wait for it
        assert sorted(landed_0.commits) == [1] and landed_0.version == 2
        os.kill(procs[1].pid, signal.SIGCONT)
        late = collect(2, {1: futures[1]})[1]  # thawed well within the timeout: it lands, late
    assert late.version == 2 and sorted(late.commits) == [1]
    print(f"\nfleet: an update of both engines {1e3 * normal_s:.0f} ms; engine 0's with engine 1 frozen "
          f"{1e3 * alone_s:.0f} ms (timeout {TIMEOUT_S:.0f} s)")
    assert alone_s < TIMEOUT_S / 4, (alone_s, normal_s)  # committed in its normal time, not at the timeout

    # re-forming engine 1's group leaves engine 0's alone
    assert pusher.rejoin(1) == {1: 2}
    assert pusher.pushers[0].group.identity == generation_0
    assert pusher.pushers[1].group.generation == 2
    assert sorted(pusher.push(3, perturbed(base, seed=3, scale=0.01))) == [0, 1]


def test_an_update_one_engine_refuses_lands_on_the_other(fleet) -> None:
    pusher, _, base = fleet
    pusher.push(1, perturbed(base, seed=1, scale=0.01))

    # bad input for one engine only (its shard plan altered on the trainer's side): every
    # engine's update is laid out before any is sent, so the error comes first and no engine
    # sees v2 (engine 0 takes the real v2 below, which it would refuse as stale otherwise)
    group = pusher.pushers[1].group
    assert group.point_to_point, "the engines sent shard plans"
    good = group.hellos[1]
    group.hellos[1] = msgspec.structs.replace(good, plan=msgspec.structs.replace(good.plan, digest="0" * 16))
    with pytest.raises(ValueError, match="worker rank 1: shard plan digest"):
        pusher.push(2, perturbed(base, seed=2, scale=0.01))
    group.hellos[1] = good

    def corrupt(header, data):  # engine 0's first bucket arrives altered: its checksum fails there
        if header.index == 0:
            data = data.clone()
            data[:8] ^= 0xFF
        return header, data

    with (pytest.raises(FleetPushError, match=r"(?s)engine 0.*checksum") as refused,
          tampering(pusher.pushers[0], corrupt)):
        collect(2, pusher.push_async(2, perturbed(base, seed=2, scale=0.01)))
    assert sorted(refused.value.landed) == [1] and sorted(refused.value.failed) == [0]
    assert "engine 0" in str(refused.value) and "checksum" in str(refused.value)
    # what each engine serves, as its workers report on joining a re-formed group
    assert pusher.rejoin(0) == {1: 1}  # engine 0 kept its last good version
    assert pusher.rejoin(1) == {1: 2}
    assert sorted(pusher.push(3, perturbed(base, seed=3, scale=0.01))) == [0, 1]
