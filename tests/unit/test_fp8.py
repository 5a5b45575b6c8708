"""FP8 checkpoints on the wire: an engine serving one takes its FP8 tensors and their float32
scales as stored (``checkpoint_schema``), an update carries them bit for bit, a NaN among
FP8 bytes is refused like any other, and a push that would cast a wider tensor to FP8 (and
drop its scales) is refused before anything is sent. Also the memory ``reload`` holds on a
GPU (``reload_peak_bytes``)."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import save_file

from inflight.engine.commit.engine_checkpoint import checkpoint_schema
from inflight.engine.commit.reload import reload_peak_bytes
from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig
from inflight.transport.listener import UpdateListener
from inflight.transport.pusher import PushConfig, WeightPusher
from inflight.transport.schema import TensorSchema
from tests.helpers import ListenerPair


def _fp8_checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(8)
    w = torch.randn(32, 16, generator=g)
    return {"layer.weight": w.to(torch.float8_e4m3fn), "layer.weight_scale": torch.tensor([0.0123]),
            "norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
            "head.weight": torch.randn(4, 16, generator=g).to(torch.float8_e5m2)}


def test_an_fp8_checkpoint_keeps_its_fp8_tensors_and_float32_scales(tmp_path) -> None:
    save_file(_fp8_checkpoint(), str(tmp_path / "model.safetensors"))
    schema = checkpoint_schema(tmp_path, torch.bfloat16)
    assert schema.tensors == {"layer.weight": ((32, 16), "float8_e4m3fn"), "layer.weight_scale": ((1,), "float32"),
                              "norm.weight": ((16,), "bfloat16"), "head.weight": ((4, 16), "float8_e5m2")}
    # a checkpoint without FP8 tensors still sends its float32 tensors in the engine's dtype
    save_file({"norm.weight": torch.ones(16)}, str(tmp_path / "model.safetensors"))
    assert checkpoint_schema(tmp_path, torch.bfloat16).tensors == {"norm.weight": ((16,), "bfloat16")}


def test_an_fp8_nan_is_found_and_finite_fp8_passes() -> None:
    ok = {"w": torch.tensor([448.0, -448.0, 0.0, 1e-3]).to(torch.float8_e4m3fn),  # e4m3fn's largest: finite
          "h": torch.tensor([57344.0, -1.0]).to(torch.float8_e5m2)}
    assert UpdateListener._nonfinite(ok) is None
    nan = torch.zeros(9, dtype=torch.float8_e4m3fn)
    nan.view(torch.uint8)[5] = 0xFF  # -NaN: e4m3fn has no inf
    assert UpdateListener._nonfinite({**ok, "nan": nan}) == "nan"
    inf = torch.zeros(3, dtype=torch.float8_e5m2)
    inf.view(torch.uint8)[1] = 0x7C  # +inf
    assert UpdateListener._nonfinite({"w": ok["w"], "inf": inf}) == "inf"


def test_an_fp8_update_crosses_the_group_bit_for_bit(port) -> None:
    state = _fp8_checkpoint()
    schema = TensorSchema({n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in state.items()})
    pair = ListenerPair(port, schema, bucket_mb=0.0005)  # several buckets, tensors cut across them
    try:
        pair.pusher.push(1, state)
        live = pair.target.live
        assert live.keys() == state.keys()
        for name, t in state.items():
            assert live[name].dtype == t.dtype and torch.equal(live[name].view(torch.uint8), t.view(torch.uint8))
    finally:
        pair.close()


def test_a_push_that_would_cast_to_fp8_is_refused_before_anything_is_sent(port) -> None:
    config = GroupConfig(port=port, world_size=2, timeout_s=10)
    workers: list[WeightGroup] = []
    t = threading.Thread(target=lambda: workers.append(
        WeightGroup(config, 1, join_timeout_s=30.0, wire_dtypes={"layer.weight": "float8_e4m3fn"})), daemon=True)
    t.start()
    pusher = WeightPusher(config, PushConfig(dtype="bfloat16"), join_timeout_s=30.0)
    t.join(30)
    try:
        with pytest.raises(ValueError, match=r"layer.weight: the engine serves it as float8_e4m3fn \(an FP8 "
                                             r"checkpoint\), this push holds torch.bfloat16: quantize on the trainer"):
            pusher.push(1, {"layer.weight": torch.ones(32, 16, dtype=torch.bfloat16)})
    finally:
        workers[0].close()
        pusher.close(goodbye_timeout_s=0.5)


def test_reload_on_a_gpu_holds_the_two_largest_modules_not_the_model() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 20), torch.nn.Linear(20, 4),
                                torch.nn.LayerNorm(4))
    model.register_buffer("table", torch.zeros(3, dtype=torch.float64))
    assert reload_peak_bytes(model) == 4 * (100 * 8) + 4 * (8 * 20 + 20)  # the embedding and the first linear
