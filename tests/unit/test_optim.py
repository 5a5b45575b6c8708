"""The optimizer's settings: the learning-rate schedule against its formulas, and the checks
that refuse a setting that would train wrongly (a negative clip flips every gradient)."""

from __future__ import annotations

import math

import pytest

from inflight.trainer.config_files import config_from_dict
from inflight.trainer.optim import learning_rate


def _cfg(**optim):
    return config_from_dict({"run": {"steps": 10}, "optim": {"lr": 2.0, **optim}})


@pytest.mark.parametrize("schedule, after_warmup", [
    ("constant", lambda d: 1.0),
    ("linear", lambda d: 1 - d),
    ("cosine", lambda d: 0.5 * (1 + math.cos(math.pi * d))),
])
def test_learning_rate_schedule(schedule: str, after_warmup) -> None:
    cfg = _cfg(schedule=schedule, warmup_steps=3)
    got = [learning_rate(cfg, s) for s in range(10)]
    # warmup: steps 1..3 at 1/4, 2/4, 3/4 of the peak; then 7 steps from the peak, d = 0, 1/7, .., 6/7
    want = [2.0 * k / 4 for k in (1, 2, 3)] + [2.0 * after_warmup(d / 7) for d in range(7)]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[3] == 2.0 and all(x > 0 for x in got)
    assert [learning_rate(_cfg(schedule=schedule), s) for s in (0, 9)] == \
        pytest.approx([2.0, 2.0 * after_warmup(0.9)], abs=1e-12)


@pytest.mark.parametrize("optim, message", [
    ({"grad_clip": -1.0}, r"optim.grad_clip=-1.0 must be >= 0 \(0: off\)"),
    ({"betas": [0.9]}, r"optim.betas=\[0.9\] must be two numbers in \[0, 1\)"),
    ({"betas": [0.9, 1.0]}, r"optim.betas=\[0.9, 1.0\] must be two numbers"),
    ({"weight_decay": -0.1}, r"optim.weight_decay=-0.1 must be in \[0, 1\)"),
    ({"schedule": "step"}, r"optim.schedule='step' is not one of 'constant', 'linear', 'cosine'"),
    ({"warmup_steps": -1}, r"optim.warmup_steps=-1 must be a whole number >= 0"),
    ({"warmup_steps": 10}, r"optim.warmup_steps=10 must be below run.steps=10"),
    ({"micro_batch_tokens": 0}, r"optim.micro_batch_tokens=0 must be a whole number >= 1"),
    ({"head_chunk_tokens": 0}, r"optim.head_chunk_tokens=0 must be a whole number >= 1"),
    ({"micro_batch_tokens": 255}, r"optim.micro_batch_tokens=255 is below engine.max_model_len=256: a sample that "
                                  r"long could not be trained in one pass; set optim.micro_batch_tokens >= 256"),
    ({"packing": "flat"}, r"optim.packing='flat' is not one of 'padded', 'packed', 'prefix_shared'"),
])
def test_optimizer_settings_are_checked(optim: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(**optim)


def test_m2po_trains_the_whole_batch_in_one_pass() -> None:
    """M2PO's mask is a moment of every token of the batch: its steps take one pass whatever
    the budget, so a budget below a sample is no refusal there."""
    cfg = config_from_dict({"loss": {"m2_threshold": 0.04}, "optim": {"micro_batch_tokens": 64}})
    assert cfg.optim.micro_batch_tokens == 64
