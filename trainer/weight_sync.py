"""The trainer's side of weight sync: one push in flight, fleet admission, recovery.

``WeightSync`` is what ``inflight.trainer.train`` calls around each optimizer step: ``next_batch`` before it (a
lost engine found while waiting for rollouts is recovered there) and ``push`` after it. Ordering invariants:
- at most one push is in flight: ``push`` lands the previous one before it sends the next, so the engines commit
  the versions in order, and every push that landed is reported once (``landed``, with the pushes a recovery made);
- the new version is scored (``score``) after the previous push landed and before the new one is sent, so no
  transfer competes with the evaluation;
- the optimizer writes the parameters only after the push in flight read them all (``wait_reads``, called by
  ``Policy.step``): pushes read the live parameters, not a copy;
- engines that knock (back from a restart or a freeze) are admitted between two pushes, never during one; before
  the last push every engine that can come is waited for, and the last push is waited for: a run ends with the
  whole fleet on its last version, committed;
- a push goes to every live engine at once, each on its own weight group, each engine committing as soon as its
  own workers staged it (``FleetPusher``): no engine waits for another. The engines it failed on, a dead engine
  process and an engine lost while waiting go through ``Fleet.recover``, engine by engine, which returns the
  trainer's version (raised above any engine's); the engines it landed on report it.
With ``rollout.mode = "pause"`` the same order holds, but each push is vLLM's native update
(``inflight.trainer.native_update.NativePusher``: announced on the store, broadcast on the native group, live once
the engine reports it after its pause); a failed one stops the run (``EngineLost``): one engine, no recovery.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from tqdm import tqdm

from inflight.protocol import RolloutGroup
from inflight.rollout_queue import RolloutBuffer, RolloutQueue
from inflight.trainer.config import TrainConfig
from inflight.trainer.fleet import EngineLost, Fleet
from inflight.transport.errors import TransportTimeout
from inflight.transport.fleet_pusher import FleetPusher, FleetPushError, collect
from inflight.transport.pusher import PushResult


class TaskFailed(RuntimeError):
    """An engine reported that the task keeps failing (``task.scoring.max_failed_in_a_row``)."""


def push_metrics(results: Mapping[int, PushResult], fleet: Fleet) -> dict[str, Any]:
    """The metrics row's fields of one push that landed on the engines of ``results``
    (workers named by fleet rank)."""
    first = results[min(results)]
    commit = first.commits[min(first.commits)]
    commits = {fleet.cfg.engine.ranks(e)[r - 1]: c for e, res in results.items() for r, c in res.commits.items()}
    # engines count their own steps, so what compares across a fleet is how many steps each
    # decoded between the first bucket and its commit
    waits = [c.steps_since_first_bucket for c in commits.values()]
    return {"pushed_version": first.version, "stall_ms": first.stall_ms, "commit_step": commit.step,
            "commit_groups": len(first.groups),
            "committed_ranks": sorted(commits), "commit_steps": {r: c.step for r, c in sorted(commits.items())},
            "commit_spread_steps": max(waits) - min(waits),
            "push_ms": 1e3 * max(r.stage_wait_s + r.commit_wait_s for r in results.values()),
            "send_ms": 1e3 * max(r.send.send_s for r in results.values()),
            "push_mb": sum(r.send.delivered_bytes for r in results.values()) / 2**20,
            # each engine's update as sent and as it would be dense (``transport.encoding``)
            "sent_mb": sum(r.send.nbytes for r in results.values()) / 2**20,
            "dense_mb": sum(r.send.dense_bytes for r in results.values()) / 2**20,
            "changed_frac": first.send.changed_frac, "encode_ms": 1e3 * first.send.encode_s,
            "read_ms": 1e3 * max(r.send.read_s for r in results.values()),
            "steps_during_transfer": first.staged[min(first.staged)].steps_during_transfer}


class WeightSync:
    """Pushes the policy to the fleet after each optimizer step, and keeps the fleet."""

    def __init__(self, cfg: TrainConfig, pusher: FleetPusher, fleet: Fleet, queue: RolloutQueue,
                 weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        self.cfg, self.pusher, self.fleet, self.queue, self.weights = cfg, pusher, fleet, queue, weights
        self.in_flight: dict[int, Future[PushResult]] = {}
        """The push in flight: each engine's outcome."""
        self.in_flight_version = -1
        self.last: dict[str, Any] = {}
        """Metrics of the push that landed last (rows report the push of the step before,
        except the last row, which reports its own)."""
        self.landed: list[list[Any]] = []
        """[version, committed ranks] of every push that landed since the last ``take_landed``."""
        self.rejoined: list[list[Any]] = []
        """[version, ranks]: what members serving that version reported when a generation formed
        (their execution thread's live version: a push that failed may have committed there)."""
        self.wait_s = 0.0
        """How long the trainer blocked on the previous push in the last ``push``."""
        self.read_wait_s = 0.0
        """How long the last optimizer step waited for the push in flight to finish reading."""
        self.batch_wait_s = 0.0
        """How long the last ``next_batch`` waited for rollouts (recoveries included)."""
        self.native: Any = None
        """Pause mode: the ``NativePusher`` every push goes through instead of ``pusher``."""
        self.native_in_flight: Future[dict] | None = None
        if cfg.rollout.mode == "pause":
            from inflight.trainer.native_update import NativePusher, native_group

            try:
                self.native = NativePusher(native_group(pusher.base), queue.store, getattr(torch, cfg.model.dtype),
                                           tcp_store=pusher.store, join_timeout_s=cfg.transport.rejoin_timeout_s,
                                           stop=fleet.exited)
            except InterruptedError:  # the fleet's watcher saw the engine exit: its log says why
                raise EngineLost("the engine exited before it joined the native group (rollout.mode='pause')") from None

    def recover(self, reason: str, version: int, lost: Collection[int] = (), *, push_behind: bool = True) -> int:
        """``Fleet.recover``, with the push in flight landed (``_land``) or none. Pause mode has
        no recovery: its native group holds one engine, never re-formed (``EngineLost``)."""
        if self.native is not None:
            raise EngineLost(f"{reason} (rollout.mode='pause' does not recover a lost engine)")
        events = len(self.fleet.events)
        version = self.fleet.recover(self.pusher, reason, version, self.weights, self.queue, lost,
                                     push_behind=push_behind)
        new = self.fleet.events[events:]
        self.landed += [e["pushed"] for e in new if "pushed" in e]
        for e in new:
            self._rejoined(e.get("serving", {}))
        return version

    def _rejoined(self, serving: dict[int, int]) -> None:
        by_version: dict[int, list[int]] = {}
        for rank, v in serving.items():
            by_version.setdefault(v, []).append(rank)
        self.rejoined += [[v, sorted(ranks)] for v, ranks in by_version.items()]

    def catch_up(self, version: int) -> int:
        """A resumed trainer behind a live engine moves its version above the engines'."""
        serving = self.fleet.serving(self.pusher.engine_versions)
        if max(serving.values(), default=-1) > version:
            return self.recover(f"engines serve {serving}, ahead of v{version}", version)
        return version

    def wait_reads(self) -> None:
        """Before the optimizer writes the parameters: the push in flight reads them as its
        buckets go out (no copy of the model), so it must have packed its last bucket."""
        self.read_wait_s = self.pusher.wait_reads()

    def next_batch(self, buffer: RolloutBuffer, version: int) -> tuple[list[RolloutGroup], int]:
        """The next batch of groups, and the trainer's version (a recovery may move it); the
        wait in ``batch_wait_s``."""
        t0 = time.perf_counter()
        try:
            return self._next_batch(buffer, version)
        finally:
            self.batch_wait_s = time.perf_counter() - t0

    def _next_batch(self, buffer: RolloutBuffer, version: int) -> tuple[list[RolloutGroup], int]:
        self._read_reports()
        if self.fleet.exit_problem() is not None:  # a fleet's other engines keep the queue full
            version = self._recover_exit(version)
        while True:
            try:
                return self._wait_groups(buffer, version), version
            except EngineLost:
                version = self._recover_exit(version)

    def _recover_exit(self, version: int) -> int:
        """An engine process exited: the push in flight lands first (it fails on that engine,
        which ``_land`` recovers); a death it did not reveal is recovered after it."""
        version = self._land(version, push_behind=True)
        if (problem := self.fleet.exit_problem()) is not None:
            version = self.recover(problem, version)
        return version

    def _wait_groups(self, buffer: RolloutBuffer, version: int) -> list[RolloutGroup]:
        """Waits in short slices so a dead engine process is noticed at once rather than after
        ``rollout.queue_timeout_s``, and a slot claimed by a frozen producer is skipped (holed)
        while other producers' groups wait behind it."""
        rollout = self.cfg.rollout
        self.queue.publish_version(version)  # the engines keep what they sample within loss.max_lag of it
        deadline = time.monotonic() + rollout.queue_timeout_s
        while True:
            try:
                return buffer.next_batch(rollout.groups_per_step, version, timeout_s=1.0)
            except TransportTimeout:
                self.queue.skip_stalled()
                self._read_reports()  # before a dead engine: a fatal report explains its death
                if (problem := self.fleet.exit_problem()) is not None:
                    raise EngineLost(problem) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no rollout group within rollout.queue_timeout_s={rollout.queue_timeout_s}s "
                                       "from a live engine: is it stuck?") from None

    def _read_reports(self) -> None:
        """Show what the engines reported (``EngineReport``: the first scoring failure of each
        kind); a fatal report stops the run (``TaskFailed``) with the engine's message."""
        for r in self.queue.reports():
            if r.fatal:
                raise TaskFailed(f"engine {r.engine_id}: {r.message}")
            tqdm.write(f"inflight: engine {r.engine_id}: {r.message}")

    def push(self, version: int, *, last: bool, score: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        """Land the previous push (recovering the engines it failed on), ``score`` the new
        version, admit knocking engines, send ``version`` to every live engine (and wait for it
        when ``last``). Returns the trainer's version and what ``score`` returned."""
        t0 = time.perf_counter()
        version = self._land(version, push_behind=False)  # the lost ones get ``version`` below, with everyone
        self.wait_s = time.perf_counter() - t0
        evaluation = score()
        if last and len(self.pusher.live) < self.cfg.engine.count:
            self._rejoined(self.fleet.admit(self.pusher, wait=True))  # the run ends with every engine that can come
        elif self.pusher.knocking():  # engines back from a restart or a freeze: in before this push
            self._rejoined(self.fleet.admit(self.pusher))
        if self.native is not None:
            self.native_in_flight, self.in_flight_version = self.native.push_async(version, self.weights()), version
        else:
            self.in_flight, self.in_flight_version = self.pusher.push_async(version, self.weights()), version
        if last:
            version = self.land(version)
        return version, evaluation

    def land(self, version: int) -> int:
        """Wait for the push in flight, as the last step's is (a run stopped early ends on a
        committed version too). Returns the trainer's version."""
        return self._land(version, push_behind=True)

    def _land(self, version: int, *, push_behind: bool) -> int:
        """Wait for the push in flight on every engine: report it where it landed, recover the
        engines where it failed. Returns the trainer's version."""
        if self.native_in_flight is not None:
            self._land_native()
            return version
        futures, self.in_flight = self.in_flight, {}
        if not futures:
            return version
        try:
            results = collect(self.in_flight_version, futures)
        except FleetPushError as e:
            if e.landed:
                self._landed(e.landed)
            return self.recover(f"push failed: {e}", version, e.failed, push_behind=push_behind)
        self._landed(results)
        return version

    def _land_native(self) -> None:
        """Pause mode: wait until the engine reports the native update live, and keep its row."""
        future, self.native_in_flight = self.native_in_flight, None
        try:
            r = future.result()
        except Exception as e:
            raise EngineLost(f"native update v{self.in_flight_version} failed (rollout.mode='pause' has no "
                             f"recovery): {e}") from e
        self.last = {"pushed_version": r["version"], "stall_ms": r["stall_ms"], "commit_step": r["commit_step"],
                     "commit_groups": 1, "committed_ranks": [1], "push_ms": r["push_ms"], "send_ms": r["send_ms"],
                     "push_mb": r["push_mb"], "sent_mb": r["push_mb"], "dense_mb": r["push_mb"],
                     "native_salts": r["salts"]}
        self.landed.append([r["version"], [1]])

    def close(self) -> None:
        """The weight groups: the native one (pause mode), then the fleet's."""
        if self.native is not None:
            self.native.close()
        self.pusher.close()

    def _landed(self, results: Mapping[int, PushResult]) -> None:
        self.last = push_metrics(results, self.fleet)
        self.landed.append([self.last["pushed_version"], self.last["committed_ranks"]])

    def take_landed(self) -> list[list[Any]]:
        """Every push that landed since the last call, sorted, as [version, committed ranks]."""
        landed, self.landed = sorted(self.landed), []
        return landed

    def take_rejoined(self) -> list[list[Any]]:
        """What (re)joining members reported serving since the last call, as [version, ranks]."""
        rejoined, self.rejoined = sorted(self.rejoined), []
        return rejoined
