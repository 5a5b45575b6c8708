"""``rollout.mode = "pause"``: the async loop with vLLM's native pause-and-update path.

The refusals are checked without an engine; one short run on the real CPU engine shows
that every pushed version lands through the native path, with the engine's pause as the
stall, version tags within ``loss.max_lag`` of the trainer, and each request salted with
the version live when it was added (read back from vLLM's own request objects)."""

from __future__ import annotations

import json

import pytest

from inflight.trainer.config_files import config_from_dict
from tests.engine.test_train import SMALL


@pytest.mark.parametrize("section, key, value", [
    ("engine", "count", 2), ("engine", "tensor_parallel_size", 2), ("engine", "commit_unit", "layer"),
    ("engine", "launcher", "ray"), ("transport", "encoding", "sparse"), ("loss", "routing_replay", True),
])
def test_pause_mode_refuses_what_it_does_not_cover(section: str, key: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{section}.{key}={value!r} with rollout.mode='pause'.*set {section}.{key}="):
        config_from_dict({"rollout": {"mode": "pause"}, section: {key: value}})
    config_from_dict({"rollout": {"mode": "inflight"}, section: {key: value}})  # inflight takes it


def test_pause_mode_refuses_lora_and_lag_zero() -> None:
    with pytest.raises(ValueError, match=r"model.lora.rank=4 with rollout.mode='pause'.*set model.lora.rank=0"):
        config_from_dict({"rollout": {"mode": "pause"}, "model": {"lora": {"rank": 4}}})
    with pytest.raises(ValueError, match=r"loss.max_lag=0 with rollout.mode='pause'.*max_lag >= 1"):
        config_from_dict({"rollout": {"mode": "pause"}, "loss": {"max_lag": 0}})
    assert config_from_dict({"rollout": {"mode": "pause"}, "loss": {"max_lag": 1}}).rollout.mode == "pause"


def test_pause_mode_trains_through_the_native_path(tmp_path) -> None:
    from inflight.trainer.train import train

    steps, max_lag = 5, 2
    cfg = config_from_dict({**SMALL, "run": {**SMALL["run"], "steps": steps, "out_dir": str(tmp_path / "run")},
                            "rollout": {**SMALL["rollout"], "mode": "pause"}, "loss": {"max_lag": max_lag}})
    summary = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and rows[-1]["version"] == steps
    # every version landed on the engine, in order, each once (the last row: its own push too)
    assert [v for r in rows for v, _ in r["pushes_landed"]] == list(range(1, steps + 1))
    assert [r["pushed_version"] for r in rows[1:]] == list(range(1, steps - 1)) + [steps]
    # the stall is the engine's pause, measured there, and the push waited for it
    assert all(r["stall_ms"] > 0 and r["push_ms"] >= r["send_ms"] > 0 for r in rows[1:])
    assert summary["stall_ms_mean"] > 0
    # the trainer at version step - 1 trains on tokens of that version or up to max_lag older
    for r in rows:
        tags = r["versions_by_engine"]["e0"]
        assert max(tags) <= r["step"] - 1 and min(tags) >= r["step"] - 1 - max_lag, (r["step"], tags)
    assert any(int(lag) > 0 for r in rows for lag in r["lag_hist"])  # sampling ran ahead of the trainer
    # every request vLLM holds carries the salt of the version live when it was added
    salts = {k: n for r in rows for k, n in r.get("native_salts", {}).items()}
    pairs = [k.split("@") for k in salts]
    assert pairs and all(salt == live for salt, live in pairs), salts
    assert len({live for _, live in pairs}) >= 2 and sum(salts.values()) % cfg.rollout.group_size == 0
