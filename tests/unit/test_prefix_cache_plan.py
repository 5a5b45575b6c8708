"""``engine_kwargs(model=...)`` decides prefix caching from the model's config alone
(``inflight.engine.prefix_cache.caching_off_reason``): on for attention of every kind and for
hybrids whose state vLLM caches exactly here; off, with one logged line naming why, for the
hybrids vLLM 0.32's CPU build cannot cache (Mamba2 scans, short convolutions). These tests run
on the CPU build; configs only, no weights, no engine."""

from __future__ import annotations

import logging

import pytest

from inflight.engine.engine_config import engine_kwargs
from inflight.engine.prefix_cache import caching_off_reason


def _config(tmp_path, kind: str):
    import transformers as t

    small = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    configs = {
        "llama": lambda: t.LlamaConfig(**small),
        "gemma2": lambda: t.Gemma2Config(**small, sliding_window=128),
        "llama4": lambda: t.Llama4TextConfig(**small, attention_chunk_size=128),
        "lfm2": lambda: t.Lfm2Config(**small, layer_types=["conv", "full_attention"]),
        "granite-mamba": lambda: t.GraniteMoeHybridConfig(**small, layer_types=["mamba", "attention"]),
        "granite-attention": lambda: t.GraniteMoeHybridConfig(**small, layer_types=["attention", "attention"]),
        "falcon_h1": lambda: t.FalconH1Config(**small),
    }
    out = tmp_path / kind
    configs[kind]().save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "llama4", "granite-attention"])
def test_attention_of_every_kind_keeps_caching_on(tmp_path, kind, caplog) -> None:
    model = _config(tmp_path, kind)
    assert caching_off_reason(model) is None
    with caplog.at_level(logging.WARNING):
        kwargs = engine_kwargs(model=model)
    assert kwargs["enable_prefix_caching"] is True and kwargs["model"] == model
    assert not [r for r in caplog.records if "prefix caching" in r.getMessage()]


@pytest.mark.parametrize(("kind", "named"), [
    ("granite-mamba", "granitemoehybrid's Mamba2 layers"),
    ("falcon_h1", "falcon_h1's Mamba2 layers"),
    ("lfm2", "lfm2's short convolutions"),
])
def test_state_vllm_cannot_cache_on_cpu_turns_caching_off_with_one_line(tmp_path, kind, named, caplog) -> None:
    model = _config(tmp_path, kind)
    with caplog.at_level(logging.WARNING, logger="inflight.engine.engine_config"):
        kwargs = engine_kwargs(model=model, max_model_len=512)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"inflight: prefix caching off for {model}: {named}"), line
    assert kwargs["enable_prefix_caching"] is False and kwargs["max_model_len"] == 512
    # the user's word stands, and nothing is logged for it
    caplog.clear()
    assert engine_kwargs(model=model, enable_prefix_caching=True)["enable_prefix_caching"] is True
    assert not caplog.records


def test_an_unreadable_config_leaves_the_decision_to_the_start_time_check(tmp_path) -> None:
    assert caching_off_reason(str(tmp_path / "missing")) is None
    assert engine_kwargs(model=tmp_path / "missing")["enable_prefix_caching"] is True
    assert "model" not in engine_kwargs()
