"""Which group members are alive: a heartbeat per worker rank, read by rank 0 after a failure.

Why: when a transfer fails, rank 0 does not learn from the data plane which peer failed.
gloo reports "Operation timed out" (a frozen peer stalls the whole broadcast, so every
member times out together) or "Connection closed by peer" naming an address, not a rank.
Without knowing, the trainer would re-form the group waiting for every member, and a
frozen one would hold the whole fleet for another full timeout. So every worker process
beats a counter in the group's store from a thread of its own (it keeps beating while the
worker's transfer thread blocks in a collective, since ``Work.wait`` releases the GIL), and
rank 0 calls a member silent when its counter does not move over a short window: a
SIGKILLed or SIGSTOPped process, or one so wedged that no Python thread runs.

Ordering invariant: a worker starts beating before it announces itself to a generation
(``WeightGroup._join``) and stops only when it leaves the group (``close``), so a member
between two generations of a rejoin is never silent for more than a few milliseconds.
Calling a live member silent is safe: it is left out of one generation and knocks to be
let back in. It only costs that member the updates it misses meanwhile.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore

_BEATS_PER_WINDOW = 4
"""A member is silent when it missed this many beats in a row: one late beat on a loaded
machine is not death."""


def beat_interval(timeout_s: float) -> float:
    """Seconds between beats: short against the group's timeout, at most half a second."""
    return min(0.5, timeout_s / 10)


def silence_window(timeout_s: float) -> float:
    """How long rank 0 watches the counters before calling a member silent."""
    return _BEATS_PER_WINDOW * beat_interval(timeout_s)


def _key(rank: int) -> str:
    return f"beat/{rank}"


class Heartbeat:
    """A worker rank's beat: ``add(beat/<rank>, 1)`` every ``beat_interval`` on its own store
    client (the group's client is busy with the worker's blocking waits). It also keeps the
    worker's look at its trainer, so a wait can ask without touching a store (a frozen
    trainer's store blocks every read): ``generation``, the generation the trainer opened
    last (read with ``read``, if given), and ``gone``, why the trainer is dead (its store
    refuses connections, or failed a beat), else None."""

    def __init__(self, host: str, port: int, prefix: str, rank: int, timeout_s: float,
                 read: Callable[[Store], int] | None = None) -> None:
        self._stop = threading.Event()
        self._interval = beat_interval(timeout_s)
        self._args = (host, port, prefix, rank, timeout_s)
        self._read = read
        self.generation: int | None = None
        self.gone: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"inflight-beat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        host, port, prefix, rank, timeout_s = self._args
        try:
            store = PrefixStore(prefix, TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                                                 wait_for_workers=False))
            while True:
                # probe before each beat: an op on a store whose host went away (a trainer that
                # finished or died) prints a C++ stack trace, and a beat is not worth one
                try:
                    socket.create_connection((host, port), timeout=self._interval).close()
                except ConnectionRefusedError:  # nothing listens there any more: the trainer is dead
                    self.gone = f"its store at {host}:{port} refuses connections"
                    return
                except OSError:  # no answer in time (a frozen trainer, a slow link): its waits time out
                    pass
                else:
                    store.add(_key(rank), 1)
                    if self._read is not None:
                        self.generation = self._read(store)
                if self._stop.wait(self._interval):
                    return
        except Exception as e:  # the store went away mid-beat (the trainer is gone)
            if not self._stop.is_set():
                self.gone = f"its store failed: {e}".splitlines()[0]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1.0)


def beats(store: Store, ranks: Iterable[int]) -> dict[int, int]:
    """Each rank's beat count so far (0 for one that never beat)."""
    return {r: store.add(_key(r), 0) for r in ranks}


def silent_ranks(store: Store, ranks: Iterable[int], timeout_s: float) -> tuple[int, ...]:
    """Rank 0: the ranks whose counter does not move within ``silence_window(timeout_s)``.

    Blocks for that window (two seconds at most): it must start after the failure, since a
    member killed a moment ago beat until then."""
    ranks = tuple(ranks)
    first = beats(store, ranks)
    time.sleep(silence_window(timeout_s))
    now = beats(store, ranks)
    return tuple(r for r in ranks if now[r] == first[r])
