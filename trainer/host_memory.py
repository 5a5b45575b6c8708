"""The trainer process's memory, as the kernel counts it: resident now and at its peak, with the
peak restartable per step (Linux ``/proc/self/clear_refs``), and on CUDA the allocator's peak.

Off Linux every reading is 0: nothing here may fail a step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")


def _status_kb(field: str) -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """Make glibc hand every freed block of ``threshold`` bytes or more back to the kernel
    (``mallopt`` M_MMAP_THRESHOLD and M_TRIM_THRESHOLD, fixed instead of glibc's adaptive
    ones), so the resident set follows the live tensors instead of keeping each step's
    freed activations. False where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.mallopt(-3, threshold)) and bool(libc.mallopt(-1, threshold))  # M_MMAP_, M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False


def resident_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return 1024 * _status_kb("VmRSS")


def peak_bytes() -> int:
    """This process's peak resident set since it started or since ``restart_peak`` (VmHWM)."""
    return 1024 * _status_kb("VmHWM")


def restart_peak() -> None:
    """Start ``peak_bytes`` (and CUDA's peak) over from the memory resident now."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def step_memory() -> dict[str, float]:
    """The metrics row's memory: peak resident GB since ``restart_peak`` (and CUDA's peak allocated)."""
    out = {"peak_rss_gb": peak_bytes() / 1e9, "rss_gb": resident_bytes() / 1e9}
    if torch.cuda.is_available():
        out["peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
    return out
