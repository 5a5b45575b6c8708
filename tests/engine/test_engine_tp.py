"""A tensor-parallel (TP=2) engine: two worker processes (vLLM's ``mp`` executor), one
EngineCore (in this process, so the test reads its step counter), one weight group of
three ranks (trainer 0, workers 1 and 2). Every test runs on a tiny Llama and on a tiny
Qwen3-MoE.

- each rank's shard plan: the boxes of the checkpoint its loaders read; the two ranks'
  boxes tile every split tensor, and each rank is sent and stages exactly its own;

- in-flight updates while decoding land on both ranks at the same engine step, with exact
  tags, and the engine then equals transformers with the new weights (fp32, 1e-5);
- every commit runs on each worker's own execution thread (the worker process's main
  thread, the one that runs its forward passes);
- a failure injected into one rank's commit rolls back the other rank, the label stays,
  outputs stay bit-identical, and the next update lands;
- a trainer on vLLM's RL API (``LLM``'s offline methods, the ``inflight`` backend) takes over
  from the project's own: every rank checks the announced update, and its pushes land on both.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from safetensors.torch import load_file

from inflight.engine.client import coordinator_of, start_inflight, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.engine.rpc import WorkerStatus, as_result
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, PushRejected, WeightPusher
from tests.engine_harness import (
    Reference,
    assert_tags_change_at_commits,
    check_fresh,
    check_warm,
    drive,
    llm_sample,
    perturbed,
    push_at_steps,
    stop_engine,
)
from tests.helpers import fail_next_commit_on_vllm_rank_1

PROMPTS = ["1+2=", "count 3 4", "the quick brown", "17+5="]


class TPEngine:
    def __init__(self, model_dir, port: int, monkeypatch: pytest.MonkeyPatch) -> None:
        # one core per rank: without the bind vLLM CPU refuses TP=2 ("Not enough allowed NUMA nodes")
        import vllm.envs
        from vllm import LLM

        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        vllm.envs.disable_envs_cache()  # an earlier in-process engine cached the environment
        self.model_dir = model_dir
        # with the RL API's backend too: the project's own trainer and vLLM's API reach one engine alike
        self.llm = LLM(str(model_dir), tensor_parallel_size=2, distributed_executor_backend="mp", enforce_eager=True,
                       dtype="float32", max_model_len=512, seed=0, **engine_kwargs(rl_api=True))
        self.group = GroupConfig(port=port, world_size=3, timeout_s=120)
        self.report = start_inflight(self.llm, InflightConfig(group=self.group))
        self.pusher = WeightPusher(self.group, PushConfig(dtype="float32", bucket_mb=0.25))
        self.coordinator = coordinator_of(self.llm)
        self.base = load_file(str(model_dir / "model.safetensors"))
        self.version = 0

    def push(self, state):
        self.version += 1
        return self.pusher.push(self.version, state)

    def greedy(self, max_tokens: int = 12):
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        return [(list(o.prompt_token_ids), tagged(o.outputs[0]))
                for o in self.llm.generate(PROMPTS, sp, use_tqdm=False)]

    def statuses(self) -> list[WorkerStatus]:
        """Every worker's status (the workers are processes: their results arrive as maps)."""
        return [as_result(s, WorkerStatus) for s in self.llm.collective_rpc("inflight_status")]

    def close(self) -> None:
        self.pusher.close()
        stop_engine(self.llm)
        del self.llm
        gc.collect()


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_moe"])
def tp(request, hold_port):
    with pytest.MonkeyPatch.context() as mp:
        engine = TPEngine(request.getfixturevalue(request.param), hold_port(), mp)
        yield engine
        engine.close()
    import vllm.envs

    vllm.envs.disable_envs_cache()


def _assert_matches(tp: TPEngine, state, version: int) -> list:
    ref = Reference(tp.model_dir, "float32").load(state)
    outs = tp.greedy()
    for prompt, out in outs:
        assert out.versions == [version] * len(out.token_ids)
        assert out.token_ids == ref.greedy(prompt, len(out.token_ids))
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), ref.logprobs(prompt, out.token_ids),
                                   atol=1e-5, rtol=0)
    return outs


def test_tp2_takes_updates_while_decoding_on_both_ranks_at_one_step(tp: TPEngine) -> None:
    from vllm import SamplingParams

    assert tp.report.ranks == (1, 2)
    assert tp.report.node_workers == 2  # both ranks' host staging was checked against this host's memory
    assert {s.rank for s in tp.statuses()} == {1, 2}
    _assert_matches(tp, tp.base, 0)
    sample = llm_sample(tp.llm)
    check_warm(sample(), sample())
    coordinator = tp.coordinator
    start, commit_at = coordinator.steps, (15, 45, 75)
    pushes = push_at_steps(lambda: coordinator.steps - start, commit_at,
                           lambda k: tp.push(perturbed(tp.base, seed=200 + k, scale=0.02)))
    sp = SamplingParams(temperature=1.0, max_tokens=110, logprobs=0, ignore_eos=True, seed=5)
    # each commit lands within 25 steps of its mark, however slow the machine (see ``drive``)
    outs = drive(tp.llm, coordinator, [f"{i}+{i}=" for i in range(6)], sp, hold_at=[a + 25 for a in commit_at],
                 start=start)
    commits = pushes.join()
    assert [r.version for r in commits] == [1, 2, 3]
    for r in commits:
        # both ranks report the one engine commit: same step, same token counts
        assert set(r.commits) == {1, 2}
        assert r.commits[1].step == r.commits[2].step
        assert r.commits[1].tokens_at_commit == r.commits[2].tokens_at_commit
    assert_tags_change_at_commits(outs, commits, rank=1, start=start, tokens=110)
    # the prefix cache (one scheduler for both ranks) holds no KV of the earlier versions
    check_fresh(sample(), sample(),
                Reference(tp.model_dir, "float32").load(perturbed(tp.base, seed=202, scale=0.02)).logprobs)
    _assert_matches(tp, perturbed(tp.base, seed=202, scale=0.02), 3)
    for status in tp.statuses():
        landed = [c for c in status.commits if c.ok]
        assert [c.version for c in landed][-3:] == [1, 2, 3]
        # the worker process's main thread runs its forward passes and every commit
        assert all(c.main_thread and c.execution_thread for c in landed[-3:]), landed
        assert status.live_version == 3 and status.engine.live_version == 3


def test_failure_on_one_rank_rolls_back_both_and_the_label_stays(tp: TPEngine) -> None:
    before = tp.greedy()
    live = before[0][1].versions[0]
    assert tp.llm.collective_rpc(fail_next_commit_on_vllm_rank_1) == [0, 1]
    with pytest.raises(PushRejected,
                       match=r"(?s)refused at commit: .*\[commit_failed\] .*injected commit failure") as exc:
        tp.push(perturbed(tp.base, seed=300, scale=0.05))
    assert exc.value.phase == "commit" and exc.value.codes == {"commit_failed"}
    reason = exc.value.rejections[1].reason
    assert ("worker rank 2: applying" in reason and "injected commit failure" in reason
            and "rolled back on ranks [1]" in reason)
    assert tp.coordinator.live_version == live and not tp.coordinator.broken
    after = tp.greedy()
    for (_, a), (_, b) in zip(before, after):  # the same weights on both ranks, the same label
        assert b.versions == [live] * len(b.token_ids)
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert [s.live_version for s in tp.statuses()] == [live, live]
    # the next update lands on both ranks
    state = perturbed(tp.base, seed=301, scale=0.02)
    result = tp.push(state)
    assert result.commits[1].step == result.commits[2].step
    _assert_matches(tp, state, tp.version)


def test_each_rank_reports_what_its_loaders_read_and_the_two_tile_every_split_tensor(tp: TPEngine) -> None:
    """The shard plans the ranks send in their hellos: every tensor is read by some rank; a
    tensor a rank reads only part of is split between the two exactly (disjoint boxes that
    tile it); the rest (norms) is read whole by both; no fallback on Llama."""
    from inflight.memory import update_bytes
    from inflight.shard_plan import check_plan, plan_bytes
    from inflight.transport.schema import TensorSchema

    schema = {n: (tuple(t.shape), "float32") for n, t in tp.base.items()}
    plans = {r: tp.pusher.group.hellos[r].plan for r in (1, 2)}
    assert all(p is not None for p in plans.values())
    for r, p in plans.items():
        check_plan(p, schema, f"rank {r}")
    assert plans[1].digest == tp.report.plan_digest  # the first worker's, as its StartReport said
    boxes = {r: {s.name: s for s in p.shards} for r, p in plans.items()}
    split = []
    for name, (shape, _) in schema.items():
        a, b = boxes[1][name], boxes[2][name]
        if a.length == shape and b.length == shape:
            continue  # replicated
        split.append(name)
        dims = [i for i in range(len(shape)) if a.length[i] != shape[i] or b.length[i] != shape[i]]
        assert len(dims) == 1, (name, a, b)
        d = dims[0]
        first, second = sorted([a, b], key=lambda s: s.start[d])
        assert first.start[d] == 0 and first.start[d] + first.length[d] == second.start[d]  # disjoint, adjacent
        assert second.start[d] + second.length[d] == shape[d]  # together, the whole tensor
    kinds = {n.rsplit(".", 1)[0].split(".")[-1] for n in split}
    # a Qwen3-MoE's experts are split the same way; its embeddings are tied (no lm_head); its router is read whole
    moe = any(".experts." in n for n in schema)
    expected = ({"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"}
                | (set() if moe else {"lm_head"}))
    assert kinds == expected, kinds
    # one KV head for two ranks: vLLM replicates k_proj and v_proj, and each rank reads them whole
    total = sum(math.prod(shape) * 4 for shape, _ in schema.values())
    split_bytes = sum(math.prod(schema[n][0]) * 4 for n in split)
    counted = {r: plan_bytes(p, schema) for r, p in plans.items()}
    assert counted[1].sharded + counted[2].sharded == split_bytes  # each split byte read by one rank
    for r, b in counted.items():
        assert b.fallback == 0 and plans[r].fallbacks == ()
        assert b.replicated == total - split_bytes and b.total == b.sharded + total - split_bytes
    # every member sent a plan: each rank is sent, and stages, exactly its boxes
    assert tp.pusher.group.point_to_point
    mine = {r: update_bytes(TensorSchema(schema), p) for r, p in plans.items()}
    assert max(mine.values()) < 0.6 * update_bytes(TensorSchema(schema))
    state = perturbed(tp.base, seed=250, scale=0.02)
    result = tp.push(state)
    assert result.send.nbytes == sum(mine.values()) == result.send.delivered_bytes  # each rank its own bytes
    assert sorted(tp.llm.collective_rpc(_staging_buffer_bytes)) == sorted(mine.values())
    _assert_matches(tp, state, tp.version)


def _staging_buffer_bytes(worker) -> int:
    """Inside a worker: the bytes of its staging buffer (the swap commit keeps no rollback copy)."""
    pool = worker._inflight_pool
    assert pool.previous is None and len(pool._free) == 1
    return pool._free[0].numel()


def test_a_trainer_on_vllms_rl_api_takes_over_both_ranks(tp: TPEngine) -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from inflight.engine.transfer_engine import RLApiError
    from inflight.trainer.transfer_trainer import InflightTrainerInitInfo, update_info

    tp.pusher.close()  # the project's trainer leaves; one on vLLM's API joins the same group
    info = InflightTrainerInitInfo(rank=0, port=tp.group.port, tensor_parallel_size=2, timeout_s=tp.group.timeout_s,
                                   push=PushConfig(dtype="float32", bucket_mb=0.25))
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=tp.llm, source=tp.base)
    try:
        assert trainer.version == tp.version  # it goes on from what the engine serves
        tp.llm.start_weight_update()
        bad = update_info(tp.version + 1, tp.base, "float32")
        # each worker refuses in its result (an error raised in one worker of the mp executor would leave the
        # other's reply queued for the next call); EngineCore raises it, once both replied
        with pytest.raises(RLApiError, match="a list of 1; this engine has 2 workers"):
            tp.llm.update_weights({"update_info": [bad]})
        with pytest.raises(RLApiError, match="finish_weight_update without update_weights"):
            tp.llm.finish_weight_update()  # refused (nothing announced), and closed
        for seed in (400, 401):
            state = trainer.source = perturbed(tp.base, seed=seed, scale=0.02)
            result = trainer.send_weights()
            assert set(result.commits) == {1, 2} and result.commits[1].step == result.commits[2].step
            tp.version = result.version
            _assert_matches(tp, state, tp.version)
    finally:
        trainer.shutdown()
        tp.pusher = WeightPusher(tp.group, PushConfig(dtype="float32", bucket_mb=0.25))
