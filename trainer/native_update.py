"""vLLM's *native* weight-update path over gloo: ``rollout.mode = "pause"`` and the benchmarks' baseline.

vLLM 0.32 ships weight-transfer engines for NCCL, CUDA IPC and others, none for CPU. This
one follows the NCCL engine's lifecycle exactly (``start_weight_update`` puts the layers
on the meta device for a layerwise reload, ``update_weights`` receives and loads,
``finish_weight_update`` re-processes), with the whole state dict as one flat gloo
broadcast on our stateless group: the fastest transfer there is, so the baseline is not
handicapped by its transport. The engine must be paused for the whole sequence, which is
the stall in-flight updates remove. ``register()`` adds it to vLLM's factory as
``inflight_gloo`` in the calling process (an in-process EngineCore runs there); then use
it with ``weight_transfer_config={"backend": "inflight_gloo"}``.

The training loop's pause mode (what PipelineRL, prime-rl and TRL's async GRPO do) talks
over the rollout queue's store: the trainer (``NativePusher``) writes the update's layout
once (``native/info``), announces each version (``native/announce``) and broadcasts it on
the ``native`` group; the engine's loop (``NativeUpdater``), between two of its steps,
pauses, receives and loads it, moves its version label, resumes and reports the pause
(``native/live/<v>``), which is what the trainer's push waits for.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from inflight.transport.bucket import plan_tensors, tensor_views
from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig

BACKEND = "inflight_gloo"
GROUP_NAME = "native"
"""The native group's key prefix on the trainer's store (beside the in-flight groups')."""


def register() -> None:
    """Register the ``inflight_gloo`` engine with vLLM's factory in this process; idempotent.
    Only pause mode and the benchmarks use it: the production plugin does not register it."""
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
    from inflight.transport.bucket import dtype_name

    return {"names": list(named), "dtype_names": [dtype_name(t.dtype) for t in named.values()],
            "shapes": [list(t.shape) for t in named.values()]}


def pack_state(named: dict[str, torch.Tensor]) -> torch.Tensor:
    """The whole state as one flat byte tensor, in ``update_info``'s order."""
    from inflight.transport.bucket import pack_into

    info = update_info(named)
    specs, total = plan_tensors(zip(info["names"], info["shapes"], info["dtype_names"]))
    flat = torch.zeros(total, dtype=torch.uint8)
    pack_into(flat, specs, named)
    return flat


def broadcast_state(group: WeightGroup, named: dict[str, torch.Tensor]) -> int:
    """Trainer side: the whole state as one flat broadcast; returns the bytes sent."""
    flat = pack_state(named)
    group.broadcast(flat, what="native weight update")
    return flat.numel()


# -- rollout.mode = "pause": the training loop's two sides ----------------------------------------
def native_group(base: GroupConfig) -> GroupConfig:
    """The native group of a one-engine run on the trainer's store: the trainer and the engine's worker, gloo."""
    import dataclasses

    return dataclasses.replace(base, name=GROUP_NAME, world_size=2, backend="gloo")


class NativePusher:
    """The trainer's side of a pause-mode run: one native update in flight at a time.

    ``push_async`` casts and packs the weights on the caller's thread (so the optimizer may
    write the parameters as soon as it returns), then, on a thread of its own, announces the
    version on ``store`` and broadcasts it; the future resolves with the engine's report
    once the engine says the version is live (``native/live/<v>``)."""

    def __init__(self, group: GroupConfig, store: Any, dtype: torch.dtype, *, tcp_store: Any = None,
                 join_timeout_s: float | None = None, stop: threading.Event | None = None) -> None:
        """Host ``group`` (on ``tcp_store``, the fleet's) and wait up to ``join_timeout_s`` for
        the engine's worker to join (``stop``: give up, its process died)."""
        self.store, self.dtype = store, dtype
        self.group = WeightGroup(group, 0, store=tcp_store, join_timeout_s=join_timeout_s, stop=stop)
        self._lock = threading.Lock()
        self.timeout_s = group.timeout_s

    def push_async(self, version: int, weights: dict[str, torch.Tensor]) -> Future[dict]:
        named = {k: v.detach().to(self.dtype) for k, v in weights.items()}
        if not self.store.check(["native/info"]):
            self.store.set("native/info", json.dumps(update_info(named)))
        flat = pack_state(named)
        future: Future[dict] = Future()
        threading.Thread(target=self._send, args=(version, flat, future), daemon=True,
                         name=f"native-push-v{version}").start()
        return future

    def _send(self, version: int, flat: torch.Tensor, future: Future[dict]) -> None:
        try:
            with self._lock:
                t0 = time.perf_counter()
                self.store.set("native/announce", str(version))
                self.group.broadcast(flat, what=f"native update v{version}")
                send_s = time.perf_counter() - t0
                key = f"native/live/{version}"
                self.store.wait([key], timedelta(seconds=self.timeout_s))
                report = json.loads(self.store.get(key))
            future.set_result({**report, "send_ms": 1e3 * send_s, "push_ms": 1e3 * (time.perf_counter() - t0),
                               "push_mb": flat.numel() / 2**20})
        except BaseException as e:  # the trainer's land() raises it
            future.set_exception(e)

    def close(self) -> None:
        self.group.close()


class NativeUpdater:
    """The engine's side of a pause-mode run, called by its rollout loop between two steps.

    Invariants: an update runs only between two ``llm_engine.step()`` calls on the loop's
    thread, with the scheduler paused in ``keep`` mode (running requests keep their KV and
    do not decode) from before the first byte is received until the label moved; every
    request added carries ``cache_salt = "v<live version>"``, and the salt vLLM's own
    request object holds is counted per live version (``salts``), reported with the next
    update, so a run shows that no request of version v reused blocks of older weights."""

    def __init__(self, llm: Any, coordinator: Any) -> None:
        self.llm, self.coordinator = llm, coordinator
        self.core = llm.llm_engine.engine_core.engine_core
        self.info: dict | None = None
        self.salts: Counter[str] = Counter()
        self.updates = 0

    def salt(self) -> str:
        return f"v{self.coordinator.live_version}"

    def observe(self, request_id: str) -> None:
        """Count the salt on the engine's own request objects of ``request_id`` (its fan-out)."""
        for rid, req in self.core.scheduler.requests.items():
            if rid.endswith(request_id):
                self.salts[f"{req.cache_salt}@v{self.coordinator.live_version}"] += 1

    def due(self, store: Any) -> int | None:
        """The version the trainer announced, if newer than the live one."""
        if not store.check(["native/announce"]):
            return None
        version = int(store.get("native/announce"))
        return version if version > self.coordinator.live_version else None

    def update(self, store: Any, version: int, step: int) -> None:
        """Pause (keep), receive and load ``version``, move the label, resume; report the pause."""
        if self.info is None:
            self.info = json.loads(store.get("native/info"))
        t0 = time.perf_counter()
        self.core.pause_scheduler(mode="keep", clear_cache=False)
        try:
            self.llm.collective_rpc("start_weight_update")
            self.llm.collective_rpc("update_weights", kwargs={"update_info": self.info})
            self.llm.collective_rpc("finish_weight_update")
            self.coordinator.set_label(version)
        finally:
            self.core.resume_scheduler()
        stall_ms = 1e3 * (time.perf_counter() - t0)
        self.updates += 1
        report = {"version": version, "stall_ms": stall_ms, "commit_step": step, "salts": dict(self.salts)}
        self.salts.clear()
        store.set(f"native/live/{version}", json.dumps(report))
