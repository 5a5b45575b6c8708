"""The trainer's loss against values computed by hand, and its gradients against the reference."""

from __future__ import annotations

import math

import pytest
import torch

from inflight.kernels.tis_loss import tis_loss
from inflight.protocol import RolloutGroup, RolloutSample, Sampling
from inflight.trainer.loss import Batch, collate, compute_loss, grpo_advantages, policy_logprobs
from inflight.trainer.loss_config import LossConfig, ObjectiveConfig
from tests.helpers import random_groups


def test_grpo_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    torch.testing.assert_close(grpo_advantages(rewards, normalize_std=True),
                               torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(grpo_advantages(rewards, normalize_std=False),
                               torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))


def _hand_batch() -> tuple[Batch, torch.Tensor]:
    """Two samples, three positions; the second sample has two real tokens.

    trainer version 7, max_lag 2: lags [[2, 2, 1], [3, 1, pad]] -> token (1, 0) is masked.
    ratios r = pi/mu: [[1, 3, 0.5], [1, 1.5, pad]] with pi = 0.5 everywhere.
    """
    logp = torch.full((2, 3), math.log(0.5))
    r = torch.tensor([[1.0, 3.0, 0.5], [1.0, 1.5, 1.0]])
    batch = Batch(
        input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4, dtype=torch.long),
        position_ids=torch.zeros(2, 4, dtype=torch.long), completion_ids=torch.zeros(2, 3, dtype=torch.long),
        completion_mask=torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        behaviour_logp=logp - torch.log(r),
        versions=torch.tensor([[5, 5, 6], [4, 6, 6]]),
        rewards=torch.tensor([1.0, 0.0]), advantages=torch.tensor([1.0, -1.0]),
    )
    return batch, logp


def test_reinforce_tis_by_hand() -> None:
    batch, logp0 = _hand_batch()
    logp = logp0.clone().requires_grad_()
    cfg = LossConfig(objective=ObjectiveConfig(truncation=2.0), max_lag=2)
    loss, m = compute_loss(logp, torch.zeros(2, 3), batch, version=7, cfg=cfg)
    # w = min(r, 2) on unmasked tokens = [1, 2, 0.5 | -, 1.5]; N = 5 real tokens
    # loss = -(1/5) * log(0.5) * [(1 + 2 + 0.5) * (+1) + 1.5 * (-1)] = -(2/5) log 0.5
    assert float(loss.detach()) == pytest.approx(-0.4 * math.log(0.5), abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.2, -0.4, -0.1], [0.0, 0.3, 0.0]]), atol=1e-6, rtol=0)
    assert m["tokens"] == 5
    assert m["frac_masked_lag"] == pytest.approx(0.2)
    assert m["frac_truncated"] == pytest.approx(0.25)  # r = 3 of [1, 3, 0.5, 1.5]
    assert m["ess"] == pytest.approx(25 / (4 * 7.5))  # (sum w)^2 / (n sum w^2), w = [1, 2, .5, 1.5]
    k3 = [0.0, 2 - math.log(3), -0.5 + math.log(2), 0.5 - math.log(1.5)]
    assert m["kl_mu_pi"] == pytest.approx(sum(k3) / 4, abs=1e-6)
    assert m["lag_hist"] == {1: 2, 2: 2, 3: 1}
    assert m["frac_multi_version"] == 1.0


def test_max_lag_zero_masks_every_stale_token() -> None:
    batch, logp0 = _hand_batch()
    logp = logp0.clone().requires_grad_()
    loss, m = compute_loss(logp, torch.zeros(2, 3), batch, version=6, cfg=LossConfig(max_lag=0))
    # version 6, lag 0 only: tokens (0, 2) and (1, 1) -> w = [0.5, 1.5], A = [+1, -1]
    assert float(loss.detach()) == pytest.approx(-(1 / 5) * math.log(0.5) * (0.5 - 1.5), abs=1e-6)
    assert m["frac_masked_lag"] == pytest.approx(3 / 5)


def _flat(r: list[float], adv: list[float]):
    logp = torch.full((len(r),), math.log(0.25)).requires_grad_()
    mu = logp.detach() - torch.log(torch.tensor(r))
    return logp, mu, torch.tensor(adv), torch.ones(len(r))


def test_ppo_clip_by_hand() -> None:
    logp, mu, adv, mask = _flat([1.5, 0.5, 0.5, 1.1], [1.0, 1.0, -1.0, -1.0])
    loss, _ = tis_loss(logp, mu, adv, mask, 4.0, objective="ppo", clip_low=0.2, clip_high=0.28, impl="reference")
    # per token -min(rA, clip(r)A): -1.28 (clipped above), -0.5 (unclipped), +0.8 (clipped below), +1.1 (inside)
    assert float(loss.detach()) == pytest.approx((-1.28 - 0.5 + 0.8 + 1.1) / 4, abs=1e-6)
    loss.backward()
    # d/dlogp = -A r / N where the unclipped branch is taken or the clip is inactive, else 0
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.5 / 4, 0.0, 1.1 / 4]), atol=1e-6, rtol=0)


def test_icepop_masks_outside_band() -> None:
    logp, mu, adv, mask = _flat([3.0, 0.3, 1.2], [1.0, 1.0, 1.0])
    loss, w = tis_loss(logp, mu, adv, mask, 3.0, objective="icepop", icepop_low=0.5, icepop_high=2.0, impl="reference")
    torch.testing.assert_close(w, torch.tensor([0.0, 0.0, 1.2]))
    assert float(loss.detach()) == pytest.approx(-1.2 * math.log(0.25) / 3, abs=1e-6)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_tis_loss_refuses_an_unknown_objective(impl: str) -> None:
    logp, mu, adv, mask = _flat([1.0], [1.0])
    with pytest.raises(ValueError, match=r"objective='sft' is not one of 'reinforce', 'ppo', 'icepop', 'none'"):
        tis_loss(logp, mu, adv, mask, 1.0, objective="sft", impl=impl)  # type: ignore[arg-type]


def _groups() -> list[RolloutGroup]:
    def sample(i: int, prompt: list[int], tokens: list[int], versions: list[int], reward: float) -> RolloutSample:
        return RolloutSample(sample_id=f"s{i}", group_id="g", prompt_ids=prompt, token_ids=tokens,
                             logprobs=[-1.0] * len(tokens), versions=versions, reward=reward)

    return [RolloutGroup(group_id="g", samples=(sample(0, [5, 6, 7], [8, 9], [1, 2], 1.0),
                                                 sample(1, [5], [10, 11, 12], [2, 2, 2], 0.0)))]


def test_collate_layout() -> None:
    b = collate(_groups(), pad_id=0, normalize_std=False)
    # prompts end at column P=3, completions start there
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 5, 10, 11, 12]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert b.position_ids[1, 2:].tolist() == [0, 1, 2, 3]  # each prompt numbered from 0, as in the engine
    assert b.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert b.versions.tolist() == [[1, 2, 2], [2, 2, 2]]
    assert b.advantages.tolist() == [0.5, -0.5]


def test_gradients_match_the_reference_pipeline(tiny_qwen) -> None:
    """Parameter gradients of the whole loss: chunked kernels vs the plain-torch reference."""
    from transformers import AutoModelForCausalLM

    batch = collate(_groups(), pad_id=0, normalize_std=True)
    grads = {}
    for impl in ("reference", "torch", "triton"):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen))
        logp, ent = policy_logprobs(model, batch, Sampling(temperature=0.7), impl=impl)
        loss, _ = compute_loss(logp, ent, batch, version=2, cfg=LossConfig(max_lag=1, entropy_coef=0.01),
                               impl="triton" if impl == "triton" else "reference")
        loss.backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for impl in ("torch", "triton"):
        for name, g in grads["reference"].items():
            torch.testing.assert_close(grads[impl][name], g, atol=1e-6, rtol=1e-4, msg=f"{impl}: {name}")


def test_left_padding_does_not_change_the_policy(tiny_qwen) -> None:
    """Batched (left-padded prompts, shifted positions) log-probs equal each sample run alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen))
    samples = (RolloutSample(sample_id="a", group_id="g", prompt_ids=[5, 6, 7, 8, 9, 10], token_ids=[11, 12, 13],
                             logprobs=[-1.0] * 3, versions=[0] * 3, reward=0.0),
               RolloutSample(sample_id="b", group_id="g", prompt_ids=[5, 9], token_ids=[11, 12, 13, 14],
                             logprobs=[-1.0] * 4, versions=[0] * 4, reward=1.0))
    batch = collate([RolloutGroup(group_id="g", samples=samples)], pad_id=2, normalize_std=False)
    with torch.no_grad():
        logp, _ = policy_logprobs(model, batch, Sampling(temperature=1.0))
        for i, s in enumerate(samples):
            full = torch.log_softmax(model(torch.tensor([s.prompt_ids + s.token_ids])).logits[0], -1)
            alone = full[len(s.prompt_ids) - 1: -1].gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(logp[i, : len(s.token_ids)], alone, atol=2e-6, rtol=0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_micro_batches_accumulate_the_one_batch_gradient(tiny_llama, level: str) -> None:
    """Padded micro-batches of at most ``optim.micro_batch_tokens`` (splitting GRPO groups, each
    micro-batch trimmed to its own padding) accumulate the gradient of one pass over the whole
    batch: fp32, within 1e-5; the loss and the step's metrics are the whole batch's."""
    from dataclasses import replace
    from pathlib import Path

    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.loss import padded_rows
    from inflight.trainer.policy import Policy

    threads = torch.get_num_threads()
    cfg = config_from_dict({"model": {"path": str(tiny_llama)}, "rollout": {"group_size": 5, "groups_per_step": 3},
                            "loss": {"entropy_coef": 0.01, "level": level, "max_lag": 1},
                            "optim": {"packing": "padded"}, "engine": {"max_model_len": 24},
                            "task": {"completion_tokens": 12}})
    try:
        policy = Policy(cfg, Path(tiny_llama), None)
        groups = random_groups(torch.Generator().manual_seed(3), 3, 5)
        runs, passes = [], []
        for budget in (10_000, 80):
            policy.accumulator = replace(policy.accumulator, budget=budget)
            loss, metrics, _ = policy.accumulate(groups, version=2)
            passes.append(metrics["micro_batches"])
            runs.append((loss, metrics, {k: p.grad.clone() for k, p in policy.unwrapped.named_parameters()}))
            policy.optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    (loss1, m1, g1), (loss4, m4, g4) = runs
    assert loss1 == pytest.approx(loss4, abs=1e-6)
    for key in ("tokens_in_loss", "ess", "entropy", "lag_hist", "ratio_hist", "frac_masked_lag"):
        assert m1[key] == pytest.approx(m4[key], abs=1e-6), key
    worst = max(float((g1[k] - g4[k]).abs().max() / g1[k].abs().max().clamp(min=1e-12)) for k in g1)
    assert worst < 1e-5, worst
    assert all(float(g.abs().max()) > 0 for g in g1.values())
    assert passes[0] == 1 and passes[1] >= 3, passes
    batch = collate(groups, 0, normalize_std=False)
    part, cols = padded_rows(batch, 4, 8)
    assert part.input_ids.shape[0] == 4 and part.input_ids.shape[1] <= batch.input_ids.shape[1]
    widths = [padded_rows(batch, i, i + 1)[0].input_ids.shape[1] for i in range(batch.input_ids.shape[0])]
    assert min(widths) < batch.input_ids.shape[1]  # a row alone is trimmed to its own padding
    assert cols.stop - cols.start == part.input_ids.shape[1]


@pytest.mark.parametrize("micro", [1, 3])
def test_the_kl_penalty_against_a_direct_computation(tiny_llama, micro: int) -> None:
    """``loss.kl_coef``: the loss gains kl_coef * the mean over policy tokens of exp(d) - d - 1,
    d = log ref - log pi, the reference being the run's first weights (a frozen copy); loss,
    ``kl_ref`` and gradient match a direct computation (fp32, 1e-6 / 1e-5), in one pass or
    accumulated over micro-batches."""
    from dataclasses import replace
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from inflight.trainer.config_files import config_from_dict
    from inflight.trainer.policy import Policy

    threads = torch.get_num_threads()
    cfg = config_from_dict({"model": {"path": str(tiny_llama)}, "rollout": {"group_size": 5, "groups_per_step": 3},
                            "loss": {"kl_coef": 0.1, "max_lag": 1}, "engine": {"max_model_len": 24},
                            "task": {"completion_tokens": 12},
                            "optim": {"micro_batch_tokens": 10_000 if micro == 1 else 30}})
    try:
        policy = Policy(cfg, Path(tiny_llama), None)
        with torch.no_grad():  # the policy has moved away from its first weights
            for p in policy.unwrapped.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
        groups = random_groups(torch.Generator().manual_seed(5), 3, 5)
        loss, metrics, _ = policy.accumulate(groups, version=2)
        got = {k: p.grad.clone() for k, p in policy.unwrapped.named_parameters()}
        policy.optimizer.zero_grad(set_to_none=True)
        batch = collate(groups, 0, normalize_std=True)
        logp, entropy = policy_logprobs(policy.model, batch, Sampling())
        reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
        with torch.no_grad():
            ref = policy_logprobs(reference, batch, Sampling())[0]
        real = batch.completion_mask > 0
        d = ref - logp
        kl = ((torch.exp(d) - d - 1) * real).sum() / real.sum()
        base, _ = compute_loss(logp, entropy, batch, version=2, cfg=replace(cfg.loss, kl_coef=0.0))
        (base + 0.1 * kl).backward()
        want = {k: p.grad.clone() for k, p in policy.unwrapped.named_parameters()}
    finally:
        torch.set_num_threads(threads)
    assert float(kl.detach()) > 1e-4  # the penalty is not vacuous
    assert loss == pytest.approx(float((base + 0.1 * kl).detach()), abs=1e-6) \
        and metrics["kl_ref"] == pytest.approx(float(kl.detach()), abs=1e-6)
    worst = max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-12)) for k in want)
    assert worst < 1e-5, worst
