"""vLLM plugin entry point (``vllm.general_plugins``): the one place `inflight` changes vLLM.

vLLM calls ``register`` in every process it starts, before an EngineCore is built and
before a worker sizes its KV cache.
"""

from __future__ import annotations


def register() -> None:
    """Apply the step-boundary patch (``engine_patches.patch``) and the KV cache budget patch
    (``engine_patches.kv_budget``); both idempotent, as vLLM may load plugins twice."""
    from engine_patches.kv_budget import patch_available_memory
    from engine_patches.patch import patch_engine_core

    patch_engine_core()
    patch_available_memory()
