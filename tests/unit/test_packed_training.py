"""Packed, prefix-shared, checkpointed training with the chunked head takes the padded step.

Each case trains the same GRPO groups (a prompt per group, shared histories past it,
observations) for 3 optimizer steps twice: with ``optim.packing = "padded"`` and no
checkpointing (the reference: every row padded and masked, the whole logits), and with the
layout under test. Per step the loss, the gradient norm and, after the step, every parameter
agree within 1e-5 in fp32. The mutants at the end (attention that crosses samples, a prefix
shared across groups) fail the same comparison.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from inflight.trainer.config_files import config_from_dict
from tests.helpers import shared_prompt_groups

STEPS = 3
CASES = {
    "plain": ("tiny_llama", {}),
    "micro_batches": ("tiny_llama", {"optim": {"micro_batch_tokens": 48}}),
    "kl_entropy_tied": ("tiny_qwen", {"loss": {"kl_coef": 0.1, "entropy_coef": 0.01}}),
    "sequence_level": ("tiny_qwen", {"loss": {"level": "sequence"}, "optim": {"micro_batch_tokens": 40}}),
    "sampling_filters": ("tiny_llama", {"rollout": {"temperature": 0.8, "top_k": 150, "top_p": 0.9}}),
    "lora": ("tiny_qwen", {"model": {"lora": {"rank": 4, "alpha": 8.0}}, "loss": {"kl_coef": 0.05}}),
    "routing_replay_moe": ("tiny_moe", {"loss": {"routing_replay": True}, "optim": {"micro_batch_tokens": 48}}),
}
LR = 1e-4
"""Adam moves a weight by about lr * g / (|g| + eps): where a gradient is near eps (a LoRA
adapter's first steps from B = 0, a router's, a few MLP elements), a rounding-level difference
between two sums of g moves it by a share of lr (1.2e-5 in a down_proj element at lr 1e-3)."""
LAYOUTS = [("packed", True), ("prefix_shared", False), ("prefix_shared", True)]


def _config(model_dir: Path, setting: dict, packing: str, checkpointing: bool):
    base = {"model": {"path": str(model_dir)}, "rollout": {"group_size": 4, "groups_per_step": 3},
            "loss": {"max_lag": 2}, "engine": {"max_model_len": 40}, "task": {"completion_tokens": 16},
            "optim": {"packing": packing, "activation_checkpointing": checkpointing, "lr": LR}}
    for key, values in setting.items():
        base[key] = {**base.get(key, {}), **values}
    return config_from_dict(base)


def _train(model_dir: Path, cfg, adapter: Path | None = None) -> list[dict]:
    """``STEPS`` optimizer steps on the same groups: each step's loss, gradient norm, weights after."""
    from inflight.trainer.policy import Policy

    threads = torch.get_num_threads()
    try:
        policy = Policy(cfg, model_dir, None, adapter)
        routers = 2 if cfg.loss.routing_replay else 0
        out = []
        for step in range(STEPS):
            groups = shared_prompt_groups(torch.Generator().manual_seed(10 + step), 3, 4, routers=routers)
            result = policy.step(groups, version=2, step=step)
            out.append({"loss": result.loss, "grad_norm": result.grad_norm, "metrics": result.metrics,
                        "weights": {k: v.detach().clone() for k, v in policy.model.named_parameters()
                                    if v.requires_grad}})
        return out
    finally:
        torch.set_num_threads(threads)


def _differences(a: list[dict], b: list[dict]) -> float:
    """The largest difference between two runs: losses, gradient norms (relative), weights."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        worst = max(worst, abs(x["loss"] - y["loss"]), abs(x["grad_norm"] - y["grad_norm"]) / max(1.0, x["grad_norm"]),
                    max(float((x["weights"][k] - y["weights"][k]).abs().max()) for k in x["weights"]))
    return worst


def _adapter(model_dir: Path, cfg, tmp_path: Path) -> Path | None:
    from inflight.trainer.lora_policy import write_first_adapter

    if not cfg.model.lora.enabled:
        return None
    return write_first_adapter(model_dir, cfg.model.lora, tmp_path / "adapter", seed=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_layout_takes_the_padded_steps(request, tmp_path, case: str) -> None:
    fixture, setting = CASES[case]
    model_dir = request.getfixturevalue(fixture)
    reference_cfg = _config(model_dir, setting, "padded", False)
    adapter = _adapter(model_dir, reference_cfg, tmp_path)
    reference = _train(model_dir, reference_cfg, adapter)
    assert all(r["grad_norm"] > 0 and r["loss"] != 0 for r in reference)
    first, last = reference[0]["weights"], reference[-1]["weights"]
    assert any(float((first[k] - last[k]).abs().max()) > 1e-5 for k in first)  # the steps moved the weights
    if case == "sampling_filters":  # the filters dropped some sampled tokens: the case tests them
        assert all(r["metrics"]["frac_masked_filter"] > 0.05 for r in reference)
    for packing, checkpointing in LAYOUTS:
        runs = _train(model_dir, _config(model_dir, setting, packing, checkpointing), adapter)
        assert runs[0]["metrics"]["packing"] == packing
        assert _differences(reference, runs) < 1e-5, (packing, checkpointing, _differences(reference, runs))
        for key in ("tokens_in_loss", "ess", "entropy", "lag_hist", "ratio_hist", "frac_masked_lag"):
            assert runs[-1]["metrics"][key] == pytest.approx(reference[-1]["metrics"][key], abs=1e-6), key
        if case == "routing_replay_moe":  # replays counted in the forward only; a shared row once
            replayed = runs[-1]["metrics"]["routing_replayed_rows"]
            want = reference[-1]["metrics"]["routing_replayed_rows"]
            assert replayed == want if packing == "packed" else 0 < replayed < want, (packing, replayed, want)
    shared = _train(model_dir, _config(model_dir, setting, "prefix_shared", True), adapter)[-1]["metrics"]
    padded = reference[-1]["metrics"]
    assert shared["trainer_prompt_tokens"] < padded["trainer_prompt_tokens"] / 2  # each prompt once per group


def test_the_layouts_count_what_they_compute(tiny_llama) -> None:
    """Per step: tokens run forward as laid out, prompt and completion apart, and where the
    step's time went."""
    rows = {p: _train(tiny_llama, _config(tiny_llama, {}, p, True))[0]["metrics"] for p in
            ("padded", "packed", "prefix_shared")}
    groups = shared_prompt_groups(torch.Generator().manual_seed(10), 3, 4)
    completion = sum(len(s.token_ids) for g in groups for s in g.samples)
    prompts = sum(len(s.prompt_ids) for g in groups for s in g.samples)
    assert rows["packed"]["trainer_completion_tokens"] == completion - 12  # no row for each sample's last token
    assert rows["packed"]["trainer_prompt_tokens"] == prompts
    assert rows["prefix_shared"]["trainer_prompt_tokens"] == sum(len(g.samples[0].prompt_ids) for g in groups)
    assert rows["padded"]["trainer_tokens"] > rows["packed"]["trainer_tokens"] > rows["prefix_shared"]["trainer_tokens"]
    for row in rows.values():
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0 and row["optimizer_ms"] > 0
        assert row["peak_rss_gb"] >= row["rss_gb"] * 0.5 > 0


def test_checkpointing_keeps_only_each_layers_input(tiny_llama) -> None:
    """The bytes saved for the backward pass during a packed forward: with checkpointing, a
    small share of what the layers save without it."""
    from inflight.trainer.policy import Policy

    saved = {}
    for checkpointing in (False, True):
        cfg = _config(tiny_llama, {}, "prefix_shared", checkpointing)
        policy = Policy(cfg, tiny_llama, None)
        groups = shared_prompt_groups(torch.Generator().manual_seed(3), 3, 4)
        total = [0]

        def pack_hook(t: torch.Tensor, total=total):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            policy.accumulate(groups, version=2)
        saved[checkpointing] = total[0]
    assert saved[True] < saved[False] / 3, saved


def test_no_whole_logits_tensor_in_a_packed_step(tiny_llama) -> None:
    """With the chunked head, no tensor of (completion tokens x vocabulary) elements is
    allocated in the step; the padded reference allocates one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from inflight.trainer.policy import Policy

    class Largest(TorchDispatchMode):
        """The most rows of any (..., vocabulary) tensor an op returns."""

        def __init__(self, vocab: int, hidden: int):
            super().__init__()
            self.vocab, self.head, self.largest = vocab, (hidden, vocab), 0  # the head's weight, transposed

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab and t.shape != self.head:
                    self.largest = max(self.largest, t.numel() // self.vocab)
            return out

    groups = shared_prompt_groups(torch.Generator().manual_seed(3), 3, 4)
    tokens = sum(len(s.token_ids) for g in groups for s in g.samples)
    largest = {}
    for packing in ("padded", "prefix_shared"):
        cfg = _config(tiny_llama, {"optim": {"head_chunk_tokens": 8}}, packing, True)
        policy = Policy(cfg, tiny_llama, None)
        vocab = policy.model.config.vocab_size
        with Largest(vocab, policy.model.config.hidden_size) as mode:
            policy.accumulate(groups, version=2)
        largest[packing] = mode.largest
    assert largest["padded"] >= tokens  # (rows, completion, vocabulary) logits
    assert largest["prefix_shared"] <= 8, largest  # optim.head_chunk_tokens rows at a time


def _mutant_runs(monkeypatch, model_dir: Path, mutate) -> float:
    reference = _train(model_dir, _config(model_dir, {}, "padded", False))
    with monkeypatch.context() as m:
        mutate(m)
        runs = _train(model_dir, _config(model_dir, {}, "prefix_shared", True))
    return _differences(reference, runs)


def test_a_mutant_whose_attention_crosses_samples_fails(monkeypatch, tiny_llama) -> None:
    """Every row of a span attends to every row before it: a sample sees its siblings."""
    import inflight.trainer.packed_batch as packed_batch

    real = packed_batch._span_mask

    def crossing(nodes):
        mask = real(nodes)
        return None if mask is None else torch.ones_like(mask).tril(diagonal=mask.shape[1] - mask.shape[0])

    assert _mutant_runs(monkeypatch, tiny_llama, lambda m: m.setattr(packed_batch, "_span_mask", crossing)) > 1e-3


def test_a_mutant_whose_prefix_is_shared_across_groups_fails(monkeypatch, tiny_llama) -> None:
    """Every group's samples hang off the first group's prompt."""
    import inflight.trainer.packed_batch as packed_batch

    real = packed_batch._forest

    def one_prompt(inputs, groups, share):
        first = groups[0][0]
        p = len(inputs.samples[first].prompt_ids)
        for m in (m for g in groups[1:] for m in g):
            q = len(inputs.samples[m].prompt_ids)
            head = inputs.tokens[first][:min(p, q)]
            inputs.tokens[m] = np.concatenate([head, inputs.tokens[m][len(head):]])
        return real(inputs, [[m for g in groups for m in g]], share)

    assert _mutant_runs(monkeypatch, tiny_llama, lambda m: m.setattr(packed_batch, "_forest", one_prompt)) > 1e-3


def test_a_model_that_cannot_pack_pads_and_says_why_once(tmp_path, caplog) -> None:
    """Gemma-2 alternates sliding-window layers: packed training falls back to padded rows, with one warning."""
    from inflight.trainer.policy import Policy
    from inflight.trainer.tiny_model import TinyModelConfig, build_tiny_model, default_corpus

    model_dir = build_tiny_model(tmp_path / "gemma2", default_corpus(), TinyModelConfig(arch="gemma2"))
    cfg = _config(model_dir, {}, "prefix_shared", True)
    with caplog.at_level(logging.WARNING, logger="inflight.train"):
        policy = Policy(cfg, model_dir, None)
        policy.step(shared_prompt_groups(torch.Generator().manual_seed(1), 3, 4), version=2, step=0)
    said = [r.getMessage() for r in caplog.records if "optim.packing" in r.getMessage()]
    assert len(said) == 1 and "sliding_attention" in said[0] and "optim.packing='padded'" in said[0], said
    assert policy.packing == "padded"
    assert replace(cfg.optim, packing="padded").packing == "padded"
