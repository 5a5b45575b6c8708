"""Layer-granular in-flight commits (``InflightConfig(commit_unit="layer")``) on a real vLLM
CPU engine (in-process EngineCore, the swap commit).

- updates commit one layer group per step boundary while requests decode, and every token
  is tagged with the hybrid that sampled it (``"0>1:2"``): a transformers model rebuilt from
  each tag alone (groups at the new version, the rest at the old) reproduces the engine's
  behaviour log-probs, over at least 8 partial states; the same tag shifted by one group
  does not;
- the staging a rank held at its peak is the configured groups, never a model;
- a group that fails its checksum stops the update: the groups before it stay live, the
  engine serves and tags that hybrid exactly, and the next push completes the model with
  transformers parity;
- bad layouts (a group holding another group's tensor, groups out of order) are refused.
Pushes are triggered by engine steps, never by wall-clock time.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from inflight.engine.client import coordinator_of, inflight_status, start_inflight, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.engine.rpc import WorkerStatus, as_result
from inflight.layer_groups import Hybrid, layer_groups, parse_label
from inflight.memory import update_bytes
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import LayerPushIncomplete, PushConfig, WeightPusher
from inflight.transport.schema import TensorSchema
from tests.engine_harness import (
    Reference,
    check_fresh,
    check_warm,
    llm_sample,
    perturbed,
    push_at_steps,
    replay,
    stop_engine,
)
from tests.helpers import tampering, wait_until

EXACT = 1e-4  # fp32 behaviour log-probs against transformers (measured <= 2e-6 on whole versions)


class LayerEngine:
    """An in-process engine committing layer groups, its trainer, and the versions pushed."""

    def __init__(self, model_dir, port: int, staged_groups: int = 2, tp: int = 1, scale: float = 0.05,
                 commit: str = "auto") -> None:
        from vllm import LLM

        self.model_dir, self.scale = model_dir, scale
        extra = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
        self.llm = LLM(str(model_dir), enforce_eager=True, dtype="float32", max_model_len=512, seed=0, **extra,
                       **engine_kwargs())
        group = GroupConfig(port=port, world_size=1 + tp, timeout_s=60)
        self.report = start_inflight(self.llm, InflightConfig(group=group, commit_unit="layer", commit=commit,
                                                              staged_groups=staged_groups))
        self.pusher = WeightPusher(group, PushConfig(dtype="float32", bucket_mb=0.05))
        self.coordinator = coordinator_of(self.llm)
        self.versions = {0: load_file(str(model_dir / "model.safetensors"))}
        self.groups = layer_groups(self.versions[0])

    def push(self, version: int):
        self.versions[version] = perturbed(self.versions[0], seed=100 + version, scale=self.scale)
        return self.pusher.push(version, self.versions[version])

    def weights_of(self, label: str) -> dict[str, torch.Tensor]:
        """The weights a label names, rebuilt from it alone."""
        by_group = parse_label(label).group_versions(len(self.groups))
        return {n: self.versions[v][n] for g, v in enumerate(by_group) for n in self.groups[g]}

    def statuses(self) -> list[WorkerStatus]:
        return [as_result(s, WorkerStatus) for s in self.llm.collective_rpc("inflight_status")]

    def close(self) -> None:
        self.pusher.close()
        stop_engine(self.llm)
        del self.llm
        gc.collect()


@pytest.fixture
def engine(tiny_llama, port):
    e = LayerEngine(tiny_llama, port)
    yield e
    e.close()


def _decode_across(e: LayerEngine, pushes: list[int], at: list[int], requests: int = 4, tokens: int = 150) -> list:
    """Decode ``requests`` sampled requests while the pushes land; their tagged completions.
    From 10 steps past the last push's mark the engine steps only as each of the outstanding
    layer groups becomes committable, so every update lands whole while the requests decode
    however slowly the machine stages (an event, never a deadline)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = e.llm.llm_engine
    sp = SamplingParams(temperature=1.0, max_tokens=tokens, logprobs=0, ignore_eos=True, seed=7,
                        output_kind=RequestOutputKind.FINAL_ONLY)
    prompts = {}
    for i in range(requests):
        engine.add_request(f"r{i}", {"prompt_token_ids": [1 + i, 5, 9, 13]}, sp)
        prompts[f"r{i}"] = [1 + i, 5, 9, 13]
    start = e.coordinator.steps
    trainer = push_at_steps(lambda: e.coordinator.steps - start, at, lambda k: e.push(pushes[k]))
    done = {}
    last = str(pushes[-1]) if pushes else None
    while engine.has_unfinished_requests():
        if last is not None and e.coordinator.steps - start >= at[-1] + 10 and str(e.coordinator.label) != last:
            label = str(e.coordinator.label)
            wait_until(lambda label=label: e.coordinator.commit_pending() or str(e.coordinator.label) != label,
                       f"a layer group of v{last} to be committable (held at label {label})", poll_s=0.001)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (prompts[out.request_id], tagged(out.outputs[0]))
    trainer.join()
    return [done[k] for k in sorted(done)]


def _errors_by_label(e: LayerEngine, finished: list, rebuild=lambda label: label) -> dict[str, float]:
    """For each label, the largest |engine - reference| log-prob over the tokens it tagged, the
    reference rebuilding the weights of each step from ``rebuild(label)`` (``replay``)."""
    ref = Reference(e.model_dir, "float32")
    worst: dict[str, float] = {}
    for prompt, t in finished:
        want = replay(ref, lambda s: e.weights_of(rebuild(s)), prompt, t.token_ids, t.labels)
        err = (torch.tensor(t.logprobs, dtype=torch.float64) - want).abs()
        for label in set(t.labels):
            idx = [i for i, s in enumerate(t.labels) if s == label]
            worst[label] = max(worst.get(label, 0.0), float(err[idx].max()))
    return worst


def _assert_labels_follow_the_commits(finished: list, groups: int) -> None:
    """Each label is a whole version or ``v-1>v:n`` with 0 < n < ``groups``; along each
    completion the labels only move forward (version, then groups committed); every completion
    carries the same label at the same token."""
    def place(label: str) -> tuple[int, int]:
        h = parse_label(label)
        if not h.steps:
            return h.base, 0
        assert len(h.steps) == 1 and h.steps[0][0] == h.base + 1 and 0 < h.steps[0][1] < groups, label
        return h.base, h.steps[0][1]

    for _, t in finished:
        places = [place(s) for s in t.labels]
        assert places == sorted(places), t.labels
    assert len({tuple(t.labels) for _, t in finished}) == 1, "requests of one batch disagree on a step's weights"


def _shifted(label: str, by: int) -> str:
    h = parse_label(label)
    to, n = h.steps[-1]
    return str(Hybrid(h.base, h.steps[:-1] + ((to, n + by),)))


def test_hybrid_tags_rebuild_the_exact_weights(engine: LayerEngine) -> None:
    e = engine
    sample = llm_sample(e.llm)
    check_warm(sample(), sample())
    finished = _decode_across(e, pushes=[1, 2, 3], at=[5, 40, 75])
    assert e.coordinator.label == Hybrid(3) and e.coordinator.live_version == 3
    # every group's commit invalidated the prefix cache: no block of an earlier hybrid serves v3
    assert e.coordinator.prefix_cache.stats.invalidations == 3 * len(e.groups)
    check_fresh(sample(), sample(), Reference(e.model_dir, "float32").load(e.versions[3]).logprobs)
    hybrids = sorted({s for _, t in finished for s in t.labels if ">" in s})
    # which partial states sample a token depends on how many groups verify between two steps
    # (the load); what the commits guarantee: every label is a state of the chain 0, 0>1:1 ..
    # 0>1:3, 1, .. 3, the labels move along it in order, and the requests, decoded in one
    # batch, change label at the same token (the commit's step boundary)
    _assert_labels_follow_the_commits(finished, len(e.groups))
    assert hybrids, "no token was sampled by a partial state: the shifted-tag check below has nothing to test"
    for _, t in finished:  # a hybrid's integer tag is its oldest version: the conservative lag
        assert t.versions == [parse_label(s).oldest for s in t.labels]
    worst = _errors_by_label(e, finished)
    print(f"{len(hybrids)} hybrid labels; worst |engine - rebuilt| {max(worst.values()):.2e} over {len(worst)} labels")
    assert max(worst.values()) < EXACT, worst
    # the tag matters: one group more or less at the new version is other weights
    for by in (-1, 1):
        shifted = _errors_by_label(e, finished, lambda s, by=by: (
            _shifted(s, by) if ">" in s and 0 < parse_label(s).steps[-1][1] + by < len(e.groups) else s))
        moved = [s for s in hybrids if 0 < parse_label(s).steps[-1][1] + by < len(e.groups)]
        print(f"shifted by {by:+d} group: smallest worst error {min(shifted[s] for s in moved):.2e} over "
              f"{len(moved)} labels")
        assert moved and all(shifted[s] > 10 * EXACT for s in moved), {s: shifted[s] for s in moved}
    # staging never held more than the configured groups
    schema = TensorSchema({n: (tuple(t.shape), "float32") for n, t in e.versions[0].items()})
    largest = max(update_bytes(schema, names=g) for g in e.groups)
    status = inflight_status(e.llm)
    assert 0 < status.staging_peak_bytes <= 2 * largest < update_bytes(schema), (status.staging_peak_bytes, largest)


def test_a_group_that_fails_leaves_a_served_hybrid_and_the_next_push_completes(engine: LayerEngine) -> None:
    e = engine
    assert sorted(e.push(1).commits) == [1]
    buckets = {"n": 0}
    group_of_bucket: list[int] = []

    def corrupt_group_2(header, data):  # the third group's first bucket arrives damaged
        buckets["n"] += 1
        if header.index == 0:
            group_of_bucket.append(len(group_of_bucket))
        if len(group_of_bucket) == 3 and header.index == 0:
            data = data.clone()
            data[0] ^= 0xFF
        return header, data

    with (pytest.raises(LayerPushIncomplete, match=r"(?s)update v2 stopped at layer group 2 of \d+; groups 0\.\.1 "
                                                   r"landed: .*\[checksum\]") as stopped,
          tampering(e.pusher, corrupt_group_2)):
        e.push(2)
    assert stopped.value.landed == 2 and stopped.value.group == 2 and "checksum" in stopped.value.codes
    assert str(e.coordinator.label) == "1>2:2" and e.coordinator.live_version == 1
    # the engine serves that hybrid, and tags it so that it can be rebuilt exactly
    finished = _decode_across(e, pushes=[], at=[], requests=2, tokens=20)
    assert {s for _, t in finished for s in t.labels} == {"1>2:2"}
    assert max(_errors_by_label(e, finished).values()) < EXACT
    # the next update completes the model: parity with its version whole
    e.push(3)
    assert e.coordinator.label == Hybrid(3)
    finished = _decode_across(e, pushes=[], at=[], requests=2, tokens=20)
    assert {s for _, t in finished for s in t.labels} == {"3"}
    assert max(_errors_by_label(e, finished).values()) < 1e-5


def test_tp2_ranks_commit_each_group_together_and_stage_their_shards_only(tiny_moe, port, monkeypatch) -> None:
    """TP=2 (two worker processes, shard plans): each group commits on both ranks at one step,
    the hybrids are exact, each rank's staging peak is at most two groups of its own boxes,
    and after the update the engine equals transformers."""
    import vllm.envs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    vllm.envs.disable_envs_cache()
    e = LayerEngine(tiny_moe, port, tp=2)
    try:
        assert e.report.ranks == (1, 2) and e.pusher.group.point_to_point
        finished = _decode_across(e, pushes=[1, 2], at=[5, 40], requests=2, tokens=90)
        assert e.coordinator.label == Hybrid(2)
        assert len({s for _, t in finished for s in t.labels if ">" in s}) >= 4
        assert max(_errors_by_label(e, finished).values()) < EXACT
        for record in e.coordinator.history:  # every group went live on both ranks in one window
            assert record.ok and sorted(w.rank for w in record.workers) == [1, 2]
        schema = TensorSchema({n: (tuple(t.shape), "float32") for n, t in e.versions[0].items()})
        for hello, status in zip(sorted(e.pusher.group.hellos.items()), sorted(e.statuses(), key=lambda s: s.rank)):
            rank, joined = hello
            largest = max(update_bytes(schema, joined.plan, g) for g in e.groups)
            assert 0 < status.staging_peak_bytes <= 2 * largest < update_bytes(schema, joined.plan), (rank, status)
        # group 2 arrives damaged on rank 1 only: rank 2, which verified and handed it over, hears
        # from its coordinator that rank 1 refused it (not after a commit timeout), and neither
        # rank commits it: both serve the same hybrid
        seen: list[int] = []

        def corrupt_rank_1_group_2(header, data):  # point to point: each group's bucket 0 goes to rank 1 first
            if header.index == 0:
                seen.append(1)
            if len(seen) == 2 * 2 + 1 and header.index == 0:
                data = data.clone()
                data[0] ^= 0xFF
            return header, data

        with tampering(e.pusher, corrupt_rank_1_group_2), pytest.raises(
                LayerPushIncomplete, match=r"(?s)update v3 stopped at layer group 2 .*worker rank 1: \[checksum\] "
                                           r".*refused by worker rank 1") as stopped:
            e.push(3)
        assert stopped.value.landed == 2 and stopped.value.rejections[1].code == "checksum"
        assert "refused by worker rank 1" in stopped.value.rejections[2].reason, stopped.value.rejections[2]
        assert str(e.coordinator.label) == "2>3:2"
        e.push(4)
        ref = Reference(e.model_dir, "float32").load(e.versions[4])
        finished = _decode_across(e, pushes=[], at=[], requests=2, tokens=12)
        for prompt, t in finished:
            assert t.labels == ["4"] * 12
            torch.testing.assert_close(torch.tensor(t.logprobs, dtype=torch.float64), ref.logprobs(prompt, t.token_ids),
                                       atol=1e-5, rtol=0)
    finally:
        e.close()
        vllm.envs.disable_envs_cache()


def test_layer_mode_is_refused_where_it_cannot_be_exact(tiny_llama, port) -> None:
    with pytest.raises(ValueError, match="commit='reload' with commit_unit='layer': layer-granular commits need"):
        InflightConfig(group=GroupConfig(port=port), commit_unit="layer", commit="reload")
    with pytest.raises(ValueError, match="staged_groups=3 must be 1 or 2"):
        InflightConfig(group=GroupConfig(port=port), commit_unit="layer", staged_groups=3)


def test_the_training_loop_with_layer_commits(tmp_path) -> None:
    """``engine.commit_unit = "layer"``: the run trains on tokens some of which hybrids sampled,
    reports their fraction, ends on its last version whole, and its queue ledger balances."""
    from inflight.trainer.train import train
    from tests.helpers import check_ledger, metrics_rows, pending_ids, run_config

    out = tmp_path / "run"
    summary = train(run_config(out, steps=6, engine={"commit_unit": "layer"}))
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert rows[-1]["pushed_version"] == rows[-1]["version"] and rows[-1]["commit_groups"] == 4
    assert summary["hybrid_token_frac"] > 0, summary
    check_ledger(summary, rows, pending_ids(out))


def _layer_copy_run(model_dir: str, results) -> None:
    """Process entry point: a layer-granular ``copy`` engine (plain CPU GEMM, so the copy is
    right on CPU; a process of its own so no other test's engine gets the patch): three
    updates while decoding; what it sampled, with labels, on ``results``."""
    import os
    import traceback

    from inflight.transport.store import reserve_port

    os.environ["INFLIGHT_CPU_PLAIN_GEMM"] = "1"
    try:
        # the port: held until the store takes it
        e = LayerEngine(Path(model_dir), reserve_port("127.0.0.1"), commit="copy")
        try:
            assert e.report.commit == "copy", e.report
            finished = _decode_across(e, pushes=[1, 2, 3], at=[5, 40, 75])
            results.put(("ok", {"finished": [(p, t.token_ids, t.logprobs, t.labels) for p, t in finished],
                                "label": str(e.coordinator.label), "peak": inflight_status(e.llm).staging_peak_bytes,
                                "stalls": [r.workers[0].ms for r in e.coordinator.history]}))
        finally:
            e.close()
    except BaseException:  # the parent fails the test with it
        results.put(("error", traceback.format_exc()))


def test_layer_copy_commits_are_exact_too(tiny_llama) -> None:
    """The GPU's commit, one group per step: run on CPU with linears that keep their weights."""
    from multiprocessing import get_context
    from types import SimpleNamespace

    ctx = get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_layer_copy_run, args=(str(tiny_llama), results))
    child.start()
    try:
        kind, run = results.get(timeout=900)
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    assert kind == "ok", run
    assert run["label"] == "3" and len(run["stalls"]) == 3 * 4
    e = SimpleNamespace(model_dir=tiny_llama, versions={0: load_file(str(tiny_llama / "model.safetensors"))})
    e.groups = layer_groups(e.versions[0])
    for v in (1, 2, 3):
        e.versions[v] = perturbed(e.versions[0], seed=100 + v, scale=0.05)
    e.weights_of = lambda label: LayerEngine.weights_of(e, label)
    finished = [(p, SimpleNamespace(token_ids=toks, logprobs=lps, labels=labels))
                for p, toks, lps, labels in run["finished"]]
    assert len({s for _, t in finished for s in t.labels if ">" in s}) >= 8
    assert max(_errors_by_label(e, finished).values()) < EXACT
    schema = TensorSchema({n: (tuple(t.shape), "float32") for n, t in e.versions[0].items()})
    assert 0 < run["peak"] <= 2 * max(update_bytes(schema, names=g) for g in e.groups)
