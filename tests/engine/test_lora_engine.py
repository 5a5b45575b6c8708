"""Adapter-only in-flight updates on a real vLLM CPU engine with LoRA: a tiny Llama at TP=1
and a tiny Qwen3 at TP=2 (two worker processes, each taking its own slice in its slot).

- adapter versions pushed while requests decode commit at one step on every rank, the
  tokens' tags change exactly at the reported commit steps, and the engine then matches
  transformers + PEFT holding the same adapter (fp32, 1e-5), each rank's slot bit for bit
  what vLLM writes when it loads the same adapter file itself;
- an adapter of another rank, dtype or target modules, or with modules the engine has no
  slot for, is refused at its announce, naming the tensor, before any byte lands: the
  engine serves the last good adapter, its outputs bit-identical;
- requests that do not name the policy adapter (none, another, a reload from disk) are
  refused alone; re-activating the adapter (an eviction, a cache reset) keeps the live
  version, never the directory's;
- a commit that fails on one rank is taken back on the other;
- an adapter of a lower rank than its slot (rank 4 in vLLM's smallest slot above it, 8):
  the copy plan gathers the zero-padded images through an index, bit for bit vLLM's; the
  listener runs on the CPUs ``InflightConfig.listener_cpus`` names, and a CPU the host lacks
  is refused by name.
"""

from __future__ import annotations

import re

import pytest
import torch

from inflight.transport.pusher import PushRejected
from tests.engine_harness import (
    assert_tags_change_at_commits,
    check_fresh,
    check_warm,
    drive,
    llm_sample,
    perturbed,
    push_at_steps,
)
from tests.helpers import fail_next_commit_on_vllm_rank_1
from tests.lora_harness import (
    PROMPTS,
    LoRAEngine,
    assert_matches_peft,
    copy_plan_of,
    index_bytes_counted,
    listener_affinity,
    slot_equals_vllm_load,
    write_adapter,
)


@pytest.fixture(scope="module", params=["llama_tp1", "qwen3_tp2"])
def lora(request, hold_port, tmp_path_factory):
    from inflight.trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama_tp1":
        base = request.getfixturevalue("tiny_llama")
        tp = 1
    else:
        cfg = TinyModelConfig(arch="qwen3", hidden_size=128, num_heads=4, num_kv_heads=2, tie_word_embeddings=True,
                              seed=3)
        base, tp = build_tiny_model(root / "base", default_corpus(), cfg), 2
    v0 = write_adapter(base, root / "v0", seed=11)
    with pytest.MonkeyPatch.context() as mp:
        if tp == 2:  # one core per rank: vLLM CPU refuses TP=2 without the bind
            import vllm.envs

            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
            vllm.envs.disable_envs_cache()
        engine = LoRAEngine(base, root / "v0", v0, hold_port(), tp)
        yield engine
        engine.close()
    import vllm.envs

    vllm.envs.disable_envs_cache()


def test_adapter_updates_land_mid_decode_with_exact_tags_and_match_peft(lora: LoRAEngine, tmp_path) -> None:
    from vllm import SamplingParams

    assert lora.report.commit == "lora" and lora.report.reserved_bytes > 0
    # prepare runs the recorded copy plan, which the slot check at the end holds to vLLM's bytes
    assert all(plan is not None and plan[0] > 0 for plan in lora.llm.collective_rpc(copy_plan_of))
    assert_matches_peft(lora, lora.v0, 0)
    sample = llm_sample(lora.llm, lora.lora)
    check_warm(sample(), sample())
    coordinator, start = lora.coordinator, lora.coordinator.steps
    versions = [perturbed(lora.v0, seed=100 + k, scale=0.03) for k in range(3)]
    adapter_bytes = sum(t.numel() * 4 for t in lora.v0.values())
    pushes = push_at_steps(lambda: coordinator.steps - start, (10, 30, 50), lambda k: lora.push(versions[k]))
    sp = SamplingParams(temperature=1.0, max_tokens=80, logprobs=0, ignore_eos=True, seed=5)
    outs = drive(lora.llm, coordinator, [f"{i}+{i}=" for i in range(4)], sp, hold_at=[35, 55, 75], start=start,
                 lora_request=lora.lora)
    commits = pushes.join()
    assert [r.version for r in commits] == [1, 2, 3]
    # the adapter alone travels
    assert all(r.send.nbytes == adapter_bytes for r in commits), [r.send.nbytes for r in commits]
    ranks = sorted(commits[0].commits)
    for r in commits:
        assert len({r.commits[k].step for k in ranks}) == 1  # every rank at one step boundary
    assert_tags_change_at_commits(outs, commits, rank=ranks[0], start=start, tokens=80)
    assert_matches_peft(lora, versions[2], 3)
    # one adapter name across versions: the cache must not serve a block of an earlier adapter
    check_fresh(sample(), sample(), lora.reference.load(versions[2]).logprobs)
    # every rank's slot: bit for bit what vLLM writes when it loads the same adapter file itself
    lora.reference.load(versions[2]).model.save_pretrained(str(tmp_path / "v3"))
    assert lora.llm.collective_rpc(slot_equals_vllm_load, args=(str(tmp_path / "v3"),)) == [True] * len(ranks)


def test_bad_adapters_are_refused_by_name_and_the_engine_serves_on(lora: LoRAEngine) -> None:
    before = lora.greedy()
    v = lora.version
    name = next(n for n in lora.v0 if "v_proj.lora_B" in n)
    a_name = next(n for n in lora.v0 if "q_proj.lora_A" in n)
    other = {k.replace("v_proj", "w_proj"): t for k, t in lora.v0.items()}
    bad = {
        "bad_shape": {**lora.live, a_name: torch.zeros(4, lora.live[a_name].shape[1])},  # rank 4, not 8
        "missing_tensor": {k: t for k, t in lora.live.items() if "v_proj" not in k},  # fewer target modules
        "unknown_tensor": other,  # a module with no slot in this engine
    }
    pusher = lora.pusher
    for code, weights in bad.items():
        with pytest.raises(PushRejected, match=rf"\[{code}\]") as exc:
            pusher.push(v + 1, weights)
        assert code in exc.value.codes, exc.value
    pusher._dtype = None  # as PushConfig(dtype="keep"): each tensor travels in its own dtype
    try:
        with pytest.raises(PushRejected, match=rf"(?s)\[bad_dtype\] .*{re.escape(name)}") as exc:
            pusher.push(v + 1, {**lora.live, name: lora.live[name].to(torch.bfloat16)})
    finally:
        pusher._dtype = torch.float32
    assert exc.value.codes == {"bad_dtype"} and name in str(exc.value)
    after = lora.greedy()
    for (_, a), (_, b) in zip(before, after):
        assert b.versions == [v] * len(b.token_ids)
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bit-identical
    assert lora.coordinator.live_version == v


def test_requests_without_the_policy_adapter_are_refused_alone(lora: LoRAEngine) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    for request, words in ((None, "names no adapter"), (LoRARequest("other", 2, str(lora.adapter_dir)), "'other'"),
                           (LoRARequest(lora.spec.name, lora.spec.int_id, str(lora.adapter_dir), load_inplace=True),
                            "load_inplace")):
        with pytest.raises(ValueError, match=words):
            lora.llm.generate(PROMPTS[:1], sp, lora_request=request, use_tqdm=False)
    assert_matches_peft(lora, lora.live, lora.version)


def _reset_adapters(worker) -> int:
    """Inside the worker: what an eviction or vLLM's ``reset_lora_state`` does to the slot."""
    worker.model_runner.lora_manager.remove_all_adapters()
    return 1


def test_a_reactivated_adapter_is_the_live_version_not_the_directory(lora: LoRAEngine) -> None:
    weights = perturbed(lora.v0, seed=400, scale=0.03)
    lora.push(weights)
    assert lora.llm.collective_rpc(_reset_adapters) == [1] * len(lora.report.ranks)
    assert_matches_peft(lora, weights, lora.version)  # re-registered from the live version, not v0's file


def test_a_commit_failing_on_one_rank_is_taken_back_on_every_rank(lora: LoRAEngine) -> None:
    if len(lora.report.ranks) < 2:
        pytest.skip("needs two ranks")
    before = lora.greedy()
    v = lora.version
    assert lora.llm.collective_rpc(fail_next_commit_on_vllm_rank_1) == [0, 1]
    with pytest.raises(PushRejected, match=r"(?s)\[commit_failed\] .*rolled back on ranks \[1\]") as exc:
        lora.pusher.push(v + 1, perturbed(lora.live, seed=500, scale=0.05))
    assert exc.value.codes == {"commit_failed"} and "rolled back on ranks [1]" in exc.value.rejections[1].reason
    after = lora.greedy()
    for (_, a), (_, b) in zip(before, after):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and b.versions == [v] * len(b.token_ids)
    weights = perturbed(lora.live, seed=501, scale=0.03)
    lora.version = v
    lora.push(weights)
    assert_matches_peft(lora, weights, v + 1)


def test_adapter_directories_the_slot_cannot_hold_are_refused_by_name(tmp_path) -> None:
    import json

    from inflight.adapter import AdapterSpec
    from inflight.engine.engine_config import engine_kwargs
    from inflight.trainer.lora_policy import LoRAOptions

    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_dora": True, "bias": "lora_only",
              "modules_to_save": ["score"], "target_modules": ["q_proj", "lm_head", "embed_tokens"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError,
                       match=f"the adapter in {re.escape(str(tmp_path))} cannot be served in flight") as exc:
        engine_kwargs(adapter=AdapterSpec(path=str(tmp_path)))
    for words in ("use_dora", "bias='lora_only'", "modules_to_save=['score']", "['embed_tokens', 'lm_head']"):
        assert words in str(exc.value), (words, str(exc.value))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 12, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    assert engine_kwargs(adapter=AdapterSpec(path=str(tmp_path)))["max_lora_rank"] == 16  # the smallest vLLM slot >= 12
    with pytest.raises(ValueError, match=r"model.lora.target_modules=.*lm_head"):
        LoRAOptions(rank=8, target_modules=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="AdapterSpec.int_id=0"):
        AdapterSpec(path=str(tmp_path), int_id=0)


def _start_on_worker(worker, config_json: str):
    return worker.inflight_start(config_json, "direct")  # past EngineCore, which refuses a second start itself


def test_an_adapter_below_its_slot_rank_is_padded_as_vllm_pads_it(tiny_llama, hold_port, tmp_path) -> None:
    import dataclasses
    import os

    from inflight.trainer.lora_policy import LoRAOptions

    v0 = write_adapter(tiny_llama, tmp_path / "v0", seed=12, options=LoRAOptions(rank=4, alpha=12.0))
    last = max(os.sched_getaffinity(0))
    engine = LoRAEngine(tiny_llama, tmp_path / "v0", v0, hold_port(), listener_cpus=(last,))
    try:
        assert engine.llm.collective_rpc(listener_affinity) == [[last]]  # InflightConfig.listener_cpus
        bad = dataclasses.replace(engine.config, listener_cpus=(4096,)).to_json()
        # checked first, on the worker
        with pytest.raises(Exception, match=r"listener_cpus=\(4096,\): this host has CPUs"):
            engine.llm.collective_rpc(_start_on_worker, args=(bad,))
        [(runs, indexed)] = engine.llm.collective_rpc(copy_plan_of)
        assert indexed > 0  # every B: runs of 4 in rows of 8
        # the KV cache's budget is set before attach records the plan: its bound covers the indexes
        [(bound, recorded)] = engine.llm.collective_rpc(index_bytes_counted)
        assert bound >= recorded > 0
        weights = perturbed(v0, seed=40, scale=0.03)
        assert engine.push(weights).commits[1].version == 1
        engine.reference.load(weights).model.save_pretrained(str(tmp_path / "v1"))
        assert engine.llm.collective_rpc(slot_equals_vllm_load, args=(str(tmp_path / "v1"),)) == [True]
        assert_matches_peft(engine, weights, 1)
    finally:
        engine.close()
