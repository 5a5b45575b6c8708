"""The engine's sampling filters, applied to the trainer's logits: temperature, top-k, top-p.

Behaviour log-probs are vLLM's *processed* log-probs (``--logprobs-mode processed_logprobs``): the log-softmax of
the logits after the filters that drew the token. The importance ratio pi_theta / mu compares like with like only if
the trainer scores its policy under the same filters, so ``filter_logits`` rebuilds them from vLLM 0.32's definition
(``vllm/v1/sample/sampler.py``: ``apply_temperature``, then ``vllm/v1/sample/ops/topk_topp_sampler.py``:
``apply_top_k_top_p_pytorch``, the CPU path):

    z'    = z / T
    top-k: keep z'_v >= the k-th largest z' of the row (every logit tied with it is kept)
    top-p: sort the top-k survivors ascending, p = softmax, c = cumsum(p) in float32;
           drop the positions with c <= 1 - top_p, the largest always kept
    log pi(v) = log_softmax(z' with -inf on every dropped v)

The top-p cut is found by the same float32 operations in the same order, so on the same logits the kept set is
vLLM's, but for exact ties at the cut and vLLM's CUDA Triton kernel (the two differences: docs/design.md).

A token the current policy's filter drops has log pi = -inf: the policy can no longer sample it, its ratio is 0, and
``inflight.trainer.loss.compute_loss`` takes it out of the loss and counts it (``frac_masked_filter``). Top-k and
top-p thresholds are found without gradients; the kept logits are differentiable as before.
"""

from __future__ import annotations

import torch

from inflight.protocol import Sampling

_SORT_BUDGET_BYTES = 64 << 20
"""Rows sorted at once: each holds V float32 values and V int64 indices."""


def _top_p_cut(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(N, V) float32 scaled logits -> (N,) the smallest kept logit of each row under
    vLLM's top-k then top-p (see the module docstring)."""
    n, v = z.shape
    one_minus_p = 1 - torch.tensor(top_p, dtype=torch.float32)
    cut = torch.empty(n, dtype=torch.float32, device=z.device)
    step = max(1, _SORT_BUDGET_BYTES // (12 * v))
    for i in range(0, n, step):
        zs = z[i:i + step].sort(dim=-1, descending=False).values
        if top_k:
            zs.masked_fill_(zs < zs[:, v - top_k:v - top_k + 1], float("-inf"))
        dropped = zs.softmax(dim=-1).cumsum(dim=-1) <= one_minus_p
        dropped[:, -1] = False  # at least one
        cut[i:i + step] = zs.gather(-1, dropped.sum(-1, keepdim=True))[:, 0]  # dropped is a prefix: c is monotone
    return cut


def filter_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """(..., V) raw logits -> the scaled logits vLLM samples from: ``logits / T`` without a
    filter; with top-k or top-p, in float32 (as vLLM's sampler) and -inf where a filter
    drops a token. Differentiable in the kept logits."""
    other = [t for t in sampling.transforms() if t.split("=")[0] not in ("top_k", "top_p")]
    if other:
        raise ValueError(f"the trainer mirrors temperature, top_k and top_p only, not {', '.join(other)}")
    v = logits.shape[-1]
    top_k = sampling.top_k if 0 < sampling.top_k < v else 0
    if not top_k and sampling.top_p >= 1:
        return logits / sampling.temperature
    z = logits.float() / sampling.temperature
    with torch.no_grad():
        flat = z.detach().reshape(-1, v)
        if sampling.top_p >= 1:  # vLLM's CPU top-k-only path (apply_top_k_only): the k-th largest value
            cut = flat.topk(top_k, dim=-1).values[:, -1]
        else:
            cut = _top_p_cut(flat, top_k, sampling.top_p)
        drop = z.detach() < cut.view(z.shape[:-1] + (1,))
    return z.masked_fill(drop, float("-inf"))
