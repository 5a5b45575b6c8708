"""The OOM diagnosis on counter readings (``inflight.trainer.memory_watch.diagnose``), the cgroup
files it reads (v1 and v2 layouts, written here), and the supervisor's lines built from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inflight.trainer.memory_watch import (
    Cgroup,
    Counters,
    GiB,
    Look,
    MemoryWatch,
    counters,
    diagnose,
    killed_by_oom,
    limit_of,
    not_by_oom,
    resident,
)
from inflight.trainer.supervisor import death_line, last_checkpoint, memory_hint, resume_hint, supervising

ROOT = Path(__file__).resolve().parents[2]
MACHINE = 24 * (1 << 30)


def _look(resident_gib: float, limit_gib: float | None, cgroup: int | None, kernel: int | None) -> Look:
    limit = None if limit_gib is None else int(limit_gib * GiB)
    return Look(resident=int(resident_gib * GiB), cgroup=None, limit=limit,
                counters=Counters(cgroup=cgroup, kernel=kernel))


def test_a_cgroup_counter_that_rose_since_the_last_look_is_the_oom_killer() -> None:
    death = diagnose(_look(12.6, 13.0, cgroup=2, kernel=7), Counters(cgroup=3, kernel=8), MACHINE)
    assert death.oom and death.evidence == "cgroup" and not death.of_machine
    assert killed_by_oom(death) == ("was killed by the kernel's out-of-memory killer (SIGKILL at 12.6 GiB resident, "
                                    "limit 13.0 GiB)")


def test_the_kernels_counter_speaks_where_the_cgroup_counter_did_not_move_or_cannot_be_read() -> None:
    """The process moved to another cgroup after the last look (its old one's counter stays),
    or no cgroup counter is readable: the kernel's /proc/vmstat count of OOM kills rose."""
    for before, after in ((Counters(cgroup=0, kernel=4), Counters(cgroup=0, kernel=5)),
                          (Counters(cgroup=None, kernel=4), Counters(cgroup=None, kernel=5))):
        death = diagnose(Look(resident=int(0.45 * GiB), cgroup=None, limit=None, counters=before), after, MACHINE)
        assert death.oom and death.evidence == "kernel" and death.of_machine and death.limit == MACHINE
        assert killed_by_oom(death) == ("was killed by the kernel's out-of-memory killer (SIGKILL at 461 MiB resident "
                                        "of this machine's 24.0 GiB)")


def test_counters_that_did_not_move_blame_something_else() -> None:
    """Near its limit or not: a SIGKILL the counters did not count is someone's ``kill -9``."""
    for resident_gib in (0.4, 12.9):
        death = diagnose(_look(resident_gib, 13.0, cgroup=1, kernel=3), Counters(cgroup=1, kernel=3), MACHINE)
        assert not death.oom and not_by_oom(death) == ("SIGKILL, not the kernel's out-of-memory killer: no oom_kill "
                                                       "counter moved")


def test_without_any_counter_resident_memory_near_the_limit_is_most_likely_the_oom_killer() -> None:
    near = diagnose(_look(12.0, 13.0, cgroup=None, kernel=None), Counters(cgroup=None, kernel=None), MACHINE)
    assert near.oom and near.evidence == "resident"
    assert killed_by_oom(near) == ("was most likely killed by the kernel's out-of-memory killer (SIGKILL at 12.0 GiB "
                                   "resident, limit 13.0 GiB; no oom_kill counter to read)")
    far = diagnose(_look(2.0, None, cgroup=None, kernel=None), Counters(cgroup=None, kernel=None), MACHINE)
    assert not far.oom and far.evidence == ("no oom_kill counter to read, and 2.0 GiB resident is far from its "
                                            "24.0 GiB")
    unseen = diagnose(None, Counters(cgroup=5, kernel=5), MACHINE)  # no look alive: no baseline, no blame
    assert not unseen.oom and unseen.evidence == "it died before its first look"


def _v1(tmp_path: Path, oom_kill: int, limit: int) -> Cgroup:
    path = tmp_path / "memory" / "run"
    path.mkdir(parents=True)
    (path / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n")
    (path / "memory.stat").write_text(f"cache 4096\nrss 8192\nhierarchical_memory_limit {limit}\n")
    return Cgroup(path, 1, tmp_path / "memory")


def _v2(tmp_path: Path, oom_kill: int, maxes: list[str]) -> Cgroup:
    """A v2 cgroup two levels under the mount, ``maxes`` its own memory.max then its parent's."""
    path = tmp_path / "unified" / "parent" / "run"
    path.mkdir(parents=True)
    (path / "memory.events").write_text(f"low 0\nhigh 0\nmax 3\noom 1\noom_kill {oom_kill}\noom_group_kill 0\n")
    for where, text in zip((path, path.parent), maxes, strict=True):
        (where / "memory.max").write_text(text + "\n")
    return Cgroup(path, 2, tmp_path / "unified")


def test_the_cgroup_files_are_read_in_both_versions(tmp_path: Path) -> None:
    v1 = _v1(tmp_path, oom_kill=3, limit=13 << 30)
    assert counters(v1).cgroup == 3 and limit_of(v1) == 13 << 30
    assert limit_of(_v1(tmp_path / "free", oom_kill=0, limit=9223372036854771712)) is None  # v1's "no limit"
    v2 = _v2(tmp_path, oom_kill=2, maxes=["max", str(6 << 30)])  # its own has none: its parent's holds
    assert counters(v2).cgroup == 2 and limit_of(v2) == 6 << 30
    assert limit_of(_v2(tmp_path / "own", oom_kill=0, maxes=[str(1 << 30), str(6 << 30)])) == 1 << 30
    assert limit_of(_v2(tmp_path / "none", oom_kill=0, maxes=["max", "max"])) is None
    gone = Cgroup(tmp_path / "gone", 2, tmp_path)
    assert counters(gone).cgroup is None and limit_of(gone) is None
    assert isinstance(counters(None).kernel, (int, type(None)))


def test_a_watch_keeps_looks_of_the_living_and_judges_a_death_once() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    watch = MemoryWatch(child.pid)
    try:
        assert child.stdout.readline() == "up\n"
        assert watch.look() and watch.last is not None and 0 < watch.last.resident <= resident(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not watch.look()  # gone: nothing kept of the look
    death = watch.death()
    assert watch.death() is death and not death.oom  # a kill -9 is not the OOM killer's


def test_the_trainers_line_names_memory_the_setting_and_the_last_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "state.json").write_text(json.dumps({"step": 20, "version": 20}))
    facts = {"out_dir": str(tmp_path), "checkpoint_every": 10,
             "memory_hint": "lower optim.micro_batch_tokens (now 8192) or run fewer engines on this machine "
                            "(engine.count=1)"}

    class Killed(MemoryWatch):
        def death(self):
            return diagnose(_look(12.6, 24.0, cgroup=0, kernel=0), Counters(cgroup=1, kernel=1), MACHINE)

    assert death_line("inflight train", 123, 9, Killed(123), facts) == (
        "inflight train: error: the trainer was killed by the kernel's out-of-memory killer (SIGKILL at 12.6 GiB "
        "resident, limit 24.0 GiB): lower optim.micro_batch_tokens (now 8192) or run fewer engines on this machine "
        "(engine.count=1); resume with --set run.resume=true (last checkpoint: step 20)")
    assert death_line("inflight train", 123, 11, Killed(123), facts) == (
        "inflight train: error: the trainer (process 123) was stopped by SIGSEGV; resume with --set run.resume=true "
        "(last checkpoint: step 20)")
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")  # a crash mid-swap: the resume moves it back
    assert last_checkpoint(tmp_path) == 20
    assert resume_hint({"out_dir": str(tmp_path / "new"), "checkpoint_every": 10}) == (
        "no checkpoint to resume from yet (run.checkpoint_every=10): run it again")


def test_the_memory_hint_names_the_settings_and_their_values() -> None:
    from inflight.trainer.config_files import load_config

    cfg = load_config("fleet_cpu")
    hint = memory_hint(cfg)
    knob = ("micro_batch_tokens", "lower") if hasattr(cfg.optim, "micro_batch_tokens") else ("micro_batches", "raise")
    assert hint == (f"{knob[1]} optim.{knob[0]} (now {getattr(cfg.optim, knob[0])}) or run fewer engines on this "
                    f"machine (engine.count={cfg.engine.count})")


def test_only_a_one_process_run_is_supervised(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("INFLIGHT_SUPERVISED", "TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert supervising(["--config", "demo"]) and supervising(["--config", "demo", "--nproc", "1"])
    assert not supervising(["--config", "demo", "--nproc", "2"]) and not supervising(["--nproc=4"])
    assert supervising(["--nproc", "x"])  # the trainer's own parser refuses it
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank under torchrun or accelerate
    assert not supervising(["--config", "demo"])
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("INFLIGHT_SUPERVISED", os.devnull)  # the child itself
    assert not supervising(["--config", "demo"])


def test_the_supervisor_imports_no_torch() -> None:
    """The thin parent of ``inflight train``: a usage error comes back from its child, the parent
    never imported torch."""
    probe = ("import sys\nfrom inflight.trainer import cli\ntry:\n    cli.main(['train', '--config', 'nope'])\n"
             "except SystemExit as e:\n    print('exit', e.code, 'torch imported:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "exit 2 torch imported: False", out.stdout + out.stderr
    assert "inflight train: error: config 'nope': no packaged config of that name" in out.stderr
