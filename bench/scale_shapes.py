"""What one tensor-parallel rank reads of a checkpoint, from the model's architecture alone.

Every checkpoint tensor of a model (named and shaped as its Hugging Face checkpoint has it)
with the box (start, length per dim) a TP rank's vLLM weight loaders read of it, following
vLLM's tensor-parallel layers:

- column parallel (q/k/v, gate/up, MLA's q_b/kv_b, each expert's gate/up): a slice of dim 0;
- row parallel (o_proj, down_proj, each expert's down): a slice of dim 1;
- vocabulary parallel (embed_tokens, lm_head): rows of the vocabulary padded to a multiple of
  64 (``pad_vocab_size``), split evenly; the last rank reads fewer rows, the padding none;
- k/v with fewer KV heads than ranks: vLLM replicates heads, and rank r reads head
  ``r // (tp // kv_heads)`` (``QKVParallelLinear``): whole on every rank when there is one;
- read whole on every rank: norms, the MoE router and its bias, MLA's q_a_proj and
  kv_a_proj_with_mqa (``ReplicatedLinear``), and tensors named in ``Arch.fallbacks`` (read
  through a transform, not a box). Experts are split per expert (TP, no expert parallelism).

Bytes are counted as ``inflight.shard_plan.plan_bytes`` counts a real plan: a box smaller than
its tensor is ``sharded``, a whole tensor ``replicated``, a fallback ``fallback``. Every rank is
sent its own boxes (replicated tensors go to every rank), so what the trainer sends one engine
per update is the sum over its ranks (``link_bytes``). One ``dtype_bytes`` for every tensor: an
FP8 checkpoint's block scales (1/16384 of its weights, 4 B each) and wider norms are left out.

A layer-granular commit (``commit_unit="layer"``) stages and commits one *layer group* at a
time, grouped as the engine groups them (``inflight.layer_groups``: the embeddings, each
decoder layer, the rest); ``group_bytes`` is each group's bytes on one rank, in commit order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from functools import lru_cache

from inflight.layer_groups import group_of
from inflight.shard_plan import PlanBytes

SPLITS = ("col", "row", "vocab", "kv", "whole")
FAMILIES = {"llama": "gqa", "qwen2": "gqa", "qwen3": "gqa", "qwen3_moe": "gqa", "deepseek_v3": "mla", "kimi_k2": "mla"}
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, kw_only=True)
class Arch:
    """The shape-deciding fields of a model's ``config.json`` (``from_config``)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: per-head RMSNorm of q and k
    experts: int = 0  # routed experts per MoE layer; 0: dense
    moe_intermediate_size: int = 0
    shared_experts: int = 0
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is an MoE
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias
    q_lora_rank: int = 0  # MLA (DeepSeek-V3, Kimi-K2) from here on
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    fallbacks: tuple[str, ...] = ()  # name suffixes a commit reads through a transform: whole on every rank

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ValueError(f"Arch.model_type={self.model_type!r} is not one of {sorted(FAMILIES)}")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and v < (1 if f.name in _POSITIVE else 0):
                raise ValueError(f"Arch.{f.name}={v} must be {'> 0' if f.name in _POSITIVE else '>= 0'}")
        if self.experts and not self.moe_intermediate_size:
            raise ValueError(f"Arch: experts={self.experts} needs moe_intermediate_size > 0")
        if bad := [i for i in self.moe_layers if not 0 <= i < self.num_hidden_layers]:
            raise ValueError(f"Arch.moe_layers={bad} outside 0..{self.num_hidden_layers - 1}")
        if self.mla and not (self.kv_lora_rank and self.qk_nope_head_dim and self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError(f"Arch({self.model_type}): MLA needs kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
                             f"v_head_dim, got {self.kv_lora_rank}, {self.qk_nope_head_dim}, {self.qk_rope_head_dim}, "
                             f"{self.v_head_dim}")

    @property
    def mla(self) -> bool:
        return FAMILIES[self.model_type] == "mla"

    @classmethod
    def from_config(cls, cfg: Mapping) -> Arch:
        """From a Hugging Face ``config.json`` (its key names, as the scenarios' ``[arch]`` keep them)."""
        try:
            mt, layers, heads = cfg["model_type"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
            experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
            if "first_k_dense_replace" in cfg:  # DeepSeek-V3: the first k layers dense, then every layer MoE
                moe = range(cfg["first_k_dense_replace"], layers) if experts else ()
            else:  # Qwen3-MoE: every decoder_sparse_step-th layer, but for mlp_only_layers
                step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers", ()))
                moe = [i for i in range(layers) if experts and i not in dense and (i + 1) % step == 0]
            return cls(model_type=mt, hidden_size=cfg["hidden_size"], num_hidden_layers=layers,
                       num_attention_heads=heads,
                       num_key_value_heads=cfg.get("num_key_value_heads") or heads,
                       head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                       intermediate_size=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                       tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                       qkv_bias=cfg.get("attention_bias", mt == "qwen2"), qk_norm=mt in ("qwen3", "qwen3_moe"),
                       experts=experts, moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
                       shared_experts=cfg.get("n_shared_experts") or 0, moe_layers=tuple(moe),
                       router_bias=cfg.get("topk_method") == "noaux_tc", q_lora_rank=cfg.get("q_lora_rank") or 0,
                       kv_lora_rank=cfg.get("kv_lora_rank", 0), qk_nope_head_dim=cfg.get("qk_nope_head_dim", 0),
                       qk_rope_head_dim=cfg.get("qk_rope_head_dim", 0), v_head_dim=cfg.get("v_head_dim", 0),
                       fallbacks=tuple(cfg.get("fallbacks", ())))
        except KeyError as e:
            raise ValueError(f"Arch.from_config: config has no {e}") from None


_POSITIVE = frozenset({"hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "intermediate_size", "vocab_size"})


@dataclass(frozen=True, kw_only=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    split: str  # one of SPLITS: how a rank reads it

    def __post_init__(self) -> None:
        if self.split not in SPLITS or not self.shape or min(self.shape) < 1:
            raise ValueError(f"Tensor {self.name}: split={self.split!r}, shape={self.shape}: need one of {SPLITS} "
                             f"and every dim >= 1")


def _t(name: str, shape: tuple[int, ...], split: str) -> Tensor:
    return Tensor(name=name, shape=shape, split=split)


def _mlp(prefix: str, width: int, hidden: int) -> Iterator[Tensor]:
    yield _t(f"{prefix}.gate_proj.weight", (width, hidden), "col")
    yield _t(f"{prefix}.up_proj.weight", (width, hidden), "col")
    yield _t(f"{prefix}.down_proj.weight", (hidden, width), "row")


def _attention(a: Arch, p: str) -> Iterator[Tensor]:
    h = a.hidden_size
    if a.mla:
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            yield _t(f"{p}.q_a_proj.weight", (a.q_lora_rank, h), "whole")
            yield _t(f"{p}.q_a_layernorm.weight", (a.q_lora_rank,), "whole")
            yield _t(f"{p}.q_b_proj.weight", (a.num_attention_heads * qk, a.q_lora_rank), "col")
        else:
            yield _t(f"{p}.q_proj.weight", (a.num_attention_heads * qk, h), "col")
        yield _t(f"{p}.kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, h), "whole")
        yield _t(f"{p}.kv_a_layernorm.weight", (a.kv_lora_rank,), "whole")
        yield _t(f"{p}.kv_b_proj.weight", (a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
                     "col")
        yield _t(f"{p}.o_proj.weight", (h, a.num_attention_heads * a.v_head_dim), "row")
        return
    q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    for name, rows, split in (("q", q, "col"), ("k", kv, "kv"), ("v", kv, "kv")):
        yield _t(f"{p}.{name}_proj.weight", (rows, h), split)
        if a.qkv_bias:
            yield _t(f"{p}.{name}_proj.bias", (rows,), split)
    yield _t(f"{p}.o_proj.weight", (h, q), "row")
    if a.qk_norm:
        yield _t(f"{p}.q_norm.weight", (a.head_dim,), "whole")
        yield _t(f"{p}.k_norm.weight", (a.head_dim,), "whole")


def tensors(a: Arch) -> Iterator[Tensor]:
    """Every tensor of the checkpoint, in layer order."""
    h, moe = a.hidden_size, set(a.moe_layers)
    yield _t("model.embed_tokens.weight", (a.vocab_size, h), "vocab")
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}"
        yield _t(f"{p}.input_layernorm.weight", (h,), "whole")
        yield _t(f"{p}.post_attention_layernorm.weight", (h,), "whole")
        yield from _attention(a, f"{p}.self_attn")
        if i not in moe:
            yield from _mlp(f"{p}.mlp", a.intermediate_size, h)
            continue
        yield _t(f"{p}.mlp.gate.weight", (a.experts, h), "whole")
        if a.router_bias:
            yield _t(f"{p}.mlp.gate.e_score_correction_bias", (a.experts,), "whole")
        for e in range(a.experts):
            yield from _mlp(f"{p}.mlp.experts.{e}", a.moe_intermediate_size, h)
        if a.shared_experts:
            yield from _mlp(f"{p}.mlp.shared_experts", a.shared_experts * a.moe_intermediate_size, h)
    yield _t("model.norm.weight", (h,), "whole")
    if not a.tie_word_embeddings:
        yield _t("lm_head.weight", (a.vocab_size, h), "vocab")


def _fallback(a: Arch, t: Tensor) -> bool:
    return bool(a.fallbacks) and t.name.endswith(a.fallbacks)


def _even(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what}: {n} rows/columns do not split over tp={tp}")
    return n // tp


def box(a: Arch, t: Tensor, tp: int, rank: int) -> Box:
    """The box rank ``rank`` of a ``tp``-way engine reads of ``t``."""
    if not 0 <= rank < tp:
        raise ValueError(f"box: rank={rank} outside 0..{tp - 1}")
    zero, shape = (0,) * len(t.shape), t.shape
    if t.split == "whole" or tp == 1 or _fallback(a, t):
        return zero, shape
    if t.split == "vocab":  # rows [r * P, (r + 1) * P) of the padded vocabulary, padding rows not read
        per = _even(-(-shape[0] // VOCAB_PADDING) * VOCAB_PADDING, tp, t.name)
        lo, hi = min(rank * per, shape[0]), min((rank + 1) * per, shape[0])
        return (lo,) + zero[1:], (hi - lo,) + shape[1:]
    dim = 1 if t.split == "row" else 0
    if t.split == "kv" and tp >= a.num_key_value_heads:  # heads replicated: rank r reads head r // (tp // kv)
        n, start = a.head_dim, rank // _even(tp, a.num_key_value_heads, f"{t.name} kv heads") * a.head_dim
    else:
        n = _even(shape[dim], tp, t.name)
        start = rank * n
    return (tuple(start if d == dim else 0 for d in range(len(shape))),
            tuple(n if d == dim else size for d, size in enumerate(shape)))


@lru_cache(maxsize=16)
def _alike(a: Arch) -> tuple[tuple[Tensor, int], ...]:
    """One tensor of each (shape, split, fallback) with how many there are: a rank reads the same
    box of each (a 1T MoE has ~70,000 expert tensors of three kinds)."""
    groups: dict[tuple, list] = {}
    for t in tensors(a):
        groups.setdefault((t.shape, t.split, _fallback(a, t)), [t, 0])[1] += 1
    return tuple((t, n) for t, n in groups.values())


@lru_cache(maxsize=256)
def rank_bytes(a: Arch, tp: int, rank: int, dtype_bytes: float) -> PlanBytes:
    """Bytes rank ``rank`` of a ``tp``-way engine reads of ``a``'s checkpoint, in ``dtype_bytes``:
    what it is sent and stages of an update, by kind, as ``plan_bytes`` counts a real plan."""
    if tp < 1 or dtype_bytes <= 0:
        raise ValueError(f"rank_bytes: tp={tp} must be >= 1 and dtype_bytes={dtype_bytes} > 0")
    counts = [0, 0, 0]
    for t, n in _alike(a):
        _, length = box(a, t, tp, rank)
        kind = 2 if _fallback(a, t) else 1 if length == t.shape else 0
        counts[kind] += n * math.prod(length)
    return PlanBytes(*(round(c * dtype_bytes) for c in counts))


def link_bytes(a: Arch, tp: int, dtype_bytes: float) -> int:
    """What the trainer sends one engine per update: every rank's boxes, whole tensors to each."""
    return sum(rank_bytes(a, tp, r, dtype_bytes).total for r in range(tp))


def staging_bytes(a: Arch, tp: int, dtype_bytes: float) -> int:
    """The most any one rank stages of a version (the memory every rank of the engine must have)."""
    return max(rank_bytes(a, tp, r, dtype_bytes).total for r in range(tp))


def param_count(a: Arch) -> int:
    return sum(n * math.prod(t.shape) for t, n in _alike(a))


@lru_cache(maxsize=16)
def _groups(a: Arch) -> tuple[tuple[tuple[int, int], tuple[tuple[Tensor, int], ...]], ...]:
    """The checkpoint's layer groups in commit order, keyed as the engine keys them
    (``inflight.layer_groups.group_of``), each as ``_alike`` has a checkpoint: one tensor of
    each kind with its count (a Kimi-K2 layer holds ~1,150 expert tensors of three kinds)."""
    by: dict[tuple[int, int], dict[tuple, list]] = {}
    for t in tensors(a):
        by.setdefault(group_of(t.name), {}).setdefault((t.shape, t.split, _fallback(a, t)), [t, 0])[1] += 1
    return tuple((k, tuple((t, n) for t, n in by[k].values())) for k in sorted(by))


def group_names(a: Arch) -> tuple[str, ...]:
    """Each layer group's name, in commit order: ``embeddings`` (with a tied head), ``layer i``,
    ``norm + head`` (the final norm alone where the head is tied)."""
    names = {0: "embeddings", 2: "norm" if a.tie_word_embeddings else "norm + head"}
    return tuple(f"layer {i}" if kind == 1 else names[kind] for (kind, i), _ in _groups(a))


@lru_cache(maxsize=256)
def group_bytes(a: Arch, tp: int, rank: int, dtype_bytes: float) -> tuple[int, ...]:
    """Bytes of each layer group (commit order) rank ``rank`` of a ``tp``-way engine reads: what
    it stages and copies of that group in a layer-granular update. They add up to ``rank_bytes``."""
    if tp < 1 or dtype_bytes <= 0:
        raise ValueError(f"group_bytes: tp={tp} must be >= 1 and dtype_bytes={dtype_bytes} > 0")
    return tuple(round(dtype_bytes * sum(n * math.prod(box(a, t, tp, rank)[1]) for t, n in kinds))
                 for _, kinds in _groups(a))
