"""The group's TCPStore: its port, hosting it (rank 0), connecting to it, waiting on its keys.

The trainer (rank 0) hosts the store; workers, the engines' commit coordinators and the
rollout queue's producers are its clients. It carries the control plane (msgspec
messages), membership (both ``group.py``), heartbeats (``liveness.py``) and the
rollout queue.

Ports, race-free: ``reserve_port`` binds a listening socket (port 0: the kernel picks) and
keeps it; ``host_store`` on that address in this process takes that very socket. So no
other socket can take the port between its choice and the store's start, and clients that
connect in between wait in the socket's backlog.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore

from inflight.auth import seal, unseal
from inflight.transport.errors import TransportError, TransportTimeout
from inflight.transport.poll import poll_until

_reserved: dict[tuple[str, int], socket.socket] = {}
_reserved_lock = threading.Lock()


def _listen(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def reserve_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` held for the group store this process will host there: a socket is
    bound and listening on it from now on, and ``host_store`` takes it over. ``release_port``
    gives up a reservation that no store took."""
    sock = _listen(host, 0)
    port = sock.getsockname()[1]
    with _reserved_lock:
        _reserved[(host, port)] = sock
    return port


def release_port(host: str, port: int) -> None:
    """Close a reservation no store took (a no-op once a store took it)."""
    with _reserved_lock:
        sock = _reserved.pop((host, port), None)
    if sock is not None:
        sock.close()


def host_store(host: str, port: int, world_size: int, timeout: timedelta) -> TCPStore:
    """Rank 0's store, listening on ``host`` only: on the socket ``reserve_port`` holds for
    this address, or on a new one. TCPStore's own server would listen on every interface
    whatever address it is given; the group can push weights into a serving engine, so it
    gets a socket bound to the configured address instead."""
    with _reserved_lock:
        sock = _reserved.pop((host, port), None)
    if sock is None:
        sock = _listen(host, port)
    fd = sock.detach()
    try:
        return TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                        master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


class SealedStore(dist.Store):
    """A store whose values are sealed for their key (``auth.seal``): what the process-group
    rendezvous (gloo's addresses, NCCL's unique id) writes and reads through it, so a client
    of the store without the secret cannot pose as a member. A forged or replayed value
    fails its ``get`` with ``AuthError``, and the process group's construction with it."""

    def __init__(self, inner: Store, secret: bytes, context: str) -> None:
        super().__init__()
        self._inner, self._secret, self._context = inner, secret, context

    def set(self, key: str, value: bytes | str) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, seal(data, self._secret, f"{self._context}/{key}"))

    def get(self, key: str) -> bytes:
        return unseal(self._inner.get(key), self._secret, f"{self._context}/{key}")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self._inner.set_timeout(timeout)


def store_reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts connections at the store's address. A plain socket probe:
    a TCPStore client that cannot connect prints a C++ stack trace per attempt, which an
    engine started before its trainer would otherwise repeat every retry."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def connect_store(host: str, port: int, prefix: str, timeout_s: float) -> PrefixStore:
    """A client of the group's store (hosted by the trainer), under the key prefix ``prefix``."""
    try:
        tcp = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise TransportError(f"cannot reach the group store at {host}:{port}: {e}") from e
    return PrefixStore(prefix, tcp)


def connect_retrying(host: str, port: int, world_size: int, timeout_s: float, *, who: str,
                     deadline: float | None, stop: threading.Event | None) -> TCPStore:
    """A client of rank 0's store, retried until ``deadline`` (None: until ``stop``) so a
    worker can wait out a trainer that is starting or restarting."""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        attempt_s = min(timeout_s, 2.0) if left is None else max(min(timeout_s, 2.0, left), 0.1)
        try:
            if not store_reachable(host, port, attempt_s):
                raise ConnectionRefusedError(f"nothing listens at {host}:{port}")
            tcp = TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=attempt_s),
                           wait_for_workers=False)
            tcp.set_timeout(timedelta(seconds=timeout_s))
            return tcp
        except Exception as e:
            if stop is not None and stop.is_set():
                raise InterruptedError(f"{who}: stopped while connecting to the group store") from e
            if left is not None and left <= 0:
                raise TransportTimeout(f"{who}: cannot reach the group store at {host}:{port}: {e}") from e
            time.sleep(0.2)


def wait_key(store: Store, key: str, *, timeout_s: float | None, stop: threading.Event | None, what: str, who: str,
             give_up=None) -> bytes:
    """Wait for ``key`` in ``store`` and return its value; ``timeout_s=None`` waits until ``stop``.

    Polls with ``check`` (one small round trip; see ``poll_until``). ``give_up``, asked every
    quarter second, raises ``GaveUp`` when it says the key will never come. A store whose
    host went away raises ``TransportTimeout``.
    """
    def ready() -> bytes | None:
        try:
            return store.get(key) if store.check([key]) else None
        except RuntimeError as e:  # the store's host (the trainer) is gone
            raise TransportTimeout(f"{who}: store failed while waiting for {what}: {e}") from e
    return poll_until(ready, timeout_s=timeout_s, stop=stop, what=what, who=who, give_up=give_up)


def await_trainer_gone(host: str, port: int, name: str, incarnation: str, stop: threading.Event, *,
                       poll_s: float = 0.25, recheck_s: float = 5.0) -> None:
    """Return once the trainer whose store had ``incarnation`` is gone (or another took its
    port), touching its store with no client meanwhile: a client whose store's host exits
    prints a C++ stack trace on its next read, which is what an engine that outlives a
    trainer that said goodbye must not do. Raises ``InterruptedError`` when ``stop`` is set."""
    reachable_since = time.monotonic()
    while not stop.is_set():
        if not store_reachable(host, port, poll_s):
            return
        if time.monotonic() - reachable_since > recheck_s:  # a new trainer between two probes?
            try:
                root = PrefixStore(name, TCPStore(host, port, is_master=False, timeout=timedelta(seconds=poll_s),
                                                  wait_for_workers=False))
                now = root.get("incarnation").decode() if root.check(["incarnation"]) else ""
            except Exception:  # gone while asking
                return
            finally:
                root = None
            if now != incarnation:
                return
            reachable_since = time.monotonic()
        stop.wait(poll_s)
    raise InterruptedError("stopped while waiting for the trainer to leave")
