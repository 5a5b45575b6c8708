"""A fleet through vLLM's RL API: ``trainer_init(client=[llm_a, llm_b])``.

Two in-process engines on the ``inflight`` backend, each its own weight group on the
trainer's store (``FleetPusher``). The test steps both engines from this thread while the
trainer pushes three versions: every version lands on both, each at a step boundary of its
own engine with requests decoding there, and each engine's tags replay in transformers.
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from safetensors.torch import load_file

from inflight.engine.client import coordinator_of, tagged
from inflight.engine.engine_config import engine_kwargs
from inflight.trainer.transfer_trainer import InflightTrainerInitInfo
from inflight.transport.pusher import PushConfig
from tests.engine_harness import Reference, perturbed, push_at_steps, replay
from tests.helpers import wait_until


@pytest.fixture(scope="module")
def fleet(tiny_qwen, hold_port):
    from vllm import LLM

    llms = [LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=512, seed=s,
                **engine_kwargs(rl_api=True)) for s in (0, 1)]
    yield llms
    for llm in llms:
        with contextlib.suppress(Exception):
            llm.collective_rpc("inflight_stop")
    del llms
    gc.collect()


def _step_both(llms, coordinators, marks_passed, requests: int) -> dict[int, list]:
    """Step both engines in turn until every request finished; an engine whose next commit is
    due (its steps reached the trainer's mark) waits for that commit to be pending first."""
    done: dict[int, list] = {0: [], 1: []}
    while any(llm.llm_engine.has_unfinished_requests() for llm in llms):
        for e, (llm, c) in enumerate(zip(llms, coordinators)):
            if not llm.llm_engine.has_unfinished_requests():
                continue
            due = marks_passed(e)
            if due is not None:
                wait_until(lambda c=c, due=due: c.commit_pending() or c.commits() > due,
                           f"engine {e}'s commit {due + 1}", poll_s=0.001)
            done[e] += [o for o in llm.llm_engine.step() if o.finished]
    assert all(len(v) == requests for v in done.values())
    return done


def test_a_list_of_clients_is_a_fleet_and_every_version_lands_on_each(fleet, tiny_qwen, hold_port) -> None:
    from vllm import SamplingParams
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    base = load_file(str(tiny_qwen / "model.safetensors"))
    info = InflightTrainerInitInfo(rank=0, port=hold_port(), push=PushConfig(dtype="float32", bucket_mb=0.25),
                                   timeout_s=60.0, join_timeout_s=120.0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=fleet, source=base)
    coordinators = [coordinator_of(llm) for llm in fleet]
    states = {0: base}
    marks = [5, 13, 21]

    def push(k: int):
        states[k + 1] = trainer.source = perturbed(base, seed=500 + k, scale=0.02)
        return trainer.send_weights()

    starts = [c.steps for c in coordinators]
    pushes = push_at_steps(lambda: min(c.steps - s for c, s in zip(coordinators, starts)), marks, push)
    sp = SamplingParams(temperature=1.0, max_tokens=40, logprobs=0, ignore_eos=True)
    for e, llm in enumerate(fleet):
        for i in range(6):
            llm.llm_engine.add_request(f"e{e}r{i}", {"prompt_token_ids": [3 + (5 * i + j) % 150 for j in range(8 + i)]},
                                       sp)

    def due(e: int) -> int | None:
        k = coordinators[e].commits()
        return k if k < len(marks) and coordinators[e].steps - starts[e] >= marks[k] + 4 else None

    done = _step_both(fleet, coordinators, due, 6)
    results = pushes.join()
    try:
        assert [sorted(r) for r in results] == [[0, 1]] * 3  # each push: a PushResult per engine
        assert [r[0].version for r in results] == [1, 2, 3]
        for e, c in enumerate(coordinators):
            assert [h.version for h in c.history if h.ok] == [1, 2, 3] and fleet[e].get_weight_version() == "3"
        ref = Reference(tiny_qwen, "float32")
        for e in (0, 1):
            for o in done[e][:2]:
                t = tagged(o.outputs[0])
                assert len(set(t.versions)) > 1, t.versions  # this request decoded across a commit
                want = replay(ref, lambda label: states[int(label)], list(o.prompt_token_ids), t.token_ids, t.labels,
                              t.prompt_label)
                torch.testing.assert_close(torch.tensor(t.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
    finally:
        trainer.shutdown()
