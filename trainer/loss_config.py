"""The ``[loss]`` table: the objective and its off-policy correction (formulas: the
docstrings of ``inflight.trainer.correction`` and ``inflight.kernels.tis_loss``; docs/training.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from inflight.kernels.tis_loss import Objective
from inflight.settings import check_choices


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """The ``[loss.objective]`` table: the per-token objective and its constants
    (``inflight.kernels.tis_loss`` takes them as plain values: ``kernel_args``)."""

    name: Objective = "reinforce"
    """reinforce (truncated IS, default), ppo (clipped ratio; GSPO at loss.level = "sequence"),
    icepop (mask outside [lo, hi]) or none (w = 1: no off-policy correction)."""
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
    lag_decay: float = 1.0
    """d in (0, 1]: the upper constant of each objective (C, hi, eps_hi) is multiplied by
    d ** lag, so staler tokens get a tighter bound. 1 turns it off."""

    def __post_init__(self) -> None:
        check_choices(self, "loss.objective")
        if not self.truncation > 0:
            raise ValueError(f"loss.objective.truncation={self.truncation} must be > 0")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(f"loss.objective clip=({self.clip_low}, {self.clip_high}) needs 0 <= low < 1, high >= 0")
        if not 0 <= self.icepop_low < self.icepop_high:
            raise ValueError(f"loss.objective icepop=({self.icepop_low}, {self.icepop_high}) needs 0 <= low < high")
        if not 0 < self.lag_decay <= 1:
            raise ValueError(f"loss.objective.lag_decay={self.lag_decay} must be in (0, 1]")

    def kernel_args(self) -> dict[str, Any]:
        """The constants as ``inflight.kernels.tis_loss`` takes them (keyword arguments, plain values)."""
        return {"objective": self.name, "truncation": self.truncation, "clip_low": self.clip_low,
                "clip_high": self.clip_high, "icepop_low": self.icepop_low, "icepop_high": self.icepop_high,
                "lag_decay": self.lag_decay}


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The objective and its off-policy correction (formulas: docs/training.md, *Off-policy correction*)."""

    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    """Objective and its constants (reinforce + truncation C, ppo clips, icepop bounds, none;
    lag_decay for lag-aware bounds)."""
    level: Literal["token", "sequence"] = "token"
    """token: the objective sees each token's ratio r_t. sequence: it sees its sample's ratio
    s_i = exp(mean of log r_t over the sample's unmasked tokens): ppo becomes GSPO,
    reinforce Seq-TIS, icepop a sequence mask."""
    max_lag: int = 4
    """Tokens sampled more than this many versions ago are masked out of the loss."""
    seq_mask: Literal["off", "geometric", "product"] = "off"
    """Seq-MIS: mask whole samples whose ratio leaves [seq_mask_low, seq_mask_high]; the ratio is
    the geometric mean of r_t (verl's geometric rejection, thresholds ~1/1.0002..1.0002) or
    their product (verl's sequence rejection)."""
    seq_mask_low: float = 0.5
    """Lower bound of the Seq-MIS band."""
    seq_mask_high: float = 2.0
    """Upper bound of the Seq-MIS band."""
    veto: bool = False
    """Mask every sample that holds a catastrophic token (r_t < veto_threshold)."""
    veto_threshold: float = 1e-4
    """What counts as catastrophic (also the catastrophic-token metric's threshold)."""
    m2_threshold: float = 0.0
    """M2PO: mask the tokens of largest (log r_t)^2 until the batch mean of (log r_t)^2 over
    the rest is <= this (AReaL's m2_threshold, e.g. 0.04). 0 turns it off."""
    ess_warn: float = 0.3
    """Warn (log) on a step whose effective sample size fraction is below this."""
    normalize_std: bool = True
    """GRPO: divide group-centred rewards by the group's std (False: Dr. GRPO)."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (the entropy is always logged)."""
    kl_coef: float = 0.0
    """Weight of a KL penalty to the reference policy (the run's first weights; a LoRA run's
    base, the adapter off): kl_coef * mean over policy tokens of the k3 estimator
    exp(ref - logp) - (ref - logp) - 1, as GRPO and TRL add it (``kl_ref`` in every row); the
    reference is scored at the sampling temperature without top-k/top-p. 0: off, and no
    reference model is loaded."""
    routing_replay: bool = False
    """Mixture-of-experts policies (R3): the engine records each sampled token's top-k experts
    per MoE layer, and the trainer's forward routes that token's position to them, with gate
    weights from its own router logits (``inflight.trainer.routing_replay``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.routing_replay, bool):
            raise ValueError(f"loss.routing_replay={self.routing_replay!r} must be true or false")
        check_choices(self, "loss")
        if self.max_lag < 0:
            raise ValueError(f"loss.max_lag={self.max_lag} must be >= 0")
        if not 0 <= self.seq_mask_low < self.seq_mask_high:
            raise ValueError(f"loss.seq_mask=({self.seq_mask_low}, {self.seq_mask_high}) needs 0 <= low < high")
        if not 0 < self.veto_threshold < 1:
            raise ValueError(f"loss.veto_threshold={self.veto_threshold} must be in (0, 1)")
        if not self.m2_threshold >= 0:
            raise ValueError(f"loss.m2_threshold={self.m2_threshold} must be >= 0 (0: off)")
        if not 0 <= self.ess_warn <= 1:
            raise ValueError(f"loss.ess_warn={self.ess_warn} must be in [0, 1]")
        if not self.kl_coef >= 0:
            raise ValueError(f"loss.kl_coef={self.kl_coef} must be >= 0 (0: off)")
