"""Keeping the engine: notice when it is gone, bring it back, resynchronise its weights.

The trainer notices a lost engine in one of two places: a push that fails (the weight
group breaks or a reply does not come within ``transport.timeout_s``), or a wait for
rollouts during which the spawned engine process exited. Either way ``recover`` runs.

Ordering invariants of a recovery:
1. the failure is reported first (log, progress bar, the run's ``engine_failures``);
2. a spawned engine that died is restarted from the model on disk, told to sample only
   once the trainer's current version is live;
3. the trainer forms the group's next generation with every worker (``WeightPusher.rejoin``);
4. it pushes its current weights, above every engine's live version, and only then goes
   back to training.
The rollout queue lives in the trainer's store, so the groups queued before the failure
are still there afterwards: only the groups the dead engine was still decoding are lost.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from inflight.buffer import RolloutQueue
from inflight.transport.pusher import WeightPusher
from trainer.config import TrainConfig
from trainer.rollout import run_engine

log = logging.getLogger("inflight.supervisor")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Which GPUs the trainer and a spawned engine use, and the weight group's data plane."""

    backend: Literal["gloo", "nccl"]
    """Backend of the weight group; both sides must use the same one."""
    engine_devices: str | None
    """``CUDA_VISIBLE_DEVICES`` of a spawned engine; None: it inherits the trainer's."""


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them, in order."""
    import torch

    n = torch.cuda.device_count()
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in named.split(",") if d.strip()] if named else [str(i) for i in range(n)]
    return ids[:n]


def place(backend: Literal["auto", "gloo", "nccl"], *, spawn: bool, gpus: Sequence[str]) -> Placement:
    """Split ``gpus`` between the trainer and the engine it spawns.

    The trainer takes the first GPU and a spawned engine the others. NCCL cannot connect two
    ranks on one GPU, so a trainer and engine sharing the only GPU use gloo (weights cross
    through host memory; the engine still stages them off the decode path). An engine that
    is not spawned runs elsewhere, on GPUs of its own.
    """
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"transport.backend={backend!r} is not auto, gloo or nccl")
    if not gpus:
        if backend == "nccl":
            raise ValueError("transport.backend='nccl' needs CUDA, and no GPU is visible")
        return Placement(backend="gloo", engine_devices=None)
    if spawn and len(gpus) == 1:
        if backend == "nccl":
            raise ValueError("transport.backend='nccl' needs the engine on a GPU of its own, and only one GPU "
                             f"({gpus[0]}) is visible: use 'auto' or 'gloo', or make a second GPU visible")
        return Placement(backend="gloo", engine_devices=None)
    return Placement(backend="nccl" if backend == "auto" else backend,
                     engine_devices=",".join(gpus[1:]) if spawn else None)


class EngineLost(RuntimeError):
    """The engine stopped serving: its process exited, or the weight group failed."""


class EngineSupervisor:
    """The engine process the trainer spawned (or, with ``spawn = false``, nothing to spawn)."""

    def __init__(self, cfg: TrainConfig, model_dir: Path, model_version: int, host: str, port: int,
                 placement: Placement, pid_file: Path) -> None:
        self.cfg = cfg
        self.placement = placement
        self.model_dir = model_dir
        self.model_version = model_version
        """The version of the weights in ``model_dir``, which a (re)started engine serves first."""
        self.host, self.port = host, port
        self.pid_file = pid_file
        self.process: mp.process.BaseProcess | None = None
        self.restarts = 0
        self.failures = 0
        self.events: list[dict] = []
        """One entry per recovery: when it began (unix time), why, and the version it ended on."""

    def start(self, wait_for_version: int) -> None:
        if not self.cfg.engine.spawn:
            return
        self.process = mp.get_context("spawn").Process(
            target=run_engine, name="inflight-engine", daemon=True,
            args=(self.cfg, str(self.model_dir), self.host, self.port, 1, self.model_version, wait_for_version, os.getpid()),
            kwargs={"backend": self.placement.backend, "cuda_devices": self.placement.engine_devices},
        )
        self.process.start()
        self.pid_file.write_text(str(self.process.pid))

    def exit_problem(self) -> str | None:
        """Why the spawned engine is not running, or None (always None without ``spawn``)."""
        if self.process is None or self.process.is_alive():
            return None
        return f"engine process {self.process.pid} exited with code {self.process.exitcode}"

    def recover(self, pusher: WeightPusher, reason: str, version: int, weights, queue: RolloutQueue) -> int:
        """Steps 1-4 above; returns the version now live on every engine (>= ``version``)."""
        self.failures += 1
        event = {"t": time.time(), "reason": reason}
        self.events.append(event)
        tqdm.write(f"inflight: engine lost ({reason}); recovering")
        log.warning("engine lost: %s", reason)
        problem = self.exit_problem()
        if problem is not None:
            if self.restarts >= self.cfg.engine.max_restarts:
                raise EngineLost(f"{problem}; already restarted {self.restarts} times (engine.max_restarts)")
            self.restarts += 1
            self.process.join(timeout=5)
            self.start(wait_for_version=version)
        try:
            live = pusher.rejoin(self.cfg.transport.rejoin_timeout_s)
        except Exception as e:
            raise EngineLost(f"the engine did not rejoin within transport.rejoin_timeout_s="
                             f"{self.cfg.transport.rejoin_timeout_s}: {e}") from e
        if problem is not None:  # the restarted engine samples only after the push below: no producer is live
            queue.fill_holes()
        if live and all(v == version for v in live.values()):
            pass  # the failed push had committed: every engine already serves these weights
        else:
            ahead = max(live.values(), default=-1)
            if ahead > version:  # a version an engine got from a trainer state that is gone (a resume)
                version = ahead + 1
            pusher.push(version, weights())
        event.update(version=version, back_after_s=round(time.time() - event["t"], 2), restarted=problem is not None)
        tqdm.write(f"inflight: engine back at v{version} (generation {pusher.group.generation})")
        return version

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.process is None:
            return
        self.process.join(timeout=timeout_s)
        if self.process.is_alive():
            self.process.terminate()
