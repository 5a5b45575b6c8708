"""The trainer's side of weight sync: one push in flight, fleet admission, recovery.

``WeightSync`` is what ``trainer.train`` calls around each optimizer step: ``next_batch``
before it (a lost engine found while waiting for rollouts is recovered there) and
``push`` after it.

Ordering invariants:
- at most one push is in flight: ``push`` lands the previous one before it sends the next,
  so the engines commit the versions in order, and every push that landed is reported once
  (``landed``, with the pushes a recovery made);
- the new version is scored (``score``) after the previous push landed and before the new
  one is sent, so no transfer competes with the evaluation;
- the optimizer writes the parameters only after the push in flight read them all
  (``wait_reads``, called by ``Policy.step``): pushes read the live parameters, not a copy;
- engines that knock (back from a restart or a freeze) are admitted between two pushes,
  never during one; before the last push, every engine that can come is waited for, so a
  run ends with the whole fleet on its last version;
- the last step's push is waited for: the run ends on a committed version;
- a failed push, a dead engine process, or an engine lost while waiting for rollouts goes
  through ``Fleet.recover``, which returns the trainer's version (raised above any
  engine's) and forgets the push in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from inflight.protocol import RolloutGroup
from inflight.rollout_queue import RolloutBuffer, RolloutQueue
from inflight.transport.errors import TransportError, TransportTimeout
from inflight.transport.pusher import PushResult, WeightPusher
from trainer.config import TrainConfig
from trainer.fleet import EngineLost, Fleet


def push_metrics(result: PushResult) -> dict[str, Any]:
    """The metrics row's fields of one landed push."""
    commit = result.commits[min(result.commits)]
    # engines count their own steps, so what compares across a fleet is how many steps each
    # decoded between the first bucket and its commit
    waits = [c.steps_since_first_bucket for c in result.commits.values()]
    return {"pushed_version": result.version, "commit_ms": commit.commit_ms, "commit_step": commit.step,
            "committed_ranks": sorted(result.commits), "commit_steps": {r: c.step for r, c in result.commits.items()},
            "commit_spread_steps": max(waits) - min(waits),
            "push_ms": 1e3 * (result.stage_wait_s + result.commit_wait_s), "send_ms": 1e3 * result.send.send_s,
            "push_mb": result.send.nbytes / 2**20, "read_ms": 1e3 * result.send.read_s,
            "steps_during_transfer": result.staged[min(result.staged)].steps_during_transfer}


class WeightSync:
    """Pushes the policy to the fleet after each optimizer step, and keeps the fleet."""

    def __init__(self, cfg: TrainConfig, pusher: WeightPusher, fleet: Fleet, queue: RolloutQueue,
                 weights: Callable[[], dict[str, torch.Tensor]]) -> None:
        self.cfg, self.pusher, self.fleet, self.queue, self.weights = cfg, pusher, fleet, queue, weights
        self.in_flight: Future[PushResult] | None = None
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

    def recover(self, reason: str, version: int, silent: Sequence[int] = ()) -> int:
        """``Fleet.recover``; the push in flight, if any, is given up."""
        self.in_flight = None
        events = len(self.fleet.events)
        version = self.fleet.recover(self.pusher, reason, version, self.weights, self.queue, silent=silent)
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
        if max(self.pusher.engine_versions.values(), default=-1) > version:
            return self.recover(f"engines serve {self.pusher.engine_versions}, ahead of v{version}", version)
        return version

    def wait_reads(self) -> None:
        """Before the optimizer writes the parameters: the push in flight reads them as its
        buckets go out (no copy of the model), so it must have packed its last bucket."""
        self.read_wait_s = self.pusher.wait_reads()

    def next_batch(self, buffer: RolloutBuffer, version: int) -> tuple[list[RolloutGroup], int]:
        """The next batch of groups, and the trainer's version (a recovery may move it)."""
        if (problem := self.fleet.exit_problem()) is not None:  # a fleet's other engines keep the queue full
            version = self.recover(problem, version)
        while True:
            try:
                return self._wait_groups(buffer, version), version
            except EngineLost as e:
                version = self.recover(str(e), version)

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
                if (problem := self.fleet.exit_problem()) is not None:
                    raise EngineLost(problem) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no rollout group within rollout.queue_timeout_s={rollout.queue_timeout_s}s "
                                       "from a live engine: is it stuck?") from None

    def push(self, version: int, *, last: bool, score: Callable[[], dict[str, Any]]) -> tuple[int, dict[str, Any]]:
        """Land the previous push, ``score`` the new version, admit knocking engines, send
        ``version`` (and wait for it when ``last``). Returns the trainer's version (a failed
        push recovers the fleet) and what ``score`` returned."""
        evaluation: dict[str, Any] = {}
        self.wait_s = 0.0
        try:
            if self.in_flight is not None:
                t0 = time.perf_counter()
                self._landed(self.in_flight.result())
                self.wait_s, self.in_flight = time.perf_counter() - t0, None
            evaluation = score()
            if last and len(self.pusher.group.roster) < self.cfg.engine.world_size - 1:
                self._rejoined(self.fleet.admit(self.pusher, wait=True))  # the run ends with every engine that can come
            elif self.pusher.knocking():  # engines back from a restart or a freeze: in before this push
                self._rejoined(self.fleet.admit(self.pusher))
            self.in_flight = self.pusher.push_async(version, self.weights())
            if last:
                self._landed(self.in_flight.result())
                self.in_flight = None
        except TransportError as e:  # an engine is gone or silent: go on without it (see Fleet.recover)
            version = self.recover(f"push failed: {e}", version, silent=getattr(e, "ranks", ()))
        return version, evaluation

    def _landed(self, result: PushResult) -> None:
        self.last = push_metrics(result)
        self.landed.append([self.last["pushed_version"], self.last["committed_ranks"]])

    def take_landed(self) -> list[list[Any]]:
        """Every push that landed since the last call, sorted, as [version, committed ranks]."""
        landed, self.landed = sorted(self.landed), []
        return landed

    def take_rejoined(self) -> list[list[Any]]:
        """What (re)joining members reported serving since the last call, as [version, ranks]."""
        rejoined, self.rejoined = sorted(self.rejoined), []
        return rejoined
