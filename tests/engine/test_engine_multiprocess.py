"""The default multiprocess ``LLM``: EngineCore in its own process (busy loop), the worker in
it (``uni`` executor). The test process is only the client, so it drives the engine step by
step through ``LLMEngine.step`` and triggers pushes by the outputs it has seen.

- an update pushed while the engine is idle commits at once (the idle-state callback, on
  the engine thread), and the engine then equals transformers;
- updates pushed while requests decode land between steps with exact tags;
- every commit ran on the thread that runs the worker's forward passes.
"""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file

from inflight.engine.client import inflight_status, start_inflight, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, WeightPusher
from inflight.versions import boundaries, is_monotone, tags_from_spans
from tests.engine_harness import Reference, perturbed, push_at_steps, stop_engine


@pytest.fixture(scope="module")
def engine(tiny_qwen, hold_port):
    import vllm.envs
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        vllm.envs.disable_envs_cache()  # an earlier in-process engine cached the environment
        llm = LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=512, seed=0, **engine_kwargs())
        assert llm.llm_engine.engine_core.__class__.__name__ == "SyncMPClient"
        group = GroupConfig(port=hold_port(), world_size=2, timeout_s=120)
        start_inflight(llm, InflightConfig(group=group))
        pusher = WeightPusher(group, PushConfig(dtype="float32", bucket_mb=0.25))
        yield llm, pusher, load_file(str(tiny_qwen / "model.safetensors")), tiny_qwen
        pusher.close()
        stop_engine(llm)
        del llm
        gc.collect()
    vllm.envs.disable_envs_cache()


def _greedy(llm, prompts: list[str], n: int = 10):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, logprobs=0, ignore_eos=True)
    return [(list(o.prompt_token_ids), tagged(o.outputs[0])) for o in llm.generate(prompts, sp, use_tqdm=False)]


def test_idle_push_commits_on_the_engine_thread_and_matches_transformers(engine) -> None:
    llm, pusher, base, model_dir = engine
    _greedy(llm, ["warm up"])  # the worker has run forward passes: its execution thread is known
    state = perturbed(base, seed=40, scale=0.03)
    result = pusher.push(1, state)  # the engine is idle: nothing steps until the commit wakes it
    assert result.commits[1].version == 1
    ref = Reference(model_dir, "float32").load(state)
    for prompt, out in _greedy(llm, ["1+2=", "the quick brown", "7+7="]):
        assert out.versions == [1] * 10
        assert out.token_ids == ref.greedy(prompt, 10)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), ref.logprobs(prompt, out.token_ids),
                                   atol=1e-5, rtol=0)
    (commit,) = [c for c in inflight_status(llm).commits if c.version == 1]
    assert commit.ok and commit.execution_thread is True


def test_pushes_while_decoding_land_between_steps_with_exact_tags(engine) -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm, pusher, base, _ = engine
    core = llm.llm_engine
    finished: dict[str, list[int]] = {}
    active: set[str] = set()
    n_req, seen = 0, 0
    # Keep 8 requests decoding until every push returned, so each commit lands mid-decode;
    # pushes are triggered by the steps this loop took, never by wall-clock time.
    pushes = push_at_steps(lambda: seen, (25, 50, 75),
                           lambda k: pusher.push(2 + k, perturbed(base, seed=50 + k, scale=0.02)))
    while pushes.alive() or active:
        while pushes.alive() and len(active) < 8:
            rid = f"r{n_req}"
            n_req += 1
            sp = SamplingParams(max_tokens=120, ignore_eos=True, temperature=1.0, seed=n_req,
                                output_kind=RequestOutputKind.FINAL_ONLY)
            core.add_request(rid, {"prompt_token_ids": [5, 6, 7, 8, 9]}, sp)
            active.add(rid)
        for out in core.step():
            if out.finished:
                active.discard(out.request_id)
                spans = out.outputs[0].weight_versions
                finished[out.request_id] = tags_from_spans(spans, len(out.outputs[0].token_ids))
        seen += 1
    results = pushes.join()
    assert [r.version for r in results] == [2, 3, 4]
    for r in results:
        assert any(n > 0 for n in r.commits[1].tokens_at_commit.values()), "a commit did not land mid-decode"
    spanning = 0
    for rid, versions in finished.items():
        assert is_monotone(versions)
        first = boundaries(versions)
        spanning += len(first) > 1
        for r in results:
            c = r.commits[1]
            if c.version in first:  # started before the commit: its boundary is the commit; after: token 0
                assert first[c.version] == c.tokens_at_commit.get(rid, 0), (rid, c.version)
    assert spanning > 0
    status = inflight_status(llm)
    assert status.live_version == 4 and status.engine.live_version == 4 and status.engine.commits == 4
    assert all(c.execution_thread is True for c in status.commits if c.ok)
