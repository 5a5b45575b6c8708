"""The fleet model of ``python -m inflight.bench.scale``: its invariants, hand-computed memory and lag,
the shipped scenarios, and its predictions of ``inflight.bench.inflight`` runs on SmolLM2 from
separate micro-benchmarks (``scale_replay``, ``scale_calibrate``); the bytes
per rank it takes from a model's shapes (``inflight.bench.scale_shapes``), by hand and against the
shard plans a real TP=2 engine's weight loaders give (one engine per tiny model, started once).

Nothing else starts an engine or reads a clock: the model is deterministic for a seed, and
the CPU check compares committed predictions (bench/scale_predictions.json, made from
bench/scale_calibration.json) with committed runs (bench/scale_slow_link_runs.json).
"""

from __future__ import annotations

import copy
import gc
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from inflight.bench.scale import scenario_rows
from inflight.bench.scale_calibrate import first_and_rest, push_slowdown
from inflight.bench.scale_fleet import GB, SCENARIOS, Link, Scenario, engine_rate, plan, scenario_paths
from inflight.bench.scale_layer import layer_rows
from inflight.bench.scale_links import link_rows, load_links, over
from inflight.bench.scale_model import Lengths, Run, StepTime, Update, _add_lags, simulate
from inflight.bench.scale_replay import (
    CALIBRATION,
    EXPECTED_MISSES,
    PREDICTIONS,
    RUNS,
    SETTINGS,
    Params,
    chunk_context,
    command,
    inflight_chunk,
    judge,
    judged_runs,
    native_chunk,
    params,
    predict,
    validation_table,
)
from inflight.bench.scale_shapes import (
    Arch,
    box,
    group_bytes,
    group_names,
    link_bytes,
    param_count,
    rank_bytes,
    staging_bytes,
    tensors,
)
from inflight.shard_plan import PlanBytes

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = scenario_paths(SCENARIOS)
STEP = StepTime(overhead_s=0.002, weights_max_s=0.006, weights_per_seq_s=0.006, kv_per_seq_s=0.0001)
LENGTHS = Lengths(dist="uniform", low=50, high=400)


def _scenario(**link: float) -> Scenario:
    s = Scenario.load(SCENARIOS / "dense_7b.toml")
    if link:
        s = replace(s, link=replace(s.link, **link))
    return s


def test_shipped_scenarios_load_and_every_built_mode_runs() -> None:
    assert len(CONFIGS) == 4
    for path in CONFIGS:
        rows = scenario_rows(Scenario.load(path))
        by = {r["variant"]: r for r in rows}
        assert by["none"]["vs_none"] == 1.0
        for r in rows:  # no mode beats the ceiling, and a variant that does not fit says why
            assert r.get("vs_none", 0.0) <= 1.0 + 1e-9
            assert r["fits"] or r["note"]


@pytest.mark.parametrize("mode", ["pause", "batch", "inflight"])
def test_no_updates_is_the_ceiling(mode: str) -> None:
    """A cadence longer than the run: every mode decodes exactly what ``none`` does, and that is
    slots / step(slots) tokens per second, the ceiling by hand."""
    none = simulate(32, STEP, Update(mode="none"), LENGTHS, steps=3000, seed=1, warmup_steps=400)
    assert none.tok_s == pytest.approx(32 / STEP(32), rel=1e-12)
    quiet = Update(mode=mode, every_s=1e9, stall_s=5.0, stage_s=1.0, stage_cost_s=0.5 if mode == "inflight" else 0.0)
    r = simulate(32, STEP, quiet, LENGTHS, steps=3000, seed=1, warmup_steps=400)
    assert (r.tokens, r.updates, r.lag_hist) == (none.tokens, 0, none.lag_hist)
    assert r.wall_s == pytest.approx(none.wall_s, rel=1e-12)


def test_zero_link_time_makes_pause_and_inflight_meet() -> None:
    """Nothing to overlap (staging takes no time and no decode time): in-flight is pause with
    the same stall, token for token and lag for lag."""
    pause = simulate(32, STEP, Update(mode="pause", every_s=0.5, stall_s=0.05), LENGTHS, steps=4000, warmup_steps=400)
    inflight = simulate(32, STEP, Update(mode="inflight", every_s=0.5, stall_s=0.05, stage_s=0.0), LENGTHS, steps=4000,
                        warmup_steps=400)
    assert pause.updates > 50
    assert (inflight.tokens, inflight.updates, inflight.lag_hist) == (pause.tokens, pause.updates, pause.lag_hist)
    assert inflight.wall_s == pytest.approx(pause.wall_s, rel=1e-12)


def test_zero_link_time_makes_them_meet_in_a_planned_fleet() -> None:
    """In a planned scenario the link is what in-flight hides. With requests short enough that
    ``max_num_seqs``, not memory, bounds concurrency (staging takes no slots) and staging
    costing decode nothing, a link of no time leaves both modes the same copy per update."""
    def rows(gbps: float) -> dict[str, dict]:
        s = _scenario(engine_gbps=gbps, load_fixed_s=0.0, commit_fixed_s=0.0)
        s = replace(s, updates=replace(s.updates, every_s=5.0, staging_hbm_passes=0.0))
        s = s.replace(lengths=Lengths(dist="uniform", low=100, high=300))
        by = {r["variant"]: r for r in scenario_rows(s)}
        assert by["inflight"]["slots"] == by["pause"]["slots"] == 256
        return by

    slow, instant = rows(5.0), rows(1e9)
    assert slow["inflight"]["tok_s"] > 1.5 * slow["pause"]["tok_s"]  # 3 s of transfer every 5 s, hidden
    assert instant["inflight"]["stall_s"] == instant["pause"]["stall_s"]  # the same copy, nothing else
    assert instant["inflight"]["tok_s"] == pytest.approx(instant["pause"]["tok_s"], rel=1e-3)


def test_staging_memory_reduces_concurrency_as_computed_by_hand() -> None:
    s = _scenario()
    s = s.replace(lengths=Lengths(dist="uniform", low=4000, high=12000))
    size = 7.62e9 * 2  # bf16 checkpoint
    free = 80 * GB * 0.9 - size - 4 * GB  # gpu_memory_utilization, weights (TP1), reserve
    held = 1024 + ((8001**2 - 1) / 12 + 8000**2) / (2 * 8000)  # prompt + E[L^2] / 2E[L] of 4000..12000
    by_hand = {
        "none": math.floor(free / 57344 / held),
        "inflight": math.floor((free - 2 * size) / 57344 / held),  # the update and its rollback copy
        "inflight_host": math.floor((free - 0.268 * GB) / 57344 / held),  # one bucket
    }
    assert by_hand["inflight"] < by_hand["none"] <= 256  # memory, not max_num_seqs, bounds it
    for variant, slots in by_hand.items():
        assert plan(s, variant).slots == slots, variant
    no_rollback = replace(s, updates=replace(s.updates, rollback=False))
    assert plan(no_rollback, "inflight").slots == math.floor((free - size) / 57344 / held)
    # and fewer slots is fewer tokens per second, by the step-time model
    rows = {r["variant"]: r for r in scenario_rows(s)}
    assert rows["inflight"]["tok_s"] < rows["inflight_host"]["tok_s"]


def test_what_does_not_fit_is_refused_with_the_figure() -> None:
    s = Scenario.load(SCENARIOS / "dense_70b.toml")
    p = plan(s, "inflight")  # every TP8 rank staging the full 141 GB checkpoint twice
    assert p.slots == 0 and "282 GB staging per GPU" in p.note
    assert plan(s, "inflight_host").slots == 0 and "pinned host memory" in plan(s, "inflight_host").note
    assert plan(s, "inflight_host_shard").slots > 0
    pp = replace(s, fleet=replace(s.fleet, pp=2))
    assert plan(pp, "inflight_host_shard").note == "refused: pipeline parallel"


def test_shard_modes_stage_and_send_what_the_shapes_give() -> None:
    """70B at TP8: each rank stages its boxes (17.6 GB, twice with rollback), which fits where
    the full checkpoint does not; the engine is sent the sum over its ranks. Qwen3-235B's shard
    (59 GB x 2) still does not fit an H200 beside its live weights; on the host it does."""
    s = Scenario.load(SCENARIOS / "dense_70b.toml")
    per_rank, sent = staging_bytes(s.arch, 8, 2), link_bytes(s.arch, 8, 2)
    assert per_rank == max(rank_bytes(s.arch, 8, r, 2).total for r in range(8))
    p = plan(s, "inflight_shard")
    assert p.slots > 0 and plan(s, "inflight").slots == 0
    assert p.staging_gb_gpu == pytest.approx(2 * per_rank / GB)
    assert p.update.stage_s == pytest.approx(sent / (s.link.engine_gbps * GB))
    assert plan(s, "inflight_host_shard").host_gb_node == pytest.approx(8 * 2 * per_rank / GB)
    big = Scenario.load(SCENARIOS / "moe_235b.toml")
    assert plan(big, "inflight_shard").note == "does not fit: 118 GB staging per GPU"
    assert plan(big, "inflight_host_shard").slots > 0
    no_rollback = replace(big, updates=replace(big.updates, rollback=False))
    assert plan(no_rollback, "inflight_shard").slots > 0  # 59 GB staged, once


def test_pause_is_held_to_the_fastest_published_update() -> None:
    """Every transfer runs at the fastest published rate an engine's NICs take in: the 1T fleet
    moves its 1.04 TB in Perplexity's 1.3 s, not checkpoint-engine's 16 s on the same fleet;
    a TP1 engine at one NIC's line rate."""
    s = Scenario.load(SCENARIOS / "moe_1t.toml")
    fastest = max(s.transfers, key=lambda t: t.gbps)
    assert fastest.system == "Perplexity RDMA" and s.link.engine_gbps == pytest.approx(fastest.gbps) == 800
    ckpt = s.via("checkpoint-engine")
    assert ckpt.link.engine_gbps == pytest.approx(470 / 6.22)  # its fastest: Qwen3-235B on 8 x H800
    load = 1040e9 / 16 * s.updates.commit_hbm_passes / (s.gpu.hbm_tbps * 1e12 * s.serving.mbu)
    assert plan(s, "pause").update.stall_s == pytest.approx(1.3 + load)
    assert plan(ckpt, "pause").update.stall_s > 10 * plan(s, "pause").update.stall_s
    small = _scenario()
    assert small.link.engine_gbps == 1 * small.link.nic_gbps  # 800 GB/s into one GPU is not to be had
    rows = {r["variant"]: r for r in scenario_rows(s)}
    assert rows["pause@checkpoint-engine"]["stall_s"] == round(plan(ckpt, "pause").update.stall_s, 3)
    assert rows["pause@checkpoint-engine"]["tok_s"] < rows["pause"]["tok_s"]


# --- bytes per rank from the model's shapes ---------------------------------------------------

TOY = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 12, "vocab_size": 100}


def test_bytes_per_rank_by_hand() -> None:
    """One layer, hidden 8, two heads of 4, one KV head, MLP 12, vocabulary 100 (padded to 128:
    64 rows per rank, the second reads 36), untied, bf16, TP=2."""
    a = Arch.from_config(TOY)
    # rank 0 splits: embed 64x8 + lm_head 64x8 + q 4x8 + o 8x4 + gate, up 6x8 + down 8x6
    # whole on both ranks: two layer norms and the final norm (8 each), k and v (one KV head: 4x8 each)
    assert rank_bytes(a, 2, 0, 2) == PlanBytes(sharded=2 * (2 * 512 + 32 + 32 + 3 * 48),
                                               replicated=2 * (3 * 8 + 2 * 32), fallback=0)
    assert rank_bytes(a, 2, 1, 2) == PlanBytes(sharded=2 * (2 * 288 + 32 + 32 + 3 * 48), replicated=2 * 88, fallback=0)
    assert param_count(a) == 2 * 800 + 3 * 8 + 64 + 2 * 32 + 64 + 3 * 96
    assert link_bytes(a, 2, 2) == 2 * (param_count(a) + 88)  # what both ranks read whole goes twice
    assert staging_bytes(a, 2, 2) == rank_bytes(a, 2, 0, 2).total
    assert rank_bytes(a, 1, 0, 2) == PlanBytes(sharded=0, replicated=2 * param_count(a), fallback=0)
    k = next(t for t in tensors(a) if t.name.endswith("k_proj.weight"))
    assert box(a, k, 2, 1) == ((0, 0), (4, 8))  # replicated, not split
    # two KV heads over four ranks: ranks 0, 1 read head 0, ranks 2, 3 head 1
    two = Arch.from_config(TOY | {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16})
    k = next(t for t in tensors(two) if t.name.endswith("k_proj.weight"))
    assert [box(two, k, 4, r)[0][0] for r in range(4)] == [0, 0, 4, 4]
    # a fallback is read whole on every rank, and counted as such
    falls = Arch.from_config(TOY | {"fallbacks": ["o_proj.weight"]})
    assert rank_bytes(falls, 2, 0, 2).fallback == 2 * 64
    with pytest.raises(ValueError, match="do not split over tp=3"):
        rank_bytes(a, 3, 0, 2)


def test_each_scenario_arch_is_its_model() -> None:
    """The [arch] shapes add up to the parameters each model card gives (within 1.5%: Kimi-K2's
    1.04 T is 1.3% above its config's shapes), and staging per rank is about S / TP."""
    for path in CONFIGS:
        s = Scenario.load(path)
        n = param_count(s.arch)
        assert n == pytest.approx(s.model.params_b * 1e9, rel=0.015), s.name
        even = n * s.model.bytes_per_param / s.fleet.tp
        assert even <= staging_bytes(s.arch, s.fleet.tp, s.model.bytes_per_param) < 1.02 * even, s.name


def test_lag_of_a_request_by_hand() -> None:
    """Tokens at steps 0..9, versions going live before steps 3 and 7 (and 12, after it)."""
    hist: dict[int, int] = {}
    _add_lags(hist, 0, 9, [3, 7, 12])
    assert hist == {2: 3, 1: 4, 0: 3}


def test_batch_boundary_drains_then_updates() -> None:
    """Two slots, requests of 4 and 10 steps (fixed length): the update waits for both."""
    lengths = Lengths(dist="uniform", low=10, high=10)
    r = simulate(2, StepTime(weights_max_s=0.01, weights_per_seq_s=0.01),
                 Update(mode="batch", every_steps=3, stall_s=1.0), lengths, steps=30)
    # steps 0-9 decode both requests (drain starts at 3, ends at 10), update, steps 10-19, again
    assert r.updates == 2 and r.tokens == 2 * 30 and r.lag_hist == {0: 60}
    assert r.wall_s == pytest.approx(30 * 0.01 + 2 * 1.0)


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="'zipf'"):
        Lengths(dist="zipf")
    with pytest.raises(ValueError, match="engine_gbps=0"):
        Link(engine_gbps=0, nic_gbps=50, egress_gbps=0, load_fixed_s=0, commit_fixed_s=0)
    with pytest.raises(ValueError, match="'bf16'"):
        Arch.from_config(TOY | {"model_type": "bf16"})
    with pytest.raises(ValueError, match="head_dim=0"):
        replace(Arch.from_config(TOY), head_dim=0)
    with pytest.raises(ValueError, match="split='diagonal'"):
        replace(next(tensors(Arch.from_config(TOY))), split="diagonal")
    with pytest.raises(ValueError, match="system='nccl'"):
        engine_rate(_scenario().transfers, "nccl", 8, 50)
    with pytest.raises(ValueError, match="every_steps=8, every_s=1.0"):
        Update(mode="pause", every_steps=8, every_s=1.0)
    with pytest.raises(ValueError, match="stall_s=0.5 is not its groups' sum"):
        Update(mode="layer", every_s=1.0, stall_s=0.5, group_stall_s=(0.1, 0.1), group_stage_s=(0.0, 0.0))
    with pytest.raises(ValueError, match="2 group stalls, 1 link times"):
        Update(mode="layer", every_s=1.0, stall_s=0.2, group_stall_s=(0.1, 0.1), group_stage_s=(0.0,))


# --- the layer-granular commit ----------------------------------------------------------------

def _groups_by_hand(a: Arch, tp: int, rank: int, dtype_bytes: int) -> dict[str, int]:
    """Each layer group's bytes on one rank, tensor by tensor: the embeddings, each
    ``model.layers.<i>.``, and everything else (final norm, LM head)."""
    out: dict[str, int] = {}
    for t in tensors(a):
        parts = t.name.split(".")
        key = "embed" if parts[1] == "embed_tokens" else f"layer {parts[2]}" if parts[1] == "layers" else "rest"
        out[key] = out.get(key, 0) + dtype_bytes * math.prod(box(a, t, tp, rank)[1])
    return out


def test_layer_staging_is_staged_groups_times_the_largest_group() -> None:
    """70B at TP8: the largest group on a rank is the LM head's 16,032 vocabulary rows (128,256
    over 8) with the final norm, 262.7 MB; a rank stages two such slots (one with staged_groups=1),
    not its 17.6 GB shard; on the host the same slots as pinned memory, plus a landing bucket on
    the device. Qwen3-235B's largest is a decoder layer: 128 experts' eighths and one KV head."""
    s = Scenario.load(SCENARIOS / "dense_70b.toml")
    by_rank = [_groups_by_hand(s.arch, 8, r, 2) for r in range(8)]
    slot = max(max(g.values()) for g in by_rank)
    assert slot == by_rank[0]["rest"] == 2 * (128256 // 8 * 8192 + 8192)
    for r, g in enumerate(by_rank):  # the same groups, in commit order, adding up to the rank's boxes
        assert group_bytes(s.arch, 8, r, 2) == (g["embed"], *(g[f"layer {i}"] for i in range(80)), g["rest"])
        assert sum(g.values()) == rank_bytes(s.arch, 8, r, 2).total
    assert plan(s, "inflight_layer").staging_gb_gpu == pytest.approx(2 * slot / GB)
    one = replace(s, updates=replace(s.updates, staged_groups=1))
    assert plan(one, "inflight_layer").staging_gb_gpu == pytest.approx(slot / GB)
    host = plan(s, "inflight_host_layer")
    assert host.host_gb_node == pytest.approx(8 * 2 * slot / GB)
    assert host.staging_gb_gpu == pytest.approx((2 * slot + s.updates.bucket_gb * GB) / GB)
    big = Scenario.load(SCENARIOS / "moe_235b.toml")
    layer = 2 * (2 * 4096 + 2 * 128 + 8192 * 4096 // 8 + 2 * 128 * 4096 + 4096 * 8192 // 8 + 128 * 4096
                 + 128 * 3 * 1536 * 4096 // 8)  # norms, q/k/v/o, q/k norms, router, experts
    assert max(group_bytes(big.arch, 8, 0, 2)) == layer and group_names(big.arch)[1] == "layer 0"
    assert plan(big, "inflight_layer").staging_gb_gpu == pytest.approx(2 * layer / GB)


def test_layer_mode_loses_less_kv_than_the_shard_mode() -> None:
    """In every shipped scenario the layer mode stages under a tenth of what the device shard
    mode does, and so keeps more KV cache; 70B, where both fit, by hand from the rows."""
    for path in CONFIGS:
        s = Scenario.load(path)
        layer, shard = plan(s, "inflight_layer"), plan(s, "inflight_shard")
        assert layer.staging_gb_gpu < shard.staging_gb_gpu / 10, s.name
        assert layer.kv_tokens > shard.kv_tokens, s.name
    s = Scenario.load(SCENARIOS / "dense_70b.toml")
    rows = {r["variant"]: r for r in scenario_rows(s)}
    assert rows["inflight_layer"]["kv_lost"] < rows["inflight_shard"]["kv_lost"]
    assert rows["inflight_layer"]["slots"] > rows["inflight_shard"]["slots"]


def test_layer_stall_is_the_sum_of_its_group_commits() -> None:
    """Each group's commit: the fixed RPC cost plus one device copy (2 HBM passes at mbu x peak)
    of the group's bytes on the slowest rank; an update's stall is their sum, and a simulated
    engine is charged exactly that per commit, a partly committed last update included."""
    s = Scenario.load(SCENARIOS / "dense_70b.toml")
    hbm = s.gpu.hbm_tbps * 1e12 * s.serving.mbu
    by_rank = [_groups_by_hand(s.arch, 8, r, 2) for r in range(8)]
    keys = ["embed"] + [f"layer {i}" for i in range(80)] + ["rest"]
    each = [s.link.commit_fixed_s + max(g[k] for g in by_rank) * s.updates.commit_hbm_passes / hbm for k in keys]
    p = plan(s, "inflight_layer")
    assert p.update.group_stall_s == pytest.approx(each, rel=1e-12)
    assert p.update.stall_s == pytest.approx(sum(each), rel=1e-12)
    assert p.update.stall_s < plan(s, "inflight_host_shard").update.stall_s
    r = simulate(p.slots, p.step, p.update, s.lengths, steps=20000, warmup_steps=2000)
    full, part = divmod(r.commits, len(each))
    assert full == r.updates >= 5
    assert r.stall_s == pytest.approx(full * sum(each) + sum(each[:part]), rel=1e-9)
    rows = layer_rows(s, scenario_rows(s))
    assert rows[0]["commit_ms_max"] == round(1e3 * max(each), 2) and rows[0]["groups"] == 82


@pytest.mark.parametrize(("staged", "stage_s", "span_s"), [(1, 0.015, 0.066), (2, 0.015, 0.056), (2, 0.001, 0.036)])
def test_layer_groups_commit_one_per_boundary_paced_by_the_slots(staged: int, stage_s: float, span_s: float) -> None:
    """Steps of 10 ms, an update due before step 50 (t = 0.5 s) of three groups, stalls 1, 2 and
    3 ms. Groups 15 ms on the link, one slot: each lands 15 ms after the last committed and
    commits at the next boundary: steps 52 (t 0.52), 54 (0.541), 56 (0.563), done at 0.566.
    Two slots: the second lands while the first waits (commits at 52, 53, 55: done at 0.556).
    Groups of 1 ms: all could commit at once, but one commits per boundary (51, 52, 53)."""
    u = Update(mode="layer", every_steps=50, stall_s=0.006, stage_s=3 * stage_s, group_stall_s=(0.001, 0.002, 0.003),
               group_stage_s=(stage_s,) * 3, staged_groups=staged)
    r = simulate(1, StepTime(overhead_s=0.01), u, Lengths(dist="uniform", low=1000, high=1000), steps=100)
    assert (r.commits, r.updates) == (3, 1)
    assert r.stall_s == pytest.approx(0.006) and r.wall_s == pytest.approx(100 * 0.01 + 0.006)
    assert r.span_s == pytest.approx(span_s)


# --- the model against this CPU: predicted from micro-benchmarks, judged on the recorded runs ----

@pytest.fixture(scope="module")
def judged() -> tuple[dict, list[dict]]:
    """The committed predictions and the recorded ``inflight.bench.inflight`` runs."""
    return json.loads(PREDICTIONS.read_text()), json.loads(RUNS.read_text())["runs"]


def every_run(preds: dict) -> dict:
    """``preds`` as if written before every recorded run: the power of the bands is a property of
    the measurements, judged here on every run there is, before or after the predictions."""
    return {**preds, "written": None}


def inflight_checks(preds: dict, runs: list[dict]) -> dict[str, dict]:
    return {c["rate"]: c for c in judge(preds, runs) if c["mode"] == "inflight"}


def with_inflight(preds: dict, make) -> dict:
    """``preds`` with every rate's in-flight prediction replaced by ``make(rate, prediction)``."""
    out = copy.deepcopy(preds)
    for rate, p in out["predictions"].items():
        p["modes"]["inflight"] = make(rate, p)
    return out


def test_a_zero_or_native_model_fails_every_rates_inflight_check(judged) -> None:
    """A model that says in-flight costs nothing (no staging time, every cue sent, no decode
    lost) and one that gives in-flight native's cost at native's cadence both fail the in-flight
    check at every recorded rate; under the band these checks replaced (15% of the measured loss
    plus 2% of an update period's decode, on the loss alone) the zero model passed at 1 Gbit/s
    and 100 Mbit/s."""
    preds, runs = every_run(judged[0]), judged[1]
    zero = with_inflight(preds, lambda rate, p: {**p["modes"]["inflight"], "lost_ms_per_update": 0.0, "stage_ms": 0.0,
                                                 "skipped_per_round": 0, "steps_per_update": SETTINGS[rate]["every"]})
    native = with_inflight(preds, lambda rate, p: {**p["modes"]["inflight"], "stage_ms": 0.0, "skipped_per_round": 0,
                                                   "steps_per_update": SETTINGS[rate]["every"],
                                                   "lost_ms_per_update": p["modes"]["native"]["lost_ms_per_update"]})
    rates = {r.get("link") or "loopback" for r in runs}
    for model in (zero, native):
        checks = inflight_checks(model, runs)
        assert set(checks) == rates and not any(c["ok"] for c in checks.values()), checks

    def old_band(row: dict, none: dict) -> float:
        return (0.15 * abs(row["lost_ms_per_update"])
                + 0.02 * row["steps"] / row["updates"] * 1e3 * none["wall_s"] / none["steps"])

    old_pass = set()
    for run in runs:
        rows = {r["mode"]: r for r in run["rows"]}
        if abs(rows["inflight"]["lost_ms_per_update"]) <= old_band(rows["inflight"], rows["none"]):
            old_pass.add(run.get("link") or "loopback")
    assert {"1gbit", "100mbit"} <= old_pass


def test_no_constant_model_passes_every_rate(judged) -> None:
    """A constant model, the same figures at every rate, cannot pass the in-flight checks of
    every recorded rate, whatever the constants: the rates' staging bands (median +- band) do
    not overlap, and a check passes only if every quantity does. By search too: no constant
    staging time from 0 to 100 s, 1 ms apart, is within every rate's band."""
    preds, runs = every_run(judged[0]), judged[1]
    checks = inflight_checks(preds, runs)
    assert len(checks) >= 3
    stage = [c["quantities"]["stage_ms"] for c in checks.values()]
    assert max(q["median"] - q["band"] for q in stage) > min(q["median"] + q["band"] for q in stage), stage
    for c_ms in range(0, 100_000):
        assert not all(abs(c_ms - q["median"]) <= q["band"] for q in stage), c_ms


def test_each_quantity_is_banded_by_the_spread_of_its_runs() -> None:
    """By hand: three runs at a rate give each quantity the median and the farthest run from
    it; runs that agree closer than the floor get the floor (a step per update, a cue per
    round, a decode step of staging, 1% of an update period's decode lost)."""
    def run(lost: float, spu: float, skipped: int, stage: float, started: str = "2026-12-01T00:00:00Z") -> dict:
        return {"started": started, "rounds": 4, "rows": [
            {"mode": "none", "updates": 0, "wall_s": 15.0, "steps": 100},
            {"mode": "inflight", "updates": 8, "lost_ms_per_update": lost, "steps_per_update": spu,
             "skipped": skipped, "stage_ms": stage}]}
    want = {"lost_ms_per_update": 120.0, "steps_per_update": 40.0, "skipped_per_round": 2, "stage_ms": 4000.0,
            "updates": 8, "steps": 320}
    preds = {"written": "2026-11-30T00:00:00Z", "predictions": {"loopback": {"modes": {"inflight": want}}}}
    runs = [run(100.0, 40.0, 8, 4000.0), run(130.0, 40.2, 8, 4010.0), run(200.0, 39.9, 12, 4005.0),
            run(9e9, 1.0, 0, 1.0, started="2026-11-29T00:00:00Z")]  # before the predictions: kept, not judged
    (check,) = judge(preds, runs)
    q = check["quantities"]
    assert check["runs"] == 3
    assert (q["lost_ms_per_update"]["median"], q["lost_ms_per_update"]["band"]) == (130.0, 70.0)  # floor: 60
    assert (q["steps_per_update"]["median"], q["steps_per_update"]["band"]) == (40.0, 1.0)  # the floor
    assert (q["skipped_per_round"]["median"], q["skipped_per_round"]["band"]) == (2.0, 1.0)
    assert (q["stage_ms"]["median"], q["stage_ms"]["band"]) == (4005.0, 150.0)  # floor: one 150 ms step
    assert check["ok"]
    want["lost_ms_per_update"] = 60.0  # 130 +- 70: 60 is the edge
    assert judge(preds, runs)[0]["ok"]
    want["lost_ms_per_update"] = 59.0
    assert not judge(preds, runs)[0]["ok"]
    want["lost_ms_per_update"], want["stage_ms"] = 120.0, 4200.0
    assert not judge(preds, runs)[0]["quantities"]["stage_ms"]["ok"]


def test_misses_are_declared_with_the_predictions_before_the_runs(judged) -> None:
    """The expected misses are in the predictions' JSON (written with them, from
    ``EXPECTED_MISSES``); every judged run started after the predictions were written; and
    docs/performance.md shows the judge's outcome as it is (its table is ``validation_table``'s)."""
    preds, runs = judged
    assert preds["expected_misses"] == EXPECTED_MISSES and preds["written"] and preds["git"]
    for rate_runs in judged_runs(preds, runs).values():
        assert all(r["started"] > preds["written"] and r["git"] for r in rate_runs)
    assert validation_table(preds, runs) in (ROOT / "docs" / "performance.md").read_text()


def test_a_disturbed_run_is_kept_and_never_judged(judged) -> None:
    """A run with other work beside it stays in the record and out of every band, and the table
    names it; unmarked, the same run is judged."""
    preds, runs = judged
    run = next(r for r in runs if r.get("started", "") > preds["written"] and not r.get("disturbed"))
    rate = run.get("link") or "loopback"
    marked = [{**r, "disturbed": "a planted load"} if r is run else r for r in runs]
    assert run not in judged_runs(preds, marked).get(rate, [])
    assert run in judged_runs(preds, runs)[rate]
    assert f"{rate} {run['started']}: a planted load" in validation_table(preds, marked)


def test_the_predictions_are_the_calibrations(judged) -> None:
    """The committed predictions are what ``scale predict`` makes of the committed calibration,
    and the calibration says which command and date produced each part: commands the CLI takes."""
    from inflight.bench.scale_calibrate import parser

    cal = json.loads(CALIBRATION.read_text())
    assert predict(cal)["predictions"] == judged[0]["predictions"]
    assert judged[0]["command"] == "python -m inflight.bench.scale predict"
    for part in ("link", "engine", "push"):
        runs = [r for r in cal["runs"] if part in r["parts"] and part not in r.get("superseded", [])]
        assert runs and all(r["command"].startswith("python -m inflight.bench.scale calibrate") and r["date"]
                            for r in runs)
        for r in runs:
            parser().parse_args(r["command"].split()[4:])  # exits on an argument the CLI does not take
    for run in judged[1]:
        assert run["command"] == command(run.get("link") or "loopback")


def test_replayed_context_by_hand() -> None:
    """Two slots, lengths from random.Random(0): before each step, the prompts (8 tokens each)
    plus the tokens each running request has so far; a slot refills the step after it frees."""
    import random

    rng = random.Random(0)
    a, b = rng.randint(16, 512), rng.randint(16, 512)
    ctx, new = chunk_context(min(a, b) + 2, concurrency=2)
    assert new[0] == 2 and ctx[0] == 16 and ctx[5] == 16 + 10
    first = min(a, b)  # the shorter frees its slot after its last token; the next request starts
    assert new[first] == 1 and ctx[first] == 8 + first + 8


def test_push_slowdown_by_hand() -> None:
    """Steps from a push's cue until its commit 25% over the step model, the others on it: the
    slowdown is 0.25; the commit's own interval (its stall) counts for neither side."""
    step = {"a_s": 0.1, "c_s_per_token": 1e-5, "p_s_per_request": 0.01}
    ctx, new = chunk_context(60)
    cues, commits = [5, 25, 45], [12, 31, 52]
    staging = {j for c, e in zip(cues, commits) for j in range(c, e)}
    gaps = [(step["a_s"] + step["c_s_per_token"] * ctx[j - 1] + step["p_s_per_request"] * new[j - 1])
            * (1.25 if j in staging else 50.0 if j in commits else 1.0) for j in range(1, 61)]
    got = push_slowdown([{"gaps": gaps, "cues": cues, "event_at": commits}], step)
    assert got["slowdown"] == pytest.approx(0.25) and got["steps_on"] == len(staging)
    assert got["steps_off"] == (25 - 13) + (45 - 32) + (60 - 52)


def test_each_chunks_first_update_is_its_own() -> None:
    """A chunk's first update takes its own figure (``first_and_rest``, then the replay): a native
    chunk stalls first_native_s once and native_s for the rest; an in-flight chunk's first push
    stages for first_stage_s, which holds the cue of the step after it (skipped) when longer."""
    assert first_and_rest([[3.0, 1.0, 2.0], [5.0, 3.0]]) == (4.0, 2.0)
    p = Params(a_s=0.1, c_s=0.0, p_s=0.0, first_stage_s=1.75, stage_s=0.45, pre_s=0.0, commit_s=0.0, slowdown=0.0,
               first_native_s=3.0, native_s=1.0)
    wall, steps, updates = native_chunk(p, every=10, steps=41)
    assert (steps, updates) == (41, 4) and wall == pytest.approx(41 * 0.1 + 3.0 + 3 * 1.0)
    # cue at step 10: staged at 1.0 + 1.75 s (step 28's start), seen after 28; the cue at 20 is
    # skipped, the one at 30 staged at 3.0 + 0.45 (step 35), seen after it: 2 updates in 40 steps
    wall, steps, updates, skipped = inflight_chunk(p, every=10, steps=40)
    assert (steps, updates, skipped) == (40, 2, 1) and wall == pytest.approx(4.0)


def test_replay_parameters_by_hand() -> None:
    """A link of 100 MB/s for 1 GB: staging is the wire (10 s) plus a bucket's share of loopback's
    2 s, slowed by the push part's figure at that rate; native's loopback send (1.05 s, 0.05 of
    it packing) becomes the pack and the wire. Over loopback: the engine part's figures."""
    cal = {"link": {"achieved_Bps": {"1gbit": 1e8}},
           "engine": {"nbytes": 10**9, "step": {"a_s": 0.1, "c_s_per_token": 0.0, "p_s_per_request": 0.0},
                      "inflight": {"stage_s": 2.0, "first_stage_s": 3.0, "buckets": 4, "slowdown": 0.2,
                                   "push_over_stage_s": 0.2, "stall_s": 0.001},
                      "native": {"stall_s": 2.5, "send_s": 1.05, "first_stall_s": 3.5, "first_send_s": 2.05,
                                 "pack_s": 0.05}},
           "push": {"by_rate": {"1gbit": {"slowdown": 0.03}}}}
    p = params(cal, "1gbit")
    assert p.stage_s == pytest.approx(10.5) and p.first_stage_s == pytest.approx(10.5) and p.slowdown == 0.03
    assert (p.native_s == pytest.approx(2.5 - 1.05 + 0.05 + 10.0)
            and p.first_native_s == pytest.approx(3.5 - 2.05 + 0.05 + 10.0))
    assert p.pre_s == pytest.approx(0.15) and p.commit_s == 0.001
    loop = params(cal, "loopback")
    assert loop.stage_s == pytest.approx(2.5) and loop.first_stage_s == pytest.approx(3.5)
    assert loop.slowdown == 0.2 and loop.native_s == pytest.approx(2.5) and loop.first_native_s == pytest.approx(3.5)


# --- slower links between the pools --------------------------------------------------------

def test_links_load_and_scale_the_transfer() -> None:
    """Each link of links.toml gives an engine its share of the port (a TP1 engine an eighth of a
    node's 100 Gbit/s at 0.9: 1.41 GB/s) or a connection of its own; a sparse delta scales what
    crosses the link and nothing else."""
    links, ratio = load_links(SCENARIOS)
    assert [x.name for x in links] == ["100 Gbit/s TCP", "25 Gbit/s TCP", "1 Gbit/s decentralized"] and 0 < ratio <= 1
    s = _scenario()
    assert links[0].engine_gbps(s) == pytest.approx(100 / 8 * 0.9 / 8)
    assert links[2].engine_gbps(s) == pytest.approx(1 / 8 * 0.9)
    dense, sparse = over(s, links[1]), over(s, links[1], 0.25)
    assert plan(sparse, "inflight").update.stage_s == pytest.approx(0.25 * plan(dense, "inflight").update.stage_s)
    assert plan(sparse, "inflight").staging_gb_gpu == plan(dense, "inflight").staging_gb_gpu
    assert dense.updates.every_s == pytest.approx(plan(dense, "inflight").update.stage_s)  # link-bound cadence
    with pytest.raises(ValueError, match="wire_ratio=1.5"):
        replace(s.updates, wire_ratio=1.5)


def test_over_a_slow_link_pause_loses_its_stall() -> None:
    """7B over 1 Gbit/s: a pause as long as the decode between updates halves tokens/s; in-flight
    keeps within 1% of none and wins; a sparse delta doubles in-flight's updates per hour."""
    links, _ = load_links(SCENARIOS)
    rows = {r["wire"]: r for r in link_rows(_scenario(), links[2:], 0.5)}
    d, sp = rows["dense"], rows["sparse"]
    assert d["inflight"] > 0.99 and d["winner"] == "inflight" and d["margin"] > 1.5
    assert 0.45 < d["pause"] < 0.6
    assert sp["inflight_per_hour"] == pytest.approx(2 * d["inflight_per_hour"], rel=0.01)


def test_run_accumulates_chunks() -> None:
    a, b = Run(tokens=10, wall_s=1.0, lag_hist={0: 10}), Run(tokens=5, wall_s=1.0, updates=1, lag_hist={0: 3, 1: 2})
    a.add(b)
    assert (a.tokens, a.tok_s, a.updates, a.lag_hist, a.lag_quantile(0.9)) == (15, 7.5, 1, {0: 13, 1: 2}, 1)


# --- the shape rule against a real TP=2 engine's loaders --------------------------------------

def _rank_plan(worker) -> tuple[list, list]:
    """Inside an engine worker: the shard plan its commit strategy records from vLLM's loaders,
    as the in-flight worker builds it at start."""
    from inflight.engine.commit.base import make_strategy
    from inflight.engine.commit.engine_checkpoint import checkpoint_dir, checkpoint_schema

    mc = worker.vllm_config.model_config
    schema = checkpoint_schema(checkpoint_dir(mc.model, mc.revision), mc.dtype)
    plan = make_strategy(worker.model_runner, "auto", schema, quantized=False, eager=True).shard_plan()
    return [(s.name, list(s.start), list(s.length)) for s in plan.shards], list(plan.fallbacks)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_moe"])
def tp2_plans(request):
    """(model dir, each rank's plan) of a TP=2 engine on the tiny Llama or the tiny Qwen3-MoE
    (one KV head for two ranks, a vocabulary of 300 padded to 320)."""
    import vllm.envs
    from vllm import LLM

    from inflight.engine.engine_config import engine_kwargs

    model_dir = request.getfixturevalue(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank: vLLM CPU refuses TP=2 without it
        vllm.envs.disable_envs_cache()  # an earlier in-process engine cached the environment
        llm = LLM(str(model_dir), tensor_parallel_size=2, distributed_executor_backend="mp", enforce_eager=True,
                  dtype="float32", max_model_len=256, seed=0, **engine_kwargs())
        try:
            yield model_dir, llm.collective_rpc(_rank_plan)
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
    vllm.envs.disable_envs_cache()


def _boxes(a: Arch, rank: int, as_col: tuple[str, ...] = ()) -> dict:
    """Every tensor's box at TP=2 by the shape rule; ``as_col``: splits read as column parallel
    instead (a wrong rule, to see the comparison fail)."""
    return {t.name: box(a, replace(t, split="col") if t.split in as_col else t, 2, rank) for t in tensors(a)}


def test_the_shape_rule_reads_what_vllm_loaders_read_at_tp2(tp2_plans) -> None:
    from safetensors import safe_open

    from inflight.shard_plan import make_plan, plan_bytes

    model_dir, plans = tp2_plans
    a = Arch.from_config(json.loads((model_dir / "config.json").read_text()))
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        schema = {n: (tuple(f.get_slice(n).get_shape()), "float32") for n in f.keys()}
    assert {t.name: (t.shape, "float32") for t in tensors(a)} == schema  # the rule names the checkpoint's tensors
    for rank, (shards, fallbacks) in enumerate(plans):
        real = {name: (tuple(start), tuple(length)) for name, start, length in shards}
        assert fallbacks == [] and real == _boxes(a, rank), rank
        counted = plan_bytes(make_plan(real, fallbacks), schema)
        assert rank_bytes(a, 2, rank, 4) == counted
        assert _boxes(a, rank, as_col=("kv",)) != real  # k/v split although one KV head serves both ranks: wrong
        assert _boxes(a, rank, as_col=("vocab",)) != real  # the vocabulary split without its 64-row padding: wrong
    assert sum(plan_bytes(make_plan({n: (tuple(b), tuple(c)) for n, b, c in shards}, []), schema).total
               for shards, _ in plans) == link_bytes(a, 2, 4)


def test_a_rate_keeps_every_recorded_run(tmp_path) -> None:
    """``record`` appends: a second run at a rate stays beside the first (each is judged), and
    a log recorded twice is refused; a run with other settings than the rate's is refused."""
    from inflight.bench.scale_replay import SETTINGS, record

    s = SETTINGS["loopback"]

    def log(name: str, every: int = s["every"]) -> Path:
        path = tmp_path / name
        run = {"bench": "inflight", "steps": s["steps"], "rounds": s["rounds"],
               "rows": [{"every": every, "mode": "none"}]}
        path.write_text("a line of the run's own output\n" + json.dumps(run) + "\n")
        return path

    out = tmp_path / "runs.json"
    record([log("first.log")], out)
    data = record([log("second.log")], out)
    assert [r["log"] for r in data["runs"]] == ["first.log", "second.log"]
    assert json.loads(out.read_text()) == data
    with pytest.raises(SystemExit, match="already recorded"):
        record([log("first.log")], out)
    with pytest.raises(SystemExit, match="not the committed settings"):
        record([log("third.log", every=s["every"] + 1)], out)
    assert [r["log"] for r in json.loads(out.read_text())["runs"]] == ["first.log", "second.log"]
