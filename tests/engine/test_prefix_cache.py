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

import gc
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from inflight.engine.client import coordinator_of, start_inflight, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, WeightPusher
from tests.engine_harness import Reference, perturbed, replay, stop_engine
from tests.helpers import WAIT_S, wait_until

EXACT = 1e-4  # fp32 behaviour log-probs against transformers
BLOCK = 128  # vLLM CPU's KV block


def _prompt(seed: int, n: int = 300) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(3, 250, (n,), generator=g)).tolist()


@dataclass
class CacheEngine:
    """An in-process engine with prefix caching (the default), its trainer, and every version pushed."""

    llm: Any
    pusher: WeightPusher
    versions: dict[int, dict[str, torch.Tensor]]
    prompts: dict[str, list[int]] = field(default_factory=dict)
    done: dict[str, Any] = field(default_factory=dict)
    pushed: dict[int, Any] = field(default_factory=dict)
    """The ``PushResult`` of every version pushed."""

    @property
    def coordinator(self) -> Any:
        return coordinator_of(self.llm)

    @property
    def scheduler(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    def add(self, rid: str, prompt: list[int], tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = SamplingParams(temperature=1.0, max_tokens=tokens, logprobs=0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
        self.prompts[rid] = prompt
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, sp)

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            for out in self.llm.llm_engine.step():
                if out.finished:
                    self.done[out.request_id] = out

    def finish(self) -> None:
        while self.llm.llm_engine.has_unfinished_requests():
            self.step()

    def close(self) -> None:
        self.pusher.close()
        stop_engine(self.llm)
        del self.llm
        gc.collect()

    def request(self, rid: str) -> Any:
        """vLLM's request for the user's id ``rid`` (internal ids are ``rid-<suffix>``)."""
        return next(r for k, r in self.scheduler.requests.items() if k.rsplit("-", 1)[0] == rid)

    def push_until_pending(self, version: int) -> threading.Thread:
        """Push ``version`` from a trainer thread and return once every rank staged it and its
        commit waits for the next step boundary (an event; the deadline only fails a hang)."""
        self.versions[version] = perturbed(self.versions[0], seed=300 + version)
        errors: list[BaseException] = []

        def push() -> None:
            try:
                self.pushed[version] = self.pusher.push(version, self.versions[version])
            except BaseException as e:  # re-raised below
                errors.append(e)
        thread = threading.Thread(target=push, daemon=True)
        thread.start()
        wait_until(lambda: self.coordinator.commit_pending() or errors, f"the commit of v{version} to be pending",
                   poll_s=0.002)
        assert not errors, errors
        thread.errors, thread.version = errors, version  # type: ignore[attr-defined]
        return thread


def _start(model_dir, port: int, scheduling: str, world_size: int = 2, **kwargs: Any) -> CacheEngine:
    """An in-process engine with prefix caching (the default), synchronous or async scheduling,
    and its trainer."""
    import os

    from vllm import LLM

    os.environ["INFLIGHT_CPU_ASYNC_SCHEDULING"] = "1" if scheduling == "async" else "0"
    try:
        llm = LLM(str(model_dir), enforce_eager=True, dtype="float32", seed=0, async_scheduling=scheduling == "async",
                  **kwargs, **engine_kwargs())
    finally:
        del os.environ["INFLIGHT_CPU_ASYNC_SCHEDULING"]
    core = llm.llm_engine.engine_core.engine_core
    assert (core.step_fn == core.step_with_batch_queue) == (scheduling == "async")
    group = GroupConfig(port=port, world_size=world_size, timeout_s=120)
    start_inflight(llm, InflightConfig(group=group))
    return CacheEngine(llm, WeightPusher(group, PushConfig(dtype="float32", bucket_mb=0.25)),
                       {0: load_file(str(Path(model_dir) / "model.safetensors"))})


def _joined(thread: threading.Thread) -> None:
    """Wait for a trainer thread of ``push_until_pending`` to return; fail with its error."""
    thread.join(WAIT_S)
    assert not thread.is_alive(), f"waited {WAIT_S:.0f} s for the push of v{thread.version} to return"  # type: ignore[attr-defined]
    assert not thread.errors, thread.errors  # type: ignore[attr-defined]


@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_a_request_preempted_across_a_commit_is_recomputed_as_reported(tiny_llama, port, scheduling) -> None:
    """Runs before the module's engine starts: its own engine, with 5 KV blocks for two requests
    of 400 tokens, so vLLM preempts one of them (recompute mode) until the other finishes."""
    from vllm.v1.request import RequestStatus

    e = _start(tiny_llama, port, scheduling, max_model_len=512, num_gpu_blocks_override=6)
    try:
        for i in range(2):
            e.add(f"p{i}", _prompt(40 + i, 200), 200)
        for _ in range(400):  # engine steps, not time: until vLLM preempted one of them for KV space
            waiting = [r for r in e.scheduler.requests.values() if r.status == RequestStatus.PREEMPTED]
            if waiting:
                break
            e.step()
        (victim,) = waiting
        rid, at = victim.request_id.rsplit("-", 1)[0], victim.num_output_tokens
        thread = e.push_until_pending(1)
        e.step()  # v1 commits while the victim waits with its KV dropped
        _joined(thread)
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
    e = _start(tiny_llama, hold_port(), request.param, max_model_len=1024, max_num_batched_tokens=256)
    yield e
    e.close()


def _commit_round(e: CacheEngine, version: int, shared: list[int], group: int = 4, tokens: int = 24) -> None:
    """One commit with a request mid-prefill and a group admitted right after it."""
    mid = f"mid{version}"
    e.add(mid, _prompt(1000 + version), tokens)
    e.step()  # its first chunk: the step budget leaves the rest of the 300 tokens for later
    req = e.request(mid)
    assert 0 < req.num_computed_tokens < req.num_prompt_tokens, (req.num_computed_tokens, req.num_prompt_tokens)
    assert e.llm.reset_prefix_cache() is False  # vLLM's own reset refuses while requests run
    thread = e.push_until_pending(version)
    for i in range(group):  # admitted by the first schedule after the commit
        e.add(f"g{version}-{i}", shared, tokens)
    restarted = e.coordinator.prefix_cache.stats.restarted_prefills
    e.step()  # the commit lands at this step's boundary, then the scheduler admits the group
    assert e.coordinator.live_version == version
    assert e.coordinator.prefix_cache.stats.restarted_prefills == restarted + 1
    _joined(thread)
    e.step(8)  # prefill the group and decode on: the next commit catches these requests running


def test_commits_keep_the_prefix_cache_exact(engine: CacheEngine, tiny_llama) -> None:
    e = engine
    shared = _prompt(7)
    for i in range(4):
        e.add(f"g0-{i}", shared, 24)
    e.step(8)
    for v in (1, 2, 3):
        _commit_round(e, v, shared)
    e.finish()
    full = (len(shared) - 1) // BLOCK * BLOCK
    for v in range(4):
        outs = [e.done[f"g{v}-{i}"] for i in range(4)]
        cached = [o.num_cached_tokens for o in outs]
        # the group's first request computed its prompt (stock vLLM would serve it the earlier
        # group's blocks, still held by running requests); its siblings shared its blocks
        assert cached[0] == 0 and all(0 < c <= full for c in cached[1:]), (v, cached)
        assert {tagged(o.outputs[0]).prompt_label for o in outs} == {str(v)}
    for v in (1, 2, 3):  # caught mid-prefill by commit v: recomputed under v
        assert tagged(e.done[f"mid{v}"].outputs[0]).prompt_label == str(v)

    ref = Reference(tiny_llama, "float32")
    worst, shifted = 0.0, []
    for rid, out in e.done.items():
        if not rid.startswith(("g", "mid")):
            continue
        t = tagged(out.outputs[0])
        assert len(set(t.versions)) >= 2 or rid.startswith(("g3", "mid3")), (rid, t.versions)
        got = torch.tensor(t.logprobs, dtype=torch.float64)
        want = replay(ref, lambda label: e.versions[int(label)], e.prompts[rid], t.token_ids, t.labels, t.prompt_label)
        worst = max(worst, float((got - want).abs().max()))
        moved = str(t.prompt_version + (1 if t.prompt_version < 3 else -1))
        wrong = replay(ref, lambda label: e.versions[int(label)], e.prompts[rid], t.token_ids, t.labels, moved)
        shifted.append(float((got - wrong).abs().max()))
    stats = e.coordinator.prefix_cache.stats
    print(f"{len(e.done)} samples across 3 commits: worst |engine - replay| {worst:.2e}; prompt version shifted by "
          f"one: smallest worst error {min(shifted):.2e}; {stats}")
    assert worst < EXACT
    assert min(shifted) > 10 * EXACT
    for v in (1, 2, 3):  # each commit's reported token counts are where the tags change
        for rid, at in e.pushed[v].commits[1].tokens_at_commit.items():
            if rid in e.done:
                versions = tagged(e.done[rid].outputs[0]).versions
                assert all(t < v for t in versions[:at]) and all(t >= v for t in versions[at:]), (rid, at, versions)
    assert stats.invalidations == 3 and stats.restarted_prefills == 3 and stats.recomputed == 0, stats
    assert stats.dropped_blocks >= 3  # each commit found the shared prompt's blocks in the index


def test_multi_turn_reuses_only_blocks_of_the_live_weights(engine: CacheEngine) -> None:
    e = engine
    v = e.coordinator.live_version
    first = _prompt(21, 260)
    e.add("turn1", first, 40)
    e.finish()
    turn1 = tagged(e.done["turn1"].outputs[0])
    history = first + turn1.token_ids  # 300 tokens: two full blocks computed under the live version
    e.add("turn2", history + _prompt(22, 20), 8)
    e.finish()
    assert e.done["turn2"].num_cached_tokens == 2 * BLOCK

    # a request holding KV across a commit: its blocks filled after the commit stay out of the cache
    long = _prompt(23, 200)
    e.add("across", long, 90)
    e.step(3)
    thread = e.push_until_pending(v + 1)
    e.step()
    _joined(thread)
    e.finish()
    across = tagged(e.done["across"].outputs[0])
    assert across.versions[0] == v and across.versions[-1] == v + 1
    e.add("redo", long, 4)  # its prompt again: across's first block was of v; redo's, of v+1, enters the cache
    e.finish()
    assert e.done["redo"].num_cached_tokens == 0
    # 290 tokens: redo's first block, then the block across filled after the commit, which stayed out
    e.add("after-across", long + across.token_ids, 4)
    e.add("turn3", history + _prompt(22, 20), 4)  # turn 2's history again: its blocks are of v
    e.finish()
    assert e.done["after-across"].num_cached_tokens == BLOCK
    assert e.done["turn3"].num_cached_tokens == 0
    e.add("turn4", history + _prompt(22, 20), 4)  # computed again under v+1 by turn 3: shared now
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
        e = _start(tiny_llama, port, "async", world_size=3, max_model_len=512, tensor_parallel_size=2,
                   distributed_executor_backend="mp")
        try:
            for i in range(4):
                e.add(f"t{i}", _prompt(60 + i, 40), 60)
            for v in (1, 2):
                e.step(10)
                thread = e.push_until_pending(v)
                e.step()
                _joined(thread)
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
