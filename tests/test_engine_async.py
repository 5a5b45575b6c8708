"""The in-flight worker behind ``AsyncLLM``: EngineCore in its own process, streaming tags."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from inflight.engine.config import InflightConfig, engine_kwargs
from inflight.engine.client import inflight_status_async, start_inflight_async, stream_tagged, tagged
from inflight.transport.group import GroupConfig
from inflight.transport.pusher import PushConfig, WeightPusher
from inflight.versions import boundaries, is_monotone
from tests.engine_harness import CACHE_PROMPT, Reference, Sample, check_fresh, check_warm, perturbed, push_at_steps


async def _sample(engine, rid: str) -> Sample:
    """4 greedy tokens for ``CACHE_PROMPT`` (a prefix-cache check), through ``AsyncLLM``."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
    async for out in engine.generate({"prompt_token_ids": CACHE_PROMPT}, sp, rid):
        pass
    t = tagged(out.outputs[0])
    return out.num_cached_tokens, t.token_ids, t.logprobs


async def _run(model_dir, port: int) -> None:
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(model=str(model_dir), enforce_eager=True, dtype="float32", max_model_len=1024, seed=0,
                           **engine_kwargs())
    engine = AsyncLLM.from_engine_args(args)
    group = GroupConfig(port=port, world_size=2, timeout_s=60)
    try:
        await start_inflight_async(engine, InflightConfig(group=group))
        pusher = await asyncio.to_thread(WeightPusher, group, PushConfig(bucket_mb=0.25))
        base = load_file(str(model_dir / "model.safetensors"))
        check_warm(await _sample(engine, "warm-0"), await _sample(engine, "warm-1"))
        n_req, versions = 6, 3
        progress = [0] * n_req
        # commit whenever every stream has moved on by 60 tokens (the engine's steps, as streamed)
        pushes = push_at_steps(lambda: min(progress), [60 * (k + 1) for k in range(versions)],
                               lambda k: pusher.push(k + 1, perturbed(base, seed=k, scale=0.02)).commits[1])
        commits = pushes.results

        async def consume(i: int):
            # EngineCore runs in its own process, free of this test: the requests are long
            # (up to 1000 tokens) and each stream closes itself (aborting its request) once
            # it is 20 tokens past the last commit, so every commit lands mid-request
            # however slow the machine, and no assertion races the engine.
            sp = SamplingParams(temperature=1.0, max_tokens=1000, logprobs=0, ignore_eos=True, seed=i)
            rid, seen = f"req-{i}", []
            async with contextlib.aclosing(stream_tagged(engine, f"{i}+{i}=", sp, request_id=rid)) as stream:
                async for out, tags in stream:
                    assert tags[: len(seen)] == seen, "a streamed tag changed after it was reported"
                    assert len(tags) == len(out.outputs[0].token_ids)
                    seen = tags
                    progress[i] = len(tags)
                    if len(commits) == versions and len(seen) > commits[-1].tokens_at_commit.get(rid, 0) + 20:
                        break  # closing the stream aborts the request
            assert len(commits) == versions, ("a request ended before every commit landed", pushes.errors)
            return rid, seen

        finished = await asyncio.gather(*(consume(i) for i in range(n_req)))
        await asyncio.to_thread(pushes.join)
        assert [c.version for c in commits] == [1, 2, 3]
        for request_id, seen in finished:
            assert is_monotone(seen)
            first = boundaries(seen)
            assert set(first) == {0, 1, 2, 3}, first
            for c in commits:
                assert first[c.version] == c.tokens_at_commit[request_id]

        # the engine now serves v3 exactly
        state = perturbed(base, seed=2, scale=0.02)
        ref = Reference(model_dir, "float32").load(state)
        sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True)
        async for out in engine.generate("1+2=", sp, "check"):
            pass
        done = tagged(out.outputs[0])
        assert done.versions == [3] * 10
        assert done.token_ids == ref.greedy(list(out.prompt_token_ids), 10)
        torch.testing.assert_close(torch.tensor(done.logprobs, dtype=torch.float64),
                                   ref.logprobs(list(out.prompt_token_ids), done.token_ids), atol=1e-5, rtol=0)
        # EngineCore's own process invalidated its prefix cache at each commit
        check_fresh(await _sample(engine, "fresh-0"), await _sample(engine, "fresh-1"), ref.logprobs)
        status = await inflight_status_async(engine)
        assert status.live_version == 3 and status.committed == 3 and status.last_error == ""
        assert status.engine.prefix_cache.invalidations == 3 and status.engine.prefix_cache.dropped_blocks >= 2
        await asyncio.to_thread(pusher.close)
    finally:
        engine.shutdown()
        del engine  # let AsyncLLM.__del__ run now, not at interpreter exit


def test_async_llm_multiprocess_engine(tiny_qwen, port) -> None:
    asyncio.run(_run(tiny_qwen, port))
