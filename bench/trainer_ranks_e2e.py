"""Does a run on N trainer ranks learn as one rank does? The same config, seed and steps
through ``inflight train --nproc N`` and ``--nproc 1``, alternated.

    python -m inflight.bench.trainer_ranks_e2e [--config demo] [--steps 200] [--nproc 2] [--rounds 1]

Each round runs one rank, then N (the order alternates between rounds), each in its own
output directory, and keeps from each run: the sampled reward per step, the summary's
reward (first and last 20% of steps), the share of samples spanning several versions, the
median step time, the mean lag of a trained token and the wall time.

A sample spans several versions only if a push commits while it decodes: the share is set by
how long a sample decodes against the time between two pushes, at any rank count. A mean lag
near ``loss.max_lag`` says the trainer was the slower side (the engine waited for room), so
samples decoded in less than a step and most carry one version. The steps before the first one
a commit reached trained on samples decoded before any push (two of a 20-step run's, at least
one): the share is also given from that step on. One JSON line per round is appended to
``bench/results/trainer_ranks_e2e.jsonl`` (command, start, git revision, load at the start
and end). The engines, the rollout queue and the pushes are rank 0's in both modes: what
differs is only how the trainer's step is computed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "trainer_ranks_e2e.jsonl"


def run(config: str, steps: int, nproc: int, out: Path, sets: list[str]) -> dict:
    """One ``inflight train`` run: its summary and per-step series."""
    overrides = [a for s in (f"run.steps={steps}", f"run.out_dir={out}", *sets) for a in ("--set", s)]
    start = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "inflight"), "train", "--config", config,
                           "--nproc", str(nproc), *overrides], capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode:
        raise RuntimeError(f"--nproc {nproc} exited {done.returncode}:\n{done.stderr[-3000:]}")
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
    summary = json.loads((out / "summary.json").read_text())
    return {"nproc": nproc, "wall_s": round(wall, 1), "reward": [round(r["reward_mean"], 4) for r in rows],
            "reward_first_20pct": summary["reward_first_20pct"], "reward_last_20pct": summary["reward_last_20pct"],
            "frac_samples_multi_version": summary["frac_samples_multi_version"],
            "frac_samples_multi_version_after_first_commit": summary["frac_samples_multi_version_after_first_commit"],
            "lag_mean": round(summary["lag_mean"], 3),
            "step_s_median": round(statistics.median(r["step_ms"] for r in rows) / 1000, 3)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="demo")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    help="a config override for both modes (as inflight train --set)")
    args = ap.parse_args(argv)
    from inflight.bench.run_record import run_record
    from inflight.trainer.config_files import load_config

    RESULTS.parent.mkdir(exist_ok=True)
    for k in range(args.rounds):
        record, load = run_record("trainer_ranks_e2e", argv), os.getloadavg()[0]
        order = (1, args.nproc) if k % 2 == 0 else (args.nproc, 1)
        with tempfile.TemporaryDirectory() as tmp:
            runs = {n: run(args.config, args.steps, n, Path(tmp) / f"n{n}", args.sets) for n in order}
        row = {**record, "config": args.config, "steps": args.steps, "sets": args.sets, "order": list(order),
               "max_lag": load_config(args.config, args.sets).loss.max_lag,
               "load": [round(load, 2), round(os.getloadavg()[0], 2)], "one": runs[1], "many": runs[args.nproc]}
        with RESULTS.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for n in order:
            r = runs[n]
            print(f"--nproc {n}: reward {r['reward_first_20pct']:.3f} -> {r['reward_last_20pct']:.3f}, "
                  f"{100 * r['frac_samples_multi_version']:.1f}% of samples span >1 version "
                  f"({100 * r['frac_samples_multi_version_after_first_commit']:.1f}% from the first step a commit "
                  "reached), "
                  f"mean lag {r['lag_mean']:.2f} of {row['max_lag']}, "
                  f"step {r['step_s_median']:.2f} s, {r['wall_s']:.0f} s in all")


if __name__ == "__main__":
    main()
