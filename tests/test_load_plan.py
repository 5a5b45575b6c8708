"""The swap commit's load plan and reused shadow buffers (``engine_patches.load_plan``,
``engine_patches.targets``) on a real vLLM CPU engine.

- the plan's copies write exactly the bytes vLLM's own weight loaders write (bitwise, every
  parameter of a Qwen2 with fused qkv / gate_up, qkv bias and tied embeddings);
- updates through the load plan match transformers after each of five pushes; the plan
  covers every tensor. Buffer reuse is off (see ``engine_patches/targets.py``): each
  update prepares into fresh buffers.
"""

from __future__ import annotations

import torch

from inflight.transport.group import free_port
from tests.engine_harness import Harness, Reference, perturbed

PROMPTS = ["1+2=", "count 3 4", "the quick brown"]


def _worker(h: Harness):
    return h.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def test_plan_writes_exactly_what_the_loaders_write(tiny_qwen) -> None:
    from engine_patches.swap import SwapApplier

    h = Harness(tiny_qwen, "float32", free_port())
    try:
        applier = _worker(h)._inflight_target.applier
        assert isinstance(applier, SwapApplier) and applier.load_plan is not None
        assert not applier.load_plan.loaded, f"unplanned tensors: {sorted(applier.load_plan.loaded)}"
        weights = perturbed(h.base, seed=3)
        by_loaders = applier._shadows()
        applier._load(weights, by_loaders)
        by_plan, destinations = applier._targets.take(applier._shadow, applier._templates, applier.load_plan)
        for t in by_plan.values():
            t.data.fill_(float("nan"))  # anything the plan does not write stays NaN and fails below
        applier._copy(destinations, applier.load_plan.sources(weights))
        applier.load_plan.fill(by_plan)
        applier._targets.discard()
        assert by_plan.keys() == by_loaders.keys()
        for key, want in by_loaders.items():
            assert torch.equal(by_plan[key].data, want.data), key
    finally:
        h.close()


def test_updates_through_the_load_plan_match_transformers(tiny_qwen) -> None:
    h = Harness(tiny_qwen, "float32", free_port())
    try:
        applier = _worker(h)._inflight_target.applier
        for seed in range(1, 6):
            state = perturbed(h.base, seed=seed)
            h.push(state)
            ref = Reference(h.model_dir, h.dtype).load(state)
            for prompt, out in h.greedy(PROMPTS):
                assert out.versions == [h.version] * len(out.token_ids)
                assert out.token_ids == ref.greedy(prompt, len(out.token_ids))
                got = torch.tensor(out.logprobs, dtype=torch.float64)
                torch.testing.assert_close(got, ref.logprobs(prompt, out.token_ids), atol=1e-5, rtol=0)
        assert not applier._targets.reuse and not applier._targets._sets  # fresh buffers per update
    finally:
        h.close()
