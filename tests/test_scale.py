"""The fleet model of ``python -m bench.scale``: its invariants, hand-computed memory and lag,
the shipped scenarios, and its prediction of a committed ``bench.inflight`` run.

Nothing here starts an engine or reads a clock: the model is deterministic for a seed, and
the CPU check compares it with a run measured once and committed (bench/scale_cpu_bench.json).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from bench.scale import TOLERANCE, merge_repeats, reference_ok, scenario_rows, validate_cpu
from bench.scale_fleet import GB, Link, Scenario, plan
from bench.scale_model import Lengths, Run, StepTime, Update, _add_lags, simulate

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs" / "scale").glob("*.toml"))
STEP = StepTime(overhead_s=0.002, weights_max_s=0.006, weights_per_seq_s=0.006, kv_per_seq_s=0.0001)
LENGTHS = Lengths(dist="uniform", low=50, high=400)


def _scenario(**link: float) -> Scenario:
    s = Scenario.load(ROOT / "configs" / "scale" / "dense_7b.toml")
    if link:
        s = replace(s, link=replace(s.link, **link))
    return s


def test_shipped_scenarios_load_and_every_built_mode_runs() -> None:
    assert len(CONFIGS) == 4
    for path in CONFIGS:
        rows = scenario_rows(Scenario.load(path))
        by = {r["variant"]: r for r in rows}
        assert by["none"]["vs_none"] == 1.0
        for r in rows:  # no mode beats the ceiling, and a variant that does not fit says why
            assert r.get("vs_none", 0.0) <= 1.0 + 1e-9
            assert r["fits"] or r["note"]


@pytest.mark.parametrize("mode", ["pause", "batch", "inflight"])
def test_no_updates_is_the_ceiling(mode: str) -> None:
    """A cadence longer than the run: every mode decodes exactly what ``none`` does, and that is
    slots / step(slots) tokens per second, the ceiling by hand."""
    none = simulate(32, STEP, Update(mode="none"), LENGTHS, steps=3000, seed=1, warmup_steps=400)
    assert none.tok_s == pytest.approx(32 / STEP(32), rel=1e-12)
    quiet = Update(mode=mode, every_s=1e9, stall_s=5.0, stage_s=1.0, stage_cost_s=0.5 if mode == "inflight" else 0.0)
    r = simulate(32, STEP, quiet, LENGTHS, steps=3000, seed=1, warmup_steps=400)
    assert (r.tokens, r.updates, r.lag_hist) == (none.tokens, 0, none.lag_hist)
    assert r.wall_s == pytest.approx(none.wall_s, rel=1e-12)


def test_zero_link_time_makes_pause_and_inflight_meet() -> None:
    """Nothing to overlap (staging takes no time and no decode time): in-flight is pause with
    the same stall, token for token and lag for lag."""
    pause = simulate(32, STEP, Update(mode="pause", every_s=0.5, stall_s=0.05), LENGTHS, steps=4000, warmup_steps=400)
    inflight = simulate(32, STEP, Update(mode="inflight", every_s=0.5, stall_s=0.05, stage_s=0.0), LENGTHS, steps=4000,
                        warmup_steps=400)
    assert pause.updates > 50
    assert (inflight.tokens, inflight.updates, inflight.lag_hist) == (pause.tokens, pause.updates, pause.lag_hist)
    assert inflight.wall_s == pytest.approx(pause.wall_s, rel=1e-12)


def test_zero_link_time_makes_them_meet_in_a_planned_fleet() -> None:
    """In a planned scenario the link is what in-flight hides. With requests short enough that
    ``max_num_seqs``, not memory, bounds concurrency (staging takes no slots) and staging
    costing decode nothing, a link of no time leaves both modes the same copy per update."""
    def rows(gbps: float) -> dict[str, dict]:
        s = _scenario(engine_gbps=gbps, load_fixed_s=0.0, commit_fixed_s=0.0)
        s = replace(s, updates=replace(s.updates, every_s=5.0, staging_hbm_passes=0.0))
        s = s.replace(lengths=Lengths(dist="uniform", low=100, high=300))
        by = {r["variant"]: r for r in scenario_rows(s)}
        assert by["inflight"]["slots"] == by["pause"]["slots"] == 256
        return by

    slow, instant = rows(5.0), rows(1e9)
    assert slow["inflight"]["tok_s"] > 1.5 * slow["pause"]["tok_s"]  # 3 s of transfer every 5 s, hidden
    assert instant["inflight"]["stall_s"] == instant["pause"]["stall_s"]  # the same copy, nothing else
    assert instant["inflight"]["tok_s"] == pytest.approx(instant["pause"]["tok_s"], rel=1e-3)


def test_staging_memory_reduces_concurrency_as_computed_by_hand() -> None:
    s = _scenario()
    s = s.replace(lengths=Lengths(dist="uniform", low=4000, high=12000))
    size = 7.62e9 * 2  # bf16 checkpoint
    free = 80 * GB * 0.9 - size - 4 * GB  # gpu_memory_utilization, weights (TP1), reserve
    held = 1024 + ((8001**2 - 1) / 12 + 8000**2) / (2 * 8000)  # prompt + E[L^2] / 2E[L] of 4000..12000
    by_hand = {
        "none": math.floor(free / 57344 / held),
        "inflight": math.floor((free - 2 * size) / 57344 / held),  # the update and its rollback copy
        "inflight_host": math.floor((free - 0.268 * GB) / 57344 / held),  # one bucket
    }
    assert by_hand["inflight"] < by_hand["none"] <= 256  # memory, not max_num_seqs, bounds it
    for variant, slots in by_hand.items():
        assert plan(s, variant).slots == slots, variant
    no_rollback = replace(s, updates=replace(s.updates, rollback=False))
    assert plan(no_rollback, "inflight").slots == math.floor((free - size) / 57344 / held)
    # and fewer slots is fewer tokens per second, by the step-time model
    rows = {r["variant"]: r for r in scenario_rows(s)}
    assert rows["inflight"]["tok_s"] < rows["inflight_host"]["tok_s"]


def test_what_does_not_fit_is_refused_with_the_figure() -> None:
    s = Scenario.load(ROOT / "configs" / "scale" / "dense_70b.toml")
    p = plan(s, "inflight")  # every TP8 rank staging the full 141 GB checkpoint twice
    assert p.slots == 0 and "282 GB staging per GPU" in p.note
    assert plan(s, "inflight_host").slots == 0 and "pinned host memory" in plan(s, "inflight_host").note
    assert plan(s, "inflight_host_shard").slots > 0
    pp = replace(s, fleet=replace(s.fleet, pp=2))
    assert plan(pp, "inflight_host_shard").note == "refused: pipeline parallel"


def test_lag_of_a_request_by_hand() -> None:
    """Tokens at steps 0..9, versions going live before steps 3 and 7 (and 12, after it)."""
    hist: dict[int, int] = {}
    _add_lags(hist, 0, 9, [3, 7, 12])
    assert hist == {2: 3, 1: 4, 0: 3}


def test_batch_boundary_drains_then_updates() -> None:
    """Two slots, requests of 4 and 10 steps (fixed length): the update waits for both."""
    lengths = Lengths(dist="uniform", low=10, high=10)
    r = simulate(2, StepTime(weights_max_s=0.01, weights_per_seq_s=0.01), Update(mode="batch", every_steps=3, stall_s=1.0),
                 lengths, steps=30)
    # steps 0-9 decode both requests (drain starts at 3, ends at 10), update, steps 10-19, again
    assert r.updates == 2 and r.tokens == 2 * 30 and r.lag_hist == {0: 60}
    assert r.wall_s == pytest.approx(30 * 0.01 + 2 * 1.0)


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="'zipf'"):
        Lengths(dist="zipf")
    with pytest.raises(ValueError, match="engine_gbps=0"):
        Link(engine_gbps=0, egress_gbps=0, load_fixed_s=0, commit_fixed_s=0)
    with pytest.raises(ValueError, match="every_steps=8, every_s=1.0"):
        Update(mode="pause", every_steps=8, every_s=1.0)


# --- the model against the CPU benchmark --------------------------------------------------

@pytest.fixture(scope="module")
def bench() -> dict:
    return json.loads((ROOT / "bench" / "scale_cpu_bench.json").read_text())


def test_model_predicts_the_cpu_benchmark_within_15_percent(bench: dict) -> None:
    checks = validate_cpu(bench)
    assert len(checks) == 3 * 3 * 2  # three modes, sizes S M L, every 8 and 32
    assert sum(c["calibration"] for c in checks) == 1  # one figure fitted, the rest predicted
    judged = [c for c in checks if not c["disturbed"]]
    assert len(judged) >= 12  # the rule for a disturbed reference cannot empty the check
    bad = [c for c in judged if abs(c["error"]) > TOLERANCE]
    assert not bad, bad


def test_a_disturbed_reference_is_recognised() -> None:
    """A none run whose tokens/s implies a mean step 4x its median lost seconds to something
    else: its repeat is left out of the mean where another repeat ran clean."""
    def run(tok_s: float) -> dict:
        rows = [{"size": "S", "every": 8, "mode": m, "tok_s": t, "vs_none": t / tok_s, "step_ms": 8.0, "stall_ms": 0.0,
                 "commit_ms": None, "stage_ms": None, "ms_per_gb": None} for m, t in (("none", tok_s), ("native", 6000.0))]
        return {"concurrency": 64, "rows": rows}

    clean, disturbed = run(7000.0), run(1800.0)
    assert reference_ok(clean, "S", 8) and not reference_ok(disturbed, "S", 8)
    merged = {r["mode"]: r for r in merge_repeats([disturbed, clean])}
    assert merged["native"]["vs_none"] == pytest.approx(6000 / 7000) and merged["native"]["repeats"] == 1
    assert not merged["native"]["disturbed"]
    assert merge_repeats([disturbed])[1]["disturbed"]


def test_the_cpu_check_can_fail(bench: dict) -> None:
    """The same check on a run whose native path had stalled half as long: the model, fed that
    stall, predicts a ratio the (real) measurement then misses by more than 15%."""
    doctored = copy.deepcopy(bench)
    for r in doctored["runs"][0]["rows"]:
        if r["mode"] == "native" and r["size"] == "L":
            r["stall_ms"] *= 0.2
    assert any(abs(c["error"]) > TOLERANCE for c in validate_cpu(doctored) if c["mode"] == "native")


def test_run_accumulates_chunks() -> None:
    a, b = Run(tokens=10, wall_s=1.0, lag_hist={0: 10}), Run(tokens=5, wall_s=1.0, updates=1, lag_hist={0: 3, 1: 2})
    a.add(b)
    assert (a.tokens, a.tok_s, a.updates, a.lag_hist, a.lag_quantile(0.9)) == (15, 7.5, 1, {0: 13, 1: 2}, 1)
