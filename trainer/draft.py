"""The draft model a run speculates with, trained online (``DraftConfig``, the ``draft`` section).

The engines load it beside the policy (vLLM's ``draft_model`` speculation) and every push
carries it as ``draft.<name>`` tensors (``inflight.engine.commit.drafted``), so it commits with
the policy at one step boundary. Between two pushes ``DraftTrainer`` distills it from the
policy's own samples, as SkyRL and slime do: cross-entropy on the batch's sampled completion
tokens (the environment's tokens of an episode excluded). Its loss on each batch is taken
before the draft trains on it: fresh samples of the newest policy, so it tracks how far the
draft is from the policy it serves.

Where the engines read it, and the trainer starts from (``draft_dir``): a checkpoint's ``draft/``
when they start from one, else ``<run.out_dir>/draft_init``, written once before the engines
start (``write_initial_draft``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inflight.engine.commit.drafted import DRAFT_PREFIX
from inflight.transport.sources import named_weights

if TYPE_CHECKING:
    from inflight.trainer.config import TrainConfig

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def checkpoint_draft(model_dir: str | Path) -> Path | None:
    """The draft a trainer checkpoint at ``model_dir`` holds (``state.json`` beside ``draft/``),
    or None: not a checkpoint, or one of a run without a draft."""
    checkpoint = Path(model_dir)
    if (checkpoint / "state.json").exists() and (checkpoint / "draft" / "config.json").exists():
        return checkpoint / "draft"
    return None


def draft_dir(cfg: TrainConfig, model_dir: str | Path) -> Path:
    """The draft an engine serving ``model_dir`` loads, and the trainer trains on from: the
    checkpoint's own (``checkpoint_draft``), else the run's first."""
    return checkpoint_draft(model_dir) or Path(cfg.run.out_dir) / "draft_init"


def write_initial_draft(cfg: TrainConfig, model_dir: Path) -> Path:
    """``<run.out_dir>/draft_init``: ``draft.path``'s checkpoint, or one built from the policy
    at ``model_dir`` (``truncated_draft``). vLLM runs a draft with the policy's tokenizer: its
    vocabulary must be the policy's (``ValueError`` naming both sizes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from inflight.trainer.models import resolve_model

    out = Path(cfg.run.out_dir) / "draft_init"
    if not cfg.draft.path:  # cut from the policy: its vocabulary
        truncated_draft(model_dir, cfg.draft.layers).save_pretrained(str(out), safe_serialization=True)
        return out
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(cfg.draft.path)), dtype=torch.float32)
    target_vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    if model.config.vocab_size != target_vocab:
        raise ValueError(f"draft.path={cfg.draft.path!r}: a vocabulary of {model.config.vocab_size} tokens, the "
                         f"policy's has {target_vocab}: a draft must share the policy's tokenizer")
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def truncated_draft(model_dir: Path, layers: int) -> torch.nn.Module:
    """The policy at ``model_dir`` cut to its first ``layers`` decoder layers (embeddings, final
    norm and LM head kept), in fp32: a draft of the same tokenizer that starts out close to it.
    ``ValueError`` if the policy has no more layers than that, or names its layers otherwise."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    if not 0 < layers < config.num_hidden_layers:
        raise ValueError(f"draft.layers={layers}: the policy has {config.num_hidden_layers} decoder layers; a draft "
                         "built from it takes fewer, and at least one")
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    kept = {n: t for n, t in policy.state_dict().items() if not ((m := _LAYER.search(n)) and int(m[1]) >= layers)}
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = draft.load_state_dict(kept, strict=False)
    if missing or unexpected:
        raise ValueError(f"draft.layers={layers}: cannot cut {type(policy).__name__} by its layers (missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}); give a draft checkpoint in draft.path")
    return draft.eval()


def completion_batch(groups: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples of ``groups`` as (input ids, attention mask, labels), right-padded: each row
    its prompt and completion; labels -100 except on the completion tokens the policy sampled."""
    samples = [s for g in groups for s in g.samples if s.token_ids]
    width = max(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        p, n = len(s.prompt_ids), len(s.token_ids)
        ids[row, :p + n] = torch.tensor(s.prompt_ids + s.token_ids)
        mask[row, :p + n] = 1
        sampled = torch.tensor(s.token_ids)
        if s.observation:  # the environment's tokens of an episode are not the policy's
            sampled = sampled.masked_fill(torch.tensor(s.observation), -100)
        labels[row, p:p + n] = sampled
    return ids, mask, labels


class DraftTrainer:
    """The draft (fp32, on the host) and its own AdamW; ``step`` distills it on a batch, ``weights``
    is what a push carries for it, ``save`` / ``load`` keep it in the trainer's checkpoint."""

    def __init__(self, cfg: TrainConfig, directory: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = cfg.draft
        self.model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.learning_rate, weight_decay=0.0)
        optimizer = directory / "optimizer.pt"
        if optimizer.exists():  # a checkpoint's draft: its optimizer goes on too
            self.optimizer.load_state_dict(torch.load(optimizer, weights_only=True))

    def step(self, groups: list) -> dict[str, Any]:
        """Measure the draft on the batch, then (``draft.train``) take ``steps_per_update``
        optimizer steps on it. ``draft_loss``: mean cross-entropy per sampled token before them;
        ``draft_top1``: how often the draft's most likely token is the one the policy sampled;
        ``draft_loss_last``: the loss of the last of those steps, before its update."""
        ids, mask, labels = completion_batch(groups)
        loss, top1 = self.evaluate(ids, mask, labels)
        metrics = {"draft_loss": loss, "draft_top1": top1}
        if not self.cfg.train:
            return metrics
        self.model.train()
        for _ in range(self.cfg.steps_per_update):
            self.optimizer.zero_grad(set_to_none=True)
            loss, _ = self._loss(ids, mask, labels)
            loss.backward()
            self.optimizer.step()
        self.model.eval()
        return {**metrics, "draft_loss_last": float(loss.detach())}

    def evaluate(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
        """The draft's mean cross-entropy and top-1 agreement on a ``completion_batch``, no update."""
        with torch.no_grad():
            loss, top1 = self._loss(ids, mask, labels)
        return float(loss), float(top1)

    def _loss(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        scored = target != -100
        loss = torch.nn.functional.cross_entropy(logits[scored], target[scored])
        top1 = (logits[scored].argmax(-1) == target[scored]).float().mean()
        return loss, top1

    def weights(self) -> dict[str, torch.Tensor]:
        """The draft's tensors as a push carries them: ``draft.`` + its checkpoint names."""
        return {DRAFT_PREFIX + n: t for n, t in named_weights(self.model).items()}

    def save(self, directory: Path) -> None:
        """The draft (a checkpoint vLLM loads) and its optimizer into ``directory``."""
        self.model.save_pretrained(str(directory), safe_serialization=True)
        torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
