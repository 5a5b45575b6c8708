"""What every benchmark run records about itself: its command, its start and the git revision.

A run's JSON (committed under ``bench/results/``, appended, never replaced) starts with these
fields, so a figure quoted from it can be traced to the code and the command that made it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def git_revision() -> str:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it; "unknown" outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev.strip() + ("+dirty" if dirty.strip() else "")


def run_record(module: str, argv: list[str] | None = None) -> dict[str, str]:
    """``command`` (``python -m inflight.bench.<module>`` and ``argv``, default the process's
    arguments), ``started`` (UTC, ISO 8601) and ``git``."""
    args = sys.argv[1:] if argv is None else argv
    return {"command": " ".join([f"python -m inflight.bench.{module}", *args]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "git": git_revision()}


RESULTS = Path(__file__).resolve().parent / "results"
"""Where each benchmark's runs are committed: ``<bench>.jsonl``, a line per run."""


def add_results_option(ap, bench: str) -> None:
    """``--results``: the JSONL file a run's line is appended to (default ``bench/results/<bench>.jsonl``;
    '' for none)."""
    ap.add_argument("--results", default=str(RESULTS / f"{bench}.jsonl"),
                    help="the JSONL file the run's line is appended to ('' for none)")


def append_result(path: str | Path, line: dict) -> None:
    """Append one run's line to ``path`` (nothing when ``path`` is ''): appended, never replaced."""
    if path:
        with Path(path).open("a") as f:
            f.write(json.dumps(line) + "\n")
