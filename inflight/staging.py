"""Staging: where a version waits between its buckets' arrival and its commit.

The pool of staging buffers (kept across group generations; what it holds and why is
counted in ``inflight.memory``), and how a commit is ordered against the forward passes
around it on CUDA.

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

import threading
from collections.abc import Callable

import torch

from inflight.memory import BucketWindows, pinned_exact
from inflight.protocol import UpdateAnnounce


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


def copy_into(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """The commit's copies, one ``torch._foreach_copy_`` (the GIL released once): call it
    inside ``ordered_commit``. Non-blocking, because torch runs a foreach copy across devices
    (pinned host staging into GPU weights) as one ``copy_`` per tensor, each waited for
    unless non-blocking; ``ordered_commit``'s single synchronize ends them all, before the
    staging they read is reused. On CPU it is the same copy."""
    torch._foreach_copy_(destinations, sources, non_blocking=True)


class StagingPool:
    """The worker's staging buffers, kept across group generations so a rejoin neither
    reallocates nor doubles them. ``reserve`` allocates them up front (at engine start,
    before the memory is gone) at their exact size, resident at once; ``take`` hands out a
    buffer of at least n bytes.

    Two threads use it: the listener takes and gives staging buffers; the execution thread
    gives back what a commit consumed and moves the rollback copy (``previous``), which
    only it reads or changes once the listener runs. ``_lock`` guards the free list."""

    def __init__(self, device: torch.device, *, pin: bool = False, keep_base: bool = False) -> None:
        self.device = device
        self.keep_base = keep_base
        """Keep the live version's bytes as the base of sparse updates (``InflightConfig.keep_base``)."""
        self.base: StagedVersion | None = None
        """The live version's bytes where no rollback copy holds them (``keep_base``)."""
        self.pin = pin and device.type == "cpu" and torch.cuda.is_available()
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self.previous: StagedVersion | None = None
        """The live version's bytes (``keep_rollback``), kept across generations with the pool."""
        self.windows: BucketWindows | None = None
        """Where buckets land on the data plane, reserved with the buffers (None: allocated on need)."""
        self._out: dict[int, int] = {}  # data_ptr -> bytes of each buffer taken and not given back
        self.peak_bytes = 0
        """The most bytes of staging buffers ever out at once (staged or receiving, the rollback
        copy included): what staging held at its peak, measured."""

    def _alloc(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            return pinned_exact(nbytes)
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.device.type == "cpu":
            t.zero_()  # resident now: the reservation is real, and the first receive pays no page faults
        return t

    def reserve(self, nbytes: int, count: int) -> None:
        with self._lock:
            self._free = [self._alloc(nbytes) for _ in range(count)]

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, t in enumerate(self._free):
                if t.numel() >= nbytes:
                    return self._lend(self._free.pop(i))
            if self._free:  # too small for this update: replace rather than keep both
                self._free.pop(0)
        buffer = self._alloc(nbytes)
        with self._lock:
            return self._lend(buffer)

    def _lend(self, buffer: torch.Tensor) -> torch.Tensor:
        self._out[buffer.data_ptr()] = buffer.numel()
        self.peak_bytes = max(self.peak_bytes, sum(self._out.values()))
        return buffer

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._out.pop(buffer.data_ptr(), None)
            self._free.append(buffer)

    def went_live(self, staged: StagedVersion) -> None:
        """Execution thread: ``staged`` (a whole version) went live. Its bytes become the
        rollback copy where the pool keeps one, else the base of the next sparse update where
        the pool keeps that, else they go back to the pool."""
        if self.previous is not None:
            self.keep_as_previous(staged)
        elif self.keep_base:
            old, self.base = self.base, staged
            if old is not None:
                self.give(old.flat)
        else:
            self.give(staged.flat)

    def base_for(self) -> StagedVersion | None:
        """The live version's bytes, if the pool holds them: the rollback copy or the base
        (``None``: neither, or only the weights read at start, which carry no version)."""
        live = self.previous if self.previous is not None else self.base
        return live if live is not None and live.announce is not None else None

    def keep_as_previous(self, staged: StagedVersion) -> None:
        """Execution thread: ``staged`` went live; keep its bytes as the rollback copy and give
        back the ones it replaces."""
        old, self.previous = self.previous, staged
        if old is not None:
            self.give(old.flat)


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
