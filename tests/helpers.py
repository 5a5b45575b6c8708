"""Helpers shared by test modules: training runs (a small config, reading the run's metrics
and checkpoint, the rollout queue's ledger) and a free port for a server that is not a store."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from inflight.protocol import decode_group
from trainer.config import TrainConfig, config_from_dict

RUN_BASE = {  # a tiny policy, short completions, small groups
    "run": {"seed": 5},
    "model": {"tiny": {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 128}},
    "task": {"completion_tokens": 24},
    "rollout": {"group_size": 4, "groups_per_step": 2, "in_flight_groups": 2, "queue_capacity": 4},
    "transport": {"bucket_mb": 0.05, "collective_timeout_s": 15.0, "reply_timeout_s": 15.0, "stale_timeout_s": 15.0,
                  "rejoin_timeout_s": 180.0},
}


def run_config(out: Path, steps: int, **sections) -> TrainConfig:
    """``RUN_BASE`` for ``steps`` steps writing to ``out``, each section updated with ``sections``."""
    data = {k: dict(v) for k, v in RUN_BASE.items()}
    data["run"].update(steps=steps, out_dir=str(out))
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return config_from_dict(data)


def metrics_rows(out: Path) -> list[dict]:
    """The rows the run in ``out`` has written so far (none before its first)."""
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_rows(out: Path, n: int, *, where: Callable[[list[dict]], bool] = lambda rows: True) -> list[dict]:
    """Block until the run has written ``n`` rows (one at least) and ``where(rows)`` holds:
    an event of the run's own, never a deadline. Returns the rows."""
    while True:
        rows = metrics_rows(out)
        if rows and len(rows) >= n and where(rows):
            return rows
        time.sleep(0.05)


def train_beside(cfg: TrainConfig, beside: Callable[[], None]) -> tuple[dict, list[dict]]:
    """``train(cfg)`` while ``beside`` runs in a thread (a fault or an input it injects when
    the run's rows say so: see ``wait_rows``). Returns the run's summary and its rows."""
    from trainer.train import train

    t = threading.Thread(target=beside, daemon=True)
    t.start()
    summary = train(cfg)
    t.join(5)
    return summary, metrics_rows(Path(cfg.run.out_dir))


def pending_ids(out: Path) -> list[str]:
    """The ids of the groups the run's last checkpoint kept for the next run."""
    raw = msgspec.msgpack.decode((out / "checkpoint" / "pending.msgpack").read_bytes())
    return [decode_group(b).group_id for b in raw]


def check_ledger(summary: dict, rows: list[dict], pending: list[str]) -> list[str]:
    """Every queued slot was read, every read is admitted, refused or a hole, and every admitted
    group was trained on, dropped as stale, or saved as pending. Returns the consumed ids."""
    q = summary["queue"]
    consumed = [g for r in rows for g in r["group_ids"]]
    dropped = [g for r in rows for g in r["dropped_ids"]]
    assert q["put"] == q["read"], q  # the final checkpoint drained the queue
    assert q["admitted"] + sum(q["rejected"].values()) + q["queue_holes"] == q["read"], q
    assert len(consumed) + len(dropped) + len(pending) == q["admitted"], (len(consumed), len(dropped), pending, q)
    assert len(set(consumed + dropped + pending)) == len(consumed) + len(dropped) + len(pending), "a group came twice"
    return consumed


def free_port() -> int:
    """A port free now, for a server that is not the group's store (``vllm serve``'s HTTP
    port). It cannot be held as ``reserve_port`` holds a store's: the server is another
    process that binds the port itself, from a number on its command line, so the socket is
    closed here first and the port may in principle be taken in between. Group stores never
    use this: the ``port`` fixture holds theirs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fail_after_applying(worker) -> int:
    """Inside the worker: its next apply writes the new weights, then fails (a half-done commit)."""
    applier = worker._inflight_target.applier
    real = applier.apply

    def apply() -> None:
        applier.apply = real
        real()
        raise RuntimeError("injected failure after the weights were written")

    applier.apply = apply
    return 1
