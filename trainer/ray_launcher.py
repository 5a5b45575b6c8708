"""The fleet's engines as Ray actors (``engine.launcher = "ray"``), for clusters where Ray
places the jobs.

Each engine is one actor running ``inflight.trainer.rollout.engine_process.run_engine``, the same function a
spawned process runs, in a placement group of its own: one bundle of ``engine.ray_cpus`` CPUs
and, where the cluster has GPUs, one GPU per tensor parallel worker (Ray sets the actor's
``CUDA_VISIBLE_DEVICES``; a TP engine starts its workers with vLLM's ``mp`` executor inside
the bundle). The placement group outlives the actor, so a restarted engine gets its
resources back where it was. Everything else is the fleet's as with processes: the weight
groups and the rollout queue live on the trainer's store, which every actor reaches at
``transport.host``.

``RayEngine`` has ``EngineProcess``'s interface (``start``, ``exit_problem``, ``alive``,
``wait``, ``kill``), so ``inflight.trainer.fleet.Fleet`` watches, restarts and stops either alike. An
actor that dies (killed, its node lost) is an engine found dead: ``exit_problem`` says so and
the fleet restarts it, as it restarts a process.
"""

from __future__ import annotations

import logging
import os
import traceback
from pathlib import Path
from typing import Any

from inflight.trainer.config import TrainConfig
from inflight.trainer.console import engine_log, log_tail
from inflight.trainer.rollout.engine_process import run_engine

log = logging.getLogger("inflight.supervisor")


WORKER_NICENESS = "RAY_worker_niceness"
"""Ray's setting for its workers' niceness, read when a local cluster starts. Ray's default,
15, gives an engine actor the CPU after every other process of the node: on a node it shares
with the trainer and other work, the engines starve (docs/LOG.md, 2026-11-27). ``connect``
starts a local cluster at 0, the trainer's own priority."""


def connect(address: str = "") -> None:
    """Join the Ray cluster at ``address`` (``engine.ray_address``), or start a local one
    whose workers run at the trainer's priority (``WORKER_NICENESS``); once per process."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("engine.launcher='ray' needs Ray: pip install 'inflight[ray]'") from e
    if not ray.is_initialized():
        if not address:
            os.environ.setdefault(WORKER_NICENESS, "0")
        # the actors import this package from the driver's working directory, as the processes do
        ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {
                     "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}})


class _EngineActor:
    """The actor's class (decorated with ``ray.remote`` when first used: Ray is optional)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, *args: Any, **kwargs: Any) -> None:
        try:
            run_engine(*args, **kwargs)
        except Exception as e:  # re-raised as its type and message
            # Ray pickles a task's exception for the driver, and one that does not pickle (vLLM's
            # pydantic config errors) arrives as Ray's own TypeError: the log keeps the traceback,
            # the driver gets the type and message
            traceback.print_exc()
            raise RuntimeError(f"{type(e).__name__}: {e}") from None


class RayEngine:
    """One engine of the fleet, as a Ray actor in its own placement group."""

    process = None
    """No local process: the fleet's watcher of spawned processes passes it by; a dead actor is
    found by ``exit_problem``, checked every step."""

    def __init__(self, cfg: TrainConfig, index: int, placement: Any, host: str, port: int, out: Path) -> None:
        self.cfg, self.index = cfg, index
        self.ranks = cfg.engine.ranks(index)
        self.host, self.port, self.backend = host, port, placement.backend
        self.pid_file = out / f"engine{index}.pid"
        self.log_file = engine_log(out, index)
        """Where the actor's engine writes its output (on the actor's node)."""
        self.restarts = 0
        self.pid: int | None = None
        self._group: Any = None
        self._actor: Any = None
        self._run: Any = None

    def _bundle(self) -> dict[str, float]:
        import ray

        bundle = {"CPU": self.cfg.engine.ray_cpus}
        if ray.cluster_resources().get("GPU", 0) > 0:
            bundle["GPU"] = float(self.cfg.engine.tensor_parallel_size)
        return bundle

    def start(self, model_dir: Path, model_version: int, wait_for_version: int,
              adapter_dir: Path | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        connect(self.cfg.engine.ray_address)
        if self.restarts == 0 and not self.cfg.run.resume:  # a new run's log; a restart's appends
            self.log_file.write_text("")
        bundle = self._bundle()
        if self._group is None:
            self._group = placement_group([bundle], strategy="STRICT_PACK", name=f"inflight-engine-{self.index}")
            ray.get(self._group.ready())
        actor_class = ray.remote(_EngineActor)
        # max_concurrency 2: ``pid`` answers while ``run`` holds the actor for the engine's lifetime
        self._actor = actor_class.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=2, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=0),
        ).remote()
        self.pid = ray.get(self._actor.pid.remote())
        self.pid_file.write_text(str(self.pid))
        # parent_pid None: a Ray actor's parent is Ray's worker pool; the actor ends with its driver
        self._run = self._actor.run.remote(self.cfg, str(model_dir), self.host, self.port, self.index, model_version,
                                           wait_for_version, None, backend=self.backend, log_file=str(self.log_file),
                                           adapter_dir=None if adapter_dir is None else str(adapter_dir))

    def alive(self) -> bool:
        import ray

        return self._run is not None and not ray.wait([self._run], timeout=0)[0]

    def exit_problem(self) -> str | None:
        """Why the engine's actor is not running, or None."""
        import ray

        if self._run is None or self.alive():
            return None
        try:
            ray.get(self._run)
        except Exception as e:  # the actor died or run_engine raised: both end the engine
            cause = getattr(e, "cause", None) or e  # a RayTaskError carries the actor's own exception
            what = " ".join(line.strip() for line in str(cause).splitlines() if line.strip())
            return f"engine {self.index} (Ray actor, process {self.pid}) ended: {what[:400]} (log: {self.log_file})"
        return f"engine {self.index} (Ray actor, process {self.pid}) returned (log: {self.log_file})"

    def last_lines(self) -> str:
        return f"the last lines of {self.log_file}:\n{log_tail(self.log_file)}"

    def wait(self, timeout_s: float) -> None:
        import ray

        if self._run is not None:
            ray.wait([self._run], timeout=timeout_s)

    def kill(self) -> None:
        import ray

        if self._actor is not None:
            ray.kill(self._actor, no_restart=True)

    def stop(self, timeout_s: float) -> None:
        """Wait for the engine to end after the trainer said stop, then kill the actor and give
        its placement group back."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        self.wait(timeout_s)
        self.kill()
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None
