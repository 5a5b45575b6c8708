"""The swap commit's load plan and reused shadow buffers (``inflight.engine.commit.loaders``,
``inflight.engine.commit.swap``) on a real vLLM CPU engine.

- the plan's copies write exactly the bytes vLLM's own weight loaders write (bitwise, every
  parameter of a Qwen2 with fused qkv / gate_up, qkv bias and tied embeddings);
- a version staged into the reused buffers while the previous one serves leaves the live
  version exactly itself, and becomes exactly itself once committed (transformers parity,
  six updates: the three rotating sets cycle and come back); the plan covers every tensor,
  reuse stays on, and most layers are re-packed while later buckets are still arriving, so
  the fast path is the one these checks exercise;
- a layer whose re-pack fails (on the re-pack thread) refuses the update, and the live
  version serves on exactly as it was; the next update goes through.
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.engine_harness import Harness, Reference, perturbed

PROMPTS = ["1+2=", "count 3 4", "the quick brown"]


def _worker(h: Harness):
    return h.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def test_plan_writes_exactly_what_the_loaders_write(tiny_qwen, port) -> None:
    from inflight.engine.commit.swap import SwapStrategy

    h = Harness(tiny_qwen, "float32", port)
    try:
        strategy = _worker(h)._inflight_target.strategy
        assert isinstance(strategy, SwapStrategy) and strategy.load_plan is not None
        assert not strategy.load_plan.loaded, f"unplanned tensors: {sorted(strategy.load_plan.loaded)}"
        weights = perturbed(h.base, seed=3)
        by_loaders = strategy._shadows()
        strategy._load(weights, by_loaders)
        by_plan, destinations = strategy._targets.take(strategy._shadow, strategy._templates, strategy.load_plan)
        for t in by_plan.values():
            t.data.fill_(float("nan"))  # anything the plan does not write stays NaN and fails below
        strategy._copy(destinations, strategy.load_plan.sources(weights))
        strategy.load_plan.fill(by_plan)
        strategy._targets.discard()
        assert by_plan.keys() == by_loaders.keys()
        for key, want in by_loaders.items():
            assert torch.equal(by_plan[key].data, want.data), key
    finally:
        h.close()


def _check(h: Harness, state: dict[str, torch.Tensor], version: int) -> None:
    ref = Reference(h.model_dir, h.dtype).load(state)
    for prompt, out in h.greedy(PROMPTS):
        assert out.versions == [version] * len(out.token_ids)
        assert out.token_ids == ref.greedy(prompt, len(out.token_ids))
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, ref.logprobs(prompt, out.token_ids), atol=1e-5, rtol=0)


def test_staging_into_reused_buffers_never_touches_the_live_version(tiny_qwen, port) -> None:
    """Each version is staged (received, checked and re-packed into the reused buffers) while
    the one before it serves, and the live one must still be exactly itself then: a buffer
    taken as consumed by the re-pack but still read by a live packed weight would show here.
    Six updates alternate between the two rotating sets: the live one and the one being
    prepared (the swapped-out set is let go once the engine keeps a commit, so a third is
    never needed)."""
    h = Harness(tiny_qwen, "float32", port)
    try:
        strategy = _worker(h)._inflight_target.strategy
        repacks = {"during receive": 0, "after": 0}  # when each layer's re-pack was started
        where = ["during receive"]
        submit, prepare = strategy._submit, strategy.prepare

        def counted_submit(*args):
            repacks[where[0]] += 1
            return submit(*args)

        def finishing(weights):
            where[0] = "after"
            try:
                return prepare(weights)
            finally:
                where[0] = "during receive"
        strategy._submit, strategy.prepare = counted_submit, finishing
        live = h.base
        for seed in range(1, 7):
            state = perturbed(h.base, seed=seed)
            h.version += 1
            h.pusher.send(h.version, state)  # staged and prepared, not committed
            _check(h, live, h.version - 1)
            h.pusher.commit(h.version)
            _check(h, state, h.version)
            live = state
        assert strategy._targets.reuse, "the re-pack broke a reuse assumption: updates fell back to fresh buffers"
        assert len(strategy._targets._sets) == 2
        # the updates were streamed: most layers re-packed while later buckets were still coming
        layers = len(strategy._owners)
        assert sum(repacks.values()) == 6 * layers
        assert repacks["during receive"] >= 6 * layers // 2, repacks
    finally:
        h.close()


def test_a_repack_failing_on_the_repack_thread_refuses_the_update_and_the_live_version_stays(
        tiny_qwen, monkeypatch, port) -> None:
    import inflight.engine.commit.swap as swap
    from inflight.transport.pusher import PushRejected

    h = Harness(tiny_qwen, "float32", port)
    try:
        good = perturbed(h.base, seed=1)
        h.push(good)
        live = h.version
        real, calls = swap.process_after_loading, []

        def failing(module):  # the fourth layer of the next version fails to re-pack
            calls.append(threading.current_thread().name)
            if len(calls) == 4:
                raise RuntimeError("oneDNN could not pack this layer")
            return real(module)
        monkeypatch.setattr(swap, "process_after_loading", failing)
        with pytest.raises(PushRejected, match=r"(?s)\[prepare_failed\] .*could not pack") as exc:
            h.push(perturbed(h.base, seed=2))
        assert exc.value.codes == {"prepare_failed"} and "could not pack" in str(exc.value)
        assert calls and all(name.startswith("inflight-repack") for name in calls)
        _check(h, good, live)  # the last good version, exactly, still serving
        monkeypatch.undo()
        later = perturbed(h.base, seed=3)
        h.push(later)  # the shadow sets the refused version used are taken again, cleanly
        _check(h, later, h.version)
    finally:
        h.close()
