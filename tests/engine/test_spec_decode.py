"""Speculative decoding on an in-flight engine (``inflight.engine.spec_decode``), on a real vLLM
CPU engine: n-gram prompt lookup proposing 3 tokens a step, sampling at temperature 1, prefix
caching on (two requests per prompt, the second served a block from the cache), three commits
while 4 requests decode. The model is a tiny fp32 Llama whose LM head
is sharpened (x40), so it repeats itself and the proposals are accepted.

- Speculation runs: more than one token per request per decode step.
- A transformers replay from the tags reproduces every behaviour log-prob within 1e-4 (the
  target's processed log-prob at each position); tags shifted by one version do not.
- A commit never splits a step's tokens: the tokens each step emitted carry one version, and
  the tags change at the token counts each commit reported.
- The engine's status counts, per version, the request-steps and tokens the test saw, and the
  drafts verified and accepted.
- A draft model (a copy of the target) travels with every update and commits with the target:
  its acceptance holds across commits, and falls to nearly none once it is frozen while the
  target moves. An update without the draft is refused by name; the engine serves on.
- A second engine starts in this process after the n-gram one (whose numba import broke vLLM
  0.32's CPU kernel rebinding: ``spec_decode.tolerate_foreign_objects_in_kernel_rebind_vllm_0_32``).
- Without ``spec_decode.fix_cpu_expand_kernel_vllm_0_32`` vLLM 0.32's CPU sampler draws
  speculated tokens from uninitialised temperatures (NaN log-probs): the replay would fail.
Pushes and commits follow engine steps and events, never wall-clock time.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inflight.engine.client import tagged
from inflight.engine.commit.drafted import DRAFT_PREFIX
from inflight.trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus
from tests.cache_harness import BLOCK, EXACT, CacheEngine, check_tags_change_at_commits, joined, start_cache_engine
from tests.engine_harness import Reference, perturbed, replay

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def repeating_llama(tmp_path_factory) -> Path:
    """A tiny Llama with its LM head scaled x40: sharp distributions, so its samples repeat."""
    out = build_tiny_model(tmp_path_factory.mktemp("repeating_llama"), default_corpus(), TinyModelConfig(
        arch="llama", hidden_size=128, num_heads=2, num_kv_heads=1, tie_word_embeddings=False, seed=1))
    state = load_file(str(out / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * 40
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _counts(e: CacheEngine) -> dict[str, int]:
    """Tokens each request has emitted so far (user ids)."""
    live = {k.rsplit("-", 1)[0]: r.num_output_tokens for k, r in e.scheduler.requests.items()}
    return {rid: live.get(rid, len(e.done[rid].outputs[0].token_ids) if rid in e.done else 0) for rid in e.prompts}


def _step(e: CacheEngine, history: dict[str, list[int]]) -> None:
    """One engine step, recording each request's token count after it when it changed."""
    e.step()
    for rid, n in _counts(e).items():
        if n != history[rid][-1]:
            history[rid].append(n)


def test_ngram_speculation_is_tagged_and_replays_exactly_across_commits(repeating_llama, port) -> None:
    e = start_cache_engine(repeating_llama, port, "sync", max_model_len=1024, speculative_config=NGRAM)
    try:
        g = torch.Generator().manual_seed(5)
        for pair in range(2):  # two requests per prompt: the second is served its first block from the cache
            prompt = torch.randint(3, 250, (150,), generator=g).tolist()
            for i in (2 * pair, 2 * pair + 1):
                e.add(f"s{i}", prompt, 96)
        history = {rid: [0] for rid in e.prompts}
        for v in (1, 2, 3):
            for _ in range(6):
                _step(e, history)
            thread = e.push_until_pending(v)
            _step(e, history)  # the commit lands at this step's boundary
            joined(thread)
        while e.llm.llm_engine.has_unfinished_requests():
            _step(e, history)

        ref = Reference(repeating_llama, "float32")
        weights = lambda label: e.versions[int(label)]  # noqa: E731
        steps = tokens = 0
        worst, shifted = 0.0, []
        by_version: dict[int, list[int]] = {v: [0, 0] for v in range(4)}  # request-steps, tokens emitted
        for rid, counts in history.items():
            t = tagged(e.done[rid].outputs[0])
            assert counts[-1] == len(t.token_ids) == 96 and set(t.versions) == {0, 1, 2, 3}, (rid, t.versions)
            for a, b in zip(counts[:-1], counts[1:]):
                assert len(set(t.versions[a:b])) == 1, (rid, a, b, t.versions[a:b])
                by_version[t.versions[a]][0] += 1
                by_version[t.versions[a]][1] += b - a
                if a > 0:  # a decode step (the first emitted the prefill's token)
                    steps, tokens = steps + 1, tokens + b - a
            got = torch.tensor(t.logprobs, dtype=torch.float64)
            assert torch.isfinite(got).all(), rid
            want = replay(ref, weights, e.prompts[rid], t.token_ids, t.labels, t.prompt_label)
            worst = max(worst, float((got - want).abs().max()))
            moved = [str(max(0, int(label) - 1)) for label in t.labels]  # each token one version early
            wrong = replay(ref, weights, e.prompts[rid], t.token_ids, moved, t.prompt_label)
            shifted.append(float((got - wrong).abs().max()))
        print(f"{tokens / steps:.2f} tokens per decode step over {steps} steps; worst |engine - replay| {worst:.2e}; "
              f"tags shifted by one version: smallest worst error {min(shifted):.2e}")
        assert tokens / steps > 1.05, "speculation did not run"  # exactly 1 without it
        assert worst < EXACT
        assert min(shifted) > 10 * EXACT
        check_tags_change_at_commits(e)
        meter = e.coordinator.status().spec_decode  # what the worker's status reports, per version
        assert [(s.version, s.steps, s.emitted) for s in meter] == [(v, *by_version[v]) for v in range(4)], meter
        assert all(s.accepted == s.emitted - s.steps and 0 <= s.accepted <= s.drafted for s in meter), meter
        assert sum(s.accepted for s in meter) > 0
        print("acceptance per version:", [f"v{s.version} {s.acceptance:.3f}" for s in meter])
        assert sorted(e.done[f"s{i}"].num_cached_tokens for i in range(4)) == [0, 0, BLOCK, BLOCK]
    finally:
        e.close()


def test_a_draft_model_commits_with_its_target_and_keeps_its_acceptance(repeating_llama, tmp_path, port) -> None:
    """The draft is a copy of the target: while every update carries the draft beside the
    target, the draft proposes the target's own most likely tokens, and the target accepts
    them at the rate it gives them. Frozen at an older version, the same draft proposes tokens
    the moved target rejects: acceptance falls to nearly none. Tags and log-probs replay
    exactly throughout."""
    import shutil

    draft_dir = tmp_path / "draft"
    shutil.copytree(repeating_llama, draft_dir)
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    e = start_cache_engine(repeating_llama, port, "sync", max_model_len=1024, speculative_config=spec)
    try:
        base = e.versions[0]
        assert e.started.schema_tensors == 2 * len(base)  # the target's tensors and the draft's
        g = torch.Generator().manual_seed(6)
        for i in range(4):
            e.add(f"d{i}", torch.randint(3, 250, (40,), generator=g).tolist(), 160)
        history = {rid: [0] for rid in e.prompts}
        targets = {0: base}
        for v in (1, 2, 3, 4, 5):  # the draft follows the target up to v3, then stays there
            for _ in range(6):
                _step(e, history)
            targets[v] = perturbed(base, seed=300 + v)
            draft = targets[min(v, 3)]
            pushed = {**targets[v], **{f"{DRAFT_PREFIX}{n}": t.clone() for n, t in draft.items()}}
            thread = e.push_until_pending(v, pushed)
            _step(e, history)
            joined(thread)
        while e.llm.llm_engine.has_unfinished_requests():
            _step(e, history)

        ref = Reference(repeating_llama, "float32")
        worst = 0.0
        for rid in history:
            t = tagged(e.done[rid].outputs[0])
            assert set(t.versions) == set(range(6)), (rid, t.versions)
            want = replay(ref, lambda label: targets[int(label)], e.prompts[rid], t.token_ids, t.labels, t.prompt_label)
            worst = max(worst, float((torch.tensor(t.logprobs, dtype=torch.float64) - want).abs().max()))
        meter = {s.version: s for s in e.coordinator.status().spec_decode}
        print(f"worst |engine - replay| {worst:.2e}; acceptance per version:",
              [f"v{v} {s.acceptance:.3f} ({s.tokens_per_step:.2f} tokens/step)" for v, s in meter.items()])
        assert worst < EXACT
        # vLLM's draft proposes its most likely token, which the target accepts with its probability there
        assert all(meter[v].acceptance > 0.3 for v in range(4)), meter  # the draft committed with the target
        assert all(meter[v].acceptance < 0.05 for v in (4, 5)), meter  # frozen at v3
        check_tags_change_at_commits(e)

        # an update without the draft is refused by name, and the engine serves on at v5
        with pytest.raises(Exception, match=DRAFT_PREFIX) as refused:
            e.pusher.push(6, {n: t.clone() for n, t in targets[5].items()})
        print("refused:", str(refused.value)[:300])
        e.add("after", e.prompts["d0"], 8)
        e.finish()
        assert set(tagged(e.done["after"].outputs[0]).versions) == {5}
    finally:
        e.close()


def test_a_smaller_draft_of_the_same_tokenizer_replays_exactly(repeating_llama, tmp_path, port) -> None:
    """A one-layer draft, half as wide, built from its own config on the target's tokenizer:
    the target's tokens and log-probs replay from their tags across commits whatever the
    draft proposes, each update carrying the draft's own (perturbed) weights."""
    draft_dir = build_tiny_model(tmp_path / "small_draft", default_corpus(), TinyModelConfig(
        arch="llama", hidden_size=64, num_heads=1, num_kv_heads=1, num_layers=1, intermediate_size=128,
        tie_word_embeddings=False, seed=4))
    draft0 = load_file(str(draft_dir / "model.safetensors"))
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    e = start_cache_engine(repeating_llama, port, "sync", max_model_len=1024, speculative_config=spec)
    try:
        assert e.started.schema_tensors == len(e.versions[0]) + len(draft0)
        targets = {0: e.versions[0]}
        g = torch.Generator().manual_seed(8)
        for i in range(2):
            e.add(f"m{i}", torch.randint(3, 250, (40,), generator=g).tolist(), 64)
        for v in (1, 2, 3):
            e.step(5)
            targets[v] = perturbed(targets[0], seed=300 + v)
            draft = {f"{DRAFT_PREFIX}{n}": t for n, t in perturbed(draft0, seed=400 + v).items()}
            thread = e.push_until_pending(v, {**targets[v], **draft})
            e.step()
            joined(thread)
        e.finish()
        ref = Reference(repeating_llama, "float32")
        for rid in ("m0", "m1"):
            t = tagged(e.done[rid].outputs[0])
            assert set(t.versions) == {0, 1, 2, 3}, t.versions
            want = replay(ref, lambda label: targets[int(label)], e.prompts[rid], t.token_ids, t.labels, t.prompt_label)
            assert float((torch.tensor(t.logprobs, dtype=torch.float64) - want).abs().max()) < EXACT
        meter = e.coordinator.status().spec_decode
        assert sum(s.drafted for s in meter) > 0 and [s.version for s in meter] == [0, 1, 2, 3], meter

        # a draft of another architecture (the target's own layers as the draft), and an update
        # for a version the engine has already passed, are refused by name; the engine serves on at v3
        other = {f"{DRAFT_PREFIX}{n}": t.clone() for n, t in targets[0].items()}
        unknown = r"\[unknown_tensor\] v4 names tensors .*'draft\.model\.layers\.1\."
        with pytest.raises(Exception, match=unknown) as refused:
            e.pusher.push(4, {**targets[3], **other})
        print("refused:", str(refused.value)[:300])
        with pytest.raises(Exception, match=r"\[stale_version\] v2 is not newer than the live v3") as refused:
            e.pusher.push(2, {**targets[2], **{f"{DRAFT_PREFIX}{n}": t for n, t in draft0.items()}})
        print("refused:", str(refused.value)[:300])
        e.add("after", e.prompts["m0"], 8)
        e.finish()
        assert set(tagged(e.done["after"].outputs[0]).versions) == {3}
        assert e.coordinator.status().live_version == 3
    finally:
        e.close()
