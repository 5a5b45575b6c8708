"""prime-rl's update path on EngineCore: ``collective_rpc("update_weights_from_path", args=(weight_dir,))``.

prime-rl's inference server answers ``POST /update_weights {"weight_dir": ...}`` with that call on
its worker extension. On this one (``InflightWorkerExtension``) EngineCore starts the engine
reading checkpoint directories if nothing started it (``rl_api.checkpoint_config``), then every
worker checks the directory and queues its read (``update_weights_from_path``); the call returns
at once and the commit lands at a later step boundary. A refusal raises ``RLApiError`` (4xx).
"""

from __future__ import annotations

from typing import Any, Callable

from inflight.engine.engine_config import WORKER_EXTENSION
from inflight.engine.rl_api import checkpoint_config, settled
from inflight.engine.rpc import OUT_OF_ORDER
from inflight.engine.transfer_engine import RLApiError

METHOD = "update_weights_from_path"
"""prime-rl's worker-extension method (``FileSystemWeightUpdateWorker.update_weights_from_path``)."""


def handles(core: Any, method: str) -> bool:
    """Whether ``method`` on ``core`` is prime-rl's update call on this project's worker
    extension (another extension, prime-rl's own included, gets it untouched)."""
    return method == METHOD and core.vllm_config.parallel_config.worker_extension_cls == WORKER_EXTENSION


def call(core: Any, args: tuple, kwargs: dict[str, Any] | None, rpc: Callable[..., list[Any]],
         start: Callable[[Any], list[Any]], coordinator: Any) -> list[Any]:
    """Start the engine if needed, then have every worker take the directory (``rpc``: the
    workers' methods, under the coordinator's lock); each worker's ``RLCallResult``."""
    kwargs = dict(kwargs or {})
    weight_path = args[0] if args else kwargs.pop("weight_path", kwargs.pop("weight_dir", None))
    version = args[1] if len(args) > 1 else kwargs.pop("version", None)
    if kwargs or len(args) > 2:
        raise RLApiError(f"inflight: {METHOD}(weight_path, version=None): unexpected arguments {sorted(kwargs)} "
                         f"{list(args[2:])}")
    if coordinator is None:
        start(checkpoint_config(core))
    elif not coordinator.config.checkpoints:
        raise RLApiError(f"inflight: {METHOD} on an engine that takes its updates from "
                         f"{'vLLM nccl wire' if coordinator.config.wire else 'a trainer weight group'}: restart it "
                         "to read checkpoint directories", OUT_OF_ORDER)
    return settled(rpc, METHOD, {"weight_path": weight_path, "version": version}, abandon="inflight_checkpoint_abandon")
