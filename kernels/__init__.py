"""The trainer's Triton kernels, each beside its pure-torch reference."""

from __future__ import annotations

from typing import Literal

Impl = Literal["auto", "triton", "torch", "reference"]
"""Which implementation a kernel runs: ``auto`` is Triton on CUDA and torch elsewhere;
``torch`` its torch path (for ``tis_loss``, the reference itself); ``reference`` the plain
torch reference the kernels are tested against."""
