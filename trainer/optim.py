"""The optimizer's settings (``[optim]``) and the learning rate of each step.

AdamW on the trainer's fp32 master weights (``inflight.trainer.policy.Policy``); each step's learning
rate is ``learning_rate(cfg, step)``, set on the optimizer right before it steps, so a
resumed run continues the schedule from its step with no scheduler state to save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from inflight.protocol import ModelDtype
from inflight.settings import check_choices


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW."""

    lr: float = 1e-3
    """Peak learning rate (after ``warmup_steps``)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """After warmup: ``constant`` at ``lr``, or a ``linear`` or ``cosine`` decay toward 0 at
    ``run.steps`` (``inflight.trainer.policy.learning_rate``)."""
    warmup_steps: int = 0
    """Steps of linear warmup: step k (from 1) uses lr * k / (warmup_steps + 1)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Adam betas."""
    grad_clip: float = 1.0
    """Max global grad norm (0: off)."""
    micro_batches: int = 1
    """Forward and backward passes per step: the step's samples split into this many
    micro-batches of consecutive rows, each trimmed to its own padding, their gradients
    accumulated (the loss normalized by the whole batch's tokens, so the step equals one
    pass). Peak memory falls with it: logits are (samples, tokens, vocabulary)."""
    compute_dtype: ModelDtype = "float32"
    """What the forward and backward passes compute in. ``bfloat16``: FSDP2's mixed precision
    (``MixedPrecisionPolicy``) on every rank, one included: each layer's parameters are
    gathered in bf16 for its passes and its gradients reduced in fp32; the master weights,
    AdamW's moments and every push stay fp32, and the logits come out in fp32."""

    def __post_init__(self) -> None:
        check_choices(self, "optim")
        if not self.lr > 0:
            raise ValueError(f"optim.lr={self.lr} must be > 0")
        if not self.grad_clip >= 0:
            raise ValueError(f"optim.grad_clip={self.grad_clip} must be >= 0 (0: off)")
        if not 0 <= self.weight_decay < 1:
            raise ValueError(f"optim.weight_decay={self.weight_decay} must be in [0, 1)")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")
        if type(self.warmup_steps) is not int or self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be a whole number >= 0")
        if type(self.micro_batches) is not int or self.micro_batches < 1:
            raise ValueError(f"optim.micro_batches={self.micro_batches} must be a whole number >= 1")


def learning_rate(cfg: Any, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0 for the first) of the run ``cfg`` (a
    ``TrainConfig``): ``optim.warmup_steps``
    of linear warmup (step k of them, from 1, at lr * k / (warmup + 1)), then ``optim.schedule``
    over the remaining steps (linear and cosine reach 0 one step past ``run.steps``)."""
    o, w = cfg.optim, cfg.optim.warmup_steps
    if step < w:
        return o.lr * (step + 1) / (w + 1)
    done = (step - w) / (cfg.run.steps - w)  # 0 at the first step after warmup, below 1 at the last
    if o.schedule == "linear":
        return o.lr * (1 - done)
    if o.schedule == "cosine":
        return o.lr * 0.5 * (1 + math.cos(math.pi * done))
    return o.lr
