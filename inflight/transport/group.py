"""The weight group: which engine workers form each generation with rank 0, and the numbered
control messages and replies they exchange on the trainer's store.

The group has two planes, both from torch.distributed: the data plane (``data_plane.DataPlane``: gloo or NCCL
broadcasts of bucket bytes) and the control plane on the trainer's TCPStore (``store.py``; messages:
``TrainerControl`` and ``WorkerControl``). ``WeightGroup`` forms generations of it: rank 0 hosts the store and
opens each generation; workers join. Every wait has a timeout, and a timeout raises ``TransportTimeout``
naming the peer and what was being waited for. After a failure the group is not reused: rank 0 ``reform``s
the next generation and the workers join it (see ``WeightGroup``).

Control plane ordering invariant: the trainer posts message ``seq`` only after collecting every reply it
needs for earlier messages, and each worker reads messages strictly in ``seq`` order, so both sides agree on
the sequence without any further handshake. Keys:
- ``msg/<seq>``: a control message (``UpdateAnnounce``, ``Commit``, ``Abort``, ``Shutdown``), or ``ForEachRank``
  when each worker's differs: worker ``rank`` reads ``msg/<seq>/<rank>``, written before the marker;
- ``rep/<seq>/<phase>/<rank>``: worker ``rank``'s reply to message ``seq`` (see ``Phase``).

With a shared secret (``INFLIGHT_SECRET``) every message and reply is sealed with an HMAC over its bytes, its
key and the group's incarnation and generation (``inflight.protocol.seal``): a client of the store without
the secret can neither forge nor replay one; a message that fails the check is answered ``Rejected(unauthenticated)``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Literal

import torch
from torch.distributed import PrefixStore, Store, TCPStore, Work

from inflight.auth import read_secret, seal, unseal
from inflight.protocol import (
    AuthError,
    CommitUnit,
    ControlMessage,
    ForEachRank,
    Joined,
    ProtocolError,
    ReplyMessage,
    Roster,
    ShardPlan,
    decode_control,
    decode_reply,
    encode,
)
from inflight.transport.data_plane import DataPlane, nccl_error_handling_once
from inflight.transport.errors import GaveUp, TransportError, TransportTimeout, member
from inflight.transport.group_config import GroupConfig, data_plane_address
from inflight.transport.liveness import Heartbeat, silent_ranks
from inflight.transport.poll import call_unless_stopped, poll_until
from inflight.transport.store import SealedStore, connect_retrying, host_store, wait_key

INCARNATION = uuid.uuid4().hex[:12]
"""This process's id in ``Joined`` messages."""


def read_generation(root: Store, secret: bytes | None, name: str) -> int:
    """The generation rank 0 opened last, 0 before the first, -1 for a value that does not
    authenticate. The value is sealed for the store's incarnation (``WeightGroup.reform``):
    one a stray client wrote or replayed from another store (or a trainer with another
    secret) neither pulls members out of a generation nor lures them into a forged one."""
    if not root.check(["incarnation", "generation"]):
        return 0
    incarnation = root.get("incarnation").decode(errors="replace")
    try:
        return int(unseal(root.get("generation"), secret, f"{name}/{incarnation}/generation"))
    except (ProtocolError, ValueError):
        return -1


def _open_generation(root: Store, secret: bytes | None, name: str, rank: int, tried: set[int], deadline: float | None,
                     stop: threading.Event | None, unauthenticated: Callable[[], None]) -> int:
    """The generation rank 0 has open for joining, other than those in ``tried``;
    ``unauthenticated()`` runs whenever the generation number does not authenticate."""
    def ready() -> int | None:
        try:
            g = read_generation(root, secret, name)
            if g < 0:
                unauthenticated()
            return g if g > 0 and g not in tried and root.check([f"gen{g}/open"]) else None
        except RuntimeError as e:
            raise TransportError(f"{member(rank)}: the group store failed while waiting to join: {e}") from e
    left = None if deadline is None else deadline - time.monotonic()
    try:
        return poll_until(ready, timeout_s=left, stop=stop, what="a generation to join", who=member(rank))
    except TransportTimeout:
        raise TransportTimeout(f"{member(rank)}: the trainer opened no generation to join") from None


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
        plan: ShardPlan | None = None,
        store: TCPStore | None = None, commit_unit: CommitUnit = "model", label: str = "",
        wire_dtypes: Mapping[str, str] | None = None, keeps_base: bool = False,
    ) -> None:
        if not 0 <= rank < config.world_size:
            raise ValueError(f"{member(rank)} outside world_size {config.world_size}")
        self.config = config
        self.rank = rank
        self.backend = config.resolved_backend()
        if self.backend == "nccl":
            nccl_error_handling_once()  # the trainer: here, at its first group; a worker: at inflight_start
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                      else torch.device("cpu"))
        self.device = device
        self.timeout = timedelta(seconds=config.timeout_s)
        self.secret = read_secret() if secret == "env" else secret
        config.check_exposure(self.secret, member(rank))
        """Shared secret sealing every message of the group (``INFLIGHT_SECRET``; None: none)."""
        self.data: DataPlane | None = None
        self.roster: tuple[int, ...] = ()
        """The worker ranks of the current generation, in data-plane order."""
        self.point_to_point = False  # frames go to each member alone (on NCCL, or all sent a shard plan)
        self.hellos: dict[int, Joined] = {}  # rank 0: each member's ``Joined`` for the current generation
        self._heartbeat: Heartbeat | None = None  # a worker's beat, and its look at the trainer (``superseded``)
        self._stop = stop if rank else None  # a worker's shutdown also ends its data-plane waits (``DataPlane``)
        self._generations = 0  # rank 0: generations opened so far
        join_timeout = config.timeout_s if join_timeout_s is None else join_timeout_s
        if rank == 0:
            try:  # a store shared by several groups (``config.name`` keeps their keys apart), or its own
                self._tcp = store if store is not None else host_store(config.host, config.port, config.world_size,
                                                                       self.timeout)
            except Exception as e:  # torch raises several store errors; name the endpoint
                raise TransportError(f"rank 0: cannot host the group store on {config.host}:{config.port}: {e}") from e
            self._root = PrefixStore(config.name, self._tcp)
            self.incarnation = uuid.uuid4().hex
            self._root.set("incarnation", self.incarnation)
            try:
                self.reform(join_timeout, stop=stop)
            except BaseException:  # free the port at once: the error may be kept (with this object) a while
                self.close()
                raise
        else:
            try:
                self._join(live_version, stop, join_timeout_s, engine_ranks or (rank,), plan, commit_unit, label,
                           dict(wire_dtypes or {}), keeps_base)
            except BaseException:
                self.close()  # a member that never joined must not go on beating
                raise

    # -- forming a generation ---------------------------------------------------------------
    @property
    def workers(self) -> list[int]:
        """Every worker rank the group may hold (1 .. world_size - 1)."""
        return list(range(1, self.config.world_size))

    def reform(self, timeout_s: float | None = None, *, want: set[int] | None = None,
               require: set[int] | None = None, stop: threading.Event | None = None) -> dict[int, Joined]:
        """Rank 0: drop the current data plane (if any) and form the next generation; returns
        its members' ``Joined``.

        Waits up to ``timeout_s`` for every rank in ``want`` (default: all workers). Raises
        ``TransportTimeout`` naming them if a rank of ``require`` (default: ``want``) did not
        come, or if no engine came whole; otherwise the members are the whole engines that
        came (pass ``require=set()`` to go on without the silent ones). ``InterruptedError`` once
        ``stop`` is set while it waits (the caller knows a worker will not come: its process died)."""
        if self.rank != 0:
            raise ValueError("only rank 0 opens generations; workers join them")
        self._close_data_plane()
        # until the roster is posted the group has no members: a generation that fails to form
        # leaves it empty (its old members see it superseded and knock), never the old roster
        self.roster, self.point_to_point, self.hellos = (), False, {}
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        want = set(self.workers) if want is None else set(want)
        require = want if require is None else set(require)
        g = self._generations = self._generations + 1
        self._root.set("generation", seal(str(g).encode(), self.secret, self._context("generation")))
        self._root.set(f"gen{g}/open", b"1")
        try:
            hellos = self._collect_hellos(g, want, time.monotonic() + timeout_s, stop)
            missing = sorted(require - hellos.keys())
            if missing:
                raise TransportTimeout(f"rank 0: worker ranks {missing} did not join generation {g} within "
                                       f"{timeout_s:.1f}s")
            members = tuple(sorted(r for r, h in hellos.items() if all(e in hellos for e in (h.engine_ranks or (r,)))))
            if not members:
                raise TransportTimeout(f"rank 0: no engine joined generation {g} whole within {timeout_s:.1f}s "
                                       f"(heard from ranks {sorted(hellos)}, wanted {sorted(want)})")
            # each its own bytes, point to point; on NCCL always (a broadcast beside vLLM's TP collectives can deadlock)
            p2p = self.backend == "nccl" or all(hellos[r].plan is not None for r in members)
            self._root.set(f"gen{g}/roster", seal(encode(Roster(generation=g, members=members, point_to_point=p2p)),
                                                  self.secret, self._context(f"gen{g}/roster")))
            self.roster, self.point_to_point = members, p2p
            self._form_data_plane(g, stop)  # a member that dies now would hold gloo's rendezvous for timeout_s
        finally:
            self._root.delete_key(f"gen{g}/open")
        for r in members:
            self._root.delete_key(f"knock/{r}")
        self.hellos = {r: hellos[r] for r in members}
        return self.hellos

    def _collect_hellos(self, g: int, want: set[int], deadline: float,
                        stop: threading.Event | None = None) -> dict[int, Joined]:
        """The ``Joined`` of every rank of ``want`` that posted one before ``deadline``."""
        hellos: dict[int, Joined] = {}

        def all_in() -> bool | None:
            for r in sorted(want - hellos.keys()):
                self._check_unauthenticated(r, g)
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
            return True if hellos.keys() >= want else None
        try:
            poll_until(all_in, timeout_s=max(deadline - time.monotonic(), 0.0), what=f"hellos of generation {g}",
                       who=member(0), stop=stop)
        except TransportTimeout:
            pass  # the caller decides what the ones that came are enough for
        return hellos

    def _check_unauthenticated(self, r: int, g: int) -> None:
        """Rank 0: raise ``AuthError`` if worker ``r`` could not authenticate this group (its hello,
        sealed with its secret, does not unseal with ours)."""
        key = f"unauthenticated/{r}"
        if not self._root.check([key]):
            return
        raw = self._root.get(key)
        self._root.delete_key(key)
        try:
            unseal(raw, self.secret, self._context(key))
        except AuthError as e:
            raise AuthError(f"rank 0: worker rank {r}'s hello to generation {g} failed authentication: {e}") from None
        # it shares our secret: what it could not read was written by someone else; it looks again

    def silent(self, ranks: Iterable[int] | None = None) -> tuple[int, ...]:
        """Rank 0: which of ``ranks`` (default: this generation's members) are dead or frozen,
        by their heartbeats (see ``liveness``); blocks for a short window."""
        return silent_ranks(self._root, self.roster if ranks is None else ranks, self.config.timeout_s)

    def knocking(self) -> list[int]:
        """Rank 0: worker ranks outside the current generation that asked to be let in."""
        return [r for r in self.workers if r not in self.roster and self._root.check([f"knock/{r}"])]

    def superseded(self) -> bool:
        """Worker: rank 0 opened a generation after this one (this member was dropped, or
        everyone is being re-formed): whatever this generation waits for will not come. Raises
        ``TransportError`` once the trainer is dead. Reads the heartbeat's last look, never the
        store (a frozen trainer's store would block the caller)."""
        beat = self._heartbeat
        if beat is not None and beat.gone is not None:
            raise TransportError(f"{member(self.rank)}: the trainer is gone ({beat.gone})")
        return beat is not None and beat.generation is not None and beat.generation > self.generation

    def _join(self, live_version: int, stop: threading.Event | None, timeout_s: float | None,
              engine_ranks: tuple[int, ...], plan: ShardPlan | None, commit_unit: CommitUnit = "model",
              label: str = "", wire_dtypes: dict[str, str] | None = None, keeps_base: bool = False) -> None:
        """Worker: connect to the store, wait for an open generation, announce, form."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._tcp = connect_retrying(self.config.host, self.config.port, self.config.world_size, self.config.timeout_s,
                                     who=member(self.rank), deadline=deadline, stop=stop)
        self._root = PrefixStore(self.config.name, self._tcp)
        # beat before the hello, so rank 0 never finds a member of a generation silent
        self._heartbeat = Heartbeat(self.config.host, self.config.port, self.config.name, self.rank,
                                    self.config.timeout_s,
                                    read=lambda store: read_generation(store, self.secret, self.config.name))
        tried: set[int] = set()
        hello = encode(Joined(rank=self.rank, live_version=live_version, incarnation=INCARNATION,
                              engine_ranks=tuple(engine_ranks), plan=plan, commit_unit=commit_unit, label=label,
                              wire_dtypes=wire_dtypes or {}, keeps_base=keeps_base))
        while True:
            self._root.set(f"knock/{self.rank}", INCARNATION.encode())
            g = _open_generation(self._root, self.secret, self.config.name, self.rank, tried, deadline, stop,
                                 lambda: self._hello_unauthenticated(hello))
            tried.add(g)
            try:
                self.incarnation = self._root.get("incarnation").decode()  # set before any generation opens
            except RuntimeError as e:
                raise TransportError(f"{member(self.rank)}: the group store failed while joining: {e}") from e
            self._root.set(f"gen{g}/hello/{self.rank}",
                           seal(hello, self.secret, self._context(f"gen{g}/hello/{self.rank}")))
            roster = self._wait_roster(g, deadline, stop)
            if roster is None or self.rank not in roster.members:
                continue  # rank 0 formed g without this engine (it came too late): knock for the next
            self.roster, self.point_to_point = roster.members, roster.point_to_point
            try:
                self._form_data_plane(g)
                return
            except TransportError:  # rank 0 gave up on g meanwhile; look for the next one
                if deadline is not None and time.monotonic() > deadline:
                    raise

    def _hello_unauthenticated(self, hello: bytes) -> None:
        """Worker: the generation number does not authenticate (the trainer has another secret,
        or none, or a stray client wrote it): post the sealed hello where rank 0 looks for it
        while it waits, so a trainer with the wrong secret learns so at once."""
        key = f"unauthenticated/{self.rank}"
        if not self._root.check([key]):
            incarnation = self._root.get("incarnation").decode(errors="replace")
            self._root.set(key, seal(hello, self.secret, f"{self.config.name}/{incarnation}/{key}"))

    def _wait_roster(self, g: int, deadline: float | None, stop: threading.Event | None) -> Roster | None:
        """The roster of g, or None if rank 0 closed g without posting one."""
        left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            raw = wait_key(self._root, f"gen{g}/roster", timeout_s=left, stop=stop,
                           what=f"the roster of generation {g}", who=member(self.rank),
                           give_up=lambda: not self._root.check([f"gen{g}/open"]))
            msg = decode_control(unseal(raw, self.secret, self._context(f"gen{g}/roster")))
        except GaveUp:
            return None
        except ProtocolError as e:
            raise TransportError(f"{member(self.rank)}: unreadable roster of generation {g}: {e}") from e
        return msg if isinstance(msg, Roster) and msg.generation == g else None

    def _form_data_plane(self, g: int, stop: threading.Event | None = None) -> None:
        """Build generation ``g``'s process group with the roster's members; ``InterruptedError``
        once ``stop`` is set first (the caller knows a member died)."""
        prefix = f"{self.config.name}/gen{g}"
        # stop-aware: the rendezvous on a connection of its own, since a store client serves one
        # request at a time and an abandoned rendezvous would hold every other call on it
        rendezvous: Store = PrefixStore(prefix + "/pg", self._tcp if stop is None else self._tcp.clone())
        if self.secret is not None:  # gloo's addresses, NCCL's unique id: sealed, so no one poses as a member
            rendezvous = SealedStore(rendezvous, self.secret, self._context(f"gen{g}/pg"))

        def build() -> DataPlane:
            return DataPlane(rendezvous, rank=self.rank,
                             pg_rank=0 if self.rank == 0 else 1 + self.roster.index(self.rank),
                             size=1 + len(self.roster), backend=self.backend, timeout=self.timeout, device=self.device,
                             peers=self.peers, superseded=self.superseded,
                             bind=data_plane_address(self.config.host, self.rank), stop=self._stop)

        self.data = build() if stop is None else call_unless_stopped(
            build, stop=stop, what=f"generation {g}'s data plane to form", who=member(self.rank))
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

    def _plane(self) -> DataPlane:
        if self.data is None:
            raise TransportError(f"{member(self.rank)}: no data plane (the group was closed or is re-forming)")
        return self.data

    def start_broadcast(self, tensor: torch.Tensor, *, what: str) -> tuple[Work, str]:
        """Post a broadcast from rank 0 (``DataPlane.start_broadcast``)."""
        return self._plane().start_broadcast(tensor, what=what)

    def start_send(self, tensor: torch.Tensor, rank: int, *, what: str) -> tuple[Work, str]:
        """Rank 0: post ``tensor`` to worker ``rank`` alone (``DataPlane.start_send``)."""
        return self._plane().start_send(tensor, 1 + self.roster.index(rank), what=what)

    def start_recv(self, tensor: torch.Tensor, *, what: str) -> tuple[Work, str]:
        """A worker: post a receive from rank 0 (``DataPlane.start_recv``)."""
        return self._plane().start_recv(tensor, what=what)

    def start_frame(self, tensor: torch.Tensor, *, what: str) -> tuple[Work, str]:
        """A worker: take the next frame or bucket of rank 0's, broadcast or sent to it alone."""
        return self.start_recv(tensor, what=what) if self.point_to_point else self.start_broadcast(tensor, what=what)

    def wait(self, pending: tuple[Work, str], timeout_s: float | None = None) -> None:
        """Finish a posted broadcast, send or receive (``DataPlane.wait``)."""
        self._plane().wait(pending, timeout_s)

    def broadcast(self, tensor: torch.Tensor, *, what: str, timeout_s: float | None = None) -> None:
        """Blocking ``start_broadcast`` + ``wait``."""
        self._plane().broadcast(tensor, what=what, timeout_s=timeout_s)

    def close(self) -> None:
        """Leave: drop the data plane and this member's store handles (rank 0's store, and its
        port, go with the last reference, e.g. a rollout queue's)."""
        self._close_data_plane()
        self.stop_beating()
        for attr in ("store", "_root", "_tcp"):
            self.__dict__.pop(attr, None)

    def _close_data_plane(self) -> None:
        data, self.data = self.data, None
        if data is not None:
            data.close()


# -- the control plane: numbered messages and replies on the group's store ----------------------------

Phase = Literal["ack", "staged"]
"""An announce gets two replies: ``ack`` (accepted or not) and ``staged`` (buckets verified or not)."""


def _wait_key(group: WeightGroup, key: str, timeout_s: float | None, stop: threading.Event | None, what: str,
              give_up=None) -> bytes:
    return wait_key(group.store, key, timeout_s=timeout_s, stop=stop, what=what, who=f"rank {group.rank}",
                    give_up=give_up)


class TrainerControl:
    """Rank 0's side: post control messages, collect replies from every worker."""

    def __init__(self, group: WeightGroup) -> None:
        if group.rank != 0:
            raise ValueError("TrainerControl belongs to rank 0")
        self.group = group
        self.seq = 0
        self._each: set[int] = set()  # messages posted per worker

    def post(self, msg: ControlMessage) -> int:
        seq = self.seq
        self._set(f"msg/{seq}", msg)
        self.seq += 1
        return seq

    def post_each(self, msgs: dict[int, ControlMessage]) -> int:
        """One message per worker (every member of the generation), under one number."""
        seq = self.seq
        for rank, msg in msgs.items():
            self._set(f"msg/{seq}/{rank}", msg)
        self._each.add(seq)
        return self.post(ForEachRank())

    def _set(self, key: str, msg: ControlMessage) -> None:
        self.group.store.set(key, seal(encode(msg), self.group.secret, self.group.auth_context(key)))

    def replies(self, seq: int, timeout_s: float, what: str, phase: Phase = "ack") -> dict[int, ReplyMessage]:
        """Each worker's reply to message ``seq``; raises naming the worker that stayed silent."""
        out: dict[int, ReplyMessage] = {}
        deadline = time.monotonic() + timeout_s
        for rank in self.group.peers:
            left = max(deadline - time.monotonic(), 0.001)
            key = f"rep/{seq}/{phase}/{rank}"
            try:
                raw = _wait_key(self.group, key, left, None, f"reply from worker rank {rank} to {what}")
            except TransportTimeout as e:
                raise TransportTimeout(str(e), ranks=(rank,)) from e
            out[rank] = self.read_reply(key, raw, f"worker rank {rank}'s reply to {what}")
        for rank in self.group.peers:
            self.group.store.delete_key(f"rep/{seq}/{phase}/{rank}")
        if seq > 0:  # every worker has read everything before ``seq``
            self.group.store.delete_key(f"msg/{seq - 1}")
            if seq - 1 in self._each:
                self._each.discard(seq - 1)
                for rank in self.group.peers:
                    self.group.store.delete_key(f"msg/{seq - 1}/{rank}")
        return out

    def read_reply(self, key: str, raw: bytes, what: str) -> ReplyMessage:
        """Authenticate and decode one reply; ``AuthError``/``ProtocolError`` name the reply."""
        try:
            return decode_reply(unseal(raw, self.group.secret, self.group.auth_context(key)))
        except ProtocolError as e:
            raise type(e)(f"{what}: {e}") from None


class WorkerControl:
    """A worker's side: read control messages in order, reply to each."""

    def __init__(self, group: WeightGroup) -> None:
        if group.rank == 0:
            raise ValueError("WorkerControl belongs to a worker rank")
        self.group = group
        self.seq = 0

    def next(self, timeout_s: float | None, stop: threading.Event | None = None) -> tuple[int, ControlMessage]:
        """The next message; ``timeout_s=None`` waits until one arrives or ``stop`` is set.

        Raises ``ProtocolError`` for an undecodable message, ``AuthError`` for one that fails
        authentication (its sequence number is consumed either way, so the worker can reply
        and stay in step with the trainer).
        """
        seq = self.seq
        # A worker dropped from its generation (it was stopped, or too slow) would wait here
        # forever: the trainer writes to the next generation's keys. It notices and rejoins.
        try:
            raw = _wait_key(self.group, f"msg/{seq}", timeout_s, stop, f"control message #{seq} from the trainer",
                            give_up=self.group.superseded)
        except GaveUp as e:
            raise GaveUp(f"{e}: the trainer opened a newer generation of the group") from None
        self.seq += 1
        msg = decode_control(unseal(raw, self.group.secret, self.group.auth_context(f"msg/{seq}")))
        if isinstance(msg, ForEachRank):  # this worker's own is there already
            key = f"msg/{seq}/{self.group.rank}"
            try:
                raw = self.group.store.get(key)
            except RuntimeError as e:
                raise TransportError(f"{member(self.group.rank)}: control message #{seq} for this rank: {e}") from e
            msg = decode_control(unseal(raw, self.group.secret, self.group.auth_context(key)))
        return seq, msg

    def reply(self, seq: int, msg: ReplyMessage, phase: Phase = "ack") -> None:
        key = f"rep/{seq}/{phase}/{self.group.rank}"
        self.group.store.set(key, seal(encode(msg), self.group.secret, self.group.auth_context(key)))
