"""The policy's forward pass over a packed micro-batch (``inflight.trainer.packed_batch``).

The model runs on one row of L tokens with the layout's positions. Its attention is the
``inflight_packed`` implementation registered with transformers: each span's root node
causally, the rest of the span under the span's mask (PyTorch's SDPA: exact, and on CPU the
fastest of the masks tried). The LM head runs only on the rows that predict a completion token,
fused with log-prob and entropy in chunks (``inflight.kernels.logprob_head``), so the (tokens,
vocabulary) logits never exist whole. A call without a layout (evaluation, generation) is plain
SDPA with transformers' own masks.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from inflight.kernels.logprob_entropy import logprob_entropy
from inflight.kernels.logprob_head import logprob_head
from inflight.protocol import Sampling
from inflight.settings import Packing
from inflight.trainer.packed_batch import PackedLayout
from inflight.trainer.sampling_filter import filter_logits

PACKED_ATTENTION = "inflight_packed"
"""The attention implementation's name in transformers' registries."""

_IN_PACKED_FORWARD = contextvars.ContextVar("inflight_packed_forward", default=False)
"""True while ``packed_logprobs`` runs the model: transformers builds no mask then."""


def packed_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (1, H, L, D) query, (1, H_kv, L, D) key and value ->
    (1, L, H, D). With ``packed_layout`` in the call's arguments, attention stays inside each
    span as its mask says; without, SDPA as transformers runs it."""
    layout: PackedLayout | None = kwargs.pop("packed_layout", None)
    if layout is None:
        if _IN_PACKED_FORWARD.get():
            raise RuntimeError(f"{type(module).__name__} got no packed_layout: this model does not pass its "
                               "forward's arguments on to its attention, so it cannot be packed")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    attend = partial(F.scaled_dot_product_attention, scale=scaling, enable_gqa=gqa)
    outs = []
    for s in layout.spans:
        root = slice(s.start, s.root)
        outs.append(attend(query[:, :, root], key[:, :, root], value[:, :, root], is_causal=True))
        if s.mask is not None:
            keys = slice(s.start, s.stop)
            outs.append(attend(query[:, :, s.root:s.stop], key[:, :, keys], value[:, :, keys], attn_mask=s.mask))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _packed_mask(*args, **kwargs):
    """transformers' mask for ``inflight_packed``: none in a packed forward (the spans are the
    mask), SDPA's otherwise."""
    if _IN_PACKED_FORWARD.get():
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ``inflight_packed`` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    AttentionMaskInterface.register(PACKED_ATTENTION, _packed_mask)


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run packed (None: it can): its attention must go through
    transformers' attention interface, over full causal attention in every layer."""
    config = model.config
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not run its attention through transformers' attention interface"
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        return f"its layers are not all full attention ({', '.join(sorted(kinds))})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) and not kinds:
        return f"it attends through a sliding window of {config.sliding_window} tokens"
    if getattr(config, "attn_logit_softcapping", None):
        return "it soft-caps its attention logits, which SDPA does not"
    return None


def use_packing(model: torch.nn.Module, packing: Packing) -> tuple[Packing, str | None]:
    """The layout ``model`` trains with when ``packing`` is asked for, and why it is simpler
    (None: as asked). A packed layout switches the model's attention to ``inflight_packed``."""
    if packing == "padded":
        return packing, None
    if (problem := packing_problem(model)) is not None:
        return "padded", problem
    register()
    model.set_attn_implementation(PACKED_ATTENTION)
    return packing, None


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Activation checkpointing on each decoder layer (``_no_split_modules``): its input kept,
    the layer recomputed in the backward pass. Module names do not change, and it composes
    with FSDP2 applied after it. Returns the layers checkpointed."""
    from torch.distributed._composable import checkpoint

    layers = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in layers]
    if not units:
        raise ValueError(f"optim.activation_checkpointing: {type(model).__name__} names no decoder layer class "
                         "(_no_split_modules); set optim.activation_checkpointing=false")
    for unit in units:
        checkpoint(unit)
    return len(units)


@contextmanager
def _fused_head(model: torch.nn.Module, layout: PackedLayout, sampling: Sampling, chunk: int) -> Iterator[bool]:
    """Inside, the model's LM head returns (1, M, 2) log-probs and entropies of ``layout``'s
    targets instead of logits (True), computed in chunks of ``chunk`` rows; a head that is not
    a plain linear layer is left alone (False)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        yield False
        return
    transform = partial(filter_logits, sampling=sampling)

    def scored(hidden: torch.Tensor) -> torch.Tensor:
        logp, entropy = logprob_head(hidden[0], head.weight, layout.targets, transform, bias=head.bias,
                                     chunk_tokens=chunk)
        return torch.stack([logp, entropy], dim=-1)[None]

    head.forward = scored
    try:
        yield True
    finally:
        del head.forward


def packed_logprobs(model: torch.nn.Module, layout: PackedLayout, sampling: Sampling, chunk: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(samples, longest completion) log-probs and entropies of ``layout``'s completion tokens
    under ``model`` as the engine samples it (``filter_logits``), 0 past each completion's end."""
    flag = _IN_PACKED_FORWARD.set(True)
    try:
        with _fused_head(model, layout, sampling, chunk) as fused:
            out = model(input_ids=layout.input_ids, position_ids=layout.position_ids, logits_to_keep=layout.predict,
                        packed_layout=layout, use_cache=False)
    finally:
        _IN_PACKED_FORWARD.reset(flag)
    if fused:
        logp, entropy = out.logits[0].unbind(-1)
    else:
        logp, entropy = logprob_entropy(filter_logits(out.logits[0], sampling), layout.targets)
    grid = torch.zeros(layout.shape, dtype=torch.float32, device=logp.device)
    where = (layout.rows, layout.cols)
    return grid.index_put(where, logp.float()), grid.index_put(where, entropy.float())
