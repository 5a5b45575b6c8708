"""A fleet's weight pushes on a communicator per engine: ``FleetPusher``.

Each engine forms a weight group of its own with the trainer (``GroupConfig.for_engine``:
its own key space, generations, control messages, heartbeats and data plane, the trainer
and that engine's workers only). The groups share the trainer's one store, so a fleet
still takes one port. Engine e's workers start with ``InflightConfig(group=
base.for_engine(e, tp), rank=1)``. Why not one group for the fleet: docs/design.md.

Ordering invariants:
- a push goes to every engine at once, each on its own pusher's thread, and each engine
  commits as soon as its own workers all staged it (one engine's ranks commit together or
  none does, as on a single engine); no engine waits for another, so a slow or frozen
  engine delays only its own update;
- across engines a version is therefore not atomic: an engine that refuses or loses an
  update keeps serving its last good version while the others move on. ``push`` names the
  engines that landed and those that failed (``FleetPushError``), and ``rejoin(e)`` re-forms
  engine e's group alone; the others' groups are untouched;
- each engine's link carries the whole update (its ranks' shards), read from the caller's
  tensors once per engine; ``wait_reads`` returns once every engine's push has read them,
  the point after which the caller may write its parameters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore

from inflight.transport.delta import DeltaEncoder
from inflight.transport.errors import TransportTimeout
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, PushResult, WeightPusher
from inflight.transport.sources import ShardedSource, Weights
from inflight.transport.store import host_store

_DEFAULT_PUSH = PushConfig()


class FleetPushError(RuntimeError):
    """Some engines did not take a push; ``landed`` did (they serve it), ``failed`` did not
    (each keeps its last good version)."""

    def __init__(self, version: int, landed: dict[int, PushResult], failed: dict[int, BaseException]) -> None:
        reasons = "; ".join(f"engine {e}: {type(x).__name__}: {x}" for e, x in sorted(failed.items()))
        super().__init__(f"v{version} landed on engines {sorted(landed)}, not on {sorted(failed)} ({reasons})")
        self.version, self.landed, self.failed = version, landed, failed


class FleetPusher:
    """Rank 0 of one weight group per engine, all hosted on one store."""

    def __init__(self, group: GroupConfig, engine_tp: Sequence[int], config: PushConfig = _DEFAULT_PUSH,
                 device: torch.device | None = None, *, join_timeout_s: float | None = None,
                 stop: threading.Event | None = None) -> None:
        """Host the store on ``group``'s address and form engine e's group (``group.for_engine(e,
        engine_tp[e])``) with its workers, waiting up to ``join_timeout_s`` for each engine
        (``InterruptedError`` once ``stop`` is set meanwhile: an engine's process died)."""
        if not engine_tp:
            raise ValueError("FleetPusher: engine_tp names no engine")
        self.base = group
        self._store = host_store(group.host, group.port, 1 + sum(engine_tp), timedelta(seconds=group.timeout_s))
        self.pushers: dict[int, WeightPusher] = {}
        deltas = DeltaEncoder() if config.encoding == "sparse" else None  # one copy of each version for every engine
        try:
            for e, tp in enumerate(engine_tp):
                self.pushers[e] = WeightPusher(group.for_engine(e, tp), config, device, join_timeout_s=join_timeout_s,
                                               store=self._store, stop=stop, deltas=deltas)
        except BaseException:
            self.close("the fleet did not form")
            raise

    @property
    def live(self) -> list[int]:
        """The engines whose group has members (an engine dropped, or whose group failed to
        re-form, is out until it knocks and is let back in with ``rejoin``)."""
        return [e for e, p in self.pushers.items() if p.group.roster]

    def push_async(self, version: int, weights: Weights, *,
                   engines: Sequence[int] | None = None) -> dict[int, Future[PushResult]]:
        """Start ``version`` towards ``engines`` (default: the live ones); each engine's future
        resolves when that engine committed it (or failed). Every engine's update is laid out
        before any is sent, so bad input (or one engine's bad shard plan) raises here and no
        engine sees anything."""
        engines = self.live if engines is None else list(engines)
        if not engines:
            raise ValueError(f"push of v{version}: no engine to push to (none is live)")
        if isinstance(weights, ShardedSource) and len(engines) > 1:
            raise ValueError("a ShardedSource gathers in the order of one push; push it to one engine's "
                             "WeightPusher at a time, or push plain tensors to the fleet")
        laid_out = {e: self.pushers[e].lay_out(version, weights) for e in engines}
        return {e: self.pushers[e].push_laid_out(laid) for e, laid in laid_out.items()}

    def push(self, version: int, weights: Weights, *, engines: Sequence[int] | None = None) -> dict[int, PushResult]:
        """Push to ``engines`` (default: the live ones) and wait for all; raise ``FleetPushError``
        naming the engines that did not take it (after every engine's push ended, landed or not)."""
        return collect(version, self.push_async(version, weights, engines=engines))

    def wait_reads(self, timeout_s: float | None = None) -> float:
        """Block until every engine's push has read the caller's tensors; the seconds waited."""
        t0 = time.perf_counter()
        for p in self.pushers.values():
            p.wait_reads(None if timeout_s is None else max(timeout_s - (time.perf_counter() - t0), 0.0))
        return time.perf_counter() - t0

    def rejoin(self, engine: int, timeout_s: float | None = None, *, require: bool = True) -> dict[int, int]:
        """Re-form engine ``engine``'s group alone (after its push failed, or to let it back in),
        waiting up to ``timeout_s`` for its workers; their live versions. The other engines'
        groups are not touched. If the engine does not come whole, it is out (``live``) and
        ``TransportTimeout`` is raised (with ``require``) or ``{}`` returned."""
        try:
            return self.pushers[engine].rejoin(timeout_s)
        except TransportTimeout:
            if require:
                raise
            return {}

    def drop(self, engine: int) -> None:
        """Take engine ``engine`` out without waiting for it (dead, frozen or restarting): a
        generation of its group opens and closes without it, so its workers, when they look,
        find themselves superseded and knock (``knocking``) to be let back in."""
        self.rejoin(engine, 0.0, require=False)

    def silent(self, engine: int) -> bool:
        """Whether a worker of engine ``engine``'s generation stopped beating (dead or frozen);
        blocks for a short window (``liveness``)."""
        group = self.pushers[engine].group
        return bool(group.roster) and bool(group.silent())

    def knocking(self) -> list[int]:
        """The engines with a worker that asked to be let (back) into its group."""
        return [e for e, p in self.pushers.items() if p.knocking()]

    @property
    def engine_versions(self) -> dict[int, dict[int, int]]:
        """Per engine, each worker's live version when it joined its group's current generation."""
        return {e: p.engine_versions for e, p in self.pushers.items()}

    @property
    def incarnation(self) -> str:
        """This fleet's store incarnation (engine 0's group's: every group is on the one store)."""
        return self.pushers[0].group.incarnation

    def sub_store(self, name: str) -> PrefixStore:
        """A key space of the fleet's store for other traffic (e.g. the rollout queue)."""
        return PrefixStore(f"{self.base.name}/{name}", self._store)

    @property
    def store(self) -> TCPStore:
        """The fleet's TCP store itself, for another group hosted on it (a pause-mode run's native group)."""
        return self._store

    def close(self, reason: str = "trainer done") -> None:
        """Say goodbye to every engine's workers, then let the store go (with its last
        reference: a rollout queue on ``sub_store`` keeps it)."""
        for p in self.pushers.values():
            p.close(reason)
        self.pushers = {}
        self.__dict__.pop("_store", None)


def collect(version: int, futures: Mapping[int, Future[PushResult]]) -> dict[int, PushResult]:
    """Every engine's outcome of one push; ``FleetPushError`` if any failed."""
    landed: dict[int, PushResult] = {}
    failed: dict[int, BaseException] = {}
    for e, f in futures.items():
        error = f.exception()
        if error is None:
            landed[e] = f.result()
        else:
            failed[e] = error
    if failed:
        raise FleetPushError(version, landed, failed)
    return landed
