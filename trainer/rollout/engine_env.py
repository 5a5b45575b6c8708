"""The engine process's environment, set before vLLM is imported: vLLM reads it at import."""

from __future__ import annotations

import os

from inflight.trainer.config import TrainConfig


def engine_environment(cfg: TrainConfig, cuda_devices: str | None = None) -> None:
    """vLLM reads these at import: an in-process EngineCore, and the CPU KV cache size; and
    the GPUs the engine may use (set before anything touches CUDA)."""
    if cuda_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = cuda_devices
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.engine.kv_cache_gb))
    if cfg.engine.tensor_parallel_size > 1:  # a CPU engine's workers must each be bound to cores of their own
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_binding(cfg.engine.tensor_parallel_size))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def cpu_binding(workers: int, cores: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a CPU engine of ``workers`` ranks: the cores this
    process may use, split into that many runs ("0|1", "0,1,2,3|4,5,6,7"; vLLM hands each to
    libnuma's cpu-string parser). vLLM's default binds by NUMA node and refuses more workers
    than nodes ("Not enough allowed NUMA nodes")."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if len(cores) < workers:
        raise ValueError(f"engine.tensor_parallel_size={workers} needs a core per worker; this process may use {cores}")
    per = len(cores) // workers
    runs = [cores[i * per:(i + 1) * per] for i in range(workers)]
    return "|".join(",".join(map(str, r)) for r in runs)
