"""Staging: where a version waits between its buckets' arrival and its commit.

The pool of staging buffers (kept across group generations), the memory an in-flight
worker needs beside the engine's own (checked and reserved when it starts), and how a
commit is ordered against the forward passes around it on CUDA.

Memory. vLLM sizes its KV cache at engine start (``gpu_memory_utilization`` of the GPU,
``VLLM_CPU_KVCACHE_SPACE`` on CPU) before any worker extension runs. A staging buffer
allocated on the first push would then find the memory taken and fail mid-update. So
``inflight_start`` computes the bytes it needs from the checkpoint schema, refuses to
start with the figure and a setting that would fit when they are not free, and otherwise
allocates them at once (``StagingPool.reserve``): an engine that started can always stage.

Ordering (CUDA). Buckets land on the listener thread's side stream (NCCL, checksums,
finite check); the commit runs on the worker's execution thread, whose current stream is
the one its forward passes use. ``ready_event`` is recorded on the side stream once a
version is staged and prepared; ``ordered_commit`` makes the commit's stream wait for it,
runs the copies there, and blocks until they completed before the commit returns. So the
next forward, on whatever stream, reads only new weights, and the staging buffer is free
for reuse as soon as the commit returns. The cost is the copies' own time, which the next
forward would have waited for anyway, plus the launch latency the block gives up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inflight.protocol import DTYPE_ITEMSIZE, UpdateAnnounce
from inflight.settings import StagingPlace
from inflight.transport.layout import ALIGN, TensorSchema

GiB = float(1 << 30)
CUDA_MARGIN_BYTES = 512 << 20
"""Left free on a GPU beyond staging: allocator fragmentation and NCCL's own buffers."""


class StagingMemoryError(RuntimeError):
    """The engine cannot hold the staging buffers it would need."""


def update_bytes(schema: TensorSchema) -> int:
    """Bytes of one update on the wire and in staging (the aligned flat layout)."""
    total = 0
    for shape, dtype in schema.tensors.values():
        total += -(-math.prod(shape) * DTYPE_ITEMSIZE[dtype] // ALIGN) * ALIGN
    return total


@dataclass(frozen=True)
class StagingNeed:
    update_bytes: int
    copies: int
    """Staging buffers: the version being staged, plus the live one's if ``keep_rollback``."""
    where: StagingPlace
    """``device`` (the engine's device) or ``host`` (pinned host memory)."""
    extra_bytes: int = 0
    """Prepared weights beside the live ones (the CPU ``swap`` commit's shadow modules)."""

    @property
    def nbytes(self) -> int:
        return self.update_bytes * self.copies + self.extra_bytes

    def describe(self) -> str:
        extra = f" + {self.extra_bytes / GiB:.2f} GiB prepared weights" if self.extra_bytes else ""
        return (f"{self.nbytes / GiB:.2f} GiB of {self.where} memory ({self.copies} x {self.update_bytes / GiB:.2f} GiB "
                f"update{', one kept for rollback' if self.copies > 1 else ''}{extra})")


def staging_need(schema: TensorSchema, *, staging: StagingPlace, keep_rollback: bool) -> StagingNeed:
    return StagingNeed(update_bytes(schema), 2 if keep_rollback else 1, staging)


def check_fits(need: StagingNeed, *, device: torch.device, free_bytes: int, total_bytes: int,
               gpu_memory_utilization: float | None) -> None:
    """Raise ``StagingMemoryError`` naming the bytes and a setting that would fit, unless
    ``need`` fits in ``free_bytes`` (what is free now, after vLLM took its share)."""
    margin = CUDA_MARGIN_BYTES if device.type == "cuda" and need.where == "device" else 0
    if need.nbytes + margin <= free_bytes:
        return
    deficit = need.nbytes + margin - free_bytes
    msg = (f"inflight: staging needs {need.describe()}, but only {free_bytes / GiB:.2f} GiB of "
           f"{total_bytes / GiB:.2f} GiB is free")
    if device.type == "cuda" and need.where == "device":
        assert gpu_memory_utilization is not None
        fit = math.floor(100 * (gpu_memory_utilization - deficit / total_bytes)) / 100
        msg += f" after vLLM sized its KV cache at gpu_memory_utilization={gpu_memory_utilization:.2f}. "
        msg += (f"Start the engine with gpu_memory_utilization<={fit:.2f}, or " if fit > 0 else "The model cannot stage on "
                "this GPU at any gpu_memory_utilization: use ")
        msg += "InflightConfig(staging='host') (commit becomes a host-to-device copy), or keep_rollback=False."
    elif device.type == "cpu" and need.where == "device":
        msg += (f" on this host. Lower VLLM_CPU_KVCACHE_SPACE by {math.ceil(deficit / GiB)} GiB, or set "
                "InflightConfig(keep_rollback=False).")
    else:
        msg += " on this host. Free host memory, or set InflightConfig(keep_rollback=False)."
    raise StagingMemoryError(msg)


def memory_budget(device: torch.device, need: StagingNeed) -> tuple[int, int]:
    """(free, total) bytes where ``need`` would live, measured now."""
    if device.type == "cuda" and need.where == "device":
        free, total = torch.cuda.mem_get_info(device)
        return free, total
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


def ready_event(device: torch.device) -> torch.cuda.Event | None:
    """On CUDA, an event on the calling thread's current stream (the staging side stream)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def ordered_commit(device: torch.device, ready: torch.cuda.Event | None, apply: Callable[[], None]) -> None:
    """Run ``apply`` (copies into live weights) ordered after staging and before any later
    forward pass; see the module docstring. On CPU it just runs ``apply``."""
    if device.type != "cuda":
        apply()
        return
    stream = torch.cuda.current_stream(device)
    if ready is not None:
        stream.wait_event(ready)  # the staged bytes are complete before the first copy reads them
    apply()
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()  # every copy finished: no later forward, on any stream, can read old bytes


class StagingPool:
    """The worker's staging buffers, kept across group generations so a rejoin neither
    reallocates nor doubles them. ``reserve`` allocates them up front (at engine start,
    before the memory is gone); ``take`` hands out a buffer of at least n bytes."""

    def __init__(self, device: torch.device, *, pin: bool = False) -> None:
        self.device = device
        self.pin = pin and device.type == "cpu" and torch.cuda.is_available()
        self._free: list[torch.Tensor] = []
        self.previous: StagedVersion | None = None
        """The live version's bytes (``keep_rollback``), kept across generations with the pool."""

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device, pin_memory=self.pin)

    def reserve(self, nbytes: int, count: int) -> None:
        self._free = [self._alloc(nbytes) for _ in range(count)]

    def take(self, nbytes: int) -> torch.Tensor:
        for i, t in enumerate(self._free):
            if t.numel() >= nbytes:
                return self._free.pop(i)
        if self._free:  # too small for this update: replace rather than keep both
            self._free.pop(0)
        return self._alloc(nbytes)

    def give(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)


class StagedVersion:
    """A version whose every bucket arrived and verified: its bytes and the views of its tensors."""

    def __init__(self, announce: UpdateAnnounce | None, flat: torch.Tensor, first_bucket_step: int,
                 views: dict[str, torch.Tensor]) -> None:
        self.announce = announce
        self.flat = flat
        self.first_bucket_step = first_bucket_step
        # built once, by the receive (``_Streamed``): the listener shares the engine's GIL, so
        # Python work per tensor is decode time
        self.views = views
