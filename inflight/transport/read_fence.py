"""When a push has read the trainer's tensors: the fence between a push and the optimizer.

A push reads the live parameters as its buckets are packed, while the trainer goes on with
the next forward and backward; the optimizer may write a parameter only after the push read
it. On the host that is an event the push sets after its last bucket is packed. On CUDA the
push packs and checksums on a stream of its own, so sending overlaps training rather than
queueing behind it on the stream training uses, and two CUDA events order the streams:

    trainer's stream:  ... optimizer.step | begin: record `begun` | forward, backward ... | wait: wait `read` | optimizer.step
    push's stream:                          wait `begun` | pack 0 | pack 1 | ... | pack n-1 | done: record `read`

CUDA is used only by a trainer that already initialized it (its tensors are on a GPU): a
CPU trainer on a machine with a GPU creates no context.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class ReadFence:
    """``begin`` (the caller, before a push) -> ``reading`` and ``done`` (the push's thread)
    -> ``wait`` (the caller, before it writes a parameter)."""

    def __init__(self) -> None:
        self._host = threading.Event()
        self._host.set()
        self.stream: torch.cuda.Stream | None = None
        """The push's CUDA stream (made at the first push of a CUDA trainer)."""
        self._begun: torch.cuda.Event | None = None
        self._read: torch.cuda.Event | None = None

    def begin(self) -> None:
        """A push starts: it reads only what the caller's stream queued so far (the last optimizer step)."""
        self._host.clear()
        self._begun = self._read = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            if self.stream is None:
                self.stream = torch.cuda.Stream()
            self._begun = torch.cuda.Event()
            self._begun.record()

    @contextmanager
    def reading(self) -> Iterator[None]:
        """The push's thread packs on the push's stream, after ``begin``'s point of the caller's."""
        if self._begun is None or self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self._begun)
            yield

    def done(self) -> None:
        """The push read every tensor it sends (or ended); a second call changes nothing."""
        if self._host.is_set():
            return
        if self._begun is not None and self.stream is not None:
            read = torch.cuda.Event()
            read.record(self.stream)
            self._read = read
        self._host.set()

    def wait(self, timeout_s: float | None = None) -> float:
        """Block until ``done``, and order the caller's stream after the push's reads; the seconds waited."""
        t0 = time.perf_counter()
        if not self._host.wait(timeout_s):
            raise TimeoutError(f"the push in flight still reads the trainer's tensors after {timeout_s} s")
        if self._read is not None:
            torch.cuda.current_stream().wait_event(self._read)
        return time.perf_counter() - t0
