"""Nobody pushes weights who should not.

- the trainer's store listens on loopback unless an address is configured, and a group
  reachable from other machines without a shared secret is refused unless ``insecure``;
- with ``INFLIGHT_SECRET`` on both sides every control message is authenticated: a trainer
  with a wrong or missing secret is refused with an error naming the secret, a message a
  stray client forges is refused (``unauthenticated``), and the engine keeps serving;
- rollout items are authenticated the same way.
"""

from __future__ import annotations

import os
import re
import socket
import threading

import msgspec
import pytest
from torch.distributed import HashStore, PrefixStore, TCPStore

from inflight.auth import SECRET_ENV, seal
from inflight.protocol import AuthError, Commit, RolloutGroup, RolloutSample, encode
from inflight.rollout_queue import RolloutBuffer, RolloutQueue
from inflight.transport.errors import TransportError
from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, PushRejected, WeightPusher
from inflight.transport.store import store_reachable, wait_key
from tests.engine_harness import Harness, perturbed
from tests.helpers import WAIT_S, form_pair, tampering

SECRET = "correct horse battery staple"


def _outside_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_store_listens_on_loopback_unless_an_address_is_configured(host: str, hold_port) -> None:
    outside = _outside_address()
    if outside is None:
        pytest.skip("this machine has no address but loopback")
    config = GroupConfig(host=host, port=hold_port(host), world_size=2, timeout_s=60.0, insecure=host == "0.0.0.0")
    errors: list[BaseException] = []
    trainers: list[WeightGroup] = []
    up = threading.Event()

    def trainer() -> None:  # hosts the store, waits for the worker
        try:
            trainers.append(WeightGroup(config, 0, join_timeout_s=60.0))
        except BaseException as e:  # surfaced below
            errors.append(e)
        up.set()

    threading.Thread(target=trainer, daemon=True).start()
    # the held socket is the store's own (``hold_port``): it listens from the start, on ``host`` only
    assert store_reachable("127.0.0.1", config.port)
    assert store_reachable(outside, config.port) == (host == "0.0.0.0")
    # let the trainer go: a worker joins, so the trainer's wait ends with the group formed
    worker = WeightGroup(GroupConfig(host="127.0.0.1", port=config.port, world_size=2, timeout_s=60.0), 1,
                         join_timeout_s=60.0)
    assert up.wait(WAIT_S), f"waited {WAIT_S:.0f} s for the trainer's group to form"
    assert not errors, errors  # the store was this very socket, and the group formed
    worker.close()
    trainers[0].close()


def test_a_group_off_loopback_without_a_secret_is_refused_unless_insecure(hold_port, monkeypatch, caplog) -> None:
    """Both ends refuse before anything listens or connects; ``insecure`` lets it through, loudly."""
    import dataclasses
    import logging

    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = GroupConfig(host="0.0.0.0", port=hold_port("0.0.0.0"), world_size=2, timeout_s=5.0)
    with pytest.raises(ValueError, match=f"trainer rank 0: the weight group at 0.0.0.0:{config.port} is reachable "
                                         f"from other machines and has no shared secret.*Set {SECRET_ENV}"):
        WeightGroup(config, 0, join_timeout_s=1.0)
    with pytest.raises(ValueError, match="worker rank 1: the weight group at 0.0.0.0.* has no shared secret"):
        WeightGroup(config, 1, join_timeout_s=1.0)
    for loopback in ("127.0.0.1", "127.0.0.2", "localhost"):
        dataclasses.replace(config, host=loopback).check_exposure(None, "rank 0")  # loopback: nothing to refuse
    config.check_exposure(SECRET.encode(), "rank 0")  # a secret seals everything: nothing to refuse
    with caplog.at_level(logging.WARNING, logger="inflight.group"):
        dataclasses.replace(config, insecure=True).check_exposure(None, "rank 0")
    assert "INSECURE" in caplog.text and "0.0.0.0" in caplog.text


def test_an_engine_off_loopback_without_a_secret_refuses_to_start_and_keeps_serving(tiny_llama, monkeypatch) -> None:
    from vllm import LLM, SamplingParams

    from inflight.engine.client import inflight_status, start_inflight
    from inflight.engine.engine_config import InflightConfig, engine_kwargs

    monkeypatch.delenv(SECRET_ENV, raising=False)
    llm = LLM(str(tiny_llama), enforce_eager=True, dtype="float32", max_model_len=256, seed=0, **engine_kwargs())
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    before = llm.generate(["1+2="], sp, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=f"inflight worker rank 1: the weight group at 10.9.8.7:29999 .* {SECRET_ENV}"):
        start_inflight(llm, InflightConfig(group=GroupConfig(host="10.9.8.7", port=29999)))
    assert not inflight_status(llm).started  # nothing was set up: no listener, no coordinator
    assert llm.generate(["1+2="], sp, use_tqdm=False)[0].outputs[0].token_ids == before
    del llm


# -- a serving engine with a secret ---------------------------------------------------------------
@pytest.fixture(scope="module")
def harness(tiny_llama, hold_port):
    saved = os.environ.get(SECRET_ENV)
    os.environ[SECRET_ENV] = SECRET  # the engine reads it at its start, the pusher at its construction
    try:
        h = Harness(tiny_llama, "float32", hold_port(), timeout_s=60.0)
    finally:
        os.environ.pop(SECRET_ENV) if saved is None else os.environ.__setitem__(SECRET_ENV, saved)
    yield h
    os.environ[SECRET_ENV] = SECRET
    try:
        h.close()
    finally:
        os.environ.pop(SECRET_ENV) if saved is None else os.environ.__setitem__(SECRET_ENV, saved)


def _serves(h: Harness, version: int) -> None:
    (_, out), = h.greedy(["1+2="], max_tokens=4)
    assert out.versions == [version] * 4


def _trainer(h: Harness) -> WeightPusher:
    return WeightPusher(h.group, PushConfig(dtype="float32", bucket_mb=0.25), join_timeout_s=120.0)


def test_trainer_with_a_wrong_or_missing_secret_is_refused(harness: Harness, monkeypatch) -> None:
    h = harness
    monkeypatch.setenv(SECRET_ENV, SECRET)
    h.push(perturbed(h.base, seed=1))
    live = h.version
    h.pusher.close()  # this trainer leaves; impostors take its port
    for secret, says in [("wrong", "wrong authentication code"), (None, f"{SECRET_ENV} is not set here")]:
        if secret is None:
            monkeypatch.delenv(SECRET_ENV)
        else:
            monkeypatch.setenv(SECRET_ENV, secret)
        with pytest.raises(AuthError, match=f"worker rank 1's hello.*{re.escape(says)}") as exc:
            _trainer(h)
        assert "worker rank 1's hello" in str(exc.value) and says in str(exc.value), str(exc.value)
        _serves(h, live)
        assert h.status().live_version == live
    monkeypatch.setenv(SECRET_ENV, SECRET)  # the right trainer comes back and pushes
    h.pusher = _trainer(h)
    h.push(perturbed(h.base, seed=2))
    _serves(h, h.version)


def test_a_forged_control_message_is_refused_and_the_engine_keeps_serving(harness: Harness, monkeypatch) -> None:
    h = harness
    monkeypatch.setenv(SECRET_ENV, SECRET)
    h.push(perturbed(h.base, seed=3))
    live = h.version
    g, seq = h.pusher.group.generation, h.pusher.control.seq
    stray = PrefixStore(h.group.name, TCPStore(h.group.host, h.group.port, is_master=False, wait_for_workers=False))
    refused_before = h.status().rejections.get("unauthenticated", 0)
    forgeries = [encode(Commit(version=live + 1)),  # unsigned
                 seal(encode(Commit(version=live + 1)), b"guessed", f"inflight/x/gen{g}/ctl/msg/{seq + 1}")]
    for k, forged in enumerate(forgeries):
        stray.set(f"gen{g}/ctl/msg/{seq + k}", forged)
        wait_key(stray, f"gen{g}/ctl/rep/{seq + k}/ack/1", timeout_s=60, stop=None, what="the refusal", who="test")
        # the trainer's message of that number was pre-empted
        with pytest.raises(PushRejected, match=rf"\[unauthenticated\] .*{SECRET_ENV}") as exc:
            h.pusher.push(live + 1, perturbed(h.base, seed=4))
        assert exc.value.codes == {"unauthenticated"} and SECRET_ENV in str(exc.value), str(exc.value)
        _serves(h, live)
    assert h.status().rejections["unauthenticated"] == refused_before + 2
    h.push(perturbed(h.base, seed=4))  # the real trainer's next update lands
    _serves(h, h.version)


def test_a_forged_bucket_with_a_valid_checksum_is_refused_and_the_engine_keeps_serving(harness: Harness,
                                                                                      monkeypatch) -> None:
    """Bytes altered on the data plane so that the (linear) wsum64 checksum still matches are
    caught by the bucket's keyed MAC: the update is refused, nothing of it goes live."""
    import torch

    h = harness
    monkeypatch.setenv(SECRET_ENV, SECRET)
    h.push(perturbed(h.base, seed=5))
    live = h.version
    (_, before), = h.greedy(["1+2="], max_tokens=4)
    h.pusher.close()  # a trainer whose buckets carry the linear checksum takes its place
    pusher = h.pusher = WeightPusher(h.group, PushConfig(dtype="float32", bucket_mb=0.25, checksum="wsum64"),
                                     join_timeout_s=120.0)

    def forge(header, data: torch.Tensor):
        words = data.clone().view(torch.int64)  # w_i += a(2j+1), w_j -= a(2i+1): the same wsum64
        i, j, a = 3, 11, 12345
        words[i] += a * (2 * j + 1)
        words[j] -= a * (2 * i + 1)
        forged = words.view(torch.uint8)
        from inflight.transport.bucket import checksum

        assert checksum(forged, "wsum64") == checksum(data, "wsum64") and not torch.equal(forged, data)
        return header, forged if header.index == 1 else data
    with pytest.raises(PushRejected, match=r"\[unauthenticated\] .*bucket 1 of v") as exc, tampering(pusher, forge):
        pusher.push(live + 1, perturbed(h.base, seed=6))
    assert exc.value.codes == {"unauthenticated"} and "bucket 1 of v" in str(exc.value), str(exc.value)
    (_, after), = h.greedy(["1+2="], max_tokens=4)
    assert after.versions == [live] * 4 and after.token_ids == before.token_ids and after.logprobs == before.logprobs
    h.version = live
    h.push(perturbed(h.base, seed=6))  # the same update, untampered, lands
    _serves(h, h.version)


def test_forged_generation_and_rendezvous_keys_are_refused(port, monkeypatch) -> None:
    """With a secret, a stray store client can neither pull a worker out of its generation
    (the generation number is sealed) nor pose as a member in the data plane's rendezvous
    (gloo's addresses are sealed): the forged values are refused, the group keeps working."""
    from datetime import timedelta

    import torch

    from inflight.transport.data_plane import DataPlane
    from inflight.transport.store import SealedStore

    monkeypatch.setenv(SECRET_ENV, SECRET)
    trainer, worker = form_pair(port, timeout_s=60.0)
    config = trainer.config
    stray = PrefixStore(config.name, TCPStore(config.host, config.port, is_master=False, wait_for_workers=False))
    for forged in (b"99", seal(b"99", b"guessed", f"{config.name}/{trainer.incarnation}/generation")):
        stray.set("generation", forged)
        assert not worker.superseded()  # a forged number pulls no one out of generation 1
    got = torch.zeros(4)
    pending = worker.start_broadcast(got, what="after the forgeries")
    trainer.broadcast(torch.arange(4.0), what="after the forgeries")
    worker.wait(pending)
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0]

    # the rendezvous of a data plane: rank 0's address, forged by the stray client
    stray.set("forged/pg/0/0", b"an address of the stray client's choosing")
    rendezvous = SealedStore(PrefixStore(f"{config.name}/forged/pg", worker._tcp), SECRET.encode(), "ctx")
    with pytest.raises(TransportError,
                       match="worker rank 1: forming a gloo group of 2 failed: ctx/0/0: unauthenticated message"):
        DataPlane(rendezvous, rank=1, pg_rank=1, size=2, backend="gloo", timeout=timedelta(seconds=60),
                  device=torch.device("cpu"), peers=[0], superseded=lambda: False)
    worker.close()
    trainer.close()


def test_rollout_items_are_authenticated() -> None:
    sample = RolloutSample(sample_id="s", group_id="g", prompt_ids=[1], token_ids=[5], logprobs=[-0.5], versions=[0],
                           reward=1.0)
    store = HashStore()
    queue = RolloutQueue(store, capacity=10, secret=SECRET.encode(), incarnation="this-run")  # the consumer
    buffer = RolloutBuffer(queue, admit_lag=4)
    RolloutQueue(store, capacity=10, secret=SECRET.encode()).put(RolloutGroup(group_id="g", samples=(sample,)))
    queue.put_raw(msgspec.msgpack.encode(RolloutGroup(group_id="forged", samples=(
        msgspec.structs.replace(sample, group_id="forged"),))))
    RolloutQueue(store, capacity=10, secret=b"other").put(RolloutGroup(group_id="g2", samples=(
        msgspec.structs.replace(sample, group_id="g2"),)))
    assert buffer.drain(current_version=0) == 3
    assert [g.group_id for g in buffer.pending] == ["g"]
    assert buffer.stats()["rejected"] == {"unauthenticated": 2}


def test_a_rollout_item_of_an_earlier_run_is_refused_in_the_next(hold_port) -> None:
    """An item sealed for its slot in one run's store, replayed byte for byte into the same
    slot of the next run's store (the same secret, a new incarnation), is not trained on."""
    from inflight.transport.store import host_store

    sample = RolloutSample(sample_id="s", group_id="g", prompt_ids=[1], token_ids=[5], logprobs=[-0.5], versions=[0],
                           reward=1.0)
    group = RolloutGroup(group_id="g", samples=(sample,))
    recorded: list[bytes] = []
    for run in ("first-run", "next-run"):
        from datetime import timedelta

        port = hold_port()
        store = PrefixStore("inflight/rollout", host_store("127.0.0.1", port, 2, timedelta(seconds=10)))
        consumer = RolloutQueue(store, capacity=4, secret=SECRET.encode(), incarnation=run)
        producer = RolloutQueue(PrefixStore("inflight/rollout", TCPStore("127.0.0.1", port, is_master=False)),
                                capacity=4, secret=SECRET.encode())
        buffer = RolloutBuffer(consumer, admit_lag=4)
        if not recorded:  # the first run: a genuine item, recorded by a store client on its way
            producer.put(group)
            recorded.append(store.get("item/0"))
            assert buffer.drain(current_version=0) == 1 and [g.group_id for g in buffer.pending] == ["g"]
        else:  # the next run: the recorded bytes, replayed into slot 0
            producer.put_raw(recorded[0])
            assert buffer.drain(current_version=0) == 1
            assert buffer.pending == [] and buffer.stats()["rejected"] == {"unauthenticated": 1}
            producer.put(group)  # the same group, sealed for this run, is taken
            assert buffer.drain(current_version=0) == 1 and [g.group_id for g in buffer.pending] == ["g"]


def test_worker_with_a_secret_refuses_an_unsealed_roster(port) -> None:
    """The other direction: a trainer without the secret cannot enrol a worker that has one."""
    config = GroupConfig(port=port, world_size=2, timeout_s=60.0)  # far above a refusal's time: not what ends it
    hosted: list[BaseException] = []

    def trainer() -> None:
        try:
            WeightGroup(config, 0, join_timeout_s=60.0, secret=None)
        except BaseException as e:  # it refuses the worker's sealed hello
            hosted.append(e)

    t = threading.Thread(target=trainer, daemon=True)
    t.start()
    # the trainer refuses, and closes its store: not a timeout
    with pytest.raises(TransportError, match="worker rank 1: the group store failed") as refused:
        WeightGroup(config, 1, join_timeout_s=60.0, secret=SECRET.encode())
    assert type(refused.value) is TransportError, refused.value  # a TransportTimeout is not the refusal
    t.join(WAIT_S)
    assert not t.is_alive(), f"waited {WAIT_S:.0f} s for the trainer's refusal"
    assert hosted and isinstance(hosted[0], AuthError) and f"{SECRET_ENV} is not set here" in str(hosted[0])
