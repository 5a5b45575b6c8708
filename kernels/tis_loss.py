"""The per-token policy-gradient loss with importance correction, fused: ratio, truncation
or masking, advantage weighting, the loss and its gradient in one pass over the tokens.

Per token t (all float32; ``m_t`` folds the completion, lag and correction masks of ``inflight.trainer.correction``):
    rho_t = exp(logp_t - mu_t)       token level (mu = behaviour log-prob), or
    rho_t = exp(l_t)                 when a log-ratio l_t is given (the sequence level passes
                                     l_t = log s_i, the sequence ratio of t's sample, detached)
    f_t = d ** lag_t                 lag-aware factor (d = lag_decay; d = 1: f_t = 1)
    none:             w_t = 1                             loss_t = -m_t w_t A_t logp_t / N
    reinforce (TIS):  w_t = min(rho_t, C f_t)             loss_t = -m_t w_t A_t logp_t / N
    icepop:           w_t = rho_t 1[lo <= rho_t <= hi f_t] loss_t = -m_t w_t A_t logp_t / N
    ppo:              loss_t = -m_t min(rho_t A_t, clip(rho_t, 1-eps_lo, 1+eps_hi f_t) A_t) / N
``w_t`` is a constant (stop-gradient) in none, reinforce and icepop, so d loss_t / d logp_t =
-m_t w_t A_t / N. In ppo the gradient flows through rho_t (d rho_t / d logp_t = rho_t, also
for a given l_t: GSPO-token's sg[s_i] pi_t / sg[pi_t]) and vanishes where the clip binds.

- ``tis_loss_reference``: plain torch with autograd (the spec);
- ``_tis_kernel``: Triton, one block of tokens per program, writes loss_t, w_t and the
  gradient factor, so the backward is a single multiply;
- ``tis_loss``: the autograd wrapper; Triton on CUDA, the reference elsewhere.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import torch
import triton
import triton.language as tl

from inflight.kernels import Impl

Objective = Literal["reinforce", "ppo", "icepop", "none"]
_OBJECTIVE_ID = {name: i for i, name in enumerate(get_args(Objective))}  # the kernel's OBJECTIVE


class _Consts(NamedTuple):
    """The constants of one call (see the module docstring and ``tis_loss``), bundled for the launch."""

    objective: Objective
    truncation: float
    clip_low: float
    clip_high: float
    icepop_low: float
    icepop_high: float
    lag_decay: float


def _objective_id(objective: str) -> int:
    if objective not in _OBJECTIVE_ID:
        raise ValueError(f"objective={objective!r} is not one of {', '.join(map(repr, _OBJECTIVE_ID))}")
    return _OBJECTIVE_ID[objective]


def lag_factor(lag: torch.Tensor, lag_decay: float) -> torch.Tensor:
    """f_t = d ** lag_t (d = ``lag_decay``), computed as exp(lag_t log d) in float32 exactly as the kernel does."""
    return torch.exp(lag.float() * math.log(lag_decay))


def tis_loss_reference(logp, mu, adv, mask, n_tokens: float, *, objective: Objective = "reinforce",
                       truncation: float = 2.0, clip_low: float = 0.2, clip_high: float = 0.28,
                       icepop_low: float = 0.5, icepop_high: float = 2.0, lag_decay: float = 1.0,
                       lag=None, log_ratio=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (scalar loss, per-token weight w_t, detached). All inputs (N,) float32; the
    arguments are ``tis_loss``'s."""
    if log_ratio is None:
        r = torch.exp(logp - mu)
    else:  # value exactly exp(l_t) (a factor exp(0) = 1), gradient d r / d logp = r (GSPO-token)
        r = torch.exp(log_ratio.detach()) * torch.exp(logp - logp.detach())
    c = _Consts(objective, truncation, clip_low, clip_high, icepop_low, icepop_high, lag_decay)
    per_token, weight = objective_terms(r, adv, logp, lag, **c._asdict())
    return (per_token * mask).sum() / n_tokens, weight


def objective_terms(rho: torch.Tensor, adv: torch.Tensor, logp: torch.Tensor, lag: torch.Tensor | None, *,
                    objective: Objective = "reinforce", truncation: float = 2.0, clip_low: float = 0.2,
                    clip_high: float = 0.28, icepop_low: float = 0.5, icepop_high: float = 2.0,
                    lag_decay: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss terms (before mask and 1/N) and weights of the objective, given the ratio
    ``rho`` the objective sees (its gradient path is the caller's) and each token's ``lag``
    (None: 0) for the lag factor f_t."""
    _objective_id(objective)
    f = lag_factor(lag, lag_decay) if lag is not None else torch.ones_like(logp)
    if objective == "ppo":
        clipped = torch.minimum(torch.clamp(rho, min=1 - clip_low), 1 + clip_high * f) * adv
        return -torch.minimum(rho * adv, clipped), rho.detach()
    rd = rho.detach()
    if objective == "reinforce":
        weight = torch.minimum(rd, truncation * f)
    elif objective == "icepop":
        weight = torch.where((rd >= icepop_low) & (rd <= icepop_high * f), rd, torch.zeros_like(rd))
    else:
        weight = torch.ones_like(rd)
    return -weight * adv * logp, weight


@triton.jit
def _tis_kernel(logp_ptr, mu_ptr, lr_ptr, lag_ptr, adv_ptr, mask_ptr, loss_ptr, w_ptr, dlogp_ptr, n, inv_n,
                trunc, clip_lo, clip_hi, ice_lo, ice_hi, log_decay, OBJECTIVE: tl.constexpr,
                GIVEN_RATIO: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    logp = tl.load(logp_ptr + offs, mask=valid, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=valid, other=0.0)
    m = tl.load(mask_ptr + offs, mask=valid, other=0.0) * inv_n
    if GIVEN_RATIO:  # sequence level: the ratio was reduced per sample outside
        r = tl.exp(tl.load(lr_ptr + offs, mask=valid, other=0.0))
    else:
        r = tl.exp(logp - tl.load(mu_ptr + offs, mask=valid, other=0.0))
    f = tl.exp(tl.load(lag_ptr + offs, mask=valid, other=0.0) * log_decay)
    if OBJECTIVE == 1:  # ppo
        unclipped = r * adv
        hi = 1.0 + clip_hi * f
        clipped = tl.minimum(tl.maximum(r, 1.0 - clip_lo), hi) * adv
        loss = -m * tl.minimum(unclipped, clipped)
        # d/dlogp of min(): the unclipped branch (or an inactive clip) carries r * A
        active = (unclipped <= clipped) | ((r >= 1.0 - clip_lo) & (r <= hi))
        dlogp = tl.where(active, -m * adv * r, 0.0)
        w = r
    else:
        if OBJECTIVE == 0:  # reinforce with truncated importance sampling
            w = tl.minimum(r, trunc * f)
        elif OBJECTIVE == 2:  # icepop
            w = tl.where((r >= ice_lo) & (r <= ice_hi * f), r, 0.0)
        else:  # none
            w = tl.full([BLOCK], 1.0, tl.float32)
        loss = -m * w * adv * logp
        dlogp = -m * w * adv
    tl.store(loss_ptr + offs, loss, mask=valid)
    tl.store(w_ptr + offs, w, mask=valid)
    tl.store(dlogp_ptr + offs, dlogp, mask=valid)


class _TISLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, mu, log_ratio, lag, adv, mask, n_tokens: float, c: _Consts):
        n = logp.numel()
        loss, w, dlogp = (torch.empty(n, dtype=torch.float32, device=logp.device) for _ in range(3))
        if n:
            block = 1024
            given = log_ratio is not None
            _tis_kernel[(triton.cdiv(n, block),)](
                logp, mu, log_ratio if given else mu, lag, adv, mask, loss, w, dlogp, n, 1.0 / n_tokens,
                c.truncation, c.clip_low, c.clip_high, c.icepop_low, c.icepop_high, math.log(c.lag_decay),
                OBJECTIVE=_objective_id(c.objective), GIVEN_RATIO=given, BLOCK=block,
            )
        ctx.save_for_backward(dlogp)
        ctx.mark_non_differentiable(w)
        return loss.sum(), w

    @staticmethod
    def backward(ctx, g_loss, g_w):
        (dlogp,) = ctx.saved_tensors
        return dlogp * g_loss, None, None, None, None, None, None, None


def tis_loss(logp, mu, adv, mask, n_tokens: float, *, objective: Objective = "reinforce", truncation: float = 2.0,
             clip_low: float = 0.2, clip_high: float = 0.28, icepop_low: float = 0.5, icepop_high: float = 2.0,
             lag_decay: float = 1.0, lag=None, log_ratio=None, impl: Impl = "auto"):
    """Scalar loss and per-token weights from flat (N,) float32 tensors; grad flows to ``logp``.

    ``objective`` and its constants are the module docstring's: ``truncation`` C (reinforce),
    ``clip_low``/``clip_high`` eps_lo/eps_hi (ppo), ``icepop_low``/``icepop_high`` lo/hi
    (icepop), ``lag_decay`` d; the caller validates their ranges (``inflight.trainer.config.ObjectiveConfig``),
    an unknown objective is refused here. ``lag`` (N,) is each token's lag for ``lag_decay``
    (None: 0); ``log_ratio`` (N,), if given, replaces logp - mu as the ratio's log (the sequence level)."""
    c = _Consts(objective, truncation, clip_low, clip_high, icepop_low, icepop_high, lag_decay)
    _objective_id(objective)
    tensors = [t for t in (logp, mu, adv, mask, lag, log_ratio) if t is not None]
    if not (all(t.shape == logp.shape for t in tensors) and logp.dim() == 1):
        raise ValueError(f"tis_loss wants equal (N,) tensors, got {[tuple(t.shape) for t in tensors]}")
    if not n_tokens > 0:
        raise ValueError(f"n_tokens={n_tokens} must be > 0")
    if impl not in get_args(Impl):
        raise ValueError(f"impl={impl!r} is not one of {', '.join(get_args(Impl))}")
    use_triton = impl == "triton" or (impl == "auto" and logp.device.type == "cuda")
    if not use_triton:  # torch and reference: the reference is plain torch
        return tis_loss_reference(logp, mu, adv, mask, n_tokens, lag=lag, log_ratio=log_ratio, **c._asdict())
    lag = torch.zeros_like(logp) if lag is None else lag
    args = [t.detach().float().contiguous() if t is not None else None for t in (mu, log_ratio, lag, adv, mask)]
    return _TISLoss.apply(logp.float().contiguous(), *args, float(n_tokens), c)
