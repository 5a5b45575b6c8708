"""A speculating engine's draft model committed with its target: one update carries both, and
both go live in the same commit window, so the draft never proposes from weights the engine
has dropped, and acceptance keeps up with a policy that moves.

The update's schema is the target checkpoint's tensors beside the draft checkpoint's, the latter
named ``draft.<name>`` (``DRAFT_PREFIX``). ``DraftedCommit`` hands each strategy its own tensors
(each built by ``make_strategy`` for its model, as an engine without a draft builds one) and
keeps the two all or nothing: a draft that fails to apply takes the target's apply back. The
draft's tensors arrive whole (no shard plan) and a drafted engine commits the whole model at
once (``commit_unit="model"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from inflight.engine.commit.base import CommitStrategy, make_strategy
from inflight.engine.commit.engine_checkpoint import engine_schema
from inflight.protocol import ShardPlan
from inflight.transport.schema import TensorSchema

DRAFT_PREFIX = "draft."
"""Where a draft model's tensors sit in an update: ``draft.`` + the name in its checkpoint."""


class _DraftRunner:
    """What ``engine_schema`` and ``make_strategy`` read of a model runner, for the draft model."""

    def __init__(self, runner: Any, model: torch.nn.Module, model_config: Any) -> None:
        self.device = runner.device
        self.model_config = model_config
        self._model = model

    def get_model(self) -> torch.nn.Module:
        return self._model


def draft_model_of(model_runner: Any) -> torch.nn.Module | None:
    """The draft model vLLM 0.32's ``draft_model`` proposer runs, or None (no speculation, or a
    proposer without weights)."""
    drafter = getattr(model_runner, "drafter", None)
    return getattr(drafter, "model", None) if drafter is not None else None


def start_model(model_runner: Any, config: Any, vllm_config: Any) -> tuple[TensorSchema, CommitStrategy]:
    """The update schema and commit strategy of an engine serving a full model (``config``: its
    ``InflightConfig``): the target's, and with a draft model the two together."""
    quantized, eager = vllm_config.model_config.quantization is not None, vllm_config.model_config.enforce_eager
    schema = engine_schema(model_runner)
    strategy = make_strategy(model_runner, config.commit, schema, quantized=quantized, eager=eager,
                             commit_unit=config.commit_unit, window=config.staged_groups)
    draft_model = draft_model_of(model_runner)
    if draft_model is None:
        return schema, strategy
    if config.commit_unit != "model":
        raise ValueError(f"inflight: commit_unit={config.commit_unit!r} with a draft model: a drafted engine commits "
                         "target and draft at once (commit_unit='model')")
    runner = _DraftRunner(model_runner, draft_model, vllm_config.speculative_config.draft_model_config)
    draft_schema = engine_schema(runner)
    draft = make_strategy(runner, config.commit, draft_schema, quantized=quantized, eager=eager)
    clash = sorted(n for n in schema.tensors if n.startswith(DRAFT_PREFIX))
    if clash:
        raise ValueError(f"inflight: the target checkpoint has tensors named {DRAFT_PREFIX}*: {clash[:3]}")
    joined = {**schema.tensors, **{DRAFT_PREFIX + n: v for n, v in draft_schema.tensors.items()}}
    return TensorSchema(joined), DraftedCommit(strategy, draft)


def _split(weights: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``weights`` as (the target's, the draft's by its own names); None stays None."""
    if weights is None:
        return None, None
    target = {n: t for n, t in weights.items() if not n.startswith(DRAFT_PREFIX)}
    draft = {n[len(DRAFT_PREFIX):]: t for n, t in weights.items() if n.startswith(DRAFT_PREFIX)}
    return target, draft


class DraftedCommit:
    """The target's strategy and the draft's, as one ``CommitStrategy`` (module docstring)."""

    def __init__(self, target: CommitStrategy, draft: CommitStrategy) -> None:
        self.target, self.draft = target, draft
        self.name = target.name
        self.needs_rollback_copy = any(getattr(s, "needs_rollback_copy", True) for s in (target, draft))
        self._target_applied = False

    def feed(self, weights: Mapping[str, torch.Tensor]) -> None:
        target, draft = _split(weights)
        if target:
            self.target.feed(target)
        if draft:
            self.draft.feed(draft)

    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        target, draft = _split(weights)
        self.target.prepare(target)
        self.draft.prepare(draft)

    def discard(self) -> None:
        self.target.discard()
        self.draft.discard()

    def apply(self) -> None:
        self._target_applied = False
        self.target.apply()
        self._target_applied = True
        self.draft.apply()

    def restore(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        target, draft = _split(previous)
        if self._target_applied:  # the draft failed: take the target's apply back too
            self.draft.restore(draft)
            self.target.undo(target)
        else:
            self.target.restore(target)

    def undo(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        target, draft = _split(previous)
        self.draft.undo(draft)
        self.target.undo(target)

    def release_rollback(self) -> None:
        self.target.release_rollback()
        self.draft.release_rollback()

    def shard_plan(self) -> ShardPlan | None:
        return None

    def held_bytes(self) -> int:
        return self.target.held_bytes() + self.draft.held_bytes()

    def close(self) -> None:
        self.target.close()
        self.draft.close()
