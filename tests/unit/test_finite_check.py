"""The listener's NaN/Inf check (``UpdateListener._nonfinite``): one 2-norm pass per bucket's tensors,
with an exact per-tensor search when the norm is not finite.

- every NaN, +Inf or -Inf element is found and named, in fp32 and bf16;
- finite weights whose 2-norm overflows (|x| ~ 3e38) are accepted: the fast pass's false
  alarm is settled by the exact search, never turned into a refusal.
"""

from __future__ import annotations

import pytest
import torch

from inflight.transport.listener import UpdateListener


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_single_nonfinite_element_is_found(dtype: torch.dtype, bad: float) -> None:
    w = torch.randn(4097, dtype=dtype)
    w[2345] = bad
    views = {"a": torch.randn(64, dtype=dtype), "w": w, "ids": torch.arange(7)}
    assert UpdateListener._nonfinite(views) == "w"


def test_finite_weights_whose_norm_overflows_are_accepted() -> None:
    views = {"huge": torch.full((16,), 3e38), "small": torch.randn(100), "ids": torch.arange(3)}
    assert not torch.isfinite(torch.linalg.vector_norm(views["huge"]))  # the fast pass does raise the alarm
    assert UpdateListener._nonfinite(views) is None
    assert UpdateListener._nonfinite({"ids": torch.arange(3)}) is None
