"""Off-policy correction beyond the per-token weight: sequence ratios and masks.

Notation for a batch of B samples, T positions, trainer version V (float32, (B, T)):
    l_t   = log pi_theta(y_t) - mu_t,  r_t = exp(l_t)           (token log-ratio and ratio)
    lag_t = V - v_t                                             (v_t: the version that sampled t)
    real_t                                                      (1 on completion tokens, 0 on padding)

Masks, applied in this order, each on the tokens the previous ones kept:
    lag:      keep_t = real_t * 1[lag_t <= max_lag]
    veto:     drop sample i if any kept token has r_t < veto_threshold (a catastrophic token)
    Seq-MIS:  drop sample i if its ratio rho_i leaves [lo, hi], where over its kept tokens
              geometric: rho_i = exp(mean_t l_t)     product: rho_i = exp(sum_t l_t)
    M2PO:     over all kept tokens of the batch, q_t = l_t^2. While mean(q) over the kept tokens is
              > m2_threshold, drop the kept token of largest q (ties: lowest flat index first).

Sequence level (``loss.level = "sequence"``), over the final mask m_t:
    s_i = exp(sum_t m_t l_t / max(1, sum_t m_t))        (GSPO's geometric mean; padding excluded)
and the objective sees rho_t = s_i on every token of sample i, with the sample's lag lag_i = max_t m_t lag_t
for its lag-aware constants (so every token of a sample shares them, which keeps GSPO's gradient exact through
the per-token kernel). The masks stay torch; the per-token part runs in ``inflight.kernels.tis_loss``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.kernels.tis_loss import lag_factor, objective_terms
from inflight.trainer.loss_config import ObjectiveConfig


@dataclass
class Masks:
    """Float (B, T) masks, each a subset of the previous one."""

    real: torch.Tensor
    lag: torch.Tensor
    veto: torch.Tensor
    seq: torch.Tensor
    m2po: torch.Tensor

    @property
    def final(self) -> torch.Tensor:
        return self.m2po


def seq_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B,) log s_i = sum_t m_t l_t / max(1, sum_t m_t); differentiable in ``log_ratio``."""
    return (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def m2po_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """The M2PO mask (see the module docstring): ``mask`` minus the tokens of largest l^2."""
    flat_mask = mask.reshape(-1) > 0
    idx = flat_mask.nonzero().squeeze(-1)
    q = log_ratio.detach().reshape(-1)[idx].double() ** 2
    n = q.numel()
    if n == 0 or float(q.mean()) <= threshold:
        return mask.clone()
    qs, order = torch.sort(q, descending=True, stable=True)
    # mean of the rest after dropping the k largest, k = 0..n-1 (suffix sums: no cancellation)
    suffix = qs.flip(0).cumsum(0).flip(0)
    rest_mean = suffix / torch.arange(n, 0, -1, dtype=torch.float64, device=q.device)
    ok = (rest_mean <= threshold).nonzero()
    k = int(ok[0]) if ok.numel() else n
    keep = mask.clone().reshape(-1)
    keep[idx[order[:k]]] = 0
    return keep.reshape(mask.shape)


def correction_masks(log_ratio: torch.Tensor, real: torch.Tensor, lag: torch.Tensor, cfg) -> Masks:
    """The masks of the module docstring; ``cfg`` is a ``inflight.trainer.config.LossConfig``."""
    log_r = log_ratio.detach()
    real = real.float()
    keep_lag = real * (lag <= cfg.max_lag).float()
    keep_veto = keep_lag
    if cfg.veto:
        bad = ((torch.exp(log_r) < cfg.veto_threshold).float() * keep_lag).sum(-1) > 0
        keep_veto = keep_lag * (~bad).float()[:, None]
    keep_seq = keep_veto
    if cfg.seq_mask != "off":
        total = (log_r * keep_veto).sum(-1)
        log_rho = total / keep_veto.sum(-1).clamp(min=1) if cfg.seq_mask == "geometric" else total
        rho = torch.exp(log_rho.double())  # float64: a product ratio may leave float32's range
        inside = (rho >= cfg.seq_mask_low) & (rho <= cfg.seq_mask_high)
        keep_seq = keep_veto * inside.float()[:, None]
    keep_m2 = m2po_keep(log_r, keep_seq, cfg.m2_threshold) if cfg.m2_threshold > 0 else keep_seq
    return Masks(real=real, lag=keep_lag, veto=keep_veto, seq=keep_seq, m2po=keep_m2)


def sequence_inputs(log_ratio: torch.Tensor, mask: torch.Tensor, lag: torch.Tensor):
    """(B, T) per-token log s_i and lag_i for the kernel at the sequence level (detached)."""
    log_s = seq_log_ratio(log_ratio.detach(), mask)
    lag_i = (lag.float() * mask).amax(-1)  # lag >= 0 on kept tokens; 0 for an empty sample
    return log_s[:, None].expand_as(mask).contiguous(), lag_i[:, None].expand_as(mask).contiguous()


def correction_loss_reference(logp: torch.Tensor, mu: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                              lag: torch.Tensor, n_tokens: float, objective: ObjectiveConfig,
                              level: str) -> torch.Tensor:
    """The per-token loss of docs/training.md in plain (B, T) torch with honest autograd: at the
    sequence level the gradient flows through s_i's mean (no GSPO-token rewrite), so the
    kernel's per-token shortcut can be checked against it. ``adv`` is (B, T)."""
    log_r = logp - mu
    if level == "sequence":
        rho = torch.exp(seq_log_ratio(log_r, mask))[:, None].expand_as(log_r)
        lag = (lag.float() * mask).amax(-1, keepdim=True).expand_as(log_r)
    else:
        rho = torch.exp(log_r)
    per_token, _ = objective_terms(rho, adv, logp, lag, **objective.kernel_args())
    return (per_token * mask).sum() / n_tokens


def bounds(objective: ObjectiveConfig, lag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) per token: where the objective stops following the ratio (truncation, clip or
    band); low is 0 where there is none (reinforce, none) and high inf for none."""
    f = lag_factor(lag, objective.lag_decay)
    if objective.name == "reinforce":
        return torch.zeros_like(f), objective.truncation * f
    if objective.name == "ppo":
        return torch.full_like(f, 1 - objective.clip_low), 1 + objective.clip_high * f
    if objective.name == "icepop":
        return torch.full_like(f, objective.icepop_low), objective.icepop_high * f
    return torch.zeros_like(f), torch.full_like(f, float("inf"))
