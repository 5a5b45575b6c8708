"""Record one ``inflight train`` run for the README's training rows: its summary, the pushes
every engine committed, its wall time, the command, its start, the git revision and the load,
appended to ``bench/results/train.jsonl``.

    python -m inflight.bench.train_record --config fleet_cpu [--set KEY=VALUE ...] [--results PATH]

The run is ``inflight train --config NAME --set ...`` in a child process, its ``run.out_dir``
in a temporary directory (what a reader runs is that command, without this wrapper).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from inflight.bench.run_record import add_results_option, append_result, run_record


def pushes(rows: list[dict], engines: int) -> dict[str, int]:
    """The run's pushes that landed (metrics rows' ``pushes_landed``: [version, committed ranks]),
    and how many of them every one of the ``engines`` committed (ranks 1..engines)."""
    landed = [p for r in rows for p in r.get("pushes_landed", [])]
    every = set(range(1, engines + 1))
    return {"engines": engines, "landed": len(landed),
            "on_every_engine": sum(set(ranks) == every for _, ranks in landed)}


def train(config: str, sets: list[str], out: Path) -> float:
    """Run ``inflight train`` into ``out``; its wall time in seconds (an error names the failed run)."""
    argv = [sys.executable, "-m", "inflight.trainer.cli", "train", "--config", config,
            *[a for s in sets for a in ("--set", s)], "--set", f"run.out_dir={out}"]
    t0 = time.perf_counter()
    done = subprocess.run(argv, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        raise SystemExit(f"inflight train --config {config} {' '.join(sets)}: exit {done.returncode}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="a packaged config by name, or a TOML file")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY.PATH=VALUE")
    add_results_option(ap, "train")
    args = ap.parse_args(argv)
    record = run_record("train_record", argv)
    load = [round(os.getloadavg()[0], 2)]
    with tempfile.TemporaryDirectory() as tmp:
        wall_s = train(args.config, args.sets, Path(tmp) / "run")
        run = Path(tmp) / "run"
        summary = json.loads((run / "summary.json").read_text())
        config = json.loads((run / "config.json").read_text())
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    load.append(round(os.getloadavg()[0], 2))
    line = {"bench": "train", **record, "train": f"inflight train --config {args.config}"
            + "".join(f" --set {s}" for s in args.sets), "config": args.config, "sets": args.sets, "load_1m": load,
            "wall_s": round(wall_s, 1), "pushes": pushes(rows, config["engine"]["count"]), "summary": summary}
    print(json.dumps(line))
    append_result(args.results, line)


if __name__ == "__main__":
    main()
