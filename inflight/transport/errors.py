"""The transport's errors: every wait either returns or raises one of these, naming the peer."""

from __future__ import annotations

from inflight.protocol import RejectCode


def member(rank: int) -> str:
    """How errors name weight-group rank ``rank``: the trainer's is 0 ("trainer rank 0", its
    rank in a sharded trainer too), and each engine worker's 1..N ("worker rank 2"); a bare
    "rank 1" could be either a worker or a sharded trainer's second process."""
    return "trainer rank 0" if rank == 0 else f"worker rank {rank}"


class TransportError(RuntimeError):
    """The group failed: a peer vanished, a collective broke, or a message was unusable."""


class GaveUp(TransportError):
    """A wait was abandoned: what it waited for will not come (e.g. a newer generation opened)."""


class TransportTimeout(TransportError):
    """A wait on the group ran past its timeout; ``ranks``: the members waited for, if known."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class UpdateRejected(Exception):
    """A worker refuses an update; ``code`` is a protocol ``RejectCode``."""

    def __init__(self, code: RejectCode, reason: str) -> None:
        super().__init__(f"[{code}] {reason}")
        self.code = code
        self.reason = reason
