"""Transport: bucketed transfer over a real gloo group, checksums, refusals, timeouts."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
import zlib
from datetime import timedelta

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from inflight.protocol import ALIGN, BucketHeader
from inflight.transport.bucket import (
    BucketReceiver,
    BucketSender,
    bucket_windows,
    checksum,
    pack_into,
    plan_tensors,
    tensor_views,
)
from inflight.transport.errors import TransportError, TransportTimeout
from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig
from inflight.transport.listener import UpdateListener
from inflight.transport.peer import run_peer
from inflight.transport.pusher import PushConfig, PushRejected, WeightPusher
from inflight.transport.schema import TensorSchema
from tests.helpers import WAIT_S, ListenerPair, form_pair, state_dict_of, tampering

GROUP_TIMEOUT_S = 60.0
"""The group timeout of tests that do not exercise it: far above any wait of theirs on a loaded machine."""
DEAD_STORE_TIMEOUT_S = 600.0
"""The group timeout of the dead-store test: the other way its wait would end, far from its bound."""
NOTICED_S = 60.0
"""How soon a worker gives up on a dead trainer: a beat or two (0.5 s each; well under a second
on an idle machine), with room for a loaded one, and a tenth of the group's timeout, the other
way its wait would end."""
assert NOTICED_S <= DEAD_STORE_TIMEOUT_S / 10


# -- layout and checksums -----------------------------------------------------------------

def _wsum64_reference(data: bytes) -> int:
    data = data + b"\0" * (-len(data) % 8)
    words = [int.from_bytes(data[i:i + 8], "little", signed=True) for i in range(0, len(data), 8)]
    return sum(w * (2 * i + 1) for i, w in enumerate(words)) % 2**64


@pytest.mark.parametrize("n", [1, 7, 8, 13, 4096 + 3])
def test_checksums_match_references(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    raw = data.numpy().tobytes()
    assert checksum(data, "crc32") == zlib.crc32(raw)
    assert checksum(data, "wsum64") == _wsum64_reference(raw)


def test_wsum64_sees_swapped_words() -> None:
    a = torch.arange(64, dtype=torch.uint8)
    b = torch.cat([a[8:16], a[:8], a[16:]])
    assert checksum(a, "wsum64") != checksum(b, "wsum64")


def test_layout_views_are_aligned_and_exact() -> None:
    named = {"w": torch.randn(5, 3), "b": torch.randn(7).to(torch.bfloat16), "i": torch.arange(3)}
    specs, total = plan_tensors((k, tuple(v.shape), str(v.dtype)[6:]) for k, v in named.items())
    assert all(s.offset % ALIGN == 0 for s in specs) and total % ALIGN == 0
    flat = torch.zeros(total, dtype=torch.uint8)
    pack_into(flat, specs, named)
    views = tensor_views(flat, specs)
    assert all(torch.equal(views[k], v) for k, v in named.items())
    assert bucket_windows(total, 100)[-1][0] + bucket_windows(total, 100)[-1][1] == total


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_check_names_the_tensor_and_ignores_huge_finite_values(bad: float) -> None:
    named = {"w": torch.full((5, 3), 3e38), "b": torch.randn(7).to(torch.bfloat16), "i": torch.arange(3),
             "h": torch.randn(4, 4, dtype=torch.float16)}
    assert UpdateListener._nonfinite(named) is None  # 3e38 is finite; a sum or 2-norm would overflow
    for name in ("w", "b", "h"):
        poisoned = {k: v.clone() for k, v in named.items()}
        poisoned[name].view(-1)[-1] = bad
        assert UpdateListener._nonfinite(poisoned) == name


def test_a_reserved_port_is_held_until_the_store_takes_that_very_socket() -> None:
    """``reserve_port`` keeps the port bound from the pick on: no other socket can take it
    before the store starts, and the store listens on the reserved socket itself."""
    import socket

    from inflight.transport.store import connect_store, host_store, release_port, reserve_port

    port = reserve_port()
    with socket.socket() as other, pytest.raises(OSError, match="Address already in use"):
        other.bind(("127.0.0.1", port))  # held: the pick cannot be lost to another bind
    store = host_store("127.0.0.1", port, 2, timedelta(seconds=5))
    connect_store("127.0.0.1", port, "x", 5.0).set("k", b"v")
    assert store.get("x/k") == b"v"
    release_port("127.0.0.1", port)  # a no-op once the store took it: the store keeps serving
    assert store.get("x/k") == b"v"
    unused = reserve_port()
    release_port("127.0.0.1", unused)
    with socket.socket() as other:
        other.bind(("127.0.0.1", unused))  # a released reservation frees the port


def test_named_weights_match_the_checkpoint(tiny_qwen, tiny_llama) -> None:
    from transformers import AutoModelForCausalLM

    from inflight.transport.sources import named_weights

    for path in (tiny_qwen, tiny_llama):  # tied and untied LM heads
        model = AutoModelForCausalLM.from_pretrained(str(path))
        on_disk = state_dict_of(path)
        sent = named_weights(model)
        assert sent.keys() == on_disk.keys()
        assert all(torch.equal(sent[k], on_disk[k]) for k in sent)


def test_a_sharded_source_gathers_over_gloo_never_beside_fsdp_on_nccl() -> None:
    """Two NCCL communicators with collectives in flight on one GPU can deadlock: the push's
    gathers go over gloo on the host (a mixed cpu:gloo,cuda:nccl group's gloo half will do)."""
    from inflight.transport.sources import check_gather_backend

    for ok in ("gloo", "cpu:gloo,cuda:nccl"):
        check_gather_backend(ok)
    with pytest.raises(ValueError, match=r"backend 'nccl': it gathers on the host, beside training's NCCL "
                                         r"collectives, so it needs gloo \(dist.new_group\(backend='gloo'\)"):
        check_gather_backend("nccl")


# -- two processes, the real thing -----------------------------------------------------

@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bucket_bytes", [3000, 8 << 20], ids=["bucket<tensor", "bucket>model"])
def test_state_dict_crosses_processes_exactly(tiny_qwen, port, tmp_path, dtype: str, bucket_bytes: int,
                                              backend: str) -> None:
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank: two GPUs")
    sd = state_dict_of(tiny_qwen)
    largest = max(t.numel() * t.element_size() for t in sd.values())
    assert bucket_bytes < largest or bucket_bytes > sum(t.numel() * 4 for t in sd.values())
    group = GroupConfig(port=port, world_size=2, timeout_s=60, backend=backend)
    peer = mp.get_context("spawn").Process(target=run_peer, args=(group, 1, str(tmp_path)), daemon=True)
    peer.start()
    pusher = WeightPusher(group, PushConfig(bucket_mb=bucket_bytes / 2**20, dtype=dtype))
    try:
        result = pusher.push(1, sd)
    finally:
        pusher.close()
        peer.join(WAIT_S)
    assert peer.exitcode == 0, f"the peer process: exit code {peer.exitcode} (None: still running after {WAIT_S:.0f} s)"
    cut = bucket_bytes // 64 * 64  # bucket_mb rounds down to 64 B, so no element straddles two buckets
    assert pusher.config.bucket_bytes == cut and result.send.buckets == len(bucket_windows(result.send.nbytes, cut))
    got = load_file(str(tmp_path / "v1.safetensors"))
    assert got.keys() == sd.keys()
    for name, t in sd.items():
        want = t.to(getattr(torch, dtype))
        assert got[name].dtype == want.dtype and torch.equal(got[name].cpu(), want), name


# -- one process, two threads: refusals leave the live version untouched ------------------

@pytest.fixture
def pair(tiny_qwen, port):
    sd = state_dict_of(tiny_qwen)
    schema = TensorSchema({k: (tuple(v.shape), "float32") for k, v in sd.items()})
    p = ListenerPair(port, schema)
    yield p, sd
    p.close()


def _expect_refusal(pair: ListenerPair, code: str, version: int, named) -> None:
    live = dict(pair.target.live)
    before = pair.target.live_version
    with pytest.raises(PushRejected, match=rf"\[{code}\]") as exc:
        pair.pusher.push(version, named)
    assert exc.value.codes == {code}, str(exc.value)
    assert pair.target.live_version == before
    assert live.keys() == pair.target.live.keys() and all(torch.equal(live[k], pair.target.live[k]) for k in live)


def test_refusals_keep_last_good_version(pair) -> None:
    p, sd = pair
    p.pusher.push(1, sd)
    assert p.target.live_version == 1
    name = next(iter(sd))
    _expect_refusal(p, "stale_version", 1, sd)
    _expect_refusal(p, "unknown_tensor", 2, sd | {"extra.weight": torch.zeros(2)})
    _expect_refusal(p, "missing_tensor", 2, {k: v for k, v in sd.items() if k != name})
    _expect_refusal(p, "bad_shape", 2, sd | {name: sd[name][:-1]})
    _expect_refusal(p, "bad_dtype", 2, sd | {name: sd[name].double()})

    def corrupt(h: BucketHeader, data: torch.Tensor):
        return h, (data.clone().bitwise_xor_(1) if h.index == 3 else data)

    def short(h: BucketHeader, data: torch.Tensor):
        if h.index != 2:
            return h, data
        return msgspec.structs.replace(h, nbytes=h.nbytes - 1), data[:-1]

    def reorder(h: BucketHeader, data: torch.Tensor):  # bucket 1 sent again in place of bucket 2
        return (msgspec.structs.replace(h, index=1), data) if h.index == 2 else (h, data)

    for code, tamper in [("checksum", corrupt), ("short_bucket", short), ("bucket_order", reorder)]:
        with tampering(p.pusher, tamper):
            _expect_refusal(p, code, 2, {k: v + 1 for k, v in sd.items()})
    with pytest.raises(PushRejected, match=r"\[incomplete\]") as exc:  # commit of a version that was never staged
        p.pusher.commit(5)
    assert exc.value.codes == {"incomplete"}
    # the next good update goes through
    new = {k: v * 2 for k, v in sd.items()}
    p.pusher.push(2, new)
    assert p.target.live_version == 2 and all(torch.equal(p.target.live[k], new[k]) for k in sd)
    assert p.listener.stats.rejections == {
        "stale_version": 1, "unknown_tensor": 1, "missing_tensor": 1, "bad_shape": 1, "bad_dtype": 1,
        "checksum": 1, "short_bucket": 1, "bucket_order": 1, "incomplete": 1,
    }
    assert p.error is None


def test_buckets_larger_than_the_reserved_windows_are_refused_before_any_byte(pair) -> None:
    """A worker that reserved bucket windows for buckets of up to N bytes (a GPU data plane,
    ``InflightConfig.max_bucket_mb``) refuses an update in larger ones, naming both sizes,
    rather than allocate mid-update; the trainer's next update in buckets that fit lands."""
    from inflight.memory import BucketWindows

    p, sd = pair
    p.pusher.push(1, sd)
    small = PushConfig(bucket_mb=0.01).bucket_bytes // 2
    p.listener.receiver.windows = BucketWindows(bucket_bytes=small, landing=[], mac_host=None)
    _expect_refusal(p, "no_memory", 2, {k: v + 1 for k, v in sd.items()})
    reason = p.listener.stats.last_error
    assert f"larger than the {small} B this worker reserved" in reason and "max_bucket_mb" in reason
    p.listener.receiver.windows = BucketWindows(bucket_bytes=PushConfig(bucket_mb=0.01).bucket_bytes, landing=[],
                                                mac_host=None)
    p.pusher.push(2, {k: v + 1 for k, v in sd.items()})
    assert p.target.live_version == 2 and p.error is None


def test_a_bucket_declaring_more_than_the_whole_update_breaks_the_group(port) -> None:
    """A bad bucket lands over its refused update's own bytes (no scratch buffer): one that
    declares more than the whole update cannot, and the sender is not speaking this protocol."""
    from inflight.transport.errors import TransportError

    trainer, worker = form_pair(port, timeout_s=GROUP_TIMEOUT_S)
    sender = BucketSender(trainer, bucket_bytes=4096, checksum_algo="crc32")
    weights = {"w": torch.ones(64)}
    announce = sender.lay_out(1, weights)  # 256 B, one bucket
    flat = torch.zeros(announce.total_bytes, dtype=torch.uint8)

    def long(h: BucketHeader, data: torch.Tensor):
        return msgspec.structs.replace(h, nbytes=1024), torch.zeros(1024, dtype=torch.uint8)
    with tampering(sender, long):
        sending = threading.Thread(target=lambda: _quietly(sender.send, announce, weights), daemon=True)
        sending.start()
        with pytest.raises(TransportError, match="declares 1024 B, more than the whole update"):
            # not a timeout: the bucket's size
            BucketReceiver(worker).receive(announce, flat, timeout_s=GROUP_TIMEOUT_S)
        worker.close()
        trainer.close()
        sending.join(30)


def _quietly(fn, *args, **kw) -> None:
    try:
        fn(*args, **kw)
    except Exception:  # the receiver left: the sender's broadcast fails, as it should
        pass


def test_receiver_timeout_names_peer_and_bucket(port) -> None:
    trainer, worker = form_pair(port, timeout_s=GROUP_TIMEOUT_S)
    announce = BucketSender(trainer, bucket_bytes=128, checksum_algo="crc32").lay_out(1, {"w": torch.ones(64)})
    flat = torch.zeros(announce.total_bytes, dtype=torch.uint8)
    # the trainer announced but never sends bucket 0
    with pytest.raises(TransportTimeout, match="header of bucket 0 of v1.*trainer rank 0"):
        BucketReceiver(worker).receive(announce, flat, timeout_s=1.0)


def test_a_point_to_point_member_without_a_shard_plan_gets_the_whole_model(port) -> None:
    """On NCCL every generation is point to point (a broadcast beside vLLM's TP all-reduces can
    deadlock): a member that sent no shard plan is sent the whole update, laid out as a
    broadcast would lay it out."""
    trainer, worker = form_pair(port, timeout_s=GROUP_TIMEOUT_S)
    sender = BucketSender(trainer, bucket_bytes=128, checksum_algo="crc32")
    named = {"w": torch.ones(64), "b": torch.zeros(3, 5)}
    assert sender.lay_out_each(1, named, {1: None}) == {1: sender.lay_out(1, named)}
    worker.close()
    trainer.close()


def test_data_sockets_bind_the_group_address_not_the_default_interface(port, monkeypatch) -> None:
    """gloo's default device binds the hostname's (or ``GLOO_SOCKET_IFNAME``'s) address: a group
    configured on loopback must not listen for bucket bytes on another interface."""
    import psutil
    from torch.distributed import ProcessGroupGloo

    from inflight.transport.group_config import is_loopback

    outside = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
               if a.family.name == "AF_INET" and not is_loopback(a.address)]
    if not outside:
        pytest.skip("this machine has no interface but loopback")
    # a machine whose hostname resolves to its LAN address, where gloo's default device binds
    # (this one's resolves to loopback, which would hide the difference)
    lan_device = ProcessGroupGloo.create_device  # a device listens from its creation: made only when asked for
    monkeypatch.setattr(ProcessGroupGloo, "create_default_device",
                        staticmethod(lambda: lan_device(hostname=outside[0])))
    trainer, worker = form_pair(port, timeout_s=GROUP_TIMEOUT_S)
    got = torch.zeros(3)
    pending = worker.start_broadcast(got, what="a bucket")
    trainer.broadcast(torch.ones(3), what="a bucket")
    worker.wait(pending)
    assert got.tolist() == [1.0, 1.0, 1.0]
    sockets = psutil.Process().net_connections(kind="tcp")
    listening = {c.laddr.ip for c in sockets if c.status == psutil.CONN_LISTEN}
    used = {c.laddr.ip for c in sockets if c.status == psutil.CONN_ESTABLISHED}
    assert listening and all(is_loopback(ip.removeprefix("::ffff:")) for ip in listening | used), (listening, used)
    worker.close()
    trainer.close()


def test_a_member_lost_after_its_hello_ends_the_formation_at_once(port, monkeypatch) -> None:
    """A worker that dies between its hello and the data plane's rendezvous (an engine's process
    exiting) leaves gloo waiting for its address for the group's whole timeout; rank 0's
    ``stop`` (set by whoever sees the process die: ``Fleet``'s watcher) ends that wait at once."""
    from inflight.transport.group import WeightGroup

    died = threading.Event()
    form = WeightGroup._form_data_plane

    def dies_instead_of_forming(self, g, stop=None):
        if self.rank == 0:
            return form(self, g, stop)
        died.set()  # this member's process is gone: it never reaches the rendezvous
        raise ConnectionAbortedError("the member's process exited")

    monkeypatch.setattr(WeightGroup, "_form_data_plane", dies_instead_of_forming)
    config = GroupConfig(port=port, world_size=2, timeout_s=120)
    worker = threading.Thread(target=_quietly, args=(WeightGroup, config, 1), daemon=True)
    worker.start()
    began = time.monotonic()
    with pytest.raises(InterruptedError,
                       match="trainer rank 0: stopped while waiting for generation 1's data plane to form"):
        WeightGroup(config, 0, stop=died)  # without stop's check: gloo's timeout, 120 s
    # nothing else waits for the abandoned rendezvous either (it holds a store connection of its own)
    assert time.monotonic() - began < 60
    worker.join(WAIT_S)
    assert not worker.is_alive(), f"waited {WAIT_S:.0f} s for the member that died to end"


def test_a_workers_stop_ends_a_wait_on_a_posted_op_and_aborts_it(port) -> None:
    """A worker polls for a posted op's completion (``DataPlane._poll``: NCCL's ``Work.wait``
    does not block the host, gloo's may miss a dead peer); its listener's stop ends that
    poll at once and aborts the communicator, so a shutdown mid-transfer never leaves an op
    posted. Here on gloo, over a receive the trainer never sends."""
    stop = threading.Event()
    trainer, worker = form_pair(port, timeout_s=120, stop=stop)
    posted = worker.start_recv(torch.zeros(4), what="bucket 0 of v1")
    threading.Timer(0.2, stop.set).start()  # the worker shuts down while the op is posted
    began = time.monotonic()
    with pytest.raises(InterruptedError, match="worker rank 1: stopped while waiting for bucket 0 of v1"):
        worker.wait(posted, 120.0)
    assert time.monotonic() - began < 60 and worker.data.pg is None  # ended by stop, not the timeout; aborted
    worker.close()
    trainer.close()


def _host_a_store(conn) -> None:
    """A group store in a process of its own (what the trainer's process is to its store)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    conn.send(store.port)
    time.sleep(600)


def test_a_worker_notices_its_trainers_death_by_its_store_while_the_data_plane_is_intact() -> None:
    """The trainer hosts the store, so its death is the store's: a worker's wait on a posted op
    gives up within about a beat once its heartbeat finds the store refusing connections
    (``WeightGroup.superseded``), whatever the data plane says (gloo noticed a SIGKILLed
    trainer's closed connections at some buckets of a push only at its timeout). The store
    lives in a process of its own here, killed while both ends of the data plane stay up."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    host = ctx.Process(target=_host_a_store, args=(child,), daemon=True)
    host.start()
    try:
        port = parent.recv()
        config = GroupConfig(port=port, world_size=2, timeout_s=DEAD_STORE_TIMEOUT_S)
        client = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        trainers: list = []
        t = threading.Thread(target=lambda: trainers.append(WeightGroup(config, 0, store=client, join_timeout_s=60.0)))
        t.start()
        worker = WeightGroup(config, 1, join_timeout_s=60.0)
        t.join(WAIT_S)
        assert trainers, "the trainer did not form the group"
        posted = worker.start_recv(torch.zeros(4), what="bucket 0 of v1")
        host.kill()
        host.join(WAIT_S)
        assert host.exitcode is not None, f"waited {WAIT_S:.0f} s for the killed store's process to end"
        died = time.monotonic()
        with pytest.raises(TransportError, match=r"worker rank 1: the trainer is gone \(its store .* refuses "
                                                 r"connections\), during bucket 0 of v1 from/to trainer rank 0; gloo "
                                                 r"communicator aborted"):
            worker.wait(posted)
        took = time.monotonic() - died
        assert took < NOTICED_S, f"{took:.1f} s"  # a beat or two, not the group's timeout (600 s)
        assert worker.data.pg is None  # aborted
        worker.close()
        trainers[0].close()
    finally:
        host.kill()


def test_a_data_plane_with_work_posted_is_aborted_never_shut_down(port) -> None:
    """A graceful shutdown waits for the collectives posted on it; NCCL's finalize never returns
    when their root is dead (a killed trainer), hanging the listener. So ``close`` aborts a
    data plane with work posted, or after a failure, and shuts down only an idle one."""
    trainer, worker = form_pair(port, timeout_s=GROUP_TIMEOUT_S)
    aborted: list[str] = []
    for name, member in (("worker", worker), ("trainer", trainer)):
        real = member.data.abort
        member.data.abort = lambda name=name, real=real: (aborted.append(name), real())
    worker.start_broadcast(torch.zeros(4), what="a bucket the trainer never sends")
    worker.close()
    trainer.close()  # idle: nothing posted, nothing failed
    assert aborted == ["worker"]


def test_nccl_error_handling_is_set_once_per_process(monkeypatch) -> None:
    """The variable NCCL reads per group is written once, at start-up, never per generation:
    ``setenv`` is not thread-safe beside another thread's ``getenv`` (a listener's, NCCL's)."""
    import os

    from inflight.transport import data_plane

    writes: list[tuple[str, str]] = []

    class Counting(dict):
        def __setitem__(self, key: str, value: str) -> None:
            writes.append((key, value))
            super().__setitem__(key, value)

    monkeypatch.setattr(os, "environ", Counting(os.environ))
    monkeypatch.setattr(data_plane, "_nccl_env_set", False)
    for _ in range(3):  # start-up, then two generations' data planes
        data_plane.nccl_error_handling_once()
    assert writes == [("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


@pytest.mark.gpu
def test_an_nccl_data_plane_forms_at_once_and_no_watchdog_outruns_its_waits() -> None:
    """What a GPU run builds first, on one GPU: a one-member NCCL data plane forms its
    communicator at construction (not inside the first op); its watchdog's
    timeout outlasts our own waits; the process's NCCL settings leave a timed-out or failed
    op to us (no teardown, no dump); an op waited for by polling completes; close leaves no
    communicator behind."""
    import os

    from torch.distributed import HashStore, PrefixStore

    from inflight.transport.data_plane import NCCL_ENV, NCCL_MAX_CTAS, DataPlane, watchdog_timeout

    dev = torch.device("cuda", torch.cuda.current_device())
    deadline = timedelta(seconds=30)
    plane = DataPlane(PrefixStore("one", HashStore()), rank=0, pg_rank=0, size=1, backend="nccl", timeout=deadline,
                      device=dev, peers=[], superseded=lambda: False)
    nccl = plane.pg._get_backend(dev)
    assert nccl._is_initialized()
    assert {k: os.environ.get(k) for k in NCCL_ENV} == NCCL_ENV
    assert nccl.options._timeout == watchdog_timeout(deadline) > 4 * deadline
    assert nccl.options.config.max_ctas == NCCL_MAX_CTAS
    t = torch.arange(1000, device=dev, dtype=torch.float32)
    plane.broadcast(t, what="a bucket")
    assert torch.equal(t.cpu(), torch.arange(1000, dtype=torch.float32))
    plane.close()
    assert plane.pg is None


def test_a_broadcast_counts_the_bytes_every_member_received(port) -> None:
    """Two workers without shard plans (a TP=2 engine on gloo) each receive the whole update:
    the push sends it once (``nbytes``) and delivers it twice (``delivered_bytes``, the
    trainer's ``push_mb``)."""
    from inflight.transport.peer import DictTarget

    config = GroupConfig(port=port, world_size=3, timeout_s=60.0)
    named = {"w": torch.arange(96, dtype=torch.float32), "b": torch.ones(3, 5)}
    targets = [DictTarget(), DictTarget()]
    stop = threading.Event()

    def serve(rank: int) -> None:
        UpdateListener(WeightGroup(config, rank), targets[rank - 1], None).run(stop)

    workers = [threading.Thread(target=serve, args=(r,), daemon=True) for r in (1, 2)]
    for w in workers:
        w.start()
    pusher = WeightPusher(config, PushConfig(dtype="float32", bucket_mb=0.001))
    try:
        result = pusher.push(1, named)
    finally:
        pusher.close()
        stop.set()
        for w in workers:
            w.join(WAIT_S)
    whole = sum(t.numel() * 4 for t in named.values())
    assert whole <= result.send.nbytes < whole + 2 * ALIGN and result.send.delivered_bytes == 2 * result.send.nbytes
    for target in targets:
        assert target.live_version == 1 and all(torch.equal(target.live[k], v) for k, v in named.items())
