"""A stateless torch.distributed group between trainer rank 0 and the engine workers.

"Stateless" means it never touches torch's global default group, so it can live next to
vLLM's own groups inside a worker and next to accelerate's inside the trainer. It has two
planes, both from torch.distributed:

- the data plane: a ProcessGroup (gloo on CPU, NCCL on CUDA) that broadcasts bucket bytes;
- the control plane: the group's TCPStore, which carries msgspec control messages and
  replies (see ``control.py``); TCPStore is hosted by rank 0, the trainer.

Every wait has a timeout, and a timeout raises ``TransportTimeout`` naming the peer and
what was being waited for. After a timeout the group is not reused: callers build a new
one with a higher ``generation`` (see ``GroupConfig.generation``).
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroup, TCPStore, Work


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for single-machine runs and tests)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TransportError(RuntimeError):
    """The group failed: a peer vanished, a collective broke, or a message was unusable."""


class TransportTimeout(TransportError):
    """A wait on the group ran past its timeout."""


@dataclass(frozen=True, kw_only=True)
class GroupConfig:
    """How trainer rank 0 and the engine workers find each other."""

    host: str = "127.0.0.1"
    """Address of the trainer's TCPStore (rank 0 listens, workers connect)."""
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
    generation: int = 0
    """Bumped each time the group is rebuilt after a failure; keys of older generations are ignored."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"GroupConfig.port={self.port} is not a TCP port")
        if self.world_size < 2:
            raise ValueError(f"GroupConfig.world_size={self.world_size}: need the trainer and at least one worker")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"GroupConfig.backend={self.backend!r} is not one of auto, gloo, nccl")
        if not self.timeout_s > 0:
            raise ValueError(f"GroupConfig.timeout_s={self.timeout_s} must be > 0")
        if self.generation < 0:
            raise ValueError(f"GroupConfig.generation={self.generation} must be >= 0")

    def resolved_backend(self) -> Literal["gloo", "nccl"]:
        if self.backend == "auto":
            return "nccl" if torch.cuda.is_available() else "gloo"
        return self.backend

    def next_generation(self) -> GroupConfig:
        return dataclasses.replace(self, generation=self.generation + 1)


def connect_store(config: GroupConfig, name: str) -> PrefixStore:
    """A client of the group's store (hosted by the trainer), for processes outside the group."""
    try:
        tcp = TCPStore(config.host, config.port, is_master=False, timeout=timedelta(seconds=config.timeout_s))
    except Exception as e:
        raise TransportError(f"cannot reach the group store at {config.host}:{config.port}: {e}") from e
    return PrefixStore(f"{config.name}/{name}", tcp)


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
        impl = ProcessGroupNCCL(store, rank, size, opts)
        kind = ProcessGroup.BackendType.NCCL
    pg._set_default_backend(kind)
    impl._set_sequence_number_for_group()
    pg._register_backend(device, kind, impl)
    return pg


class WeightGroup:
    """One member of the trainer/engine group. Rank 0 is the trainer and the only sender."""

    def __init__(self, config: GroupConfig, rank: int, device: torch.device | None = None) -> None:
        if not 0 <= rank < config.world_size:
            raise ValueError(f"rank {rank} outside world_size {config.world_size}")
        self.config = config
        self.rank = rank
        self.backend = config.resolved_backend()
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.device = device
        self.timeout = timedelta(seconds=config.timeout_s)
        try:
            self._tcp = TCPStore(
                config.host, config.port, config.world_size, is_master=rank == 0,
                timeout=self.timeout, wait_for_workers=False,
            )
        except Exception as e:  # torch raises several store errors; name the endpoint
            raise TransportError(f"rank {rank}: cannot reach the group store at {config.host}:{config.port}: {e}") from e
        prefix = f"{config.name}/gen{config.generation}"
        self.store = PrefixStore(prefix + "/ctl", self._tcp)
        try:
            self.pg = _make_process_group(
                PrefixStore(prefix + "/pg", self._tcp), rank, config.world_size, self.backend, self.timeout, device
            )
        except Exception as e:
            raise TransportError(
                f"rank {rank}: joining {self.backend} group {prefix} of {config.world_size} failed: {e}"
            ) from e

    def sub_store(self, name: str) -> PrefixStore:
        """A key space of this group's store for other traffic (e.g. the rollout queue)."""
        return PrefixStore(f"{self.config.name}/{name}", self._tcp)

    @property
    def peers(self) -> list[int]:
        """Ranks this member exchanges with: all workers for the trainer, the trainer for a worker."""
        return list(range(1, self.config.world_size)) if self.rank == 0 else [0]

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
        """Finish a posted broadcast; raise ``TransportTimeout`` naming the peer and what it carried."""
        work, what = pending
        timeout = self.timeout if timeout_s is None else timedelta(seconds=timeout_s)
        try:
            work.wait(timeout)
        except Exception as e:
            peer = "trainer (rank 0)" if self.rank else f"workers {self.peers}"
            msg = f"rank {self.rank}: {what} from/to {peer} failed after <= {timeout.total_seconds():.1f}s: {e}"
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TransportTimeout(msg) from e
            raise TransportError(msg) from e

    def broadcast(self, tensor: torch.Tensor, *, what: str, timeout_s: float | None = None) -> None:
        """Blocking ``start_broadcast`` + ``wait``."""
        self.wait(self.start_broadcast(tensor, what=what), timeout_s)

    def close(self) -> None:
        """Drop the process group; the store goes with the last reference."""
        try:
            self.pg.shutdown() if hasattr(self.pg, "shutdown") else None
        except Exception:  # a broken group may refuse to shut down cleanly; nothing to save
            pass
        self.pg = None  # type: ignore[assignment]
