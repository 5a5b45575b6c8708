"""Keeping the fleet: notice when an engine is gone, bring it back, keep the rest going.

The trainer notices a lost engine in three places: a push that fails (the weight group
breaks, or a worker does not reply within ``transport.reply_timeout_s``), a spawned engine
process found dead (checked every step, and while waiting for rollouts), or an engine
knocking to be let back into the group. ``Fleet.recover`` and ``Fleet.admit`` run then.

Ordering invariants of a recovery:
1. the failure is reported first (log, progress bar, the run's ``engine_failures``);
2. a spawned engine that died is restarted from the latest checkpoint, told to sample only
   once a version at least as new as the trainer's current one is live on it;
3. the trainer forms the group's next generation with the engines that answer within the
   timeout, not waiting for the restarting ones or for a member that went silent (named by
   the failed wait, or by its heartbeat stopping: see ``inflight.transport.liveness``; with
   a single engine there is no one else: it waits ``transport.rejoin_timeout_s`` for it);
   whoever is left out is counted in ``engine_drops`` and knocks when it is back. So a
   failure costs the fleet one ``transport.reply_timeout_s`` (the wait that failed) plus the
   heartbeat window, not a second timeout for a member that will not come;
4. if no member serves the current version yet, the trainer pushes it now; otherwise the
   laggards get the next step's version with everyone (a version is pushed to a whole
   generation, and a member that already serves it would refuse it).
An engine let back in (``admit``) serves its old version under its old label until that
push lands: never stale weights under a new label. The rollout queue lives in the
trainer's store, so groups queued before a failure are still there afterwards; slots a
dead or frozen producer claimed but never wrote are holed, and a frozen producer that
wakes re-puts its group (``RolloutQueue``): nothing is lost or read twice.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from inflight.rollout_queue import RolloutQueue
from inflight.settings import Backend, DataPlane
from inflight.transport.pusher import WeightPusher
from trainer.config import TrainConfig
from trainer.engine_process import run_engine

log = logging.getLogger("inflight.supervisor")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Which GPUs the trainer and a spawned engine use, and the weight group's data plane."""

    backend: DataPlane
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


def place(backend: Backend, *, spawn: bool, gpus: Sequence[str]) -> Placement:
    """Split ``gpus`` between the trainer and the engine it spawns.

    The trainer takes the first GPU and a spawned engine the others. NCCL cannot connect two
    ranks on one GPU, so a trainer and engine sharing the only GPU use gloo (weights cross
    through host memory; the engine still stages them off the decode path). An engine that
    is not spawned runs elsewhere, on GPUs of its own.
    """
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
    """An engine stopped serving: its process exited, or the weight group failed."""


def engine_share(devices: str | None, count: int, index: int, tensor_parallel_size: int = 1) -> str | None:
    """``CUDA_VISIBLE_DEVICES`` of spawned engine ``index`` of ``count``: an equal share of
    the GPUs ``place`` gave the engines (None: no GPUs, all inherit the trainer's view), at
    least one per tensor parallel worker."""
    if devices is None:
        return None
    gpus = devices.split(",")
    per = len(gpus) // count
    if per < tensor_parallel_size:
        raise ValueError(f"engine.count={count} engines of engine.tensor_parallel_size={tensor_parallel_size} need "
                         f"{count * tensor_parallel_size} GPUs besides the trainer's; visible for engines: {gpus}")
    return ",".join(gpus[index * per:(index + 1) * per])


class EngineProcess:
    """One engine of the fleet that the trainer spawned (or, with ``spawn = false``, nothing to spawn)."""

    def __init__(self, cfg: TrainConfig, index: int, placement: Placement, host: str, port: int, pid_file: Path) -> None:
        self.cfg, self.index, self.placement = cfg, index, placement
        self.ranks = cfg.engine.ranks(index)
        """Its workers' weight-group ranks (one per tensor parallel rank)."""
        self.host, self.port = host, port
        self.pid_file = pid_file
        self.process: mp.process.BaseProcess | None = None
        self.restarts = 0

    def start(self, model_dir: Path, model_version: int, wait_for_version: int) -> None:
        if not self.cfg.engine.spawn:
            return
        # daemonic, so it ends with the trainer; but a daemonic process may not start children,
        # and a tensor parallel engine starts one per worker: that one ends by itself once
        # it sees its parent gone (``run_engine``), or at ``Fleet.stop``
        self.process = mp.get_context("spawn").Process(
            target=run_engine, name=f"inflight-engine-{self.index}", daemon=self.cfg.engine.tensor_parallel_size == 1,
            args=(self.cfg, str(model_dir), self.host, self.port, self.index, model_version, wait_for_version, os.getpid()),
            kwargs={"backend": self.placement.backend,
                    "cuda_devices": engine_share(self.placement.engine_devices, self.cfg.engine.count, self.index,
                                                 self.cfg.engine.tensor_parallel_size)},
        )
        self.process.start()
        self.pid_file.write_text(str(self.process.pid))

    def exit_problem(self) -> str | None:
        """Why the spawned engine is not running, or None (always None without ``spawn``)."""
        if self.process is None or self.process.is_alive():
            return None
        return f"engine {self.index} (process {self.process.pid}) exited with code {self.process.exitcode}"


class Fleet:
    """The trainer's engines: start, watch, recover, let back in."""

    def __init__(self, cfg: TrainConfig, model_dir: Path, model_version: int, port: int, placement: Placement,
                 out: Path) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.model_version = model_version
        """The version of the weights in ``model_dir``, which a (re)started engine serves first."""
        self.engines = [EngineProcess(cfg, i, placement, cfg.transport.host, port, out / f"engine{i}.pid") for i in range(cfg.engine.count)]
        self.failures = 0
        self.drops = 0
        """Times a member was left out of a generation (silent, frozen or restarting)."""
        self.events: list[dict] = []
        """One entry per recovery: when it began (unix time), why, and the version it ended on."""

    @property
    def restarts(self) -> int:
        return sum(e.restarts for e in self.engines)

    def start(self, wait_for_version: int) -> None:
        for e in self.engines:
            e.start(self.model_dir, self.model_version, wait_for_version)

    def exit_problem(self) -> str | None:
        problems = [p for e in self.engines if (p := e.exit_problem()) is not None]
        return "; ".join(problems) or None

    def recover(self, pusher: WeightPusher, reason: str, version: int, weights, queue: RolloutQueue,
                silent: Sequence[int] = ()) -> int:
        """Steps 1-4 above; returns the trainer's version (raised above any engine's)."""
        self.failures += 1
        event = {"t": time.time(), "reason": reason}
        self.events.append(event)
        tqdm.write(f"inflight: engine lost ({reason}); recovering")
        log.warning("engine lost: %s", reason)
        before = set(pusher.group.roster)
        # a failed transfer does not say who failed: the heartbeats do (dead or frozen members).
        # Asked first: a SIGKILLed engine's sockets close before its process can be reaped, so
        # the push may fail while it still looks alive; the heartbeat window outlasts that
        silent = set(silent) | set(pusher.group.silent(before))
        dead = [e for e in self.engines if e.exit_problem() is not None]
        for e in dead:
            if e.restarts >= self.cfg.engine.max_restarts:
                raise EngineLost(f"{e.exit_problem()}; already restarted {e.restarts} times (engine.max_restarts)")
            e.restarts += 1
            e.process.join(timeout=5)
            e.start(self.model_dir, self.model_version, wait_for_version=version)
        if dead:  # their claimed-but-unwritten slots; a live producer that loses one re-puts
            queue.fill_holes()
        restarting = {r for e in dead for r in e.ranks}
        waiting = restarting | silent
        want = set(pusher.group.workers) - waiting
        try:
            if want:  # the restarting and the silent knock later. The live ones come as soon as
                # they see the failure: at once, since re-forming closes this side's connections
                live = pusher.rejoin(self.cfg.transport.reply_timeout_s, want=want, require=set())
            else:  # nobody else to go on with: wait for them
                live = pusher.rejoin(self.cfg.transport.rejoin_timeout_s, require=set())
        except Exception as e:
            raise EngineLost(f"no engine rejoined the weight group: {e}") from e
        self._count_drops(before, set(live))
        ahead = max(live.values(), default=-1)
        if ahead > version:  # a version an engine got from a trainer state that is gone (a resume)
            version = ahead + 1
        if all(v < version for v in live.values()):
            event["pushed"] = [version, sorted(pusher.push(version, weights()).commits)]
        event.update(version=version, members=sorted(live), back_after_s=round(time.time() - event["t"], 2),
                     restarted=[e.index for e in dead], serving=dict(sorted(live.items())))
        tqdm.write(f"inflight: fleet at v{version} with engines on ranks {sorted(live)} "
                   f"(generation {pusher.group.generation})")
        return version

    def admit(self, pusher: WeightPusher, *, wait: bool = False) -> dict[int, int]:
        """Form a generation that lets the knocking engines back in (between two pushes);
        ``wait``: wait up to ``transport.rejoin_timeout_s`` for every engine of the fleet."""
        before = set(pusher.group.roster)
        knocking = set(pusher.knocking())
        if wait:
            live = pusher.rejoin(self.cfg.transport.rejoin_timeout_s, require=set())
        else:
            live = pusher.rejoin(self.cfg.transport.reply_timeout_s, want=before | knocking, require=set())
        self._count_drops(before, set(live))
        tqdm.write(f"inflight: engines on ranks {sorted(set(live) - before)} back in the weight group "
                   f"(serving {dict(sorted(live.items()))})")
        return live

    def _count_drops(self, before: set[int], after: set[int]) -> None:
        for r in sorted(before - after):
            self.drops += 1
            tqdm.write(f"inflight: engine on rank {r} left out of the weight group (silent for {self.cfg.transport.reply_timeout_s}s)")
            log.warning("engine on rank %d dropped from the weight group", r)

    def stop(self, timeout_s: float = 60.0) -> None:
        for e in self.engines:
            if e.process is None:
                continue
            e.process.join(timeout=timeout_s)
            if e.process.is_alive():
                e.process.terminate()
