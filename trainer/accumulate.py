"""One rank's gradient of a training step: its samples cut into micro-batches
(``inflight.trainer.step_plan``), each laid out (``optim.packing``), scored under the policy
(and the KL reference), its share of the loss backpropagated.

Every micro-batch's loss divides by the whole batch's real completion tokens, so the gradients
sum to the one-pass gradient of the whole batch, on one rank or many. The log-probs come back
as the whole (rows, completion) grid, for the batch's loss and metrics. Routing replay stays on
through the backward pass, so a checkpointed layer recomputes with the engine's experts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from inflight.protocol import RolloutGroup, Sampling
from inflight.settings import Packing
from inflight.trainer.loss import Batch, compute_loss, padded_rows, policy_logprobs
from inflight.trainer.loss_config import LossConfig
from inflight.trainer.packed_batch import pack
from inflight.trainer.packed_forward import packed_logprobs
from inflight.trainer.routing_replay import RoutingReplay, collate_routing
from inflight.trainer.step_plan import MicroBatch, plan

log = logging.getLogger("inflight.train")

Score = Callable[[torch.nn.Module, Sampling], tuple[torch.Tensor, torch.Tensor]]
"""A micro-batch's scoring: (model, sampling) -> its (rows, completion) log-probs and entropies."""


@dataclass
class StepTimes:
    """Where one rank's step went, in seconds, and what it computed."""

    forward: float = 0.0
    backward: float = 0.0
    reference: float = 0.0
    tokens: int = 0
    """Tokens run forward, as laid out (padding and shared prefixes counted as computed)."""
    prompt_tokens: int = 0
    """Of ``tokens``, those before a completion (prompt, or padding before it)."""
    passes: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {"forward_ms": 1e3 * self.forward, "backward_ms": 1e3 * self.backward,
                "reference_ms": 1e3 * self.reference, "trainer_tokens": self.tokens,
                "trainer_prompt_tokens": self.prompt_tokens,
                "trainer_completion_tokens": self.tokens - self.prompt_tokens, "micro_batches": self.passes}


@dataclass
class Scores:
    """The batch's (rows, completion) log-probs, entropies and reference log-probs (None
    without a KL term), on the host, and the step's times."""

    logp: torch.Tensor
    entropy: torch.Tensor
    ref: torch.Tensor | None
    times: StepTimes = field(default_factory=StepTimes)


@dataclass
class Accumulator:
    """Runs micro-batches of ``model`` (and ``reference``: a frozen model, or a callable that
    scores with the policy's adapter off) on ``device``."""

    model: torch.nn.Module
    reference: Callable[[Score], torch.Tensor] | None
    """The KL reference's log-probs of a micro-batch, given its scoring function."""
    replay: RoutingReplay
    loss: LossConfig
    sampling: Sampling
    packing: Packing
    budget: int
    head_chunk: int
    device: torch.device

    def plan(self, groups: Sequence[RolloutGroup], passes: int | None = None, whole: bool = False) -> list[MicroBatch]:
        """``groups``' micro-batches; ``whole``: one (a loss that needs the whole batch at once)."""
        samples = [s for g in groups for s in g.samples]
        owners = [i for i, g in enumerate(groups) for _ in g.samples]
        return plan(samples, owners, self.packing, 1 << 62 if whole else self.budget, passes)

    def run(self, groups: Sequence[RolloutGroup], batch: Batch, version: int, n_tokens: float,
            micro: Sequence[MicroBatch]) -> Scores:
        """Backward of ``groups``' share of a loss over ``n_tokens`` tokens (``batch``: them
        collated), one pass per micro-batch of ``micro``."""
        scores = Scores(torch.zeros_like(batch.behaviour_logp), torch.zeros_like(batch.behaviour_logp),
                        torch.zeros_like(batch.behaviour_logp) if self.reference is not None else None)
        self.replay.reset()
        routing = (collate_routing(groups, batch.input_ids, batch.completion_ids.shape[1])
                   if self.replay.enabled and self.packing == "padded" else None)
        for mb in micro:
            self._pass(groups, batch, mb, version, n_tokens, scores, routing)
        scores.times.passes = len(micro)
        return scores

    def _pass(self, groups: Sequence[RolloutGroup], batch: Batch, mb: MicroBatch, version: int, n_tokens: float,
              scores: Scores, routing: torch.Tensor | None) -> None:
        times = scores.times
        if mb.empty:  # a pass that only joins the other ranks' collectives
            self._join()
            return
        t0 = time.perf_counter()
        targets, score, route, prompt_tokens = self._layout(groups, batch, mb, routing)
        with self.replay.replaying(route):
            logp, entropy = score(self.model, self.sampling)
        t1 = time.perf_counter()
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self.reference(score)
        t2 = time.perf_counter()
        part, _ = compute_loss(logp, entropy, targets, version=version, cfg=self.loss, n_tokens=n_tokens,
                               ref_logp=ref, with_metrics=False)
        with self.replay.replaying(route), self.replay.counting(False):  # a checkpointed layer recomputes
            part.backward()
        t3 = time.perf_counter()
        times.forward += t1 - t0
        times.reference += t2 - t1
        times.backward += t3 - t2
        times.tokens += mb.tokens
        times.prompt_tokens += prompt_tokens
        rows, t = slice(mb.start, mb.stop), logp.shape[1]
        scores.logp[rows, :t], scores.entropy[rows, :t] = logp.detach().cpu(), entropy.detach().cpu()
        if scores.ref is not None and ref is not None:
            scores.ref[rows, :t] = ref.cpu()

    def _layout(self, groups: Sequence[RolloutGroup], batch: Batch, mb: MicroBatch, routing: torch.Tensor | None):
        """(the micro-batch's per-token targets, a function scoring them under a model, its
        routing to replay, its prompt tokens)."""
        if self.packing == "padded":
            targets, cols = padded_rows(batch, mb.start, mb.stop)
            targets = targets.to(self.device)
            route = None if routing is None else routing[mb.start:mb.stop, cols]
            width = targets.input_ids.shape[1] - targets.completion_ids.shape[1]
            return (targets, lambda m, sampling: policy_logprobs(m, targets, sampling), route,
                    width * (mb.stop - mb.start))
        samples = [s for g in groups for s in g.samples][mb.start:mb.stop]
        owners = [i for i, g in enumerate(groups) for _ in g.samples][mb.start:mb.stop]
        members: dict[int, list[int]] = {}
        for row, owner in enumerate(owners):
            members.setdefault(owner, []).append(row)
        layout = pack(samples, list(members.values()), share=self.packing == "prefix_shared",
                      routing=self.replay.enabled).to(self.device)
        targets, _ = padded_rows(batch, mb.start, mb.stop, inputs=False)
        targets = targets.to(self.device)
        return (targets, lambda m, sampling: packed_logprobs(m, layout, sampling, self.head_chunk), layout.routing,
                layout.prompt_rows)

    def _join(self) -> None:
        """A forward and backward of one token whose loss is 0 (and the reference's forward):
        this rank's part of a pass the others run (FSDP's gathers and reductions, expert dispatch)."""
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        one = Batch(ids, torch.ones_like(ids), torch.zeros_like(ids), ids, torch.zeros(1, 1, device=self.device),
                    torch.zeros(1, 1, device=self.device), ids, torch.zeros(1, device=self.device),
                    torch.zeros(1, device=self.device))
        score = lambda m, sampling: policy_logprobs(m, one, sampling)  # noqa: E731
        logp, _ = score(self.model, self.sampling)
        if self.reference is not None:
            with torch.no_grad():
                self.reference(score)
        (logp.sum() * 0.0).backward()
