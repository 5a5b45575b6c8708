"""The in-flight worker behind ``AsyncLLM``: EngineCore in its own process, streaming tags."""

from __future__ import annotations

import asyncio

import torch

from inflight.engine.client import inflight_status_async, start_inflight_async, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, WeightPusher
from tests.engine_harness import (
    CACHE_PROMPT,
    Reference,
    Sample,
    check_fresh,
    check_warm,
    perturbed,
    stream_across_commits,
)


async def _sample(engine, rid: str) -> Sample:
    """4 greedy tokens for ``CACHE_PROMPT`` (a prefix-cache check), through ``AsyncLLM``."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True)
    async for out in engine.generate({"prompt_token_ids": CACHE_PROMPT}, sp, rid):  # noqa: B007  the last is read below
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
        await stream_across_commits(engine,
                                    lambda k: pusher.push(k + 1, perturbed(base, seed=k, scale=0.02)).commits[1],
                                    versions=3, requests=6, every=60)

        # the engine now serves v3 exactly
        state = perturbed(base, seed=2, scale=0.02)
        ref = Reference(model_dir, "float32").load(state)
        sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True)
        async for out in engine.generate("1+2=", sp, "check"):  # noqa: B007  the last is read below
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
