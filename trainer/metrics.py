"""Per-step metrics: a JSONL log, a PNG of reward, lag and stall over steps, a summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON object per step; ``rows`` keeps them for the plot and the summary."""

    def __init__(self, path: Path, *, append: bool = False) -> None:
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        if append and self.path.exists():
            self.rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        else:
            self.path.write_text("")

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Reward of the first vs the last 20% of steps, multi-version samples, stall per update."""
    n = len(rows)
    k = max(1, n // 5)
    stalls = [r["commit_ms"] for r in rows if r.get("commit_ms") is not None]
    return {
        "steps": n,
        "reward_first_20pct": _mean([r["reward_mean"] for r in rows[:k]]),
        "reward_last_20pct": _mean([r["reward_mean"] for r in rows[-k:]]),
        "frac_samples_multi_version": _mean([r["frac_multi_version"] for r in rows]),
        "max_versions_per_sample": max((r.get("max_versions_per_sample", 1) for r in rows), default=1),
        "stall_ms_mean": _mean(stalls),
        "stall_ms_max": max(stalls, default=float("nan")),
        "lag_mean": _mean([r["lag_mean"] for r in rows]),
    }


def plot_run(rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    reward = [r["reward_mean"] for r in rows]
    window = max(1, len(rows) // 20)
    smooth = [_mean(reward[max(0, i - window + 1): i + 1]) for i in range(len(reward))]
    axes[0].plot(steps, reward, alpha=0.35, label="batch mean")
    axes[0].plot(steps, smooth, label=f"moving mean ({window})")
    axes[0].set_ylabel("reward")
    axes[0].legend(loc="lower right")
    axes[1].plot(steps, [r["lag_mean"] for r in rows], label="mean lag")
    axes[1].plot(steps, [max(r["lag_hist"] or {"0": 0}, key=int) for r in rows], label="max lag", alpha=0.6)
    axes[1].set_ylabel("token lag (versions)")
    axes[1].legend(loc="upper right")
    axes[2].plot(steps, [r.get("commit_ms") or float("nan") for r in rows], label="engine stall per update (commit)")
    axes[2].plot(steps, [r.get("push_ms") or float("nan") for r in rows], label="push, announce..commit", alpha=0.6)
    axes[2].set_ylabel("ms")
    axes[2].set_xlabel("optimizer step")
    axes[2].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
