"""The trainer's policy: the model, its optimizer, and one optimizer step on a batch of groups.

``Policy.step`` is the learning half of a training step: collate the groups, score the
sampled tokens under the current weights (MoE: routed as the engine routed them), the
off-policy-corrected loss (``inflight.trainer.loss``), backward, clip, optimizer step. It does not
move the version: the caller does, and pushes the new weights (``inflight.trainer.weight_sync``).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from inflight.protocol import RolloutGroup, Sampling
from inflight.rollout_queue import RolloutBuffer
from inflight.transport.sources import named_weights
from inflight.trainer.adapter import adapter_weights, load_trainable
from inflight.trainer.checkpoint import TrainerState, restore_rng, save_checkpoint
from inflight.trainer.config import TrainConfig
from inflight.trainer.loss import Batch, collate, compute_loss, micro_batches, policy_logprobs
from inflight.trainer.metrics import ess_warning
from inflight.trainer.optim import learning_rate
from inflight.trainer.routing_replay import RoutingReplay, collate_routing
from inflight.trainer.tasks.tool_calls import use_chat_template

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
                 adapter_dir: Path | None = None, reference_dir: Path | None = None) -> None:
        """``reference_dir``: the run's first weights, ``loss.kl_coef``'s reference (default
        ``model_dir``; a LoRA run's reference is its base with the adapter off)."""
        from accelerate import Accelerator
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        if self.accelerator.device.type == "cpu":
            torch.set_num_threads(1)  # leave the other core(s) to the engine
        self.tokenizer = use_chat_template(AutoTokenizer.from_pretrained(str(model_dir)), cfg.task.chat_template)
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
        self.flat_steps = 0  # steps in a row whose every group's samples scored alike (zero advantages)
        self.reference = None  # loss.kl_coef's frozen reference model (a LoRA run's: the base, adapter off)
        if cfg.loss.kl_coef and not self.lora:
            self.reference = AutoModelForCausalLM.from_pretrained(str(reference_dir or model_dir), dtype=torch.float32)
            self.reference.to(self.accelerator.device).eval().requires_grad_(False)

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch) -> torch.Tensor | None:
        """The reference policy's log-probs of ``batch``'s tokens (None without ``loss.kl_coef``),
        at the sampling temperature and without top-k/top-p, so every token has one."""
        if not self.cfg.loss.kl_coef:
            return None
        unfiltered = Sampling(temperature=self.cfg.rollout.temperature)
        if self.reference is None:  # LoRA: the base is the model with its adapter off
            with self.unwrapped.disable_adapter():
                return policy_logprobs(self.model, batch, unfiltered)[0]
        return policy_logprobs(self.reference, batch, unfiltered)[0]

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors a push sends, by checkpoint name (``named_weights``); in a LoRA run the
        adapter's, by the names PEFT saves (``inflight.trainer.adapter``)."""
        return adapter_weights(self.unwrapped) if self.lora else named_weights(self.unwrapped)

    def step(self, groups: list[RolloutGroup], version: int, step: int, *,
             before_write: Callable[[], object] = lambda: None) -> StepResult:
        """One optimizer step on ``groups``, scored against the trainer's ``version``.
        ``before_write`` runs right before the optimizer writes the parameters: a push in
        flight reads them until then (``WeightPusher.wait_reads``)."""
        loss, metrics, batch = self.accumulate(groups, version)
        if (warning := ess_warning(metrics, self.cfg.loss.ess_warn)) is not None:
            log.warning("step %d: %s", step + 1, warning)
        metrics["groups_without_signal"] = flat = sum(len({s.reward for s in g.samples}) == 1 for g in groups)
        self.flat_steps = self.flat_steps + 1 if flat == len(groups) else 0
        if self.flat_steps in (1, 5):  # the first such step, and once it keeps on
            rewards = sorted({s.reward for g in groups for s in g.samples})[:4]
            log.warning("step %d: every group's samples scored alike (rewards %s): %s (what the policy samples, and "
                        "its rewards: samples.jsonl)", step + 1, rewards, "no learning signal in this batch"
                        if self.flat_steps == 1 else f"still no learning signal, {self.flat_steps} steps in a row")
        clip = self.cfg.optim.grad_clip
        grad_norm = float(self.accelerator.clip_grad_norm_(self.model.parameters(), clip)) if clip else 0.0
        lr = learning_rate(self.cfg, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        metrics["lr"] = lr
        before_write()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss, grad_norm, batch, metrics)

    def accumulate(self, groups: list[RolloutGroup], version: int) -> tuple[float, dict[str, Any], Batch]:
        """The gradient of the step's loss on ``groups``, accumulated into the parameters'
        ``.grad`` over ``optim.micro_batches`` forward/backward passes (the loss normalized by
        the whole batch's tokens, so the sum is the one-batch gradient); returns the loss, the
        whole batch's metrics and the batch."""
        cfg = self.cfg
        batch = collate(groups, self.tokenizer.pad_token_id, cfg.loss.normalize_std)
        routing = collate_routing(groups, batch.input_ids, batch.completion_ids.shape[1]) if self.replay.enabled else None
        parts = micro_batches(batch, min(cfg.optim.micro_batches, batch.input_ids.shape[0]))
        device = self.accelerator.device
        if len(parts) == 1:  # one pass: the loss and its metrics at once
            batch = batch.to(device)
            with self.replay.replaying(routing):
                logp, entropy = policy_logprobs(self.model, batch, cfg.rollout.sampling())
            loss, metrics = compute_loss(logp, entropy, batch, version=version, cfg=cfg.loss,
                                         ref_logp=self.reference_logprobs(batch))
            self.accelerator.backward(loss)
            return float(loss.detach()), {**metrics, **self.replay.stats()}, batch
        n_tokens = float((batch.completion_mask > 0).sum().clamp(min=1))
        logp_all, entropy_all = torch.zeros_like(batch.behaviour_logp), torch.zeros_like(batch.behaviour_logp)
        ref_all = torch.zeros_like(batch.behaviour_logp) if cfg.loss.kl_coef else None
        for rows, micro in parts:
            micro, t = micro.to(device), micro.completion_ids.shape[1]
            p = micro.input_ids.shape[1] - t  # the micro-batch's columns of the whole batch's routing
            width = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
            part_routing = None if routing is None else routing[rows, width - p: width + t]
            with self.replay.replaying(part_routing):
                logp, entropy = policy_logprobs(self.model, micro, cfg.rollout.sampling())
            ref = self.reference_logprobs(micro)
            part, _ = compute_loss(logp, entropy, micro, version=version, cfg=cfg.loss, n_tokens=n_tokens,
                                   ref_logp=ref, with_metrics=False)
            self.accelerator.backward(part)
            logp_all[rows, :t], entropy_all[rows, :t] = logp.detach().cpu(), entropy.detach().cpu()
            if ref_all is not None:
                ref_all[rows, :t] = ref.cpu()
        with torch.no_grad():  # the whole batch's loss and metrics, from the micro-batches' log-probs
            loss, metrics = compute_loss(logp_all, entropy_all, batch, version=version, cfg=cfg.loss, ref_logp=ref_all)
        return float(loss), {**metrics, **self.replay.stats()}, batch

    def save(self, path: Path, step: int, version: int, buffer: RolloutBuffer,
             ledger: Callable[[], dict] | None = None) -> None:
        """A checkpoint: weights, optimizer, RNG, the rollout groups admitted but not yet trained
        on, and the trainer's side of the rollout ledger."""
        buffer.drain(version)  # queued groups live in this process's store: keep them with the checkpoint
        save_checkpoint(path, self.unwrapped, self.tokenizer, self.optimizer, TrainerState(
            step=step, version=version, python_rng=random.getstate(), torch_rng=torch.get_rng_state(),
            buffer_stats=buffer.stats(), pending=list(buffer.pending), ledger=ledger() if ledger else {}))
