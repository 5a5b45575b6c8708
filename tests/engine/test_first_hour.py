"""A new user's mistakes fail fast, name their cause, and leave no process behind.

Each test runs the user's command (``inflight train ...``) as a process, as a user would,
and follows it by its own events (the engine's process ending, the trainer's exit), never
by racing a clock: the only time asserted is the one the user waits, from the cause to
the error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import WAIT_S, wait_until

INFLIGHT = [sys.executable, "-m", "inflight.trainer.cli"]
ROOT = Path(__file__).resolve().parents[2]
ERROR_WITHIN_S = 15.0
"""How soon after its cause a user sees the error (the issue's bound). Measured on an idle
machine: 1-6 s; every transport timeout it must not wait for is 120 s or more."""


def _dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _left_behind(pids: set[int], grace_s: float = 20.0) -> list[str]:
    """The processes of ``pids`` still running ``grace_s`` after the trainer exited (a
    multiprocessing resource tracker notices its last client's exit a moment later), each
    with its command line."""
    deadline = time.monotonic() + grace_s
    while (left := [pid for pid in pids if not _dead(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    described = []
    for pid in left:
        try:
            described.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())[:200]}")
        except psutil.NoSuchProcess:
            pass
    return described


class Run:
    """``inflight train`` with ``args`` in ``out``: its process, every process it started
    (seen while it runs), and its console."""

    def __init__(self, out: Path, *args: str) -> None:
        self.out = out
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the suite's (conftest) would override engine.kv_cache_gb
        self.proc = subprocess.Popen([*INFLIGHT, "train", *args, "--set", f"run.out_dir={out}"], cwd=out.parent,
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)  # its own process group: a terminal's Ctrl-C reaches all
        self.children: set[int] = set()
        self.lines: list[tuple[float, str]] = []  # the console, each line with when it came
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def when(self, text: str) -> float:
        """When the first console line holding ``text`` came."""
        return next(t for t, line in self.lines if text in line)

    def _look(self) -> None:
        try:
            self.children |= {c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def engine_pid(self) -> int:
        """Block until the trainer spawned its engine; its pid."""
        pid_file = self.out / "engine0.pid"

        def written() -> bool:
            assert self.proc.poll() is None, self.lines  # the trainer exited first
            return pid_file.exists() and bool(pid_file.read_text().strip())
        wait_until(written, f"the trainer to write its engine's pid to {pid_file}")
        return int(pid_file.read_text())

    def wait_dead(self, pid: int) -> float:
        """Block until process ``pid`` has ended (watching the trainer's children meanwhile); when."""
        def dead() -> bool:
            self._look()
            return _dead(pid)
        wait_until(dead, f"process {pid} to end")
        return time.monotonic()

    def finish(self) -> tuple[int, str, float]:
        """The trainer's exit code, its console, and when it exited; every process it
        started is gone by then."""
        # a whole run (an engine's start, its steps): the bound is renewed at each of its events,
        # a console line or a metrics row, so it fails a hang, never a slow run
        metrics, seen, deadline = self.out / "metrics.jsonl", None, 0.0
        while self.proc.poll() is None:
            self._look()
            now = (len(self.lines), metrics.stat().st_size if metrics.exists() else 0)
            if now != seen:
                seen, deadline = now, time.monotonic() + WAIT_S
            if time.monotonic() > deadline:
                raise AssertionError(f"waited {WAIT_S:.0f} s for the trainer's exit or its next console line or "
                                     f"metrics row: {self.lines[-20:]}")
            time.sleep(0.05)
        ended = time.monotonic()
        self._reader.join(WAIT_S)  # the end of its console: every process that shares it has ended
        console = "\n".join(line for _, line in self.lines)
        assert not self._reader.is_alive(), f"waited {WAIT_S:.0f} s for the end of the trainer's console " \
                                            f"(a process it started holds it): {self.children}\n{console}"
        left = _left_behind(self.children)
        assert not left, f"processes left behind: {left}\n{console}"
        return self.proc.returncode, console, ended


def test_an_engine_that_fails_at_start_stops_the_run_with_its_error(tmp_path) -> None:
    """1. A setting vLLM refuses at start (here a context longer than the model's positions,
    which only vLLM reads from the model): the trainer stops within seconds of the engine's
    exit, its last line naming the engine and vLLM's own error, not a transport timeout."""
    run = Run(tmp_path / "run", "--config", "demo", "--set", "engine.max_model_len=100000",
              "--set", "optim.micro_batch_tokens=100000")
    engine = run.engine_pid()
    cause = run.wait_dead(engine)
    code, console, ended = run.finish()
    assert code == 1, console
    last = console.strip().splitlines()[-1]
    assert last.startswith(f"inflight train: error: engine 0 (process {engine}) exited with code 1"), console
    assert "max_model_len" in last and "before joining its weight group" in last, last
    assert "TransportTimeout" not in console and "Traceback (most recent call last)" not in console.split(
        "exited with code 1; the last lines of")[0], console  # the trainer's own output has no traceback
    assert ended - cause < ERROR_WITHIN_S, (ended - cause, console)


def test_a_malformed_dataset_line_stops_the_run_before_any_engine_starts(tmp_path) -> None:
    """2. A dataset with a bad line: the trainer reads the task before it starts an engine, and
    says where the line is, in one line, within seconds."""
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n{"prompt": "3+3=", \n')
    run = Run(tmp_path / "run", "--config", "demo", "--set", "task.name=jsonl", "--set", f"task.jsonl.path={data}")
    started = time.monotonic()
    code, console, ended = run.finish()
    assert code == 1, console
    assert console.strip().splitlines()[-1].startswith(
        f"inflight train: error: task 'jsonl': {data}:3: not valid JSON"), console
    assert "Traceback" not in console and not (tmp_path / "run" / "engine0.pid").exists(), console  # no engine started
    assert ended - started < ERROR_WITHIN_S + 15, ended - started  # the trainer's own start-up (imports) and the cause


def test_a_task_module_and_dataset_next_to_the_config_are_found_from_anywhere(tmp_path) -> None:
    """7. ``task.name = "my_task:make"`` and a relative ``task.jsonl``-style path in a config file
    resolve next to the file, wherever the run starts (here: from another directory): the
    trainer and the engine both import the module."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "words.txt").write_text("alpha\nbeta\ngamma\n")
    (project / "my_task.py").write_text(
        "import random\n"
        "from pathlib import Path\n"
        "from inflight.trainer.tasks import Prompt, Task\n\n"
        "class Words(Task):\n"
        "    def __init__(self, path):\n"
        "        self.words = Path(path).read_text().split()\n"
        "    def sample(self, rng):\n"
        "        return Prompt('Say ' + rng.choice(self.words))\n"
        "    def score(self, prompts, completions):\n"
        "        return [float(len(c.text) % 2) for c in completions]\n"
        "    def eval_prompts(self, n):\n"
        "        return [Prompt('Say ' + w) for w in self.words[:n]]\n\n"
        "def make(tokenizer, words):\n"
        "    return Words(Path(__file__).with_name(words))\n")
    (project / "run.toml").write_text(
        '[run]\nsteps = 2\n[model.tiny]\nhidden_size = 64\nnum_heads = 2\nnum_kv_heads = 1\nintermediate_size = 128\n'
        '[task]\nname = "my_task:make"\ncompletion_tokens = 8\n[task.options]\nwords = "words.txt"\n'
        '[rollout]\ngroup_size = 2\ngroups_per_step = 2\nin_flight_groups = 2\n')
    run = Run(elsewhere / "run", "--config", str(project / "run.toml"))
    code, console, _ = run.finish()
    assert code == 0, console
    rows = [json.loads(line) for line in (elsewhere / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2], rows


BAD_REWARDS = """
import math
import os
import time
from pathlib import Path
from inflight.trainer.envs import RepeatDigit

class BadReward(RepeatDigit):
    def __init__(self, tokenizer, kind):
        super().__init__(tokenizer, 16, 0.1)
        self.kind = kind
    def score(self, prompts, completions):
        # when each call ran (CLOCK_MONOTONIC is one clock for every process on the machine)
        with open(Path(__file__).with_name("scored.txt"), "a") as calls:
            calls.write(f"{time.monotonic()}\\n")
        if self.kind == "raise":
            raise KeyError("the verifier cannot parse this")
        return [math.nan] * len(completions)

def make(tokenizer, kind):
    return BadReward(tokenizer, kind)
"""


@pytest.mark.parametrize("kind, error", [("nan", "returned reward [0] is nan: NaN and inf are not rewards"),
                                         ("raise", "raised KeyError")])
def test_a_reward_that_raises_or_is_not_finite_is_reported_then_stops_the_run(tmp_path, kind: str, error: str) -> None:
    """3, 4. A reward function that returns NaN, or raises: its first failure is on the trainer's
    console within seconds of the call, naming the task and the group; the engine is never
    restarted; when every group keeps failing (``task.scoring.max_failed_in_a_row``), the run
    stops with that message within seconds of the last failing call. The calls' times are
    the task's own (``scored.txt``)."""
    (tmp_path / "bad_reward.py").write_text(BAD_REWARDS)
    run = Run(tmp_path / "run", "--config", "demo", "--set", "task.name=bad_reward:make", "--set",
              f"task.options.kind={kind}", "--set", "task.scoring.max_failed_in_a_row=8")
    code, console, ended = run.finish()
    assert code == 1, console
    first = run.when("inflight: engine e0: task bad_reward:make failed to score group")
    assert error in next(line for _, line in run.lines if "failed to score group" in line), console
    last = console.strip().splitlines()[-1]
    assert last.startswith("inflight train: error: engine e0: task bad_reward:make: scoring failed for 8 groups in a "
                           "row (task.scoring.max_failed_in_a_row); the last, group "), last
    assert error in last and "restart" not in console and "TimeoutError" not in console, console
    calls = [float(t) for t in (tmp_path / "scored.txt").read_text().split()]
    assert len(calls) >= 8, calls  # a group may be scored after the eighth, before the run stops
    assert 0 < first - calls[0] < ERROR_WITHIN_S, (first - calls[0], console)
    assert 0 < ended - calls[7] < ERROR_WITHIN_S, (ended - calls[7], console)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_ctrl_c_saves_a_checkpoint_the_plot_and_the_summary_and_resume_goes_on(tmp_path) -> None:
    """6. Ctrl-C (SIGINT to the run's process group, as a terminal sends it) mid-run: the step
    in progress finishes, then the checkpoint, plot and summary are written, no traceback, no
    process left; ``run.resume=true`` goes on from there without truncating the metrics; and
    resuming a finished run, or resuming with nothing to resume over a run's metrics, is refused
    before any engine starts, the metrics untouched."""
    out = tmp_path / "run"
    run = Run(out, "--config", "demo")

    def three_rows() -> bool:
        assert run.proc.poll() is None, run.lines  # the run ended first
        return len(_rows(out)) >= 3
    wait_until(three_rows, f"3 rows in {out / 'metrics.jsonl'}")
    sent = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)
    code, console, ended = run.finish()
    assert code == 130 and "Traceback" not in console, console
    done = len(_rows(out))
    assert console.strip().splitlines()[-1] == (f"inflight train: stopped by Ctrl-C after step {done} of 200; go on "
                                                "with --set run.resume=true"), console
    assert json.loads((out / "checkpoint" / "state.json").read_text())["step"] == done
    assert (out / "training.png").exists() and json.loads((out / "summary.json").read_text())["steps"] == done
    assert ended - sent < ERROR_WITHIN_S, [f"{t - sent:.1f} {line[-120:]}" for t, line in run.lines[-12:]]
    before = (out / "metrics.jsonl").read_text()

    code, console, _ = Run(out, "--config", "demo", "--set", "run.resume=true", "--set",
                           f"run.steps={done + 2}").finish()
    assert code == 0, console
    assert (out / "metrics.jsonl").read_text().startswith(before) and [r["step"] for r in _rows(out)] == \
        list(range(1, done + 3))
    # the ledger goes on across the resume, as one uninterrupted run's would: groups trained
    # count every group of every row, the engine's totals never go back, the queue's reads
    # cover every group admitted, in both runs (a new run's queue starts at 0: without the
    # checkpoint's totals, reads would fall short of the buffer's admitted count)
    rows, summary = _rows(out), json.loads((out / "summary.json").read_text())
    trained = [r["rollout_groups_trained"] for r in rows]
    assert trained == [sum(len(r["group_ids"]) for r in rows[:i + 1]) for i in range(len(rows))], trained
    scored = [r["rollout_groups_scored"] for r in rows]
    assert scored == sorted(scored) and scored[-1] >= trained[-1], scored
    assert summary["rollout"]["groups_trained"] == trained[-1] and summary["rollout"]["groups_scored"] == scored[-1]
    queue = summary["queue"]
    assert queue["put"] >= queue["read"] >= queue["admitted"] >= trained[-1], queue  # stale ones were admitted
    code, console, _ = Run(out, "--config", "demo", "--set", "run.resume=true", "--set",
                           f"run.steps={done + 2}").finish()
    assert code == 1 and console.strip().splitlines()[-1].endswith(
        f"is at step {done + 2}, and run.steps={done + 2}: nothing left to train (raise run.steps to go on)"), console

    (out / "checkpoint").rename(tmp_path / "moved")  # metrics, and no checkpoint to go on from
    kept = (out / "metrics.jsonl").read_text()
    code, console, _ = Run(out, "--config", "demo", "--set", "run.resume=true").finish()
    assert code == 1 and f"no checkpoint in {out / 'checkpoint'} to resume from" in console, console
    assert (out / "metrics.jsonl").read_text() == kept and "engine0.pid" not in console


def test_a_batch_with_nothing_to_learn_is_named(tmp_path) -> None:
    """9. Every sample scores the same (here 0: a task whose reward this policy never earns):
    the first such step says so on the console, naming the rewards and where the samples are,
    and samples.jsonl holds every sample trained on with its completion."""
    (tmp_path / "zero_reward.py").write_text(
        "from inflight.trainer.envs import RepeatDigit\n\n"
        "class Zero(RepeatDigit):\n"
        "    def score(self, prompts, completions):\n"
        "        return [0.0] * len(completions)\n\n"
        "def make(tokenizer):\n"
        "    return Zero(tokenizer, 16, 0.0)\n")
    out = tmp_path / "run"
    code, console, _ = Run(out, "--config", "demo", "--set", "task.name=zero_reward:make", "--set",
                           "run.steps=2").finish()
    assert code == 0, console
    assert ("step 1: every group's samples scored alike (rewards [0.0]): no learning signal in this batch (what the "
            "policy samples, and its rewards: samples.jsonl)") in console, console
    assert all(r["groups_without_signal"] == 8 for r in _rows(out))
    logged = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(logged) == 16 and all(s["completion"] and s["reward"] == 0.0 for g in logged for s in g["samples"])
