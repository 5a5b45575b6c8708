"""Where a benchmark's threads run on this machine: ``shared`` or ``split`` cores (``--placement``).

- ``shared``: the OS places the engine, its listener thread and the trainer process on any
  core. Every CPU cycle the trainer and the listener spend comes out of decode's.
- ``split`` (what a GPU fleet has, emulated): the in-process engine on ``ENGINE_CORE``, one
  compute thread; the trainer process and the engine's listener thread
  (``InflightConfig.listener_cpus``) on ``TRAINER_CORE``. The trainer's work and the
  listener's CPU then cost decode nothing; what is left is what a GPU engine pays too: the
  GIL the listener shares with the engine thread, and the commit.

In ``shared``, an in-process engine runs torch's OpenMP pool, a thread per core, and OpenMP
threads wait for each other at every parallel region: any other work on either core (the
trainer's, the listener's) stalls the whole team while it runs, so decode loses more than
that work's CPU time.

Two ways in, one placement:
- an engine in this process (``inflight.bench.inflight``, ``inflight_lora``, ``grpo``,
  ``scoring``): ``engine_env`` runs on the thread that will run the engine, before the engine
  starts; a trainer process is pinned with ``pin_trainer`` right after it starts (the threads
  and children it starts later inherit its core);
- engines in processes this one spawns, the trainer here (``inflight.trainer.train``, as
  ``inflight.bench.e2e`` runs it): ``pinned_processes`` keeps this process on ``TRAINER_CORE``
  and every process it starts on ``ENGINE_CORE``, one compute thread each.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Literal

TRAINER_CORE, ENGINE_CORE = 0, 1
Placement = Literal["shared", "split"]
PLACEMENTS: tuple[Placement, ...] = ("split", "shared")


def engine_env(placement: Placement) -> tuple[int, ...]:
    """Set up the environment for an in-process engine of ``placement``; returns the
    listener's CPUs (``InflightConfig.listener_cpus``: () keeps the engine thread's)."""
    if placement == "shared":
        return ()
    if not {TRAINER_CORE, ENGINE_CORE} <= set(range(os.cpu_count() or 1)):
        raise RuntimeError(f"placement 'split' needs CPUs {TRAINER_CORE} and {ENGINE_CORE}")
    import torch

    # vLLM binds the OpenMP threads of the worker processes it spawns (VLLM_CPU_OMP_THREADS_BIND);
    # an in-process engine runs on the calling thread with torch's own pool: one thread, here
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {ENGINE_CORE})  # this thread, and every thread it starts from now on
    return (TRAINER_CORE,)


def pin_trainer(pid: int, placement: Placement) -> None:
    """Pin a freshly started trainer process to the trainer's core (``split``)."""
    if placement == "split":
        os.sched_setaffinity(pid, {TRAINER_CORE})


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def _pin(pid: int, core: int) -> None:
    for tid in _threads(pid):
        with contextlib.suppress(OSError):  # a thread that just exited
            if os.sched_getaffinity(tid) != {core}:
                os.sched_setaffinity(tid, {core})


@contextlib.contextmanager
def pinned_processes(placement: Placement) -> Iterator[None]:
    """``split``: this process (the trainer) on ``TRAINER_CORE`` and the processes it starts
    (its engines) on ``ENGINE_CORE``, one compute thread each (the trainer's torch threads, the
    engines' ``VLLM_CPU_OMP_THREADS_BIND``); a pinning thread keeps every thread there, the
    listener's and any started later included. ``shared``: nothing."""
    if placement == "shared":
        yield
        return
    import psutil
    import torch

    if len(os.sched_getaffinity(0)) < 2:
        raise RuntimeError("placement 'split' needs 2 cores")
    saved_env = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    saved_threads = torch.get_num_threads()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(ENGINE_CORE)  # the engine's one compute thread
    torch.set_num_threads(1)
    stop = threading.Event()
    me = os.getpid()

    def keep_pinned() -> None:
        while not stop.is_set():
            _pin(me, TRAINER_CORE)
            for child in psutil.Process(me).children(recursive=True):
                _pin(child.pid, ENGINE_CORE)
            stop.wait(0.5)

    _pin(me, TRAINER_CORE)
    pinner = threading.Thread(target=keep_pinned, name="pin-cores", daemon=True)
    pinner.start()
    try:
        yield
    finally:
        stop.set()
        pinner.join()
        everything = set(range(os.cpu_count() or 1))
        for tid in _threads(me):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, everything)
        torch.set_num_threads(saved_threads)
        if saved_env is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved_env
