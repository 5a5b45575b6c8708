"""The benchmarks' baseline is right: vLLM's native pause(keep) + start/update/finish path,
over the ``inflight_gloo`` transfer engine, serves the new weights exactly."""

from __future__ import annotations

import threading

import torch
from safetensors.torch import load_file

from inflight.trainer.native_update import broadcast_state, register, update_info
from inflight.transport.group import WeightGroup
from inflight.transport.group_config import GroupConfig
from tests.engine_harness import Reference, perturbed


def test_native_pause_update_resume(tiny_llama, port) -> None:
    from vllm import LLM, SamplingParams

    from inflight.engine.engine_config import engine_kwargs

    register()  # the benchmarks' engine, not the plugin's: registered in the process that builds the LLM
    llm = LLM(str(tiny_llama), enforce_eager=True, dtype="float32", max_model_len=256, seed=0,
              weight_transfer_config={"backend": "inflight_gloo"}, **engine_kwargs())
    trainer: list[WeightGroup] = []
    t = threading.Thread(target=lambda: trainer.append(WeightGroup(GroupConfig(port=port, name="native"), 0)))
    t.start()
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {
        "host": "127.0.0.1", "port": port, "world_size": 2, "rank": 1, "name": "native"}})
    t.join()
    state = perturbed(load_file(str(tiny_llama / "model.safetensors")), seed=9)

    core = llm.llm_engine.engine_core.engine_core
    core.pause_scheduler(mode="keep", clear_cache=False)
    llm.collective_rpc("start_weight_update")
    sender = threading.Thread(target=broadcast_state, args=(trainer[0], state))
    sender.start()
    llm.collective_rpc("update_weights", kwargs={"update_info": update_info(state)})
    sender.join()
    llm.collective_rpc("finish_weight_update")
    core.resume_scheduler()

    ref = Reference(tiny_llama, "float32").load(state)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0.0, max_tokens=10, logprobs=0),
                       use_tqdm=False)[0]
    # The native path labels no versions (its spans read "default"), so compare raw outputs.
    done = out.outputs[0]
    token_ids = list(done.token_ids)
    logprobs = [step[tok].logprob for step, tok in zip(done.logprobs, token_ids)]
    assert token_ids == ref.greedy([5, 6, 7, 8], 10)
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64),
                               ref.logprobs([5, 6, 7, 8], token_ids), atol=1e-5, rtol=0)
    llm.collective_rpc("shutdown_weight_transfer_engine")
    trainer[0].close()
