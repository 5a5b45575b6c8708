"""Where a benchmark's threads run on this machine: ``shared`` or ``split`` cores.

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
that work's CPU time. ``engine_env`` must run on the thread that will run the engine, before
the engine starts; a trainer process is pinned with ``pin_trainer`` right after it starts
(the threads and children it starts later inherit its core).
"""

from __future__ import annotations

import os
from typing import Literal

from inflight.bench.e2e import ENGINE_CORE, TRAINER_CORE

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
