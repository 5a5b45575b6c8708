"""The drop-in vLLM worker extension: ``--worker-extension-cls engine_patches.worker.InflightWorkerExtension``.

It only adds methods (vLLM forbids overriding worker methods from an extension), all
called through ``collective_rpc``:

- ``inflight_start(config_json)``: reserve staging memory (or refuse, naming the bytes),
  build the commit strategy, and start the listener thread, which joins the weight group
  as rank ``config.rank + <vLLM worker rank>`` and stages every update while the engine
  keeps decoding (and rejoins whenever the group fails). It passes through the patched
  ``EngineCore.collective_rpc``, which checks the engine and attaches the commit
  coordinator first (``engine_patches.coordinator``);
- ``inflight_commit(v)`` / ``inflight_rollback(v)``: called by the coordinator, between
  two engine steps, on this worker's execution thread: apply the prepared version, or
  take it back because another rank of the engine failed;
- ``inflight_status()``, ``inflight_stop()``.

Ordering invariants: live weights are touched only by ``inflight_commit`` and
``inflight_rollback``, on the execution thread, between steps, for a version this worker
fully staged and prepared and for which the trainer sent ``Commit``. The listener thread
only stages, prepares, announces readiness and relays the engine's outcome.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine_patches.apply import checkpoint_dir, checkpoint_schema, make_applier
from engine_patches.config import InflightConfig
from engine_patches.staging import StagingNeed, check_fits, memory_budget, ordered_commit, ready_event, staging_need
from inflight.protocol import (
    ENGINE_CHANNEL,
    CommitReady,
    EngineCommitted,
    ProtocolError,
    Sampling,
    decode_engine,
    encode,
)
from inflight.auth import read_secret
from inflight.transport.group import TransportError, TransportTimeout, WeightGroup, await_trainer_gone, wait_key
from inflight.transport.listener import CommitFailed, CommitInfo, ListenerStats, StagingPool, UpdateListener

log = logging.getLogger("inflight.worker")


@dataclass
class _Ready:
    version: int
    weights: Mapping[str, torch.Tensor]
    previous: Mapping[str, torch.Tensor] | None
    event: Any  # torch.cuda.Event on CUDA: staging of this version is complete


class _EngineTarget:
    """The listener's view of this worker (``CommitTarget``) and the execution-thread half
    of the engine's two-phase commit."""

    def __init__(self, applier: Any, config: InflightConfig, rank: int, device: torch.device) -> None:
        self.applier = applier
        self.config = config
        self.rank = rank
        self.device = device
        self._live = config.initial_version
        self._disk_version = config.initial_version
        self.channel: Any = None  # this engine's commit channel in the current generation's store
        self.incarnation = ""  # of the trainer's store the channel lives in
        self._lock = threading.Lock()  # hands a ready version to exactly one of: commit, withdrawal
        self._ready: _Ready | None = None
        self._applied: _Ready | None = None
        self._event: Any = None
        self.forwards = 0
        self.forward_thread: int | None = None
        self.commits: list[dict[str, Any]] = []

    def on_forward(self, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook: counts this worker's model steps and remembers which thread runs them."""
        self.forwards += 1
        self.forward_thread = threading.get_ident()

    # -- listener thread (CommitTarget) -----------------------------------------------------
    @property
    def live_version(self) -> int:
        return self._live

    def steps(self) -> int:
        return self.forwards

    def prepare_part(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        feed = getattr(self.applier, "feed", None)  # the swap commit re-packs layer by layer; others wait for all
        if feed is not None:
            feed(weights)

    def prepare(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.applier.prepare(weights)
        self._event = ready_event(self.device)

    def discard(self) -> None:
        self.applier.discard()

    def leave(self) -> None:
        """The trainer is leaving: have the engine's coordinator let go of its store first (it
        deletes ``bye/<rank>`` as the last thing it does with it; see the coordinator)."""
        key = f"bye/{self.rank}"
        self.channel.set(key, self.incarnation.encode())
        deadline = time.monotonic() + 5.0  # a coordinator busy committing answers within a step; else go on
        while self.channel.check([key]) and time.monotonic() < deadline:
            time.sleep(0.002)

    def commit(self, version: int, weights: dict[str, torch.Tensor], previous: Mapping[str, torch.Tensor] | None) -> CommitInfo:
        """Announce readiness to the engine's coordinator and relay its outcome."""
        ready = _Ready(version, weights, previous, self._event)
        with self._lock:
            self._ready = ready
        key, what = f"outcome/{version}", f"the engine's commit of v{version}"
        self.channel.delete_key(key)  # a failed earlier attempt at this version left its outcome (issue 17)
        self.channel.set(f"ready/{self.rank}", encode(CommitReady(rank=self.rank, version=version)))
        try:
            raw = wait_key(self.channel, key, timeout_s=self.config.commit_timeout_s, stop=None, what=what, who=f"rank {self.rank}")
        except TransportTimeout as e:
            with self._lock:
                withdrawn = self._ready is ready
                if withdrawn:
                    self._ready = None
            if withdrawn:  # the engine never took it: nothing changed anywhere
                self.channel.delete_key(f"ready/{self.rank}")
                raise CommitFailed(f"v{version} withdrawn: {e}") from e
            # the commit is running on the execution thread: its outcome is moments away
            raw = wait_key(self.channel, key, timeout_s=self.config.commit_timeout_s, stop=None, what=what, who=f"rank {self.rank}")
        self._applied = None
        try:
            outcome = decode_engine(raw)
        except ProtocolError as e:
            raise TransportError(f"rank {self.rank}: unreadable commit outcome: {e}") from e
        if not isinstance(outcome, EngineCommitted) or outcome.version != version:
            raise CommitFailed(getattr(outcome, "reason", f"unexpected outcome {outcome!r}"))
        self._live = version
        if not self.config.keep_rollback:
            self.applier.release_rollback()
        return CommitInfo(step=outcome.step, commit_ms=outcome.commit_ms, tokens_at_commit=dict(outcome.tokens_at_commit))

    # -- execution thread (called by the coordinator between two engine steps) --------------
    def execute_commit(self, version: int) -> dict[str, Any]:
        me = threading.current_thread()
        info: dict[str, Any] = {
            "rank": self.rank, "version": version, "ok": False, "applied": False, "error": "", "ms": 0.0,
            "thread": me.name, "main_thread": me is threading.main_thread(),
            # None before this worker ran any forward pass since the listener started
            "forward_thread": None if self.forward_thread is None else self.forward_thread == threading.get_ident(),
        }
        with self._lock:
            ready, self._ready = self._ready, None
            if ready is not None and ready.version != version:  # not the version the engine commits: keep it
                self._ready, ready = ready, None
        if ready is None:
            info["error"] = f"v{version} is not staged and committed by the trainer on this rank (withdrawn or lost)"
            return self._log(info)
        t0 = time.perf_counter()
        try:
            ordered_commit(self.device, ready.event, self.applier.apply)
        except Exception as e:
            info["error"] = f"applying v{version} failed: {e!r}"
            try:
                self._undo(ready, self.applier.restore)
            except Exception as e2:  # state unknown: ask the coordinator to roll this rank back too
                info["error"] += f"; restoring failed: {e2!r}"
                info["applied"] = True
                self._applied = ready
            return self._log(info)
        self._applied = ready
        info.update(ok=True, applied=True, ms=1e3 * (time.perf_counter() - t0))
        return self._log(info)

    def execute_rollback(self, version: int) -> dict[str, Any]:
        info: dict[str, Any] = {"rank": self.rank, "version": version, "ok": True, "error": ""}
        applied, self._applied = self._applied, None
        if applied is None or applied.version != version:
            return info  # nothing of v went live here
        try:
            self._undo(applied, self.applier.undo)
        except Exception as e:
            info.update(ok=False, error=repr(e))
        return info

    def _undo(self, ready: _Ready, how: Any) -> None:
        if ready.previous is None and getattr(self.applier, "strategy", "") != "swap" and self._live != self._disk_version:
            raise RuntimeError(f"no rollback copy of v{self._live} (keep_rollback=False) and the checkpoint on disk "
                               f"is v{self._disk_version}")
        ordered_commit(self.device, None, lambda: how(ready.previous))

    def _log(self, info: dict[str, Any]) -> dict[str, Any]:
        self.commits = (self.commits + [info])[-64:]
        return info


class InflightWorkerExtension:
    """Mixed into vLLM's Worker; ``self`` is the worker (``model_runner``, ``vllm_config``, ``rank``)."""

    def inflight_start(self, config_json: str, engine_id: str | None = None) -> dict[str, Any]:
        if engine_id is None:  # the call did not pass through the patched EngineCore.collective_rpc
            raise RuntimeError("inflight: EngineCore did not attach a commit coordinator: the inflight vLLM plugin is "
                               "not loaded in EngineCore's process (install this package; check VLLM_PLUGINS)")
        config = InflightConfig.from_json(config_json)
        if getattr(self, "_inflight_thread", None) is not None:
            raise RuntimeError("inflight: already started on this worker")
        vc = self.vllm_config
        _refuse_sampling_defaults(vc.model_config)
        rank = config.rank + self.rank
        device = torch.device(self.model_runner.device)
        schema = checkpoint_schema(checkpoint_dir(vc.model_config.model, vc.model_config.revision), vc.model_config.dtype)
        applier = make_applier(self.model_runner, config.commit, schema, quantized=vc.model_config.quantization is not None,
                               eager=vc.model_config.enforce_eager)
        from engine_patches.routing import RoutingRecorder

        self._inflight_routing = RoutingRecorder(self.model_runner) if config.record_routing else None
        pool, need = self._inflight_reserve(config, schema, applier, device)
        target = _EngineTarget(applier, config, rank, device)
        self._inflight_hook = self.model_runner.get_model().register_forward_pre_hook(target.on_forward)
        self._inflight_target = target
        self._inflight_pool = pool
        self._inflight_engine_id = engine_id
        self._inflight_stop = threading.Event()
        self._inflight_secret = read_secret()  # once: the environment at the engine's start decides
        self._inflight_listener: UpdateListener | None = None
        self._inflight_stats = ListenerStats()
        self._inflight_thread = threading.Thread(
            target=self._inflight_serve, args=(config, schema, rank), name=f"inflight-listener-{rank}", daemon=True
        )
        self._inflight_thread.start()
        # the listener stops with the interpreter too (a plain exit, no engine shutdown), before
        # the objects its thread uses are torn down under it
        ref = weakref.ref(self)
        self._inflight_atexit = lambda: (w := ref()) is not None and w.inflight_stop()
        atexit.register(self._inflight_atexit)
        return {"rank": rank, "instance_id": engine_id, "commit": applier.strategy, "schema_tensors": len(schema.tensors),
                "staging": need.where, "staging_bytes": need.nbytes,
                "routing": None if self._inflight_routing is None else [self._inflight_routing.layers,
                                                                         self._inflight_routing.top_k]}

    def _inflight_reserve(self, config: InflightConfig, schema, applier: Any, device: torch.device) -> tuple[StagingPool, StagingNeed]:
        """Check the staging buffers fit where they will live, then allocate them now."""
        data = self._inflight_data_device(config)
        pool_device = data if config.staging == "device" else torch.device("cpu")
        where = "device" if pool_device.type == device.type else "host"  # gloo next to a GPU engine stages on the host
        need = staging_need(schema, staging=where, keep_rollback=config.keep_rollback)
        if getattr(applier, "strategy", "") == "swap":  # prepared shadow weights (+ the swapped-out ones kept for rollback)
            need = StagingNeed(need.update_bytes, need.copies, need.where, applier.prepared_bytes() * need.copies)
        free, total = memory_budget(device, need)
        check_fits(need, device=device, free_bytes=free, total_bytes=total,
                   gpu_memory_utilization=getattr(self.vllm_config.cache_config, "gpu_memory_utilization", None))
        pool = StagingPool(pool_device, pin=where == "host")
        pool.reserve(need.update_bytes, need.copies)
        return pool, need

    def _inflight_serve(self, config: InflightConfig, schema, rank: int) -> None:
        """The listener thread: join the group, stage and commit updates, and whenever the
        group fails (trainer killed, a stalled transfer timed out) drop what was staged, keep
        serving the live version, and join the next generation the trainer opens."""
        if config.listener_nice and hasattr(os, "setpriority"):  # per thread on Linux
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), config.listener_nice)
        if torch.cuda.is_available() and self.model_runner.device.type == "cuda":
            # verify and stage on a side stream so checksums never queue behind the forward pass
            torch.cuda.set_device(self.model_runner.device)
            torch.cuda.set_stream(torch.cuda.Stream())
        stats, stop, target = self._inflight_stats, self._inflight_stop, self._inflight_target
        secret = self._inflight_secret
        joined_before = False
        while not stop.is_set():
            try:
                engine_ranks = tuple(range(config.rank, config.rank + self.vllm_config.parallel_config.world_size))
                group = WeightGroup(config.group, rank, device=self._inflight_data_device(config),
                                    live_version=target.live_version, stop=stop, join_timeout_s=None,
                                    engine_ranks=engine_ranks, secret=secret)
            except InterruptedError:
                return
            except TransportError as e:  # the store went away while joining: try again
                stats.last_error = f"[join] {e}"
                stop.wait(1.0)
                continue
            stats.rejoins += joined_before
            joined_before = True
            log.info("inflight: rank %d joined generation %s serving v%d", rank, group.identity, target.live_version)
            target.channel = group.sub_store(f"{ENGINE_CHANNEL}/{self._inflight_engine_id}")
            target.incarnation = group.incarnation
            self._inflight_listener = UpdateListener(group, target, schema, stats=stats, stale_timeout_s=config.stale_timeout_s,
                                                     check_finite=config.check_finite, pool=self._inflight_pool,
                                                     keep_rollback=config.keep_rollback)
            try:
                self._inflight_listener.run(stop)
            except TransportError as e:
                log.warning("inflight: lost the weight group (%s); staging dropped, still serving v%d; rejoining",
                            e, target.live_version)
            except Exception as e:  # keep the engine serving; the status call reports it
                stats.last_error = f"[crash] {e!r}"
                log.exception("inflight: listener crashed; rejoining")
                stop.wait(1.0)
            finally:
                group.close()
            if self._inflight_listener.trainer_left:  # rejoin only once its store is gone (or replaced)
                try:
                    await_trainer_gone(config.group, group.incarnation, stop)
                except InterruptedError:
                    return

    def _inflight_data_device(self, config: InflightConfig) -> torch.device:
        if config.group.resolved_backend() == "nccl":
            return torch.device(self.model_runner.device)
        return torch.device("cpu")

    def inflight_commit(self, version: int) -> dict[str, Any]:
        return self._inflight_target.execute_commit(version)

    def inflight_rollback(self, version: int) -> dict[str, Any]:
        return self._inflight_target.execute_rollback(version)

    def inflight_take_routing(self) -> tuple[list[str], Any]:
        """The last forward's routing rows (``engine_patches.routing``); called by EngineCore after each step."""
        return self._inflight_routing.take()

    def inflight_status(self) -> dict[str, Any]:
        target: _EngineTarget | None = getattr(self, "_inflight_target", None)
        if target is None or getattr(self, "_inflight_thread", None) is None:
            return {"started": False}
        listener = self._inflight_listener
        stats: ListenerStats = self._inflight_stats
        return {
            "started": True,
            "rank": target.rank,
            "joined": listener is not None,
            "listening": self._inflight_thread.is_alive(),
            "generation": list(listener.group.identity) if listener else None,
            "live_version": target.live_version,
            "forward_steps": target.forwards,
            "committed": stats.committed,
            "rejections": dict(stats.rejections),
            "rejoins": stats.rejoins,
            "dropped_staging": stats.dropped_staging,
            "last_error": stats.last_error,
            "commits": list(target.commits),
        }

    def inflight_stop(self) -> None:
        if getattr(self, "_inflight_thread", None) is None:
            return
        atexit.unregister(self._inflight_atexit)
        self._inflight_stop.set()
        self._inflight_thread.join(timeout=10)
        self._inflight_hook.remove()
        if self._inflight_routing is not None:
            self._inflight_routing.close()
        close = getattr(self._inflight_target.applier, "close", None)  # the swap commit's re-pack thread
        if close is not None:
            close()
        self._inflight_thread = None


def _refuse_sampling_defaults(model_config: Any) -> None:
    """Refuse an engine that would sample requests with transforms the trainer does not apply.

    vLLM fills every sampling parameter a request leaves unset from the model's
    ``generation_config.json`` (``LLM.generate`` without ``SamplingParams``, every OpenAI
    request of ``vllm serve``) unless the engine runs with ``generation_config="vllm"``.
    Behaviour log-probs are the processed distribution, after those transforms; the trainer
    scores its policy with the temperature alone, so e.g. Qwen2.5-Instruct's top_k=20,
    top_p=0.8, repetition_penalty=1.05 would bias every importance ratio."""
    defaults = model_config.get_diff_sampling_param()
    known = {k: v for k, v in defaults.items() if k in Sampling.__struct_fields__}
    transforms = Sampling(**known).transforms()
    if transforms:
        raise RuntimeError(
            f"inflight: this engine applies sampling defaults from {model_config.generation_config!r} "
            f"({', '.join(transforms)}) to every request that does not set them, and the trainer's log-probs apply only "
            "the temperature: start the engine with generation_config='vllm' (engine_kwargs() does; "
            "`--generation-config vllm` for vllm serve)")
