"""The GPU ``copy`` commit is used only where it is right.

A copy commit writes the new weights into the live storage and runs no post-load processing,
so a layer whose processing derives state from its weights (MLA's ``W_UK_T``/``W_UV``, a
FlashInfer MoE layout, a quantized repack) would keep that state at the old version,
silently. ``copy_refusals`` names such layers from the real vLLM model; ``auto`` then picks
``reload`` (which re-runs each layer's processing), and an explicit ``copy`` is refused.
"""

from __future__ import annotations

import gc

import pytest
import torch

from inflight.engine.commit.base import resolve_strategy
from inflight.engine.commit.loaders import copy_refusals


class DerivesABuffer(torch.nn.Module):
    """Like MLA attention: its processing computes a buffer from a loaded weight."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_b = torch.nn.Parameter(torch.randn(4, 4))

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self.w_uk_t = self.kv_b.detach().t().contiguous()


def _refusals_of(model_dir, names: tuple[str, ...] = ()) -> list[str]:
    from vllm import LLM

    from inflight.engine.engine_config import engine_kwargs

    llm = LLM(str(model_dir), enforce_eager=True, dtype="float32", max_model_len=256, seed=0, **engine_kwargs())
    try:
        return llm.collective_rpc(lambda worker: copy_refusals(worker.model_runner.get_model(), names))[0]
    finally:
        del llm
        gc.collect()


def test_layers_whose_processing_derives_from_weights_are_never_silently_copied(tiny_llama, tiny_moe) -> None:
    assert _refusals_of(tiny_llama) == []  # linear, embedding, norms, plain attention: a copy is exact
    # KV-cache scales in the checkpoint: attention derives its float scales from them
    scales = ("model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale")
    assert _refusals_of(tiny_llama, scales) == ["Attention (KV-cache scales in the checkpoint)"]
    moe = _refusals_of(tiny_moe)
    assert moe and all("FusedMoE" in r for r in moe), moe  # the experts' layout is the backend's own
    toy = torch.nn.Sequential(torch.nn.LayerNorm(4), DerivesABuffer())
    assert copy_refusals(toy) == ["DerivesABuffer"]
    cuda = torch.device("cuda")
    assert resolve_strategy("auto", cuda, quantized=False, eager=False) == "copy"
    assert resolve_strategy("auto", cuda, quantized=False, eager=False, copy_refused=moe) == "reload"
    with pytest.raises(ValueError, match=r"commit='copy' would leave the post-load state of \['DerivesABuffer'\]"):
        resolve_strategy("copy", cuda, quantized=False, eager=False, copy_refused=["DerivesABuffer"])
