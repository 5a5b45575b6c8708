"""vLLM's RL API on an engine whose weight-transfer backend is ``inflight``: EngineCore's side.

The API's calls (``/pause``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/resume``; ``LLM``'s methods; ``TrainerWeightTransferEngine``) reach EngineCore between two engine
steps, and the patch (``inflight.engine.patch``) hands them here:
- ``init_weight_transfer_engine(init_info)``: an ``InflightConfig`` starts the engine (the same config
  again drops an update a restarted trainer left open; another is refused, naming the fields that
  differ); vLLM's ``nccl`` init info joins that trainer's group for its packed broadcast
  (``wire_config``); ``{"checkpoints": true}`` reads each update from ``update_info.weight_dir``
  (``checkpoint_config``; ``inflight.engine.checkpoint_reader``);
- start, update, finish: the worker extension's ``inflight_rl_*`` methods, each returning at once;
  a draft's own update is refused (its tensors travel in the target's); shutdown is ``inflight_stop``;
- ``set_weight_version(v)``: accepted only for the version served or the update announced, and never
  moves the label: the coordinator moves it at the commit, so no token old weights sampled carries it;
- ``pause_scheduler(mode="keep")``: decoding goes on (the backend's one opt-in deviation from vLLM);
  ``is_scheduler_paused`` says so; ``abort`` and ``wait`` still pause.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Callable

import msgspec

from inflight.engine.engine_config import WORKER_EXTENSION, InflightConfig
from inflight.engine.rpc import ENGINE_SETUP, OUT_OF_ORDER
from inflight.engine.transfer_engine import BACKEND, RLApiError

log = logging.getLogger("inflight.rl_api")

ATTR = "_inflight_rl_api"
"""Attribute of the ``EngineCore`` that holds its ``RLApiState``."""

WORKER_METHODS = {"start_weight_update": "inflight_rl_start", "update_weights": "inflight_rl_update",
                  "finish_weight_update": "inflight_rl_finish"}
"""vLLM's worker methods and the worker extension's methods they become on this backend."""
METHODS = {*WORKER_METHODS, "init_weight_transfer_engine", "start_draft_weight_update",
           "shutdown_weight_transfer_engine"}


@dataclass
class RLApiState:
    """What EngineCore remembers of the RL API's calls."""

    announced: int | None = None
    """The version of the last update a client announced (``update_weights``)."""
    sleeping: bool = False
    """Inside ``sleep``: its pause is a real one, whatever the mode."""
    channel: Any = None
    """On vLLM's nccl wire: (port, the store) EngineCore hosts for its commit channel."""


def uses_backend(core: Any) -> bool:
    """Whether ``core``'s engine runs the ``inflight`` weight-transfer backend."""
    wtc = getattr(core.vllm_config, "weight_transfer_config", None)
    return wtc is not None and wtc.backend == BACKEND


def state(core: Any) -> RLApiState:
    if ATTR not in core.__dict__:
        core.__dict__[ATTR] = RLApiState()
    return core.__dict__[ATTR]


def config_of(init_info: Any) -> InflightConfig:
    """``init_info`` (an ``InflightConfig`` as a JSON object or string) as the config it names."""
    if not isinstance(init_info, (str, bytes, dict)):
        raise RLApiError(f"inflight: init_info must be an InflightConfig as a JSON object, not "
                         f"{type(init_info).__name__}")
    try:
        return InflightConfig.from_json(init_info if isinstance(init_info, (str, bytes))
                                        else msgspec.json.encode(init_info))
    except (ValueError, msgspec.MsgspecError) as e:
        raise RLApiError(f"inflight: init_info: {e}") from None


def call(core: Any, method: str, kwargs: dict[str, Any], rpc: Callable[..., list[Any]],
         start: Callable[[InflightConfig], list[Any]], coordinator: Any) -> list[Any]:
    """One call of vLLM's RL API on ``core``: ``rpc(method, args, kwargs)`` reaches the
    workers (EngineCore's patched ``collective_rpc``: under the coordinator's lock, between two
    steps), ``start(config)`` starts the engine as ``inflight_start`` does."""
    if method == "init_weight_transfer_engine":
        return _init(core, kwargs, rpc, start, coordinator)
    if method == "start_draft_weight_update":
        raise RLApiError("inflight: start_draft_weight_update: draft model updates are refused apart from the "
                         "target's: a draft's tensors travel in the target's update, named 'draft.<name>', and "
                         "commit with it (inflight.engine.commit.drafted)")
    if coordinator is None:
        raise RLApiError(f"inflight: {method} before init_weight_transfer_engine", OUT_OF_ORDER)
    if method == "shutdown_weight_transfer_engine":
        return rpc("inflight_stop", (), None)
    results = settled(rpc, WORKER_METHODS[method], kwargs)  # between two steps, as every RPC on an in-flight engine
    if method == "update_weights":
        state(core).announced = results[0].version
    return results


def settled(rpc: Callable[..., list[Any]], method: str, kwargs: dict[str, Any] | None,
            abandon: str = "inflight_rl_abandon") -> list[Any]:
    """Every worker's ``RLCallResult`` of ``method``; raises ``RLApiError`` if any refused. Where
    some ranks took a call the others refused, the update is dropped on every rank (``abandon``),
    so the engine's ranks never disagree on what is open."""
    from inflight.engine.rpc import RLCallResult, as_result

    results = [as_result(r, RLCallResult) for r in rpc(method, (), kwargs)]
    refused = [r for r in results if not r.ok]
    if not refused:
        return results
    reasons = sorted({r.error for r in refused})
    if len(refused) < len(results):
        rpc(abandon, (), None)
        reasons.append(f"(ranks {sorted(r.rank for r in results if r.ok)} had taken it: the update is dropped on every "
                       "rank; start again)")
    raise RLApiError("; ".join(reasons), max(r.status for r in refused))


def _init(core: Any, kwargs: dict[str, Any], rpc: Callable[..., list[Any]],
          start: Callable[[InflightConfig], list[Any]], coordinator: Any) -> list[Any]:
    ext = core.vllm_config.parallel_config.worker_extension_cls
    if ext != WORKER_EXTENSION:
        raise RLApiError(f"inflight: the inflight backend needs the worker extension: start the engine with "
                         f"worker_extension_cls={WORKER_EXTENSION!r} (--worker-extension-cls; engine_kwargs() sets "
                         f"it), not {ext!r}", ENGINE_SETUP)
    init_info = (kwargs or {}).get("init_info")
    if is_checkpoint_source(init_info):
        config = checkpoint_config(core, init_info)
    elif is_packed_wire(init_info):
        config = wire_config(core, init_info)
        if coordinator is not None and coordinator.config.wire is not None:  # a new trainer of the nccl wire
            log.info("inflight: init_weight_transfer_engine again on vLLM's nccl wire: joining the new trainer's group")
            return settled(rpc, "inflight_rl_rejoin", {"wire_json": msgspec.json.encode(config.wire).decode()})
    else:
        config = config_of(init_info)
    if coordinator is None:
        return start(config)
    if coordinator.config != config:
        differ = [f.name for f in fields(InflightConfig)
                  if getattr(config, f.name) != getattr(coordinator.config, f.name)]
        raise RLApiError(f"inflight: init_weight_transfer_engine twice with another config (fields {differ} differ): "
                         "this engine serves one weight group; restart it to join another", OUT_OF_ORDER)
    # a restarted trainer: its workers rejoin the new store by themselves; an update the last
    # trainer left open is gone with it
    log.info("inflight: init_weight_transfer_engine again with the same config: a new trainer; open updates dropped")
    return settled(rpc, "inflight_rl_abandon", None)


def is_packed_wire(init_info: Any) -> bool:
    """Whether ``init_info`` is the init info of vLLM's ``nccl`` backend (``rank_offset`` is its
    own field), as its trainers send it, rather than an ``InflightConfig``."""
    return isinstance(init_info, dict) and "rank_offset" in init_info


def is_checkpoint_source(init_info: Any) -> bool:
    """Whether ``init_info`` asks for an engine that reads checkpoint directories
    (``{"checkpoints": true}``, other ``InflightConfig`` fields beside it, no ``group``)."""
    return isinstance(init_info, dict) and init_info.get("checkpoints") is True and "group" not in init_info


def checkpoint_config(core: Any, init_info: dict[str, Any] | None = None) -> InflightConfig:
    """The engine's config reading checkpoint directories: ``init_info``'s fields (defaults
    where none) and a commit channel on a store this EngineCore hosts on loopback."""
    group = engine_channel(core)
    return config_of({**(init_info or {}), "checkpoints": True, "group": msgspec.to_builtins(group)})


def engine_channel(core: Any) -> Any:
    """The ``GroupConfig`` of a commit channel on a store this EngineCore hosts on loopback
    (held in its ``RLApiState``), for an engine without a trainer's weight group. An engine's
    workers must share EngineCore's host."""
    from datetime import timedelta

    from inflight.transport.group_config import GroupConfig
    from inflight.transport.store import host_store, reserve_port

    workers = core.vllm_config.parallel_config.world_size
    st = state(core)
    if st.channel is None:
        port = reserve_port("127.0.0.1")
        st.channel = (port, host_store("127.0.0.1", port, 1 + workers, timedelta(seconds=120)))
    return GroupConfig(host="127.0.0.1", port=st.channel[0], world_size=1 + workers, backend="gloo",
                       name="inflight-engine")


def wire_config(core: Any, init_info: dict[str, Any]) -> InflightConfig:
    """The engine's config on vLLM's ``nccl`` wire: the trainer's group from ``init_info``, and
    a commit channel on a store this EngineCore hosts on loopback (``engine_channel``)."""
    from inflight.engine.engine_config import PackedWireConfig, refuse_unknown

    try:
        refuse_unknown(PackedWireConfig, init_info, "init_info (vLLM's nccl backend)")
        wire = msgspec.convert(init_info, PackedWireConfig)
    except (ValueError, msgspec.ValidationError) as e:
        raise RLApiError(f"inflight: {e}") from None
    workers = core.vllm_config.parallel_config.world_size
    if wire.world_size < wire.rank_offset + workers:
        raise RLApiError(f"inflight: init_info.world_size={wire.world_size} has no room for this engine's {workers} "
                         f"workers at rank_offset={wire.rank_offset}")
    return InflightConfig(group=engine_channel(core), wire=wire)


def check_label(core: Any, weight_version: Any, coordinator: Any) -> None:
    """Refuse a label that is neither the version this engine serves nor the update a client
    announced; an accepted one changes nothing now (the commit moves the label)."""
    if coordinator is None:
        raise RLApiError("inflight: set_weight_version before init_weight_transfer_engine: the label of an in-flight "
                         "engine moves only with a commit", OUT_OF_ORDER)
    try:
        version = int(str(weight_version))
    except ValueError:
        raise RLApiError(f"inflight: weight_version={weight_version!r} must be an integer: each token is tagged with "
                         "the integer version that sampled it") from None
    announced = state(core).announced
    if version != coordinator.live_version and version != announced:
        raise RLApiError(f"inflight: weight_version={version} names no update: the engine serves "
                         f"v{coordinator.live_version}"
                         f"{'' if announced is None else f' and was told of v{announced}'}; the label moves to an "
                         "announced version at its commit", OUT_OF_ORDER)
