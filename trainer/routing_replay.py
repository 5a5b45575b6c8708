"""Rollout routing replay (R3): the trainer's forward routes each sampled token to the
experts the engine used for it.

R3 fixes the *selection*, never the weights (why: docs/design.md): at a replayed position each MoE layer uses
the recorded top-k expert ids, and the gate weights still come from the current router logits, so the router
keeps learning:

    p = softmax(router_logits)              (float32, as the router computes it)
    w_j = p[e_j]  for the recorded e_1..e_k,  then / sum_j w_j  when the router renormalises

The engine records, for completion token t, the routing of the position whose logits sampled
it (``inflight.engine.routing``); in the trainer's batch that is column ``P - 1 + t`` (prompts
left-padded to P). Other positions (the prompt, padding) keep the router's own choice.

Which routers: transformers' sparse-MoE blocks whose ``gate`` returns
``(router_logits, top_k_weights, top_k_index)`` (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, ...).
Every call checks that the formula above reproduces the router's own weights for its own
selection, so a router with other gate math (DeepSeek's grouped sigmoid, biases) is refused
loudly instead of replayed wrongly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from inflight.engine.routing import unpack
from inflight.protocol import RolloutGroup

NO_ROUTE = -1
"""A position without a recorded routing: the router chooses."""


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of ``model``'s sparse-MoE blocks (a ``gate`` beside ``experts``), in model order."""
    return [m.gate for m in model.modules() if isinstance(getattr(m, "gate", None), torch.nn.Module)
            and isinstance(getattr(m, "experts", None), torch.nn.Module)]


def gate_weights(logits: torch.Tensor, index: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The gate weights of the experts ``index`` (N, k) from ``logits`` (N, E)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, index)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def collate_routing(groups: Sequence[RolloutGroup], input_ids: torch.Tensor, completion_len: int) -> torch.Tensor:
    """(B, S, layers, k) int64 expert ids for a batch collated by ``inflight.trainer.loss.collate``:
    sample i's completion token t at column ``S - completion_len - 1 + t``, ``NO_ROUTE`` elsewhere."""
    samples = [s for g in groups for s in g.samples]
    missing = [s.sample_id for s in samples if not s.routing]
    if missing:
        raise ValueError(f"loss.routing_replay=true but samples {missing[:3]} carry no routing: the engine must "
                         "record it (InflightConfig(record_routing=True); inflight.trainer.rollout.engine_process does "
                         "when replay is on)")
    shapes = {(s.routing_layers, s.routing_k) for s in samples}
    if len(shapes) != 1:
        raise ValueError(f"samples of one batch carry routing of different shapes {sorted(shapes)}")
    (layers, k), (b, width) = shapes.pop(), input_ids.shape
    start = width - completion_len - 1  # the position that sampled completion token 0
    out = torch.full((b, width, layers, k), NO_ROUTE, dtype=torch.long)
    for i, s in enumerate(samples):
        rows = torch.from_numpy(unpack(s.routing, layers, k).astype("int64"))
        out[i, start: start + rows.shape[0]] = rows
    return out


class RoutingReplay:
    """Replays recorded routing in ``model``'s MoE routers while ``replaying`` is active."""

    def __init__(self, model: torch.nn.Module, enabled: bool = True) -> None:
        self.enabled = enabled
        self.routers = moe_routers(model) if enabled else []
        if enabled and not self.routers:
            raise ValueError(f"loss.routing_replay=true but {type(model).__name__} has no sparse-MoE router to replay")
        self._routing: torch.Tensor | None = None
        self._counts = torch.zeros(3, dtype=torch.long)  # replayed rows, rows whose expert set differed, router calls
        self._counting = True

    @contextmanager
    def replaying(self, routing: torch.Tensor | None) -> Iterator[None]:
        """Inside: every forward of the model replays ``routing`` (B, S, layers, k); None: no replay."""
        if not self.enabled or routing is None:
            yield
            return
        if routing.shape[2] != len(self.routers):
            raise ValueError(f"routing covers {routing.shape[2]} MoE layers, the model has {len(self.routers)}")
        self._routing = routing
        hooks = [r.register_forward_hook(partial(self._replay, layer)) for layer, r in enumerate(self.routers)]
        try:
            yield
        finally:
            for h in hooks:
                h.remove()
            self._routing = None

    @contextmanager
    def counting(self, on: bool) -> Iterator[None]:
        """Inside, replays are counted only if ``on``: a checkpointed layer recomputing in the
        backward pass replays what its forward already counted."""
        before, self._counting = self._counting, on
        try:
            yield
        finally:
            self._counting = before

    def reset(self) -> None:
        """Start counting anew (``stats``): at the start of each optimizer step."""
        self._counts.zero_()

    def counts(self) -> tuple[int, int]:
        """Since ``reset``: the replayed (token, layer) rows, and those where the trainer's
        router would have chosen another set of experts than the engine did."""
        rows, differ, _ = self._counts.tolist()
        return rows, differ

    def stats(self, more: tuple[int, int] = (0, 0)) -> dict[str, float]:
        """Over every ``replaying`` since ``reset``, plus ``more`` (other ranks' ``counts``): the
        rows replayed, and the fraction where the trainer's router would have chosen another
        set of experts than the engine did."""
        rows, differ = (a + b for a, b in zip(self.counts(), more))
        return ({"routing_replayed_rows": rows, "routing_mismatch": differ / rows if rows else 0.0} if self.enabled
                else {})

    def _replay(self, layer: int, router: torch.nn.Module, args: Any, output: Any) -> tuple[torch.Tensor, ...]:
        if not (isinstance(output, tuple) and len(output) == 3):
            raise RuntimeError(f"routing replay: {type(router).__name__} does not return (logits, weights, index)")
        logits, weights, index = output
        renormalize = bool(getattr(router, "norm_topk_prob", True))
        if not torch.allclose(gate_weights(logits.detach(), index, renormalize), weights.detach(), rtol=1e-5,
                              atol=1e-7):
            raise RuntimeError(f"routing replay: {type(router).__name__}'s gate weights are not softmax-top-k"
                               f"{' renormalised' if renormalize else ''}; replaying it would change its math")
        assert self._routing is not None
        recorded = self._routing[:, :, layer].reshape(-1, index.shape[-1]).to(index.device)
        if recorded.shape[0] != index.shape[0]:
            raise RuntimeError(f"routing replay: {recorded.shape[0]} recorded positions, the router saw "
                               f"{index.shape[0]}")
        if int(recorded.max()) >= logits.shape[-1]:
            raise ValueError(f"routing replay: expert id {int(recorded.max())} >= {logits.shape[-1]} experts")
        replay = recorded[:, 0] != NO_ROUTE
        chosen = torch.where(replay[:, None], recorded, index)
        same = torch.sort(chosen, -1).values.eq(torch.sort(index, -1).values).all(-1)
        if self._counting:
            self._counts += torch.tensor([int(replay.sum()), int((replay & ~same).sum()), 1])
        return logits, gate_weights(logits, chosen, renormalize), chosen
