"""Sparse updates (``PushConfig(encoding="sparse")``, ``inflight.transport.delta``) between a
real pusher and a real listener on one gloo group, the commit a copy into a dict
(``DictTarget``): what the worker stages is bit-identical to the dense update of the same
weights, a delta against a base the worker does not hold is refused by name and goes again
dense, a rebuilt tensor that is not the trainer's is refused at its checksum, and the wire
carries only the changed elements. The same on a real vLLM engine: ``tests/engine/test_engine_inflight.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from inflight.protocol import Changed, Delta, TensorSpec, UpdateAnnounce
from inflight.staging import StagingPool
from inflight.transport.bucket import plan_tensors
from inflight.transport.delta import INDEX, VALUES, XOR, DeltaEncoder
from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig
from inflight.transport.listener import UpdateListener
from inflight.transport.peer import DictTarget
from inflight.transport.pusher import PushConfig, PushRejected, WeightPusher
from inflight.transport.schema import TensorSchema

SHAPES = {"embed.weight": (96, 32), "layers.0.proj.weight": (64, 32), "layers.0.norm.weight": (32,), "head.bias": (7,)}


class SparsePair:
    """A sparse pusher (rank 0) and a listener that keeps its base (rank 1, a thread)."""

    def __init__(self, port: int, dtype: str, *, keep_base: bool = True, codec: str = "auto") -> None:
        config = GroupConfig(port=port, world_size=2, timeout_s=20.0)
        schema = TensorSchema({n: (s, dtype) for n, s in SHAPES.items()})
        self.target = DictTarget()
        self.pool = StagingPool(torch.device("cpu"), keep_base=keep_base)
        self.stop = threading.Event()
        ready = threading.Event()

        def serve() -> None:
            group = WeightGroup(config, 1, keeps_base=keep_base)
            self.listener = UpdateListener(group, self.target, schema, pool=self.pool)
            ready.set()
            self.listener.run(self.stop)

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        self.pusher = WeightPusher(config, PushConfig(bucket_mb=0.004, dtype=dtype, encoding="sparse",  # type: ignore[arg-type]
                                                      sparse_codec=codec))
        assert ready.wait(30)

    def close(self) -> None:
        self.pusher.close()
        self.thread.join(10)


def _master(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _step(master: dict[str, torch.Tensor], k: int, frac: float) -> None:
    """An fp32 master update that moves about ``frac`` of each tensor's elements by ~1e-3
    (relative), most of them below bf16's resolution, and the rest not at all."""
    g = torch.Generator().manual_seed(100 + k)
    for t in master.values():
        mask = torch.rand(t.shape, generator=g) < frac
        t.add_(mask * t * 3e-3 * torch.randn(t.shape, generator=g))


@pytest.mark.parametrize("codec", ["xor_zstd", "index"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_ten_sparse_pushes_stage_exactly_the_dense_bytes(port: int, dtype: str, codec: str) -> None:
    pair = SparsePair(port, dtype, codec=codec)
    try:
        master = _master()
        first = pair.pusher.push(1, master)
        assert first.send.changed_frac is None and first.send.nbytes == first.send.dense_bytes  # no base yet: dense
        for v in range(2, 12):
            _step(master, v, frac=0.05)
            result = pair.pusher.push(v, master)
            send = result.send
            assert send.changed_frac is not None and 0 < send.changed_frac < 0.1, send
            assert send.nbytes < 0.5 * send.dense_bytes, send
            wire = {n: t.to(getattr(torch, dtype)) for n, t in master.items()}
            assert pair.target.live.keys() == wire.keys() and pair.target.live_version == v
            for n, t in wire.items():  # bit for bit: what a dense push of these weights stages
                assert torch.equal(pair.target.live[n].view(torch.uint8), t.view(torch.uint8)), n
        again = pair.pusher.push(12, master)  # nothing changed: next to no bytes, and the same weights live
        assert again.send.changed_frac == 0.0 and again.send.nbytes == (0 if codec == "index" else 64 * len(SHAPES))
        assert pair.target.live_version == 12
        assert all(torch.equal(pair.target.live[n], t.to(getattr(torch, dtype))) for n, t in master.items())
        assert pair.listener.stats.rejections == {}
    finally:
        pair.close()


def test_a_delta_against_a_base_the_worker_lacks_is_refused_by_name_and_goes_dense(port: int) -> None:
    pair = SparsePair(port, "bfloat16")
    try:
        master = _master()
        pair.pusher.push(1, master)
        pair.pool.give(pair.pool.base.flat)  # the worker loses its base bytes (e.g. restarted with keep_base)
        pair.pool.base = None
        _step(master, 2, frac=0.05)
        result = pair.pusher.push(2, master)
        assert result.send.changed_frac is None and result.send.nbytes == result.send.dense_bytes  # resent dense
        assert pair.listener.stats.rejections == {"wrong_base": 1}
        assert "v2 is a sparse update against v1, and this worker holds no base bytes: send it dense" in \
            pair.listener.stats.last_error
        for n, t in master.items():
            assert torch.equal(pair.target.live[n], t.to(torch.bfloat16)), n
        _step(master, 3, frac=0.05)  # the dense resend left a base: the next one is sparse again
        assert pair.pusher.push(3, master).send.changed_frac is not None
    finally:
        pair.close()


def test_a_rebuilt_tensor_that_is_not_the_trainers_is_refused_and_live_stays(port: int) -> None:
    pair = SparsePair(port, "bfloat16")
    try:
        master = _master()
        pair.pusher.push(1, master)
        live = {n: t.clone() for n, t in pair.target.live.items()}
        pair.pool.base.views["layers.0.proj.weight"][0, 0] += 1.0  # the base bytes are not v1's any more
        _step(master, 2, frac=0.05)
        with pytest.raises(PushRejected,
                           match=r"\[checksum\] v2: layers.0.proj.weight rebuilt on v1 has checksum") as e:
            pair.pusher.push(2, master)
        assert e.value.phase == "staging"
        assert pair.target.live_version == 1
        assert all(torch.equal(pair.target.live[n], t) for n, t in live.items())
    finally:
        pair.close()


def test_an_engine_without_a_base_gets_dense_updates(port: int) -> None:
    pair = SparsePair(port, "bfloat16", keep_base=False)
    try:
        master = _master()
        for v in (1, 2, 3):
            _step(master, v, frac=0.05)
            send = pair.pusher.push(v, master).send
            assert send.changed_frac is None and send.nbytes == send.dense_bytes
        assert pair.listener.stats.rejections == {}
    finally:
        pair.close()


def test_the_encoder_sends_each_tensor_the_smaller_way() -> None:
    """Per tensor: a few changed elements travel as index and values, a tensor whose every
    element changed travels whole; an update where nothing changed sends no bytes."""
    enc = DeltaEncoder()
    wire = {n: "bfloat16" for n in SHAPES}
    base = _master()
    enc.record(1, base, wire)
    same = enc.encode(2, base, wire, 1, "xxh3", "index")
    assert same is not None and same.wire_bytes == 0 and len(same.delta.changed) == len(SHAPES)
    new = {n: t.clone() for n, t in base.items()}
    new["embed.weight"][3, :5] += 1.0
    new["head.bias"] += 1.0
    e = enc.encode(3, new, wire, 1, "xxh3", "index")
    sparse = ["embed.weight", "layers.0.proj.weight", "layers.0.norm.weight"]  # 5, 0 and 0 elements changed
    assert e is not None and [c.name for c in e.delta.changed] == sparse
    assert torch.equal(e.wire["embed.weight" + INDEX], torch.tensor([96, 97, 98, 99, 100], dtype=torch.int32))
    assert torch.equal(e.wire["embed.weight" + VALUES], new["embed.weight"][3, :5].to(torch.bfloat16))
    assert e.wire["layers.0.proj.weight" + INDEX].numel() == 0
    # every element changed: whole
    assert set(e.wire) == {n + s for n in sparse for s in (INDEX, VALUES)} | {"head.bias"}
    assert (e.changed, e.elements) == (5 + 7, sum(t.numel() for t in base.values()))
    assert enc.encode(3, new, wire, 0, "xxh3", "index") is None  # a base it never recorded
    x = enc.encode(3, new, wire, 2, "xxh3", "xor_zstd")  # the same changes (v2 is v1), xor-compressed
    # a frame's 64-byte alignment is no smaller than the 64-byte norm: it goes whole
    assert x is not None and [c.name for c in x.delta.changed] == sparse[:2]
    assert set(x.wire) == {n + XOR for n in sparse[:2]} | {"layers.0.norm.weight", "head.bias"}
    import zstandard

    xor = zstandard.ZstdDecompressor().decompress(x.wire["embed.weight" + XOR].numpy().tobytes())
    bits = torch.frombuffer(bytearray(xor), dtype=torch.int16)
    assert bits.nonzero().reshape(-1).tolist() == [96, 97, 98, 99, 100]
    enc.record(4, new, wire)
    assert not enc.has(1) and enc.versions() == [3, 4]  # the last two are kept


def test_an_announce_whose_delta_does_not_add_up_is_refused() -> None:
    result, total = plan_tensors([("w", (4, 4), "bfloat16")])
    wire, wire_total = plan_tensors([("w@index", (2,), "int32"), ("w@values", (2,), "float32")])

    def announce(tensors: tuple[TensorSpec, ...], total_bytes: int, changed: tuple[Changed, ...]) -> UpdateAnnounce:
        from inflight.protocol import BucketSpec

        return UpdateAnnounce(version=2, total_bytes=total_bytes, bucket_bytes=4096, checksum_algo="xxh3",
                              tensors=tensors, buckets=(BucketSpec(index=0, offset=0, nbytes=total_bytes),),
                              delta=Delta(base_version=1, result=result, result_bytes=total, changed=changed))

    with pytest.raises(ValueError, match="not an int32 index and bfloat16 values of one length"):
        announce(wire, wire_total, (Changed(name="w", index="w@index", values="w@values", digest=0),))
    with pytest.raises(ValueError, match="'w' is neither sent whole nor changed"):
        announce(wire, wire_total, ())
    frame, frame_total = plan_tensors([("w@xor", (40,), "int8")])
    with pytest.raises(ValueError, match="'w' changes by wire tensor 'w@xor', which is not one uint8 zstd frame"):
        announce(frame, frame_total, (Changed(name="w", values="w@xor", digest=0, codec="xor_zstd"),))
