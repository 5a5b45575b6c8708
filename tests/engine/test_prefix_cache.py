"""Prefix caching on an in-flight engine (``inflight.engine.prefix_cache``), on a real vLLM CPU
engine (in-process EngineCore, tiny Llama fp32, 128-token KV blocks, chunked prefill with a
256-token step budget so a 300-token prompt takes two steps), each test once with vLLM's
synchronous step and once under async scheduling (``INFLIGHT_CPU_ASYNC_SCHEDULING=1``: the
next batch is dispatched before the last one is processed, and a commit lands between them;
``inflight.engine.batch_labels``).

- Three commits land while requests decode, each at a step boundary where vLLM's own
  ``reset_prefix_cache()`` refuses (requests are running). Right after each commit a group
  with the prompt earlier groups still hold in the cache is admitted: its first request is
  served no prompt token from the earlier version's blocks, its siblings share its prefill;
  a request caught mid-prefill by the commit is recomputed under the new weights.
- A transformers replay from each sample's prompt label and token tags alone reproduces every
  behaviour log-prob within 1e-4; the prompt's version shifted by one does not. Each tag
  changes exactly at the token count the commit reported.
- A request vLLM preempts for KV space and resumes after a commit is recomputed under the new
  weights: the guard counts and names it, and a replay that recomputes its history under the
  resuming label at the resumption (what ``docs/design.md`` says) reproduces it, while the
  plain replay from its tags does not.
- Multi-turn: a request that extends an earlier turn reuses that turn's blocks when they were
  computed under the live weights, none after a commit, and a request that held KV across a
  commit puts none of its later blocks in the cache (where a request that recomputed its
  first block would otherwise chain into them).
Pushes and commits follow engine steps and events, never wall-clock time.
"""

from __future__ import annotations

import pytest
import torch

from inflight.engine.client import tagged
from tests.cache_harness import (
    BLOCK,
    EXACT,
    CacheEngine,
    check_three_commits,
    joined,
    prompt_of,
    start_cache_engine,
)
from tests.engine_harness import Reference, replay


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_request_preempted_across_a_commit_is_recomputed_as_reported(tiny_llama, port, scheduling) -> None:
    """Runs before the module's engine starts: its own engine, with 5 KV blocks for two requests
    of 400 tokens, so vLLM preempts one of them (recompute mode) until the other finishes."""
    from vllm.v1.request import RequestStatus

    e = start_cache_engine(tiny_llama, port, scheduling, max_model_len=512, num_gpu_blocks_override=6)
    try:
        for i in range(2):
            e.add(f"p{i}", prompt_of(40 + i, 200), 200)
        for _ in range(400):  # engine steps, not time: until vLLM preempted one of them for KV space
            waiting = [r for r in e.scheduler.requests.values() if r.status == RequestStatus.PREEMPTED]
            if waiting:
                break
            e.step()
        (victim,) = waiting
        rid, at = victim.request_id.rsplit("-", 1)[0], victim.num_output_tokens
        thread = e.push_until_pending(1)
        e.step()  # v1 commits while the victim waits with its KV dropped
        joined(thread)
        e.finish()
        stats = e.coordinator.prefix_cache.stats
        assert stats.recomputed == 1 and stats.recomputed_ids == (victim.request_id,), stats
        t = tagged(e.done[rid].outputs[0])
        assert 0 < at < len(t.versions) and t.versions == [0] * at + [1] * (len(t.versions) - at)
        ref = Reference(tiny_llama, "float32")
        weights = lambda label: e.versions[int(label)]  # noqa: E731
        got = torch.tensor(t.logprobs, dtype=torch.float64)
        plain = replay(ref, weights, e.prompts[rid], t.token_ids, t.labels, t.prompt_label)
        # tokens from the resumption on attend to the prompt and the first ``at`` tokens recomputed under v1
        resumed = replay(ref, weights, e.prompts[rid], t.token_ids, ["1"] * len(t.labels), "1")
        assert float((got[:at] - plain[:at]).abs().max()) < EXACT
        assert float((got[at:] - resumed[at:]).abs().max()) < EXACT
        assert float((got[at:] - plain[at:]).abs().max()) > 10 * EXACT
        other = tagged(e.done[f"p{1 - int(rid[1])}"].outputs[0])  # decoded across the commit on its own KV
        want = replay(ref, weights, e.prompts[f"p{1 - int(rid[1])}"], other.token_ids, other.labels, other.prompt_label)
        assert set(other.versions) == {0, 1}
        assert float((torch.tensor(other.logprobs, dtype=torch.float64) - want).abs().max()) < EXACT
    finally:
        e.close()


@pytest.fixture(scope="module", params=["sync", "async"])
def engine(tiny_llama, hold_port, request):
    e = start_cache_engine(tiny_llama, hold_port(), request.param, max_model_len=1024, max_num_batched_tokens=256)
    yield e
    e.close()


def test_commits_keep_the_prefix_cache_exact(engine: CacheEngine, tiny_llama) -> None:
    check_three_commits(engine, tiny_llama)


def test_multi_turn_reuses_only_blocks_of_the_live_weights(engine: CacheEngine) -> None:
    e = engine
    v = e.coordinator.live_version
    first = prompt_of(21, 260)
    e.add("turn1", first, 40)
    e.finish()
    turn1 = tagged(e.done["turn1"].outputs[0])
    history = first + turn1.token_ids  # 300 tokens: two full blocks computed under the live version
    e.add("turn2", history + prompt_of(22, 20), 8)
    e.finish()
    assert e.done["turn2"].num_cached_tokens == 2 * BLOCK

    # a request holding KV across a commit: its blocks filled after the commit stay out of the cache
    long = prompt_of(23, 200)
    e.add("across", long, 90)
    e.step(3)
    thread = e.push_until_pending(v + 1)
    e.step()
    joined(thread)
    e.finish()
    across = tagged(e.done["across"].outputs[0])
    assert across.versions[0] == v and across.versions[-1] == v + 1
    e.add("redo", long, 4)  # its prompt again: across's first block was of v; redo's, of v+1, enters the cache
    e.finish()
    assert e.done["redo"].num_cached_tokens == 0
    # 290 tokens: redo's first block, then the block across filled after the commit, which stayed out
    e.add("after-across", long + across.token_ids, 4)
    e.add("turn3", history + prompt_of(22, 20), 4)  # turn 2's history again: its blocks are of v
    e.finish()
    assert e.done["after-across"].num_cached_tokens == BLOCK
    assert e.done["turn3"].num_cached_tokens == 0
    e.add("turn4", history + prompt_of(22, 20), 4)  # computed again under v+1 by turn 3: shared now
    e.finish()
    assert e.done["turn4"].num_cached_tokens == 2 * BLOCK
    assert tagged(e.done["turn4"].outputs[0]).prompt_label == str(v + 1)


def test_tp2_under_async_scheduling_tags_each_batch_with_its_weights(tiny_llama, port) -> None:
    """Async scheduling with two worker processes (vLLM's ``mp`` executor): the commit reaches
    each worker behind the batch in flight, in one ordered queue; every token replays exactly
    from its tag, and each tag changes at the token count the commit reported."""
    import vllm.envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank: vLLM CPU refuses TP=2 without it
        vllm.envs.disable_envs_cache()
        e = start_cache_engine(tiny_llama, port, "async", world_size=3, max_model_len=512, tensor_parallel_size=2,
                   distributed_executor_backend="mp")
        try:
            for i in range(4):
                e.add(f"t{i}", prompt_of(60 + i, 40), 60)
            for v in (1, 2):
                e.step(10)
                thread = e.push_until_pending(v)
                e.step()
                joined(thread)
            e.finish()
            ref = Reference(tiny_llama, "float32")
            for rid in (f"t{i}" for i in range(4)):
                t = tagged(e.done[rid].outputs[0])
                assert set(t.versions) == {0, 1, 2}
                for v in (1, 2):
                    (at,) = {r.tokens_at_commit[rid] for r in e.pushed[v].commits.values()}  # both ranks agree
                    assert t.versions.index(v) == at
                want = replay(ref, lambda label: e.versions[int(label)], e.prompts[rid], t.token_ids, t.labels,
                              t.prompt_label)
                assert float((torch.tensor(t.logprobs, dtype=torch.float64) - want).abs().max()) < EXACT
        finally:
            e.close()
    vllm.envs.disable_envs_cache()
