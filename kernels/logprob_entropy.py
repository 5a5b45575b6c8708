"""Per-token log-prob of the sampled token and entropy of the distribution, from logits,
without ever materialising the (N, V) float32 log-softmax.

Given logits z (N, V) and targets y (N,):
    lse_n   = log sum_v exp(z_nv)
    logp_n  = z_{n,y_n} - lse_n
    H_n     = lse_n - sum_v p_nv z_nv  (the kernel sums p (z - max z): see ``_fwd_kernel``)
Backward, with upstream gradients a_n (for logp) and b_n (for H):
    dz_nv = a_n (1[v = y_n] - p_nv) - b_n p_nv (z_nv - lse_n + H_n)

Logits of -inf are tokens a sampling filter removed (``inflight.trainer.sampling_filter``): they have
p = 0 and add nothing to H or to any gradient (p z is taken as 0 there, never 0 * -inf); a
target among them has logp = -inf.

Four implementations, in the order of the Triton tutorials:
- ``logprob_entropy_reference``: plain torch autograd through ``log_softmax`` (the spec);
- ``_fwd_kernel`` / ``_bwd_kernel``: Triton, one row per program, the vocabulary walked in
  ``BLOCK_V`` chunks with an online (rescaled) max/sum; the backward recomputes p;
- ``_torch_chunked``: the same math in torch over row chunks, the CPU fallback;
- ``logprob_entropy``: the autograd wrapper that picks one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inflight.kernels import Impl


def logprob_entropy_reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: log-softmax in float32 (float64 stays float64), gathered and summed.
    (..., V) -> (...), (...)."""
    logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all.masked_fill(logp_all == float("-inf"), 0.0)).sum(-1)
    return logp, entropy


@triton.jit
def _fwd_kernel(z_ptr, y_ptr, logp_ptr, ent_ptr, lse_ptr, V, stride_n, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_n
    m = float("-inf")  # running max
    s = 0.0  # sum exp(z - m)
    # sum exp(z - m) (z - m): kept relative to the running max, so H = log s - t / s is a
    # difference of terms of the entropy's size, not of max|z|'s (the unshifted sum of
    # exp(z - m) z lost 7e-5 over 149 blocks of V = 151936 with max|z| = 30; this, 4e-6)
    t = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        z = tl.load(z_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        live = m_new > float("-inf")  # False while every logit so far is filtered out
        scale = tl.exp(tl.where(live, m, 0.0) - tl.where(live, m_new, 0.0))  # never -inf - -inf
        shift = tl.where(m > float("-inf"), m - m_new, 0.0)  # t's terms move to the new max
        d = z - tl.where(live, m_new, 0.0)
        e = tl.where(valid & (z > float("-inf")), tl.exp(d), 0.0)
        t = (t + shift * s) * scale + tl.sum(tl.where(e > 0.0, e * d, 0.0), axis=0)  # never 0 * -inf
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    lse = m + tl.log(s)
    y = tl.load(y_ptr + row)
    z_y = tl.load(z_row + y).to(tl.float32)
    tl.store(logp_ptr + row, z_y - lse)
    tl.store(ent_ptr + row, tl.log(s) - t / s)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _bwd_kernel(z_ptr, y_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, dz_ptr, V, stride_n, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = offs < V
    z = tl.load(z_ptr + row.to(tl.int64) * stride_n + offs, mask=valid, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    h = tl.load(ent_ptr + row)
    a = tl.load(glogp_ptr + row)
    b = tl.load(gent_ptr + row)
    y = tl.load(y_ptr + row)
    logp = z - lse
    p = tl.exp(logp)
    dz = a * (tl.where(offs == y, 1.0, 0.0) - p) - b * p * tl.where(p > 0.0, logp + h, 0.0)
    tl.store(dz_ptr + row.to(tl.int64) * stride_n + offs, dz.to(dz_ptr.dtype.element_ty), mask=valid)


_BLOCK_V = 1024


def _triton_forward(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, v = z.shape
    logp, ent, lse = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
    if n:
        _fwd_kernel[(n,)](z, y, logp, ent, lse, v, z.stride(0), BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(v)))
    return logp, ent, lse


def _triton_backward(z, y, lse, ent, g_logp, g_ent) -> torch.Tensor:
    n, v = z.shape
    dz = torch.empty_like(z)
    block = min(_BLOCK_V, triton.next_power_of_2(v))
    if n:
        _bwd_kernel[(n, triton.cdiv(v, block))](z, y, lse, ent, g_logp, g_ent, dz, v, z.stride(0), BLOCK_V=block)
    return dz


# -- torch fallback: the same math, a few rows at a time ------------------------------
def _rows_per_chunk(v: int, budget_bytes: int = 64 << 20) -> int:
    return max(1, budget_bytes // (4 * max(v, 1)))


def _torch_forward(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, v = z.shape
    logp, ent, lse = (torch.empty(n, dtype=torch.float32, device=z.device) for _ in range(3))
    step = _rows_per_chunk(v)
    for i in range(0, n, step):
        zc = z[i:i + step].float()  # (rows, V): bounded by the chunk budget
        m = zc.amax(-1, keepdim=True)
        d = zc - torch.where(torch.isfinite(m), m, 0.0)  # relative to the row's max (a row of -inf: as it is)
        e = d.exp()
        s = e.sum(-1)  # pairwise summation: a bmm here loses 1e-3 at V=50k
        # H = log s - sum e d / s: terms of the entropy's size, never of max|z|'s (as the kernel);
        # e d is 0 where d = -inf (0 * -inf is nan)
        t = e.mul_(d.clamp_(min=torch.finfo(torch.float32).min)).sum(-1)
        log_s = s.log()
        lse_c = m[:, 0] + log_s
        lse[i:i + step] = lse_c
        logp[i:i + step] = zc.gather(-1, y[i:i + step, None])[:, 0] - lse_c
        ent[i:i + step] = log_s - t / s
    return logp, ent, lse


def _torch_backward(z, y, lse, ent, g_logp, g_ent) -> torch.Tensor:
    n, v = z.shape
    dz = torch.empty_like(z)
    step = _rows_per_chunk(v)
    for i in range(0, n, step):
        sl = slice(i, i + step)
        d = z[sl].float() - lse[sl, None]  # log p; turned into the gradient in place
        p = d.exp()
        d.add_(ent[sl, None]).mul_(p).mul_(-g_ent[sl, None]).masked_fill_(p == 0, 0.0)  # -b p (log p + H)
        d.sub_(p.mul_(g_logp[sl, None]))  # -a p
        d.scatter_add_(-1, y[sl, None], g_logp[sl, None])  # +a 1[v = y]
        dz[sl] = d
    return dz


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, y: torch.Tensor, use_triton: bool):
        fwd = _triton_forward if use_triton else _torch_forward
        logp, ent, lse = fwd(z, y)
        ctx.save_for_backward(z, y, lse, ent)
        ctx.use_triton = use_triton
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None):
        z, y, lse, ent = ctx.saved_tensors
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.float().contiguous()
        g_ent = torch.zeros_like(lse) if g_ent is None else g_ent.float().contiguous()
        bwd = _triton_backward if ctx.use_triton else _torch_backward
        return bwd(z, y, lse, ent, g_logp, g_ent), None, None


def logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                    impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(..., V) logits, (...) int targets -> float32 (...) log-probs and entropies, differentiable.

    ``auto`` uses Triton on CUDA and the chunked torch path elsewhere.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    if impl == "reference":
        return logprob_entropy_reference(logits, targets)
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl={impl!r} is not auto, triton, torch or reference")
    use_triton = impl == "triton" or (impl == "auto" and logits.device.type == "cuda")
    lead = logits.shape[:-1]
    z = logits.reshape(-1, logits.shape[-1]).contiguous()
    y = targets.reshape(-1).to(torch.int64).contiguous()
    # one host sync: the kernels read z[y] unchecked
    lo, hi = torch.stack(torch.aminmax(y)).tolist() if y.numel() else (0, 0)
    if not 0 <= lo <= hi < z.shape[1]:
        raise ValueError(f"targets hold {lo}..{hi}, outside the vocabulary 0..{z.shape[1] - 1} "
                         "(mask padding with a valid id, e.g. the pad token, not -100)")
    logp, ent = _LogprobEntropy.apply(z, y, use_triton)
    return logp.view(lead), ent.view(lead)
