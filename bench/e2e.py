"""The training loop end to end: in-flight vs batch-boundary samples/s and reward vs wall clock.

    python -m inflight.bench.e2e [--steps 40] [--placement shared split] [--out runs/bench]

Each placement (``inflight.bench.placement``) runs both modes alike:

- **shared cores** (what ``inflight.trainer.train`` does on this machine): trainer and engine
  processes on the same cores, taking turns, so the overlap async RL exists for cannot show;
- **split cores** (a real deployment, emulated): the trainer process on core 0, the engine
  process on core 1, one compute thread each (``placement.pinned_processes``).

Samples/s counts from the first step on (the same engine start-up for all); reward against
wall clock comes from each run's ``metrics.jsonl``. Writes ``bench_e2e.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from inflight.bench.placement import PLACEMENTS, Placement, pinned_processes

def train_loop(steps: int, work: Path, engines: int = 1, *, placement: Placement = "shared") -> list[dict]:
    """In-flight vs batch-boundary with one engine (and, with ``engines`` > 1 on shared
    cores, in-flight with a fleet of that many engines)."""
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.train import train

    rows = []
    runs = [("inflight", 1), ("batch", 1)] + ([("inflight", engines)] if engines > 1 and placement == "shared" else [])
    cores = f"{placement} cores"
    for mode, count in runs:
        name = f"train_{mode}_x{count}_{placement}"
        cfg = config_from_dict({"run": {"steps": steps, "out_dir": str(work / name)}, "rollout": {"mode": mode},
                                "engine": {"count": count}})
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        with pinned_processes(placement):
            train(cfg)
        log = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
        steps_log = [r for r in log if "reward_mean" in r]
        wall = sum(r["step_ms"] for r in steps_log[1:]) / 1e3  # from the first step on: the same start-up for all
        samples = (len(steps_log) - 1) * cfg.rollout.groups_per_step * cfg.rollout.group_size
        k = max(1, len(steps_log) // 5)
        clock, curve = 0.0, []
        for r in steps_log[1:]:
            clock += r["step_ms"] / 1e3
            curve.append((round(clock, 2), r["reward_mean"]))
        rows.append({"mode": mode, "engines": count, "cores": cores, "steps": steps, "samples_s": round(samples / wall, 1),
                     "wall_s": round(wall, 1), "total_s": round(time.perf_counter() - t0, 1), "load_1m": round(load, 1),
                     # trainer time waiting for rollouts vs computing: what the overlap can hide
                     "wait_ms": round(sum(r.get("wait_ms", 0.0) for r in steps_log[1:]) / max(1, len(steps_log) - 1), 1),
                     "step_ms": round(1e3 * wall / max(1, len(steps_log) - 1), 1),
                     "reward_first": round(sum(r["reward_mean"] for r in steps_log[:k]) / k, 3),
                     "reward_last": round(sum(r["reward_mean"] for r in steps_log[-k:]) / k, 3),
                     "reward_vs_wall": curve})
    return rows


def plot_e2e(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        if r["engines"] != 1:
            continue
        xs, ys = zip(*r["reward_vs_wall"]) if r["reward_vs_wall"] else ((), ())
        window = 5
        smooth = [sum(ys[max(0, i - window + 1): i + 1]) / len(ys[max(0, i - window + 1): i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, label=f"{r['mode']}, {r['cores']} ({r['samples_s']} samples/s)",
                color="C1" if r["mode"] == "inflight" else "C3", ls="-" if r["cores"] == "split cores" else ":")
    ax.set_xlabel("training wall clock from the first step, s")
    ax.set_ylabel("reward (batch mean, 5-step average)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--placement", nargs="+", choices=PLACEMENTS, default=["shared"],
                    help="inflight.bench.placement: each runs both modes (split: trainer and engine on a core each)")
    ap.add_argument("--out", default="runs/bench")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [r for placement in args.placement for r in train_loop(args.steps, Path(tmp), placement=placement)]
    for r in rows:
        print(f"{r['cores']:>12} {r['mode']:>8}: {r['samples_s']} samples/s, reward {r['reward_first']} -> "
              f"{r['reward_last']} ({r['steps']} steps, {r['wall_s']} s; per step {r['step_ms']} ms, of it waiting for "
              f"rollouts {r['wait_ms']} ms; load {r['load_1m']})")
    for cores in ("shared cores", "split cores"):
        got = {r["mode"]: r for r in rows if r["cores"] == cores and r["engines"] == 1}
        if len(got) == 2:
            print(f"{cores}: in-flight / batch-boundary = {got['inflight']['samples_s'] / got['batch']['samples_s']:.2f}x")
    plot_e2e(rows, out / "bench_e2e.png")
    print(json.dumps({"bench": "e2e", "rows": rows}))


if __name__ == "__main__":
    main()
