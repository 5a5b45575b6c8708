"""Shared fixtures: tiny models on disk, held ports, and the ``gpu`` marker.

vLLM reads its environment at import, so the settings that make a CPU engine start in
seconds are set here, before any test module imports it.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Triton reads this when a kernel is decorated: without a GPU, the kernels under test run
# in Triton's interpreter. The trainer itself never takes the Triton path on CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from inflight.transport.store import release_port, reserve_port  # noqa: E402  (after the environment above)
from tests.helpers import MOE  # noqa: E402


@pytest.fixture
def port():
    """A port held for the group store this test hosts in this process (``reserve_port``):
    the store takes the held socket, so no other socket can take the port first."""
    port = reserve_port()
    yield port
    release_port("127.0.0.1", port)


@pytest.fixture(scope="module")
def hold_port():
    """``hold_port(host="127.0.0.1")`` holds a port as ``port`` does, for a store hosted in
    this process by a module-scoped fixture (one port per call: a parametrized fixture's
    instances each get their own) or on another address; what no store took is released
    when the module ends. A store hosted by a child process cannot take a port held here:
    the child reserves its own and hands it on."""
    held: list[tuple[str, int]] = []

    def hold(host: str = "127.0.0.1") -> int:
        held.append((host, reserve_port(host)))
        return held[-1][1]

    yield hold
    for host, port in held:
        release_port(host, port)


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer Qwen2 (qkv bias, tied embeddings), fp32 on disk."""
    from inflight.trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen"), default_corpus(), TinyModelConfig(arch="qwen2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer Llama (no bias, untied LM head, head_dim 64), fp32 on disk."""
    from inflight.trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus

    cfg = TinyModelConfig(arch="llama", hidden_size=128, num_heads=2, num_kv_heads=1, tie_word_embeddings=False, seed=1)
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), default_corpus(), cfg)


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer Qwen3-MoE (4 experts, top-2, head_dim 64, tied embeddings), fp32 on disk."""
    from inflight.trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus

    return build_tiny_model(tmp_path_factory.mktemp("tiny_moe"), default_corpus(), TinyModelConfig(**MOE, seed=2))
