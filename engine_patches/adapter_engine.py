"""An adapter-only in-flight engine: the checks and the start of its one policy LoRA slot.

Every rollout request of such an engine names the policy adapter (``policy_request``), and
the worker keeps that adapter in slot 0 from start to end (``inflight.engine.commit.
lora_slot``). What vLLM 0.32 would otherwise do with it, and what is done instead:

- another adapter in a request would evict the policy from the one slot, and a request
  without one would decode on the base model while tagged with the policy's version: both
  are refused when the request is added (``check_request``), naming the policy adapter;
- ``load_inplace=True`` reloads the adapter from disk on every step (the first version,
  silently replacing the live one): refused the same way;
- whenever the worker's manager would load the policy adapter from disk again (its cache
  reset, a re-registration), it gets the live version instead (``guard_disk_loads``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inflight.adapter import AdapterSpec
from inflight.engine.commit.engine_checkpoint import checkpoint_schema
from inflight.engine.commit.lora_slot import LoRASlotStrategy
from inflight.transport.schema import TensorSchema


def policy_request(spec: AdapterSpec) -> Any:
    """The ``LoRARequest`` every request to this engine carries."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(spec.name, spec.int_id, spec.path)


def engine_problems(vllm_config: Any, spec: AdapterSpec) -> list[str]:
    """Why this engine cannot serve the policy adapter in flight (empty: it can)."""
    lc = vllm_config.lora_config
    if lc is None:
        return ["InflightConfig.adapter is set but LoRA is off (engine_kwargs(adapter=...) enables it)"]
    problems = []
    if lc.max_loras != 1 or (lc.max_cpu_loras or lc.max_loras) != 1:
        problems.append(f"max_loras={lc.max_loras}, max_cpu_loras={lc.max_cpu_loras}: an adapter engine has one slot "
                        "and caches one adapter, the policy's (another would evict it)")
    if lc.fully_sharded_loras:
        problems.append("fully_sharded_loras=True is not supported in flight")
    shape = spec.shape()
    if lc.max_lora_rank < shape.r:
        problems.append(f"max_lora_rank={lc.max_lora_rank} < the adapter's rank {shape.r}")
    return problems


class RequestRefused(ValueError):
    """A request this engine does not serve; ``request_id`` is vLLM's internal id."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(reason)
        self.request_id = request_id


def check_request(request_id: str, lora_request: Any, spec: AdapterSpec) -> None:
    """Refuse a request that does not decode with the policy adapter, as it is live."""
    if lora_request is None:
        raise RequestRefused(request_id, f"inflight: request {request_id} names no adapter; this engine serves the "
                         f"policy adapter {spec.name!r} (id {spec.int_id}) in flight, and every request must name it "
                         f"(inflight.engine.client.policy_lora; model={spec.name!r} on vllm serve)")
    if lora_request.lora_int_id != spec.int_id or lora_request.lora_name != spec.name:
        raise RequestRefused(request_id, f"inflight: request {request_id} names adapter {lora_request.lora_name!r} (id "
                         f"{lora_request.lora_int_id}); this engine serves only the policy adapter {spec.name!r} "
                         f"(id {spec.int_id}), which another adapter would evict from its one slot")
    if getattr(lora_request, "load_inplace", False):
        raise RequestRefused(request_id, f"inflight: request {request_id} asks to reload the policy adapter from disk "
                         "(load_inplace); its versions arrive in flight, and a reload would serve the file's")


def start_adapter(model_runner: Any, spec: AdapterSpec) -> tuple[TensorSchema, LoRASlotStrategy]:
    """Worker, execution thread, at ``inflight_start``: the policy adapter pinned in the slot,
    disk loads redirected to the live version, and the schema updates are checked against
    (the PEFT directory's tensors, in the LoRA dtype)."""
    schema = adapter_schema(model_runner, spec)
    strategy = LoRASlotStrategy(model_runner, spec, schema)
    strategy.attach()
    guard_disk_loads(model_runner.lora_manager, strategy, spec)
    return schema, strategy


def adapter_schema(model_runner: Any, spec: AdapterSpec) -> TensorSchema:
    """What an adapter update must contain: the PEFT directory's tensors, in the LoRA dtype."""
    return checkpoint_schema(Path(spec.path), model_runner.lora_config.lora_dtype)


def guard_disk_loads(worker_manager: Any, strategy: LoRASlotStrategy, spec: AdapterSpec) -> None:
    """Make the worker manager's ``_load_adapter`` (vLLM 0.32: what ``add_adapter`` calls for
    an adapter it does not hold) return the live version for the policy id, and refuse any
    other id. Set on the instance, once; idempotent."""
    original = worker_manager._load_adapter
    if getattr(original, "__inflight_guard__", False):
        return

    def load_adapter(lora_request: Any) -> Any:
        if lora_request.lora_int_id == spec.int_id:
            return strategy.live_adapter(spec.int_id)
        raise ValueError(f"inflight: adapter id {lora_request.lora_int_id} requested on an engine that serves only "
                         f"the policy adapter (id {spec.int_id})")

    load_adapter.__inflight_guard__ = True  # type: ignore[attr-defined]
    worker_manager._load_adapter = load_adapter
