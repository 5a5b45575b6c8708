"""``inflight.bench.grpo``'s arithmetic, without an engine: the workload (prompts, the ramp), what a
scheduled chunk computes, the cadence in-flight achieves, and the figures of each row."""

from __future__ import annotations

import pytest

from inflight.bench.grpo_figures import (achieved_cadence, against_cache, checks, group_prompt, positions, prefill_figures, ramp,
                        rotate)


def test_every_group_has_a_fresh_prompt_the_same_in_every_mode() -> None:
    a, b = group_prompt(0, 7, 256, 49152), group_prompt(0, 8, 256, 49152)
    assert len(a) == 256 and a == group_prompt(0, 7, 256, 49152)
    assert a != b and a != group_prompt(1, 7, 256, 49152)
    assert all(256 <= t < 49152 for t in a)  # clear of the low ids that hold special tokens
    assert all(64 <= t < 256 for t in group_prompt(0, 0, 64, 256))  # a tiny vocabulary: its top three quarters


def test_the_first_groups_are_admitted_over_one_completion() -> None:
    assert ramp(4, 64) == [0, 16, 32, 48]
    assert ramp(3, 256) == [0, 85, 170]
    assert ramp(1, 64) == [0]


@pytest.mark.parametrize(("start", "end", "prompt", "total", "expected"), [
    (0, 256, 256, 256, (256, 0)),      # a whole prompt in one chunk, nothing cached
    (128, 256, 256, 256, (128, 0)),    # a sibling: the first block came from the cache
    (0, 100, 256, 256, (100, 0)),      # the first chunk of a split prefill
    (100, 256, 256, 256, (156, 0)),    # ... and the rest
    (300, 301, 256, 301, (0, 0)),      # a decode step: the last sampled token's position
    (0, 301, 256, 301, (256, 44)),     # re-prefill after a preemption: 45 sampled, 44 recomputed
    (128, 301, 256, 301, (128, 44)),   # ... its first block back from the cache
    (0, 280, 256, 301, (256, 24)),     # a re-prefill split in two: none of the first chunk is the decode's
    (280, 301, 256, 301, (0, 20)),
])
def test_what_a_scheduled_chunk_computes(start: int, end: int, prompt: int, total: int,
                                         expected: tuple[int, int]) -> None:
    assert positions(start, end, prompt, total) == expected


def test_the_cadence_in_flight_achieves() -> None:
    # every 16: a push that lands before the next cue keeps the cadence
    assert achieved_cadence([(16, 20), (32, 40), (48, 50)], 16) == 16
    # landing at or after the next cue skips it: the next send is the first cue after the landing
    assert achieved_cadence([(16, 32), (48, 70), (80, 100)], 16) == 32
    assert achieved_cadence([(16, 60)], 16) == 48
    assert achieved_cadence([], 16) == 16


def test_rotate_starts_each_round_with_the_next_mode() -> None:
    order = ["none", "inflight", "native-salt"]
    assert [rotate(order, k)[0] for k in range(4)] == ["none", "inflight", "native-salt", "none"]
    assert sorted(rotate(order, 2)) == sorted(order)


def _row(engine: str, mode: str, **kw: float) -> dict:
    base = {"engine": engine, "mode": mode, "group": "P1024/T64/every16", "P": 1024, "T": 64, "every": 16,
            "updates": 0, "cached": 0, "prompt_computed": 0, "prefilled": 0, "admitted_prompt": 0, "readmitted": 0,
            "tokens": 1000, "wall_s": 1.0, "tok_s": 1000.0, "vs_none": 1.0}
    return {**base, **kw}


def test_prefill_figures_are_against_the_caching_engines_none() -> None:
    # none: 8 prompts of 1024, 7 siblings each find 896 tokens cached
    none = _row("cache", "none", cached=7 * 896, prompt_computed=8192 - 7 * 896, prefilled=8192 - 7 * 896,
                admitted_prompt=8192)
    # a reset: the same prompts, plus 4 requests recomputed (2048 prompt tokens, 100 sampled tokens)
    reset = _row("cache", "native-reset", updates=2, cached=7 * 896, prompt_computed=8192 - 7 * 896 + 2048,
                 prefilled=8192 - 7 * 896 + 2148, admitted_prompt=8192, readmitted=4)
    nocache = _row("nocache", "inflight-nocache", updates=4, prompt_computed=8192, prefilled=8192, admitted_prompt=8192)
    rows = [none, reset, nocache, _row("nocache", "none", prompt_computed=8192, prefilled=8192, admitted_prompt=8192)]
    prefill_figures(rows)
    assert none["hit_rate"] == round(7 * 896 / 8192, 3) and none["extra_prefill_per_update"] is None
    assert reset["hit_rate"] == round(7 * 896 / (8192 + 2048), 3)
    assert reset["extra_prefill_per_update"] == 2148 / 2 and reset["readmitted_per_update"] == 2.0
    assert reset["prompt_computed_per_update"] == round((8192 - 7 * 896 + 2048) / 2)
    assert nocache["hit_rate"] == 0.0 and nocache["extra_prefill_per_update"] == 7 * 896 / 4


def test_a_cacheless_engine_alone_is_against_its_own_none() -> None:
    rows = [_row("nocache", "none", prompt_computed=8192, prefilled=8192, admitted_prompt=8192),
            _row("nocache", "inflight-nocache", updates=4, prompt_computed=8192, prefilled=8192, admitted_prompt=8192)]
    prefill_figures(rows)
    assert rows[1]["extra_prefill_per_update"] == 0


def test_the_cacheless_rows_against_the_caching_engines_none() -> None:
    rows = [_row("cache", "none", tokens=1000, wall_s=1.0, tok_s=1000.0),
            _row("nocache", "inflight-nocache", updates=4, tokens=800, wall_s=1.0, tok_s=800.0),
            _row("cache", "inflight", updates=4)]
    against_cache(rows)
    assert rows[1]["vs_none_cache"] == 0.8
    assert rows[1]["lost_ms_per_update_cache"] == pytest.approx(1e3 * (1.0 - 0.8) / 4)
    assert rows[0]["vs_none_cache"] is None and rows[2]["vs_none_cache"] is None


def test_the_targets_at_1024_and_every_16() -> None:
    rows = [_row("cache", "none", tok_s=1000.0), _row("cache", "inflight", tok_s=960.0, vs_none=0.96),
            _row("cache", "native-salt", tok_s=700.0), _row("cache", "native-reset", tok_s=970.0),
            _row("cache", "inflight", P=256, group="P256/T64/every16", tok_s=10.0, vs_none=0.01)]
    (c,) = checks(rows)  # the P=256 row is not a target
    assert c["vs_none_pass"] and not c["vs_native_pass"]
    rows[3]["tok_s"] = 900.0
    assert checks(rows)[0]["vs_native_pass"]
    rows[1]["vs_none"] = 0.94
    assert not checks(rows)[0]["vs_none_pass"]
    assert not checks(rows[:3])[0]["vs_native_pass"]  # a native mode missing: not shown to be beaten
