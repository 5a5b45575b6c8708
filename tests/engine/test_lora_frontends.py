"""An adapter engine behind ``AsyncLLM`` (EngineCore in its own process) and behind the OpenAI
server (``--lora-modules policy=<dir>``): adapter updates pushed in flight land with exact
streamed tags, the engine then matches transformers + PEFT, and a request that does not name
the policy adapter gets an error of its own while the engine serves on."""

from __future__ import annotations

import asyncio
import urllib.error

import pytest
import torch

from inflight.adapter import AdapterSpec
from inflight.engine.client import policy_lora, start_inflight_async, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.engine.rpc import StartReport, as_result
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, WeightPusher
from tests.engine_harness import perturbed, post_json, serve_process, stream_across_commits
from tests.lora_harness import PeftReference, write_adapter


async def _run_async(base, adapter_dir, v0: dict, port: int) -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    spec = AdapterSpec(path=str(adapter_dir))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(base), enforce_eager=True, dtype="float32",
                                                       max_model_len=1024, seed=0, **engine_kwargs(adapter=spec)))
    group = GroupConfig(port=port, world_size=2, timeout_s=60)
    try:
        config = InflightConfig(group=group, adapter=spec)
        await start_inflight_async(engine, config)
        lora = policy_lora(config)
        pusher = await asyncio.to_thread(WeightPusher, group, PushConfig(bucket_mb=0.25))
        versions = [perturbed(v0, seed=60 + k, scale=0.03) for k in range(2)]
        await stream_across_commits(engine, lambda k: pusher.push(k + 1, versions[k]).commits[1], versions=2,
                                    requests=3, every=40, lora_request=lora)
        async for refused in engine.generate("1+2=", SamplingParams(max_tokens=4), "no-adapter"):  # noqa: B007
            pass  # EngineCore answers the request alone, with an error finish and no token
        assert refused.finished and refused.outputs[0].finish_reason == "error" and not refused.outputs[0].token_ids
        ref = PeftReference(base, adapter_dir).load(versions[1])
        sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True)
        async for out in engine.generate("1+2=", sp, "check", lora_request=lora):  # noqa: B007  the last is read below
            pass
        done = tagged(out.outputs[0])
        assert done.versions == [2] * 10
        torch.testing.assert_close(torch.tensor(done.logprobs, dtype=torch.float64),
                                   ref.logprobs(list(out.prompt_token_ids), done.token_ids), atol=1e-5, rtol=0)
        await asyncio.to_thread(pusher.close)
    finally:
        engine.shutdown()
        del engine


def test_async_llm_adapter_engine(tiny_llama, tmp_path, port) -> None:
    v0 = write_adapter(tiny_llama, tmp_path / "v0", seed=13)
    asyncio.run(_run_async(tiny_llama, tmp_path / "v0", v0, port))


def test_vllm_serve_adapter_engine(tiny_llama, tmp_path, port) -> None:
    from transformers import AutoTokenizer

    v0 = write_adapter(tiny_llama, tmp_path / "v0", seed=14)
    spec = AdapterSpec(path=str(tmp_path / "v0"))
    kwargs = engine_kwargs(adapter=spec)
    flags = ["--enable-lora", "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank",
             str(kwargs["max_lora_rank"]), "--lora-target-modules", *kwargs["lora_target_modules"], "--lora-modules",
             f"{spec.name}={spec.path}"]
    with serve_process(tiny_llama, tmp_path, flags) as server:
        group = GroupConfig(port=port, world_size=2, timeout_s=60)
        config = InflightConfig(group=group, adapter=spec)
        started = post_json(server + "/collective_rpc", {"method": "inflight_start", "args": [config.to_json()]})
        assert as_result(started["results"][0], StartReport).commit == "lora"
        pusher = WeightPusher(group, PushConfig())
        weights = perturbed(v0, seed=70, scale=0.03)
        assert pusher.push(1, weights).commits[1].version == 1
        body = {"prompt": "1+2=", "max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True,
                "return_tokens_as_token_ids": True}
        out = post_json(server + "/v1/completions", {**body, "model": spec.name})["choices"][0]
        tok = AutoTokenizer.from_pretrained(str(tiny_llama))
        prompt = tok("1+2=")["input_ids"]
        got = torch.tensor(out["logprobs"]["token_logprobs"], dtype=torch.float64)
        ids = [int(t.removeprefix("token_id:")) for t in out["logprobs"]["tokens"]]
        torch.testing.assert_close(got, PeftReference(tiny_llama, spec.path).load(weights).logprobs(prompt, ids),
                                   atol=1e-5, rtol=0)
        # the base model, not the policy adapter: refused alone (an error finish, which vLLM serves as a 500)
        with pytest.raises(urllib.error.HTTPError, match="HTTP Error 500: Internal Server Error"):
            post_json(server + "/v1/completions", {**body, "model": str(tiny_llama)})
        again = post_json(server + "/v1/completions", {**body, "model": spec.name})["choices"][0]
        assert again["text"] == out["text"]
        pusher.close()
