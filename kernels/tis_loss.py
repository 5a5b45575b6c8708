"""The per-token policy-gradient loss with importance correction, fused: ratio, truncation
or masking, advantage weighting, the loss and its gradient in one pass over the tokens.

Per token t (all float32; ``m_t`` already folds the completion mask and the lag mask):
    r_t = exp(logp_t - mu_t)                       (pi_theta / mu, mu = behaviour log-prob)
    reinforce (TIS):  w_t = min(r_t, C)            loss_t = -m_t w_t A_t logp_t / N
    icepop:           w_t = r_t 1[lo <= r_t <= hi]  loss_t = -m_t w_t A_t logp_t / N
    ppo:              loss_t = -m_t min(r_t A_t, clip(r_t, 1-eps_lo, 1+eps_hi) A_t) / N
``w_t`` is a constant (stop-gradient) in reinforce and icepop, so d loss_t / d logp_t =
-m_t w_t A_t / N; in ppo the gradient flows through r_t and vanishes where the clip binds.

- ``tis_loss_reference``: plain torch with autograd (the spec);
- ``_tis_kernel``: Triton, one block of tokens per program, writes loss_t, w_t and the
  gradient factor, so the backward is a single multiply;
- ``tis_loss``: the autograd wrapper; Triton on CUDA, the reference elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

Objective = Literal["reinforce", "ppo", "icepop"]
_OBJECTIVE_ID = {"reinforce": 0, "ppo": 1, "icepop": 2}


@dataclass(frozen=True, kw_only=True)
class TISParams:
    """Constants of the loss (see the module docstring)."""

    objective: Objective = "reinforce"
    """reinforce (truncated IS, default), ppo (clipped ratio) or icepop (mask outside [lo, hi])."""
    truncation: float = 2.0
    """C in min(r, C) for reinforce."""
    clip_low: float = 0.2
    """eps_lo for ppo."""
    clip_high: float = 0.28
    """eps_hi for ppo (asymmetric, as in DAPO)."""
    icepop_low: float = 0.5
    """lo for icepop."""
    icepop_high: float = 2.0
    """hi for icepop."""

    def __post_init__(self) -> None:
        if self.objective not in _OBJECTIVE_ID:
            raise ValueError(f"TISParams.objective={self.objective!r} is not reinforce, ppo or icepop")
        if not self.truncation > 0:
            raise ValueError(f"TISParams.truncation={self.truncation} must be > 0")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"TISParams clip=({self.clip_low}, {self.clip_high}) needs 0 <= low < 1, high >= 0")
        if not 0 <= self.icepop_low < self.icepop_high:
            raise ValueError(f"TISParams icepop=({self.icepop_low}, {self.icepop_high}) needs 0 <= low < high")


def tis_loss_reference(logp, mu, adv, mask, n_tokens: float, p: TISParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (scalar loss, per-token weight w_t, detached). All inputs (N,) float32."""
    log_ratio = logp - mu
    r = torch.exp(log_ratio)
    if p.objective == "ppo":
        unclipped = r * adv
        clipped = torch.clamp(r, 1 - p.clip_low, 1 + p.clip_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        weight = r.detach()
    else:
        rd = r.detach()
        if p.objective == "reinforce":
            weight = torch.clamp(rd, max=p.truncation)
        else:
            weight = torch.where((rd >= p.icepop_low) & (rd <= p.icepop_high), rd, torch.zeros_like(rd))
        per_token = -weight * adv * logp
    return (per_token * mask).sum() / n_tokens, weight


@triton.jit
def _tis_kernel(logp_ptr, mu_ptr, adv_ptr, mask_ptr, loss_ptr, w_ptr, dlogp_ptr, n, inv_n,
                trunc, clip_lo, clip_hi, ice_lo, ice_hi, OBJECTIVE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    logp = tl.load(logp_ptr + offs, mask=valid, other=0.0)
    mu = tl.load(mu_ptr + offs, mask=valid, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=valid, other=0.0)
    m = tl.load(mask_ptr + offs, mask=valid, other=0.0) * inv_n
    r = tl.exp(logp - mu)
    if OBJECTIVE == 1:  # ppo
        unclipped = r * adv
        clipped = tl.minimum(tl.maximum(r, 1.0 - clip_lo), 1.0 + clip_hi) * adv
        loss = -m * tl.minimum(unclipped, clipped)
        # d/dlogp of min(): the unclipped branch (or an inactive clip) carries r * A
        active = (unclipped <= clipped) | ((r >= 1.0 - clip_lo) & (r <= 1.0 + clip_hi))
        dlogp = tl.where(active, -m * adv * r, 0.0)
        w = r
    else:
        if OBJECTIVE == 0:  # reinforce with truncated importance sampling
            w = tl.minimum(r, trunc)
        else:  # icepop
            w = tl.where((r >= ice_lo) & (r <= ice_hi), r, 0.0)
        loss = -m * w * adv * logp
        dlogp = -m * w * adv
    tl.store(loss_ptr + offs, loss, mask=valid)
    tl.store(w_ptr + offs, w, mask=valid)
    tl.store(dlogp_ptr + offs, dlogp, mask=valid)


class _TISLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, mu, adv, mask, n_tokens: float, p: TISParams):
        n = logp.numel()
        loss, w, dlogp = (torch.empty(n, dtype=torch.float32, device=logp.device) for _ in range(3))
        if n:
            block = 1024
            _tis_kernel[(triton.cdiv(n, block),)](
                logp, mu, adv, mask, loss, w, dlogp, n, 1.0 / n_tokens, p.truncation, p.clip_low, p.clip_high,
                p.icepop_low, p.icepop_high, OBJECTIVE=_OBJECTIVE_ID[p.objective], BLOCK=block,
            )
        ctx.save_for_backward(dlogp)
        ctx.mark_non_differentiable(w)
        return loss.sum(), w

    @staticmethod
    def backward(ctx, g_loss, g_w):
        (dlogp,) = ctx.saved_tensors
        return dlogp * g_loss, None, None, None, None, None


def tis_loss(logp, mu, adv, mask, n_tokens: float, p: TISParams, *, impl: Literal["auto", "triton", "reference"] = "auto"):
    """Scalar loss and per-token weights from flat (N,) float32 tensors; grad flows to ``logp``."""
    if not (logp.shape == mu.shape == adv.shape == mask.shape and logp.dim() == 1):
        raise ValueError(f"tis_loss wants equal (N,) tensors, got {[tuple(t.shape) for t in (logp, mu, adv, mask)]}")
    if not n_tokens > 0:
        raise ValueError(f"n_tokens={n_tokens} must be > 0")
    use_triton = impl == "triton" or (impl == "auto" and logp.device.type == "cuda")
    if not use_triton:
        return tis_loss_reference(logp, mu, adv, mask, n_tokens, p)
    args = [t.float().contiguous() for t in (logp, mu, adv, mask)]
    return _TISLoss.apply(*args, float(n_tokens), p)
