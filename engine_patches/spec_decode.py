"""Speculative decoding on an in-flight engine: which proposers are exact across commits, what
they accept per version, and the two vLLM 0.32 CPU defects on its path (an expand kernel that
leaves sampled speculation's temperatures unset; a kernel rebinding that fails after numba).

A speculative step verifies its draft tokens in one forward of the target and accepts a prefix
of them (vLLM's rejection sampler: the accepted and recovered tokens are distributed as the
target's processed distribution, and their log-probs are the target's). So every token a step
emits was computed by the weights live at that step and carries that step's label, and the
input at position j is still processed by the step that samples token j+1: the replay rule
of an engine without speculation holds unchanged (``tests/engine_harness.py: replay``). A
commit lands between two steps and cannot split a step's tokens. Proposers with no weights of
their own (n-gram prompt lookup) are exact across commits as they are; a draft model's
weights travel with every update and go live with the target's (``commit.drafted``). EAGLE and
MTP heads, which share the target's layers, are refused by name.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from inflight.protocol import VersionSpecStats

KEPT_VERSIONS = 64
"""The newest versions whose speculation ``SpecDecodeMeter`` reports."""

IN_FLIGHT_METHODS = ("ngram", "draft_model")
"""vLLM 0.32 ``speculative_config.method`` values whose proposals stay exact across commits:
n-gram lookup has no weights; a draft model's travel with every update and commit with the
target's (``inflight.engine.commit.drafted``)."""


def problems(vllm_config: Any, *, record_routing: bool) -> list[str]:
    """Why this engine's speculative decoding cannot run in flight ([] if it can, or is off)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return []
    found = []
    if spec.method not in IN_FLIGHT_METHODS:
        found.append(f"speculative_config.method={spec.method!r}: its proposer's weights are not updated in flight "
                     f"(supported: {', '.join(IN_FLIGHT_METHODS)})")
    if getattr(spec, "use_heterogeneous_vocab", False):
        found.append("speculative_config.use_heterogeneous_vocab=True: a draft of another vocabulary (its tokens "
                     "mapped to the target's) is not run in flight; use a draft of the target's tokenizer")
    if vllm_config.scheduler_config.async_scheduling:
        found.append("speculative decoding with async scheduling is untested here (start with async_scheduling=False)")
    if record_routing:
        found.append("record_routing with speculative decoding: routing is recorded for one token per step")
    return found


class SpecDecodeMeter:
    """Counts, per live version, the request-steps, tokens emitted, draft tokens verified and
    accepted, from the drafts each running request holds before a step (vLLM schedules them
    for verification in that step) and the tokens its output carries after it. A step emits
    its accepted drafts plus one token sampled by the target, so accepted = emitted - 1 (a
    request stopped inside a step counts only what it emitted). Engine thread only."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self._drafted: dict[str, int] = {}
        self._by_version: OrderedDict[int, VersionSpecStats] = OrderedDict()

    def before_step(self) -> None:
        self._drafted = {r.request_id: len(r.spec_token_ids) for r in self.scheduler.running if r.spec_token_ids}

    def after_step(self, outputs: dict[int, Any], version: int) -> None:
        steps = emitted = drafted = accepted = 0
        for batch in outputs.values():
            for out in batch.outputs:
                n = len(out.new_token_ids)
                if n == 0:
                    continue
                d = self._drafted.get(out.request_id, 0)
                steps, emitted, drafted, accepted = steps + 1, emitted + n, drafted + d, accepted + min(n - 1, d)
        if steps == 0:
            return
        s = self._by_version.pop(version, None) or VersionSpecStats(version=version)
        self._by_version[version] = msgspec.structs.replace(
            s, steps=s.steps + steps, emitted=s.emitted + emitted, drafted=s.drafted + drafted,
            accepted=s.accepted + accepted)
        while len(self._by_version) > KEPT_VERSIONS:
            self._by_version.popitem(last=False)

    def stats(self) -> tuple[VersionSpecStats, ...]:
        return tuple(sorted(self._by_version.values(), key=lambda s: s.version))


def fix_cpu_expand_kernel_vllm_0_32(vllm_config: Any) -> bool:
    """vLLM 0.32.0's CPU build, on an engine that speculates: make the rejection sampler's
    ``expand_kernel`` override write floats. Its C++ implementation casts the output to int64
    and writes into that copy, so the per-token temperatures it expands stay uninitialised:
    sampled speculation then draws from garbage distributions and returns NaN log-probs
    (greedy is unaffected). Idempotent; True when the override is (now) the fixed one, False
    where there is nothing to fix."""
    import vllm
    from vllm.platforms import current_platform

    if vllm_config.speculative_config is None or not current_platform.is_cpu() or vllm.__version__ != "0.32.0":
        return False
    import vllm.v1.sample.rejection_sampler as rejection_sampler
    from vllm.triton_utils.dispatcher import KernelOverride

    override = rejection_sampler.expand_kernel
    if not isinstance(override, KernelOverride):
        return False
    if override._impl is not _expand:
        override._impl = override.func = _expand
        override._forward_by_name = False
    return True


def _expand(output: Any, input_val: Any, cu_num_tokens: Any, replace_from: Any, replace_to: Any,
            MAX_NUM_TOKENS: Any = None) -> None:
    """``expand_kernel`` in torch, for any dtype: request i's value (``replace_from`` replaced
    by ``replace_to``) for each of its tokens, ``cu_num_tokens`` holding the running counts."""
    import torch

    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    values = values.repeat_interleave(counts)
    output[: values.numel()] = values.to(output.dtype)


def tolerate_foreign_objects_in_kernel_rebind_vllm_0_32() -> None:
    """vLLM 0.32.0's CPU platform, at every engine's start, points every module-level reference
    to a Triton kernel at its CPU stand-in (``triton_utils.dispatcher._rebind_kernels``),
    reading each object's ``vars(value).get("kernel")``. Once an n-gram proposer ran in the
    process, numba's llvmlite is imported, whose wrapped C functions answer ``vars`` with an
    object that has no ``get``: every later engine in that process fails to start. The same
    scan, skipping such objects; installed by the plugin on CPU; idempotent."""
    import sys
    import warnings

    from vllm.triton_utils import dispatcher

    if getattr(dispatcher._rebind_kernels, "__inflight_tolerant__", False):
        return

    def rebind(overrides: list) -> None:
        with warnings.catch_warnings():  # reading a module's deprecated attributes warns (torch.distributed.reduce_op)
            warnings.simplefilter("ignore")
            _rebind({id(original): wrapper for original, wrapper in overrides})

    def _rebind(originals: dict) -> None:
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not namespace:
                continue
            for attr, value in list(namespace.items()):
                wrapper = originals.get(id(value))
                if wrapper is not None:
                    setattr(module, attr, wrapper)
                    continue
                inner = getattr(value, "__dict__", None)
                if not isinstance(inner, dict):  # the llvmlite case, or no instance dict at all
                    continue
                wrapper = originals.get(id(inner.get("kernel")))
                if wrapper is None:
                    continue
                value.kernel = wrapper
                if not isinstance(value, type):
                    value.__dict__.pop("_kernel_arg_names", None)

    rebind.__inflight_tolerant__ = True  # type: ignore[attr-defined]
    dispatcher._rebind_kernels = rebind
