"""Speculative decoding on an in-flight engine: which proposers are exact across commits, and
the one vLLM 0.32 CPU defect that makes sampled speculation inexact.

A speculative step verifies its draft tokens in one forward of the target and accepts a prefix
of them (vLLM's rejection sampler: the accepted and recovered tokens are distributed as the
target's processed distribution, and their log-probs are the target's). So every token a step
emits was computed by the weights live at that step and carries that step's label, and the
input at position j is still processed by the step that samples token j+1: the replay rule
of an engine without speculation holds unchanged (``tests/engine_harness.py: replay``). A
commit lands between two steps and cannot split a step's tokens. Proposers with no weights of
their own (n-gram prompt lookup) are exact across commits as they are; a proposer with weights
(a draft model, EAGLE, MTP) would propose from weights the trainer has moved past, and is
refused by name until its weights travel with the update.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

from inflight.engine.rpc import VersionSpecStats

KEPT_VERSIONS = 64
"""The newest versions whose speculation ``SpecDecodeMeter`` reports."""

WEIGHTLESS_METHODS = ("ngram",)
"""vLLM 0.32 ``speculative_config.method`` values whose proposer has no weights to update."""


def problems(vllm_config: Any, *, record_routing: bool) -> list[str]:
    """Why this engine's speculative decoding cannot run in flight ([] if it can, or is off)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return []
    found = []
    if spec.method not in WEIGHTLESS_METHODS:
        found.append(f"speculative_config.method={spec.method!r}: its proposer's weights are not updated in flight "
                     f"(supported: {', '.join(WEIGHTLESS_METHODS)})")
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
