"""``inflight train``'s supervisor: the trainer runs in a child process, and a death by signal is named.

A one-process run is a thin parent (it imports no torch) and the trainer, its child: ``python -m
inflight.trainer.train`` with the same arguments, marked by ``CHILD_ENV`` (the file it writes its
run's facts to: ``write_facts``). The parent looks at the child's memory every ``LOOK_EVERY_S``
(``MemoryWatch``); when the child dies by a signal it prints one line: for a SIGKILL, whether the
kernel's out-of-memory killer did it, what to lower and where to resume (``death_line``).

Invariants:
- the parent ignores Ctrl-C (the terminal's SIGINT reaches the child through the process group
  and the child acts on it), passes SIGTERM and SIGHUP on, and exits with the child's code
  (128 + N after a death by signal N); the child dies with it (``PR_SET_PDEATHSIG``);
- a child, a rank of ``--nproc`` or ``torchrun``, or a run with ``--nproc`` > 1 (whose elastic
  agent is the parent: ``launch_ranks``) is not supervised again;
- the parent is the subreaper of the trainer's processes: an engine the dead trainer left behind
  ends (by itself, else killed after ``ORPHANS_WAIT_S``) before the parent exits.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from inflight.trainer.memory_watch import LOOK_EVERY_S, Death, MemoryWatch, children, killed_by_oom, not_by_oom

CHILD_ENV = "INFLIGHT_SUPERVISED"
"""In the trainer child's environment: the file it writes its run's facts to (``write_facts``)."""
ORPHANS_WAIT_S = 30.0
"""How long the parent waits for the processes the trainer left (its engines, after a kill) to end."""
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36


def supervising(argv: list[str]) -> bool:
    """Whether this ``inflight train`` process should be the thin parent of a trainer child: not
    a child already, not a rank (``torchrun``, ``launch_ranks``), not ``--nproc`` > 1, on Linux."""
    if CHILD_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ or not sys.platform.startswith("linux"):
        return False
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        return False
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--nproc", default="1")
    try:
        return int(ap.parse_known_args(argv)[0].nproc) <= 1
    except (ValueError, SystemExit):  # a bad --nproc: the trainer's parser says so
        return True


def supervise(argv: list[str], prog: str) -> int:
    """Run the trainer as a child with ``argv`` and wait for it; its exit code (a death by a
    signal is named in one line on stderr first). This process's signal handlers and
    subreaper role are as they were on return."""
    fd, facts = tempfile.mkstemp(prefix="inflight-train-", suffix=".json")
    os.close(fd)
    prctl, others = _prctl(), set(children(os.getpid()))
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGINT, lambda *_: None)  # not SIG_IGN, which the child would inherit
    prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        child = subprocess.Popen([sys.executable, "-m", "inflight.trainer.train", *argv],
                                 env={**os.environ, CHILD_ENV: facts, "INFLIGHT_PROG": prog},
                                 preexec_fn=lambda: prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0))
        passed = _pass_on(child, (signal.SIGTERM, signal.SIGHUP))
        watch = MemoryWatch(child.pid)
        code = _wait(child, watch)
        _reap_orphans(others | {child.pid}, ORPHANS_WAIT_S)
        if code < 0 and -code not in passed | {signal.SIGINT}:  # a Ctrl-C that ended it was the user's own
            # on a line of its own: the child died mid-line (its progress bar)
            print(f"\n{death_line(prog, child.pid, -code, watch, _read_facts(facts))}", file=sys.stderr, flush=True)
        return 128 - code if code < 0 else code
    finally:
        prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for s, handler in saved.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        Path(facts).unlink(missing_ok=True)


def _prctl() -> Any:
    """libc's ``prctl``, looked up before any fork (a child between fork and exec must not load
    a library); a no-op where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux's libc: the parent only loses the niceties
        return lambda *_: -1


def _pass_on(child: subprocess.Popen, signals: tuple[signal.Signals, ...]) -> set[int]:
    """Pass each of ``signals`` that reaches this process on to ``child``; the set of those passed."""
    passed: set[int] = set()

    def forward(signum: int, _frame: Any) -> None:
        passed.add(signum)
        child.send_signal(signum)
    for s in signals:
        signal.signal(s, forward)
    return passed


def _wait(child: subprocess.Popen, watch: MemoryWatch) -> int:
    """Look at ``child``'s memory every ``LOOK_EVERY_S`` until it exits; its return code."""
    while True:
        watch.look()
        try:
            return child.wait(timeout=LOOK_EVERY_S)
        except subprocess.TimeoutExpired:
            continue


def _reap_orphans(known: set[int], wait_s: float) -> None:
    """Wait up to ``wait_s`` for the processes re-parented here (the subreaper's: children not in
    ``known``) to end, reaping each; then kill those left."""
    deadline, killed = time.monotonic() + wait_s, False
    while orphans := [pid for pid in children(os.getpid()) if pid not in known]:
        for pid in orphans:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        if time.monotonic() > deadline:
            if killed:
                return
            for pid in orphans:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            killed, deadline = True, time.monotonic() + 10.0
        time.sleep(0.05)


def death_line(prog: str, pid: int, signum: int, watch: MemoryWatch, facts: dict) -> str:
    """The one line naming why the trainer (process ``pid``) died by signal ``signum``."""
    resume = resume_hint(facts)
    if signum != signal.SIGKILL:
        return f"{prog}: error: the trainer (process {pid}) was stopped by {_name(signum)}; {resume}"
    death = watch.death()
    if not death.oom:
        return f"{prog}: error: the trainer (process {pid}) was killed ({not_by_oom(death)}); {resume}"
    lower = facts.get("memory_hint") or "give it more memory"
    return f"{prog}: error: the trainer {killed_by_oom(death)}: {lower}; {resume}"


def rank_killed(prog: str, rank: int, n: int, death: Death, facts: dict) -> str:
    """``launch_ranks``' line for trainer rank ``rank`` of ``n``, killed by SIGKILL (``death``), in
    the run of ``facts`` (``run_facts``)."""
    resume = resume_hint(facts)
    if not death.oom:
        return (f"{prog}: error: trainer rank {rank} of {n} failed first (signal SIGKILL), not killed by the kernel's "
                f"out-of-memory killer ({death.evidence}); the others were stopped; {resume}")
    return (f"{prog}: error: trainer rank {rank} of {n} {killed_by_oom(death)}: "
            f"{facts.get('memory_hint') or 'give it more memory'}; the others were stopped; {resume}")


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def resume_hint(facts: dict) -> str:
    """Where a killed run goes on from: its last checkpoint's step (``state.json``), or none yet."""
    out = facts.get("out_dir")
    step = last_checkpoint(Path(out)) if out else None
    if step is not None:
        return f"resume with --set run.resume=true (last checkpoint: step {step})"
    every = facts.get("checkpoint_every")
    return (f"no checkpoint to resume from yet (run.checkpoint_every={every}): run it again" if out
            else "no checkpoint to resume from: run it again")


def last_checkpoint(out_dir: Path) -> int | None:
    """The step of the checkpoint in ``out_dir`` (``checkpoint/``, or the ``checkpoint.old`` a crash
    mid-swap leaves, which a resume moves back: ``inflight.trainer.checkpoint.recover``)."""
    for name in ("checkpoint", "checkpoint.old"):
        try:
            return int(json.loads((out_dir / name / "state.json").read_text())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def memory_hint(cfg: Any) -> str:
    """What lowers the trainer's memory in run ``cfg`` (a ``TrainConfig``), its values named."""
    optim = cfg.optim
    if hasattr(optim, "micro_batch_tokens"):
        lower = f"lower optim.micro_batch_tokens (now {optim.micro_batch_tokens})"
    else:  # the setting before micro_batch_tokens: more micro-batches, less memory
        lower = f"raise optim.micro_batches (now {optim.micro_batches})"
    if cfg.engine.spawn and cfg.engine.launcher == "process":
        lower += f" or run fewer engines on this machine (engine.count={cfg.engine.count})"
    return lower


def run_facts(cfg: Any) -> dict:
    """What a line about the death of run ``cfg``'s trainer names: its run directory (for the
    last checkpoint), ``run.checkpoint_every`` and what lowers its memory."""
    return {"out_dir": str(Path(cfg.run.out_dir).absolute()), "checkpoint_every": cfg.run.checkpoint_every,
            "memory_hint": memory_hint(cfg)}


def write_facts(cfg: Any) -> None:
    """In a supervised trainer (``CHILD_ENV``): its ``run_facts`` into the parent's file, and
    ``trainer.pid`` in the run directory."""
    path = os.environ.get(CHILD_ENV)
    if not path:
        return
    facts = run_facts(cfg)
    Path(path).write_text(json.dumps(facts))
    Path(facts["out_dir"]).mkdir(parents=True, exist_ok=True)
    (Path(facts["out_dir"]) / "trainer.pid").write_text(str(os.getpid()))


def _read_facts(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
