"""Expert parallelism over the trainer's ranks: each rank owns num_experts / world experts of
every MoE layer, and each routed (token, expert) row travels to its expert's owner and back,
all-to-all, so no rank ever gathers another rank's experts to compute.

Invariants:
- rank r owns experts [r * E / world, (r + 1) * E / world) of each layer (``owner``); an
  experts module's 3-D parameters are DTensors sharded by expert (``Shard(0)``) on the ranks'
  1-D mesh, the one FSDP shards over, so the optimizer, the gradient norm,
  torch.distributed.checkpoint and ``ShardedSource`` read them as they read FSDP's shards,
  and FSDP leaves them alone (``fully_shard``'s ``ignored_params``);
- the forward is one of transformers' experts implementations (``NAME``, in its
  ``ExpertsInterface``), the module's own eager math on the owner's rows; the gate weights
  multiply at the origin, so the router's gradient stays on its rank and routing replay's
  hooks on the gate see exactly what they see without expert parallelism;
- per call every rank runs the same collectives in the same order, tokens or none: the
  counts, the dispatch and the combine all-to-alls, and in the backward the last two with
  their splits swapped;
- every local expert runs on its rows, none included, so each rank's expert parameters get a
  gradient (zeros where no token came) whenever the unsharded module's would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

NAME = "inflight_expert_parallel"
"""The experts implementation a sharded model's config names (``ExpertsInterface``)."""

SUPPORTED = frozenset({
    "Qwen3MoeExperts", "Qwen2MoeExperts", "Qwen3NextExperts", "Qwen3_5MoeExperts", "Qwen3VLMoeTextExperts",
    "OlmoeExperts", "FlexOlmoExperts", "MixtralExperts", "PhimoeExperts", "MiniMaxExperts", "MiniMaxM2Experts",
    "DeepseekV2Experts", "DeepseekV3Experts", "Glm4MoeExperts", "Ernie4_5_MoeExperts", "GraniteMoeExperts",
    "GraniteMoeSharedExperts", "JambaExperts", "HunYuanMoEV1Experts",
})
"""transformers 5.19's experts classes that share Qwen3-MoE's contract: ``@use_experts_implementation``
with its defaults, ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I), the default gate
(act(gate) * up), the eager forward ``experts(hidden (n, H), top_k_index (n, k), top_k_weights (n, k))``
word for word (tests/engine/test_expert_parallel.py checks each)."""


@dataclass
class ExpertShard:
    """One experts module's place in expert parallelism, kept on the module (``_inflight_ep``)."""

    group: dist.ProcessGroup
    rank: int
    world: int
    per_rank: int
    sent: int = 0
    """Bytes this rank sent to other ranks through this layer's all-to-alls (``all_to_all_bytes``)."""


def owner(experts: torch.Tensor, per_rank: int) -> torch.Tensor:
    """The rank that owns each expert id of ``experts``: block ownership, ``per_rank`` each."""
    return torch.div(experts, per_rank, rounding_mode="floor")


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``model``'s MoE experts modules by qualified name: the ``experts`` of every module that has one."""
    found = {}
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module):
            found[f"{name}.experts" if name else "experts"] = experts
    return found


def _fused_contract(m: nn.Module) -> bool:
    """Whether ``m`` holds its experts as transformers' fused eager experts do (``SUPPORTED``)."""
    from transformers.integrations.moe import _default_apply_gate

    params = dict(m.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or params["gate_up_proj"].ndim != 3:
        return False
    e, two_i, h = params["gate_up_proj"].shape
    return (tuple(params["down_proj"].shape) == (e, h, two_i // 2) and two_i % 2 == 0
            and getattr(m, "num_experts", None) == e and callable(getattr(m, "act_fn", None))
            and getattr(m, "has_gate", False) and not getattr(m, "has_bias", True)
            and not getattr(m, "is_transposed", True) and getattr(m, "is_concatenated", False)
            and getattr(type(m), "_apply_gate", None) is _default_apply_gate)


def check_expert_parallel(model: nn.Module, world: int) -> dict[str, nn.Module]:
    """``model``'s experts modules (``experts_modules``), each one that expert parallelism over
    ``world`` ranks cannot shard refused by name (``ValueError``) before any collective."""
    found = experts_modules(model)
    for name, m in found.items():
        cls = type(m).__name__
        if cls not in SUPPORTED or not _fused_contract(m):
            raise ValueError(f"optim.expert_parallel=true: {name} is a {cls}, not one of the experts modules expert "
                             "parallelism shards (transformers' fused experts of Qwen3-MoE's contract: "
                             f"{', '.join(sorted(SUPPORTED)[:4])}, ...); set optim.expert_parallel=false to shard it "
                             "with FSDP like a dense layer")
        experts = m.gate_up_proj.shape[0]
        if experts % world:
            raise ValueError(f"optim.expert_parallel=true: {name} ({cls}) has {experts} experts, which {world} "
                             f"trainer ranks cannot own in equal shares; run on a number of ranks that divides "
                             f"{experts}, or set optim.expert_parallel=false")
    return found


def shard_experts(model: nn.Module, mesh: Any, device: torch.device) -> list[nn.Parameter]:
    """Every rank, before FSDP: each experts module's 3-D parameters replaced by DTensors
    ``Shard(0)`` on ``mesh`` (this rank's experts, copied to ``device``; on a meta model, meta),
    its forward made the all-to-all one (``NAME``). Returns the new parameters (FSDP's
    ``ignored_params``); none for a dense model."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    found = check_expert_parallel(model, world)
    params = []
    for m in found.values():
        per_rank = m.gate_up_proj.shape[0] // world
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(m, name)
            if p.is_meta:
                local = torch.empty((per_rank, *p.shape[1:]), dtype=p.dtype, device="meta")
            else:
                local = p.detach()[rank * per_rank:(rank + 1) * per_rank].to(device, copy=True)
            shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            setattr(m, name, nn.Parameter(shard, requires_grad=p.requires_grad))
            params.append(getattr(m, name))
        m._inflight_ep = ExpertShard(group=mesh.get_group(), rank=rank, world=world, per_rank=per_rank)
    if found:
        _dispatch_to_expert_parallel(model, found)
    return params


def _dispatch_to_expert_parallel(model: nn.Module, found: dict[str, nn.Module]) -> None:
    """``NAME`` registered in transformers' ``ExpertsInterface`` and made the experts
    implementation of ``model`` (its outermost ``PreTrainedModel``: a PEFT model's base)."""
    from transformers import PreTrainedModel
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, expert_parallel_forward)
    top = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if top is not None:
        top.set_experts_implementation(NAME)
    for name, m in found.items():
        if getattr(getattr(m, "config", None), "_experts_implementation", None) != NAME:
            raise ValueError(f"optim.expert_parallel=true: {name} ({type(m).__name__}) does not dispatch through "
                             "transformers' experts interface, so its forward cannot be made expert-parallel; set "
                             "optim.expert_parallel=false")


def all_to_all_bytes(model: nn.Module, reset: bool = False) -> dict[str, int]:
    """Per experts module of ``model`` (by qualified name): the bytes this rank sent to other
    ranks through its all-to-alls (counts, dispatch, combine; forward and backward) since the
    last ``reset``; empty for a model without expert parallelism."""
    out = {}
    for name, m in experts_modules(model).items():
        ep = getattr(m, "_inflight_ep", None)
        if ep is not None:
            out[name] = ep.sent
            if reset:
                ep.sent = 0
    return out


def expert_parallel_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts module ``self``'s forward with its experts sharded over the ranks: each
    (token, slot) row to its expert's owner, the owner's experts on what arrived, back, the
    gate weights applied here, summed into the token rows."""
    ep: ExpertShard | None = getattr(self, "_inflight_ep", None)
    if ep is None:
        raise RuntimeError(f"{type(self).__name__} names the {NAME} experts implementation but was not sharded "
                           "(inflight.trainer.expert_parallel.shard_experts)")
    n, k = top_k_index.shape
    experts = top_k_index.reshape(-1)
    key = owner(experts, ep.per_rank) * ep.per_rank + experts % ep.per_rank  # (destination, its local expert)
    order = torch.argsort(key, stable=True)
    send_counts = torch.bincount(key, minlength=ep.world * ep.per_rank)
    if send_counts.numel() != ep.world * ep.per_rank:
        raise ValueError(f"{type(self).__name__}: an expert id >= {ep.world * ep.per_rank} experts")
    recv_counts = _all_to_all(send_counts, None, None, ep)
    send = send_counts.view(ep.world, ep.per_rank).sum(1).tolist()
    receive = recv_counts.view(ep.world, ep.per_rank).sum(1).tolist()
    token = torch.div(order, k, rounding_mode="floor")
    rows = _AllToAll.apply(hidden_states[token], receive, send, ep)  # dispatch
    local = torch.repeat_interleave(torch.arange(ep.per_rank, device=rows.device).repeat(ep.world), recv_counts)
    back = _AllToAll.apply(_local_experts(self, rows, local, ep.per_rank), send, receive, ep)  # combine
    weighted = back * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add_(0, token, weighted.to(hidden_states.dtype))


def _local_experts(m: nn.Module, rows: torch.Tensor, local: torch.Tensor, per_rank: int) -> torch.Tensor:
    """This rank's experts of ``m`` on the rows that arrived (``local``: each row's local
    expert), as the module's eager forward computes one expert: down(act(gate) * up)."""
    gate_up, down = m.gate_up_proj.to_local(), m.down_proj.to_local()
    out = torch.zeros_like(rows)
    for e in range(per_rank):  # every expert, rows or none: each gets its gradient
        idx = (local == e).nonzero().squeeze(-1)
        x = rows[idx]
        y = nn.functional.linear(m._apply_gate(nn.functional.linear(x, gate_up[e].to(x.dtype))), down[e].to(x.dtype))
        out.index_add_(0, idx, y.to(out.dtype))
    return out


def _all_to_all(x: torch.Tensor, receive: list[int] | None, send: list[int] | None, ep: ExpertShard) -> torch.Tensor:
    """``x``'s rows, ``send[r]`` of them to rank r in order, exchanged for ``receive[r]`` from
    each rank r (None: equal shares); the bytes sent to other ranks counted on ``ep``."""
    x = x.contiguous()
    rows = x.shape[0] if receive is None else sum(receive)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, receive, send, group=ep.group)
    sent = x.shape[0] - (x.shape[0] // ep.world if send is None else send[ep.rank])  # not to itself
    ep.sent += sent * math.prod(x.shape[1:]) * x.element_size()
    return out


class _AllToAll(torch.autograd.Function):
    """``_all_to_all`` as an autograd function: its backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, receive: list[int], send: list[int], ep: ExpertShard) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.ep = receive, send, ep
        return _all_to_all(x, receive, send, ep)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.send, ctx.receive, ctx.ep), None, None, None
