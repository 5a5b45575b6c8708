"""Kernel parity against the pure-torch references, on awkward shapes.

On CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (set in conftest); the same
tests run compiled on CUDA under the ``gpu`` marker.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from inflight.kernels.logprob_entropy import logprob_entropy, logprob_entropy_reference
from inflight.kernels.tis_loss import tis_loss

# (B, T, V): vocabularies that are not powers of two (37, 769) or are GPT-2's (50257), odd T
SHAPES = [(2, 7, 37), (3, 5, 769), (2, 3, 50257), (2, 3, 151936)]
"""(batch, tokens, vocabulary): under one block, several, GPT-2's vocabulary and Qwen's (149
blocks; its cancellation check: ``test_entropy_is_summed_relative_to_the_max``)."""
EPS32 = torch.finfo(torch.float32).eps


def _logits(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    z = (3 * torch.randn(shape, generator=g)).to(dtype).to(device)
    z[..., 1] += 20.0  # one dominant logit per row: the online max must rescale
    y = torch.randint(0, shape[-1], shape[:-1], generator=g).to(device)
    a, b = torch.randn(shape[:-1], generator=g).to(device), torch.randn(shape[:-1], generator=g).to(device)
    return z, y, a, b


def _check_logprob_entropy(impl: str, shape, dtype, device) -> None:
    """Against the reference evaluated in float64 on the same (rounded) logits: the truth.

    Outputs are float32 sums over V of terms of size |z|, so they may be off by a few float32
    ulps of max|z|; each gradient carries that error of logp and H times an upstream weight
    of order one, and is then stored in the logits' dtype.
    """
    z, y, a, b = _logits(shape, dtype, device, seed=sum(shape))
    z64 = z.double().requires_grad_()
    lp64, ent64 = logprob_entropy_reference(z64, y)
    (a.double() * lp64 + b.double() * ent64).sum().backward()
    z_new = z.clone().requires_grad_()
    lp, ent = logprob_entropy(z_new, y, impl=impl)
    (a * lp + b * ent).sum().backward()
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == shape[:-1] and z_new.grad.dtype == dtype
    atol = 16 * EPS32 * float(z.abs().max())
    torch.testing.assert_close(lp.double(), lp64.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(ent.double(), ent64.detach(), atol=atol, rtol=0)
    want = z64.grad.to(dtype)  # the truth, rounded once to the storage dtype
    if dtype == torch.float32:
        torch.testing.assert_close(z_new.grad, want, atol=4 * atol, rtol=0)
    else:  # at most one bf16 rounding step away
        torch.testing.assert_close(z_new.grad.float(), want.float(), atol=1e-6, rtol=2 ** -7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_logprob_entropy_parity(impl: str, shape, dtype) -> None:
    _check_logprob_entropy(impl, shape, dtype, "cpu")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_entropy_is_summed_relative_to_the_max(impl: str) -> None:
    """Logits 1000 above zero over Qwen's 151936 tokens: the entropy and log-probs stay within a
    few float32 ulps of the logits' spread below their max, as for unshifted logits. A sum of
    exp(z - m) z (the form both implementations once had) cancels 1000 against 1000 and misses
    the entropy by 5.9e-4 (Triton) and 2.8e-2 (torch)."""
    z, y, _, _ = _logits((2, 3, 151936), torch.float32, "cpu", seed=7)
    z = z + 1000.0
    lp, ent = logprob_entropy(z, y, impl=impl)
    lp64, ent64 = logprob_entropy_reference(z.double(), y)
    atol = 16 * EPS32 * float((z - z.amax(-1, keepdim=True)).abs().max())
    torch.testing.assert_close(ent.double(), ent64, atol=atol, rtol=0)
    torch.testing.assert_close(lp.double(), lp64, atol=atol, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES + [(4, 1023, 151936)], ids=lambda s: "x".join(map(str, s)))  # and many rows
def test_logprob_entropy_parity_cuda(shape, dtype) -> None:
    _check_logprob_entropy("triton", shape, dtype, "cuda")


@pytest.mark.parametrize("impl,device", [("triton", "cpu"), ("torch", "cpu"), ("reference", "cpu"),
                                         pytest.param("triton", "cuda", marks=pytest.mark.gpu)])
def test_logprob_entropy_of_filtered_logits(impl: str, device: str) -> None:
    """-inf logits (tokens a top-k/top-p filter dropped, ``inflight.trainer.sampling_filter``): p = 0, no
    term in H or in any gradient, whole 1024-wide blocks of them first in a row (the online
    max starts at -inf); a target among them has logp = -inf, and its upstream gradient is
    0 (``compute_loss`` takes it out of the loss)."""
    g = torch.Generator().manual_seed(5)
    n, v = 6, 3000
    z = 3 * torch.randn(n, v, generator=g)
    drop = torch.rand(n, v, generator=g) < 0.7
    drop[:, :2048] = True
    drop[torch.arange(n), 2048 + torch.randint(0, v - 2048, (n,), generator=g)] = False  # one kept token at least
    z = z.masked_fill(drop, float("-inf"))
    y = torch.where(torch.arange(n) % 3 == 0, drop.float().argmax(-1), (~drop).float().argmax(-1))  # rows 0, 3: dropped
    a, b = torch.randn(n, generator=g).masked_fill(drop[torch.arange(n), y], 0.0), torch.randn(n, generator=g)
    kept = [z[i][~drop[i]].double() for i in range(n)]  # the truth: the distribution over the kept tokens alone
    lse = torch.stack([k.logsumexp(0) for k in kept])
    want_ent = torch.stack([lse[i] - (k.softmax(0) * k).sum() for i, k in enumerate(kept)])
    zz = z.clone().to(device).requires_grad_()
    lp, ent = logprob_entropy(zz, y.to(device), impl=impl)
    (a.to(device) * lp.masked_fill(torch.isinf(lp), 0.0) + b.to(device) * ent).sum().backward()
    lp, ent, zz = lp.cpu(), ent.cpu(), zz.grad.cpu()
    assert torch.equal(torch.isinf(lp), drop[torch.arange(n), y])
    live = ~torch.isinf(lp)
    torch.testing.assert_close(lp[live].double(), (z[live, y[live]].double() - lse[live]), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), want_ent, atol=1e-5, rtol=0)
    assert torch.isfinite(zz).all() and torch.all(zz[drop] == 0)
    z64 = z.double().requires_grad_()
    lp64, ent64 = logprob_entropy_reference(z64, y)
    (a.double() * lp64.masked_fill(torch.isinf(lp64), 0.0) + b.double() * ent64).sum().backward()
    torch.testing.assert_close(zz.double(), z64.grad, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("bad", [-100, 37])
def test_targets_outside_the_vocabulary_are_refused(impl: str, bad: int) -> None:
    """The reference's gather raises on such a target; the kernels would read out of bounds."""
    z, y, _, _ = _logits((2, 3, 37), torch.float32, "cpu", 1)
    y[1, 2] = bad
    with pytest.raises(RuntimeError, match=rf"index {bad} is out of bounds for dimension 2 with size 37"):
        logprob_entropy_reference(z, y)
    with pytest.raises(ValueError, match=r"outside the vocabulary 0..36"):
        logprob_entropy(z, y, impl=impl)


def test_only_gradients_that_flow_are_used() -> None:
    z, y, _, _ = _logits((2, 3, 37), torch.float32, "cpu", 0)
    for impl in ("triton", "torch"):
        zz = z.clone().requires_grad_()
        lp, _ = logprob_entropy(zz, y, impl=impl)
        lp.sum().backward()  # entropy unused: its upstream gradient is None
        zr = z.clone().requires_grad_()
        logprob_entropy_reference(zr, y)[0].sum().backward()
        torch.testing.assert_close(zz.grad, zr.grad, atol=1e-6, rtol=1e-6)


OBJECTIVES = ["reinforce", "ppo", "icepop", "none"]


def _off_the_cuts(log_r: torch.Tensor, lag: torch.Tensor, lag_decay: float) -> torch.Tensor:
    """How far to move each log-ratio so it lies at least 1e-5 from every cut of every
    objective at ``tis_loss``'s default constants (reinforce's truncation C, ppo's 1 - eps_lo
    and 1 + eps_hi f, icepop's lo and hi f; f = d ** lag): a ratio within an ulp of a cut may
    fall on either side in two correct float32 implementations (the kernel's exp is not torch's)."""
    c = {k: v.default for k, v in inspect.signature(tis_loss).parameters.items()}
    log_f = lag.double() * math.log(lag_decay)
    cuts = [torch.full_like(log_f, math.log(1 - c["clip_low"])), math.log(c["truncation"]) + log_f,
            math.log(c["icepop_low"]), math.log(c["icepop_high"]) + log_f, torch.log1p(c["clip_high"] * log_f.exp())]
    shift = torch.zeros_like(log_f)
    for cut in cuts:
        near = (log_r.double() + shift - cut).abs() < 1e-5
        shift = torch.where(near, shift + 3e-5, shift)
    return shift.float()


def _check_tis(objective: str, device: str, n: int = 1001, lag_decay: float = 1.0, given_ratio: bool = False) -> None:
    g = torch.Generator().manual_seed(n)
    logp0 = 0.5 * torch.randn(n, generator=g) - 2
    mu = logp0 + 0.8 * torch.randn(n, generator=g)  # ratios spread across every branch
    adv = torch.randn(n, generator=g).to(device)
    mask = (torch.rand(n, generator=g) > 0.2).float().to(device)
    lag = torch.randint(0, 9, (n,), generator=g).float()
    log_ratio = None
    if given_ratio:  # a given log-ratio (the sequence level's log s_i), shared by runs of 1-6 tokens
        log_ratio = (0.6 * torch.randn(n, generator=g)).repeat_interleave(6)[:n]
        log_ratio = (log_ratio + _off_the_cuts(log_ratio, lag, lag_decay)).to(device)
    else:
        mu = mu - _off_the_cuts(logp0 - mu, lag, lag_decay)
    logp0, mu, lag = logp0.to(device), mu.to(device), lag.to(device)
    out = {}
    for impl in ("reference", "triton"):
        lp = logp0.clone().requires_grad_()
        loss, w = tis_loss(lp, mu, adv, mask, 777.0, lag_decay=lag_decay, lag=lag, log_ratio=log_ratio,
                           objective=objective, impl=impl)  # type: ignore[arg-type]
        loss.backward()
        out[impl] = (loss.detach(), w, lp.grad)
    for ref, new in zip(out["reference"], out["triton"]):
        torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("given_ratio", [False, True], ids=["token", "given_ratio"])
@pytest.mark.parametrize("lag_decay", [1.0, 0.7])
@pytest.mark.parametrize("n", [1, 1001, 2049])  # under one block, a partial block, a block and one
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_tis_loss_parity(objective: str, n: int, lag_decay: float, given_ratio: bool) -> None:
    _check_tis(objective, "cpu", n, lag_decay, given_ratio)


@pytest.mark.gpu
@pytest.mark.parametrize("given_ratio", [False, True], ids=["token", "given_ratio"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_tis_loss_parity_cuda(objective: str, given_ratio: bool) -> None:
    _check_tis(objective, "cuda", n=1 << 20, lag_decay=0.8, given_ratio=given_ratio)


def _check_compute_loss(objective: str, level: str, lag_decay: float, device: str, b: int = 5, t: int = 13) -> None:
    """The whole trainer loss through the kernel (masks, sequence reduction, GSPO-token
    gradient) against ``correction_loss_reference``'s honest autograd, on a ragged batch of
    mixed versions; every mask is on."""
    from inflight.trainer.correction import correction_loss_reference, correction_masks
    from inflight.trainer.loss import Batch, compute_loss
    from inflight.trainer.loss_config import LossConfig, ObjectiveConfig

    g = torch.Generator().manual_seed(b * t)
    lengths = torch.tensor([t, 1, 7, t - 1, 4] * (b // 5 + 1))[:b]
    real = (torch.arange(t)[None] < lengths[:, None]).float()
    logp0 = -torch.rand(b, t, generator=g) * 3
    mu = logp0 + 0.4 * torch.randn(b, t, generator=g)
    versions = 9 - torch.randint(0, 7, (b, t), generator=g)
    batch = Batch(input_ids=torch.zeros(b, t + 1, dtype=torch.long),
                  attention_mask=torch.ones(b, t + 1, dtype=torch.long),
                  position_ids=torch.zeros(b, t + 1, dtype=torch.long),
                  completion_ids=torch.zeros(b, t, dtype=torch.long),
                  completion_mask=real, behaviour_logp=mu, versions=versions, rewards=torch.zeros(b),
                  advantages=torch.randn(b, generator=g))
    obj = ObjectiveConfig(name=objective, lag_decay=lag_decay, clip_low=0.1, clip_high=0.1, truncation=1.2)  # type: ignore[arg-type]
    cfg = LossConfig(level=level, max_lag=5, veto=True, veto_threshold=0.3, seq_mask="geometric", seq_mask_low=0.6,
                     seq_mask_high=1.6, m2_threshold=0.1, objective=obj)
    batch = batch.to(torch.device(device))
    lp = logp0.to(device).requires_grad_()
    loss, m = compute_loss(lp, torch.zeros_like(lp), batch, version=9, cfg=cfg, impl="triton")
    loss.backward()
    assert 0 < m["tokens_in_loss"] < int(real.sum())  # the masks did something, and left something
    # the reference, given the same final mask (the masks are checked by hand in test_correction)
    mask = correction_masks(lp.detach() - batch.behaviour_logp, batch.completion_mask > 0, 9 - batch.versions,
                            cfg).final
    lr = lp.detach().clone().requires_grad_()
    ref = correction_loss_reference(lr, batch.behaviour_logp, batch.advantages[:, None].expand_as(lr), mask,
                                    9 - batch.versions, float(real.sum()), cfg.objective, level)
    ref.backward()
    torch.testing.assert_close(loss.detach(), ref.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lp.grad, lr.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("lag_decay", [1.0, 0.7])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_compute_loss_parity(objective: str, level: str, lag_decay: float) -> None:
    _check_compute_loss(objective, level, lag_decay, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_compute_loss_parity_cuda(objective: str, level: str) -> None:
    _check_compute_loss(objective, level, 0.7, "cuda", b=64, t=1023)
