"""``inflight.bench.paired.per_round``: decode lost, paired step by step against ``none``; and
``inflight.bench.inflight_report.compare``'s ceiling for the rows run at in-flight's length.

Every mode decodes the same batches at the same step, so the loss is the sum of step
differences, plus each step run past the chunk (while the last update landed) against
none's median step; a prefill-heavy first step costs every mode alike and drops out."""

from __future__ import annotations

import pytest

from inflight.bench.paired import per_round


def _chunk(gaps: list[float], updates: int = 0) -> dict:
    return {"gaps": gaps, "infos": [{}] * updates}


def test_the_loss_is_the_step_differences_plus_the_steps_past_the_chunk() -> None:
    none = [_chunk([3.0, 1.0, 1.0, 1.0]), _chunk([3.2, 1.2, 1.2, 1.2])]
    mode = [_chunk([3.0, 1.5, 1.0, 1.0, 1.1], updates=2), _chunk([3.2, 1.2, 1.4, 1.2], updates=1)]
    r = per_round({"none": none, "mode": mode}, "mode")
    # round 1: 0.5 s slower at step 2, and a fifth step 0.1 s over none's median (1.0)
    # round 2: 0.2 s slower at step 3
    assert r["round_lost_ms"] == [300, 200]
    assert r["paired_lost_ms_per_update"] == pytest.approx(1e3 * 0.8 / 3, abs=0.1)
    # none would take 7.0 + 6.8 s for the same steps; the mode took 7.6 + 7.0
    assert r["paired_vs_none"] == pytest.approx(round(13.8 / 14.6, 4))
    assert r["round_vs_none"] == [round(7.0 / 7.6, 3), round(6.8 / 7.0, 3)]


def test_a_mode_without_updates_has_no_loss_per_update() -> None:
    none = [_chunk([1.0, 1.0])]
    r = per_round({"none": none, "mode": [_chunk([1.0, 1.0])]}, "mode")
    assert r["paired_lost_ms_per_update"] is None and r["paired_vs_none"] == 1.0 and r["round_lost_ms"] == []


def _row(mode: str, tokens: int, wall_s: float, updates: int = 0, **extra) -> dict:
    return {"model": "m", "engine": "model", "group": 16, "mode": mode, "tokens": tokens, "wall_s": wall_s,
            "tok_s": tokens / wall_s, "steps": tokens // 32, "updates": updates, "step_ms": 100.0,
            "_quiet": [0.1] * (tokens // 32), "_events": [], **extra}


def test_rows_run_at_inflights_length_are_measured_against_none_over_those_steps() -> None:
    """``inflight_report.compare``: none decodes 3200 tokens in 10 s; over in-flight's longer
    chunks (longer contexts) 6400 tokens in 24 s. In-flight took 25 s for 6400 tokens with 2
    updates: 0.5 s lost per update against none@inflight, where none's rate would charge it
    the longer contexts too (5 s). A row without a ceiling of its own keeps none's."""
    from inflight.bench.inflight_report import compare

    rows = [_row("none", 3200, 10.0), _row("none@inflight", 6400, 24.0),
            _row("inflight", 6400, 25.0, updates=2, ceiling="none@inflight"), _row("native", 3200, 14.0, updates=2)]
    compare(rows)
    by = {r["mode"]: r for r in rows}
    assert by["inflight"]["lost_ms_per_update"] == pytest.approx(500.0)
    assert by["inflight"]["vs_none"] == pytest.approx(24.0 / 25.0, abs=1e-3)
    assert by["native"]["lost_ms_per_update"] == pytest.approx(2000.0)
    assert (by["none@inflight"]["lost_ms_per_update"] is None
            and by["none@inflight"]["lost_ms_per_step"] == pytest.approx(1e3 * 4.0 / 200))
