"""Record one ``make test`` run, for the README's suite row: its pytest summary, its wall time,
the revision it ran and the load, appended to ``bench/results/suite.jsonl``.

    python -m inflight.bench.suite_record LOG --started 2026-11-30T14:45:00Z --wall-s 2550 --clone fresh
                                          [--load 1.2 2.0] [--git REV]

``LOG`` is the run's output; its last line is pytest's summary (``N passed, M skipped ... in S s``).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from inflight.bench.run_record import git_revision

RESULTS = Path(__file__).resolve().parent / "results" / "suite.jsonl"


def summary(text: str) -> dict[str, float]:
    """pytest's last summary line: each outcome's count and the seconds it reports."""
    line = next(x for x in reversed(text.splitlines()) if re.search(r"\b(passed|failed)\b.* in [\d.]+s", x))
    counts = {k: int(n)
              for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", line)}
    return {"passed": 0, "failed": 0, "skipped": 0, **counts,
            "tests_s": float(re.search(r" in ([\d.]+)s", line).group(1))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--started", required=True, help="when make test started (UTC, ISO 8601)")
    ap.add_argument("--wall-s", type=float, required=True, help="make test's wall time, install included")
    ap.add_argument("--clone", choices=["fresh", "worktree"], required=True)
    ap.add_argument("--load", type=float, nargs="*", default=[], help="load averages seen during the run")
    ap.add_argument("--git", default=None, help="the revision the run tested (default: this checkout's)")
    args = ap.parse_args(argv)
    row = {"command": "make test", "started": args.started, "git": args.git or git_revision(), "clone": args.clone,
           **summary(args.log.read_text()), "wall_s": args.wall_s, "load": args.load}
    with RESULTS.open("a") as f:  # appended, never replaced
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


if __name__ == "__main__":
    main()
