"""The worker's queue of updates that come beside the weight group: ``UpdateQueue``, the loop
``PackedReceiver`` (vLLM's nccl wire) and ``CheckpointReader`` (checkpoint directories) share.

One thread per worker takes each queued ``Job`` in turn, lands its bytes in a staging buffer
while the engine decodes (the subclass's ``_receive``), and once its client finished it hands
it to the engine's commit (``EngineTarget.commit``): one step boundary, every rank or none.
Invariants: nothing live is touched before the commit; a refused or abandoned job gives its
buffer back and the engine serves its last version; a refusal is kept until ``take_refusal``.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from inflight.engine.commit.base import CommitFailed, CommitTarget
from inflight.staging import StagedVersion, StagingPool

log = logging.getLogger("inflight.update_queue")


@dataclass
class Job:
    """One update in the queue: its version, whether its client finished it, or dropped it."""

    version: int
    finished: threading.Event = field(default_factory=threading.Event, kw_only=True)
    abandoned: bool = field(default=False, kw_only=True)


class Refused(Exception):
    """An update received (or read) but not staged; the reason names the tensor, file or step."""


class UpdateQueue:
    """Stages and commits queued jobs on one worker; a subclass lands their bytes."""

    what = "update"
    """How the log names this queue's updates."""

    def __init__(self, *, target: CommitTarget, pool: StagingPool, stats: Any) -> None:
        self.target, self.pool, self.stats = target, pool, stats
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._lock = threading.Lock()
        self._current: Job | None = None
        self._refusals: list[str] = []

    # -- the execution thread (the RPC that queued it) ---------------------------------------
    def expect(self, job: Job) -> None:
        """Queue ``job``; its bytes are the thread's to land."""
        with self._lock:
            self._current = job
        self._jobs.put(job)

    def finish(self, version: int) -> None:
        """The client finished ``version``: commit it once staged."""
        with self._lock:
            if self._current is not None and self._current.version == version:
                self._current.finished.set()

    def abandon(self) -> None:
        """Drop the open job (its client went away): never committed."""
        with self._lock:
            if self._current is not None:
                self._current.abandoned = True
                self._current.finished.set()

    def take_refusal(self) -> str | None:
        """Why earlier jobs did not commit, once; None if every one did."""
        with self._lock:
            refusals, self._refusals = self._refusals, []
        return "; ".join(refusals) or None

    # -- the queue's thread ----------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                job = self._jobs.get(timeout=0.5)
            except queue.Empty:
                continue
            try:
                self._serve(job, stop)
            except Exception as e:  # the thread serves the next job; the engine its last version
                self._failed(job, e)

    def _failed(self, job: Job, error: Exception) -> None:
        log.exception("inflight: v%d (%s) failed", job.version, self.what)
        self._refuse(job, f"receiving it failed: {error!r}")

    def _receive(self, job: Job) -> tuple[torch.Tensor, StagedVersion | None, str | None]:
        """Land ``job`` in a staging buffer taken from the pool: (the buffer, the staged and
        prepared version, None) or (the buffer, None, why it is refused)."""
        raise NotImplementedError

    def _serve(self, job: Job, stop: threading.Event) -> None:
        flat, staged, why = self._receive(job)
        if why is None:
            while not job.finished.wait(0.5):
                if stop.is_set():
                    why = "the engine stopped"
                    break
        if why is None and job.abandoned:
            why = "abandoned by its client"
        if why is not None:
            self.target.discard()
            self.pool.give(flat)
            self._refuse(job, why)
            return
        assert staged is not None
        try:  # the target owns ``staged`` from here on, whatever the outcome
            info = self.target.commit(job.version, staged, self.pool)
        except CommitFailed as e:
            self.target.discard()
            self._refuse(job, f"its commit failed: {e}")
            return
        self.stats.committed += 1
        log.info("inflight: v%d (%s) committed at step %d (%.1f ms)", job.version, self.what, info.step,
                 info.commit_ms)

    def _refuse(self, job: Job, why: str) -> None:
        if job.abandoned:
            return
        with self._lock:
            self._refusals.append(f"v{job.version} did not commit: {why}")
        self.stats.last_error = f"[{self.what}] v{job.version}: {why}"
