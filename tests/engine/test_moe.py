"""Mixture-of-experts policies take in-flight updates (a tiny random-init Qwen3-MoE: 4 experts,
top-2, head_dim 64, on a real vLLM CPU engine).

- the trainer sends checkpoint-format tensors: transformers 5 keeps the experts fused in
  memory (``experts.gate_up_proj`` (E, 2I, H)), the checkpoint and the engine's schema have
  one tensor per expert and projection; ``named_weights`` applies transformers' own reverse
  conversion, and each expert crosses the wire once;
- after an update the engine's greedy tokens and log-probs equal the transformers model
  the trainer holds (fp32, 1e-5), for both CPU commit strategies (``swap``, what ``auto``
  picks on an eager engine, and ``reload``): vLLM's CPU MoE update path skips the experts'
  re-pack (``inflight.engine.commit.loaders.process_after_loading``), which these tests catch;
- building a commit strategy never fails with a bare error: an unforeseen one is a refusal
  naming the model class, a loader that transforms tensors makes ``auto`` fall back;
- the trainer entry point trains an MoE policy.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from tests.engine_harness import Harness
from tests.helpers import MOE, check_tags, moe_trainer_model

PROMPTS = ["1+2=", "count 3 4", "the quick brown", "17+5=", "lazy dog"]
def _on_disk(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_named_weights_are_the_checkpoint_one_copy_per_expert(tiny_moe) -> None:
    from inflight.transport.sources import named_weights

    model = moe_trainer_model(tiny_moe)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())  # fused in memory
    sent, disk = named_weights(model), _on_disk(tiny_moe)
    assert sent.keys() == disk.keys()
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in sent
    assert all(torch.equal(sent[k], disk[k]) for k in disk)
    # one copy of each expert: exactly the checkpoint's bytes, nothing fused sent beside them
    assert (sum(t.numel() * t.element_size() for t in sent.values())
            == sum(t.numel() * t.element_size() for t in disk.values()))
    # the expert tensors are the in-memory ones, split: a change in the fused tensor reaches its expert
    with torch.no_grad():
        model.model.layers[0].mlp.experts.gate_up_proj[2, 128:] += 1.0  # rows I.. are up_proj (gate first)
    moved = named_weights(model)
    assert torch.equal(moved["model.layers.0.mlp.experts.2.up_proj.weight"],
                       disk["model.layers.0.mlp.experts.2.up_proj.weight"] + 1)
    assert torch.equal(moved["model.layers.0.mlp.experts.2.gate_proj.weight"],
                       disk["model.layers.0.mlp.experts.2.gate_proj.weight"])


@torch.no_grad()
def _reference_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


@torch.no_grad()
def _reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _check(h: Harness, model, version: int) -> float:
    worst = 0.0
    for prompt, out in h.greedy(PROMPTS):
        assert out.versions == [version] * len(out.token_ids)
        assert out.token_ids == _reference_greedy(model, prompt, len(out.token_ids))
        got, want = torch.tensor(out.logprobs, dtype=torch.float64), _reference_logprobs(model, prompt, out.token_ids)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        worst = max(worst, float((got - want).abs().max()))
    return worst


@pytest.mark.parametrize("commit", ["auto", "reload"])
def test_moe_engine_takes_updates_with_parity(tiny_moe, port, commit: str) -> None:
    from inflight.transport.sources import named_weights

    h = Harness(tiny_moe, "float32", port, commit=commit)
    try:
        assert h.start_report.commit == ("swap" if commit == "auto" else "reload")
        _check(h, moe_trainer_model(tiny_moe), 0)
        disk_bytes = sum(t.numel() * t.element_size() for t in _on_disk(tiny_moe).values())
        for seed in (1, 2):  # two updates: the second goes through the state the first left
            model = moe_trainer_model(tiny_moe, seed)
            result = h.push(named_weights(model))
            # what crossed the wire: the checkpoint's bytes once (64-byte aligned offsets)
            assert disk_bytes <= result.send.nbytes < disk_bytes + 64 * len(h.base)
            worst = _check(h, model, h.version)
            print(f"moe {commit}: v{h.version} worst |logp - transformers| = {worst:.2e}, "
                  f"commit {result.commits[1].commit_ms:.2f} ms")
    finally:
        h.close()


@pytest.fixture(scope="module")
def tiny_glm(tmp_path_factory):
    """A 2-layer GLM-4.5-style MoE (``Glm4MoeForCausalLM``: a dense first layer, then 4 routed
    experts, top-2, one shared expert): vLLM 0.32 keeps its router (``GateLinear``) and the
    router's ``e_score_correction_bias`` in float32 in a bfloat16 engine. fp32 on disk."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from inflight.trainer.tiny_model import default_corpus, train_tokenizer

    out = tmp_path_factory.mktemp("tiny_glm")
    vocab = train_tokenizer(default_corpus(), out, vocab_size=256)
    config = Glm4MoeConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           n_group=1, topk_group=1, max_position_embeddings=2048, tie_word_embeddings=False,
                           partial_rotary_factor=0.5)
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(config).float()
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("commit", ["auto", "reload"])
def test_a_bf16_engine_keeps_its_fp32_router_fp32_through_an_update(tiny_glm, port, tmp_path, commit: str) -> None:
    """An in-flight update of a bfloat16 engine carries the parameters it keeps in float32 in
    float32 (the worker's hello names them: ``Joined.wire_dtypes``), and the routers' own
    references to the router bias follow the swap commit's new parameters
    (``swap.parameter_aliases``): the updated engine equals a fresh engine started on the
    same checkpoint, tokens and log-probs bit for bit. So does ``reload``, whose CPU experts
    are re-packed once though the router shares a parameter with them."""
    import gc

    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams

    from inflight.engine.engine_config import engine_kwargs
    from tests.engine_harness import perturbed

    bias, gate = "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"
    new = perturbed({k: v.float() for k, v in _on_disk(tiny_glm).items()}, seed=3)
    assert not torch.equal(new[bias].to(torch.bfloat16).float(), new[bias])  # bfloat16 would round it
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)

    def outputs(llm) -> list[tuple[list[int], list[float]]]:
        return [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                for o in llm.generate(PROMPTS, sp, use_tqdm=False)]

    def live_bias(self) -> torch.Tensor:
        return dict(self.model_runner.get_model().named_parameters())[bias].detach().clone()

    h = Harness(tiny_glm, "bfloat16", port, commit=commit)
    try:
        assert h.start_report.commit == ("swap" if commit == "auto" else "reload")
        assert h.pusher.group.hellos[1].wire_dtypes == {bias: "float32", gate: "float32"}
        h.push(new)
        assert torch.equal(h.llm.collective_rpc(live_bias)[0], new[bias])
        updated = outputs(h.llm)
    finally:
        h.close()
    fresh_dir = tmp_path / "fresh"
    fresh_dir.mkdir()
    for f in tiny_glm.iterdir():
        if f.suffix != ".safetensors":
            (fresh_dir / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in new.items()}, str(fresh_dir / "model.safetensors"),
              metadata={"format": "pt"})
    fresh = LLM(str(fresh_dir), enforce_eager=True, dtype="bfloat16", max_model_len=1024, seed=0, **engine_kwargs())
    try:
        assert outputs(fresh) == updated
    finally:
        del fresh
        gc.collect()


class _Runner:
    """The two things ``make_strategy`` reads from vLLM's model runner."""

    device = torch.device("cpu")

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


class Unforeseen(torch.nn.Module):
    """A model whose loader fails in a way nobody planned for."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 2))

    def load_weights(self, weights):
        raise TypeError("record() missing 1 required positional argument: 'loaded'")


class Transposing(Unforeseen):
    """A model whose loader changes the tensor before loading it: not a plain routing."""

    def load_weights(self, weights):
        for _name, t in weights:
            self.w.weight_loader(self.w, t.t())


def test_building_a_commit_never_fails_bare(caplog) -> None:
    from inflight.engine.commit.base import make_strategy
    from inflight.transport.schema import TensorSchema

    schema = TensorSchema({"w": ((2, 2), "float32")})
    with pytest.raises(RuntimeError, match=r"building the swap commit for Unforeseen failed: TypeError"):
        make_strategy(_Runner(Unforeseen()), "auto", schema, quantized=False, eager=True)
    with caplog.at_level(logging.WARNING, logger="inflight.apply"):
        strategy = make_strategy(_Runner(Transposing()), "auto", schema, quantized=False, eager=True)
    assert strategy.name == "reload"
    assert "swap commits unavailable for Transposing" in caplog.text and "transforms 'w'" in caplog.text
    with pytest.raises(RuntimeError, match=r"commit='swap' is not possible for Transposing"):
        make_strategy(_Runner(Transposing()), "swap", schema, quantized=False, eager=True)


def test_training_an_moe_policy(tmp_path) -> None:
    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.train import train

    tiny = {k: v for k, v in MOE.items()}
    cfg = config_from_dict({
        "run": {"steps": 3, "seed": 3, "out_dir": str(tmp_path / "run")},
        "model": {"tiny": tiny},
        "task": {"completion_tokens": 12},
        "rollout": {"group_size": 4, "groups_per_step": 2, "in_flight_groups": 2, "queue_capacity": 2},
        "transport": {"bucket_mb": 0.25},
    })
    summary = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == [1, 2, 3]
    assert rows[-1]["pushed_version"] == 3 and rows[-1]["stall_ms"] > 0  # every push committed
    assert all(r["tokens_in_loss"] > 0 and r["grad_norm"] > 0 for r in rows)
    assert "routing_mismatch" not in rows[-1]  # replay is opt-in
    check_tags(summary, rows, cfg.loss.max_lag)
