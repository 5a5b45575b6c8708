"""The trainer's policy: the model, its optimizer, and one optimizer step on a batch of groups.

``Policy.step`` is the learning half of a training step: collate the groups, score the
sampled tokens under the current weights (MoE: routed as the engine routed them), the
off-policy-corrected loss (``inflight.trainer.loss``), backward, clip, optimizer step. It does not
move the version: the caller does, and pushes the new weights (``inflight.trainer.weight_sync``).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inflight.protocol import (
    RolloutGroup,
    Sampling,
    TrainerOrder,
    TrainerPart,
    TrainerSave,
    TrainerSetup,
    decode_trainer_part,
)
from inflight.rollout_queue import RolloutBuffer
from inflight.trainer.accumulate import Accumulator, Score, Scores
from inflight.trainer.checkpoint import TrainerState, load_optimizer, restore_rng, save_checkpoint, save_optimizer
from inflight.trainer.config import TrainConfig
from inflight.trainer.expert_parallel import all_to_all_bytes
from inflight.trainer.host_memory import restart_peak, return_freed_memory, step_memory
from inflight.trainer.lora_policy import adapter_weights, empty_trainable, load_trainable
from inflight.trainer.loss import Batch, collate, compute_loss
from inflight.trainer.metrics import ess_warning
from inflight.trainer.models import empty_model
from inflight.trainer.optim import learning_rate
from inflight.trainer.packed_forward import checkpoint_layers, use_packing
from inflight.trainer.ranks import GatheredWeights, TrainerRanks, decode_floats
from inflight.trainer.routing_replay import RoutingReplay
from inflight.trainer.tasks.tool_calls import use_chat_template
from inflight.transport.sources import checkpoint_form, named_weights

log = logging.getLogger("inflight.train")


@dataclass
class StepResult:
    """What one optimizer step computed, for the metrics row."""

    loss: float
    grad_norm: float
    batch: Batch
    metrics: dict[str, Any]


class Policy:
    """The policy under training, its optimizer and tokenizer; with ``ranks``, one rank's shard
    of them (``inflight.trainer.ranks``: rank 0 orders each step, the others ``follow``)."""

    def __init__(self, cfg: TrainConfig, model_dir: Path, resumed: TrainerState | None,
                 adapter_dir: Path | None = None, reference_dir: Path | None = None, *,
                 ranks: TrainerRanks | None = None, resume: bool | None = None) -> None:
        """``reference_dir``: the run's first weights, ``loss.kl_coef``'s reference (default
        ``model_dir``; a LoRA run's reference is its base with the adapter off). ``resume``: load
        the optimizer from ``model_dir``'s checkpoint (default: whether ``resumed`` is given)."""
        from transformers import AutoTokenizer

        self.formed_ranks = ranks is None and cfg.optim.compute_dtype != "float32"
        if self.formed_ranks:  # mixed precision is FSDP2's, on one rank too
            ranks = TrainerRanks.from_env(cfg.run.rank_timeout_s, alone=True)
        self.cfg, self.ranks, self.model_dir = cfg, ranks, model_dir
        self.device = ranks.device if ranks else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # leave the other core(s) to the engine
            return_freed_memory()  # the resident set follows the live tensors: no step keeps the last one's
        resume = resumed is not None if resume is None else resume
        if ranks is not None:
            check_ranks(cfg, ranks.world)
            if ranks.rank == 0:
                for r in range(1, ranks.world):
                    ranks.send(TrainerSetup(model_dir=str(model_dir), resume=resume, adapter_dir=str(adapter_dir or ""),
                                            reference_dir=str(reference_dir or "")), r)
        self.tokenizer = use_chat_template(AutoTokenizer.from_pretrained(str(model_dir)), cfg.task.chat_template)
        self.lora, self.adapter_dir = adapter_dir is not None, adapter_dir
        state_dir = adapter_dir or model_dir  # a LoRA run's checkpoint is its adapter's directory
        # loss.kl_coef's frozen reference model (a LoRA run's: the base, adapter off)
        self.model, self.reference = self._placed(self._prepared(self._load(model_dir, adapter_dir, reference_dir)))
        self.gathered: GatheredWeights | None = None
        if ranks is not None:
            self.gathered = GatheredWeights(ranks, self._live())
            self.gathered.gather(0)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.optim.lr,
                                           betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay,
                                           fused=True)  # one kernel per tensor: no temporaries of the moments
        if resume:
            load_optimizer(self.model, self.optimizer, state_dir)
        if resumed is not None:
            restore_rng(resumed)
        self.replay = RoutingReplay(self.model, enabled=cfg.loss.routing_replay)
        self.accumulator = Accumulator(self.model, self._reference_scores if cfg.loss.kl_coef else None, self.replay,
                                       cfg.loss, cfg.rollout.sampling(), self.packing, cfg.optim.micro_batch_tokens,
                                       cfg.optim.head_chunk_tokens, self.device)
        self.flat_steps = 0  # steps in a row whose every group's samples scored alike (zero advantages)
        self._eval_model: torch.nn.Module | None = None

    def _load(self, model_dir: Path, adapter_dir: Path | None, reference_dir: Path | None) -> list[torch.nn.Module]:
        """The policy (fp32 master weights; with ``adapter_dir`` only the adapter trains) and the
        KL reference (if any), on the host; a following rank's on the meta device, no weights read."""
        empty = self.ranks is not None and self.ranks.rank != 0
        models = [_model(model_dir, adapter_dir, empty=empty)]
        if self.cfg.loss.kl_coef and adapter_dir is None:
            models.append(_model(reference_dir or model_dir, None, empty=empty).eval().requires_grad_(False))
        return models

    def _prepared(self, models: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """``models`` set up to train as ``optim`` says, before any is sharded: the layout their
        forward takes (``optim.packing``, or a simpler one the model needs, said once) and the
        policy's decoder layers checkpointed (``optim.activation_checkpointing``)."""
        packing, why = self.cfg.optim.packing, None
        for model in models:
            packing, why = use_packing(model, packing)
        if why is not None and (self.ranks is None or self.ranks.rank == 0):
            log.warning("optim.packing=%r: %s, so the trainer pads its batches (optim.packing='padded')",
                        self.cfg.optim.packing, why)
        self.packing = packing
        if self.cfg.optim.activation_checkpointing:
            checkpoint_layers(models[0])
        return models

    def _placed(self, models: list[torch.nn.Module]) -> tuple[torch.nn.Module, torch.nn.Module | None]:
        """``_load``'s models on this process's device: with ranks, sharded layer by layer
        before any leaves the host (FSDP moves each unit's shards), then every rank's shards
        filled from rank 0's weights."""
        for model in models:
            if self.ranks is None:
                model.to(self.device)
                continue
            full = model.state_dict() if self.ranks.rank == 0 else None
            self.ranks.shard(model, self.cfg.optim.compute_dtype, expert_parallel=self.cfg.optim.expert_parallel)
            self.ranks.fill_from_rank_0(model, full)
            del full
        return models[0], models[1] if len(models) > 1 else None

    @torch.no_grad()
    def _reference_scores(self, score: Score) -> torch.Tensor:
        """The KL reference's log-probs of a micro-batch (``score`` runs it under a model), at
        the sampling temperature and without top-k/top-p, so every token has one."""
        unfiltered = Sampling(temperature=self.cfg.rollout.temperature)
        if self.reference is None:  # LoRA: the base is the model with its adapter off (on every rank)
            with self.model.disable_adapter():
                return score(self.model, unfiltered)[0]
        return score(self.reference, unfiltered)[0]

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The model, for a caller that runs it alone: with ranks, an unsharded copy on rank 0
        (``model_for_eval``)."""
        return self.model if self.ranks is None else self.model_for_eval()

    def model_for_eval(self) -> torch.nn.Module:
        """Rank 0's unsharded model with the weights of the last step (built once, then loaded
        from ``GatheredWeights``' copy): what evaluations run and the checkpoint saves."""
        if self.gathered is None:
            return self.model
        if self._eval_model is None:
            self._eval_model = _model(self.model_dir, self.adapter_dir, empty=False)
            self._eval_model.to(self.device).eval().requires_grad_(False)
        with torch.no_grad():
            own = self._live(self._eval_model)
            for name, t in self.gathered.whole().items():
                own[name].copy_(t)
        return self._eval_model

    def _live(self, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
        """The trained tensors of ``model`` (default the policy) as they live in it: a LoRA
        run's adapter by PEFT's names, else the parameters by their in-memory names."""
        model = self.model if model is None else model
        return adapter_weights(model) if self.lora else {n: p.detach() for n, p in model.named_parameters()}

    def weights(self) -> dict[str, torch.Tensor]:
        """The tensors a push sends, by checkpoint name (``named_weights``); in a LoRA run the
        adapter's, by the names PEFT saves (``inflight.trainer.lora_policy``); with ranks, from rank
        0's host copy of the last step's (``GatheredWeights``), in checkpoint form."""
        if self.gathered is not None:
            copy = self.gathered.whole()
            return copy if self.lora else checkpoint_form(self.model, copy)
        return adapter_weights(self.model) if self.lora else named_weights(self.model)

    def step(self, groups: list[RolloutGroup], version: int, step: int, *,
             before_write: Callable[[], object] = lambda: None) -> StepResult:
        """One optimizer step on ``groups``, scored against the trainer's ``version``.
        ``before_write`` runs right before the weights a push reads are written: the
        parameters (a push in flight reads them until then: ``WeightPusher.wait_reads``), or
        with ranks rank 0's gathered copy."""
        if self.ranks is None:
            return self._step(groups, version, step, before_write)
        with self.ranks.naming_the_lost(step):
            return self._step(groups, version, step, before_write)

    def _step(self, groups: list[RolloutGroup], version: int, step: int, before_write: Callable[[], object]
              ) -> StepResult:
        restart_peak()
        if self.ranks is None:
            loss, metrics, batch = self.accumulate(groups, version)
        else:
            loss, metrics, batch = self._accumulate_on_ranks(groups, version, step)
        if (warning := ess_warning(metrics, self.cfg.loss.ess_warn)) is not None:
            log.warning("step %d: %s", step + 1, warning)
        metrics["groups_without_signal"] = flat = sum(len({s.reward for s in g.samples}) == 1 for g in groups)
        self.flat_steps = self.flat_steps + 1 if flat == len(groups) else 0
        if self.flat_steps in (1, 5):  # the first such step, and once it keeps on
            rewards = sorted({s.reward for g in groups for s in g.samples})[:4]
            log.warning("step %d: every group's samples scored alike (rewards %s): %s (what the policy samples, and "
                        "its rewards: samples.jsonl)", step + 1, rewards, "no learning signal in this batch"
                        if self.flat_steps == 1 else f"still no learning signal, {self.flat_steps} steps in a row")
        t0 = time.perf_counter()
        grad_norm = self._clip()
        metrics["lr"] = self._set_lr(step)
        if self.gathered is None:
            t1 = time.perf_counter()
            before_write()
            t0 += time.perf_counter() - t1  # waiting for a push's reads is not the optimizer's
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics["optimizer_ms"] = 1e3 * (time.perf_counter() - t0)
        if self.gathered is not None:
            before_write()
            t1 = time.perf_counter()
            self.gathered.gather(step + 1)
            metrics["gather_ms"] = 1e3 * (time.perf_counter() - t1)
        metrics.update(step_memory())
        if sent := all_to_all_bytes(self.model, reset=True):  # this rank's expert dispatch, forward and backward
            metrics["expert_all_to_all_mb"] = sum(sent.values()) / 2**20
        return StepResult(loss, grad_norm, batch, metrics)

    def close(self) -> None:
        """Leave the process group this policy formed for itself (bf16 compute on one rank); a
        group it was given is its caller's to leave."""
        if self.formed_ranks and self.ranks is not None:
            self.ranks.stop()

    def follow(self, order: TrainerOrder) -> None:
        """A following rank's part of rank 0's step ``order``: its groups' gradients, its rows'
        log-probs sent to rank 0, the optimizer step on its shard, the gather."""
        assert self.ranks is not None
        with self.ranks.naming_the_lost(order.step):
            self._follow(order)

    def _follow(self, order: TrainerOrder) -> None:
        assert self.ranks is not None and self.gathered is not None
        self.ranks.check_in(order.step)
        groups = list(order.groups)
        batch = collate(groups, self.tokenizer.pad_token_id, self.cfg.loss.normalize_std)
        micro = self.accumulator.plan(groups, order.passes, whole=self._whole_batch)
        scores = self.accumulator.run(groups, batch, order.version, order.n_tokens, micro)
        (rows, cols), (routed, differ) = scores.logp.shape, self.replay.counts()
        t = scores.times
        self.ranks.send(TrainerPart(rows=rows, cols=cols, logp=_raw(scores.logp), entropy=_raw(scores.entropy),
                                    ref=b"" if scores.ref is None else _raw(scores.ref), routing_rows=routed,
                                    routing_differ=differ, tokens=t.tokens, prompt_tokens=t.prompt_tokens), 0)
        self._clip()
        self._set_lr(order.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.gathered.gather(order.step + 1)

    def _set_lr(self, step: int) -> float:
        lr = learning_rate(self.cfg, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _clip(self) -> float:
        """The gradients' global norm (over every rank's shard), then the gradients clipped to
        ``optim.grad_clip`` (0: the norm is not computed, and 0 reported)."""
        clip = self.cfg.optim.grad_clip
        if not clip:
            return 0.0
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if hasattr(norm, "full_tensor"):  # sharded gradients: the norm of the whole
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        return float(norm)

    @property
    def _whole_batch(self) -> bool:
        """The loss needs the whole batch in one pass: M2PO's mask is a moment of all its tokens."""
        return self.cfg.loss.m2_threshold > 0

    def accumulate(self, groups: list[RolloutGroup], version: int) -> tuple[float, dict[str, Any], Batch]:
        """The gradient of the step's loss on ``groups``, accumulated into the parameters'
        ``.grad`` over micro-batches of at most ``optim.micro_batch_tokens`` (the loss normalized
        by the whole batch's tokens, so the sum is the one-batch gradient); returns the loss, the
        whole batch's metrics (with where the step went) and the batch."""
        cfg = self.cfg
        batch = collate(groups, self.tokenizer.pad_token_id, cfg.loss.normalize_std)
        n_tokens = float((batch.completion_mask > 0).sum().clamp(min=1))
        scores = self.accumulator.run(groups, batch, version, n_tokens,
                                      self.accumulator.plan(groups, whole=self._whole_batch))
        return self._whole_loss(scores, batch, version, self.replay.stats())

    def _whole_loss(self, scores: Scores, batch: Batch, version: int, routing: dict[str, float]
                    ) -> tuple[float, dict[str, Any], Batch]:
        """The whole batch's loss and metrics from every micro-batch's (and rank's) log-probs."""
        with torch.no_grad():
            loss, metrics = compute_loss(scores.logp, scores.entropy, batch, version=version, cfg=self.cfg.loss,
                                         ref_logp=scores.ref)
        return float(loss), {**metrics, **routing, **scores.times.as_metrics(), "packing": self.packing}, batch

    def _accumulate_on_ranks(self, groups: list[RolloutGroup], version: int, step: int
                             ) -> tuple[float, dict[str, Any], Batch]:
        """Rank 0's ``accumulate``: each rank its whole groups (``TrainerRanks.rows``), every
        loss over the whole batch's tokens, the same number of passes on every rank; the whole
        batch's loss and metrics from every rank's log-probs."""
        ranks, cfg = self.ranks, self.cfg
        assert ranks is not None
        batch = collate(groups, self.tokenizer.pad_token_id, cfg.loss.normalize_std)
        n_tokens = float((batch.completion_mask > 0).sum().clamp(min=1))
        parts = ranks.rows(groups)
        passes = max(len(self.accumulator.plan(p, whole=self._whole_batch)) for p in parts)
        for r in range(1, ranks.world):
            ranks.send(TrainerOrder(step=step, version=version, groups=tuple(parts[r]), n_tokens=n_tokens,
                                    passes=passes), r)
        ranks.check_in(step)
        mine = collate(parts[0], self.tokenizer.pad_token_id, cfg.loss.normalize_std)
        own = self.accumulator.run(parts[0], mine, version, n_tokens,
                                   self.accumulator.plan(parts[0], passes, whole=self._whole_batch))
        shares, routed = [(own.logp, own.entropy, own.ref)], (0, 0)  # routed: the other ranks' replay counts
        for r in range(1, ranks.world):
            part = decode_trainer_part(ranks.receive_bytes(r))
            routed = (routed[0] + part.routing_rows, routed[1] + part.routing_differ)
            own.times.tokens += part.tokens
            own.times.prompt_tokens += part.prompt_tokens
            shares.append((decode_floats(part.logp, part.rows, part.cols),
                           decode_floats(part.entropy, part.rows, part.cols),
                           decode_floats(part.ref, part.rows, part.cols) if part.ref else None))
        whole = Scores(torch.zeros_like(batch.behaviour_logp), torch.zeros_like(batch.behaviour_logp),
                       torch.zeros_like(batch.behaviour_logp) if cfg.loss.kl_coef else None, own.times)
        start = 0
        for logp, entropy, ref in shares:
            rows, t = slice(start, start + logp.shape[0]), logp.shape[1]
            whole.logp[rows, :t], whole.entropy[rows, :t] = logp, entropy
            if whole.ref is not None and ref is not None:
                whole.ref[rows, :t] = ref
            start = rows.stop
        return self._whole_loss(whole, batch, version, self.replay.stats(routed))

    def save(self, path: Path, step: int, version: int, buffer: RolloutBuffer,
             ledger: Callable[[], dict] | None = None, extra: Callable[[Path], None] | None = None) -> None:
        """A checkpoint: weights, optimizer, RNG, the rollout groups admitted but not yet trained
        on, the trainer's side of the rollout ledger, and what ``extra(directory)`` writes."""
        buffer.drain(version)  # queued groups live in this process's store: keep them with the checkpoint
        save_checkpoint(path, self.unwrapped, self.tokenizer, self.write_optimizer, TrainerState(
            step=step, version=version, python_rng=random.getstate(), torch_rng=torch.get_rng_state(),
            buffer_stats=buffer.stats(), pending=list(buffer.pending), ledger=ledger() if ledger else {}), extra)

    def write_optimizer(self, directory: Path) -> None:
        """The optimizer's state into ``directory``, every rank its shard (rank 0 tells the others)."""
        if self.ranks is not None and self.ranks.rank == 0:
            for r in range(1, self.ranks.world):
                self.ranks.send(TrainerSave(path=str(directory)), r)
        save_optimizer(self.model, self.optimizer, directory)


def _model(model_dir: Path, adapter_dir: Path | None, *, empty: bool) -> torch.nn.Module:
    """``model_dir``'s model in fp32 (master weights), with ``adapter_dir``'s adapter the only
    trainable part; ``empty``: on the meta device, no weights read."""
    if adapter_dir is not None:
        return empty_trainable(model_dir, adapter_dir) if empty else load_trainable(model_dir, adapter_dir)
    if empty:
        return empty_model(model_dir)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def _raw(t: torch.Tensor) -> bytes:
    return t.to(torch.float32).contiguous().numpy().tobytes()


def check_ranks(cfg: TrainConfig, world: int) -> None:
    """What a run on ``world`` trainer ranks needs, refused by name (``ValueError``) before
    any engine starts or model loads; one rank is refused nothing."""
    if world == 1:
        return
    if cfg.rollout.groups_per_step < world:
        raise ValueError(f"rollout.groups_per_step={cfg.rollout.groups_per_step} on {world} trainer ranks: each rank "
                         "trains on whole groups, so a batch needs at least one group per rank")
