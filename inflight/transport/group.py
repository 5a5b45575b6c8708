"""A stateless torch.distributed group between trainer rank 0 and the engine workers.

"Stateless" means it never touches torch's global default group, so it can live next to
vLLM's own groups inside a worker and next to accelerate's inside the trainer. It has two
planes, both from torch.distributed:

- the data plane: a ProcessGroup (gloo on CPU, NCCL on CUDA) that broadcasts bucket bytes;
- the control plane: the group's TCPStore, which carries msgspec control messages and
  replies (see ``control.py``); TCPStore is hosted by rank 0, the trainer.

Every wait has a timeout, and a timeout raises ``TransportTimeout`` naming the peer and
what was being waited for. After a failure the group is not reused: rank 0 ``reform``s
the next generation and the workers join it (see ``WeightGroup``).
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroup, Store, TCPStore, Work

from inflight.protocol import (
    AuthError,
    Joined,
    ProtocolError,
    Roster,
    decode_control,
    decode_reply,
    encode,
)
from inflight.auth import read_secret, seal, unseal
from inflight.transport.liveness import Heartbeat, silent_ranks


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now, for the trainer's store on one machine.

    Chosen below the kernel's ephemeral range: a port the kernel hands out itself (a bind to
    port 0, the local end of every outgoing connection, gloo's pairs) comes from that range,
    so between this check and the store's bind nothing but another explicit bind can take
    the port. A port from ``bind(0)`` could be taken by any new connection in that window
    (a full test suite hit it once: the store then failed with EADDRINUSE)."""
    low, _ = _ephemeral_range()
    first = max(1024, low - 12000)
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(first, low) if low > first else 0
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    with socket.socket() as s:  # every try below the range was taken: the old way
        s.bind((host, 0))
        return s.getsockname()[1]


class TransportError(RuntimeError):
    """The group failed: a peer vanished, a collective broke, or a message was unusable."""


class GaveUp(TransportError):
    """A wait was abandoned: what it waited for will not come (e.g. a newer generation opened)."""


class TransportTimeout(TransportError):
    """A wait on the group ran past its timeout; ``ranks``: the members waited for, if known."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    """How trainer rank 0 and the engine workers find each other."""

    host: str = "127.0.0.1"
    """Address of the trainer's TCPStore: rank 0 listens on this address only (loopback by
    default, so nothing off the machine can reach the group unless an address is configured;
    ``0.0.0.0`` listens everywhere), and workers connect to it."""
    port: int
    """TCP port of the store; must be free on ``host``."""
    world_size: int = 2
    """1 trainer + the number of engine workers that receive weights."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Data-plane backend: ``auto`` picks NCCL when CUDA is available, else gloo."""
    timeout_s: float = 60.0
    """Limit on every wait: connecting, each bucket, each control message."""
    name: str = "inflight"
    """Key prefix in the store, so several groups can share one store."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"GroupConfig.port={self.port} is not a TCP port")
        if self.world_size < 2:
            raise ValueError(f"GroupConfig.world_size={self.world_size}: need the trainer and at least one worker")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"GroupConfig.backend={self.backend!r} is not one of auto, gloo, nccl")
        if not self.timeout_s > 0:
            raise ValueError(f"GroupConfig.timeout_s={self.timeout_s} must be > 0")

    def resolved_backend(self) -> Literal["gloo", "nccl"]:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend


def connect_store(config: GroupConfig, name: str) -> PrefixStore:
    """A client of the group's store (hosted by the trainer), for processes outside the group."""
    try:
        tcp = TCPStore(config.host, config.port, is_master=False, timeout=timedelta(seconds=config.timeout_s))
    except Exception as e:
        raise TransportError(f"cannot reach the group store at {config.host}:{config.port}: {e}") from e
    return PrefixStore(f"{config.name}/{name}", tcp)


def _host_store(config: GroupConfig, timeout: timedelta) -> TCPStore:
    """Rank 0's store, listening on ``config.host`` only. TCPStore's own server listens on every
    interface whatever address it is given; the group can push weights into a serving
    engine, so it gets a socket bound to the configured address instead."""
    family, kind, proto, _, address = socket.getaddrinfo(config.host, config.port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return TCPStore(config.host, config.port, config.world_size, is_master=True, timeout=timeout,
                        wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def await_trainer_gone(config: GroupConfig, incarnation: str, stop: threading.Event, *, poll_s: float = 0.25,
                       recheck_s: float = 5.0) -> None:
    """Return once the trainer whose store had ``incarnation`` is gone (or another took its
    port), touching its store with no client meanwhile: a client whose store's host exits
    prints a C++ stack trace on its next read, which is what an engine that outlives a
    trainer that said goodbye must not do. Raises ``InterruptedError`` when ``stop`` is set."""
    reachable_since = time.monotonic()
    while not stop.is_set():
        if not store_reachable(config.host, config.port, poll_s):
            return
        if time.monotonic() - reachable_since > recheck_s:  # a new trainer between two probes?
            try:
                root = PrefixStore(config.name, TCPStore(config.host, config.port, is_master=False,
                                                         timeout=timedelta(seconds=poll_s), wait_for_workers=False))
                now = root.get("incarnation").decode() if root.check(["incarnation"]) else ""
            except Exception:  # noqa: BLE001  gone while asking
                return
            finally:
                root = None
            if now != incarnation:
                return
            reachable_since = time.monotonic()
        stop.wait(poll_s)
    raise InterruptedError("stopped while waiting for the trainer to leave")


_NCCL_ENV_LOCK = threading.Lock()


def _make_process_group(
    store: PrefixStore, rank: int, size: int, backend: str, timeout: timedelta, device: torch.device
) -> ProcessGroup:
    # Same construction as torch's init_process_group, minus the global registration.
    pg = ProcessGroup(store, rank, size)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        impl = ProcessGroupGloo(store, rank, size, timeout)
        kind = ProcessGroup.BackendType.GLOO
    else:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # NCCL's watchdog acts on a collective that outlives the timeout according to
        # TORCH_NCCL_ASYNC_ERROR_HANDLING, read when the group is built. Its default (3)
        # tears the whole process down: a stalled trainer would kill a serving engine. 2
        # ("clean up only") aborts the communicator and leaves the process alone; our own
        # wait (``WeightGroup.wait``) notices the timeout first, aborts the group and
        # raises, and the worker forms a fresh communicator in the next generation. Scoped
        # to this group's construction: vLLM's own NCCL groups keep their settings.
        with _NCCL_ENV_LOCK:
            saved = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
            try:
                impl = ProcessGroupNCCL(store, rank, size, opts)
            finally:
                if saved is None:
                    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)
                else:
                    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = saved
        kind = ProcessGroup.BackendType.NCCL
    pg._set_default_backend(kind)
    impl._set_sequence_number_for_group()
    pg._register_backend(device, kind, impl)
    return pg


INCARNATION = uuid.uuid4().hex[:12]
"""This process's id in ``Joined`` messages."""

_POLL_MAX_S = 0.005  # idle polling backs off to this; a blocking store wait would log a warning per timeout


def wait_key(store: Store, key: str, *, timeout_s: float | None, stop: threading.Event | None, what: str, who: str,
             give_up: Callable[[], bool] | None = None) -> bytes:
    """Wait for ``key`` in ``store`` and return its value; ``timeout_s=None`` waits until ``stop``.

    Polls with ``check`` (one small round trip) rather than ``store.wait``, whose timeouts
    log a c10d warning each, so an idle worker stays quiet. ``give_up``, asked every
    quarter second, raises ``TransportError`` when it says the key will never come.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 0.0002
    next_ask = time.monotonic() + 0.25
    while True:
        try:
            if store.check([key]):
                return store.get(key)
        except RuntimeError as e:  # the store's host (the trainer) is gone
            raise TransportTimeout(f"{who}: store failed while waiting for {what}: {e}") from e
        if give_up is not None and time.monotonic() > next_ask:  # after the check: a key that came is taken
            next_ask = time.monotonic() + 0.25
            if give_up():
                raise GaveUp(f"{who}: gave up waiting for {what}")
        if stop is not None and stop.is_set():
            raise InterruptedError(f"{who}: stopped while waiting for {what}")
        if deadline is not None and time.monotonic() > deadline:
            raise TransportTimeout(f"{who}: no {what} within {timeout_s:.1f}s")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def store_reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts connections at the store's address. A plain socket probe:
    a TCPStore client that cannot connect prints a C++ stack trace per attempt, which an
    engine started before its trainer would otherwise repeat every retry."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _connect(config: GroupConfig, rank: int, deadline: float | None, stop: threading.Event | None) -> TCPStore:
    """A client of rank 0's store, retried until ``deadline`` (None: until ``stop``) so a worker
    can wait out a trainer that is starting or restarting."""
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        attempt_s = min(config.timeout_s, 2.0) if left is None else max(min(config.timeout_s, 2.0, left), 0.1)
        try:
            if not store_reachable(config.host, config.port, attempt_s):
                raise ConnectionRefusedError(f"nothing listens at {config.host}:{config.port}")
            tcp = TCPStore(config.host, config.port, config.world_size, is_master=False,
                           timeout=timedelta(seconds=attempt_s), wait_for_workers=False)
            tcp.set_timeout(timedelta(seconds=config.timeout_s))
            return tcp
        except Exception as e:
            if stop is not None and stop.is_set():
                raise InterruptedError(f"rank {rank}: stopped while connecting to the group store") from e
            if left is not None and left <= 0:
                raise TransportTimeout(f"rank {rank}: cannot reach the group store at {config.host}:{config.port}: {e}") from e
            time.sleep(0.2)


def _open_generation(root: Store, rank: int, tried: set[int], deadline: float | None, stop: threading.Event | None) -> int:
    """The generation rank 0 has open for joining, other than those in ``tried``."""
    while True:
        try:
            g = root.add("generation", 0) if root.check(["incarnation"]) else 0
            if g > 0 and g not in tried and root.check([f"gen{g}/open"]):
                return g
        except RuntimeError as e:
            raise TransportError(f"rank {rank}: the group store failed while waiting to join: {e}") from e
        if stop is not None and stop.is_set():
            raise InterruptedError(f"rank {rank}: stopped while waiting to join the group")
        if deadline is not None and time.monotonic() > deadline:
            raise TransportTimeout(f"rank {rank}: the trainer (rank 0) opened no generation to join")
        time.sleep(0.01)


class WeightGroup:
    """One member of the trainer/engine group. Rank 0 is the trainer and the only sender.

    Forming a generation (ordering invariant): rank 0 hosts the store, marks it with a
    random ``incarnation``, bumps ``generation`` to g and opens ``gen<g>/open``; each worker
    waits for an open generation it is not already in and posts ``Joined`` under
    ``gen<g>/hello/<rank>``. Rank 0 waits for the workers it wants (all of them at first;
    after a failure, whoever answers within the timeout), admits whole engines only, posts
    the ``Roster`` and builds the data plane of its members (the i-th member is data-plane
    rank i + 1); then it closes ``open``. A worker left out of a roster knocks
    (``knock/<rank>``) and waits for the next generation, which rank 0 opens when it sees
    the knock. So a worker that lost its group (trainer gone, a timeout, a stop) never walks
    into a generation that already formed, and a fleet goes on without a silent member.
    """

    def __init__(
        self, config: GroupConfig, rank: int, device: torch.device | None = None, *,
        live_version: int = 0, stop: threading.Event | None = None, join_timeout_s: float | None = None,
        engine_ranks: tuple[int, ...] = (), secret: bytes | None | Literal["env"] = "env",
    ) -> None:
        if not 0 <= rank < config.world_size:
            raise ValueError(f"rank {rank} outside world_size {config.world_size}")
        self.config = config
        self.rank = rank
        self.backend = config.resolved_backend()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.device = device
        self.timeout = timedelta(seconds=config.timeout_s)
        self.secret = read_secret() if secret == "env" else secret
        """Shared secret sealing every message of the group (``INFLIGHT_SECRET``; None: none)."""
        self.pg: ProcessGroup | None = None
        self.roster: tuple[int, ...] = ()
        """The worker ranks of the current generation, in data-plane order."""
        self.hellos: dict[int, Joined] = {}
        """Rank 0: each member's ``Joined`` for the current generation."""
        self._heartbeat: Heartbeat | None = None
        join_timeout = config.timeout_s if join_timeout_s is None else join_timeout_s
        if rank == 0:
            try:
                self._tcp = _host_store(config, self.timeout)
            except Exception as e:  # torch raises several store errors; name the endpoint
                raise TransportError(f"rank 0: cannot host the group store on {config.host}:{config.port}: {e}") from e
            self._root = PrefixStore(config.name, self._tcp)
            self.incarnation = uuid.uuid4().hex
            self._root.set("incarnation", self.incarnation)
            try:
                self.reform(join_timeout)
            except BaseException:  # free the port at once: the error may be kept (with this object) a while
                self.close()
                raise
        else:
            try:
                self._join(live_version, stop, join_timeout_s, engine_ranks or (rank,))
            except BaseException:
                self.close()  # a member that never joined must not go on beating
                raise

    # -- forming a generation ---------------------------------------------------------------
    @property
    def workers(self) -> list[int]:
        """Every worker rank the group may hold (1 .. world_size - 1)."""
        return list(range(1, self.config.world_size))

    def reform(self, timeout_s: float | None = None, *, want: set[int] | None = None,
               require: set[int] | None = None) -> dict[int, Joined]:
        """Rank 0: drop the current data plane (if any) and form the next generation; returns
        its members' ``Joined``.

        Waits up to ``timeout_s`` for every rank in ``want`` (default: all workers). Raises
        ``TransportTimeout`` naming them if a rank of ``require`` (default: ``want``) did not
        come, or if no engine came whole; otherwise the members are the whole engines that
        came (pass ``require=set()`` to go on without the silent ones)."""
        if self.rank != 0:
            raise ValueError("only rank 0 opens generations; workers join them")
        self._close_data_plane()
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        want = set(self.workers) if want is None else set(want)
        require = want if require is None else set(require)
        g = self._root.add("generation", 1)
        self._root.set(f"gen{g}/open", b"1")
        try:
            hellos = self._collect_hellos(g, want, time.monotonic() + timeout_s)
            missing = sorted(require - hellos.keys())
            if missing:
                raise TransportTimeout(f"rank 0: worker ranks {missing} did not join generation {g} within {timeout_s:.1f}s")
            members = tuple(sorted(r for r, h in hellos.items() if all(e in hellos for e in (h.engine_ranks or (r,)))))
            if not members:
                raise TransportTimeout(f"rank 0: no engine joined generation {g} whole within {timeout_s:.1f}s "
                                       f"(heard from ranks {sorted(hellos)}, wanted {sorted(want)})")
            self._root.set(f"gen{g}/roster", seal(encode(Roster(generation=g, members=members)), self.secret,
                                                  self._context(f"gen{g}/roster")))
            self.roster = members
            self._form_data_plane(g)
        finally:
            self._root.delete_key(f"gen{g}/open")
        for r in members:
            self._root.delete_key(f"knock/{r}")
        self.hellos = {r: hellos[r] for r in members}
        return self.hellos

    def _collect_hellos(self, g: int, want: set[int], deadline: float) -> dict[int, Joined]:
        hellos: dict[int, Joined] = {}
        pause = 0.0002
        while True:
            for r in sorted(want - hellos.keys()):
                key = f"gen{g}/hello/{r}"
                if self._root.check([key]):
                    try:
                        msg = decode_reply(unseal(self._root.get(key), self.secret, self._context(key)))
                    except AuthError as e:  # a trainer without the engines' secret must not go on
                        raise AuthError(f"rank 0: worker rank {r}'s hello to generation {g} failed authentication: "
                                        f"{e}") from None
                    except ProtocolError as e:
                        raise TransportError(f"rank 0: unreadable hello of worker rank {r} at {key} (bytes from a "
                                             f"stray client?): {e}") from None
                    if isinstance(msg, Joined) and msg.rank == r:
                        hellos[r] = msg
            if hellos.keys() >= want or time.monotonic() > deadline:
                return hellos
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def silent(self, ranks: Iterable[int] | None = None) -> tuple[int, ...]:
        """Rank 0: which of ``ranks`` (default: this generation's members) are dead or frozen,
        by their heartbeats (see ``liveness``); blocks for a short window."""
        return silent_ranks(self._root, self.roster if ranks is None else ranks, self.config.timeout_s)

    def knocking(self) -> list[int]:
        """Rank 0: worker ranks outside the current generation that asked to be let in."""
        return [r for r in self.workers if r not in self.roster and self._root.check([f"knock/{r}"])]

    def superseded(self) -> bool:
        """Worker: rank 0 opened a generation after this one (this member was dropped, or
        everyone is being re-formed): whatever this generation waits for will not come."""
        try:
            return self._root.add("generation", 0) > self.generation
        except RuntimeError as e:
            raise TransportError(f"rank {self.rank}: the group store failed: {e}") from e

    def _join(self, live_version: int, stop: threading.Event | None, timeout_s: float | None,
              engine_ranks: tuple[int, ...]) -> None:
        """Worker: connect to the store, wait for an open generation, announce, form."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._tcp = _connect(self.config, self.rank, deadline, stop)
        self._root = PrefixStore(self.config.name, self._tcp)
        # beat before the hello, so rank 0 never finds a member of a generation silent
        self._heartbeat = Heartbeat(self.config.host, self.config.port, self.config.name, self.rank, self.config.timeout_s)
        tried: set[int] = set()
        hello = encode(Joined(rank=self.rank, live_version=live_version, incarnation=INCARNATION,
                              engine_ranks=tuple(engine_ranks)))
        while True:
            self._root.set(f"knock/{self.rank}", INCARNATION.encode())
            g = _open_generation(self._root, self.rank, tried, deadline, stop)
            tried.add(g)
            try:
                self.incarnation = self._root.get("incarnation").decode()  # set before any generation opens
            except RuntimeError as e:
                raise TransportError(f"rank {self.rank}: the group store failed while joining: {e}") from e
            self._root.set(f"gen{g}/hello/{self.rank}", seal(hello, self.secret, self._context(f"gen{g}/hello/{self.rank}")))
            roster = self._wait_roster(g, deadline, stop)
            if roster is None or self.rank not in roster.members:
                continue  # rank 0 formed g without this engine (it came too late): knock for the next
            self.roster = roster.members
            try:
                self._form_data_plane(g)
                return
            except TransportError:  # rank 0 gave up on g meanwhile; look for the next one
                if deadline is not None and time.monotonic() > deadline:
                    raise

    def _wait_roster(self, g: int, deadline: float | None, stop: threading.Event | None) -> Roster | None:
        """The roster of g, or None if rank 0 closed g without posting one."""
        left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            raw = wait_key(self._root, f"gen{g}/roster", timeout_s=left, stop=stop, what=f"the roster of generation {g}",
                           who=f"rank {self.rank}", give_up=lambda: not self._root.check([f"gen{g}/open"]))
            msg = decode_control(unseal(raw, self.secret, self._context(f"gen{g}/roster")))
        except GaveUp:
            return None
        except ProtocolError as e:
            raise TransportError(f"rank {self.rank}: unreadable roster of generation {g}: {e}") from e
        return msg if isinstance(msg, Roster) and msg.generation == g else None

    def _form_data_plane(self, g: int) -> None:
        prefix = f"{self.config.name}/gen{g}"
        pg_rank = 0 if self.rank == 0 else 1 + self.roster.index(self.rank)
        size = 1 + len(self.roster)
        try:
            self.pg = _make_process_group(PrefixStore(prefix + "/pg", self._tcp), pg_rank, size, self.backend,
                                          self.timeout, self.device)
        except Exception as e:
            raise TransportError(f"rank {self.rank}: forming {self.backend} group {prefix} of {size} failed: {e}") from e
        self.generation = g
        self.incarnation = self._root.get("incarnation").decode()
        self.store = PrefixStore(prefix + "/ctl", self._tcp)

    def _context(self, key: str) -> str:
        """What a sealed message at ``key`` of the root key space is bound to (``auth.seal``): the
        key in this store's random incarnation, so it cannot be replayed to another trainer."""
        return f"{self.config.name}/{self.incarnation}/{key}"

    def auth_context(self, key: str) -> str:
        """What a sealed control message at ``key`` is bound to: the key in this generation of
        this store (its random incarnation), so it cannot be replayed elsewhere."""
        return f"{self.config.name}/{self.incarnation}/gen{self.generation}/ctl/{key}"

    def stop_beating(self) -> None:
        """Stop this worker's heartbeat (leaving: its store client must not outlive the trainer's store)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    @property
    def identity(self) -> tuple[str, int]:
        """(store incarnation, generation): which formation of the group this member is in."""
        return self.incarnation, self.generation

    def sub_store(self, name: str) -> PrefixStore:
        """A key space of this group's store for other traffic (e.g. the rollout queue)."""
        return PrefixStore(f"{self.config.name}/{name}", self._tcp)

    @property
    def peers(self) -> list[int]:
        """Ranks this member exchanges with: the generation's workers for the trainer, the trainer for a worker."""
        return list(self.roster) if self.rank == 0 else [0]

    def start_broadcast(self, tensor: torch.Tensor, *, what: str) -> tuple[Work, str]:
        """Post a broadcast from rank 0 into every member's ``tensor``; finish it with ``wait``.

        Every member must post the same broadcasts in the same order.
        """
        opts = BroadcastOptions()
        opts.rootRank = 0
        try:
            return self.pg.broadcast([tensor], opts), what
        except Exception as e:
            raise TransportError(f"rank {self.rank}: posting {what} failed: {e}") from e

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
        except TransportError:
            raise
        except Exception as e:
            msg = f"rank {self.rank}: {what} from/to {peer} failed after <= {timeout.total_seconds():.1f}s: {e}"
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TransportTimeout(msg) from e
            raise TransportError(msg) from e

    def _poll_nccl(self, work: Work, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        next_ask = time.monotonic() + 0.25
        pause = 0.00005
        while not work.is_completed():
            now = time.monotonic()
            if now > deadline:
                self._abort()
                raise TransportTimeout(f"rank {self.rank}: {what} did not complete within {timeout_s:.1f}s; "
                                       "NCCL communicator aborted")
            if self.rank != 0 and now > next_ask:
                next_ask = now + 0.25
                if self.superseded():
                    self._abort()
                    raise TransportError(f"rank {self.rank}: {what}: the trainer moved to a newer generation; "
                                         "NCCL communicator aborted")
            time.sleep(pause)
            pause = min(pause * 2, 0.001)

    def _abort(self) -> None:
        pg, self.pg = self.pg, None
        try:
            pg.abort() if pg is not None else None
        except Exception:  # already broken; nothing more to release
            pass

    def broadcast(self, tensor: torch.Tensor, *, what: str, timeout_s: float | None = None) -> None:
        """Blocking ``start_broadcast`` + ``wait``."""
        self.wait(self.start_broadcast(tensor, what=what), timeout_s)

    def close(self) -> None:
        """Leave: drop the data plane and this member's store handles (rank 0's store, and its
        port, go with the last reference, e.g. a rollout queue's)."""
        self._close_data_plane()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        for attr in ("store", "_root", "_tcp"):
            self.__dict__.pop(attr, None)

    def _close_data_plane(self) -> None:
        pg, self.pg = self.pg, None
        try:
            pg.shutdown() if pg is not None and hasattr(pg, "shutdown") else None
        except Exception:  # a broken group may refuse to shut down cleanly; nothing to save
            pass
