"""``run.report_to``: a short real run read back from TensorBoard's event files, the W&B offline
run and Trackio's database, each holding metrics.jsonl's numbers under grouped names."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight.trainer.config import RunConfig
from inflight.trainer.config_files import config_from_dict
from inflight.trainer.trackers import check_trackers, scalars
from tests.helpers import metrics_rows, run_config


def test_report_to_is_checked_where_it_is_set() -> None:
    assert RunConfig().report_to == ("jsonl",)
    assert RunConfig(report_to=["wandb"]).report_to == ("jsonl", "wandb")  # metrics.jsonl is always written
    assert RunConfig(report_to=("tensorboard", "jsonl")).report_to == ("tensorboard", "jsonl")
    with pytest.raises(ValueError, match=r"^run: run.report_to=\('tensorbord',\): 'tensorbord' is not one of "
                                         r"'jsonl', 'tensorboard', 'wandb', 'trackio'$"):
        config_from_dict({"run": {"report_to": ["tensorbord"]}})
    with pytest.raises(ValueError, match=r"run.report_to=\('wandb', 'jsonl', 'wandb'\) names 'wandb' twice"):
        RunConfig(report_to=("wandb", "jsonl", "wandb"))
    with pytest.raises(ValueError, match=r"run.report_to='wandb' must be a list of 'jsonl', "):
        RunConfig(report_to="wandb")


def test_a_missing_tracker_package_names_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else object())
    cfg = config_from_dict({"run": {"report_to": ["tensorboard", "wandb"]}})
    with pytest.raises(ImportError, match=r"run.report_to includes 'wandb'.*pip install 'inflight\[wandb\]'"):
        check_trackers(cfg)
    check_trackers(config_from_dict({"run": {"report_to": ["tensorboard"]}}))


def test_metric_names_are_grouped_and_only_numbers_go() -> None:
    row = {"step": 3, "version": 3, "loss": 0.5, "grad_norm": 1.0, "ess": 0.9, "ess_low": True, "reward_mean": 0.25,
           "lag_mean": 0.5, "queue_depth": 2, "stall_ms": 1.5, "push_mb": 0.1, "wait_ms": 3.0, "eval_accuracy": 0.75,
           "lag_hist": {"0": 3}, "ratio_hist": [1, 2], "group_ids": ["a"], "committed_ranks": [1], "pending_note": None}
    assert scalars(row) == {
        "sync/version": 3.0, "train/loss": 0.5, "train/grad_norm": 1.0, "train/ess": 0.9, "train/ess_low": 1.0,
        "rollout/reward_mean": 0.25, "rollout/lag_mean": 0.5, "rollout/queue_depth": 2.0, "sync/stall_ms": 1.5,
        "sync/push_mb": 0.1, "sync/wait_ms": 3.0, "eval/accuracy": 0.75}


def wandb_history(run_file: Path) -> tuple[dict[int, dict[str, float]], dict[str, object]]:
    """(each step's logged values, the run's config) from a W&B transaction log (``run-<id>.wandb``).

    wandb >= 0.18 has no Python reader of its own, so this reads the format: a 7-byte header
    (":W&B", magic, version), then LevelDB log records in 32 KiB blocks, each record (crc32,
    length, type: 1 full, 2 first, 3 middle, 4 last) a piece of a serialized ``Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    def records(data: bytes) -> Iterator[pb.Record]:
        assert data[:4] == b":W&B", data[:7]
        pos, block, buf = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # too little left in the block for a header: zero padding
                pos += block - pos % block
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            buf += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                record = pb.Record()
                record.ParseFromString(buf)
                buf = b""
                yield record

    steps: dict[int, dict[str, float]] = {}
    config: dict[str, object] = {}
    for r in records(run_file.read_bytes()):
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            steps.setdefault(r.history.step.num, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
        elif r.WhichOneof("record_type") == "run":
            config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    return steps, config


def _need_extras(*names: str) -> None:
    """Skip without the trackers' packages (pip install -e '.[tensorboard,wandb,trackio]'); found,
    not imported: trackio fixes its data directory when it is first imported."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        pytest.skip(f"needs the extras {missing}")


def test_a_short_run_reports_to_tensorboard_wandb_and_trackio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _need_extras("tensorboard", "wandb", "trackio")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    # every tracker writes under the run's directory, none under $HOME; W&B stays offline
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    for name in [m for m in sys.modules if m == "trackio" or m.startswith("trackio.")]:
        monkeypatch.delitem(sys.modules, name)  # trackio reads TRACKIO_DIR once, at import (TRL imports it): afresh
    monkeypatch.setenv("TRACKIO_DIR", str(out / "trackio"))
    from inflight.trainer.train import train

    cfg = run_config(out, steps=3, eval={"every": 2, "prompts": 4},
                     run={"name": "trackers", "report_to": ["tensorboard", "wandb", "trackio"]})
    train(cfg)
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # row "step 0": the evaluation before training
    train_rows = [r for r in rows if "reward_mean" in r]

    # TensorBoard, read with its own reader: one point per optimizer step, metrics.jsonl's values
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    for name in ("rollout/reward_mean", "rollout/lag_mean", "train/loss", "train/ess", "sync/stall_ms"):
        key = name.partition("/")[2]
        series = [(e.step, e.value) for e in acc.Scalars(name)]
        want = [(r["step"], pytest.approx(r[key], rel=1e-6, abs=1e-6)) for r in train_rows if r.get(key) is not None]
        assert series == want, name  # float32 in the event file
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [0, 2, 3]
    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"histograms": 0})
    acc.Reload()
    for tag, key in (("rollout/lag_hist", "lag_hist"), ("train/ratio_hist", "ratio_hist")):
        got = {e.step: [int(c) for c in e.histogram_value.bucket] for e in acc.Histograms(tag)}
        want = {r["step"]: ([v for _, v in sorted((int(k), v) for k, v in r[key].items())] if key == "lag_hist"
                            else r[key]) for r in train_rows}
        assert got == want, tag
    assert "config/text_summary" in acc.Tags()["tensors"]

    # W&B: an offline run directory, the same names and numbers at the same steps, the run's config
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history, config = wandb_history(run_file)
    assert sorted(history) == [0, 1, 2, 3]
    for r in rows:
        assert history[r["step"]] == pytest.approx(scalars(r)), r["step"]
    assert config["run"]["report_to"] == ["jsonl", "tensorboard", "wandb", "trackio"]
    assert run_file.name == f"run-{(out / 'wandb' / 'inflight_run_id').read_text()}.wandb"

    # Trackio: its local database, under the run directory
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("inflight", "trackers")
    assert [x["step"] for x in logs] == [0, 1, 2, 3]
    assert [x["rollout/lag_mean"] for x in logs[1:]] == pytest.approx([r["lag_mean"] for r in train_rows])
    assert (out / "trackio" / "inflight.db").exists()


def test_a_resumed_run_continues_its_series(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard reads the resumed run's event file beside the first; W&B gets the same run id."""
    _need_extras("tensorboard", "wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("WANDB_MODE", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    from inflight.trainer.train import train

    out = tmp_path / "run"
    report = {"report_to": ["tensorboard", "wandb"]}
    train(run_config(out, steps=2, run=report))
    run_id = (out / "wandb" / "inflight_run_id").read_text()
    train(run_config(out, steps=4, run={**report, "resume": True}))
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == \
        [(r["step"], pytest.approx(r["reward_mean"], rel=1e-6)) for r in rows]
    assert (out / "wandb" / "inflight_run_id").read_text() == run_id
    files = sorted((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 2
    assert sorted(wandb_history(files[1])[0]) == [3, 4]
