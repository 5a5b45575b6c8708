"""The data plane of one generation of the group: a stateless gloo or NCCL process group
that broadcasts bucket bytes from rank 0 (the trainer) to every member.

"Stateless" means it never touches torch's global default group, so it lives next to
vLLM's own groups inside a worker and next to accelerate's inside the trainer. It is built
once per generation and never reused after a failure: the next generation builds a new one.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroup, Work

from inflight.settings import DataPlane as Backend
from inflight.transport.errors import GaveUp, TransportError, TransportTimeout
from inflight.transport.poll import poll_until

_NCCL_ENV_LOCK = threading.Lock()
_nccl_env_set = False


def nccl_error_handling_once() -> None:
    """Set ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` ("clean up only") once per process.

    NCCL's watchdog acts on a collective that outlives its timeout according to this
    variable, read when a ProcessGroupNCCL is built. Its default (3) tears the whole process
    down: a stalled trainer would kill a serving engine. 2 aborts the communicator and leaves
    the process alone; our own wait (``DataPlane.wait``) notices the timeout first, aborts and
    raises, and the next generation builds a new communicator. It is written once, at start-up
    (``inflight_start``, the trainer's first group), never per generation: ``setenv`` is not
    thread-safe in glibc beside another thread's ``getenv``. NCCL groups the process builds
    later get the same handling; vLLM builds its own before ``inflight_start``."""
    global _nccl_env_set
    with _NCCL_ENV_LOCK:
        if not _nccl_env_set:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
            _nccl_env_set = True


def _make_process_group(store: PrefixStore, rank: int, size: int, backend: Backend, timeout: timedelta,
                        device: torch.device, bind: str | None) -> ProcessGroup:
    # Same construction as torch's init_process_group, minus the global registration.
    pg = ProcessGroup(store, rank, size)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        # gloo's default device binds the hostname's address (or GLOO_SOCKET_IFNAME's): a group
        # configured on loopback would still listen for bucket bytes on another interface
        opts._devices = [ProcessGroupGloo.create_device(hostname=bind) if bind else ProcessGroupGloo.create_default_device()]
        impl = ProcessGroupGloo(store, rank, size, opts)
        kind = ProcessGroup.BackendType.GLOO
    else:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        nccl_error_handling_once()  # a no-op after start-up, which already set it
        impl = ProcessGroupNCCL(store, rank, size, opts)
        kind = ProcessGroup.BackendType.NCCL
    pg._set_default_backend(kind)
    impl._set_sequence_number_for_group()
    pg._register_backend(device, kind, impl)
    return pg


class DataPlane:
    """One generation's process group, seen from one member (``rank``: the group rank;
    ``pg_rank``: its rank in this process group, 0 for the trainer)."""

    def __init__(self, store: PrefixStore, *, rank: int, pg_rank: int, size: int, backend: Backend,
                 timeout: timedelta, device: torch.device, peers: list[int],
                 superseded: Callable[[], bool], bind: str | None = None, stop: threading.Event | None = None) -> None:
        self.rank = rank
        self.backend = backend
        self.timeout = timeout
        self.peers = peers
        self._superseded = superseded
        self._stop = stop  # a worker's shutdown: ends an NCCL wait at once (``_poll_nccl``)
        self._unfinished = 0  # broadcasts posted and not yet waited for successfully
        self._failed = False
        try:
            self.pg: ProcessGroup | None = _make_process_group(store, pg_rank, size, backend, timeout, device, bind)
        except Exception as e:
            raise TransportError(f"rank {rank}: forming a {backend} group of {size} failed: {e}") from e

    def start_broadcast(self, tensor: torch.Tensor, *, what: str) -> tuple[Work, str]:
        """Post a broadcast from rank 0 into every member's ``tensor``; finish it with ``wait``.

        Every member must post the same broadcasts in the same order.
        """
        opts = BroadcastOptions()
        opts.rootRank = 0
        return self._post(lambda pg: pg.broadcast([tensor], opts), what)

    def start_send(self, tensor: torch.Tensor, pg_rank: int, *, what: str) -> tuple[Work, str]:
        """Rank 0: post ``tensor`` to one member alone (its process-group rank); finish with ``wait``.
        Sends to one member arrive in the order posted."""
        return self._post(lambda pg: pg.send([tensor], pg_rank, 0), what)

    def start_recv(self, tensor: torch.Tensor, *, what: str) -> tuple[Work, str]:
        """A worker: post a receive from rank 0 into ``tensor``; finish with ``wait``."""
        return self._post(lambda pg: pg.recv([tensor], 0, 0), what)

    def _post(self, op: Callable[[ProcessGroup], Work], what: str) -> tuple[Work, str]:
        if self.pg is None:
            raise TransportError(f"rank {self.rank}: posting {what}: the data plane was closed")
        try:
            work = op(self.pg)
        except Exception as e:
            self._failed = True
            raise TransportError(f"rank {self.rank}: posting {what} failed: {e}") from e
        self._unfinished += 1
        return work, what

    def wait(self, pending: tuple[Work, str], timeout_s: float | None = None) -> None:
        """Finish a posted broadcast; raise ``TransportTimeout`` naming the peer and what it carried.

        gloo: ``Work.wait`` blocks the host up to the timeout and raises on it or on a peer's
        closed connection (a trainer that gives up on a generation shuts its side down, so
        the workers' waits fail at once). NCCL: ``Work.wait`` does not block the host at all,
        so a stalled peer would hang the first host sync forever; poll for completion with
        our own deadline instead, and on timeout, or once the trainer opened a newer
        generation (asked every quarter second), abort the communicator before raising:
        this generation is over, and the next one builds a new communicator.
        """
        work, what = pending
        timeout = self.timeout if timeout_s is None else timedelta(seconds=timeout_s)
        peer = "trainer (rank 0)" if self.rank else f"workers {self.peers}"
        try:
            if self.backend == "nccl":
                self._poll_nccl(work, timeout.total_seconds(), f"{what} from/to {peer}")
            work.wait(timeout)  # raises the collective's own error, if it failed
            self._unfinished -= 1
        except TransportError:
            self._failed = True
            raise
        except Exception as e:
            self._failed = True
            msg = f"rank {self.rank}: {what} from/to {peer} failed after <= {timeout.total_seconds():.1f}s: {e}"
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TransportTimeout(msg) from e
            raise TransportError(msg) from e

    def _poll_nccl(self, work: Work, timeout_s: float, what: str) -> None:
        who = f"rank {self.rank}"
        give_up = self._superseded if self.rank != 0 else None
        try:  # a few ms between polls at most: each is a GIL grab beside vLLM's scheduler
            poll_until(lambda: True if work.is_completed() else None, timeout_s=timeout_s, what=what, who=who,
                       give_up=give_up, stop=self._stop, first_pause_s=0.0001, max_pause_s=0.004)
        except BaseException as e:  # every way out aborts: a communicator with work posted is never shut down
            self.abort()
            if isinstance(e, GaveUp):
                raise TransportError(f"{who}: {what}: the trainer moved to a newer generation; "
                                     "NCCL communicator aborted") from None
            if isinstance(e, TransportTimeout):
                raise TransportTimeout(f"{who}: {what} did not complete within {timeout_s:.1f}s; "
                                       "NCCL communicator aborted") from None
            raise

    def broadcast(self, tensor: torch.Tensor, *, what: str, timeout_s: float | None = None) -> None:
        """Blocking ``start_broadcast`` + ``wait``."""
        self.wait(self.start_broadcast(tensor, what=what), timeout_s)

    def abort(self) -> None:
        """Drop the communicator without a goodbye (its peers may be gone)."""
        pg, self.pg = self.pg, None
        try:
            pg.abort() if pg is not None else None
        except Exception:  # already broken; nothing more to release
            pass

    def close(self) -> None:
        """Shut the process group down, gracefully only when it is idle: a graceful shutdown
        waits for posted collectives, and one whose root is dead never completes (NCCL's
        finalize would hang the caller); so after any failure, or with work posted, abort."""
        if self._failed or self._unfinished:
            self.abort()
            return
        pg, self.pg = self.pg, None
        try:
            pg.shutdown() if pg is not None and hasattr(pg, "shutdown") else None
        except Exception:  # a broken group may refuse to shut down cleanly; nothing to save
            pass
