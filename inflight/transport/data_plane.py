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
from inflight.transport.errors import GaveUp, TransportError, TransportTimeout, member
from inflight.transport.poll import call_beside, poll_until

_NCCL_ENV_LOCK = threading.Lock()
_nccl_env_set = False


NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
"""What ``nccl_error_handling_once`` writes: clean up only, and no debug dump on a timeout or
error (torch 2.x reads both when a ProcessGroupNCCL is built)."""


def nccl_error_handling_once() -> None:
    """Set ``NCCL_ENV`` once per process, so no watchdog of a weight group takes a process down.

    NCCL's watchdog acts on a collective that outlives its timeout, or fails, according to
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: its default (3) tears the whole process down, so a
    stalled trainer would kill a serving engine; 2 aborts the communicator and leaves the
    process alone. With ``TORCH_NCCL_DUMP_ON_TIMEOUT`` at its default (1), the same event
    also sets a process-wide flag on which the heartbeat monitor of the process's first NCCL
    group (vLLM's own world group, in a worker) dumps and then terminates the process, minutes
    later; 0 leaves that flag alone. Our own wait (``DataPlane.wait``) notices a timeout
    first anyway (the group's watchdog timeout is longer: ``watchdog_timeout``), aborts and
    raises, and the next generation builds a new communicator. Both are written once, at
    start-up (``inflight_start``, the trainer's first group), never per generation: ``setenv``
    is not thread-safe in glibc beside another thread's ``getenv``. NCCL groups the process
    builds later get the same settings; vLLM builds its own before ``inflight_start``."""
    global _nccl_env_set
    with _NCCL_ENV_LOCK:
        if not _nccl_env_set:
            for key, value in NCCL_ENV.items():
                os.environ[key] = value
            _nccl_env_set = True


NCCL_MAX_CTAS = 8
"""The most thread blocks (CTAs) a weight-group op of NCCL's takes: a receive posted for a
bucket stays resident while the engine decodes, and every SM it holds is one the forward
passes lose (an H100 has 132). A bucket still moves at several times a network link's rate."""


def watchdog_timeout(timeout: timedelta) -> timedelta:
    """The NCCL watchdog's timeout for a data plane whose waits give up after ``timeout``.
    Its clock starts when an op is posted, ours when it is waited for, and a receiver posts
    the next header while a bucket arrives: so four of our deadlines and ten minutes, by
    which time our wait has long aborted the communicator (the watchdog never fires first)."""
    return 4 * timeout + timedelta(minutes=10)


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
        opts._devices = [ProcessGroupGloo.create_device(hostname=bind) if bind
                         else ProcessGroupGloo.create_default_device()]
        impl = ProcessGroupGloo(store, rank, size, opts)
        kind = ProcessGroup.BackendType.GLOO
    else:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = watchdog_timeout(timeout)
        opts.config.max_ctas = NCCL_MAX_CTAS
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
        self._stop = stop  # a worker's shutdown: ends a wait at once (``_poll``)
        self._unfinished = 0  # broadcasts posted and not yet waited for successfully
        self._failed = False
        try:
            self.pg: ProcessGroup | None = _make_process_group(store, pg_rank, size, backend, timeout, device, bind)
        except Exception as e:
            raise TransportError(f"{member(rank)}: forming a {backend} group of {size} failed: {e}") from e
        if backend == "nccl":
            self._connect_nccl(device)

    def _connect_nccl(self, device: torch.device) -> None:
        """Form the NCCL communicator now rather than inside the first op, where a peer lost
        before it would leave this member in ``ncclCommInitRank`` for good: it forms on a
        helper thread (the unique id crosses the store) polled like an op (``_beside``: the
        deadline, ``stop``, a newer generation or a dead trainer end the wait). A formation
        that never ends is left to its daemon thread; this generation is over either way.
        (A non-blocking communicator would not do: torch marks it ready only at its first op.)"""
        assert self.pg is not None
        nccl = self.pg._get_backend(device)
        self.pg.bound_device_id = device
        try:
            self._beside(lambda: nccl.eager_connect_single_device(device), self.timeout.total_seconds(),
                         "the NCCL communicator to form")
        except (TransportError, InterruptedError):  # ``_poll`` aborted already; InterruptedError: ``stop``
            raise
        except Exception as e:
            self.abort()
            raise TransportError(f"{member(self.rank)}: connecting NCCL on {device} failed: {e}") from e

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
            raise TransportError(f"{member(self.rank)}: posting {what}: the data plane was closed")
        try:
            work = op(self.pg)
        except Exception as e:
            self._failed = True
            raise TransportError(f"{member(self.rank)}: posting {what} failed: {e}") from e
        self._unfinished += 1
        return work, what

    def wait(self, pending: tuple[Work, str], timeout_s: float | None = None) -> None:
        """Finish a posted broadcast; raise ``TransportTimeout`` naming the peer and what it carried.

        A worker (and rank 0 on NCCL) polls with our own deadline rather than only blocking
        in ``Work.wait``: NCCL's does not block the host at all, and gloo's does not always
        return when its peer dies (a SIGKILLed trainer's closed connections went unnoticed
        until the timeout for a kill at some buckets of a push). NCCL's op is polled for
        completion; gloo's ``Work.wait`` blocks on a helper thread (a gloo receive is
        complete only once waited for) while the caller polls that thread. Every quarter
        second the poll asks whether a newer generation opened or the trainer died (the
        worker's heartbeat keeps both, ``WeightGroup.superseded``): either way this
        generation is over. On a timeout, a newer generation, a dead trainer or ``stop`` the
        communicator is aborted before raising; the next generation builds a new one (a gloo
        wait left blocked ends at its own timeout, on its daemon thread, with nothing to write:
        its sender is gone). Rank 0 on gloo blocks: its peers' deaths are the heartbeats' to
        tell (``inflight.transport.liveness``).
        """
        work, what = pending
        timeout = self.timeout if timeout_s is None else timedelta(seconds=timeout_s)
        peer = member(0) if self.rank else f"workers {self.peers}"
        label = f"{what} from/to {peer}"
        try:
            if self.backend == "nccl":
                self._poll(lambda: True if work.is_completed() else None, timeout.total_seconds(), label)
                work.wait(timeout)  # raises the collective's own error, if it failed
            elif self.rank != 0:
                # a second past gloo's own deadline: its timeout error, which names the op, comes first
                self._beside(lambda: work.wait(timeout), timeout.total_seconds() + 1.0, label)
            else:
                work.wait(timeout)
            self._unfinished -= 1
        except (TransportError, InterruptedError):  # InterruptedError: ``stop`` (the worker shuts down)
            self._failed = True
            raise
        except Exception as e:
            self._failed = True
            msg = f"{member(self.rank)}: {what} from/to {peer} failed after <= {timeout.total_seconds():.1f}s: {e}"
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TransportTimeout(msg) from e
            raise TransportError(msg) from e

    def _beside(self, fn: Callable[[], object], timeout_s: float, what: str) -> None:
        """``fn()`` (a blocking native call) beside our poll of it (``call_beside``, ``_poll``)."""
        call_beside(fn, lambda done: self._poll(done, timeout_s, what))

    def _poll(self, done: Callable[[], bool | None], timeout_s: float, what: str) -> None:
        who = member(self.rank)
        give_up = self._superseded if self.rank != 0 else None
        try:  # a few ms between polls at most: each is a GIL grab beside vLLM's scheduler
            poll_until(done, timeout_s=timeout_s, what=what, who=who,
                       give_up=give_up, stop=self._stop, first_pause_s=0.0001, max_pause_s=0.004)
        except BaseException as e:  # every way out aborts: a communicator with work posted is never shut down
            self.abort()
            if isinstance(e, GaveUp):
                raise TransportError(f"{who}: {what}: the trainer moved to a newer generation; "
                                     f"{self.backend} communicator aborted") from None
            if isinstance(e, TransportTimeout):
                raise TransportTimeout(f"{who}: {what} did not complete within {timeout_s:.1f}s; "
                                       f"{self.backend} communicator aborted") from None
            if isinstance(e, TransportError):  # ``superseded``: the trainer is gone
                raise TransportError(f"{e}, during {what}; {self.backend} communicator aborted") from None
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
