"""Routing replay (R3) for mixture-of-experts policies, engine to loss.

Engine (real vLLM CPU engines on a tiny Qwen3-MoE, ``record_routing=True``):
- every sampled token carries the top-k experts of every MoE layer, int16 ``[tokens, layers,
  k]``, equal to a transformers forward's top-k on the same weights for tokens of one version,
  before and after an in-flight update;
- streamed outputs carry the routing of exactly the tokens they show, across a commit, and
  the finished output the whole of it; preempted (recomputed) requests keep it exact.
Trainer:
- a bf16 engine's samples scored by the fp32 trainer: replay brings the trainer's log-probs
  closer to the engine's behaviour log-probs than its own routing does (both printed);
- replaying the router's own choice changes nothing; the loss and every gradient with
  replay equal a pure-torch reference MoE that takes the experts as given;
- the trainer entry point trains with ``loss.routing_replay = true``.
"""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch

from inflight.engine.client import tagged
from inflight.engine.routing import routing_fields, routing_of, streamed_routing
from inflight.protocol import RolloutGroup, RolloutSample, Sampling
from inflight.trainer.loss import collate, compute_loss, policy_logprobs
from inflight.trainer.routing_replay import NO_ROUTE, RoutingReplay, collate_routing, gate_weights
from tests.engine_harness import push_at_steps
from tests.helpers import MOE, moe_trainer_model, wait_until

PROMPTS = ["1+2=", "count 3 4", "the quick brown", "17+5=", "lazy dog"]


class RecordingEngine:
    """An in-process ``LLM`` with the in-flight worker recording routing, and its pusher."""

    def __init__(self, model_dir, dtype: str, port: int) -> None:
        from vllm import LLM

        from inflight.engine.client import start_inflight
        from inflight.engine.engine_config import InflightConfig, engine_kwargs
        from inflight.transport.group_config import GroupConfig
        from inflight.transport.pusher import PushConfig, WeightPusher

        self.llm = LLM(str(model_dir), enforce_eager=True, dtype=dtype, max_model_len=1024, seed=0, **engine_kwargs())
        group = GroupConfig(port=port, world_size=2, timeout_s=60.0)
        self.report = start_inflight(self.llm, InflightConfig(group=group, record_routing=True))
        self.pusher = WeightPusher(group, PushConfig(dtype=dtype, bucket_mb=0.25))
        self.version = 0

    def push(self, model) -> None:
        from inflight.transport.sources import named_weights

        self.version += 1
        self.pusher.push(self.version, named_weights(model))

    def generate(self, prompts, sp):
        return self.llm.generate(prompts, sp, use_tqdm=False)

    def close(self) -> None:
        self.pusher.close()
        self.llm.collective_rpc("inflight_stop")
        del self.llm


@pytest.fixture(scope="module")
def fp32_engine(tiny_moe, hold_port):
    e = RecordingEngine(tiny_moe, "float32", hold_port())
    yield e
    e.close()


@torch.no_grad()
def _hf_routing(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per position and MoE layer: the router's top-k ids, and its k-th minus (k+1)-th probability."""
    picks, margins = [], []

    def hook(router, args, out):
        probs = torch.softmax(out[0].float(), -1).sort(-1, descending=True).values
        picks.append(out[2])
        margins.append(probs[:, router.top_k - 1] - probs[:, router.top_k])

    hooks = [m.register_forward_hook(hook) for m in RoutingReplay(model).routers]
    try:
        model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picks, 1).numpy(), torch.stack(margins, 1).numpy()


def _check_routing_against(outs, model) -> int:
    """Recorded routing equals the model's top-k wherever that is not a near-tie; returns the rows checked."""
    checked = 0
    for o in outs:
        c = o.outputs[0]
        rows = routing_of(c)
        assert rows.dtype == np.int16 and rows.shape == (len(c.token_ids), 2, 2)
        p = len(o.prompt_token_ids)
        picks, margin = _hf_routing(model, list(o.prompt_token_ids) + list(c.token_ids))
        want, margin = picks[p - 1: p - 1 + len(c.token_ids)], margin[p - 1: p - 1 + len(c.token_ids)]
        clear = margin > 1e-5  # fp32 near-ties may break either way in two implementations
        assert clear.mean() > 0.95
        assert (np.sort(rows, -1) == np.sort(want, -1)).all(-1)[clear].all()
        checked += int(clear.sum())
    return checked


def test_recorded_routing_is_the_routers_topk(fp32_engine, tiny_moe) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True)
    assert fp32_engine.report.routing == (2, 2)
    assert _check_routing_against(fp32_engine.generate(PROMPTS, sp), moe_trainer_model(tiny_moe)) > 100
    moved = moe_trainer_model(tiny_moe, seed=5)
    fp32_engine.push(moved)  # tokens of the new version are routed by the new weights
    outs = fp32_engine.generate(PROMPTS, sp)
    assert all(tagged(o.outputs[0]).versions == [fp32_engine.version] * 16 for o in outs)
    assert _check_routing_against(outs, moved) > 100


def test_streamed_routing_covers_exactly_the_tokens_shown(fp32_engine, tiny_moe) -> None:
    """Stepped by the test (see ``tests.engine_harness.drive``), read after every step as a
    streaming client reads, with a commit landing mid-generation."""
    from vllm import SamplingParams

    from inflight.engine.client import coordinator_of

    coordinator = coordinator_of(fp32_engine.llm)
    engine = fp32_engine.llm.llm_engine
    sp = SamplingParams(temperature=1.0, max_tokens=40, logprobs=0, ignore_eos=True, seed=3)
    start = coordinator.steps
    commits = coordinator.commits()
    for rid, prompt in (("s0", "3+4="), ("s1", "count 1 2")):
        engine.add_request(rid, prompt, sp)
    pushes = push_at_steps(lambda: coordinator.steps - start, [0],
                           lambda _: fp32_engine.push(moe_trainer_model(tiny_moe, seed=6)))
    counts: dict[str, list[int]] = {"s0": [], "s1": []}
    shown: dict[str, np.ndarray] = {}
    done = {}
    while engine.has_unfinished_requests():
        if coordinator.steps - start >= 20 and coordinator.commits() == commits:  # hold until the commit can land here
            wait_until(lambda: coordinator.commit_pending() or coordinator.commits() != commits,
                       "the commit to be pending at the coordinator (held 20 engine steps in)", poll_s=0.001)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
                continue
            rows = streamed_routing(engine, out.request_id)
            assert rows is not None and len(rows) == len(out.outputs[0].token_ids)  # exactly the tokens shown
            shown[out.request_id] = rows
            counts[out.request_id].append(len(rows))
    pushes.join()
    for rid, o in done.items():
        final = routing_of(o.outputs[0])
        assert len(final) == 40 and len(set(tagged(o.outputs[0]).versions)) == 2  # the request spans the commit
        assert len(counts[rid]) >= 30 and counts[rid] == sorted(counts[rid])
        assert np.array_equal(shown[rid], final[: len(shown[rid])])


def test_preempted_requests_keep_exact_routing(tiny_moe, port) -> None:
    """A KV cache of 8 blocks of 32 for 6 requests of 64+ tokens: vLLM preempts some and
    recomputes them on resume; their routing still covers each token once, as the router chose."""
    from vllm import LLM, SamplingParams

    from inflight.engine.client import coordinator_of, start_inflight
    from inflight.engine.engine_config import InflightConfig, engine_kwargs
    from inflight.transport.group_config import GroupConfig
    from inflight.transport.pusher import WeightPusher

    llm = LLM(str(tiny_moe), enforce_eager=True, dtype="float32", max_model_len=128, seed=0, block_size=32,
              num_gpu_blocks_override=8, **engine_kwargs())
    group = GroupConfig(port=port, world_size=2, timeout_s=60.0)
    start_inflight(llm, InflightConfig(group=group, record_routing=True))
    pusher = WeightPusher(group)
    try:
        coordinator, engine = coordinator_of(llm), llm.llm_engine
        sp = SamplingParams(temperature=0.0, max_tokens=60, logprobs=0, ignore_eos=True)
        for i in range(6):
            engine.add_request(f"p{i}", f"{i}+{i}=", sp)
        preempted: set[str] = set()
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            preempted |= {rid.rsplit("-", 1)[0] for rid, r in list(coordinator.core.scheduler.requests.items())
                          if r.num_preemptions}
    finally:
        pusher.close()
        llm.collective_rpc("inflight_stop")
        del llm
    assert len(preempted) >= 2, preempted
    outs = [done[rid] for rid in sorted(preempted)]
    assert all(len(o.outputs[0].token_ids) == 60 for o in outs)
    assert _check_routing_against(outs, moe_trainer_model(tiny_moe)) > 200


def _samples(outs) -> list[RolloutGroup]:
    groups = []
    for o in outs:
        samples = []
        for i, c in enumerate(o.outputs):
            t = tagged(c)
            samples.append(RolloutSample(sample_id=f"{o.request_id}-{i}", group_id=o.request_id,
                                         prompt_ids=list(o.prompt_token_ids), token_ids=t.token_ids,
                                         logprobs=t.logprobs, versions=t.versions, reward=float(i),
                                         **routing_fields(c)))
        groups.append(RolloutGroup(group_id=o.request_id, samples=tuple(samples)))
    return groups


def test_replay_brings_the_trainer_to_the_engine(tiny_moe, port) -> None:
    """bf16 engine, fp32 trainer on the same weights: the routers disagree on some rows."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    e = RecordingEngine(tiny_moe, "bfloat16", port)
    try:
        sp = SamplingParams(n=4, temperature=1.0, max_tokens=32, logprobs=0, ignore_eos=True, seed=1)
        groups = _samples(e.generate([f"{i}+{i}=" for i in range(8)], sp))
    finally:
        e.close()
    model = moe_trainer_model(tiny_moe)
    batch = collate(groups, AutoTokenizer.from_pretrained(str(tiny_moe)).pad_token_id, True)
    replay = RoutingReplay(model)
    routing = collate_routing(groups, batch.input_ids, batch.completion_ids.shape[1])
    with torch.no_grad():
        plain, _ = policy_logprobs(model, batch, Sampling())
        with replay.replaying(routing):
            replayed, _ = policy_logprobs(model, batch, Sampling())
    real = batch.completion_mask > 0
    gap = {name: (lp - batch.behaviour_logp).abs()[real] for name, lp in (("plain", plain), ("replay", replayed))}
    stats = replay.stats()
    print(f"bf16 engine vs fp32 trainer, {int(real.sum())} tokens, routing mismatch {stats['routing_mismatch']:.4f} "
          f"of {stats['routing_replayed_rows']} rows: |logp - mu| mean/max without replay "
          f"{gap['plain'].mean():.5f}/{gap['plain'].max():.5f}, with "
          f"{gap['replay'].mean():.5f}/{gap['replay'].max():.5f}")
    assert stats["routing_mismatch"] > 0  # else this batch could not tell
    assert gap["replay"].mean() < gap["plain"].mean() and gap["replay"].max() < gap["plain"].max()


# -- trainer side, against references -------------------------------------------------------

def _tiny_batch(seed: int = 0):
    """A ragged batch of random samples with random recorded routing (distinct experts per row)."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(2):
        samples = []
        for si in range(2):
            p, t = 3 + gi + si, 5 + 2 * si
            ids = torch.randint(3, 200, (p + t,), generator=g).tolist()
            rows = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t * 2)]).reshape(t, 2, 2)
            samples.append(RolloutSample(sample_id=f"{gi}-{si}", group_id=f"g{gi}", prompt_ids=ids[:p],
                                         token_ids=ids[p:], logprobs=(-torch.rand(t, generator=g)).tolist(),
                                         versions=[0] * t, reward=float(si + gi),
                                         routing=rows.numpy().astype("<i2").tobytes(), routing_layers=2, routing_k=2))
        groups.append(RolloutGroup(group_id=f"g{gi}", samples=tuple(samples)))
    batch = collate(groups, 2, True)
    return groups, batch, collate_routing(groups, batch.input_ids, batch.completion_ids.shape[1])


def test_collate_routing_aligns_with_the_sampling_positions(tiny_moe) -> None:
    groups, batch, routing = _tiny_batch()
    p_len = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
    for i, s in enumerate(s for g in groups for s in g.samples):
        rows = torch.from_numpy(np.frombuffer(s.routing, "<i2").reshape(-1, 2, 2).astype("int64"))
        t = len(s.token_ids)
        assert torch.equal(routing[i, p_len - 1: p_len - 1 + t], rows)  # column P-1+t predicts token t
        assert (routing[i, : p_len - 1] == NO_ROUTE).all() and (routing[i, p_len - 1 + t:] == NO_ROUTE).all()


def _reference_moe(block: torch.nn.Module, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Sparse-MoE block by hand, token by token: softmax coordinator, the given experts, renormalised."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ block.gate.weight.t()
    out = torch.zeros_like(flat)
    inter = block.experts.down_proj.shape[-1]
    for n in range(flat.shape[0]):
        w = torch.softmax(logits[n], -1)[index[n]]
        w = w / w.sum()
        for j, e in enumerate(index[n].tolist()):
            gu = block.experts.gate_up_proj[e] @ flat[n]
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[n] = out[n] + w[j] * (block.experts.down_proj[e] @ h)
    return out.reshape(x.shape)


def test_replay_loss_and_gradient_match_a_reference(tiny_moe) -> None:
    from inflight.trainer.loss_config import LossConfig

    model = moe_trainer_model(tiny_moe)
    _, batch, routing = _tiny_batch()
    replay = RoutingReplay(model)
    blocks = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeSparseMoeBlock"]

    def loss_and_grads(use_reference: bool):
        model.zero_grad()
        hooks = []
        if use_reference:  # each block's output replaced by the hand-written one with the same experts
            for layer, block in enumerate(blocks):
                def hook(mod, args, out, layer=layer):
                    own = torch.topk(torch.softmax(args[0].reshape(-1, args[0].shape[-1]) @ mod.gate.weight.t(), -1),
                                     2).indices
                    rec = routing[:, :, layer].reshape(-1, 2)
                    return _reference_moe(mod, args[0], torch.where(rec[:, :1] != NO_ROUTE, rec, own))
                hooks.append(block.register_forward_hook(hook))
        try:
            with replay.replaying(None if use_reference else routing):
                logp, ent = policy_logprobs(model, batch, Sampling(), impl="torch")
            loss, _ = compute_loss(logp, ent, batch, version=0, cfg=LossConfig(), impl="torch")
            loss.backward()
        finally:
            for h in hooks:
                h.remove()
        return logp.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    logp, loss, grads = loss_and_grads(False)
    ref_logp, ref_loss, ref_grads = loss_and_grads(True)
    assert replay.stats()["routing_mismatch"] > 0.3  # random routing: the replay is doing something
    torch.testing.assert_close(logp, ref_logp, atol=2e-6, rtol=0)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-5)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-6, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
    assert ref_grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the router learns through its weights


def test_replaying_the_routers_own_choice_changes_nothing(tiny_moe) -> None:
    model = moe_trainer_model(tiny_moe)
    _, batch, _ = _tiny_batch()
    replay = RoutingReplay(model)
    own: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, o: own.append(o[2])) for r in replay.routers]
    with torch.no_grad():
        plain, _ = policy_logprobs(model, batch, Sampling())
    for h in hooks:
        h.remove()
    b, s = batch.input_ids.shape
    routing = torch.stack(own, 1).reshape(b, s, len(own), 2)
    with torch.no_grad(), replay.replaying(routing):
        replayed, _ = policy_logprobs(model, batch, Sampling())
    assert torch.equal(plain, replayed) and replay.stats()["routing_mismatch"] == 0.0
    w = gate_weights(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), torch.tensor([[3, 0]]), True)
    torch.testing.assert_close(w, torch.tensor([[np.e ** 3 / (np.e ** 3 + 1), 1 / (np.e ** 3 + 1)]],
                                               dtype=torch.float32))


def test_refusals_name_what_is_missing(tiny_moe) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has no sparse-MoE router"):
        RoutingReplay(dense)
    assert RoutingReplay(dense, enabled=False).stats() == {}
    bare = RolloutSample(sample_id="a-0", group_id="a", prompt_ids=[1], token_ids=[2, 3], logprobs=[-1.0, -1.0],
                         versions=[0, 0], reward=0.0)
    with pytest.raises(ValueError, match=r"samples \['a-0'\] carry no routing"):
        collate_routing([RolloutGroup(group_id="a", samples=(bare,))], torch.zeros(1, 3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="6 routing bytes for 2 tokens x 1 layers x 2 experts"):
        RolloutSample(sample_id="a-0", group_id="a", prompt_ids=[1], token_ids=[2, 3], logprobs=[-1.0, -1.0],
                      versions=[0, 0], reward=0.0, routing=b"\0" * 6, routing_layers=1, routing_k=2)
    good = RolloutSample(sample_id="a-0", group_id="a", prompt_ids=[1], token_ids=[2, 3], logprobs=[-1.0, -1.0],
                         versions=[0, 0], reward=0.0, routing=np.array([1, 0, 3, 2], "<i2").tobytes(),
                         routing_layers=1, routing_k=2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(good), type=RolloutSample) == good


def test_training_with_routing_replay(tmp_path) -> None:
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.train import train

    cfg = config_from_dict({
        "run": {"steps": 3, "seed": 4, "out_dir": str(tmp_path / "run")},
        "model": {"tiny": dict(MOE)},
        "task": {"completion_tokens": 12},
        "rollout": {"group_size": 4, "groups_per_step": 2, "in_flight_groups": 2, "queue_capacity": 2},
        "loss": {"routing_replay": True},
        "transport": {"bucket_mb": 0.25},
    })
    train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3] and rows[-1]["pushed_version"] == 3
    # every sampled token's position was replayed, in both MoE layers
    assert all(0 < r["routing_replayed_rows"] <= 2 * 8 * 12 for r in rows)  # tokens x MoE layers
    assert all(0.0 <= r["routing_mismatch"] < 1.0 for r in rows)
    print("routing mismatch per step (trainer vs engine experts):", [round(r["routing_mismatch"], 4) for r in rows])


def test_capture_is_refused_where_its_hooks_cannot_run() -> None:
    """Model Runner V2 (vLLM's pick on CUDA with Triton) has no ``input_batch`` to align rows
    with, and CUDA-graph replay runs no Python hook: ``inflight_start`` refuses both by name
    instead of failing a step (V2) or recording nothing (graphs). The eager CPU runner and an
    eager V1 GPU runner record."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    from inflight.engine.routing import capture_problem

    v2 = capture_problem(V2Runner, device_type="cuda", enforce_eager=True, cudagraph_mode=CUDAGraphMode.NONE)
    assert v2 is not None and "Model Runner V2" in v2 and "enable_return_routed_experts" in v2
    graphs = capture_problem(V1Runner, device_type="cuda", enforce_eager=False, cudagraph_mode=CUDAGraphMode.FULL)
    assert graphs is not None and "cudagraph_mode=FULL" in graphs and "enforce_eager=True" in graphs
    assert capture_problem(V1Runner, device_type="cuda", enforce_eager=True, cudagraph_mode=CUDAGraphMode.FULL) is None
    assert capture_problem(CPUModelRunner, device_type="cpu", enforce_eager=True,
                           cudagraph_mode=CUDAGraphMode.NONE) is None
