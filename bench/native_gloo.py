"""vLLM's *native* weight-update path over gloo: the baseline the benchmarks compare with.

vLLM 0.32 ships weight-transfer engines for NCCL, CUDA IPC and others, none for CPU. This
one follows the NCCL engine's lifecycle exactly (``start_weight_update`` puts the layers
on the meta device for a layerwise reload, ``update_weights`` receives and loads,
``finish_weight_update`` re-processes), with the whole state dict as one flat gloo
broadcast on our stateless group: the fastest transfer there is, so the baseline is not
handicapped by its transport. The engine must be paused for the whole sequence, which is
the stall in-flight updates remove. ``register()`` adds it to vLLM's factory as
``inflight_gloo`` in the calling process (the benchmark's in-process EngineCore); then use
it with ``weight_transfer_config={"backend": "inflight_gloo"}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig
from inflight.transport.layout import plan_tensors, tensor_views

BACKEND = "inflight_gloo"


def register() -> None:
    """Register the ``inflight_gloo`` engine with vLLM's factory in this process; idempotent.
    Only the benchmarks and their tests use it: the production plugin does not register it."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "GlooWeightTransferEngine")


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    host: str
    port: int
    world_size: int
    rank: int
    timeout_s: float = 120.0
    name: str = "native"
    insecure: bool = False  # a shaped link of this machine (inflight.bench.slow_link), as the in-flight group's


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: WeightGroup | None = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        cfg = GroupConfig(host=init_info.host, port=init_info.port, world_size=init_info.world_size,
                          backend="gloo", timeout_s=init_info.timeout_s, name=init_info.name,
                          insecure=init_info.insecure)
        self.group = WeightGroup(cfg, init_info.rank)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from inflight.engine.commit.loaders import modules_sharing_parameters, reprocess

        finalize_layerwise_reload(self.model, self.model_config)
        # as in inflight's reload commit: a tied LM head's CPU prepack must follow its embedding
        reprocess(modules_sharing_parameters(self.model))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("inflight_gloo: init_weight_transfer_engine first")
        specs, total = plan_tensors(zip(update_info.names, update_info.shapes, update_info.dtype_names))
        flat = torch.empty(total, dtype=torch.uint8)
        self.group.broadcast(flat, what="native weight update")
        self.model.load_weights(iter(tensor_views(flat, specs).items()))

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def native_update(core: Any, llm: Any, conn: Any, version: int, info: dict) -> None:
    """vLLM's own update of an in-process engine, between two of its steps: pause the scheduler
    (keep: running requests keep their KV), then the weight-transfer API's start, update (the
    trainer process broadcasts ``version`` when cued on ``conn``) and finish. The caller
    resumes the scheduler (after whatever it does in the pause)."""
    core.pause_scheduler(mode="keep", clear_cache=False)
    llm.collective_rpc("start_weight_update")
    conn.send(("native", version))
    llm.collective_rpc("update_weights", kwargs={"update_info": info})
    llm.collective_rpc("finish_weight_update")


def update_info(named: dict[str, torch.Tensor]) -> dict:
    """What ``update_weights`` needs to know before the bytes arrive (same order as ``broadcast_state``)."""
    from inflight.transport.layout import dtype_name

    return {"names": list(named), "dtype_names": [dtype_name(t.dtype) for t in named.values()],
            "shapes": [list(t.shape) for t in named.values()]}


def broadcast_state(group: WeightGroup, named: dict[str, torch.Tensor]) -> int:
    """Trainer side: the whole state as one flat broadcast; returns the bytes sent."""
    from inflight.transport.layout import pack_into

    info = update_info(named)
    specs, total = plan_tensors(zip(info["names"], info["shapes"], info["dtype_names"]))
    flat = torch.zeros(total, dtype=torch.uint8)
    pack_into(flat, specs, named)
    group.broadcast(flat, what="native weight update")
    return total
