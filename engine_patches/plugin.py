"""vLLM plugin entry point (``vllm.general_plugins``): the one place `inflight` changes vLLM.

vLLM calls ``register`` in every process it starts, before an EngineCore is built.
"""

from __future__ import annotations


def register() -> None:
    """Apply the step-boundary patch (``engine_patches.patch``); idempotent, as vLLM may load
    plugins twice."""
    from engine_patches.patch import patch_engine_core

    patch_engine_core()
