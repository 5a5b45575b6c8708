"""The trainer's peak memory, planned from the config and the machine before any engine starts.

Per trainer rank, in bytes (P parameters, T of them trained, N ranks sharding them, fp32 master
weights as ``Policy`` holds them):
    weights 4P/N, gradients 4T/N, AdamW moments 8T/N, a KL reference 4P/N (LoRA: none);
    one decoder layer gathered whole while it runs (N > 1);
    activations for the most tokens a pass may hold (``micro_tokens``):
        checkpointed: every layer's input (4H per token per layer) + one layer's saved tensors
                      and their gradients (2 * 4 * a per token, a = ``layer_floats``);
        not:          every layer's saved tensors (4a per token per layer);
    the LM head: chunk x vocabulary logits and their gradients (fused), or every completion
        token's (padded), and the head's fp32 weight gradient;
    the push's two bucket buffers per engine (``transport.bucket_mb``, at most the weights);
    the process itself (Python, torch, transformers: ``PROCESS_BYTES``).
What the machine can give is its memory (the cgroup's limit where lower), less what spawned CPU
engines take (``engine_bytes``). A plan over what is available is refused naming the setting to
change and a value that fits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROCESS_BYTES = 600 << 20
"""A trainer process before its model: Python, torch, transformers, the task's libraries."""
ENGINE_PROCESS_BYTES = 1536 << 20
"""A CPU engine process besides its weights, staging and KV cache (vLLM and its libraries)."""
STAGING_COPIES = 4
"""Copies of the weights a CPU engine holds: live, staged update, shadow or rollback (docs/design.md)."""


@dataclass(frozen=True)
class MemoryPlan:
    """One trainer rank's planned peak, part by part, and what the machine can give it."""

    parts: dict[str, int]
    available: int
    micro_tokens: int

    @property
    def peak(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        gb = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
        parts = ", ".join(f"{k} {gb(v)}" for k, v in self.parts.items() if v)
        return f"{gb(self.peak)} GiB ({parts}) of {gb(self.available)} GiB available"


def layer_floats(config: Any) -> int:
    """Floats one decoder layer saves for its backward pass per token (fp32): its norms' inputs
    and outputs, q, k, v, the attention output, and the MLP's (or the routed experts') four
    intermediate products."""
    h = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim, getattr(config, "num_key_value_heads", heads) * head_dim
    experts = getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0)
    if experts:
        k = getattr(config, "num_experts_per_tok", 1)
        mlp = k * (4 * getattr(config, "moe_intermediate_size", config.intermediate_size) + 2 * h) + experts
    else:
        mlp = 4 * config.intermediate_size
    return 4 * h + 3 * q + 2 * kv + heads + mlp


def available_bytes(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """This machine's memory, or the memory limit of this process's cgroup where that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (cgroup_root / limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def _counts(cfg: Any, model_dir: Path) -> tuple[Any, int, int, int]:
    """(the model's config, its parameters, those trained, the bytes of its largest decoder layer)."""
    import torch

    from inflight.trainer.models import empty_model

    model = empty_model(model_dir)
    params = sum(p.numel() for p in model.parameters())
    trained = params
    if cfg.model.lora.enabled:
        from peft import get_peft_model

        with torch.device("meta"):
            model = get_peft_model(model, cfg.model.lora.peft_config())
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layers = set(getattr(model, "_no_split_modules", None) or ())
    largest = max((sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in layers),
                  default=0)
    return model.config, params, trained, 4 * largest


def micro_tokens(cfg: Any, world: int = 1) -> int:
    """The most tokens one pass may hold: the budget, or a rank's whole step at its longest
    (every sample ``engine.max_model_len``, nothing shared) where that is less; M2PO's step is
    one pass."""
    samples = -(-cfg.rollout.group_size * cfg.rollout.groups_per_step // world)
    step = samples * cfg.engine.max_model_len
    return step if cfg.loss.m2_threshold > 0 else min(cfg.optim.micro_batch_tokens, step)


def engine_bytes(cfg: Any, weight_bytes: int) -> int:
    """What the engines a run spawns on this machine's CPU take of its memory (0 on a GPU, or
    when they run elsewhere)."""
    import torch

    if not cfg.engine.spawn or cfg.engine.launcher != "process" or torch.cuda.is_available():
        return 0
    per_engine = ENGINE_PROCESS_BYTES * cfg.engine.tensor_parallel_size + (cfg.engine.kv_cache_gb << 30)
    return cfg.engine.count * (per_engine + STAGING_COPIES * weight_bytes)


def plan(cfg: Any, model_dir: Path, world: int = 1, tokens: int | None = None,
         available: int | None = None) -> MemoryPlan:
    """One trainer rank's peak for ``cfg`` (``tokens``: a pass of this many, default
    ``micro_tokens``); ``available``: what the machine gives it (default: measured)."""
    config, params, trained, layer = _counts(cfg, model_dir)
    tokens = micro_tokens(cfg, world) if tokens is None else tokens
    o, h, n_layers = cfg.optim, config.hidden_size, config.num_hidden_layers
    a = layer_floats(config)
    acts = (4 * tokens * (n_layers * h + 2 * a)) if o.activation_checkpointing else 4 * tokens * n_layers * a
    completion = min(tokens, -(-cfg.rollout.group_size * cfg.rollout.groups_per_step // world)
                     * cfg.task.completion_tokens)
    head_rows = o.head_chunk_tokens if o.packing != "padded" else completion
    vocab = config.vocab_size
    parts = {"process": PROCESS_BYTES, "weights": 4 * params // world, "gradients": 4 * trained // world,
             "optimizer": 8 * trained // world,
             "reference": 4 * params // world if cfg.loss.kl_coef and not cfg.model.lora.enabled else 0,
             "gathered_layer": layer if world > 1 else 0, "activations": acts,
             "head": 3 * 4 * head_rows * vocab + 4 * vocab * h,
             "push_buckets": 2 * cfg.engine.count * min(int(cfg.transport.bucket_mb * 2**20), 4 * params)}
    if available is None:
        available = available_bytes() - engine_bytes(cfg, 4 * params)
    return MemoryPlan(parts, available, tokens)


def fitting_budget(cfg: Any, model_dir: Path, world: int, available: int) -> int | None:
    """The largest ``optim.micro_batch_tokens`` that fits (at least ``engine.max_model_len``), or None."""
    lo, hi = cfg.engine.max_model_len, max(cfg.engine.max_model_len, cfg.optim.micro_batch_tokens)
    if plan(cfg, model_dir, world, lo, available).peak > available:
        return None
    while hi - lo > 64:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if plan(cfg, model_dir, world, mid, available).peak <= available else (lo, mid)
    return lo


def check_fits(cfg: Any, model_dir: Path, world: int = 1, available: int | None = None) -> MemoryPlan:
    """``plan``, or ``ValueError`` naming the setting to change and a value that fits."""
    p = plan(cfg, model_dir, world, available=available)
    if p.peak <= p.available:
        return p
    if available is None and p.available < PROCESS_BYTES:
        machine, engines = available_bytes(), engine_bytes(cfg, p.parts["weights"] * world)
        raise ValueError(f"the {cfg.engine.count} engine(s) this run spawns on this machine's CPU would take "
                         f"{engines / 2**30:.1f} GiB of its {machine / 2**30:.1f} GiB (engine.kv_cache_gb="
                         f"{cfg.engine.kv_cache_gb} each, their weights and staging), leaving the trainer nothing: "
                         "lower engine.kv_cache_gb or engine.count")
    head = f"the trainer would need {p.describe()} at a pass of {p.micro_tokens} tokens"
    if cfg.loss.m2_threshold == 0 and (budget := fitting_budget(cfg, model_dir, world, p.available)) is not None:
        raise ValueError(f"{head}: set optim.micro_batch_tokens={budget} (now {cfg.optim.micro_batch_tokens})")
    if not cfg.optim.activation_checkpointing:
        raise ValueError(f"{head}: set optim.activation_checkpointing=true")
    raise ValueError(f"{head}: even one sample of engine.max_model_len={cfg.engine.max_model_len} tokens does not "
                     "fit; lower engine.max_model_len, train a LoRA adapter (model.lora.rank), or use more trainer "
                     "ranks (--nproc)")
