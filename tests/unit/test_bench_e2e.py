"""``inflight.bench.e2e``'s arithmetic and workloads, without an engine (the bench's own run
is the training loop, tested in tests/engine/test_train.py and tests/engine/test_pause_mode.py)."""

from __future__ import annotations

import pytest

from inflight.bench.e2e import MODES, figures, summarize, workload
from inflight.trainer.config_files import config_from_dict


def _row(mode: str, rnd: int, rate: float, stall: float | None = None) -> dict:
    return {"mode": mode, "round": rnd, "cores": "shared cores", "samples_s": rate, "stall_ms": stall, "wait_ms": 1.0,
            "reward_first": 0.1, "reward_last": 0.2 + rnd}


def test_summary_takes_medians_across_rounds_and_their_ratios() -> None:
    rows = [_row(m, r, rate) for r, rates in enumerate([(10, 5, 2), (14, 6, 4), (12, 8, 3)])
            for m, rate in zip(MODES, rates)]
    s = summarize(rows)["shared cores"]
    assert s["modes"]["inflight"]["samples_s"] == 12 and s["modes"]["pause"]["samples_s"] == 6
    assert (s["modes"]["inflight"]["samples_s_min"], s["modes"]["inflight"]["samples_s_max"]) == (10, 14)
    assert s["modes"]["batch"]["samples_s_rounds"] == [2, 4, 3] and s["modes"]["batch"]["reward_last"] == 1.2
    assert s["ratios"] == {"inflight/pause": 2.0, "inflight/batch": 4.0}


def test_figures_count_samples_from_the_first_step_on() -> None:
    cfg = config_from_dict({"rollout": {"group_size": 4, "groups_per_step": 2}})
    log = [{"step": i, "reward_mean": 0.1 * i, "step_ms": 5000.0 if i == 1 else 500.0, "wait_ms": 100.0,
            **({"stall_ms": 20.0 + i} if i > 1 else {})} for i in range(1, 6)]
    row = figures(log, cfg, mode="pause", rnd=1, placement="shared", load=1.5, total=9.0)
    assert row["samples_s"] == 16.0 and row["wall_s"] == 2.0  # 4 steps after the first, 8 samples each, 0.5 s each
    assert row["stall_ms"] == 23.5 and [t for t, _ in row["reward_vs_wall"]] == [0.5, 1.0, 1.5, 2.0]
    assert row["reward_first"] == 0.1 and row["reward_last"] == 0.5


def test_every_mode_shares_lag_and_prefix_caching() -> None:
    base, about = workload("tiny", 5, 3, 512)
    for mode in MODES:
        cfg = config_from_dict({**base, "rollout": {"mode": mode}})
        assert (cfg.loss.max_lag, cfg.engine.prefix_caching, cfg.run.steps) == (3, True, 5)
    assert about == {"workload": "tiny"}


def test_the_smollm2_workload_has_long_prompts_with_a_shared_preamble() -> None:
    pytest.importorskip("transformers")
    from inflight.trainer.models import resolve_model

    try:
        resolve_model("smollm2")
    except (FileNotFoundError, ModuleNotFoundError) as e:
        pytest.skip(f"smollm2 is not prepared: {e}")
    base, about = workload("smollm2-system", 5, 2, 512)
    cfg = config_from_dict({**base, "rollout": {**base["rollout"], "mode": "pause"}})
    assert cfg.rollout.group_size == 8 and cfg.model.path == "smollm2" and about["prompt_tokens_min"] >= 512
    assert cfg.task.arithmetic.template.startswith("You are a careful arithmetic assistant")
    assert cfg.engine.max_model_len >= about["prompt_tokens_min"] + cfg.task.completion_tokens
