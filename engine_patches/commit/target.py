"""The engine worker as the listener sees it (``EngineTarget``, a ``CommitTarget``), and the
execution-thread half of the engine's two-phase commit.

Two threads use it. The listener thread stages, prepares and, on the trainer's ``Commit``,
hands the staged version over, posts ``CommitReady`` on the engine's channel and relays the
coordinator's outcome (``commit``). The worker's execution thread, between two engine
steps, applies the ready version (``execute_commit``), then keeps it (``execute_confirm``)
or takes it back (``execute_rollback``), as the engine's commit coordinator decides for
every rank in the same window, through ``collective_rpc``.

Ordering invariants:
- a ready version is handed to exactly one of the commit and its withdrawal (``_lock``): a
  listener that stops waiting withdraws it only if the execution thread has not taken it,
  so nothing the engine applied is ever dropped unseen;
- the live version and the rollback copy (``StagingPool.previous``) change only on the
  execution thread, in the window where the coordinator moves the engine's label: every
  rank's hello reports the label, whether or not its listener ever reads the outcome (the
  trainer may die between its ``Commit`` and that read);
- the staged bytes belong to the execution thread from the moment it takes them: it keeps
  them as the next rollback copy or gives them back to the pool.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from inflight.engine.commit.base import CommitFailed, CommitStrategy
from inflight.engine.coordinator import outcome_key
from inflight.engine.engine_config import InflightConfig
from inflight.layer_groups import Hybrid
from inflight.protocol import (
    CommitInfo,
    CommitReady,
    EngineCommitted,
    ProtocolError,
    WorkerCommitResult,
    WorkerSettleResult,
    decode_engine,
    encode,
)
from inflight.staging import StagedVersion, StagingPool, ordered_commit, ready_event
from inflight.transport.errors import TransportError, TransportTimeout, member
from inflight.transport.poll import poll_until
from inflight.transport.store import wait_key


@dataclass
class _Candidate:
    version: int
    staged: StagedVersion
    pool: StagingPool
    event: Any  # torch.cuda.Event on CUDA: staging of this version is complete
    part: int = 0
    parts: int = 0  # 0: the whole model; else layer group ``part`` of ``parts``

    def names(self) -> str:
        return f"group {self.part} of v{self.version}" if self.parts else f"v{self.version}"


@dataclass
class PendingCommit:
    """A commit handed to the engine whose outcome the listener has not read yet (``begin_commit``)."""

    ready: _Candidate
    key: str


class EngineTarget:
    """The listener's view of this worker (``CommitTarget``) and the execution-thread half
    of the engine's two-phase commit."""

    def __init__(self, strategy: CommitStrategy, config: InflightConfig, rank: int, device: torch.device) -> None:
        self.strategy = strategy
        self.config = config
        self.rank = rank
        self.device = device
        self._live = config.initial_version
        self.label = Hybrid(config.initial_version)
        """This rank's weights, as the coordinator labels them (moves with ``_live``, on the execution thread)."""
        self.channel: Any = None  # this engine's commit channel in the current generation's store
        self.incarnation = ""  # of the trainer's store the channel lives in
        self._lock = threading.Lock()  # hands a ready version to exactly one of: commit, withdrawal
        self._ready: _Candidate | None = None
        self._applied: _Candidate | None = None  # applied in the open window, neither kept nor taken back yet
        self._event: Any = None
        self.model_steps = 0
        self.execution_thread: int | None = None
        """The thread that runs this worker's model steps (``inflight_start`` runs on it too)."""
        self.commits: list[WorkerCommitResult] = []

    def on_step(self) -> None:
        """Before each model step of this worker (``inflight.engine.patch.count_worker_steps``):
        count it, and remember which thread runs it."""
        self.model_steps += 1
        self.execution_thread = threading.get_ident()

    # -- listener thread (CommitTarget) -----------------------------------------------------
    @property
    def live_version(self) -> int:
        return self._live

    def steps(self) -> int:
        return self.model_steps

    def prepare_part(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.strategy.feed(weights)  # the swap commit re-packs layer by layer; the others wait for all

    def prepare(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.strategy.prepare(weights)
        self._event = ready_event(self.device)

    def discard(self) -> None:
        self.strategy.discard()

    def leave(self) -> None:
        """The trainer is leaving: have the engine's coordinator let go of its store first (it
        deletes ``bye/<rank>`` as the last thing it does with it; see the coordinator)."""
        key = f"bye/{self.rank}"
        self.channel.set(key, self.incarnation.encode())
        try:  # a coordinator busy committing answers within a step; else go on
            poll_until(lambda: None if self.channel.check([key]) else True, timeout_s=5.0,
                       what="the coordinator's goodbye", who=member(self.rank))
        except TransportTimeout:
            pass

    def commit(self, version: int, staged: StagedVersion, pool: StagingPool) -> CommitInfo:
        """Hand ``staged`` to the execution thread, announce readiness to the engine's
        coordinator and relay its outcome. Whatever happens, ``staged`` is this target's now:
        withdrawn (never applied), its bytes go back to ``pool`` here; taken, the execution
        thread keeps or returns them."""
        return self.finish_commit(self.begin_commit(version, staged, pool))

    def begin_commit(self, version: int, staged: StagedVersion, pool: StagingPool, part: int = 0,
                     parts: int = 0) -> PendingCommit:
        """The first half of ``commit``: hand ``staged`` (layer group ``part`` of ``parts``, or
        the whole version) over and post this rank's readiness; ``finish_commit`` reads the
        outcome. One at a time: the previous one's outcome is read first."""
        ready = _Candidate(version, staged, pool, self._event, part, parts)
        with self._lock:
            self._ready = ready
        key = outcome_key(version, part, parts)
        try:
            self.channel.delete_key(key)  # a failed earlier attempt at this version left its outcome
            self.channel.set(f"ready/{self.rank}", encode(CommitReady(rank=self.rank, version=version, part=part,
                                                                      parts=parts)))
        except BaseException:
            self._withdraw(ready)
            raise
        return PendingCommit(ready, key)

    def refuse_commit(self, version: int, part: int, parts: int, reason: str) -> None:
        """Layer-granular: this rank refused group ``part`` after every rank accepted it. Tell
        the coordinator, so the ranks that handed the group over hear at once that it fails."""
        self.channel.set(f"ready/{self.rank}", encode(CommitReady(rank=self.rank, version=version, part=part,
                                                                  parts=parts, refused=reason[:200] or "refused")))

    def finish_commit(self, pending: PendingCommit) -> CommitInfo:
        """The second half of ``commit``: wait for the engine's outcome and relay it."""
        ready, key = pending.ready, pending.key
        version, what = ready.version, f"the engine's commit of {ready.names()}"
        try:
            try:
                raw = wait_key(self.channel, key, timeout_s=self.config.commit_timeout_s, stop=None, what=what,
                               who=member(self.rank))
            except TransportTimeout as e:
                if self._withdraw(ready):  # the engine never took it: nothing changed anywhere
                    self.channel.delete_key(f"ready/{self.rank}")
                    raise CommitFailed(f"v{version} withdrawn: {e}") from e
                # the commit is running on the execution thread: its outcome is moments away
                raw = wait_key(self.channel, key, timeout_s=self.config.commit_timeout_s, stop=None, what=what,
                               who=member(self.rank))
        except TransportError:
            self._withdraw(ready)  # the store is gone: if the engine took v, its own window settled it
            raise
        try:
            outcome = decode_engine(raw)
        except ProtocolError as e:
            self._withdraw(ready)
            raise TransportError(f"{member(self.rank)}: unreadable commit outcome: {e}") from e
        if not isinstance(outcome, EngineCommitted) or (outcome.version, outcome.part) != (version, ready.part):
            self._withdraw(ready)  # refused before the window (not newer than the live version)
            raise CommitFailed(getattr(outcome, "reason", f"unexpected outcome {outcome!r}"))
        return CommitInfo(step=outcome.step, commit_ms=outcome.commit_ms,
                          tokens_at_commit=dict(outcome.tokens_at_commit), label=outcome.label)

    def _withdraw(self, ready: _Candidate) -> bool:
        """Take ``ready`` back unless the execution thread took it; True if withdrawn."""
        with self._lock:
            withdrawn = self._ready is ready
            if withdrawn:
                self._ready = None
        if withdrawn:
            ready.pool.give(ready.staged.flat)
        return withdrawn

    # -- execution thread (called by the coordinator between two engine steps) --------------
    def execute_commit(self, version: int, final: bool = False, part: int = 0, parts: int = 0) -> WorkerCommitResult:
        """Apply the ready ``version`` (its layer group ``part`` of ``parts``, if ``parts``).
        ``final``: this is the engine's only rank, so its own success is the engine's and the
        commit is kept at once (no ``execute_confirm``)."""
        me = threading.current_thread()
        result = functools.partial(
            WorkerCommitResult, rank=self.rank, version=version, thread=me.name,
            main_thread=me is threading.main_thread(),
            execution_thread=None if self.execution_thread is None else self.execution_thread == threading.get_ident())
        with self._lock:
            ready, self._ready = self._ready, None
            if ready is not None and (ready.version, ready.part, ready.parts) != (version, part, parts):
                self._ready, ready = ready, None  # not what the engine commits: keep it
        if ready is None:
            what = f"group {part} of v{version}" if parts else f"v{version}"
            return self._log(result(ok=False, error=f"{what} is not staged and ready on this rank (withdrawn or lost)"))
        t0 = time.perf_counter()
        try:
            ordered_commit(self.device, ready.event, self.strategy.apply)
        except Exception as e:
            error = f"applying v{version} failed: {e!r}"
            try:
                self._undo(ready, self.strategy.restore)
            except Exception as e2:  # state unknown: ask the coordinator to roll this rank back too
                self._applied = ready
                return self._log(result(ok=False, applied=True, error=f"{error}; restoring failed: {e2!r}"))
            return self._log(result(ok=False, error=error))
        self._applied = ready
        if final:
            self.execute_confirm(version)
        return self._log(result(ok=True, applied=True, ms=1e3 * (time.perf_counter() - t0)))

    def execute_confirm(self, version: int) -> WorkerSettleResult:
        """Every rank applied ``version``: it is live. Where the pool keeps a rollback copy
        (reserved at start: ``keep_rollback`` with ``reload``/``copy``) or a base for sparse
        updates (``keep_base``), the staged bytes become it and the bytes they replace go back
        to the pool; else they go back themselves."""
        applied, self._applied = self._applied, None
        if applied is None or applied.version != version:
            return WorkerSettleResult(rank=self.rank, version=version, ok=False,
                                      error=f"v{version} was not applied on this rank")
        if applied.parts:  # a layer group: the live version moves with the last one (see the coordinator)
            self.label = self.label.with_groups(version, applied.part + 1, applied.parts)
        else:
            self.label = Hybrid(version)
        self._live = self.label.oldest
        if applied.parts:
            applied.pool.give(applied.staged.flat)  # no rollback copy: a committed group is never taken back
        else:
            applied.pool.went_live(applied.staged)
        self.strategy.release_rollback()  # nothing rolls back past a kept commit but the copy above
        return WorkerSettleResult(rank=self.rank, version=version, ok=True)

    def execute_rollback(self, version: int) -> WorkerSettleResult:
        """Another rank failed ``version``: take it back here too (or it never went live here)."""
        applied, self._applied = self._applied, None
        if applied is None or applied.version != version:
            return WorkerSettleResult(rank=self.rank, version=version, ok=True)  # nothing of v went live here
        try:
            self._undo(applied, self.strategy.undo)
        except Exception as e:
            return WorkerSettleResult(rank=self.rank, version=version, ok=False, error=repr(e))
        return WorkerSettleResult(rank=self.rank, version=version, ok=True)

    def _undo(self, applied: _Candidate, how: Any) -> None:
        """Put the live version back from the pool's rollback copy (``how``: after a failed or
        a refused apply; the copy moves only when a commit is kept); the refused version's
        bytes go back to the pool."""
        previous = applied.pool.previous
        if previous is None and getattr(self.strategy, "needs_rollback_copy", True):
            # reading the checkpoint from disk here would hold the step lock for minutes at scale
            raise RuntimeError(f"no rollback copy of v{self._live} (keep_rollback=False): the engine fails closed "
                               "rather than reload its checkpoint inside the stall")
        ordered_commit(self.device, None, lambda: how(None if previous is None else previous.views))
        applied.pool.give(applied.staged.flat)

    def _log(self, result: WorkerCommitResult) -> WorkerCommitResult:
        self.commits = (self.commits + [result])[-64:]
        return result
