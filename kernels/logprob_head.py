"""The LM head fused with per-token log-prob and entropy, ``chunk_tokens`` rows at a time:
no (N, V) logits, probabilities or gradient ever exist at once.

Per chunk of rows: z = f(h W^T + b), f the sampling filter as a row-wise callable (the trainer
passes ``partial(filter_logits, sampling=s)``: kernels/ never imports trainer/), then logp, H and
lse as ``logprob_entropy``; the forward keeps only lse and H per row. The backward recomputes the
chunk's z (the same logits: f drops the same tokens), takes dz_f from ``logprob_entropy``'s
backward formula, chains it through f by autograd (1/T; zero where f wrote -inf), then
    grad_h[chunk] = dz W,   grad_W += dz^T h[chunk],   grad_b += sum_rows dz
with grad_W and grad_b accumulated in float32. Extra memory: a few (chunk_tokens, V) tensors.

Liger-Kernel's ``fused_linear_cross_entropy`` and chunked GRPO loss (``LigerFusedLinearPPOBase``)
compute their own fixed loss's gradient inside the forward and only scale it in the backward;
neither has an entropy output with a gradient of its own, nor a top-k/top-p mask, both of which the
trainer's objectives (importance-weighted logp, entropy) need: so here the backward computes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from inflight.kernels import Impl
from inflight.kernels.logprob_entropy import (
    _torch_backward,
    _torch_forward,
    _triton_backward,
    _triton_forward,
    logprob_entropy_reference,
)

Transform = Callable[[torch.Tensor], torch.Tensor]
"""(rows, V) logits -> (rows, V) filtered logits, row by row, deterministic, differentiable in
the kept logits (``inflight.trainer.sampling_filter.filter_logits`` with its sampling bound)."""


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The head's raw logits, as the reference computes them."""
    z = h @ weight.T
    return z if bias is None else z + bias


def logprob_head_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           transform: Transform | None = None, *,
                           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: the whole (..., V) logits, filtered, through ``logprob_entropy_reference``."""
    z = _logits(hidden, weight, bias)
    return logprob_entropy_reference(z if transform is None else transform(z), targets)


def _softmax_fwd(z: torch.Tensor, y: torch.Tensor, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (_triton_forward if use_triton else _torch_forward)(z.contiguous(), y)


def _chunk_grad(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transform: Transform | None,
                y: torch.Tensor, saved: tuple[torch.Tensor, ...], use_triton: bool) -> torch.Tensor:
    """d loss / d raw logits of one chunk: its logits recomputed, the filter's Jacobian applied
    by autograd. ``saved`` is the chunk's (lse, H, g_logp, g_ent)."""
    z = _logits(h, weight, bias)
    if transform is None:
        return _softmax_bwd(z, y, saved, use_triton)
    with torch.enable_grad():
        z.requires_grad_(True)
        zf = transform(z)
        dzf = _softmax_bwd(zf.detach(), y, saved, use_triton)
        return _chain(z, zf, dzf)


def _softmax_bwd(z: torch.Tensor, y: torch.Tensor, saved: tuple[torch.Tensor, ...], use_triton: bool) -> torch.Tensor:
    lse, ent, g_logp, g_ent = saved
    return (_triton_backward if use_triton else _torch_backward)(z.contiguous(), y, lse, ent, g_logp, g_ent)


def _chain(z: torch.Tensor, zf: torch.Tensor, dzf: torch.Tensor) -> torch.Tensor:
    """The gradient on the filtered logits zf = f(z), taken back to z."""
    (dz,) = torch.autograd.grad(zf, z, dzf)
    return dz


class _LogprobHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, y, transform, chunk, use_triton):
        n = hidden.shape[0]
        logp, ent, lse = (torch.empty(n, dtype=torch.float32, device=hidden.device) for _ in range(3))
        for i in range(0, n, chunk):
            sl = slice(i, i + chunk)
            z = _logits(hidden[sl], weight, bias)
            logp[sl], ent[sl], lse[sl] = _softmax_fwd(z if transform is None else transform(z), y[sl], use_triton)
            del z
        ctx.save_for_backward(hidden, weight, bias, y, lse, ent)
        ctx.transform, ctx.chunk, ctx.use_triton = transform, chunk, use_triton
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, y, lse, ent = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        f32 = torch.float32
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=f32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=f32, device=bias.device) if need_b else None
        for i in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(i, i + ctx.chunk)
            h = hidden[sl]
            dz = _chunk_grad(h, weight, bias, ctx.transform, y[sl], (lse[sl], ent[sl], g_logp[sl], g_ent[sl]),
                             ctx.use_triton)
            if grad_b is not None:
                grad_b.add_(dz.sum(0, dtype=f32))
            dz = dz.to(hidden.dtype)  # a float32 bias promotes the logits; the matmuls are in h's dtype
            if grad_h is not None:
                grad_h[sl] = dz @ weight
            if grad_w is not None and dz.dtype == f32:
                grad_w.addmm_(dz.T, h)  # summed in place, no (V, H) product beside it
            elif grad_w is not None:
                grad_w.add_(dz.T @ h)  # bf16: each chunk's product rounded once, summed in float32
            del dz
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


def logprob_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                 transform: Transform | None = None, *, bias: torch.Tensor | None = None,
                 chunk_tokens: int = 512, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(..., H) hidden states, (V, H) head weight, (...) int targets -> float32 (...) log-probs
    and entropies of ``transform(hidden @ weight.T + bias)``, differentiable in hidden, weight
    and bias; ``transform`` None is no filter. ``auto`` runs the softmax part in Triton on CUDA
    and in torch elsewhere; ``reference`` is ``logprob_head_reference``."""
    if hidden.shape[:-1] != targets.shape or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
                         f"{tuple(targets.shape)} disagree")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} is not positive")
    if impl == "reference":
        return logprob_head_reference(hidden, weight, targets, transform, bias=bias)
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl={impl!r} is not auto, triton, torch or reference")
    use_triton = impl == "triton" or (impl == "auto" and hidden.device.type == "cuda")
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).to(torch.int64).contiguous()
    lo, hi = torch.stack(torch.aminmax(y)).tolist() if y.numel() else (0, 0)  # one host sync
    if not 0 <= lo <= hi < weight.shape[0]:
        raise ValueError(f"targets hold {lo}..{hi}, outside the vocabulary 0..{weight.shape[0] - 1}")
    logp, ent = _LogprobHead.apply(h, weight, bias, y, transform, chunk_tokens, use_triton)
    return logp.view(lead), ent.view(lead)
