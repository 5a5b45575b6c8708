"""The commit coordinator: the one place where an engine's staged version becomes live.

One per in-flight engine, in EngineCore's process, attached by the patch when ``inflight_start`` passes through
``EngineCore.collective_rpc``. The workers only receive, verify and prepare; on the trainer's ``Commit(v)`` each
posts ``CommitReady(rank, v)`` on its engine's channel (messages defined here, sealed as in ``inflight.protocol``);
the watcher thread waits for all ranks, commits at the next step boundary and posts the outcome to the workers.

Ordering invariants:
- every engine step (schedule, forward, sample, label the outputs) and every commit runs under ``lock``;
- a commit runs on the engine thread, at the start of a step (patched ``EngineCore.step``) or, idle, from vLLM's
  idle-state callbacks (woken by ``WAKEUP``); only an in-process ``EngineCore`` with no request at all commits
  from the watcher thread, holding ``lock`` (nothing else would step it);
- a commit is ``collective_rpc("inflight_commit", v)`` on every worker's execution thread, between two
  ``execute_model`` calls. If any rank fails, every rank that applied v rolls back in the same window and the
  label stays; else every rank keeps v (``inflight_confirm``) and the label (``EngineCore._weight_version``) moves
  to v in the same window: tokens of the next step are tagged v, none before, and each worker's live version is
  the label whether or not its listener reads the outcome;
- every commit that goes live invalidates the prefix cache in its window (``inflight.engine.prefix_cache``);
- a rollback that fails marks the engine broken: its next step raises (fail-stop), never serving a mix;
- store I/O (readiness, outcomes) happens on the watcher thread, never inside the stall.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from inflight.engine.batch_labels import BatchLabels
from inflight.engine.engine_config import InflightConfig
from inflight.engine.prefix_cache import PrefixCacheGuard
from inflight.engine.prefix_cache import problems as prefix_cache_problems
from inflight.engine.rpc import EngineState, as_result
from inflight.engine.spec_decode import SpecDecodeMeter
from inflight.engine.spec_decode import problems as spec_decode_problems
from inflight.layer_groups import Hybrid
from inflight.protocol import (
    ENGINE_CHANNEL,
    CommitReady,
    EngineCommitFailed,
    EngineCommitted,
    ProtocolError,
    WorkerCommitResult,
    WorkerSettleResult,
    decode_engine,
    encode,
)
from inflight.transport.errors import TransportError
from inflight.transport.poll import poll_until
from inflight.transport.store import store_reachable

log = logging.getLogger("inflight.coordinator")

ATTR = "_inflight_coordinator"
"""Attribute of the ``EngineCore`` that holds its coordinator."""

Via = Literal["step", "idle-callback", "idle-inproc"]
_POLL_MAX_S = 0.005


def check_engine(vllm_config: Any, config: InflightConfig, scheduler: Any = None) -> int:
    """Refuse engines whose step loop cannot take an atomic between-steps commit, or whose
    prefix cache cannot be kept exact across one (``scheduler``: EngineCore's); returns the
    number of workers (weight-group ranks) this engine needs."""
    pc = vllm_config.parallel_config
    problems = []
    if vllm_config.scheduler_config.async_scheduling and config.record_routing:
        problems.append("record_routing needs async_scheduling=False: routing is read after a step's forward, and "
                        "under async scheduling the next batch's forward has already run by then")
    if pc.pipeline_parallel_size != 1:
        problems.append(f"pipeline_parallel_size={pc.pipeline_parallel_size} is not supported: vLLM's batch queue "
                        "keeps up to pp_size batches in flight, so there is no step boundary at which every stage is "
                        "idle (scale with tensor parallelism or more engines)")
    if pc.data_parallel_size != 1:
        problems.append(f"data_parallel_size={pc.data_parallel_size} is not supported: run one in-flight engine per "
                        "data-parallel replica, each with its own ranks in the weight group")
    if scheduler is not None:
        problems.extend(prefix_cache_problems(scheduler))
    problems.extend(spec_decode_problems(vllm_config, record_routing=config.record_routing))
    if config.require_processed_logprobs and vllm_config.model_config.logprobs_mode != "processed_logprobs":
        problems.append(f"logprobs_mode is {vllm_config.model_config.logprobs_mode!r}, need 'processed_logprobs'")
    if config.adapter is not None:
        from inflight.engine.adapter_engine import engine_problems

        problems.extend(engine_problems(vllm_config, config.adapter))
    workers = pc.world_size
    last = config.rank + workers - 1
    if last >= config.group.world_size:
        problems.append(f"this engine has {workers} workers, which take weight-group ranks {config.rank}..{last}, "
                        f"but GroupConfig.world_size={config.group.world_size} (trainer + workers) ends at rank "
                        f"{config.group.world_size - 1}")
    if problems:
        raise RuntimeError("inflight cannot run on this engine: " + "; ".join(problems) +
                           ". inflight.engine.engine_config.engine_kwargs() sets the engine options.")
    return workers


def outcome_key(version: int, part: int, parts: int) -> str:
    """Where the coordinator posts the outcome of a version (or of one of its layer groups)."""
    return f"outcome/{version}.{part}" if parts else f"outcome/{version}"


class EngineBroken(RuntimeError):
    """A failed commit could not be rolled back on every rank: the engine must stop."""


@dataclass
class _CommitRequest:
    version: int
    part: int = 0
    parts: int = 0  # 0: the whole model; else group ``part`` of a layer-granular update
    done: threading.Event = field(default_factory=threading.Event)
    outcome: EngineCommitted | EngineCommitFailed | None = None


@dataclass
class CommitRecord:
    """What one commit did, kept for status and tests."""

    version: int
    via: Via
    step: int
    ok: bool
    workers: list[WorkerCommitResult]
    part: int = 0
    parts: int = 0


class CommitCoordinator:
    def __init__(self, core: Any, config: InflightConfig, workers: int) -> None:
        from vllm.v1.engine.core import EngineCoreProc

        self.core = core
        self.config = config
        self.ranks = list(range(config.rank, config.rank + workers))
        self.instance_id = core.vllm_config.instance_id
        self.lock = threading.Lock()
        self.live_version = config.initial_version
        """The oldest version any layer group holds (the version, outside a layer-granular update)."""
        self.label = Hybrid(config.initial_version)
        """What the outputs are tagged with: the version, or the hybrid of a layer-granular update."""
        self.steps = 0  # engine steps that ran the model since the coordinator started
        self.broken = ""
        self.history: list[CommitRecord] = []
        self.prefix_cache = PrefixCacheGuard(core.scheduler)  # every commit invalidates it, in its window
        self.batch_labels = BatchLabels(core)  # async scheduling: each batch labelled by the weights it ran on
        self.spec_decode = SpecDecodeMeter(core.scheduler) if core.vllm_config.speculative_config else None
        self._busy_loop = isinstance(core, EngineCoreProc)
        self._pending: _CommitRequest | None = None
        self._slot = threading.Lock()  # guards _pending: taken once, by whichever thread runs it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="inflight-coordinator", daemon=True)

    def start(self) -> None:
        """Once every worker started: label the outputs from now on, and watch for commits."""
        self.core._weight_version = str(self.label)
        self.batch_labels.install()
        self._thread.start()
        # a plain interpreter exit stops the watcher too, before the trainer's store can go away under it
        ref = weakref.ref(self)
        atexit.register(lambda: (c := ref()) is not None and c.stop())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def set_label(self, version: int) -> None:
        """Move the label without a commit (a baseline that loaded weights by other means)."""
        with self.lock:
            self.live_version, self.label = version, Hybrid(version)
            self.core._weight_version = str(version)

    def commit_pending(self) -> bool:
        """Every rank is ready and the commit waits for the next step boundary."""
        return self._pending is not None

    def commits(self) -> int:
        """Commits that went live on every rank."""
        return sum(h.ok for h in self.history)

    def status(self) -> EngineState:
        return EngineState(live_version=self.live_version, steps=self.steps, broken=self.broken, commits=self.commits(),
                           label=str(self.label), prefix_cache=self.prefix_cache.stats,
                           spec_decode=self.spec_decode.stats() if self.spec_decode is not None else ())

    # -- engine thread ------------------------------------------------------------------------
    @contextmanager
    def step(self) -> Iterator[Any]:
        """Wrap one EngineCore step; yields a callback to report whether the model ran."""
        with self.lock:
            if self.broken:
                raise EngineBroken(f"inflight: engine {self.instance_id} holds mixed weights: {self.broken}")
            self._run_pending_locked("step")
            executed = [False]
            yield lambda ran: executed.__setitem__(0, bool(ran))
            if executed[0]:
                self.steps += 1

    def _on_idle(self, core: Any) -> None:
        with self.lock:
            self._run_pending_locked("idle-callback")

    def _run_pending_locked(self, via: Via) -> None:
        with self._slot:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.outcome = self._commit(pending.version, via, pending.part, pending.parts)
        except EngineBroken as e:
            self.broken = str(e)
            pending.outcome = EngineCommitFailed(version=pending.version, reason=str(e), live_version=self.live_version)
            raise
        finally:
            pending.done.set()

    def _commit(self, version: int, via: Via, part: int = 0, parts: int = 0) -> EngineCommitted | EngineCommitFailed:
        executor = self.core.model_executor
        t0 = time.perf_counter()
        final = len(self.ranks) == 1  # one rank: its own success is the engine's, kept at once
        results = [as_result(r, WorkerCommitResult)
                   for r in executor.collective_rpc("inflight_commit", args=(version, final, part, parts))]
        failed = {r.rank: r.error for r in results if not r.ok}
        if not failed:
            if not final:
                kept = [as_result(r, WorkerSettleResult)
                        for r in executor.collective_rpc("inflight_confirm", args=(version,))]
                unkept = {r.rank: r.error for r in kept if not r.ok}
                if unkept:  # cannot happen unless a worker lost track: its live version is unknown
                    raise EngineBroken(f"commit of v{version} applied but not kept on ranks {sorted(unkept)}: {unkept}")
            self.label = self.label.with_groups(version, part + 1, parts) if parts else Hybrid(version)
            self.live_version = self.label.oldest
            self.core._weight_version = str(self.label)
            try:  # before the next schedule: no admission may find KV of the replaced weights
                self.prefix_cache.on_commit()
            except Exception as e:  # the cache may serve the old weights' KV: stop rather than serve it
                raise EngineBroken(f"v{version} is live but invalidating the prefix cache failed: {e!r}") from e
            ms = 1e3 * (time.perf_counter() - t0)
            self.history.append(CommitRecord(version, via, self.steps, True, results, part, parts))
            return EngineCommitted(version=version, step=self.steps, commit_ms=ms,
                                   tokens_at_commit=self._output_tokens(), part=part, parts=parts,
                                   label=str(self.label))
        applied = [r.rank for r in results if r.applied]
        reason = "; ".join(f"worker rank {r}: {e}" for r, e in sorted(failed.items()))
        if applied:
            back = [as_result(r, WorkerSettleResult)
                    for r in executor.collective_rpc("inflight_rollback", args=(version,))]
            stuck = {r.rank: r.error for r in back if not r.ok}
            if stuck:
                raise EngineBroken(f"commit of v{version} failed ({reason}) and rollback failed on ranks "
                                   f"{sorted(stuck)}: {stuck}")
            reason += f"; rolled back on ranks {applied}"
        self.history.append(CommitRecord(version, via, self.steps, False, results, part, parts))
        log.warning("inflight: commit of v%d refused on engine %s: %s; still serving v%d",
                    version, self.instance_id, reason, self.live_version)
        return EngineCommitFailed(version=version, reason=reason, live_version=self.live_version)

    def _output_tokens(self) -> dict[str, int]:
        """Output tokens so far of every unfinished request, by the user's request id: where its
        tags change. Under async scheduling a batch sampled before the commit is processed after
        it; its tokens (``num_output_placeholders``) carry the earlier label and count here.

        ``list()`` copies the dict in one step under the GIL: an in-process engine may add a
        request from the user's thread meanwhile (it has no output tokens yet either way)."""
        requests = list(self.core.scheduler.requests.items())
        # Worker-side ids are "<user id>-<8 random chars>" (vLLM 0.32 input processor).
        return {rid.rsplit("-", 1)[0]: req.num_output_tokens + req.num_output_placeholders for rid, req in requests}

    # -- watcher thread -----------------------------------------------------------------------
    def _request(self, ready: CommitReady) -> EngineCommitted | EngineCommitFailed | None:
        """Have ``ready``'s version (or group) committed at the next step boundary; None if stopped first."""
        pending = _CommitRequest(ready.version, ready.part, ready.parts)
        with self._slot:
            self._pending = pending
        if self._busy_loop:
            from vllm.v1.engine import EngineCoreRequestType

            # An idle busy loop blocks on its input queue: wake it, and it runs the idle
            # callbacks (on the engine thread) before it blocks again.
            self.core._idle_state_callbacks.append(self._on_idle)
            self.core.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
        while not pending.done.is_set():
            if not self._busy_loop and self.lock.acquire(timeout=0.05):
                try:  # in-process and idle: no step will come to pick it up; busy: the next step will
                    if self.core.scheduler.get_num_unfinished_requests() == 0:
                        self._run_pending_locked("idle-inproc")
                except EngineBroken:
                    pass  # recorded; the next step raises it on the engine thread
                finally:
                    self.lock.release()
            if self._stop.is_set():
                return None
            pending.done.wait(0.05)
        return pending.outcome

    def _watch(self) -> None:
        """Wait for every rank's ``CommitReady`` for one version, commit it, post the outcome;
        reconnect when the trainer's store goes away (a restarted trainer hosts a new one)."""
        keys = [f"ready/{r}" for r in self.ranks]
        while not self._stop.is_set():
            try:
                if not store_reachable(self.config.group.host, self.config.group.port):
                    raise TransportError("the trainer's store is not up (yet)")
                store = self.config.group.connect(f"{ENGINE_CHANNEL}/{self.instance_id}")
            except TransportError:
                self._stop.wait(1.0)
                continue
            try:
                while not self._stop.is_set():
                    ready = self._wait_ready(store, keys)
                    if isinstance(ready, str):  # the trainer is leaving: let go of its store first
                        store = None
                        try:
                            self.config.group.await_trainer_gone(ready, self._stop)
                        except InterruptedError:
                            return
                        break
                    if ready is None:
                        continue
                    for k in keys:
                        store.delete_key(k)
                    why = self._refusal(ready)
                    if why:
                        outcome: Any = EngineCommitFailed(version=ready.version, reason=why,
                                                          live_version=self.live_version)
                    else:
                        outcome = self._request(ready)
                        if outcome is None:
                            return
                    store.set(outcome_key(ready.version, ready.part, ready.parts), encode(outcome))
                    # every worker read the previous outcome before it posted this readiness
                    if ready.parts and ready.part > 0:
                        store.delete_key(outcome_key(ready.version, ready.part - 1, ready.parts))
                    elif ready.version > 0:
                        store.delete_key(outcome_key(ready.version - 1, 0, 0))
            except RuntimeError as e:  # the store's host went away
                log.info("inflight: coordinator lost the group store (%s); reconnecting", e)
                self._stop.wait(0.5)

    def _refusal(self, ready: CommitReady) -> str:
        """Why ``ready`` may not commit over the live weights ("" if it may): a rank refused it;
        a whole version must be newer than the oldest group; a layer group must be the next of
        its update (a version at least as new as every group, whose earlier groups are live)."""
        if ready.refused:
            return f"refused by {ready.refused}"
        v, label = ready.version, self.label
        if v <= label.oldest:
            return f"v{v} is not newer than the live v{self.live_version}"
        if not ready.parts:
            return ""
        done = label.steps[-1][1] if label.steps and label.steps[-1][0] == v else 0
        if v < label.newest or ready.part > done:
            return f"group {ready.part} of v{v} does not follow the live {label} (expected group {done} at most)"
        return ""

    def _wait_ready(self, store: Any, keys: list[str]) -> CommitReady | str | None:
        """What every rank is ready for, None (try again), or the trainer's store
        incarnation when a worker relayed its ``Shutdown`` (``bye/<rank>``, deleted here as the
        last use of the store: the worker answers the trainer only then)."""
        byes = [f"bye/{r}" for r in self.ranks]

        def ready_or_bye() -> str | None:
            if store.check(keys):
                return "ready"
            return "bye" if store.check(byes) else None
        try:
            seen = poll_until(ready_or_bye, timeout_s=None, stop=self._stop, what="every rank's CommitReady",
                              who="inflight coordinator", max_pause_s=_POLL_MAX_S)
        except InterruptedError:
            return None
        if seen == "bye":
            incarnation = store.get(byes[0]).decode()
            for k in byes:
                store.delete_key(k)
            return incarnation
        versions: set[tuple[int, int, int]] = set()
        refused: list[str] = []
        for k in keys:
            try:
                msg = decode_engine(store.get(k))
            except ProtocolError as e:
                log.warning("inflight: dropped an unreadable message at %s: %s", k, e)
                store.delete_key(k)
                return None
            if not isinstance(msg, CommitReady) or msg.rank != int(k.rsplit("/", 1)[1]):
                log.warning("inflight: dropped a message at %s that is not this rank's CommitReady: %r", k, msg)
                store.delete_key(k)
                return None
            versions.add((msg.version, msg.part, msg.parts))
            if msg.refused:
                refused.append(f"worker rank {msg.rank}: {msg.refused}")
        if len(versions) > 1:  # a rank still on an older attempt; it withdraws on its timeout
            time.sleep(_POLL_MAX_S)
            return None
        version, part, parts = versions.pop()
        return CommitReady(rank=self.ranks[0], version=version, part=part, parts=parts, refused="; ".join(refused))
