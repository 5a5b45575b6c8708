"""The commit's state belongs to the thread that applies it.

A TP=2 engine (two ``mp`` worker processes, EngineCore in this process) with the
``reload`` commit, which rolls back from the staged copy of the live bytes. Its first
trainer, a child process, is killed inside the engine's commit of v1: after every rank
applied and kept v1, before the outcome reached the trainer's store, so no worker's
listener ever reads it. Then:

- both ranks report v1, the engine's label, and a new trainer's group sees v1 on both;
- a commit forced to fail on one rank restores v1's bytes on both (equal to transformers
  at v1), not the weights the engine loaded (the rollback copy moved with the commit, on
  the execution thread, not when a listener read the outcome);
- the next push lands on both ranks.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import signal
import threading

import pytest
import torch
from safetensors.torch import load_file

from inflight.engine.client import coordinator_of, start_inflight, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.engine.rpc import WorkerStatus, as_result
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, PushRejected, WeightPusher
from tests.engine_harness import Reference, perturbed, stop_engine
from tests.helpers import fail_next_commit_on_vllm_rank_1

PROMPTS = ["1+2=", "count 3 4", "the quick brown"]
PUSH = PushConfig(dtype="float32", bucket_mb=0.25)


def _first_trainer(model_dir, ports, go) -> None:
    """Hosts the group's store on a port it holds, and pushes v1; the test kills it inside
    the engine's commit."""
    from inflight.transport.store import reserve_port

    port = reserve_port()
    ports.put(port)
    go.wait()
    pusher = WeightPusher(GroupConfig(port=port, world_size=3, timeout_s=120), PUSH)
    pusher.push(1, perturbed(load_file(str(model_dir / "model.safetensors")), seed=400, scale=0.02))


def _statuses(llm) -> list[WorkerStatus]:
    return [as_result(s, WorkerStatus) for s in llm.collective_rpc("inflight_status")]


def _assert_serves(llm, model_dir, state, version: int) -> None:
    from vllm import SamplingParams

    ref = Reference(model_dir, "float32").load(state)
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True)
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        out = tagged(o.outputs[0])
        assert out.versions == [version] * len(out.token_ids)
        assert out.token_ids == ref.greedy(list(o.prompt_token_ids), len(out.token_ids))
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64),
                                   ref.logprobs(list(o.prompt_token_ids), out.token_ids), atol=1e-5, rtol=0)


def test_a_trainer_lost_between_commit_and_outcome_leaves_every_rank_at_the_label(tiny_llama, monkeypatch) -> None:
    import vllm.envs
    from vllm import LLM

    ctx = mp.get_context("spawn")
    ports, go = ctx.Queue(), ctx.Event()
    first = ctx.Process(target=_first_trainer, args=(tiny_llama, ports, go), daemon=True)
    first.start()
    port = ports.get(timeout=120)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank (vLLM CPU refuses TP=2 without it)
    vllm.envs.disable_envs_cache()
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="mp", enforce_eager=True,
              dtype="float32", max_model_len=512, seed=0, **engine_kwargs())
    group = GroupConfig(port=port, world_size=3, timeout_s=120)
    pusher = None
    killed = threading.Event()
    try:
        assert start_inflight(llm, InflightConfig(group=group, commit="reload")).commit == "reload"
        coordinator = coordinator_of(llm)
        real = coordinator._request

        def commit_then_lose_the_trainer(version: int):
            outcome = real(version)  # every rank applied v and kept it, in one window
            first.kill()  # before the coordinator posts the outcome: no listener will read it
            first.join()  # reaped here only: a second join on another thread could miss the exit code
            killed.set()
            return outcome

        coordinator._request = commit_then_lose_the_trainer
        go.set()
        assert killed.wait(1800), "the first trainer's push never reached the engine's commit"
        assert first.exitcode == -signal.SIGKILL
        coordinator._request = real
        base = load_file(str(tiny_llama / "model.safetensors"))
        v1 = perturbed(base, seed=400, scale=0.02)
        assert coordinator.live_version == 1
        assert [s.live_version for s in _statuses(llm)] == [1, 1]  # the label, on both ranks
        _assert_serves(llm, tiny_llama, v1, 1)

        pusher = WeightPusher(group, PUSH)  # a new trainer, on the same port
        assert pusher.engine_versions == {1: 1, 2: 1}
        assert llm.collective_rpc(fail_next_commit_on_vllm_rank_1) == [0, 1]
        with pytest.raises(PushRejected, match=r"(?s)\[commit_failed\] .*rolled back on ranks \[1\]") as exc:
            pusher.push(2, perturbed(base, seed=401, scale=0.05))
        assert exc.value.codes == {"commit_failed"} and "rolled back on ranks [1]" in exc.value.rejections[1].reason
        assert coordinator.live_version == 1 and not coordinator.broken
        _assert_serves(llm, tiny_llama, v1, 1)  # v1's bytes on both ranks, not the loaded weights
        v3 = perturbed(base, seed=402, scale=0.02)
        result = pusher.push(3, v3)
        assert result.commits[1].step == result.commits[2].step
        _assert_serves(llm, tiny_llama, v3, 3)
        assert [s.live_version for s in _statuses(llm)] == [3, 3]
    finally:
        if not killed.is_set() and first.is_alive():
            first.kill()
        if pusher is not None:
            pusher.close()
        stop_engine(llm)
        del llm
        gc.collect()
        monkeypatch.undo()
        vllm.envs.disable_envs_cache()
