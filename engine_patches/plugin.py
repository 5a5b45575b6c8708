"""vLLM plugin entry point (``vllm.general_plugins``): the one place `inflight` changes vLLM.

vLLM calls ``register`` in every process it starts, before an EngineCore is built and
before a worker loads its model or sizes its KV cache.
"""

from __future__ import annotations

import sys


def register() -> None:
    """Register the ``inflight`` weight-transfer backend (``register_backend``); apply the
    step-boundary patch and the in-process refusal patch (``inflight.engine.patch``), the KV
    cache budget patch (``inflight.engine.kv_budget``), in the OpenAI server the version
    spans on its completions (``inflight.engine.openai_spans``) and the RL routes' 4xx
    answers (``inflight.engine.rl_status``), on CPU the async-scheduling
    switch (``keep_cpu_async_scheduling``, inert unless ``INFLIGHT_CPU_ASYNC_SCHEDULING=1``)
    and the kernel-rebind mend (``spec_decode.tolerate_foreign_objects_in_kernel_rebind_vllm_0_32``),
    and, with ``INFLIGHT_CPU_PLAIN_GEMM=1``, the plain CPU GEMM
    (``inflight.engine.patch.use_plain_cpu_gemm``); all idempotent, as vLLM may load
    plugins twice."""
    from vllm.platforms import current_platform

    from inflight.engine.kv_budget import patch_available_memory
    from inflight.engine.patch import (
        keep_cpu_async_scheduling,
        patch_engine_core,
        patch_inprocess_refusals,
        plain_cpu_gemm_requested,
        use_plain_cpu_gemm,
    )
    from inflight.engine.spec_decode import tolerate_foreign_objects_in_kernel_rebind_vllm_0_32

    register_backend()
    patch_engine_core()
    if current_platform.is_cpu():
        keep_cpu_async_scheduling()
        tolerate_foreign_objects_in_kernel_rebind_vllm_0_32()
    patch_inprocess_refusals()
    if "vllm.entrypoints.openai" in sys.modules:  # the OpenAI server's process (its other processes import it too)
        from inflight.engine.openai_spans import patch_openai_spans
        from inflight.engine.rl_status import patch_rl_status_codes

        patch_openai_spans()
        patch_rl_status_codes()
    patch_available_memory()
    if plain_cpu_gemm_requested():
        use_plain_cpu_gemm()


def register_backend() -> None:
    """Add the ``inflight`` backend to vLLM's weight-transfer registries, worker side
    (``inflight.engine.transfer_engine``) and trainer side (``inflight.trainer.transfer_trainer``),
    each imported on first use; idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    from inflight.engine.transfer_engine import BACKEND

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "inflight.engine.transfer_engine",
                                                    "InflightWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "inflight.trainer.transfer_trainer",
                                                     "InflightTrainerWeightTransferEngine")
