"""How trainer rank 0 and the engine workers find each other: ``GroupConfig``, and whether
its address is reachable from other machines (which, without a shared secret, it refuses)."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import socket
import threading
from dataclasses import dataclass

import torch
from torch.distributed import PrefixStore

from inflight.settings import Backend, check_choices
from inflight.settings import DataPlane as ResolvedBackend
from inflight.transport.store import await_trainer_gone, connect_store

log = logging.getLogger("inflight.group")


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    """How trainer rank 0 and the engine workers find each other."""

    host: str = "127.0.0.1"
    """Address of the trainer's TCPStore: rank 0 listens on this address only (loopback by
    default, so nothing off the machine can reach the group unless an address is configured;
    ``0.0.0.0`` listens everywhere), and workers connect to it."""
    port: int
    """TCP port of the store (``store.reserve_port`` holds one free for it)."""
    world_size: int = 2
    """1 trainer + the number of engine workers that receive weights."""
    backend: Backend = "auto"
    """Data-plane backend: ``auto`` picks NCCL when CUDA is available, else gloo."""
    timeout_s: float = 120.0
    """The collective timeout: connecting, joining, and each bucket's broadcast."""
    name: str = "inflight"
    """Key prefix in the store, so several groups can share one store."""
    insecure: bool = False
    """Allow a group on a non-loopback address without a shared secret (``INFLIGHT_SECRET``).
    Without one, anyone who reaches the store's address can push weights into the serving
    engines and queue samples the trainer trains on; so such a group is refused unless this
    says so, and then it is logged as a warning by every member."""

    def __post_init__(self) -> None:
        check_choices(self, "GroupConfig")
        if not 0 < self.port < 65536:
            raise ValueError(f"GroupConfig.port={self.port} is not a TCP port")
        if self.world_size < 2:
            raise ValueError(f"GroupConfig.world_size={self.world_size}: need the trainer and at least one worker")
        if not self.timeout_s > 0:
            raise ValueError(f"GroupConfig.timeout_s={self.timeout_s} must be > 0")

    def check_exposure(self, secret: bytes | None, who: str) -> None:
        """Refuse (``ValueError``) a group reachable off this machine with no secret, unless
        ``insecure``; with ``insecure``, warn."""
        if secret is not None or is_loopback(self.host):
            return
        risk = (f"{who}: the weight group at {self.host}:{self.port} is reachable from other machines and has no "
                f"shared secret: anyone who reaches it can push weights into the serving engines and queue samples "
                f"the trainer trains on")
        if not self.insecure:
            raise ValueError(f"{risk}. Set INFLIGHT_SECRET (the same value on the trainer and every engine), "
                             "or GroupConfig(insecure=True) / transport.insecure = true to accept that")
        log.warning("inflight: INSECURE: %s (insecure=True)", risk)

    def for_engine(self, engine: int, tensor_parallel_size: int) -> GroupConfig:
        """Engine ``engine``'s own group in a fleet of per-engine groups on this store
        (``inflight.transport.fleet_pusher``): its own key space, and the trainer with that
        engine's workers only (ranks 1 .. ``tensor_parallel_size``)."""
        if engine < 0 or tensor_parallel_size < 1:
            raise ValueError(f"GroupConfig.for_engine: engine={engine} must be >= 0 and "
                             f"tensor_parallel_size={tensor_parallel_size} >= 1")
        return dataclasses.replace(self, name=f"{self.name}/engine{engine}", world_size=1 + tensor_parallel_size)

    def resolved_backend(self) -> ResolvedBackend:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend

    def connect(self, name: str) -> PrefixStore:
        """A client of the group's store for processes outside the group (key space ``name``)."""
        return connect_store(self.host, self.port, f"{self.name}/{name}", self.timeout_s)

    def await_trainer_gone(self, incarnation: str, stop: threading.Event) -> None:
        """Return once the trainer whose store had ``incarnation`` left (``store.await_trainer_gone``)."""
        await_trainer_gone(self.host, self.port, self.name, incarnation, stop)


def data_plane_address(host: str, rank: int) -> str | None:
    """The local address a member's data-plane sockets bind: the trainer's configured address
    (None for a wildcard: gloo's default), a worker's address on the route to the trainer. So
    a group on loopback never opens a data socket on another interface."""
    if rank == 0:
        return None if host in ("", "0.0.0.0", "::") else host
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: this only picks the interface towards the trainer
            return s.getsockname()[0]
    except OSError:
        return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names a loopback address (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False
