"""The drop-in vLLM worker extension: ``--worker-extension-cls inflight.engine.worker.InflightWorkerExtension``.

It only adds methods (vLLM forbids overriding worker methods from an extension), all called through
``collective_rpc``:
- ``inflight_start(config_json)``: reserve staging memory (or refuse, naming the bytes; on an engine built with
  a staging intent, against what was set aside before vLLM sized its KV cache: ``inflight.engine.kv_budget``),
  build the commit strategy, and start the listener thread, which joins the weight group as rank
  ``config.rank + <vLLM worker rank>`` and stages every update while the engine keeps decoding (and rejoins
  whenever the group fails). It passes through the patched ``EngineCore.collective_rpc``, which checks the
  engine and attaches the commit coordinator first (``inflight.engine.coordinator``);
- ``inflight_commit(v)``, then ``inflight_confirm(v)`` or ``inflight_rollback(v)``: called by the coordinator,
  between two engine steps, on this worker's execution thread: apply the prepared version, then keep it (every
  rank applied it) or take it back (another rank of the engine failed);
- ``inflight_status()``, ``inflight_stop()``.

Ordering invariants: live weights, the live version and the rollback copy are touched only by
``inflight_commit``, ``inflight_confirm`` and ``inflight_rollback``, on the execution thread, between steps,
for a version this worker fully staged and prepared and for which the trainer sent ``Commit``. The listener
thread only stages, prepares, announces readiness and relays the engine's outcome.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import weakref
from pathlib import Path
from typing import Any

import msgspec
import torch

from inflight.auth import read_secret
from inflight.engine.checkpoint_reader import CheckpointReader
from inflight.engine.commit.base import CommitStrategy
from inflight.engine.commit.drafted import start_model
from inflight.engine.commit.engine_checkpoint import (
    checkpoint_dir,
    read_checkpoint_into,
)
from inflight.engine.commit.target import EngineTarget
from inflight.engine.engine_config import InflightConfig, PackedWireConfig
from inflight.engine.kv_budget import SET_ASIDE_ATTR, planned_need
from inflight.engine.packed_receiver import PackedReceiver, close_wire, join_wire
from inflight.engine.patch import count_worker_steps
from inflight.engine.rpc import ENGINE_SETUP, OUT_OF_ORDER, RLCallResult, StartReport, WorkerStatus
from inflight.engine.spec_decode import fix_cpu_expand_kernel_vllm_0_32
from inflight.engine.transfer_engine import InflightWeightTransferEngine, RLApiError
from inflight.memory import (
    BucketWindows,
    MemoryBudget,
    StagingNeed,
    check_fits,
    memory_budget,
)
from inflight.protocol import (
    ENGINE_CHANNEL,
    Sampling,
    ShardPlan,
    WorkerCommitResult,
    WorkerSettleResult,
)
from inflight.staging import StagedVersion, StagingPool
from inflight.transport.bucket import dtype_name, torch_dtype
from inflight.transport.data_plane import nccl_error_handling_once
from inflight.transport.errors import TransportError
from inflight.transport.group import WeightGroup
from inflight.transport.listener import ListenerStats, UpdateListener
from inflight.transport.schema import TensorSchema

log = logging.getLogger("inflight.worker")


class InflightWorkerExtension:
    """Mixed into vLLM's Worker; ``self`` is the worker (``model_runner``, ``vllm_config``, ``rank``)."""

    def inflight_start(self, config_json: str, engine_id: str | None = None) -> StartReport:
        if engine_id is None:  # the call did not pass through the patched EngineCore.collective_rpc
            raise RuntimeError("inflight: EngineCore did not attach a commit coordinator: the inflight vLLM plugin is "
                               "not loaded in EngineCore's process (install this package; check VLLM_PLUGINS)")
        config = InflightConfig.from_json(config_json)
        if not set(config.listener_cpus) <= set(range(os.cpu_count() or 1)):
            raise ValueError(f"inflight: InflightConfig.listener_cpus={config.listener_cpus}: this host has CPUs "
                             f"0..{(os.cpu_count() or 1) - 1}")
        if getattr(self, "_inflight_thread", None) is not None:
            raise RuntimeError("inflight: already started on this worker")
        device = torch.device(self.model_runner.device)
        # first, on every rank alike: each measures before any allocates, and learns how many
        # of this engine's workers share its host RAM
        budget, node_workers = memory_budget(device), _same_node_workers()
        vc = self.vllm_config
        _refuse_sampling_defaults(vc.model_config)
        fix_cpu_expand_kernel_vllm_0_32(vc)
        rank = config.rank + self.rank
        secret = read_secret()  # once: the environment at the engine's start decides
        if config.group.resolved_backend() == "nccl":
            nccl_error_handling_once()  # on the worker's own thread, before the listener's start
        config.group.check_exposure(secret, f"inflight worker rank {rank}")
        if config.adapter is not None:  # adapter-only: the base weights never move
            from inflight.engine.adapter_engine import start_adapter

            schema, strategy = start_adapter(self.model_runner, config.adapter)
        else:  # the target, and a draft model where vLLM runs one
            schema, strategy = start_model(self.model_runner, config, vc)
        from inflight.engine.routing import RoutingRecorder

        self._inflight_routing = RoutingRecorder(self.model_runner) if config.record_routing else None
        plan = strategy.shard_plan()  # what this rank's loaders read, sent to the trainer in each hello
        pool, need = self._inflight_reserve(config, schema, strategy, device, budget, node_workers, secret is not None,
                                            plan)
        target = EngineTarget(strategy, config, rank, device)
        target.execution_thread = threading.get_ident()  # collective RPCs run on the execution thread
        self._inflight_target = target
        count_worker_steps(self)  # per engine step, CUDA graph or not
        self._inflight_pool = pool
        self._inflight_engine_id = engine_id
        self._inflight_stop = threading.Event()
        self._inflight_secret = secret
        self._inflight_listener: UpdateListener | None = None
        self._inflight_stats = ListenerStats()
        self._inflight_thread = self._inflight_listen(config, schema, rank, plan, target)
        _bind_rl_api(self, schema, target, self._inflight_wire, self._inflight_checkpoints)
        # the listener stops with the interpreter too (a plain exit, no engine shutdown), before
        # the objects its thread uses are torn down under it
        ref = weakref.ref(self)
        self._inflight_atexit = lambda: (w := ref()) is not None and w.inflight_stop()
        atexit.register(self._inflight_atexit)
        routing = self._inflight_routing
        return StartReport(rank=rank, instance_id=engine_id, commit=strategy.name, schema_tensors=len(schema.tensors),
                           staging=need.where, reserved_bytes=need.nbytes, node_workers=node_workers,
                           plan_digest="" if plan is None else plan.digest,
                           routing=None if routing is None else (routing.layers, routing.top_k))

    def _inflight_reserve(self, config: InflightConfig, schema: TensorSchema, strategy: CommitStrategy,
                          device: torch.device, budget: MemoryBudget, node_workers: int, mac: bool,
                          plan: ShardPlan | None) -> tuple[StagingPool, StagingNeed]:
        """Check that everything staging holds fits where it will live (``inflight.memory``),
        then allocate it now, at its exact size."""
        data = self._inflight_data_device(config)
        bucket_bytes = int(config.max_bucket_mb * (1 << 20))
        need = planned_need(schema, strategy, plan, staging=config.staging, keep_rollback=config.keep_rollback,
                            bucket_bytes=bucket_bytes, engine=device, data=data, mac=mac, keep_base=config.keep_base)
        # an engine built with a staging intent kept its device bytes out of the KV cache: the
        # config must fit in those, not in the free memory (which holds vLLM's activation peak)
        check_fits(need, device=device, budget=budget, node_workers=node_workers,
                   gpu_memory_utilization=getattr(self.vllm_config.cache_config, "gpu_memory_utilization", None),
                   set_aside=getattr(self, SET_ASIDE_ATTR, None))
        pool = StagingPool(data if config.staging == "device" else torch.device("cpu"), pin=need.where == "host",
                           keep_base=config.keep_base)
        pool.reserve(need.update_bytes, need.copies)
        pool.windows = BucketWindows.reserve(bucket_bytes, data, landing=data.type == "cuda" and need.where == "host",
                                             mac=mac)
        if any(p.what == "rollback copy" for p in need.parts):
            # what a failed first commit restores, read now: never from disk inside the stall
            vc = self.vllm_config.model_config
            flat = pool.take(need.update_bytes)
            # with a shard plan the copy holds this rank's boxes, as the updates it stages do
            pool.previous = StagedVersion(None, flat, 0, read_checkpoint_into(checkpoint_dir(vc.model, vc.revision),
                                                                              schema, flat, plan))
        return pool, need

    def _inflight_serve(self, config: InflightConfig, schema: TensorSchema, rank: int, plan: ShardPlan | None) -> None:
        """The listener thread: join the group, stage and commit updates, and whenever the
        group fails (trainer killed, a stalled transfer timed out) drop what was staged, keep
        serving the live version, and join the next generation the trainer opens."""
        if config.listener_nice and hasattr(os, "setpriority"):  # per thread on Linux
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), config.listener_nice)
        if config.listener_cpus:  # this thread only: threads it starts (gloo's, a prepare pool) inherit it
            os.sched_setaffinity(0, config.listener_cpus)
        if torch.cuda.is_available() and self.model_runner.device.type == "cuda":
            # verify and stage on a side stream so checksums never queue behind the forward pass
            torch.cuda.set_device(self.model_runner.device)
            torch.cuda.set_stream(torch.cuda.Stream())
        stats, stop, target = self._inflight_stats, self._inflight_stop, self._inflight_target
        own = dtype_name(self.vllm_config.model_config.dtype)  # tensors kept in a dtype of their own travel in it
        kept = {n: d for n, (_, d) in schema.tensors.items()
                if config.adapter is None and d != own and torch_dtype(d).is_floating_point}
        secret = self._inflight_secret
        joined_before = False
        while not stop.is_set():
            try:
                engine_ranks = tuple(range(config.rank, config.rank + self.vllm_config.parallel_config.world_size))
                group = WeightGroup(config.group, rank, device=self._inflight_data_device(config),
                                    live_version=target.live_version, stop=stop, join_timeout_s=None,
                                    engine_ranks=engine_ranks, secret=secret, plan=plan, commit_unit=config.commit_unit,
                                    label="" if not target.label.steps else str(target.label), wire_dtypes=kept,
                                    keeps_base=config.keep_base)
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
            self._inflight_listener = UpdateListener(group, target, schema, stats=stats,
                                                     stale_timeout_s=config.stale_timeout_s,
                                                     check_finite=config.check_finite, pool=self._inflight_pool,
                                                     plan=plan, staged_groups=config.staged_groups)
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
                    config.group.await_trainer_gone(group.incarnation, stop)
                except InterruptedError:
                    return

    def _inflight_listen(self, config: InflightConfig, schema: TensorSchema, rank: int, plan: ShardPlan | None,
                         target: EngineTarget) -> threading.Thread:
        """Start the listener thread: on the trainer's weight group, on vLLM's nccl wire, or
        reading checkpoint directories."""
        self._inflight_wire = None if config.wire is None else self._inflight_join_wire(config, schema, plan, target)
        self._inflight_checkpoints = None
        if config.checkpoints:  # commits go through this engine's own channel (a store EngineCore hosts)
            target.channel = config.group.connect(f"{ENGINE_CHANNEL}/{self._inflight_engine_id}")
            self._inflight_checkpoints = CheckpointReader(target=target, schema=schema, pool=self._inflight_pool,
                                                          plan=plan, stats=self._inflight_stats,
                                                          check_finite=config.check_finite)
        queue = self._inflight_wire or self._inflight_checkpoints
        serve, args = ((self._inflight_serve, (config, schema, rank, plan)) if queue is None
                       else (queue.run, (self._inflight_stop,)))
        thread = threading.Thread(target=serve, args=args, name=f"inflight-listener-{rank}", daemon=True)
        thread.start()
        return thread

    def _inflight_join_wire(self, config: InflightConfig, schema: TensorSchema, plan: ShardPlan | None,
                            target: EngineTarget) -> PackedReceiver:
        """vLLM's ``nccl`` wire (``InflightConfig.wire``): join the trainer's group now, as vLLM's
        init does; commits go through this engine's own channel (a store EngineCore hosts)."""
        assert config.wire is not None
        device = self._inflight_data_device(config)
        wire = join_wire(config.wire, self.vllm_config.parallel_config, device, config.stale_timeout_s,
                         self._inflight_stop)
        target.channel = config.group.connect(f"{ENGINE_CHANNEL}/{self._inflight_engine_id}")
        return PackedReceiver(wire, packed=config.wire.packed, buffer_size_bytes=config.wire.packed_buffer_size_bytes,
                              target=target, schema=schema, pool=self._inflight_pool, plan=plan,
                              stats=self._inflight_stats, check_finite=config.check_finite, device=device)

    def inflight_rl_rejoin(self, wire_json: str) -> RLCallResult:
        """A new ``init_weight_transfer_engine`` on the packed wire (a restarted trainer): join its group."""
        receiver: PackedReceiver | None = getattr(self, "_inflight_wire", None)
        rank = self._inflight_target.rank
        if receiver is None:
            return RLCallResult(rank=rank, ok=False, error="inflight: this engine does not receive vLLM's nccl wire")
        try:
            wire = msgspec.json.decode(wire_json, type=PackedWireConfig)
            receiver.rejoin(join_wire(wire, self.vllm_config.parallel_config, receiver.device,
                                      self._inflight_target.config.stale_timeout_s, self._inflight_stop))
        except (ValueError, TransportError, msgspec.ValidationError) as e:
            return RLCallResult(rank=rank, ok=False, error=f"inflight: joining the trainer's group failed: {e}")
        return RLCallResult(rank=rank)

    def _inflight_data_device(self, config: InflightConfig) -> torch.device:
        if config.group.resolved_backend() == "nccl" or (config.wire is not None and torch.cuda.is_available()):
            return torch.device(self.model_runner.device)
        return torch.device("cpu")

    def inflight_commit(self, version: int, final: bool = False, part: int = 0, parts: int = 0) -> WorkerCommitResult:
        return self._inflight_target.execute_commit(version, final, part, parts)

    def inflight_confirm(self, version: int) -> WorkerSettleResult:
        return self._inflight_target.execute_confirm(version)

    def inflight_rollback(self, version: int) -> WorkerSettleResult:
        return self._inflight_target.execute_rollback(version)

    # -- vLLM's RL API on the inflight backend (EngineCore routes its calls here: inflight.engine.rl_api) --
    def inflight_rl_start(self) -> RLCallResult:
        return self._inflight_rl_call(lambda engine: engine.start_weight_update())

    def inflight_rl_update(self, update_info: dict | list[dict]) -> RLCallResult:
        """``update_info``: one for every worker, or a list indexed by worker rank (as vLLM's)."""
        def update(engine: InflightWeightTransferEngine) -> int | None:
            info = update_info
            if isinstance(info, list):
                workers = self.vllm_config.parallel_config.world_size
                if len(info) != workers:
                    raise RLApiError(f"inflight: update_info is a list of {len(info)}; this engine has {workers} "
                                     "workers")
                info = info[self.rank]
            engine.update_weights(info)
            return engine.open_version
        return self._inflight_rl_call(update)

    def inflight_rl_finish(self) -> RLCallResult:
        return self._inflight_rl_call(lambda engine: engine.finish_weight_update())

    def inflight_rl_abandon(self) -> RLCallResult:
        return self._inflight_rl_call(lambda engine: engine.abandon())

    def _inflight_rl_call(self, call: Any) -> RLCallResult:
        """Run ``call(engine)``; a refusal becomes the result's error (see ``RLCallResult``)."""
        rank = self._inflight_target.rank
        try:
            version = call(self._inflight_rl_engine())
        except RLApiError as e:
            return RLCallResult(rank=rank, ok=False, error=str(e), status=e.status)
        return RLCallResult(rank=rank, version=version)

    def _inflight_rl_engine(self) -> InflightWeightTransferEngine:
        engine = getattr(self, "weight_transfer_engine", None)
        if not isinstance(engine, InflightWeightTransferEngine):
            raise RLApiError(f"inflight: this worker's weight-transfer engine is {type(engine).__name__}, not the "
                             "inflight backend's: start the engine with weight_transfer_config={'backend': 'inflight'}",
                             ENGINE_SETUP)
        return engine

    # -- checkpoint directories (prime-rl's worker extension's names: inflight.engine.checkpoint_api) --
    def update_weights_from_path(self, weight_path: str, version: int | None = None) -> RLCallResult:
        """prime-rl's ``collective_rpc("update_weights_from_path", args=(weight_dir,))``: check
        the directory's headers now, read and commit it in flight; returns at once. An earlier
        directory that was refused after its check (a NaN, a failed read) is reported first."""
        rank = self._inflight_target.rank if getattr(self, "_inflight_target", None) else self.rank
        reader: CheckpointReader | None = getattr(self, "_inflight_checkpoints", None)
        try:
            if reader is None:
                raise RLApiError("inflight: update_weights_from_path on an engine that takes its updates from "
                                 "elsewhere (a trainer's weight group, vLLM's nccl wire) or was not started through "
                                 "the inflight plugin's EngineCore (install it; check VLLM_PLUGINS)", OUT_OF_ORDER)
            if (refused := reader.take_refusal()) is not None:
                raise RLApiError(f"inflight: {refused}; this engine serves v{self._inflight_target.live_version} "
                                 f"({weight_path} was not taken: call again to send it)", OUT_OF_ORDER)
            if (again := reader.taken(weight_path, version)) is not None:  # a retry: queued or live already
                return RLCallResult(rank=rank, version=again)
            job = reader.check(weight_path, version)
        except RLApiError as e:
            return RLCallResult(rank=rank, ok=False, error=str(e), status=e.status)
        job.finished.set()  # no session: the directory commits once staged
        reader.expect(job)
        return RLCallResult(rank=rank, version=job.version)

    def inflight_checkpoint_abandon(self) -> RLCallResult:
        """Another rank refused a directory this one queued: drop it here too."""
        if (reader := getattr(self, "_inflight_checkpoints", None)) is not None:
            reader.abandon()
        return RLCallResult(rank=self._inflight_target.rank)

    def init_broadcaster(self, *args: Any) -> None:
        """prime-rl's filesystem worker's no-op (its NCCL broadcast is not taken here)."""
        if args:
            raise ValueError("inflight: init_broadcaster with arguments (prime-rl's NCCL broadcast): this engine takes "
                             "prime-rl's checkpoint directories (weight_broadcast.type = 'filesystem')")

    def liveness_probe(self) -> None:
        """prime-rl's ``/liveness`` RPC: nothing to do."""
        return None

    def inflight_take_routing(self) -> tuple[list[str], Any]:
        """The last forward's routing rows (``inflight.engine.routing``); called by EngineCore after each step."""
        return self._inflight_routing.take()

    def inflight_status(self) -> WorkerStatus:
        target: EngineTarget | None = getattr(self, "_inflight_target", None)
        if target is None or getattr(self, "_inflight_thread", None) is None:
            return WorkerStatus(started=False)
        listener = self._inflight_listener
        stats: ListenerStats = self._inflight_stats
        return WorkerStatus(
            started=True, rank=target.rank, joined=listener is not None, listening=self._inflight_thread.is_alive(),
            generation=listener.group.identity if listener else None, live_version=target.live_version,
            model_steps=target.model_steps, committed=stats.committed, rejections=dict(stats.rejections),
            rejoins=stats.rejoins, dropped_staging=stats.dropped_staging, aborted=stats.aborted,
            last_error=stats.last_error,
            commits=tuple(target.commits), staging_peak_bytes=self._inflight_pool.peak_bytes)

    def inflight_stop(self) -> None:
        if getattr(self, "_inflight_thread", None) is None:
            return
        atexit.unregister(self._inflight_atexit)
        self._inflight_stop.set()
        self._inflight_thread.join(timeout=10)
        if self._inflight_wire is not None:
            close_wire(self._inflight_wire.wire)
        if self._inflight_routing is not None:
            self._inflight_routing.close()
        self._inflight_target.strategy.close()  # the swap commit's re-pack thread
        self._inflight_thread = None


def _bind_rl_api(worker: Any, schema: TensorSchema, target: EngineTarget, receiver: PackedReceiver | None,
                 reader: CheckpointReader | None) -> None:
    """On the inflight backend, give vLLM's weight-transfer engine of this worker the tensors
    an update must match, the version the worker serves and, on vLLM's nccl wire, the
    receiver; reading checkpoints, the reader."""
    engine = getattr(worker, "weight_transfer_engine", None)
    if isinstance(engine, InflightWeightTransferEngine):
        engine.bind(schema, lambda: target.live_version, receiver, reader)


def _same_node_workers() -> int:
    """How many workers of this engine run on this host (this one included): their staging
    shares its RAM. A collective over vLLM's world group: every worker calls it at once."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group().cpu_group
    size = dist.get_world_size(group)
    if size == 1:
        return 1
    boot = Path("/proc/sys/kernel/random/boot_id")  # one per running kernel: containers on a host share it
    here = f"{socket.gethostname()}/{boot.read_text().strip() if boot.exists() else ''}"
    names: list[Any] = [None] * size
    dist.all_gather_object(names, here, group=group)
    return names.count(here)


def _refuse_sampling_defaults(model_config: Any) -> None:
    """Refuse an engine that would sample requests with transforms the trainer does not apply.

    vLLM fills every sampling parameter a request leaves unset from the model's
    ``generation_config.json`` (``LLM.generate`` without ``SamplingParams``, every OpenAI
    request of ``vllm serve``) unless the engine runs with ``generation_config="vllm"``.
    Behaviour log-probs are the processed distribution, after those transforms; the trainer
    scores its policy under the filters the run sets (``rollout.top_k``, ``rollout.top_p``),
    not under defaults it never sees, so e.g. Qwen2.5-Instruct's top_k=20, top_p=0.8,
    repetition_penalty=1.05 would bias every importance ratio."""
    defaults = model_config.get_diff_sampling_param()
    known = {k: v for k, v in defaults.items() if k in Sampling.__struct_fields__}
    transforms = Sampling(**known).transforms()
    if transforms:
        raise RuntimeError(
            f"inflight: this engine applies sampling defaults from {model_config.generation_config!r} "
            f"({', '.join(transforms)}) to every request that does not set them, and the trainer's log-probs apply "
            "only what the run sets: start the engine with generation_config='vllm' (engine_kwargs() does; "
            "`--generation-config vllm` for vllm serve)")
