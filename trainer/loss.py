"""From rollout groups to a loss: collate, GRPO advantages, per-token importance weights.

For completion token t of sample i, sampled by policy version v_t with behaviour
log-prob mu_t, at trainer version V:
    lag_t = V - v_t,  m_t = 1[real] * 1[lag_t <= max_lag] * (veto, Seq-MIS, M2PO masks:
                                                           see inflight.trainer.correction)
    r_t = pi_theta(y_t) / mu(y_t),  w_t = min(r_t, C)     (reinforce; see inflight.kernels.tis_loss)
    loss = -(1/N) sum_t m_t w_t A_i log pi_theta(y_t),   N = number of real tokens
N counts masked tokens too, so masking removes their signal instead of re-weighting the
rest. At loss.level = "sequence" the objective sees s_i, its sample's geometric-mean ratio,
instead of r_t. pi_theta is scored under the engine's sampling filters (temperature,
top-k, top-p: inflight.trainer.sampling_filter), like mu; a token they now drop has r_t = 0 and
leaves the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inflight.kernels.logprob_entropy import logprob_entropy
from inflight.kernels.tis_loss import tis_loss
from inflight.protocol import RolloutGroup, Sampling
from inflight.trainer.correction import Masks, bounds, correction_masks, seq_log_ratio, sequence_inputs
from inflight.trainer.loss_config import LossConfig
from inflight.trainer.metrics import by_lag, correction_stats
from inflight.trainer.sampling_filter import filter_logits

RATIO_BINS = (0.0, 0.5, 0.8, 0.95, 1.05, 1.25, 2.0, float("inf"))


@dataclass
class Batch:
    """Left-padded prompts followed by right-padded completions, so every completion starts at column P."""

    input_ids: torch.Tensor  # (B, P+T)
    attention_mask: torch.Tensor  # (B, P+T)
    position_ids: torch.Tensor  # (B, P+T)
    completion_ids: torch.Tensor  # (B, T)
    completion_mask: torch.Tensor  # (B, T) float
    behaviour_logp: torch.Tensor  # (B, T) float32
    versions: torch.Tensor  # (B, T) int64
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)

    def to(self, device: torch.device) -> Batch:
        return Batch(**{k: v.to(device) for k, v in self.__dict__.items()})


def grpo_advantages(rewards: torch.Tensor, normalize_std: bool, eps: float = 1e-6) -> torch.Tensor:
    """(G, S) rewards -> (G, S) advantages: centred per group, optionally divided by its std."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return centred


def collate(groups: Sequence[RolloutGroup], pad_id: int, normalize_std: bool) -> Batch:
    samples = [s for g in groups for s in g.samples]
    if len({len(g.samples) for g in groups}) != 1:
        raise ValueError("all groups of a batch must have the same size")
    rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)  # (G, S)
    advantages = grpo_advantages(rewards, normalize_std).reshape(-1)
    p_len = max(len(s.prompt_ids) for s in samples)
    t_len = max(len(s.token_ids) for s in samples)
    b = len(samples)
    input_ids = torch.full((b, p_len + t_len), pad_id, dtype=torch.long)
    attention = torch.zeros((b, p_len + t_len), dtype=torch.long)
    completion_mask = torch.zeros((b, t_len))
    behaviour = torch.zeros((b, t_len))
    versions = torch.zeros((b, t_len), dtype=torch.long)
    for i, s in enumerate(samples):
        p, t = len(s.prompt_ids), len(s.token_ids)
        input_ids[i, p_len - p: p_len] = torch.tensor(s.prompt_ids)
        input_ids[i, p_len: p_len + t] = torch.tensor(s.token_ids)
        attention[i, p_len - p: p_len + t] = 1
        completion_mask[i, :t] = 1 if not s.observation else 1.0 - torch.tensor(s.observation, dtype=torch.float32)
        behaviour[i, :t] = torch.tensor(s.logprobs)
        versions[i, :t] = torch.tensor(s.versions)
        versions[i, t:] = s.versions[-1]
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)  # the engine numbered each prompt from 0
    return Batch(input_ids, attention, position_ids, input_ids[:, p_len:], completion_mask, behaviour, versions,
                 rewards.reshape(-1), advantages)


def padded_rows(batch: Batch, start: int, stop: int, *, inputs: bool = True) -> tuple[Batch, slice]:
    """Rows ``start..stop`` of ``batch`` trimmed to their own padding, and the columns of
    ``batch``'s inputs they keep: their completion columns are the first
    ``completion_ids.shape[1]`` of ``batch``'s. ``inputs=False``: their per-token targets only,
    the padded inputs left empty (a packed layout feeds the model instead)."""
    p_len = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
    rows = slice(start, stop)
    att = batch.attention_mask[rows]
    p, t = int(att[:, :p_len].sum(-1).max()), max(1, int(att[:, p_len:].sum(-1).max()))
    cols = slice(p_len - p, p_len + t) if inputs else slice(0, 0)
    return Batch(batch.input_ids[rows, cols], att[:, cols], batch.position_ids[rows, cols],
                 batch.completion_ids[rows, :t], batch.completion_mask[rows, :t], batch.behaviour_logp[rows, :t],
                 batch.versions[rows, :t], batch.rewards[rows], batch.advantages[rows]), cols


def policy_logprobs(model: torch.nn.Module, batch: Batch, sampling: Sampling, impl: str = "auto"):
    """(B, T) log-probs and entropies of the completion tokens under the current policy, as the
    engine samples it (temperature, top-k, top-p: ``inflight.trainer.sampling_filter``); -inf where the
    policy's filter drops the token."""
    t_len = batch.completion_ids.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                logits_to_keep=t_len + 1, use_cache=False)
    logits = filter_logits(out.logits[:, :t_len], sampling)  # (B, T, V): positions P-1 .. P+T-2 predict the completion
    return logprob_entropy(logits, batch.completion_ids, impl=impl)  # type: ignore[arg-type]


def _histogram(values: torch.Tensor, edges: Sequence[float]) -> list[int]:
    return [int(((values >= lo) & (values < hi)).sum()) for lo, hi in zip(edges, edges[1:])]


def compute_loss(logp: torch.Tensor, entropy: torch.Tensor, batch: Batch, *, version: int, cfg: LossConfig,
                 impl: str = "auto", n_tokens: float | None = None, ref_logp: torch.Tensor | None = None,
                 with_metrics: bool = True) -> tuple[torch.Tensor, dict]:
    """The scalar loss and the step's importance-sampling metrics (formulas: module docstrings
    of ``inflight.trainer.correction`` and ``inflight.kernels.tis_loss``). ``n_tokens``: N of the loss, when
    ``batch`` is a micro-batch of a larger one (default: ``batch``'s real tokens);
    ``ref_logp``: the reference policy's log-probs, for ``loss.kl_coef``'s penalty."""
    real = batch.completion_mask > 0
    lag = version - batch.versions  # (B, T)
    if n_tokens is None:
        n_tokens = float(real.sum().clamp(min=1))
    # a token the policy's top-k/top-p drops has ratio 0: out of the loss (a finite stand-in keeps 0 * inf out)
    filtered = real & torch.isneginf(logp.detach())
    scored = real & ~filtered
    logp = torch.where(scored, logp, batch.behaviour_logp)  # and padding, whose pad token a filter may drop too
    log_ratio = logp.detach() - batch.behaviour_logp
    masks = correction_masks(log_ratio, scored, lag, cfg)
    mask = masks.final
    adv = batch.advantages[:, None].expand_as(logp)
    if cfg.level == "sequence":
        seq_lr, obj_lag = sequence_inputs(log_ratio, mask, lag)
        rho = torch.exp(seq_lr)
    else:
        seq_lr, obj_lag, rho = None, lag.float(), torch.exp(log_ratio)
    loss, weight = tis_loss(logp.reshape(-1), batch.behaviour_logp.reshape(-1), adv.reshape(-1).contiguous(),
                            mask.reshape(-1), n_tokens, lag=obj_lag.reshape(-1),
                            log_ratio=None if seq_lr is None else seq_lr.reshape(-1), impl=impl,  # type: ignore[arg-type]
                            **cfg.objective.kernel_args())
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * (entropy * real).sum() / n_tokens
    kl = None
    if ref_logp is not None:  # k3: exp(d) - d - 1 >= 0, d = log ref - log pi, per policy token
        d = ref_logp - logp
        kl = ((torch.exp(d) - d - 1) * scored).sum() / n_tokens
        loss = loss + cfg.kl_coef * kl
    if not with_metrics:
        return loss, {}
    with torch.no_grad():
        metrics = _step_metrics(log_ratio, weight.reshape(logp.shape), rho, obj_lag, masks, batch, lag, entropy,
                                filtered=filtered, scored=scored, n_tokens=n_tokens, cfg=cfg)
    if kl is not None:
        metrics["kl_ref"] = float(kl.detach())
    return loss, metrics


def _step_metrics(log_ratio: torch.Tensor, w: torch.Tensor, rho: torch.Tensor, obj_lag: torch.Tensor, masks: Masks,
                  batch: Batch, lag: torch.Tensor, entropy: torch.Tensor, *, filtered: torch.Tensor,
                  scored: torch.Tensor, n_tokens: float, cfg: LossConfig) -> dict:
    """The step's importance-sampling metrics (``compute_loss``'s second result): ``w`` the
    objective's per-token weight, ``rho`` the ratio it bounds, ``masks`` ``correction_masks``'."""
    real = batch.completion_mask > 0
    mask = masks.final
    low, high = bounds(cfg.objective, obj_lag)
    stats = correction_stats(log_ratio, w, rho, low, high, cand=masks.lag, final=mask, real=masks.real,
                             seq_sel=real.any(-1), seq_cand=masks.lag, seq_final=mask, seq_real=masks.real,
                             catastrophic=cfg.veto_threshold)
    used = masks.lag > 0
    lags = lag[real]
    n_seq = max(1, int(real.any(-1).sum()))
    metrics = {
        **stats,
        "tokens_in_loss": int(mask.sum()),
        "frac_masked_filter": float(filtered.sum()) / n_tokens,
        "frac_masked_lag": float(scored.sum() - masks.lag.sum()) / n_tokens,
        "frac_masked_veto": float((masks.lag - masks.veto).sum()) / n_tokens,
        "frac_masked_seq": float((masks.veto - masks.seq).sum()) / n_tokens,
        "frac_masked_m2po": float((masks.seq - masks.m2po).sum()) / n_tokens,
        "frac_seq_vetoed": float(((masks.lag.sum(-1) > 0) & (masks.veto.sum(-1) == 0)).sum()) / n_seq,
        "frac_truncated": stats["frac_truncated_high"] + stats["frac_truncated_low"],
        "ratio_hist": _histogram(torch.exp(log_ratio)[used], RATIO_BINS),
        "seq_ratio_mean": float(torch.exp(seq_log_ratio(log_ratio, masks.lag))[masks.lag.sum(-1) > 0].mean())
        if float(masks.lag.sum()) else 1.0,
        "by_lag": by_lag(log_ratio, w, rho, low, high, mask, masks.real, lag, cfg.veto_threshold),
        "entropy": float((entropy.detach() * real).sum() / n_tokens),
        "lag_hist": {int(k): int(v) for k, v in zip(*torch.unique(lags, return_counts=True))},
        "lag_mean": float(lags.float().mean()) if lags.numel() else 0.0,
        "frac_multi_version": float(
            sum(len(set(row[m > 0].tolist())) > 1 for row, m in zip(batch.versions, batch.completion_mask)) / len(lag)
        ),
    }
    metrics["ess_low"] = metrics["tokens_in_loss"] > 0 and metrics["ess"] < cfg.ess_warn
    return metrics
