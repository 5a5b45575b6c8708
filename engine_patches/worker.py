"""The drop-in vLLM worker extension: ``--worker-extension-cls engine_patches.worker.InflightWorkerExtension``.

It only adds methods (vLLM forbids overriding worker methods from an extension), all
called through ``collective_rpc``:

- ``inflight_start(config_json)``: check the engine can commit in flight, register the
  step gate, and start the listener thread, which joins the weight group and then stages
  every update while the engine keeps decoding (and rejoins whenever the group fails);
- ``inflight_status()``: live version, steps, counters, the last error;
- ``inflight_stop()``: leave the group and unregister the gate.

The listener thread lands buckets in staging buffers of its own; the live weights are
touched only inside ``StepGate.commit``, between two engine steps.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch

from engine_patches.apply import checkpoint_dir, checkpoint_schema, make_applier
from engine_patches.config import InflightConfig
from engine_patches.gate import StepGate
from inflight.transport.group import TransportError, WeightGroup
from inflight.transport.listener import CommitFailed, CommitInfo, ListenerStats, UpdateListener

log = logging.getLogger("inflight.worker")


class _EngineTarget:
    """The listener's view of this engine: version, step count, prepare, and the gated commit."""

    def __init__(self, gate: StepGate, applier: Any, timeout_s: float) -> None:
        self.gate = gate
        self.applier = applier
        self.timeout_s = timeout_s

    @property
    def live_version(self) -> int:
        return self.gate.live_version

    def steps(self) -> int:
        return self.gate.steps

    def prepare(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.applier.prepare(weights)

    def discard(self) -> None:
        self.applier.discard()

    def commit(self, version: int, weights: dict[str, torch.Tensor], previous: Mapping[str, torch.Tensor] | None) -> CommitInfo:
        def apply() -> None:
            try:
                self.applier.apply()
            except Exception as e:
                self.applier.restore(previous)  # if this raises too, the engine is broken: let it surface
                raise CommitFailed(f"applying v{version} failed ({e!r}); v{self.gate.live_version} restored") from e

        try:
            return self.gate.commit(version, apply, self.timeout_s)
        except TimeoutError as e:
            raise CommitFailed(str(e)) from e


class InflightWorkerExtension:
    """Mixed into vLLM's Worker; ``self`` is the worker (``model_runner``, ``vllm_config``, ``rank``)."""

    def inflight_start(self, config_json: str) -> dict[str, Any]:
        config = InflightConfig.from_json(config_json)
        if getattr(self, "_inflight_thread", None) is not None:
            raise RuntimeError("inflight: already started on this worker")
        self._inflight_check_engine(config)
        vc = self.vllm_config
        schema = checkpoint_schema(checkpoint_dir(vc.model_config.model, vc.model_config.revision), vc.model_config.dtype)
        applier = make_applier(self.model_runner, config.commit, schema, quantized=vc.model_config.quantization is not None,
                               eager=vc.model_config.enforce_eager)
        gate = StepGate(vc.instance_id, config.initial_version)
        gate.register()
        self._inflight_gate = gate
        self._inflight_target = _EngineTarget(gate, applier, config.commit_timeout_s)
        self._inflight_stop = threading.Event()
        self._inflight_listener: UpdateListener | None = None
        self._inflight_stats = ListenerStats()
        self._inflight_thread = threading.Thread(
            target=self._inflight_serve, args=(config, schema), name=f"inflight-listener-{config.rank}", daemon=True
        )
        self._inflight_thread.start()
        return {"rank": config.rank, "instance_id": vc.instance_id, "commit": applier.strategy,
                "schema_tensors": len(schema.tensors)}

    def _inflight_check_engine(self, config: InflightConfig) -> None:
        from engine_patches.patch import is_patched

        vc = self.vllm_config
        problems = []
        if not is_patched():
            problems.append("the inflight vLLM plugin is not loaded (install this package; check VLLM_PLUGINS)")
        if vc.scheduler_config.async_scheduling:
            problems.append("async_scheduling must be False")
        if vc.parallel_config.pipeline_parallel_size != 1 or vc.parallel_config.tensor_parallel_size != 1:
            problems.append("one worker per engine (tensor/pipeline parallel size 1); scale out with more engines")
        if vc.cache_config.enable_prefix_caching:
            problems.append("enable_prefix_caching must be False (cached KV would cross versions)")
        if vc.speculative_config is not None:
            problems.append("speculative decoding is not supported")
        if config.require_processed_logprobs and vc.model_config.logprobs_mode != "processed_logprobs":
            problems.append(f"logprobs_mode is {vc.model_config.logprobs_mode!r}, need 'processed_logprobs'")
        if problems:
            raise RuntimeError("inflight cannot run on this engine: " + "; ".join(problems) +
                               ". engine_patches.config.engine_kwargs() sets all of these.")

    def _inflight_serve(self, config: InflightConfig, schema) -> None:
        """The listener thread: join the group, stage and commit updates, and whenever the
        group fails (trainer killed, a stalled transfer timed out) drop what was staged, keep
        serving the live version, and join the next generation the trainer opens."""
        if config.listener_nice and hasattr(os, "setpriority"):  # per thread on Linux
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), config.listener_nice)
        if torch.cuda.is_available() and self.model_runner.device.type == "cuda":
            # verify and stage on a side stream so checksums never queue behind the forward pass
            torch.cuda.set_device(self.model_runner.device)
            torch.cuda.set_stream(torch.cuda.Stream())
        stats, stop, gate = self._inflight_stats, self._inflight_stop, self._inflight_gate
        joined_before = False
        while not stop.is_set():
            try:
                group = WeightGroup(config.group, config.rank, device=self._inflight_data_device(config),
                                    live_version=gate.live_version, stop=stop, join_timeout_s=None)
            except InterruptedError:
                return
            except TransportError as e:  # the store went away while joining: try again
                stats.last_error = f"[join] {e}"
                stop.wait(1.0)
                continue
            stats.rejoins += joined_before
            joined_before = True
            log.info("inflight: rank %d joined generation %s serving v%d", config.rank, group.identity, gate.live_version)
            self._inflight_listener = UpdateListener(group, self._inflight_target, schema, stats=stats,
                                                     stale_timeout_s=config.stale_timeout_s, check_finite=config.check_finite)
            try:
                self._inflight_listener.run(stop)
            except TransportError as e:
                log.warning("inflight: lost the weight group (%s); staging dropped, still serving v%d; rejoining",
                            e, gate.live_version)
            except Exception as e:  # keep the engine serving; the status call reports it
                stats.last_error = f"[crash] {e!r}"
                log.exception("inflight: listener crashed; rejoining")
                stop.wait(1.0)
            finally:
                group.close()

    def _inflight_data_device(self, config: InflightConfig) -> torch.device:
        if config.group.resolved_backend() == "nccl":
            return torch.device(self.model_runner.device)
        return torch.device("cpu")

    def inflight_status(self) -> dict[str, Any]:
        gate: StepGate | None = getattr(self, "_inflight_gate", None)
        if gate is None:
            return {"started": False}
        listener = self._inflight_listener
        stats: ListenerStats = self._inflight_stats
        return {
            "started": True,
            "joined": listener is not None,
            "listening": self._inflight_thread.is_alive(),
            "generation": list(listener.group.identity) if listener else None,
            "live_version": gate.live_version,
            "steps": gate.steps,
            "committed": stats.committed,
            "rejections": dict(stats.rejections),
            "rejoins": stats.rejoins,
            "dropped_staging": stats.dropped_staging,
            "last_error": stats.last_error,
        }

    def inflight_stop(self) -> None:
        gate: StepGate | None = getattr(self, "_inflight_gate", None)
        if gate is None:
            return
        self._inflight_stop.set()
        self._inflight_thread.join(timeout=10)
        gate.unregister()
        self._inflight_gate = None
        self._inflight_thread = None
