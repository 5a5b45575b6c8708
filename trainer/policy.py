"""The trainer's policy: the model, its optimizer, and one optimizer step on a batch of groups.

``Policy.step`` is the learning half of a training step: collate the groups, score the
sampled tokens under the current weights (MoE: routed as the engine routed them), the
off-policy-corrected loss (``trainer.loss``), backward, clip, optimizer step. It does not
move the version: the caller does, and pushes the new weights (``trainer.weight_sync``).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from inflight.protocol import RolloutGroup
from inflight.rollout_queue import RolloutBuffer
from inflight.transport.sources import named_weights
from trainer.adapter import adapter_weights, load_trainable
from trainer.checkpoint import TrainerState, restore_rng, save_checkpoint
from trainer.config import TrainConfig
from trainer.loss import Batch, collate, compute_loss, policy_logprobs
from trainer.metrics import ess_warning
from trainer.routing_replay import RoutingReplay, collate_routing

log = logging.getLogger("inflight.train")


@dataclass
class StepResult:
    """What one optimizer step computed, for the metrics row."""

    loss: float
    grad_norm: float
    batch: Batch
    metrics: dict[str, Any]


class Policy:
    """The policy under training (accelerate), its optimizer and tokenizer."""

    def __init__(self, cfg: TrainConfig, model_dir: Path, resumed: TrainerState | None,
                 adapter_dir: Path | None = None) -> None:
        from accelerate import Accelerator
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        if self.accelerator.device.type == "cpu":
            torch.set_num_threads(1)  # leave the other core(s) to the engine
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.lora = adapter_dir is not None
        if adapter_dir is not None:  # only the adapter trains; its directory is also the checkpoint's
            model, state_dir = load_trainable(model_dir, adapter_dir), adapter_dir
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)  # fp32 master weights
            state_dir = model_dir
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                      betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay)
        if resumed is not None:
            optimizer.load_state_dict(torch.load(state_dir / "optimizer.pt", weights_only=True))
            restore_rng(resumed)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.replay = RoutingReplay(self.unwrapped, enabled=cfg.loss.routing_replay)

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors a push sends, by checkpoint name (``named_weights``); in a LoRA run the
        adapter's, by the names PEFT saves (``trainer.adapter``)."""
        return adapter_weights(self.unwrapped) if self.lora else named_weights(self.unwrapped)

    def step(self, groups: list[RolloutGroup], version: int, step: int, *,
             before_write: Callable[[], object] = lambda: None) -> StepResult:
        """One optimizer step on ``groups``, scored against the trainer's ``version``.
        ``before_write`` runs right before the optimizer writes the parameters: a push in
        flight reads them until then (``WeightPusher.wait_reads``)."""
        cfg = self.cfg
        batch = collate(groups, self.tokenizer.pad_token_id, cfg.loss.normalize_std).to(self.accelerator.device)
        routing = collate_routing(groups, batch.input_ids, batch.completion_ids.shape[1]) if self.replay.enabled else None
        with self.replay.replaying(routing):  # MoE: each sampled token's position routed to the engine's experts
            logp, entropy = policy_logprobs(self.model, batch, cfg.rollout.temperature)
        loss, metrics = compute_loss(logp, entropy, batch, version=version, cfg=cfg.loss)
        metrics.update(self.replay.stats())
        if (warning := ess_warning(metrics, cfg.loss.ess_warn)) is not None:
            log.warning("step %d: %s", step + 1, warning)
        self.accelerator.backward(loss)
        clip = cfg.optim.grad_clip
        grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), clip)) if clip else 0.0
        before_write()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(float(loss.detach()), grad_norm, batch, metrics)

    def save(self, path: Path, step: int, version: int, buffer: RolloutBuffer) -> None:
        """A checkpoint: weights, optimizer, RNG, and the rollout groups admitted but not yet trained on."""
        buffer.drain(version)  # queued groups live in this process's store: keep them with the checkpoint
        save_checkpoint(path, self.unwrapped, self.tokenizer, self.optimizer, TrainerState(
            step=step, version=version, python_rng=random.getstate(), torch_rng=torch.get_rng_state(),
            buffer_stats=buffer.stats(), pending=list(buffer.pending)))
