"""The ``copy`` commit replays a load plan recorded against the live parameters, so each
tensor-parallel rank is sent, stages and keeps as its rollback copy only the boxes of the
checkpoint its loaders read (as ``swap`` does).

On CPU the copy is right only where vLLM's linears keep their weights in their parameters
(``INFLIGHT_CPU_PLAIN_GEMM=1``: ``inflight.engine.patch.use_plain_cpu_gemm``). The plugin
applies that patch in every process that builds an engine, this pytest process included
when EngineCore runs in it; so every engine built with it here runs in a spawned process of
its own (its TP workers inherit the variable), and no other test module's engine sees it.

- a TP=1 (tiny Qwen2: tied embeddings, qkv bias) and a TP=2 (tiny Llama) CPU engine with
  ``commit='copy'`` take three in-flight updates while decoding, then equal transformers at
  fp32 within 1e-5;
- each TP=2 rank stages exactly its plan's bytes (below the whole model), and its rollback
  copy holds exactly its boxes of the checkpoint;
- a commit that fails after writing (a first one, rolled back from the checkpoint's boxes
  read at start; a later one, from the last update's staged boxes) leaves outputs
  bit-identical;
- ``copy`` on a CPU engine whose GEMM prepacks is refused, naming the variable.
"""

from __future__ import annotations

import gc
import os
from multiprocessing import get_context
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from inflight.settings import PLAIN_CPU_GEMM_ENV
from tests.engine_harness import Reference, perturbed

PROMPTS = ["1+2=", "count 3 4", "the quick brown", "17+5="]
COMMIT_AT = (6, 18, 30)  # engine steps (from the drive's start) at which the trainer pushes
STATE_SEED = 400  # the k-th in-flight update is perturbed(base, STATE_SEED + k)


def _fail_after_applying_on_last_rank(worker) -> int:
    """Inside each worker: the last vLLM rank's next apply writes the new weights, then fails
    (``fail_after_applying``); it restores from its rollback copy, and every other rank undoes
    from its own."""
    from tests.helpers import fail_after_applying

    if worker.rank != worker.vllm_config.parallel_config.world_size - 1:
        return 0
    return fail_after_applying(worker)


def _worker_facts(worker) -> dict[str, Any]:
    """Inside each worker: its commit, its plan's bytes, its staging buffers, and whether its
    rollback copy (at start: the checkpoint read at ``inflight_start``) is exactly its boxes."""
    from safetensors.torch import load_file

    from inflight.engine.commit.base import cpu_gemm_prepacking
    from inflight.engine.commit.engine_checkpoint import checkpoint_dir, checkpoint_schema
    from inflight.memory import update_bytes

    mc = worker.vllm_config.model_config
    model_dir = checkpoint_dir(mc.model, mc.revision)
    schema = checkpoint_schema(model_dir, mc.dtype)
    strategy, pool = worker._inflight_target.strategy, worker._inflight_pool
    plan = strategy.shard_plan()
    model = strategy.runner.get_model()
    boxes_exact = None
    if pool.previous is not None and plan is not None and worker._inflight_target.live_version == 0:
        base = load_file(str(model_dir / "model.safetensors"))
        boxes_exact = True
        for s in plan.shards:
            want = base[s.name]
            for d, (b, n) in enumerate(zip(s.start, s.length)):
                want = want.narrow(d, b, n)
            boxes_exact &= torch.equal(pool.previous.views[s.name], want)
    return {
        "rank": worker.rank, "strategy": strategy.name, "has_plan": strategy.load_plan is not None,
        "loaded": sorted(strategy.load_plan.loaded) if strategy.load_plan is not None else None,
        "fallbacks": list(plan.fallbacks) if plan is not None else None,
        "planned": update_bytes(schema, plan), "whole": update_bytes(schema),
        "buffers": sorted([pool.previous.flat.numel()] + [t.numel() for t in pool._free]),
        "rollback_boxes_exact": boxes_exact,
        "prepack": cpu_gemm_prepacking(p.dtype for p in model.parameters() if p.is_floating_point()),
        "linears_keep_weights": all(m.weight.numel() > 0 for m in model.modules() if hasattr(m, "cpu_linear")),
    }


def _float32_prepack(worker) -> str | None:
    """Inside the worker: what its CPU GEMM packs float32 linear weights for (None: nothing)."""
    from inflight.engine.commit.base import cpu_gemm_prepacking

    return cpu_gemm_prepacking([torch.float32])


def _greedy(llm) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    from inflight.engine.client import tagged

    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0, ignore_eos=True)
    outs = []
    for o in llm.generate(PROMPTS, sp, use_tqdm=False):
        t = tagged(o.outputs[0])
        outs.append({"prompt": list(o.prompt_token_ids), "tokens": list(t.token_ids), "logprobs": list(t.logprobs),
                     "versions": list(t.versions)})
    return outs


def _refused_commit(llm, push) -> dict[str, Any]:
    """Outputs before and after an update whose commit fails after writing, and the refusal."""
    from inflight.transport.pusher import PushRejected

    before = _greedy(llm)
    llm.collective_rpc(_fail_after_applying_on_last_rank)
    try:
        push()
    except PushRejected as e:
        refusal = {"phase": e.phase, "codes": sorted(e.codes), "reason": str(e)}
    else:
        refusal = None
    return {"before": before, "after": _greedy(llm), "refusal": refusal}


def run_copy_engine(model_dir: str, tp: int) -> dict[str, Any]:
    """Process entry point: a ``copy`` CPU engine with the plain GEMM, driven through a refused
    first commit, three in-flight updates while decoding and a refused later commit; returns
    what the parent checks (plain data)."""
    os.environ[PLAIN_CPU_GEMM_ENV] = "1"  # before the engine: the plugin reads it in every vLLM process
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))  # one core per rank
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams

    from inflight.engine.client import coordinator_of, start_inflight, tagged
    from inflight.engine.engine_config import InflightConfig, engine_kwargs
    from inflight.transport.group_config import GroupConfig
    from inflight.transport.pusher import PushConfig, WeightPusher
    from inflight.transport.store import release_port, reserve_port
    from tests.engine_harness import drive, push_at_steps, stop_engine

    base = load_file(str(Path(model_dir) / "model.safetensors"))
    port = reserve_port()
    llm = LLM(model_dir, tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
              enforce_eager=True, dtype="float32", max_model_len=512, seed=0, **engine_kwargs())
    pusher = None
    try:
        group = GroupConfig(port=port, world_size=tp + 1, timeout_s=120)
        report = start_inflight(llm, InflightConfig(group=group, commit="copy", keep_rollback=True))
        pusher = WeightPusher(group, PushConfig(dtype="float32", bucket_mb=0.25))
        out: dict[str, Any] = {"commit": report.commit, "start": llm.collective_rpc(_worker_facts)}
        version = 1  # refused: the in-flight updates are versions 2, 3 and 4
        out["first_refused"] = _refused_commit(llm, lambda: pusher.push(version, perturbed(base, seed=90, scale=0.05)))

        coordinator = coordinator_of(llm)
        start = coordinator.steps
        states = [perturbed(base, seed=STATE_SEED + k, scale=0.02) for k in range(len(COMMIT_AT))]
        pushes = push_at_steps(lambda: coordinator.steps - start, COMMIT_AT,
                               lambda k: pusher.push(version + 1 + k, states[k]))
        sp = SamplingParams(temperature=1.0, max_tokens=44, logprobs=0, ignore_eos=True, seed=5)
        # each commit lands within 8 steps of its mark, however slow the machine (see ``drive``)
        # a push that failed releases the hold (its error is raised by ``join`` below)
        finals = drive(llm, coordinator, PROMPTS, sp, hold_at=[a + 8 for a in COMMIT_AT], start=start,
                       release=lambda: not pushes.alive())
        results = pushes.join()
        out["pushes"] = [{"version": r.version, "send_bytes": r.send.nbytes,
                          "commits": {rank: {"step": c.step - start, "commit_ms": c.commit_ms,
                                             "tokens_at_commit": dict(c.tokens_at_commit)}
                                      for rank, c in r.commits.items()}} for r in results]
        out["decoded"] = {o.request_id: list(tagged(o.outputs[0]).versions) for o in finals}
        out["final"] = _greedy(llm)
        out["end"] = llm.collective_rpc(_worker_facts)
        out["point_to_point"] = pusher.group.point_to_point
        last = version + len(COMMIT_AT)
        out["last_refused"] = _refused_commit(llm, lambda: pusher.push(last + 1, perturbed(base, seed=91, scale=0.05)))
        return out
    finally:
        if pusher is not None:
            pusher.close()
        stop_engine(llm)
        del llm
        gc.collect()
        release_port("127.0.0.1", port)


def _run_and_report(model_dir: str, tp: int, results: Any) -> None:
    """Process entry point: ``run_copy_engine``'s result, or its traceback, on ``results``."""
    import traceback

    try:
        results.put(("ok", run_copy_engine(model_dir, tp)))
    except BaseException:  # reported to the parent, which fails the test with it
        results.put(("error", traceback.format_exc()))


@pytest.fixture(scope="module", params=[("tiny_qwen", 1), ("tiny_llama", 2)], ids=["tp1-qwen2", "tp2-llama"])
def copy_run(request) -> tuple[Path, int, dict[str, Any]]:
    name, tp = request.param
    model_dir = request.getfixturevalue(name)
    ctx = get_context("spawn")
    results = ctx.Queue()
    # not daemonic: it starts TP workers
    child = ctx.Process(target=_run_and_report, args=(str(model_dir), tp, results))
    child.start()
    try:
        kind, value = results.get(timeout=900)  # a hung engine fails the test rather than the whole run
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join()
    assert kind == "ok", f"the copy engine's process failed:\n{value}"
    return Path(model_dir), tp, value


def _assert_matches(model_dir: Path, state: dict[str, torch.Tensor], outs: list[dict], version: int) -> None:
    ref = Reference(model_dir, "float32").load(state)
    for o in outs:
        assert o["versions"] == [version] * len(o["tokens"])
        assert o["tokens"] == ref.greedy(o["prompt"], len(o["tokens"]))
        torch.testing.assert_close(torch.tensor(o["logprobs"], dtype=torch.float64),
                                   ref.logprobs(o["prompt"], o["tokens"]), atol=1e-5, rtol=0)


def test_copy_engine_takes_three_updates_while_decoding_and_equals_transformers(copy_run) -> None:
    from safetensors.torch import load_file

    from inflight.versions import boundaries, is_monotone

    model_dir, tp, run = copy_run
    assert run["commit"] == "copy"
    for facts in run["start"]:
        # the plain GEMM is in effect in every worker: linears keep their weights, nothing prepacks
        assert facts["strategy"] == "copy" and facts["has_plan"] and facts["loaded"] == []
        assert facts["prepack"] is None and facts["linears_keep_weights"]
    pushes = run["pushes"]
    assert [p["version"] for p in pushes] == [2, 3, 4]
    for p in pushes:
        assert set(p["commits"]) == set(range(1, tp + 1))
        steps = {c["step"] for c in p["commits"].values()}
        assert len(steps) == 1  # every rank at one engine step
        assert len({tuple(sorted(c["tokens_at_commit"].items())) for c in p["commits"].values()}) == 1
    first_rank = pushes[0]["commits"][1]
    for rid, versions in run["decoded"].items():
        assert len(versions) == 44 and is_monotone(versions)
        first = boundaries(versions)
        assert set(first) == {0, 2, 3, 4}, first  # the refused v1 never served a token
        for p in pushes:
            c = p["commits"][1]
            assert first[p["version"]] == c["tokens_at_commit"][rid] == c["step"]
    assert first_rank["step"] >= COMMIT_AT[0]
    base = load_file(str(model_dir / "model.safetensors"))
    _assert_matches(model_dir, perturbed(base, seed=STATE_SEED + 2, scale=0.02), run["final"], 4)


def test_each_rank_stages_and_keeps_exactly_its_planned_bytes(copy_run) -> None:
    model_dir, tp, run = copy_run
    assert run["point_to_point"]  # every worker sent a plan: each is sent its boxes alone
    for when in ("start", "end"):
        for facts in run[when]:
            # the staging buffer and the rollback copy: one update of this rank's boxes each
            assert facts["buffers"] == [facts["planned"]] * 2, (when, facts)
    for facts in run["start"]:
        assert facts["rollback_boxes_exact"]  # read from the checkpoint at start, box by box
        assert facts["fallbacks"] == []
    planned = [f["planned"] for f in run["start"]]
    whole = run["start"][0]["whole"]
    for p in run["pushes"]:
        assert p["send_bytes"] == sum(planned)
    if tp == 1:
        assert planned == [whole]
    else:
        assert max(planned) < 0.6 * whole  # split linears and embeddings: well below the whole model
        assert sum(planned) > whole  # replicated norms and the single KV head are read by both ranks
    print(f"\ncopy TP={tp}: staged per rank {planned} B, whole model {whole} B; commit ms "
          f"{[round(c['commit_ms'], 2) for p in run['pushes'] for c in p['commits'].values()]}")


def test_a_commit_failing_after_the_copy_wrote_leaves_outputs_bit_identical(copy_run) -> None:
    model_dir, tp, run = copy_run
    for what, live in (("first_refused", 0), ("last_refused", 4)):
        r = run[what]
        assert r["refusal"] is not None, what
        assert r["refusal"]["phase"] == "commit" and r["refusal"]["codes"] == ["commit_failed"], r["refusal"]
        assert "injected failure after the weights were written" in r["refusal"]["reason"]
        assert r["after"] == r["before"], what  # token ids, log-probs and labels, bit for bit
        assert all(o["versions"] == [live] * len(o["tokens"]) for o in r["after"])
    from safetensors.torch import load_file

    _assert_matches(model_dir, load_file(str(model_dir / "model.safetensors")), run["first_refused"]["after"], 0)


def test_this_process_never_saw_the_plain_gemm() -> None:
    """The engines above patched vLLM in their own processes only."""
    import vllm._custom_ops as ops

    assert PLAIN_CPU_GEMM_ENV not in os.environ
    assert ops._supports_onednn == bool(hasattr(torch.ops._C, "create_onednn_mm_handler"))


def test_copy_is_refused_on_a_cpu_engine_whose_gemm_prepacks(tiny_llama, port) -> None:
    from vllm import LLM

    from inflight.engine.client import start_inflight
    from inflight.engine.commit.base import resolve_strategy
    from inflight.engine.engine_config import InflightConfig, engine_kwargs
    from inflight.transport.group_config import GroupConfig

    cpu = torch.device("cpu")
    assert resolve_strategy("copy", cpu, quantized=False, eager=True, cpu_prepack=None) == "copy"
    # auto never copies on CPU
    assert resolve_strategy("auto", cpu, quantized=False, eager=True, cpu_prepack=None) == "swap"
    assert resolve_strategy("auto", cpu, quantized=False, eager=False, cpu_prepack=None) == "reload"
    llm = LLM(str(tiny_llama), enforce_eager=True, dtype="float32", max_model_len=256, seed=0, **engine_kwargs())
    try:
        prepack = llm.collective_rpc(_float32_prepack)[0]
        if prepack is None:
            pytest.skip("this vLLM build's CPU GEMM does not prepack float32 weights")
        with pytest.raises(Exception,
                           match=rf"commit='copy' is wrong on this CPU engine: .*{prepack}.*{PLAIN_CPU_GEMM_ENV}=1"):
            start_inflight(llm, InflightConfig(group=GroupConfig(port=port, world_size=2, timeout_s=20), commit="copy"))
    finally:
        del llm
        gc.collect()


def test_rollback_copy_sizes_must_match_the_plan(tmp_path) -> None:
    """``read_checkpoint_into`` refuses a buffer the plan's layout does not fill exactly."""
    from safetensors.torch import save_file

    from inflight.engine.commit.engine_checkpoint import read_checkpoint_into
    from inflight.memory import update_bytes
    from inflight.shard_plan import make_plan, whole
    from inflight.transport.schema import TensorSchema

    full = {"a": torch.arange(48, dtype=torch.float32).view(8, 6), "b": torch.arange(6, dtype=torch.float32)}
    save_file(full, str(tmp_path / "model.safetensors"))
    schema = TensorSchema({"a": ((8, 6), "float32"), "b": ((6,), "float32")})
    plan = make_plan({"a": ((2, 1), (4, 3)), "b": whole((6,))}, [])
    n = update_bytes(schema, plan)
    assert n < update_bytes(schema)
    views = read_checkpoint_into(tmp_path, schema, torch.zeros(n, dtype=torch.uint8), plan)
    assert torch.equal(views["a"], full["a"][2:6, 1:4]) and torch.equal(views["b"], full["b"])
    with pytest.raises(ValueError, match="this rank's boxes of the checkpoint lays out in"):
        read_checkpoint_into(tmp_path, schema, torch.zeros(update_bytes(schema), dtype=torch.uint8), plan)
    assert read_checkpoint_into(tmp_path, schema,
                                torch.zeros(update_bytes(schema), dtype=torch.uint8))["a"].shape == (8, 6)


class _LoaderProperty(torch.nn.Parameter):
    """A parameter whose loader is a property over ``_weight_loader`` (as vLLM's v2 parameters)."""

    @property
    def weight_loader(self):
        return self._weight_loader

    @weight_loader.setter
    def weight_loader(self, value) -> None:
        self._weight_loader = value


class _RankOne(torch.nn.Module):
    """Loaders as a second tensor-parallel rank's: ``w`` takes rows 2..4 of its checkpoint
    tensor, ``b`` all of it; ``flip`` reverses each tensor on the way (not a plain routing)."""

    def __init__(self, flip: bool = False) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((2, 3), 7.0), requires_grad=False)
        self.b = _LoaderProperty(torch.full((3,), 7.0), requires_grad=False)
        self.w.weight_loader = lambda p, t: p.data.copy_(t.narrow(0, 2, 2))
        self.b.weight_loader = lambda p, t: p.data.copy_(t)
        self.flip = flip

    def load_weights(self, weights) -> None:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for name, t in weights:
            p = getattr(self, name)
            getattr(p, "weight_loader", default_weight_loader)(p, t.flip(0) if self.flip else t)


def _runner(model: torch.nn.Module) -> SimpleNamespace:
    """What ``CopyStrategy`` reads of vLLM's model runner."""
    return SimpleNamespace(device=torch.device("cpu"), get_model=lambda: model)


def test_the_copy_plan_is_recorded_on_cpu_scratch_and_replays_the_loaders_from_boxes(caplog) -> None:
    from inflight.engine.commit.copy import CopyStrategy, _CpuScratch

    shapes = {"w": ((4, 3), torch.float32), "b": ((3,), torch.float32)}
    model = _RankOne()
    b_loader = model.b.weight_loader
    strategy = CopyStrategy(_runner(model), shapes)
    assert model.b.weight_loader is b_loader  # recording put the property-backed loader back too
    # recording wrote only into scratch: the live parameters are as they were
    assert torch.equal(model.w, torch.full((2, 3), 7.0)) and torch.equal(model.b, torch.full((3,), 7.0))
    scratch = _CpuScratch({id(model.w): model.w})
    a, b = scratch[id(model.w)], scratch[id(model.w)]
    assert a is not b and a.device.type == "cpu" and a.stride() == model.w.stride()  # made per access, never kept
    assert a.weight_loader is model.w.weight_loader  # with the live parameter's own loader
    plan = strategy.shard_plan()
    assert {s.name: (s.start, s.length) for s in plan.shards} == {"w": ((2, 0), (2, 3)), "b": ((0,), (3,))}
    full = {"w": torch.arange(12.0).view(4, 3), "b": torch.tensor([1.0, 2.0, 3.0])}
    boxed = {"w": full["w"][2:4].clone(), "b": full["b"].clone()}  # as this rank stages them
    strategy.prepare(boxed)
    strategy.apply()
    assert torch.equal(model.w, full["w"][2:4]) and torch.equal(model.b, full["b"])
    strategy.undo({"w": torch.zeros(4, 3), "b": torch.zeros(3)})  # a whole rollback copy reads the same rows
    assert not model.w.any() and not model.b.any()
    # a model whose loading transforms tensors: no plan, whole tensors, load_weights (logged)
    caplog.set_level("WARNING", logger="inflight.commit")
    model = _RankOne(flip=True)
    strategy = CopyStrategy(_runner(model), shapes)
    assert strategy.shard_plan() is None and strategy.load_plan is None
    assert "no load plan for the copy commit of _RankOne" in caplog.text
    strategy.prepare(full)
    strategy.apply()
    assert torch.equal(model.w, full["w"].flip(0)[2:4]) and torch.equal(model.b, full["b"].flip(0))
