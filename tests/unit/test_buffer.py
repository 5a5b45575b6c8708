"""Rollout queue on a real TCPStore: order, bound, validation, max-lag admission."""

from __future__ import annotations

import math
import threading
from datetime import timedelta

import msgspec
import pytest
from torch.distributed import PrefixStore, TCPStore

from inflight.protocol import RolloutGroup, RolloutSample
from inflight.rollout_queue import RolloutBuffer, RolloutQueue
from inflight.transport.store import host_store


def _group(gid: str, versions: list[int], *, logprob: float = -1.0, size: int = 2, reward: float = 1.0) -> RolloutGroup:
    return RolloutGroup(group_id=gid, samples=tuple(
        RolloutSample(sample_id=f"{gid}-{i}", group_id=gid, prompt_ids=[1, 2], token_ids=[3] * len(versions),
                      logprobs=[logprob] * len(versions), versions=versions, reward=reward)
        for i in range(size)))


@pytest.fixture
def store(port):
    master = host_store("127.0.0.1", port, 2, timedelta(seconds=10))  # on the socket ``port`` holds
    yield PrefixStore("test/rollout", master)


def test_fifo_across_producer_and_consumer_connections(store, port) -> None:
    producer_store = PrefixStore("test/rollout",
                                 TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)))
    producer, consumer = RolloutQueue(producer_store, capacity=8), RolloutQueue(store, capacity=8)
    for i in range(5):
        producer.put(_group(f"g{i}", [0, 0]))
    assert consumer.depth() == 5
    got = [msgspec.msgpack.decode(consumer.get(timeout_s=5))["group_id"] for _ in range(5)]
    assert got == [f"g{i}" for i in range(5)] and consumer.depth() == 0


def test_a_full_queue_holds_the_producer_back(store) -> None:
    q = RolloutQueue(store, capacity=2)
    q.put(_group("a", [0]))
    q.put(_group("b", [0]))
    with pytest.raises(TimeoutError, match="queue full"):
        q.put(_group("c", [0]), timeout_s=0.3)
    done, saw_full, room = threading.Event(), threading.Event(), q._room

    def watched_room():  # the producer's look for room, seen from the test: an event, not a sleep
        found = room()
        if found is None:
            saw_full.set()
        return found

    q._room = watched_room
    threading.Thread(target=lambda: (q.put(_group("c", [0]), timeout_s=10), done.set())).start()
    assert saw_full.wait(5)  # the producer found the queue full ...
    assert not done.is_set()  # ... and waits
    q.get(timeout_s=5)  # the consumer frees one slot ...
    assert done.wait(5)  # ... and the producer goes on
    assert q.depth() == 2


def test_malformed_groups_are_counted_and_dropped(store) -> None:
    q = RolloutQueue(store, capacity=16)
    q.put(_group("nan", [0, 0], logprob=math.nan))
    q.put(_group("small", [0, 0], size=1))
    q.put(_group("future", [0, 9]))
    q.put(_group("pos", [0, 0], logprob=0.5))
    q.put(_group("inf-reward", [0, 0], reward=math.inf))
    bad = msgspec.msgpack.encode({"kind": "group", "group_id": "x", "samples": [
        {"kind": "sample", "sample_id": "s", "group_id": "x", "prompt_ids": [1], "token_ids": [1, 2],
         "logprobs": [-1.0], "versions": [0, 0], "reward": 0.0}]})
    q.put_raw(bad)  # 2 tokens, 1 log-prob
    q.put_raw(b"\x00garbage")
    q.put(_group("ok", [1, 1]))
    buf = RolloutBuffer(q, admit_lag=4, group_size=2)
    batch = buf.next_batch(1, current_version=2, timeout_s=5)
    assert [g.group_id for g in batch] == ["ok"]
    assert dict(buf.rejected) == {"nonfinite_logprob": 1, "group_size": 1, "future_version": 1, "positive_logprob": 1,
                                  "nonfinite_reward": 1, "length_mismatch": 1, "bad_message": 1}
    assert buf.admitted == 1


def test_max_lag_admission_drops_stale_groups(store) -> None:
    q = RolloutQueue(store, capacity=16)
    for gid, versions in [("old", [1, 5]), ("edge", [4, 6]), ("new", [6, 6])]:
        q.put(_group(gid, versions))
    buf = RolloutBuffer(q, admit_lag=2, group_size=2)
    batch = buf.next_batch(2, current_version=6, timeout_s=5)  # oldest admissible version: 4
    assert [g.group_id for g in batch] == ["edge", "new"]
    assert buf.dropped_stale == 1
    # groups held over (e.g. restored from a checkpoint) age too: fine at version 6, too old at 9
    q.put(_group("fresh", [9, 9]))
    held = RolloutBuffer(q, admit_lag=2, group_size=2, pending=[_group("held", [6, 6])])
    assert [g.group_id for g in held.next_batch(1, current_version=9, timeout_s=5)] == ["fresh"]
    assert held.dropped_stale == 1 and held.pending == []


def test_consumer_timeout_names_what_it_waited_for(store) -> None:
    buf = RolloutBuffer(RolloutQueue(store, capacity=4), admit_lag=1, group_size=2)
    with pytest.raises(Exception, match=r"no rollout #0 within 0.3s"):
        buf.next_batch(1, current_version=0, timeout_s=0.3)


def test_groups_the_loss_would_mask_whole_are_dropped_as_stale(store) -> None:
    q = RolloutQueue(store, capacity=16)
    # at version 10 with the loss's max lag 3, tokens of versions < 7 are masked
    for gid, versions in [("all-masked", [4, 6]), ("one-kept", [4, 7]), ("fresh", [9, 10])]:
        q.put(_group(gid, versions))
    buf = RolloutBuffer(q, admit_lag=8, mask_lag=3, group_size=2)
    assert [g.group_id for g in buf.next_batch(2, current_version=10, timeout_s=5)] == ["one-kept", "fresh"]
    assert buf.dropped_stale == 1 and buf.dropped_ids == ["all-masked"]
    with pytest.raises(ValueError, match="mask_lag=-1"):
        RolloutBuffer(q, admit_lag=8, mask_lag=-1)


def test_the_consumer_version_reaches_producers_and_stray_bytes_read_as_unknown(store, port) -> None:
    producer = RolloutQueue(PrefixStore("test/rollout", TCPStore("127.0.0.1", port, is_master=False,
                                                                  timeout=timedelta(seconds=10))), capacity=4)
    consumer = RolloutQueue(store, capacity=4)
    assert producer.consumer_version() is None
    consumer.publish_version(7)
    assert producer.consumer_version() == 7
    store.set("consumer_version", b"\xff\x00")  # a stray client of the store
    assert producer.consumer_version() is None


@pytest.mark.parametrize("ahead, trainer, live, ok", [
    (0, None, 0, True),    # first group of a run: lag 1 at most (the trainer may be computing)
    (7, 5, 5, True),       # one batch ahead at G=4 -> trained 1 + 1 versions on: 2 <= 3
    (8, 5, 5, True),       # two batches ahead: 1 + 2 = 3 <= 3
    (12, 5, 5, False),     # three: 4 > 3
    (4, 6, 5, True),       # the engine serves one version behind the trainer: 1 + 1 + 1 = 3
    (8, 6, 5, False),      # ... and two batches ahead: 4
    (0, 9, 5, False),      # the engine is 4 versions behind: even an empty queue is too late
])
def test_an_engine_starts_a_group_only_if_it_is_trained_within_max_lag(ahead, trainer, live, ok) -> None:
    from inflight.trainer.rollout.engine_process import may_start_group

    assert may_start_group(ahead=ahead, trainer_version=trainer, live_version=live, groups_per_step=4, max_lag=3) is ok
