"""Keeping the fleet: notice when an engine is gone, bring it back, keep the rest going.

Each engine is in a weight group of its own (``FleetPusher``): a lost one is re-formed, dropped or let back in
alone. The trainer notices one when a push fails on it (its group breaks, or a worker's reply times out), when a
spawned engine process is found dead (every step, and while waiting for rollouts), or when it knocks to be let back
in: ``Fleet.recover`` and ``Fleet.admit`` run then. Metrics name workers by fleet rank (``engine.ranks(i)``).

Ordering invariants of a recovery:
1. the failure is reported first (log, progress bar, the run's ``engine_failures``);
2. a spawned engine that died is restarted from the latest checkpoint, told to sample only once a version at
   least as new as the trainer's current one is live on it;
3. each lost engine that is alive is re-formed at once; one dead, restarting or silent (its heartbeat stopped:
   ``inflight.transport.liveness``) is dropped without waiting, counted in ``engine_drops``, and knocks when back;
   with none left the trainer waits ``transport.rejoin_timeout_s`` for one. A failure costs the fleet one
   ``transport.reply_timeout_s`` (the wait that failed) plus the heartbeat window;
4. live engines that do not serve the current version yet get it now, alone; in a failed push's recovery they
   get the version the trainer is about to push with everyone instead (``push_behind=False``).
An engine let back in (``admit``) serves its old version under its old label until that push lands: never stale
weights under a new label. Queued groups survive a failure (the queue is in the trainer's store); slots a dead or
frozen producer claimed are holed, and one that wakes re-puts its group: nothing is lost or read twice.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as ready
from pathlib import Path

from tqdm import tqdm

from inflight.rollout_queue import RolloutQueue
from inflight.settings import Backend, DataPlane
from inflight.trainer.config import TrainConfig
from inflight.trainer.console import engine_log, last_error, log_tail
from inflight.trainer.memory_watch import LOOK_EVERY_S, MemoryWatch, killed_by_oom, not_by_oom
from inflight.trainer.rollout.engine_process import run_engine
from inflight.transport.fleet_pusher import FleetPusher, FleetPushError
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig
from inflight.transport.sources import Weights

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

    def __init__(self, cfg: TrainConfig, index: int, placement: Placement, host: str, port: int, out: Path) -> None:
        self.cfg, self.index, self.placement = cfg, index, placement
        self.ranks = cfg.engine.ranks(index)
        """Its workers' weight-group ranks (one per tensor parallel rank)."""
        self.host, self.port = host, port
        self.pid_file = out / f"engine{index}.pid"
        self.log_file = engine_log(out, index)
        """Where the spawned process writes its output (its console is the trainer's no more)."""
        self.process: mp.process.BaseProcess | None = None
        self.memory: MemoryWatch | None = None
        """The running process's memory, looked at by the fleet's watcher (``look_at_memory``)."""
        self.restarts = 0

    def start(self, model_dir: Path, model_version: int, wait_for_version: int,
              adapter_dir: Path | None = None) -> None:
        if not self.cfg.engine.spawn:
            return
        if self.restarts == 0 and not self.cfg.run.resume:  # a new run's log; a restart's or a resume's appends
            self.log_file.write_text("")
        # daemonic, so it ends with the trainer; but a daemonic process may not start children,
        # and a tensor parallel engine starts one per worker: that one ends by itself once
        # it sees its parent gone (``run_engine``), or at ``Fleet.stop``
        self.process = mp.get_context("spawn").Process(
            target=run_engine, name=f"inflight-engine-{self.index}", daemon=self.cfg.engine.tensor_parallel_size == 1,
            args=(self.cfg, str(model_dir), self.host, self.port, self.index, model_version, wait_for_version,
                  os.getpid()),
            kwargs={"backend": self.placement.backend, "adapter_dir": None if adapter_dir is None else str(adapter_dir),
                    "cuda_devices": engine_share(self.placement.engine_devices, self.cfg.engine.count, self.index,
                                                 self.cfg.engine.tensor_parallel_size),
                    "log_file": str(self.log_file)},
        )
        self.process.start()
        self.memory = MemoryWatch(self.process.pid)
        self.pid_file.write_text(str(self.process.pid))

    def look_at_memory(self) -> None:
        """One look at the running process's memory, by the fleet's watcher."""
        if self.memory is not None:
            self.memory.look()

    def why_exited(self, pid: int, code: int) -> str:
        """What ended process ``pid`` of this engine with exit code ``code``: a SIGKILL says
        whether the kernel's out-of-memory killer did it (``inflight.trainer.memory_watch``)."""
        if code != -signal.SIGKILL or self.memory is None or self.memory.pid != pid:
            return f"engine {self.index} (process {pid}) exited with code {code}"
        death = self.memory.death()  # judged once, at the first look after the kill
        if not death.oom:
            return f"engine {self.index} (process {pid}) exited with code {code} ({not_by_oom(death)})"
        engine = self.cfg.engine
        return (f"engine {self.index} (process {pid}) {killed_by_oom(death)}: lower engine.kv_cache_gb (now "
                f"{engine.kv_cache_gb}) or run fewer engines on this machine (engine.count={engine.count})")

    def killed_by_oom(self, pid: int, code: int) -> bool:
        """Whether process ``pid`` of this engine, which exited with ``code``, was killed by the
        kernel's OOM killer (``why_exited`` says so)."""
        return (code == -signal.SIGKILL and self.memory is not None and self.memory.pid == pid
                and self.memory.death().oom)

    def exit_problem(self) -> str | None:
        """Why the spawned engine is not running, or None (always None without ``spawn``)."""
        if self.process is None or self.process.is_alive():
            return None
        return f"{self.why_exited(self.process.pid, self.process.exitcode)} (log: {self.log_file})"

    def last_lines(self) -> str:
        """The end of its log, for a report of its exit."""
        return f"the last lines of {self.log_file}:\n{log_tail(self.log_file)}"

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the process to end (reaping it)."""
        if self.process is not None:
            self.process.join(timeout=timeout_s)

    def stop(self, timeout_s: float) -> None:
        """Wait for the process to end after the trainer said stop; terminate it if it does not
        (its scoring processes watch it and follow within a second), and kill it if that fails too."""
        self.wait(timeout_s)
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()


class Fleet:
    """The trainer's engines: start, watch, recover, let back in."""

    def __init__(self, cfg: TrainConfig, model_dir: Path, model_version: int, port: int, placement: Placement,
                 out: Path, adapter_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.model_dir = model_dir
        self.model_version = model_version
        """The version of the weights in ``model_dir``, which a (re)started engine serves first."""
        self.adapter_dir = adapter_dir
        """A LoRA run: the adapter of ``model_version`` (``model_dir`` is the base, which never moves)."""
        launcher = EngineProcess
        if cfg.engine.launcher == "ray" and cfg.engine.spawn:
            from inflight.trainer.ray_launcher import RayEngine as launcher  # (Ray is an optional extra)
        self.engines = [launcher(cfg, i, placement, cfg.transport.host, port, out) for i in range(cfg.engine.count)]
        self.failures = 0
        self.drops = 0
        """Times a member was left out of a generation (silent, frozen or restarting)."""
        self.events: list[dict] = []
        """One entry per recovery: when it began (unix time), why, and the version it ended on."""
        self._stopping = threading.Event()
        self.exited = threading.Event()
        """Set once a spawned engine exits with an error (after the watcher reported it)."""

    @property
    def restarts(self) -> int:
        return sum(e.restarts for e in self.engines)

    def restart_from(self, ckpt_dir: Path, version: int) -> None:
        """A checkpoint of ``version`` was saved: a restarted engine starts from it (in a LoRA run,
        the base stays and the checkpoint is the adapter)."""
        if self.adapter_dir is not None:
            self.adapter_dir = ckpt_dir
        else:
            self.model_dir = ckpt_dir
        self.model_version = version

    def start(self, wait_for_version: int) -> None:
        for e in self.engines:
            e.start(self.model_dir, self.model_version, wait_for_version, self.adapter_dir)
        if self.cfg.engine.spawn:
            print(f"engines: logs in {', '.join(str(e.log_file) for e in self.engines)}", flush=True)
            threading.Thread(target=self._watch, name="inflight-engine-watch", daemon=True).start()

    def _watch(self) -> None:
        """Look at each spawned engine's memory every ``LOOK_EVERY_S``, and report each that fails
        (a process that exits with a code other than 0, which is a stop the trainer asked for; a
        Ray actor whose run ends) at once, with the end of its log; one the kernel's OOM killer
        killed, in one line naming its memory (its log has nothing to add). An engine that fails
        at start-up does so while the trainer waits up to ``transport.rejoin_timeout_s`` for it to
        join, and nothing else would say why meanwhile; a recovery's report names only the log."""
        reported: set[tuple[int, int | None]] = set()
        while not self._stopping.wait(LOOK_EVERY_S):
            for e in self.engines:
                if isinstance(e, EngineProcess):
                    e.look_at_memory()
                failed = self._failed(e, reported)
                if failed is not None and not self._stopping.is_set():
                    problem, oom = failed
                    tqdm.write(f"inflight: {problem}" if oom else f"inflight: {problem}; {e.last_lines()}")
                    self.exited.set()

    def _failed(self, e: EngineProcess, reported: set[tuple[int, int | None]]) -> tuple[str, bool] | None:
        """Engine ``e``'s failure (an ``EngineProcess`` or a ``RayEngine``, alike), once per
        process (a restart starts another), and whether the OOM killer did it; or None."""
        p = e.process  # a restart replaces it; this one is kept while looked at
        if p is None:  # a Ray actor: its run's end is its exit (``RayEngine.exit_problem``)
            if (e.index, e.pid) in reported or (problem := e.exit_problem()) is None:
                return None
            reported.add((e.index, e.pid))
            return problem, False
        # its sentinel: reaping it here (``is_alive``) would race the main thread's reaping
        if (e.index, p.pid) in reported or not ready([p.sentinel], timeout=0):
            return None
        reported.add((e.index, p.pid))
        while (code := p.exitcode) is None and not self._stopping.wait(0.05):
            pass  # the main thread is reaping it at the same moment: its return code comes
        return (e.why_exited(p.pid, code), e.killed_by_oom(p.pid, code)) if code else None

    def connect(self, group: GroupConfig, push: PushConfig) -> FleetPusher:
        """Host a weight group per engine on ``group``'s store and wait up to
        ``transport.rejoin_timeout_s`` for every engine to join. An engine whose process exits
        meanwhile (a setting vLLM refuses, a model that does not load) stops the run at once:
        ``EngineLost`` naming the engine and the last line of its log, the rest of which the
        watcher printed; the other engines are stopped."""
        try:
            return FleetPusher(group, self.cfg.engine.tp_sizes, push,
                               join_timeout_s=self.cfg.transport.rejoin_timeout_s, stop=self.exited)
        except InterruptedError:
            problems = [f"{problem}: {last_error(e.log_file)}" for e in self.engines
                        if (problem := e.exit_problem()) is not None]
            self.stop(timeout_s=5.0)
            raise EngineLost(f"{'; '.join(problems)}, before joining its weight group") from None

    def exit_problem(self) -> str | None:
        problems = [p for e in self.engines if (p := e.exit_problem()) is not None]
        return "; ".join(problems) or None

    def ranks_of(self, engines: Iterable[int]) -> list[int]:
        """The fleet ranks of ``engines``' workers (engine i's are ``engine.ranks(i)``): the
        names metrics give them, though each engine is ranks 1.. of a weight group of its own."""
        return sorted(r for e in engines for r in self.cfg.engine.ranks(e))

    def serving(self, versions: Mapping[int, Mapping[int, int]]) -> dict[int, int]:
        """Per-engine worker versions (``FleetPusher.engine_versions``) keyed by fleet rank."""
        return {self.cfg.engine.ranks(e)[r - 1]: v for e, by_rank in versions.items() for r, v in by_rank.items()}

    def recover(self, pusher: FleetPusher, reason: str, version: int, weights: Callable[[], Weights],
                queue: RolloutQueue, lost: Collection[int] = (), *, push_behind: bool = True) -> int:
        """Steps 1-4 above for the ``lost`` engines (those whose push failed; dead processes are
        found here); returns the trainer's version (raised above any engine's)."""
        self.failures += 1
        event: dict = {"t": time.time(), "reason": reason}
        self.events.append(event)
        tqdm.write(f"inflight: engine lost ({reason}); recovering")
        log.warning("engine lost: %s", reason)
        before = set(pusher.live)
        dead = self._restart_dead(version)
        if dead:  # their claimed-but-unwritten slots; a live producer that loses one re-puts
            queue.fill_holes()
            event["exits"] = list(dead.values())  # why each restarted engine exited (a push failure does not say)
        lost = set(lost) | set(dead)
        for e in sorted(lost):
            # a failed transfer does not say why: the heartbeats say who is dead or frozen. Asked
            # first: a SIGKILLed engine's sockets close before its process can be reaped
            if e in dead or pusher.silent(e):
                pusher.drop(e)  # it knocks when it is back
            else:  # alive (it refused, or its link broke): it comes as soon as it sees the failure
                pusher.rejoin(e, self.cfg.transport.reply_timeout_s, require=False)
        if not pusher.live:  # nobody else to go on with: wait for them
            timeout_s = self.cfg.transport.rejoin_timeout_s

            def restart_late() -> None:  # one whose sockets closed before it could be reaped, dropped above
                if late := self._restart_dead(version):
                    dead.update(late)
                    queue.fill_holes()
                    event["exits"] = list(dead.values())
            self._let_in(pusher, timeout_s, done=lambda: bool(pusher.live), each_look=restart_late)
            if not pusher.live:
                raise EngineLost(f"no engine rejoined its weight group within transport.rejoin_timeout_s={timeout_s}s")
        self._count_drops(before, set(pusher.live))
        rejoined = {e: pusher.engine_versions[e] for e in pusher.live if e in lost or e not in before}
        live = {e: pusher.engine_versions[e] for e in pusher.live}
        ahead = max((v for by_rank in live.values() for v in by_rank.values()), default=-1)
        if ahead > version:  # a version an engine got from a trainer state that is gone (a resume)
            version = ahead + 1
        behind = [e for e, by_rank in live.items() if all(v < version for v in by_rank.values())]
        if push_behind and behind:
            event["pushed"] = [version, self.ranks_of(self._push(pusher, version, weights, behind))]
        event.update(version=version, members=self.ranks_of(pusher.live),
                     back_after_s=round(time.time() - event["t"], 2), restarted=sorted(dead),
                     serving=dict(sorted(self.serving(rejoined).items())))
        tqdm.write(f"inflight: fleet at v{version} with engines {pusher.live} (ranks {self.ranks_of(pusher.live)})")
        return version

    def _restart_dead(self, version: int) -> dict[int, str]:
        """Restart every spawned engine whose process exited, told to sample from ``version`` on;
        why each exited, by engine."""
        dead = {e.index: problem for e in self.engines if (problem := e.exit_problem()) is not None}
        for index, problem in dead.items():
            e = self.engines[index]
            if e.restarts >= self.cfg.engine.max_restarts:
                raise EngineLost(f"{problem}; already restarted {e.restarts} times (engine.max_restarts); "
                                 f"{e.last_lines()}")
            e.restarts += 1
            e.wait(5)
            e.start(self.model_dir, self.model_version, version, self.adapter_dir)
        return dead

    def _let_in(self, pusher: FleetPusher, timeout_s: float, done: Callable[[], bool],
                each_look: Callable[[], None] = lambda: None) -> dict[int, dict[int, int]]:
        """Let in the engines that knock (at least one look), until ``done()`` or ``timeout_s``
        passed, calling ``each_look()`` before each look; what each engine let in serves."""
        deadline = time.monotonic() + timeout_s
        admitted: dict[int, dict[int, int]] = {}
        while True:
            each_look()
            for e in pusher.knocking():
                if versions := pusher.rejoin(e, self.cfg.transport.reply_timeout_s, require=False):
                    admitted[e] = versions
            if done() or time.monotonic() > deadline:
                return admitted
            time.sleep(0.05)

    def _push(self, pusher: FleetPusher, version: int, weights: Callable[[], Weights], engines: list[int]) -> list[int]:
        """Push ``version`` to ``engines`` now; the engines that took it (one that did not is dropped)."""
        try:
            return sorted(pusher.push(version, weights(), engines=engines))
        except FleetPushError as e:
            for failed in e.failed:
                pusher.drop(failed)
            if not e.landed:
                raise EngineLost(f"no engine took v{version} after a recovery: {e}") from e
            return sorted(e.landed)

    def admit(self, pusher: FleetPusher, *, wait: bool = False) -> dict[int, int]:
        """Let the knocking engines back into their groups (between two pushes); ``wait``: wait
        up to ``transport.rejoin_timeout_s`` for every engine of the fleet. Returns what the
        engines let in serve, by fleet rank."""
        before = set(pusher.live)
        admitted = self._let_in(pusher, self.cfg.transport.rejoin_timeout_s if wait else 0.0,
                                done=lambda: len(pusher.live) == len(self.engines))
        self._count_drops(before, set(pusher.live))
        serving = self.serving(admitted)
        tqdm.write(f"inflight: engines {sorted(admitted)} back in their weight groups (serving "
                   f"{dict(sorted(serving.items()))})")
        return serving

    def _count_drops(self, before: set[int], after: set[int]) -> None:
        for e in sorted(before - after):
            self.drops += 1
            tqdm.write(f"inflight: engine {e} left out of its weight group (silent for "
                       f"{self.cfg.transport.reply_timeout_s}s)")
            log.warning("engine %d dropped from its weight group", e)

    def stop(self, timeout_s: float = 60.0) -> None:
        self._stopping.set()  # engines that end now were asked to
        for e in self.engines:
            e.stop(timeout_s)
