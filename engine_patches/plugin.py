"""vLLM plugin entry point (``vllm.general_plugins``): the one place `inflight` changes vLLM.

vLLM calls ``register`` in every process it starts, before an EngineCore is built.
"""

from __future__ import annotations


def register() -> None:
    """Apply the step-boundary patch and register the ``inflight_gloo`` weight-transfer
    engine (the native-path baseline on CPU); idempotent, as vLLM may load plugins twice."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from engine_patches.native_gloo import BACKEND
    from engine_patches.patch import patch_engine_core

    patch_engine_core()
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "engine_patches.native_gloo", "GlooWeightTransferEngine")
