"""Top-k and top-p mirrored in the trainer's log-probs (``inflight.trainer.sampling_filter``).

- the filters equal vLLM 0.32's own functions (``apply_top_k_top_p_pytorch``, and
  ``apply_top_k_only``, the CPU engine's top-k-only path) exactly, on awkward shapes, with
  ties at the top-k cut;
- a token the policy's filter drops leaves the loss exactly as a masked token does, with
  zero gradient and a count (``frac_masked_filter``);
- on a real engine, behaviour log-probs sampled under top-k and top-p equal the trainer's
  ``policy_logprobs`` within 1e-5 (``test_engine_inflight.py`` holds that engine).
"""

from __future__ import annotations

import pytest
import torch

from inflight.protocol import Sampling
from inflight.trainer.sampling_filter import filter_logits

# (top_k, top_p): top-k alone, top-p alone, both, the extremes (k=1; p small; k >= V)
FILTERS = [(5, 1.0), (1, 1.0), (0, 0.9), (20, 0.8), (1, 0.5), (0, 0.05), (40, 0.95), (100_000, 0.9)]


def _vllm_filtered(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's own filter on (N, V) float32 scaled logits, as its CPU sampler calls it."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only, apply_top_k_top_p_pytorch

    n, v = z.shape
    k = torch.full((n,), min(top_k, v), dtype=torch.long) if top_k else None
    p = torch.full((n,), top_p, dtype=torch.float32) if top_p < 1 else None
    if p is None:
        return apply_top_k_only(z.clone(), k)
    return apply_top_k_top_p_pytorch(z.clone(), k, p)


@pytest.mark.parametrize("top_k,top_p", FILTERS)
@pytest.mark.parametrize("shape", [(3, 7, 37), (2, 5, 769), (1, 3, 49152)], ids=lambda s: "x".join(map(str, s)))
def test_filters_equal_vllms(shape, top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(sum(shape) + top_k)
    logits = 3 * torch.randn(shape, generator=g)
    if top_p == 1:  # ties at the top-k cut (at a top-p cut, see the next test)
        logits[..., 0] = logits.max(-1).values + 1.0
        logits[..., 1:5] = logits[..., :1]
    sampling = Sampling(temperature=0.7, top_k=top_k, top_p=top_p)
    got = filter_logits(logits, sampling)
    want = _vllm_filtered(logits.reshape(-1, shape[-1]) / 0.7, top_k, top_p).view(shape)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got.log_softmax(-1), want.log_softmax(-1))
    if top_k == 1 and top_p == 1:  # the maximum, written 5 times: every tie at the k-th value is kept
        assert torch.all((~torch.isinf(got)).sum(-1) == 5)


def test_ties_at_the_top_p_cut_are_all_kept() -> None:
    """vLLM's sort (not stable) keeps some of the logits tied at the top-p cut; the trainer keeps
    them all: a superset, so a token vLLM could sample always has a log-prob here."""
    logits = torch.tensor([[2.0, 2.0, 2.0, 2.0, 2.0, -1.0, -3.0]])
    got = filter_logits(logits, Sampling(top_p=0.5))
    want = _vllm_filtered(logits, 0, 0.5)
    assert (~torch.isinf(got)).sum() == 5 and 1 <= (~torch.isinf(want)).sum() < 5
    assert torch.all(~torch.isinf(got)[~torch.isinf(want)])


def test_no_filter_is_the_temperature_alone_and_other_transforms_are_refused() -> None:
    logits = torch.randn(2, 3, 11)
    assert torch.equal(filter_logits(logits, Sampling(temperature=0.5)), logits / 0.5)
    with pytest.raises(ValueError, match="min_p=0.1"):
        filter_logits(logits, Sampling(min_p=0.1, top_k=3))


def test_filtered_logits_keep_the_gradient_of_the_kept_tokens() -> None:
    logits = torch.randn(4, 50, dtype=torch.float64).float().requires_grad_()
    out = filter_logits(logits, Sampling(temperature=0.9, top_k=10, top_p=0.8))
    out.log_softmax(-1).masked_fill(torch.isinf(out), 0.0).sum().backward()
    dropped = torch.isinf(out.detach())
    assert torch.all(logits.grad[dropped] == 0) and torch.all(logits.grad[~dropped] != 0)


def test_a_token_the_filter_drops_leaves_the_loss_like_a_masked_one() -> None:
    """Reference: the same tokens masked by lag instead (same N, same everything else)."""
    from inflight.trainer.loss import Batch, compute_loss
    from inflight.trainer.loss_config import LossConfig

    g = torch.Generator().manual_seed(3)
    b, t = 3, 6
    behaviour = -torch.rand(b, t, generator=g) - 0.1
    logp = (behaviour + 0.1 * torch.randn(b, t, generator=g)).clamp(max=0)
    dropped = torch.zeros(b, t, dtype=torch.bool)
    dropped[0, 2] = dropped[2, 0] = dropped[2, 5] = True
    ones = torch.ones(b, t)
    batch = Batch(torch.zeros(b, 2 + t, dtype=torch.long), torch.ones(b, 2 + t),
                  torch.zeros(b, 2 + t, dtype=torch.long),
                  torch.zeros(b, t, dtype=torch.long), ones, behaviour, torch.zeros(b, t, dtype=torch.long),
                  torch.tensor([1.0, 0.0, 0.5]), torch.tensor([1.0, -1.0, 0.3]))
    cfg = LossConfig(max_lag=4, kl_coef=0.1)
    filtered = logp.masked_fill(dropped, float("-inf")).requires_grad_()
    loss, metrics = compute_loss(filtered, torch.zeros(b, t), batch, version=0, cfg=cfg, impl="torch",
                                 ref_logp=behaviour - 0.05)
    loss.backward()
    lagged = Batch(*[getattr(batch, f) for f in Batch.__dataclass_fields__][:6], torch.where(dropped, -9, 0),
                   batch.rewards, batch.advantages)
    masked = logp.clone().requires_grad_()
    want, want_metrics = compute_loss(masked, torch.zeros(b, t), lagged, version=0, cfg=cfg, impl="torch")
    want.backward()
    d = behaviour - 0.05 - logp  # the KL term (k3) over the tokens the filter kept, by hand
    kl = float(((torch.exp(d) - d - 1) * ~dropped).sum()) / (b * t)
    assert metrics["kl_ref"] == pytest.approx(kl, abs=1e-7)
    torch.testing.assert_close(float(loss.detach()), float(want.detach()) + cfg.kl_coef * kl, atol=1e-7, rtol=0)
    assert torch.all(filtered.grad[dropped] == 0) and torch.isfinite(filtered.grad).all()
    kl_grad = cfg.kl_coef * (1 - torch.exp(d)) / (b * t)
    torch.testing.assert_close(filtered.grad[~dropped], (masked.grad + kl_grad)[~dropped], atol=1e-7, rtol=0)
    assert metrics["frac_masked_filter"] == 3 / (b * t) and metrics["frac_masked_lag"] == 0.0
    assert metrics["tokens_in_loss"] == want_metrics["tokens_in_loss"] == b * t - 3
