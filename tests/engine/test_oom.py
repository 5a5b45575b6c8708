"""A process of the run killed by the kernel's out-of-memory killer is named in one line.

Each test runs ``inflight train`` as a user would (``tests.engine.test_first_hour.Run``), moves
one of its processes into a fresh memory cgroup (v1 or v2, under this test's own) whose limit
is a little above what that process has charged there since the move, and lets the run's own
next allocations pass it: the kernel's OOM killer kills the process, as it would at a machine's
limit. The tests follow the run by its events (a checkpoint written, a console line, the run's
exit), never by a clock. ``MALLOC_MMAP_THRESHOLD_`` (glibc's own tunable, in the run's
environment) maps every large allocation afresh, so each step charges the new cgroup anew
instead of reusing heap pages charged before the move.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest

from tests.engine.test_first_hour import Run
from tests.helpers import metrics_rows, wait_until

SMALL = ["rollout.group_size=4", "rollout.groups_per_step=2", "rollout.in_flight_groups=4", "rollout.queue_capacity=4",
         "task.completion_tokens=16"]
HEADROOM = 256 << 10
"""What the moved process may charge its new cgroup above what it charged there at the move: less
than any step allocates afresh (a training step's gradients alone, freed and allocated anew each
step, are megabytes)."""


class MemoryCgroup:
    """A fresh memory cgroup beside this test process (a child of its own), v1 or v2: ``limit``,
    ``add`` a process, ``oom_kills``; removed by ``close`` (its processes moved back first)."""

    def __init__(self, name: str) -> None:
        from inflight.trainer.memory_watch import cgroup_of

        own = cgroup_of(os.getpid())
        if own is None:
            pytest.skip("no memory cgroup here (neither cgroup v1's memory controller nor cgroup v2 is mounted)")
        self.version, self.home = own.version, own.path
        self.path = self._create(own, name)

    def _create(self, own, name: str) -> Path:
        """The new cgroup's directory: under this process's own, or (v2, whose own cgroup holds
        processes and so cannot give its children the memory controller) under the hierarchy's root."""
        tried = []
        for parent in ([own.path] if own.version == 1 else [own.path, own.top]):
            path = parent / name
            try:
                path.mkdir(exist_ok=True)
                if own.version == 2 and not (path / "memory.max").exists():
                    (parent / "cgroup.subtree_control").write_text("+memory")
                if (path / ("memory.limit_in_bytes" if own.version == 1 else "memory.max")).exists():
                    return path
            except OSError as e:
                tried.append(f"{path}: {e}")
            self._remove(path)
        pytest.skip(f"cannot create a memory cgroup (cgroup v{own.version}): {'; '.join(tried) or 'no memory files'}")

    def usage(self) -> int:
        return int((self.path / ("memory.usage_in_bytes" if self.version == 1 else "memory.current")).read_text())

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def limit(self, nbytes: int) -> None:
        (self.path / ("memory.limit_in_bytes" if self.version == 1 else "memory.max")).write_text(str(nbytes))

    def oom_kills(self) -> int:
        text = (self.path / ("memory.oom_control" if self.version == 1 else "memory.events")).read_text()
        return int(re.search(r"^oom_kill (\d+)$", text, re.M).group(1))

    def close(self) -> None:
        for pid in (self.path / "cgroup.procs").read_text().split():  # a test that failed before the kill
            try:
                (self.home / "cgroup.procs").write_text(pid)
            except OSError:
                pass
        self._remove(self.path)

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.rmdir()
        except OSError:
            pass


def _squeeze(cgroup: MemoryCgroup, pid: int) -> None:
    """Move process ``pid`` into ``cgroup`` and limit it to what it charged there so far plus
    ``HEADROOM``. A v1 limit below the usage is refused (EBUSY) where v2 kills: one that the
    process outgrew between the read and the write is asked again, with the new usage."""
    cgroup.add(pid)
    for _ in range(100):
        try:
            return cgroup.limit(cgroup.usage() + HEADROOM)
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
    raise AssertionError(f"process {pid} outgrew every limit written to {cgroup.path}")


def _checkpoint_step(out: Path) -> int | None:
    try:
        return json.loads((out / "checkpoint" / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None


LIMIT = r"resident(?:, limit| of this machine's) [\d.]+ [GM]iB"
"""The limit a line names: the new cgroup's, or the machine's when the OOM killer came before
the watcher's next look (it saw the process's old cgroup; the kernel's counter said who killed it)."""
OOM_LINE = re.compile(
    r"inflight train: error: the trainer was killed by the kernel's out-of-memory killer \(SIGKILL at [\d.]+ [GM]iB "
    rf"{LIMIT}\): (?:lower optim\.micro_batch_tokens|raise optim\.micro_batches) \(now \d+\) or "
    r"run fewer engines on this machine \(engine\.count=1\); resume with --set run\.resume=true \(last checkpoint: "
    r"step (\d+)\)")


def test_a_trainer_killed_by_the_oom_killer_is_named_in_one_line_and_resumes(tmp_path, monkeypatch) -> None:
    """The trainer (the CLI's child) is squeezed once its first checkpoint is on disk: the CLI
    exits non-zero with one line naming the OOM killer, the resident memory and limit, the
    setting to lower and the last checkpoint's step; ``run.resume=true`` goes on from that step
    to the last."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    out, steps = tmp_path / "run", 40
    sets = [a for s in (*SMALL, f"run.steps={steps}", "run.checkpoint_every=3") for a in ("--set", s)]
    cgroup = MemoryCgroup(f"inflight-oom-trainer-{os.getpid()}")
    try:
        run = Run(out, "--config", "demo", *sets)

        def checkpointed() -> bool:
            assert run.proc.poll() is None, run.lines  # the run ended first
            return _checkpoint_step(out) is not None
        wait_until(checkpointed, f"the first checkpoint in {out / 'checkpoint'}")
        trainer = int((out / "trainer.pid").read_text())
        _squeeze(cgroup, trainer)
        code, console, _ = run.finish()
        assert cgroup.oom_kills() >= 1, console
    finally:
        cgroup.close()
    assert code == 128 + 9, console
    named = [line for line in console.splitlines() if "out-of-memory" in line]
    assert len(named) == 1 and OOM_LINE.fullmatch(named[0]) and console.strip().splitlines()[-1] == named[0], console
    step = int(OOM_LINE.fullmatch(named[0]).group(1))
    assert step == _checkpoint_step(out) and 3 <= step < steps, (step, console)
    crashed = metrics_rows(out)
    assert "Traceback" not in console and len(crashed) >= step, console

    code, console, _ = Run(out, "--config", "demo", *sets, "--set", "run.resume=true").finish()
    assert code == 0, console
    rows = metrics_rows(out)  # the rows after the checkpoint's step were dropped, and taken again
    assert rows[:step] == crashed[:step] and [r["step"] for r in rows] == list(range(1, steps + 1)), \
        [r["step"] for r in rows]
    assert _checkpoint_step(out) == steps


def test_an_engine_killed_by_the_oom_killer_is_named_in_one_line_and_restarted(tmp_path, monkeypatch) -> None:
    """The engine process is squeezed once the run has trained a step: the trainer's console
    names it in one line (the OOM killer, its resident memory and limit, the settings to
    lower), with no log tail after it; the recovery's event names it too, the engine is
    restarted and the run reaches its last step."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    out, steps = tmp_path / "run", 30
    cgroup = MemoryCgroup(f"inflight-oom-engine-{os.getpid()}")
    try:
        # the push in flight at the kill fails after transport.reply_timeout_s (its wait), as any engine's death
        sets = (*SMALL, f"run.steps={steps}", *(f"transport.{t}_timeout_s=15.0" for t in ("reply", "collective",
                                                                                           "stale")))
        run = Run(out, "--config", "demo", *[a for s in sets for a in ("--set", s)])
        engine = run.engine_pid()

        def stepped() -> bool:
            assert run.proc.poll() is None, run.lines
            return len(metrics_rows(out)) >= 1
        wait_until(stepped, f"a row in {out / 'metrics.jsonl'}")
        _squeeze(cgroup, engine)
        said = f"inflight: engine 0 (process {engine}) was killed by the kernel's out-of-memory killer (SIGKILL at "
        wait_until(lambda: any(line.startswith(said) for _, line in run.lines) or run.proc.poll() is not None,
                   f"the console's line naming engine 0's death by the OOM killer: {said}")
        code, console, _ = run.finish()
        assert cgroup.oom_kills() >= 1, console
    finally:
        cgroup.close()
    assert code == 0, console
    lines = console.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.startswith(said)]
    assert re.fullmatch(rf".*{LIMIT}\): lower engine\.kv_cache_gb \(now 1\) or run fewer engines "
                        r"on this machine \(engine\.count=1\)", lines[at]), lines[at]
    assert "the last lines of" not in lines[at] and not lines[at + 1].startswith(" "), lines[at:at + 3]
    summary = json.loads((out / "summary.json").read_text())
    (event,) = [e for e in summary["engine_events"] if e.get("restarted")]
    assert event["restarted"] == [0] and any(e.startswith(said[len("inflight: "):]) for e in event["exits"]), event
    assert [r["step"] for r in metrics_rows(out)] == list(range(1, steps + 1))


def test_a_rank_killed_by_the_oom_killer_is_named_by_the_launcher(tmp_path, monkeypatch) -> None:
    """``--nproc 2``: trainer rank 1 squeezed once a checkpoint is on disk; the elastic agent's
    line names the rank, the OOM killer and the last checkpoint, and the run stops."""
    from tests.engine.test_trainer_ranks import _rank_pid

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    out = tmp_path / "run"
    sets = [a for s in (*SMALL, "run.steps=200", "run.checkpoint_every=2") for a in ("--set", s)]
    cgroup = MemoryCgroup(f"inflight-oom-rank-{os.getpid()}")
    try:
        run = Run(out, "--config", "demo", "--nproc", "2", *sets)

        def checkpointed() -> bool:
            assert run.proc.poll() is None, run.lines
            return _checkpoint_step(out) is not None
        wait_until(checkpointed, f"the first checkpoint in {out / 'checkpoint'}")
        rank1 = _rank_pid(run.proc.pid, 1)
        assert rank1, "no trainer rank 1 under the launcher"
        _squeeze(cgroup, rank1)
        code, console, _ = run.finish()
        assert cgroup.oom_kills() >= 1, console
    finally:
        cgroup.close()
    assert code != 0, console
    (line,) = [line for line in console.splitlines() if "out-of-memory" in line]
    assert re.fullmatch(r"inflight train: error: trainer rank 1 of 2 was killed by the kernel's out-of-memory killer "
                        rf"\(SIGKILL at [\d.]+ [GM]iB {LIMIT}\): .* or run fewer engines on this machine "
                        r"\(engine\.count=1\); the others were stopped; resume with --set run\.resume=true \(last "
                        rf"checkpoint: step {_checkpoint_step(out)}\)", line), line
