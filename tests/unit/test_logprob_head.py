"""The fused LM head (``inflight.kernels.logprob_head``) against the unfused reference.

- log-probs, entropies and the gradients of hidden, weight and bias equal
  ``logprob_head_reference`` (whole logits, plain autograd) within 1e-6 of each tensor's
  scale in float32, under every sampling filter, chunk size and upstream gradient;
- no tensor of N x V elements is ever allocated, forward or backward, where the reference
  allocates several;
- two mutants (the entropy's gradient dropped, the temperature not chained) fail the same
  comparison: it is a check a wrong implementation would not pass.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from inflight.kernels import logprob_head as head
from inflight.kernels.logprob_head import logprob_head, logprob_head_reference
from inflight.protocol import Sampling
from inflight.trainer.sampling_filter import filter_logits

SAMPLINGS = {"none": Sampling(), "temperature": Sampling(temperature=0.7), "top_k": Sampling(top_k=20),
             "top_p": Sampling(top_p=0.8), "top_k_top_p": Sampling(temperature=0.9, top_k=40, top_p=0.7)}
RTOL = 1e-6
"""float32: each output within RTOL of its tensor's largest magnitude (an element near 0 of a
gradient has no relative accuracy of its own)."""


def _case(n: int, hdim: int, v: int, seed: int, bias: bool = True, sampling: Sampling | None = None):
    """Targets drawn from the filtered distribution, as the engine drew them, but every fourth
    one uniform (under a filter, mostly a token it drops)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hdim, generator=g)
    weight = 2 * torch.randn(v, hdim, generator=g) / hdim ** 0.5  # logits of a few units, as a trained head's
    b = 0.5 * torch.randn(v, generator=g) if bias else None
    z = _transform(sampling)(hidden @ weight.T + (0 if b is None else b))
    y = torch.multinomial(z.float().softmax(-1), 1, generator=g)[:, 0]
    y[::4] = torch.randint(0, v, (len(y[::4]),), generator=g)
    up = torch.randn(2, n, generator=g)  # upstream gradients of logp and of the entropy
    return hidden, weight, b, y, up


def _transform(sampling: Sampling | None):
    return (lambda z: z) if sampling is None else partial(filter_logits, sampling=sampling)


def _run(fn, hidden, weight, bias, y, up, dtype=torch.float32):
    """fn's outputs and the gradients of sum(a logp + b H) (a dropped target's logp: taken out, a = 0 there)."""
    leaves = [t.detach().clone().to(dtype).requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    lp, ent = fn(leaves[0], leaves[1], y, bias=leaves[2])
    dropped = torch.isinf(lp)
    a = up[0].masked_fill(dropped, 0.0)
    (a * lp.masked_fill(dropped, 0.0) + up[1] * ent).sum().backward()
    return [lp.detach(), ent.detach()] + [t.grad for t in leaves if t is not None]


def _check(sampling: Sampling | None, *, n: int = 37, hdim: int = 16, v: int = 301, chunk: int = 8,
           bias: bool = True, impl: str = "torch", seed: int = 0, case=None) -> list[torch.Tensor]:
    hidden, weight, b, y, up = case or _case(n, hdim, v, seed, bias, sampling)
    transform = None if sampling is None else _transform(sampling)
    want = _run(partial(logprob_head_reference, transform=transform), hidden, weight, b, y, up)
    got = _run(partial(logprob_head, transform=transform, chunk_tokens=chunk, impl=impl), hidden, weight, b, y, up)
    assert torch.equal(torch.isinf(got[0]), torch.isinf(want[0]))
    for name, g, w in zip(["logp", "entropy", "hidden", "weight", "bias"], got, want):
        assert g.dtype == w.dtype and torch.isfinite(g[~torch.isinf(w)]).all(), name
        scale = float(w[torch.isfinite(w)].abs().max())
        torch.testing.assert_close(g, w, rtol=RTOL, atol=RTOL * scale, msg=lambda m, name=name: f"{name}: {m}")
    return want


@pytest.mark.parametrize("name", SAMPLINGS)
def test_matches_the_reference_under_each_filter(name: str) -> None:
    _check(SAMPLINGS[name])


@pytest.mark.parametrize("chunk", [1, 5, 37, 64], ids=lambda c: f"chunk{c}")  # one row; 37 = 7 x 5 + 2; all; more
def test_every_chunk_size_gives_the_reference(chunk: int) -> None:
    _check(SAMPLINGS["top_k_top_p"], chunk=chunk)


def test_no_bias_and_no_filter() -> None:
    _check(None, bias=False)


def test_leading_dimensions_are_kept() -> None:
    """(B, T, H) hidden states and (B, T) targets, as the trainer holds them: the flat rows' results."""
    hidden, weight, b, y, _ = _case(36, 16, 301, seed=2)
    lp, ent = logprob_head(hidden.view(4, 9, 16), weight, y.view(4, 9), bias=b, chunk_tokens=8)
    flat = logprob_head(hidden, weight, y, bias=b, chunk_tokens=8)
    assert lp.shape == ent.shape == (4, 9)
    assert torch.equal(lp.flatten(), flat[0]) and torch.equal(ent.flatten(), flat[1])


def test_targets_the_filter_drops() -> None:
    """A target outside top-k has logp = -inf (its ratio is 0, ``compute_loss`` takes it out):
    its row's upstream gradient of logp is 0, and every gradient stays finite and equal to the reference's."""
    sampling = Sampling(temperature=0.8, top_k=5)
    hidden, weight, b, y, up = _case(37, 16, 301, seed=3, sampling=sampling)
    y[::3] = (hidden[::3] @ weight.T + b).argmin(-1)  # every third target the least likely token: dropped
    dropped = torch.isinf(_check(sampling, case=(hidden, weight, b, y, up))[0])
    assert dropped[::3].all() and not dropped.all()


def test_a_tied_weight_accumulates_both_uses() -> None:
    """The head's weight is the embedding's Parameter too: its .grad is the sum of both uses' gradients."""
    n, hdim, v = 37, 16, 301
    _, weight, _, y, up = _case(n, hdim, v, seed=4, bias=False)
    ids = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(4))
    transform = partial(filter_logits, sampling=SAMPLINGS["top_k_top_p"])
    grads = []
    for fn in (logprob_head_reference, partial(logprob_head, chunk_tokens=8)):
        emb = torch.nn.Embedding(v, hdim, _weight=weight.clone())
        hidden = torch.tanh(emb(ids))  # the embedding's output through a layer, into the head
        lp, ent = fn(hidden, emb.weight, y, transform)
        (up[0] * lp.masked_fill(torch.isinf(lp), 0.0) + up[1] * ent).sum().backward()
        grads.append(emb.weight.grad)
    assert grads[0][ids].abs().sum() > 0  # the embedding's rows carry both uses
    torch.testing.assert_close(grads[1], grads[0], rtol=RTOL, atol=RTOL * float(grads[0].abs().max()))


def test_bfloat16_matches_the_bfloat16_reference() -> None:
    """bf16 hidden and weight: both compute the same bf16 logits and their softmax in float32,
    so logp, H and grad_h agree within one bf16 rounding of a logit (2^-8 of the scale). grad_W's
    chunk products are each rounded to bf16 once before their float32 sum, the reference's one
    product once: within 2^-6 of the scale (four bf16 ulps of the largest element)."""
    hidden, weight, _, y, up = _case(37, 16, 301, seed=5, bias=False)
    for sampling in (SAMPLINGS["temperature"], SAMPLINGS["top_k_top_p"]):
        transform = _transform(sampling)
        want = _run(partial(logprob_head_reference, transform=transform), hidden, weight, None, y, up, torch.bfloat16)
        got = _run(partial(logprob_head, transform=transform, chunk_tokens=8), hidden, weight, None, y, up,
                   torch.bfloat16)
        assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float32] * 2 + [torch.bfloat16] * 2
        for g, w, tol in zip(got, want, [2 ** -8] * 3 + [2 ** -6]):
            scale = float(w[torch.isfinite(w)].abs().max())
            torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=tol * scale)


def test_only_the_outputs_used_carry_gradient() -> None:
    """The entropy unused: its upstream gradient is None, not a tensor of zeros."""
    hidden, weight, b, y, _ = _case(37, 16, 301, seed=6)
    grads = []
    for fn in (logprob_head_reference, partial(logprob_head, chunk_tokens=8)):
        h = hidden.clone().requires_grad_()
        fn(h, weight, y, bias=b)[0].sum().backward()
        grads.append(h.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=RTOL, atol=RTOL * float(grads[0].abs().max()))


def test_the_triton_kernels_in_the_head() -> None:
    """The Triton kernels as the softmax part (Triton's interpreter here, compiled on CUDA)."""
    _check(SAMPLINGS["top_k_top_p"], n=9, v=70, chunk=4, impl="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["none", "top_k_top_p"])
def test_the_head_on_cuda(name: str) -> None:
    hidden, weight, b, y, up = (t.cuda() if t is not None else None for t in _case(1000, 64, 5003, seed=7))
    _check(SAMPLINGS[name], chunk=256, impl="auto", case=(hidden, weight, b, y, up))


class _Allocations(TorchDispatchMode):
    """The element count of the storage behind every tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.sizes += [t.untyped_storage().nbytes() // t.element_size()
                       for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        return out


def _largest(fn, hidden, weight, b, y, up) -> tuple[int, int]:
    """The largest allocation of fn's forward, and of its backward alone."""
    h = hidden.clone().requires_grad_()
    with _Allocations() as fwd:
        lp, ent = fn(h, weight.requires_grad_(), y, bias=b.requires_grad_())
        loss = (up[0] * lp.masked_fill(torch.isinf(lp), 0.0) + up[1] * ent).sum()
    with _Allocations() as bwd:
        loss.backward()
    return max(fwd.sizes), max(bwd.sizes)


def test_no_tensor_holds_the_whole_logits() -> None:
    """Under the filters' sort and the backward's recomputation, no allocation reaches N x V
    elements (N > H, so the weight's V x H gradient is smaller); the reference's forward and
    its backward alone each make one, so the check sees both passes."""
    n, hdim, v = 64, 8, 256
    transform = partial(filter_logits, sampling=SAMPLINGS["top_k_top_p"])
    case = _case(n, hdim, v, seed=8)
    ref = _largest(partial(logprob_head_reference, transform=transform), *case)
    fused = _largest(partial(logprob_head, transform=transform, chunk_tokens=16), *case)
    assert min(ref) >= n * v, ref
    assert max(fused) < n * v and max(fused) <= 16 * v, fused


def test_a_dropped_entropy_gradient_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_entropy_grad(z, y, lse, ent, g_logp, g_ent):
        return torch_backward(z, y, lse, ent, g_logp, torch.zeros_like(g_ent))

    torch_backward = head._torch_backward
    monkeypatch.setattr(head, "_torch_backward", no_entropy_grad)
    with pytest.raises(AssertionError, match="hidden"):
        _check(SAMPLINGS["none"])


def test_a_temperature_not_chained_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The filter's Jacobian skipped: right at T = 1 (masks alone: their gradient is 0 already), wrong at T = 0.7."""
    monkeypatch.setattr(head, "_chain", lambda z, zf, dzf: dzf.to(z.dtype))
    _check(Sampling(top_k=20))
    with pytest.raises(AssertionError, match="hidden"):
        _check(SAMPLINGS["temperature"])


@pytest.mark.parametrize("bad", [-100, 301])
def test_targets_outside_the_vocabulary_are_refused(bad: int) -> None:
    hidden, weight, b, y, _ = _case(5, 16, 301, seed=9)
    y[2] = bad
    with pytest.raises(ValueError, match=r"outside the vocabulary 0..300"):
        logprob_head(hidden, weight, y, bias=b)
