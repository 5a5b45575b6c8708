"""An in-process in-flight engine with prefix caching, driven by engine steps, and the
checks of ``tests/engine/test_prefix_cache.py`` and ``test_prefix_cache_models.py``: three
commits, each with a request caught mid-prefill and a group admitted right after it, and a
transformers replay of every sample from its tags."""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def prompt_of(seed: int, n: int = 300) -> list[int]:
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
    started: Any = None
    """``start_inflight``'s report (the commit strategy the engine chose, ...)."""
    top_logprobs: int = 0
    """The most likely tokens' log-probs each request returns beside its own (vLLM's ``logprobs``)."""

    @property
    def coordinator(self) -> Any:
        return coordinator_of(self.llm)

    @property
    def scheduler(self) -> Any:
        return self.llm.llm_engine.engine_core.engine_core.scheduler

    def add(self, rid: str, prompt: list[int], tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sp = SamplingParams(temperature=1.0, max_tokens=tokens, logprobs=self.top_logprobs, ignore_eos=True,
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

    def push_until_pending(self, version: int, state: dict[str, torch.Tensor] | None = None) -> threading.Thread:
        """Push ``version`` (``state``, or by default the first version perturbed) from a trainer
        thread and return once every rank staged it and its commit waits for the next step
        boundary (an event; the deadline only fails a hang)."""
        self.versions[version] = perturbed(self.versions[0], seed=300 + version) if state is None else state
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


def start_cache_engine(model_dir, port: int, scheduling: str, world_size: int = 2, **kwargs: Any) -> CacheEngine:
    """An in-process engine with prefix caching (the default), synchronous or async scheduling,
    and its trainer."""
    import os

    from vllm import LLM

    os.environ["INFLIGHT_CPU_ASYNC_SCHEDULING"] = "1" if scheduling == "async" else "0"
    try:
        llm = LLM(enforce_eager=True, dtype="float32", seed=0, async_scheduling=scheduling == "async",
                  **engine_kwargs(model=model_dir, **kwargs))
    finally:
        del os.environ["INFLIGHT_CPU_ASYNC_SCHEDULING"]
    core = llm.llm_engine.engine_core.engine_core
    assert (core.step_fn == core.step_with_batch_queue) == (scheduling == "async")
    group = GroupConfig(port=port, world_size=world_size, timeout_s=120)
    started = start_inflight(llm, InflightConfig(group=group))
    return CacheEngine(llm, WeightPusher(group, PushConfig(dtype="float32", bucket_mb=0.25)),
                       {0: load_file(str(Path(model_dir) / "model.safetensors"))}, started=started)


def joined(thread: threading.Thread) -> None:
    """Wait for a trainer thread of ``push_until_pending`` to return; fail with its error."""
    thread.join(WAIT_S)
    assert not thread.is_alive(), f"waited {WAIT_S:.0f} s for the push of v{thread.version} to return"  # type: ignore[attr-defined]
    assert not thread.errors, thread.errors  # type: ignore[attr-defined]


def commit_round(e: CacheEngine, version: int, shared: list[int], group: int = 4, tokens: int = 24) -> None:
    """One commit with a request mid-prefill and a group admitted right after it."""
    mid = f"mid{version}"
    e.add(mid, prompt_of(1000 + version), tokens)
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
    joined(thread)
    e.step(8)  # prefill the group and decode on: the next commit catches these requests running


def run_three_commits(e: CacheEngine) -> list[int]:
    """A group of 4 for the shared prompt (returned), then three commits (``commit_round``)."""
    shared = prompt_of(7)
    for i in range(4):
        e.add(f"g0-{i}", shared, 24)
    e.step(8)
    for v in (1, 2, 3):
        commit_round(e, v, shared)
    e.finish()
    return shared


def check_tags_change_at_commits(e: CacheEngine) -> None:
    """Each commit's reported token counts are where the tags of ``run_three_commits`` change."""
    for v in (1, 2, 3):
        for rid, at in e.pushed[v].commits[1].tokens_at_commit.items():
            if rid in e.done:
                versions = tagged(e.done[rid].outputs[0]).versions
                assert all(t < v for t in versions[:at]) and all(t >= v for t in versions[at:]), (rid, at, versions)


def check_three_commits(e: CacheEngine, model_dir: Path) -> None:
    """Three commits (``run_three_commits``) on ``e``, then every sample replayed from its tags."""
    shared = run_three_commits(e)
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

    ref = Reference(model_dir, "float32")
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
    check_tags_change_at_commits(e)
    assert stats.invalidations == 3 and stats.restarted_prefills == 3 and stats.recomputed == 0, stats
    assert stats.dropped_blocks >= 3  # each commit found the shared prompt's blocks in the index
