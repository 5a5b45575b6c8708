"""``inflight.bench.paired.per_round``: decode lost, paired step by step against ``none``.

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
