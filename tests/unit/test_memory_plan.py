"""The trainer's planned memory (``inflight.trainer.memory_plan``): each part as its formula
says, the refusal of a plan over what is available naming a setting and a value that fits,
and ``inflight train`` refusing such a config before any engine starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inflight.trainer.config_files import config_from_dict
from inflight.trainer.memory_plan import PROCESS_BYTES, check_fits, layer_floats, micro_tokens, plan


def _cfg(model_dir: Path, **optim):
    return config_from_dict({"model": {"path": str(model_dir)}, "rollout": {"group_size": 4, "groups_per_step": 2},
                             "engine": {"max_model_len": 64}, "task": {"completion_tokens": 16}, "optim": optim})


def test_each_part_is_its_formula(tiny_llama) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tiny_llama))
    cfg = _cfg(tiny_llama, micro_batch_tokens=256)
    p = plan(cfg, tiny_llama, tokens=100, available=1 << 40)
    params = p.parts["weights"] // 4
    assert p.parts["gradients"] == 4 * params and p.parts["optimizer"] == 8 * params
    assert p.parts["process"] == PROCESS_BYTES and p.parts["reference"] == 0 and p.parts["gathered_layer"] == 0
    a, h = layer_floats(config), config.hidden_size
    assert p.parts["activations"] == 4 * 100 * (config.num_hidden_layers * h + 2 * a)  # checkpointed
    off = plan(_cfg(tiny_llama, activation_checkpointing=False), tiny_llama, tokens=100, available=1 << 40)
    assert off.parts["activations"] == 4 * 100 * config.num_hidden_layers * a
    kl = config_from_dict({"model": {"path": str(tiny_llama)}, "loss": {"kl_coef": 0.1}})
    two = plan(kl, tiny_llama, world=2, tokens=100, available=1 << 40)
    assert two.parts["weights"] == p.parts["weights"] // 2 and two.parts["reference"] == two.parts["weights"]
    assert two.parts["gathered_layer"] > 0
    # a pass never holds more than a step: 8 samples of at most 64 tokens
    assert micro_tokens(cfg) == 256 and micro_tokens(_cfg(tiny_llama, micro_batch_tokens=10_000)) == 8 * 64


def test_a_plan_over_what_is_available_names_a_budget_that_fits(tiny_llama) -> None:
    cfg = _cfg(tiny_llama, micro_batch_tokens=100_000)
    need = plan(cfg, tiny_llama, available=0).peak
    small = plan(cfg, tiny_llama, tokens=64, available=0).peak
    available = (need + small) // 2
    big = config_from_dict({"model": {"path": str(tiny_llama)}, "rollout": {"group_size": 64, "groups_per_step": 64},
                            "engine": {"max_model_len": 64}, "task": {"completion_tokens": 16},
                            "optim": {"micro_batch_tokens": 100_000}})
    with pytest.raises(ValueError, match=r"set optim.micro_batch_tokens=(\d+) \(now 100000\)") as e:
        check_fits(big, tiny_llama, available=available)
    budget = int(str(e.value).split("optim.micro_batch_tokens=")[1].split(" ")[0])
    fits = config_from_dict({"model": {"path": str(tiny_llama)}, "rollout": {"group_size": 64, "groups_per_step": 64},
                             "engine": {"max_model_len": 64}, "task": {"completion_tokens": 16},
                             "optim": {"micro_batch_tokens": budget}})
    assert check_fits(fits, tiny_llama, available=available).peak <= available  # the value named fits
    with pytest.raises(ValueError, match=r"even one sample of engine.max_model_len=64 tokens does not fit"):
        check_fits(big, tiny_llama, available=PROCESS_BYTES)


def test_inflight_train_refuses_a_config_that_cannot_fit_before_any_engine_starts(tiny_llama, tmp_path) -> None:
    """Every activation of a million-token pass kept: no machine holds it. The run stops with
    the setting and a value that fits, and no engine was started (no engine log)."""
    out = tmp_path / "run"
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "inflight.trainer.train", "--config", "demo", "--set", f"model.path={tiny_llama}",
         "--set", f"run.out_dir={out}", "--set", "optim.activation_checkpointing=false", "--set",
         "optim.micro_batch_tokens=100000000", "--set", "rollout.groups_per_step=4096", "--set",
         "rollout.group_size=1024"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=600)
    elapsed = time.monotonic() - t0
    assert run.returncode != 0
    assert "the trainer would need" in run.stderr and "set optim.micro_batch_tokens=" in run.stderr, run.stderr[-2000:]
    assert not list(out.glob("engine*.log")), "an engine started before the refusal"
    print(f"refused after {elapsed:.1f} s")


def test_engines_that_take_the_machine_are_named(tiny_llama) -> None:
    """Spawned CPU engines whose KV caches alone exceed the machine: the setting named is theirs."""
    cfg = config_from_dict({"model": {"path": str(tiny_llama)}, "engine": {"kv_cache_gb": 100_000}})
    with pytest.raises(ValueError, match=r"engine\(s\) this run spawns .*\(engine.kv_cache_gb=100000 each.*lower "
                                         r"engine.kv_cache_gb or engine.count"):
        check_fits(cfg, tiny_llama)
