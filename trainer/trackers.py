"""Experiment trackers: each step's metrics row, as grouped scalars, to TensorBoard, W&B or Trackio.

``run.report_to`` names them; metrics.jsonl (``inflight.trainer.metrics.MetricsLog``) is always written
and is the record the plot, the summary and a resumed run read; the trackers get a copy of
each row. A tracker's package is imported only when the run names it, so none of them is a
dependency of the trainer (each is an extra: ``pip install 'inflight[wandb]'``).

Names: ``<group>/<key>``, the key as in metrics.jsonl and the group one of ``train/`` (the
loss and its importance-sampling statistics), ``rollout/`` (what was sampled: reward, lag,
versions, the queue), ``sync/`` (weight pushes, commits, waits, the fleet) and ``eval/``
(``eval_*``, less the prefix: ``eval/accuracy``); the step is the optimizer step (row "step 0": the evaluation
before training). Only numbers are logged, and to TensorBoard the token lag and importance ratio histograms
(``rollout/lag_hist``, ``train/ratio_hist``); the tables of a row (``by_lag``, ...) stay in
metrics.jsonl.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from inflight.trainer.config import TrainConfig

log = logging.getLogger("inflight.trackers")

ROLLOUT = frozenset({
    "reward_mean", "reward_std", "lag_mean", "frac_multi_version", "max_versions_per_sample", "hybrid_token_frac",
    "queue_depth", "admitted", "dropped_stale", "pending", "queue_holes", "tokens", "seqs"})
SYNC = frozenset({
    "version", "pushed_version", "stall_ms", "commit_step", "commit_groups", "commit_spread_steps", "push_ms",
    "send_ms", "push_mb", "read_ms", "steps_during_transfer", "wait_ms", "push_wait_ms", "read_wait_ms",
    "engine_failures", "engine_restarts", "engine_drops", "engines_live"})
SKIP = frozenset({"step"})  # the x axis itself


def group_of(key: str) -> str:
    """The group a metrics.jsonl key is shown under; a key not listed is the loss's (``train/``)."""
    if key.startswith("eval_"):
        return "eval"
    return "rollout" if key in ROLLOUT else "sync" if key in SYNC else "train"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's numbers under their grouped names (booleans as 0/1; lists, tables, None left out)."""
    out = {}
    for key, value in row.items():
        if key in SKIP or not isinstance(value, (int, float)):
            continue
        group = group_of(key)
        out[f"{group}/{key.removeprefix('eval_') if group == 'eval' else key}"] = float(value)
    return out


class Tracker(Protocol):
    def log(self, row: dict[str, float], step: int) -> None:
        """One step's grouped scalars (``scalars``)."""

    def close(self) -> None:
        """Flush and finish; called once."""


def _need(name: str) -> None:
    """Raise when tracker ``name``'s package (also the name of its extra) is not installed."""
    if importlib.util.find_spec(name) is None:
        raise ImportError(f"run.report_to includes {name!r}, which needs its package: pip install 'inflight[{name}]'")


class TensorBoardTracker:
    """Event files in ``out/tensorboard`` (``tensorboard --logdir out``); the config as a text
    entry. A resumed run writes a new event file beside the old ones, which TensorBoard merges."""

    def __init__(self, cfg: TrainConfig, out: Path, config: dict[str, Any]) -> None:
        _need("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))
        # indented: TensorBoard's text tab renders markdown, and this keeps the JSON a code block
        text = "\n".join("    " + line for line in json.dumps(config, indent=2).splitlines())
        self.writer.add_text("config", text, global_step=0)

    def log(self, row: dict[str, float], step: int) -> None:
        for name, value in row.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()  # a step takes seconds: a live TensorBoard shows each as it lands

    def histograms(self, row: dict[str, Any], step: int) -> None:
        """The row's token lag and importance ratio histograms, as TensorBoard histograms (the
        ratio's buckets are ``inflight.trainer.loss.RATIO_BINS``; its mean is taken at their midpoints)."""
        for name, values in (("rollout/lag_hist", _lag_buckets(row.get("lag_hist"))),
                             ("train/ratio_hist", _ratio_buckets(row.get("ratio_hist")))):
            if values is None:
                continue
            limits, points, counts = values
            self.writer.add_histogram_raw(
                name, min=points[0], max=points[-1], num=sum(counts), sum=sum(p * c for p, c in zip(points, counts)),
                sum_squares=sum(p * p * c for p, c in zip(points, counts)), bucket_limits=limits,
                bucket_counts=counts, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


RATIO_EDGES = (0.0, 0.5, 0.8, 0.95, 1.05, 1.25, 2.0, 4.0)
"""``inflight.trainer.loss.RATIO_BINS`` with its last edge, infinity, drawn at 4."""


def _lag_buckets(hist: Any) -> tuple[list[float], list[float], list[int]] | None:
    """(right bucket edges, values, counts) of a ``lag_hist`` ({lag: tokens}), one bucket per lag."""
    if not hist:
        return None
    tokens = {int(k): int(v) for k, v in hist.items()}  # int keys in a row, str keys read back from JSON
    lags = sorted(tokens)
    return [lag + 0.5 for lag in lags], [float(lag) for lag in lags], [tokens[lag] for lag in lags]


def _ratio_buckets(counts: Any) -> tuple[list[float], list[float], list[int]] | None:
    if not counts or not sum(counts):
        return None
    mids = [(a + b) / 2 for a, b in zip(RATIO_EDGES, RATIO_EDGES[1:])]
    return list(RATIO_EDGES[1:]), mids, [int(c) for c in counts]


class WandbTracker:
    """A W&B run under ``out/wandb``, offline unless ``WANDB_MODE`` says otherwise (``wandb sync``
    uploads it later). A resumed run continues the same W&B run: its id is kept in
    ``out/wandb/inflight_run_id``."""

    def __init__(self, cfg: TrainConfig, out: Path, config: dict[str, Any], *, resumed: bool) -> None:
        _need("wandb")
        import wandb

        id_file = out / "wandb" / "inflight_run_id"
        run_id = id_file.read_text().strip() if resumed and id_file.exists() else secrets.token_hex(4)
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id)
        # offline by default: a run must not fail, or hang, for want of a network or a login
        mode = None if os.environ.get("WANDB_MODE") else "offline"
        self.run = wandb.init(project=cfg.run.project, name=cfg.run.name, dir=str(out), config=config, mode=mode,
                              id=run_id, resume="allow")

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    """A Trackio run (a local SQLite database; ``trackio show --project inflight``). Trackio reads
    ``TRACKIO_DIR`` once, at import: unset then, it becomes ``out/trackio``, so the run's data
    stay with its other outputs."""

    def __init__(self, cfg: TrainConfig, out: Path, config: dict[str, Any], *, resumed: bool) -> None:
        _need("trackio")
        os.environ.setdefault("TRACKIO_DIR", str(out.resolve() / "trackio"))
        import trackio

        # no system-metrics thread: it would take time from cores the trainer and the engines share
        self.run = trackio.init(project=cfg.run.project, name=cfg.run.name, config=config,
                                resume="allow" if resumed else "never", auto_log_cpu=False, auto_log_gpu=False)

    def log(self, row: dict[str, float], step: int) -> None:
        self.run.log(row, step=step)

    def close(self) -> None:
        self.run.finish()


def check_trackers(cfg: TrainConfig) -> None:
    """Raise ``ImportError`` naming the extra to install for each tracker whose package is missing."""
    for name in cfg.run.report_to:
        if name != "jsonl":  # MetricsLog's own file
            _need(name)


class Trackers:
    """The run's trackers behind one ``log(row)``; ``close`` is idempotent and also runs at exit,
    so a run that fails anywhere still flushes what it logged."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers
        if trackers:
            atexit.register(self.close)

    def log(self, row: dict[str, Any]) -> None:
        if not self.trackers:
            return
        values = scalars(row)
        for t in self.trackers:
            t.log(values, int(row["step"]))
            if isinstance(t, TensorBoardTracker):  # histograms: TensorBoard's own kind of series
                t.histograms(row, int(row["step"]))

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            try:
                t.close()
            except Exception:  # one tracker failing to finish must not hide the others' files or the run's error
                log.exception("closing %s failed", type(t).__name__)
        atexit.unregister(self.close)


def open_trackers(cfg: TrainConfig, out: Path, *, resumed: bool = False) -> Trackers:
    """The trackers ``run.report_to`` names (``jsonl`` is ``MetricsLog``'s own file), each started
    with the run's config; ``resumed``: continue the runs a previous run in ``out`` started."""
    config = json.loads(json.dumps(dataclasses.asdict(cfg)))  # plain JSON types, as every tracker stores them
    opened: list[Tracker] = []
    try:
        for name in cfg.run.report_to:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(cfg, out, config))
            elif name == "wandb":
                opened.append(WandbTracker(cfg, out, config, resumed=resumed))
            elif name == "trackio":
                opened.append(TrackioTracker(cfg, out, config, resumed=resumed))
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)
