"""Staging's device bytes come out of the KV cache's budget, before vLLM sizes it.

Why (the activation peak vLLM budgets for, then releases): docs/design.md. ``engine_kwargs(reserve_staging=config)``
records a ``StagingIntent`` in vLLM's ``additional_config``, which reaches every worker inside its ``VllmConfig``.
When vLLM asks a worker (``determine_available_memory``, after the model is loaded and profiled, before
``inflight_start``), the wrapper below computes this rank's staging from the loaded model with the accounting
``inflight_start`` uses (``planned_need``: the checkpoint's tensors in the engine's dtype, whole on every rank
unless the commit has a shard plan, the rollback copy, the commit's own memory, the bucket windows), subtracts
its device bytes and the GPU margin from what vLLM returns, and remembers the figure on the worker
(``SetAside``). ``inflight_start`` checks its config against that figure, not against free memory, and refuses
one that needs more, naming both. An intent with ``staging='host'`` sets aside only the bucket windows and
checksum temporaries.

Where nothing is set aside (``inflight_start`` then checks free memory, as for an engine built without an
intent):
- a CPU engine: vLLM CPU's worker has its own ``determine_available_memory``, which returns the KV space the
  user set (``VLLM_CPU_KVCACHE_SPACE``); host staging is checked against the node's memory at ``inflight_start``;
- a GPU engine started with ``kv_cache_memory_bytes``: the user sized the KV cache explicitly. A figure vLLM's
  startup plan (``VLLM_ENABLE_STARTUP_PLAN``) fills in is its own profiled one, without staging: staging is set
  aside from it too.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from inflight.engine.commit.base import CommitStrategy, make_strategy
from inflight.engine.commit.engine_checkpoint import engine_schema
from inflight.engine.engine_config import StagingIntent
from inflight.memory import GiB, SetAside, StagingNeed, kv_cache_after_staging, set_aside_bytes, staging_need
from inflight.protocol import ShardPlan
from inflight.settings import StagingPlace
from inflight.transport.schema import TensorSchema

log = logging.getLogger("inflight.kv_budget")

SET_ASIDE_ATTR = "_inflight_set_aside"
"""The worker attribute holding its ``SetAside`` (absent where nothing was set aside)."""
_MARK = "__inflight_kv_budget__"


def planned_need(schema: TensorSchema, strategy: CommitStrategy, plan: ShardPlan | None, *, staging: StagingPlace,
                 keep_rollback: bool, bucket_bytes: int, engine: torch.device, data: torch.device,
                 mac: bool, keep_base: bool = False) -> StagingNeed:
    """What a worker of an ``engine``-device engine holds for these settings, its buckets
    landing on ``data`` (the weight group's data plane): one accounting for the set-aside and
    for the reservation at ``inflight_start``, so the two agree."""
    pool_device = data if staging == "device" else torch.device("cpu")
    # gloo beside a GPU stages on the host
    where: StagingPlace = "device" if pool_device.type == engine.type else "host"
    rollback_copy = keep_rollback and strategy.name not in ("swap", "lora")  # they roll back by module, by slot image
    groups, window = getattr(strategy, "groups", ()), getattr(strategy, "window", 0)  # a layer-granular swap
    if groups:
        rollback_copy = False
    return staging_need(schema, plan=plan, staging=where, rollback_copy=rollback_copy,
                        commit_bytes=strategy.held_bytes(), commit=strategy.name, bucket_bytes=bucket_bytes,
                        plane_cuda=data.type == "cuda", mac=mac, groups=groups, window=window, base_copy=keep_base)


def intended_need(worker: Any, intent: StagingIntent) -> StagingNeed:
    """This rank's staging at the intent's settings, from the loaded model."""
    mc = worker.vllm_config.model_config
    strategy: CommitStrategy
    if intent.adapter is not None:  # the adapter's tensors and slot images, not the model
        from inflight.engine.adapter_engine import adapter_schema
        from inflight.engine.commit.lora_slot import LoRASlotStrategy

        schema = adapter_schema(worker.model_runner, intent.adapter)
        strategy = LoRASlotStrategy(worker.model_runner, intent.adapter, schema)
    else:
        schema = engine_schema(worker.model_runner)
        strategy = make_strategy(worker.model_runner, intent.commit, schema, quantized=mc.quantization is not None,
                                eager=mc.enforce_eager)
    try:
        engine = torch.device(worker.model_runner.device)
        # as GroupConfig.resolved_backend: NCCL wherever CUDA is, unless gloo is named
        data = engine if engine.type == "cuda" and intent.backend != "gloo" else torch.device("cpu")
        # the MAC's host copy is host memory: no secret changes the device bytes
        return planned_need(schema, strategy, strategy.shard_plan(), staging=intent.staging,
                            keep_rollback=intent.keep_rollback, bucket_bytes=int(intent.max_bucket_mb * (1 << 20)),
                            engine=engine, data=data, mac=False, keep_base=intent.keep_base)
    finally:
        strategy.close()


def reserve_before_kv_cache(worker: Any, available: int, *, total: int, utilization: float) -> int:
    """``available`` (what vLLM would give the KV cache) less this rank's staging at the
    engine's intent; the figure is remembered on the worker for ``inflight_start``. Refuses,
    naming the bytes and a setting that fits, when nothing would be left."""
    intent = StagingIntent.from_additional_config(worker.vllm_config.additional_config)
    if intent is None:
        raise ValueError("inflight: this engine was not built with engine_kwargs(reserve_staging=...)")
    need = intended_need(worker, intent)
    device = torch.device(worker.model_runner.device)
    left = kv_cache_after_staging(available, need, device=device, total=total, utilization=utilization)
    setattr(worker, SET_ASIDE_ATTR, SetAside(set_aside_bytes(need, device), repr(intent), available))
    log.info("inflight: set aside %.2f GiB for staging (%s) before the KV cache, which gets %.2f GiB",
             (available - left) / GiB, need.describe("device", device), left / GiB)
    return left


def patch_available_memory() -> None:
    """Wrap ``vllm.v1.worker.gpu_worker.Worker.determine_available_memory`` (vLLM 0.32.0).

    On a worker of an engine built with a staging intent (``engine_kwargs(reserve_staging=...)``)
    the KV cache's budget vLLM computes is returned less this rank's staging
    (``reserve_before_kv_cache``); vLLM's own ``available_kv_cache_memory_bytes`` is set to
    match, so its later log lines report the KV cache it allocated. Every other engine, and
    one whose ``kv_cache_memory_bytes`` the user set, gets vLLM's figure unchanged. vLLM CPU's
    worker overrides the method, so CPU engines are untouched.

    Why a patch: the extension cannot override a worker method (vLLM refuses one that
    shadows an attribute of the worker), and nothing else runs between the profile and the
    sizing. Idempotent; raises if vLLM's GPU worker no longer has the method.
    """
    from vllm.v1.worker.gpu_worker import Worker

    original = getattr(Worker, "determine_available_memory", None)
    if not callable(original):
        raise RuntimeError("inflight: vllm's GPU Worker has no determine_available_memory(); this vLLM is not "
                           "0.32-compatible")
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def determine_available_memory(self) -> int:
        sized_by_user = self.cache_config.kv_cache_memory_bytes is not None  # before a startup plan fills it in
        available = original(self)
        if StagingIntent.from_additional_config(self.vllm_config.additional_config) is None:
            return available
        if sized_by_user:
            log.info("inflight: kv_cache_memory_bytes is set: nothing set aside for staging; inflight_start checks the "
                     "memory left free")
            return available
        left = reserve_before_kv_cache(self, available, total=self.init_snapshot.total_memory,
                                       utilization=self.cache_config.gpu_memory_utilization)
        if hasattr(self, "available_kv_cache_memory_bytes"):
            self.available_kv_cache_memory_bytes = left
        return left

    setattr(determine_available_memory, _MARK, True)
    Worker.determine_available_memory = determine_available_memory
