"""A clean console: the demo's fits on one screen, with one progress bar and no warning twice;
the engines' output goes to a file per engine, and an engine that fails is reported with the
end of that file."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

from inflight.trainer.config_files import config_from_dict
from inflight.trainer.console import BarText, OncePerMessage, log_tail, log_to_file
from inflight.trainer.fleet import Fleet, Placement
from tests.helpers import metrics_rows, wait_until

ROOT = Path(__file__).resolve().parents[2]
BAR = re.compile(r"^train:\s+\d+%\|")
VLLM_LINE = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d [\d:]+ \[")  # vLLM's log format


def test_the_demo_console_fits_on_one_screen(tmp_path) -> None:
    out = tmp_path / "run"
    # as `make demo` runs it: conftest quiets vLLM's log (VLLM_LOGGING_LEVEL), the demo does not
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "TRITON_INTERPRET")}
    run = subprocess.run([sys.executable, "-m", "inflight.trainer.train", "--config", "demo", "--set", "run.steps=3",
                          "--set", f"run.out_dir={out}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=1800)
    console = run.stdout
    assert run.returncode == 0, console
    assert len(metrics_rows(out)) == 3
    lines = [s.strip() for s in re.split(r"[\r\n]", console) if s.strip()]
    bars = [s for s in lines if BAR.match(s)]
    others = [s for s in lines if not BAR.match(s)]
    # one bar: its redraws aside, every line once, and a screen's worth of them
    assert bars and len(others) == len(set(others)), console
    assert len(others) + 1 <= 25, console
    assert not [s for s in others if re.search(r"\d+%\|", s)], console  # no library's progress bar
    assert not [s for s in lines if "(inflight-engine" in s or VLLM_LINE.search(s)], console
    assert "reward" in bars[-1] and "samples/s" in bars[-1] and "lag" in bars[-1] and "stall" in bars[-1], bars[-1]
    # the engine's output is in its file, which the console names
    log = out / "engine0.log"
    assert f"engines: logs in {log}" in others, console
    text = log.read_text()
    assert text.startswith("--- engine 0 (process ") and VLLM_LINE.search(text), text[:2000]


def _failing_engine(cfg, *args, log_file: str, **kwargs) -> None:
    """Stands in for ``run_engine``: writes its start-up to its log, then fails."""
    log_to_file(log_file, "a failing engine")
    for i in range(30):
        print(f"start-up line {i}")
    raise RuntimeError("the engine could not start")


def test_an_engine_that_fails_is_reported_with_the_end_of_its_log(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("inflight.trainer.fleet.run_engine", _failing_engine)
    # the console, read without truncating it: capsys.readouterr() empties its buffer between a
    # read and a truncate, and loses what the watcher thread writes in between (it hung here)
    console = io.StringIO()
    monkeypatch.setattr(sys, "stdout", console)
    cfg = config_from_dict({"run": {"out_dir": str(tmp_path)}})
    fleet = Fleet(cfg, tmp_path, 0, 0, Placement(backend="gloo", engine_devices=None), tmp_path)
    fleet.start(wait_for_version=0)
    try:
        wait_until(lambda: "RuntimeError: the engine could not start" in console.getvalue(),
                   "the watcher's report of the failed engine", poll_s=0.1)
    finally:
        fleet.stop()
    seen = console.getvalue()
    log = tmp_path / "engine0.log"
    assert f"engines: logs in {log}" in seen
    assert f"engine 0 (process {fleet.engines[0].process.pid}) exited with code 1; the last lines of {log}:" in seen
    assert "    start-up line 29" in seen and "start-up line 5\n" not in seen  # the last 20 lines, indented
    assert f"(log: {log})" in fleet.exit_problem()


def test_each_distinct_warning_passes_once_and_errors_always() -> None:
    once = OncePerMessage()

    def passes(level: int, msg: str, *args: object, name: str = "inflight.train") -> bool:
        return once.filter(logging.LogRecord(name, level, __file__, 1, msg, args, None))

    assert passes(logging.WARNING, "step %d: ESS %.2f < 0.5", 3, 0.31)
    assert not passes(logging.WARNING, "step %d: ESS %.2f < 0.5", 4, 0.27)  # the same warning, other numbers
    assert passes(logging.WARNING, "step %d: ESS %.2f < 0.5", 4, 0.27, name="inflight.other")
    assert passes(logging.WARNING, "engine lost: %s", "engine 0 exited")
    assert passes(logging.ERROR, "push failed") and passes(logging.ERROR, "push failed")


def test_a_log_tail_is_the_last_lines_with_a_bar_at_its_last_redraw(tmp_path) -> None:
    log = tmp_path / "engine0.log"
    assert log_tail(log) == ""
    log.write_text("".join(f"line {i}\n" for i in range(30)) + "Loading: 0%\rLoading: 100%\n")
    assert log_tail(log, 3).splitlines() == ["    line 28", "    line 29", "    Loading: 100%"]



def test_the_bar_counts_each_failed_episode_once() -> None:
    """A group that failed is its episodes that failed (the ledger counts both): the bar says
    how many episodes, not their sum with the groups."""
    bar = BarText(group_size=4)
    row = {"reward_mean": 0.5, "group_ids": ["a"], "lag_mean": 0.0, "stall_ms": 1.0}
    assert "failed" not in bar({**row, "rollout_groups_failed": 0, "rollout_episodes_failed": 0})
    assert bar({**row, "rollout_groups_failed": 1, "rollout_episodes_failed": 4}).endswith(" failed 4")
