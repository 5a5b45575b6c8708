"""``bench.staleness``'s runs are valid configs of today's trainer: each builds a ``TrainConfig``
from the packaged demo config with the settings its name says (a renamed setting fails here,
not an hour into the benchmark)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from inflight.bench.staleness import RUNS, run_config
from inflight.trainer.config_files import find_config


@pytest.mark.parametrize("name", list(RUNS))
def test_every_run_is_a_config_with_its_named_settings(name: str, tmp_path: Path) -> None:
    with open(find_config("demo"), "rb") as f:
        base = tomllib.load(f)
    cfg = run_config(name, base, steps=3, seed=1, out=tmp_path / "run")
    mode, correction = name.split(" ")
    assert cfg.rollout.mode == ("batch" if mode == "batch" else "inflight")
    if mode.startswith("lag"):
        assert cfg.loss.max_lag == cfg.rollout.admit_lag == int(mode[3:])
    assert cfg.loss.objective.name == ("reinforce" if correction == "TIS" else "none")
    assert cfg.loss.seq_mask == ("product" if correction == "Seq-MIS" else "off")
    assert cfg.loss.m2_threshold == (0.04 if correction == "M2PO" else 0.0)
    assert (cfg.run.steps, cfg.run.seed, cfg.run.out_dir) == (3, 1, str(tmp_path / "run"))
