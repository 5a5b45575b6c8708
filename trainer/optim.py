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
from inflight.settings import Packing, check_choices


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
    packing: Packing = "prefix_shared"
    """How a micro-batch's samples are laid out for the forward pass (``inflight.trainer.packed_batch``):
    ``padded`` rows, each prompt left-padded to the longest and attention masked (the
    reference); ``packed``, every sample's tokens concatenated without padding, positions
    restarting per sample, attention kept inside each sample; ``prefix_shared``, packed with
    each group's shared prefix (its prompt, and any history its samples share) run forward
    once and attended to by every sample that shares it. A model that cannot take a layout
    falls back to the next simpler one, saying why once."""
    micro_batch_tokens: int = 8192
    """Tokens one forward and backward pass may hold (as laid out: a shared prefix counts
    once; padded rows count their padding). A step's samples are cut into micro-batches of
    whole samples under this budget, their gradients accumulated (the loss normalized by the
    whole batch's tokens, so the step equals one pass). Activation memory grows with it."""
    activation_checkpointing: bool = True
    """Keep only each decoder layer's input for the backward pass and recompute the layer
    there: about a tenth of the activation memory for about a third more forward compute."""
    head_chunk_tokens: int = 256
    """Tokens whose LM-head logits exist at once (``inflight.kernels.logprob_head``): the head,
    log-prob and entropy run in chunks of this many rows, recomputed in the backward pass,
    so no (tokens, vocabulary) logits tensor is ever whole."""
    expert_parallel: bool = True
    """On several trainer ranks, shard each MoE layer's experts by expert (each rank owns
    experts / ranks of them, tokens dispatched to their owner all-to-all) instead of
    all-gathering every expert with the layer (FSDP). No effect on one rank or a dense model."""
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
        for name in ("micro_batch_tokens", "head_chunk_tokens"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"optim.{name}={value} must be a whole number >= 1")

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
