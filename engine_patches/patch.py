"""The one patch `inflight` applies to vLLM, and the function that applies it.

Why a patch at all: in vLLM 0.32 nothing runs between two EngineCore steps except client
requests (utility calls), and a worker cannot issue those. A commit that must land at a
step boundary *and* move the version label in the same breath (two separate utility
calls mislabel a token per request) needs the step itself to look for it. Everything
else (the receiver, the staging, the commit) lives in the worker extension.
"""

from __future__ import annotations

import functools

_MARK = "__inflight_step_boundary__"


def patch_engine_core_step_boundary() -> None:
    """Wrap ``vllm.v1.engine.core.EngineCore.step`` (vLLM 0.32.0) with the in-flight step gate.

    - ``EngineCore.step``: if an in-flight worker registered a ``StepGate`` for this engine
      (keyed by ``vllm_config.instance_id``), the step runs inside the gate: a pending
      commit is applied first and ``_weight_version`` (what vLLM attaches to every output of
      the step) is set from the gate's live version. Engines without a gate are untouched.
    - ``EngineCore.step_with_batch_queue``: used for async scheduling and pipeline
      parallelism, where a commit between two loop turns could still race a batch in
      flight; refused loudly when a gate is present.

    Idempotent; raises if vLLM's EngineCore no longer has these methods. Must run before an
    EngineCore binds ``self.step_fn`` in ``__init__``, which the ``vllm.general_plugins``
    entry point guarantees (plugins load at the top of ``EngineCore.__init__``).
    """
    from vllm.v1.engine.core import EngineCore

    from engine_patches.gate import gate_for

    for name in ("step", "step_with_batch_queue"):
        if not callable(getattr(EngineCore, name, None)):
            raise RuntimeError(f"inflight: vllm EngineCore has no {name}(); this vLLM is not 0.32-compatible")
    if getattr(EngineCore.step, _MARK, False):
        return

    original_step = EngineCore.step
    original_batch_step = EngineCore.step_with_batch_queue

    @functools.wraps(original_step)
    def step(self):
        gate = gate_for(self.vllm_config.instance_id)
        if gate is None:
            return original_step(self)
        with gate.step(self) as report:
            outputs, executed = original_step(self)
            report(executed)
        return outputs, executed

    @functools.wraps(original_batch_step)
    def step_with_batch_queue(self):
        if gate_for(self.vllm_config.instance_id) is not None:
            raise RuntimeError(
                "inflight: in-flight commits need async_scheduling=False and pipeline_parallel_size=1 "
                "(the batch queue keeps a step in flight across the commit boundary)"
            )
        return original_batch_step(self)

    setattr(step, _MARK, True)
    setattr(step_with_batch_queue, _MARK, True)
    EngineCore.step = step
    EngineCore.step_with_batch_queue = step_with_batch_queue


def is_patched() -> bool:
    from vllm.v1.engine.core import EngineCore

    return bool(getattr(EngineCore.step, _MARK, False))
