"""Scoring off the engine's critical path: ``Task.score`` (and ``EpisodeTask.turn``) in
worker processes, since a verifier that runs code or asks a judge would, inline, stop every sequence::

    pool.submit(group_id, prompts, completions)   # or submit_turn(key, episode); never waits
    for scored in pool.poll(): ...                # scored.key, .rewards, .turn, .error; never waits

Workers are fresh interpreters (``scoring_worker``) that one collector thread drives (docs/design.md). Invariants:
1. a worker holds at most one call, sent only once it built its task and is idle; its deadline (``timeout_s``)
   starts at the send; past it, the worker's process group is SIGKILLed and a fresh worker takes its place;
2. queued calls are sent in submission order; results come back in completion order, checked in the worker
   (``check_rewards``, ``check_turn``): a bad reward is an error naming its index, never a NaN;
3. every submitted key is in exactly one place (the queue, a worker's call, the result deque) until ``poll`` returns it,
   once; a dead or killed worker's call, a ``cancel``, and at ``close`` every call left become error results;
4. a result that reaches the pipe is read before the worker's death or deadline is acted on;
5. while calls wait and every worker is busy, one more starts (up to ``max_workers``) once a call has run, or
   the oldest waited, ``GROW_AFTER_S``, never while a worker starts; workers are not retired;
6. a worker that cannot start (it dies, or is not ready within ``start_timeout_s``) is restarted only while calls
   wait, at once when no other is alive, else at most every 30 s, each such failure with none alive failing the
   oldest waiting call (never a busy loop); a ``make_task`` that raises answers every call with its error;
7. the lock is held for a set or deque operation only, never while a worker starts, is sent a call or is killed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from inflight.trainer.rollout.scoring_worker import (
    JOIN_S,
    LIVE,
    WAKE_S,
    Scored,
    WorkerProcess,
    check_rewards,
    check_settings,
    describe_exit,
    engine_task,
    engine_task_factory,
    first_line,
)
from inflight.trainer.tasks.task import Completion, EpisodeView, Prompt, Task, Turn

__all__ = ["ScoringPool", "Scored", "check_rewards", "engine_task", "engine_task_factory"]

log = logging.getLogger("inflight.scoring")

GROW_AFTER_S = 1.0
"""How long a call runs (or the oldest waits), calls waiting and every worker busy, before the
pool starts one more: a slow or hung call holds the queue that long; fast calls queued
behind fast ones (a burst of groups) start nothing."""


class ScoringPool:
    """``Task.score`` in ``workers`` processes of their own, off the engine's critical path
    (see the module docstring for the design and its invariants).

    ``make_task``: a picklable factory (a module-level function, or ``functools.partial`` of
    one), called once in each worker. ``timeout_s``: the most one call may take; its worker
    is then killed and replaced. ``memory_mb``: each worker's address-space cap (None: none).
    ``start_timeout_s``: how long a worker may take to import and build its task.
    ``max_workers``: the most workers it grows to while calls wait (None: ``workers``)."""

    def __init__(self, make_task: Callable[[], Task], workers: int = 1, timeout_s: float = 30.0,
                 memory_mb: int | None = 2048, *, start_timeout_s: float = 300.0,
                 max_workers: int | None = None) -> None:
        check_settings(make_task, workers, timeout_s, memory_mb, start_timeout_s, max_workers)
        self.make_task, self.workers, self.timeout_s = make_task, workers, float(timeout_s)
        self.max_workers = workers if max_workers is None else max_workers
        self.memory_mb, self.start_timeout_s = memory_mb, float(start_timeout_s)
        self.counts = {"submitted": 0, "scored": 0, "failed": 0, "timeouts": 0, "deaths": 0, "cancelled": 0,
                       "grown": 0}
        """Running totals (read them for metrics; written by the pool only)."""
        self._boot = pickle.dumps((memory_mb, os.getpid(), pickle.dumps(make_task)))
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, bytes, float]] = deque()  # (key, pickled call, when it was queued)
        self._results: deque[Scored] = deque()
        self._outstanding: set[str] = set()
        self._cancel: dict[str, str] = {}  # running keys to cancel (the collector kills their workers) -> why
        self._closed, self._broken = False, ""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._workers: list[WorkerProcess] = []
        try:
            for slot in range(workers):
                self._workers.append(self._spawn(slot))
        except BaseException:
            self._stop_workers()
            os.close(self._wake_r)
            os.close(self._wake_w)
            raise
        self._thread = threading.Thread(target=self._run, name="inflight-scoring", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- the API: any thread, never waits for scoring ----------------------------------------
    def submit(self, key: str, prompts: Sequence[Prompt], completions: Sequence[Completion]) -> None:
        """Queue one group for scoring under ``key`` (unique until ``poll`` returns it)."""
        if len(prompts) != len(completions):
            raise ValueError(f"key {key!r}: {len(prompts)} prompts for {len(completions)} completions")
        self._submit(key, ("score", list(prompts), list(completions)))

    def submit_turn(self, key: str, episode: EpisodeView) -> None:
        """Queue one turn of an episode (``EpisodeTask.turn``): ``Scored.turn`` or ``error``."""
        self._submit(key, ("turn", episode))

    def _submit(self, key: str, call: tuple) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"ScoringPool.submit({key!r}) after close()")
            if key in self._outstanding:
                raise ValueError(f"key {key!r} is already pending: a key is reused only after poll() returned it")
            self._outstanding.add(key)
            self.counts["submitted"] += 1
        try:  # a snapshot: the caller may reuse its lists
            data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            self._finish(key, None, f"key {key!r}: the call cannot be pickled for a scoring worker "
                                    f"({type(e).__name__}: {first_line(e)})")
            return
        with self._lock:
            refused = self._broken or ("the scoring pool was closed before it was scored" if self._closed else "")
            if not refused:
                self._queue.append((key, data, time.monotonic()))
                self._wake()
        if refused:
            self._finish(key, None, f"key {key!r}: {refused}")

    def poll(self) -> list[Scored]:
        """What finished since the last poll, in completion order; never waits."""
        out: list[Scored] = []
        while self._results:  # the only consumer: the collector appends, never pops
            out.append(self._results.popleft())
        if not out:
            return out
        with self._lock:
            self._outstanding.difference_update(s.key for s in out)
        return out

    def cancel(self, keys: Sequence[str], why: str) -> None:
        """Take ``keys`` out (invariant 6): queued ones at once, running ones by the collector.
        Keys not pending are ignored, and one whose answer comes first keeps it: the results
        that come back with ``Scored.cancelled`` are what was cancelled."""
        wanted = set(keys)
        with self._lock:
            wanted &= self._outstanding
            queued = [item[0] for item in self._queue if item[0] in wanted]
            if queued:
                self._queue = deque(item for item in self._queue if item[0] not in wanted)
            for key in wanted - set(queued):
                self._cancel[key] = why
            self._wake()
        for key in queued:
            self._finish(key, None, f"key {key!r}: cancelled before it ran ({why})", cancelled=True)

    def pending(self) -> int:
        """Keys submitted and not yet returned by ``poll``."""
        return len(self._outstanding)

    def pids(self) -> list[int]:
        """The worker processes now running (replacements included, the dead not)."""
        return [w.pid for w in self._workers if w.state != "down"]

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until every worker has built its task: True; False once ``timeout_s`` passed.
        RuntimeError if ``make_task`` failed, or a worker could not start (the reason)."""
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while True:
            states = [(w.state, w.error) for w in self._workers]
            errors = [error for state, error in states if error and state != "starting"]
            if errors:
                raise RuntimeError(f"scoring worker: {errors[0]}")
            if all(state in ("idle", "busy") for state, _ in states):
                return True
            if self._closed or self._broken:
                raise RuntimeError(self._broken or "the scoring pool is closed")
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def close(self) -> None:
        """Stop every worker; every call still queued or running becomes an error result (a
        last ``poll`` returns them). Safe to call twice, and at exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake()
        atexit.unregister(self.close)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30.0)
            if self._thread.is_alive():
                log.error("scoring pool: the collector thread did not stop; closing the workers anyway")
        for w in self._workers:  # answers already in the pipes count
            if w.state in ("busy", "starting"):
                self._drain(w)
        self._fail_all("the scoring pool was closed before it was scored")
        self._stop_workers()
        if not self._thread.is_alive():
            with self._lock:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the collector thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closed:
                self._dispatch()
                ready = wait(self._watched(), timeout=self._wait_s())
                if self._closed:
                    return
                if self._wake_r in ready:
                    self._drain_wake()
                for slot in range(len(self._workers)):
                    w = self._workers[slot]
                    if w.state != "down" and w.conn in ready:
                        self._read(w)
                    if self._workers[slot] is w and w.state != "down" and self._has_exited(w, ready):
                        self._exited(w)
                self._check_deadlines()
                self._cancel_running()
        except Exception as e:  # a bug of the pool's own: fail what it holds, loudly, rather than hang
            log.exception("scoring pool: the collector thread failed")
            self._broken = f"the scoring pool's collector failed ({type(e).__name__}: {first_line(e)})"
            self._fail_all(self._broken)

    def _watched(self) -> list[Any]:
        watched: list[Any] = [self._wake_r]
        for w in self._workers:
            if w.state != "down":
                watched += [w.conn] if w.exit_fd is None else [w.conn, w.exit_fd]
        return watched

    @staticmethod
    def _has_exited(w: WorkerProcess, ready: list[Any]) -> bool:
        return w.exit_fd in ready if w.exit_fd is not None else w.proc.poll() is not None

    def _wait_s(self) -> float:
        """Until the nearest deadline (or the time to grow), at most ``WAKE_S``."""
        soonest = min([w.deadline for w in self._workers if w.state == "busy"]
                      + [w.started + self.start_timeout_s for w in self._workers if w.state == "starting"]
                      + [self._grow_due() or math.inf], default=math.inf)
        return max(0.0, min(WAKE_S, soonest - time.monotonic()))

    def _dispatch(self) -> None:
        """Restart a down worker if calls wait (invariant 7); send queued calls to idle workers;
        grow while calls still wait (invariant 5)."""
        if self._queue:
            live = any(w.state in LIVE for w in self._workers)
            for w in self._workers:
                if w.state == "down" and (not live or time.monotonic() - w.started >= 30.0):
                    self._replace(w)
                    break
        for w in self._workers:
            if w.state != "idle":
                continue
            with self._lock:
                if not self._queue:
                    return
                key, data, _ = self._queue.popleft()
            w.state, w.key, w.deadline = "busy", key, time.monotonic() + self.timeout_s
            try:
                w.conn.send((key, data))
            except (OSError, ValueError):
                pass  # it died since it reported idle: its exit fails the call with its exit code
        self._grow()

    def _grow(self) -> None:
        """One more worker once the oldest call has waited ``GROW_AFTER_S`` with every worker
        busy (invariant 5)."""
        due = self._grow_due()
        if not due or due > time.monotonic():
            return
        try:
            self._workers.append(self._spawn(len(self._workers)))
        except Exception as e:  # no process could start: the workers there are go on
            log.error("scoring pool: could not start worker %d of max_workers=%d (%s: %s)", len(self._workers) + 1,
                      self.max_workers, type(e).__name__, first_line(e))
            self.max_workers = len(self._workers)
            return
        self.counts["grown"] += 1
        log.info("scoring pool: every worker busy with calls waiting; worker %d of max_workers=%d started",
                 len(self._workers), self.max_workers)

    def _grow_due(self) -> float:
        """When the pool may grow next (monotonic seconds); 0: not while nothing waits, a worker is
        not busy, or it is at ``max_workers``."""
        with self._lock:
            oldest = self._queue[0][2] if self._queue else 0.0
        if not oldest or len(self._workers) >= self.max_workers or any(w.state != "busy" for w in self._workers):
            return 0.0  # an idle or starting worker takes the call soon; a down one is restarted for it
        longest = min(w.deadline - self.timeout_s for w in self._workers)  # the call running longest: sent then
        return min(oldest, longest) + GROW_AFTER_S

    def _cancel_running(self) -> None:
        """Kill and replace the workers running a cancelled key (invariant 6)."""
        with self._lock:
            if not self._cancel:
                return
            cancel, self._cancel = self._cancel, {}
        for slot in range(len(self._workers)):
            w = self._workers[slot]
            if w.state == "busy" and w.key in cancel:
                self._read(w)  # an answer already sent counts
                if self._workers[slot] is w and w.state == "busy":
                    self._kill_call(w, f"cancelled while it ran ({cancel[w.key]})", cancelled=True)

    def _read(self, w: WorkerProcess) -> None:
        if not self._drain(w):
            self._exited(w)

    def _drain(self, w: WorkerProcess) -> bool:
        """Handle what the worker has sent; False once its pipe is closed."""
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            return False
        return True

    def _handle(self, w: WorkerProcess, message: tuple) -> None:
        if message[0] == "ready" and w.state == "starting":
            w.state, w.error = "idle", message[1]
            if w.error:
                log.error("scoring worker %d: %s; every call fails with it", w.pid, w.error)
        elif message[0] == "result" and w.state == "busy" and message[1] == w.key:
            self._finish(message[1], message[2], message[3], trace=message[4])
            w.state, w.key, w.deadline = "idle", "", math.inf
        else:
            log.warning("scoring worker %d (%s) sent %r unexpectedly", w.pid, w.state, message[:2])

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for slot in range(len(self._workers)):
            w = self._workers[slot]
            if w.state == "busy" and now >= w.deadline:
                self._read(w)  # an answer at the deadline counts (invariant 4)
                if self._workers[slot] is w and w.state == "busy":
                    self._timed_out(w)
            elif w.state == "starting" and now >= w.started + self.start_timeout_s:
                self._read(w)
                if self._workers[slot] is w and w.state == "starting":
                    w.kill()
                    self._start_failed(w, f"the scoring worker (pid {w.pid}) did not build its task within "
                                          f"start_timeout_s={self.start_timeout_s:g} s")

    def _timed_out(self, w: WorkerProcess) -> None:
        self.counts["timeouts"] += 1
        log.warning("scoring: key %r ran past timeout_s=%g s; worker %d killed and replaced",
                    w.key, self.timeout_s, w.pid)
        self._kill_call(w, f"scoring timed out after timeout_s={self.timeout_s:g} s")

    def _kill_call(self, w: WorkerProcess, why: str, *, cancelled: bool = False) -> None:
        """End ``w``'s call with ``why``: its worker (and what it started) killed, then replaced."""
        key = w.key
        w.kill()
        w.reap(JOIN_S)
        self._finish(key, None, f"key {key!r}: {why}; its worker (pid {w.pid}) was killed and replaced",
                     cancelled=cancelled)
        self._replace(w)

    def _exited(self, w: WorkerProcess) -> None:
        """The worker's process ended (or closed its pipe): fail its call, replace it."""
        code = w.reap(JOIN_S)
        w.kill()  # what its verifier started goes with it
        if code is None:
            w.reap(JOIN_S)
        why = describe_exit(code)
        if w.state == "starting":
            self._start_failed(w, f"the scoring worker (pid {w.pid}) died with {why} before its task was built")
            return
        self.counts["deaths"] += 1
        log.warning("scoring worker %d died with %s%s; replacing it", w.pid, why,
                    f" while scoring key {w.key!r}" if w.state == "busy" else "")
        if w.state == "busy":
            self._finish(w.key, None, f"key {w.key!r}: its scoring worker (pid {w.pid}) died with {why} "
                                      "while scoring it; a new worker replaces it")
        self._replace(w)

    def _start_failed(self, w: WorkerProcess, why: str) -> None:
        """Invariant 7: down until calls wait; the oldest waiting call fails if no worker is alive."""
        log.error("scoring pool: %s", why)
        w.reap(JOIN_S)
        w.release()
        w.state, w.error, w.started = "down", why, time.monotonic()
        if any(x.state in LIVE for x in self._workers):
            return
        with self._lock:
            head = self._queue.popleft() if self._queue else None
        if head is not None:
            self._finish(head[0], None, f"key {head[0]!r}: no scoring worker could start ({why})")

    def _replace(self, w: WorkerProcess) -> None:
        w.release()
        try:
            self._workers[w.slot] = self._spawn(w.slot)
        except Exception as e:  # no process could start at all: down, retried when calls wait
            w.state, w.key, w.started = "down", "", time.monotonic()
            w.error = f"a scoring worker could not be started ({type(e).__name__}: {first_line(e)})"
            log.error("scoring pool: %s", w.error)

    def _spawn(self, slot: int) -> WorkerProcess:
        return WorkerProcess.start(slot, self._boot)

    # -- shared by the collector and close ---------------------------------------------------
    def _finish(self, key: str, result: list[float] | Turn | None, error: str, *, trace: str = "",
                cancelled: bool = False) -> None:
        with self._lock:  # never called holding it
            self.counts["scored" if result is not None else "cancelled" if cancelled else "failed"] += 1
        turn = result if isinstance(result, Turn) else None
        self._results.append(Scored(key, None if turn is not None else result, error, turn, trace, cancelled))

    def _fail_all(self, reason: str) -> None:
        """Every call queued or running becomes an error result (invariant 3)."""
        with self._lock:
            queued = [item[0] for item in self._queue]
            self._queue.clear()
        running = []
        for w in self._workers:
            if w.state == "busy" and w.key:  # busy still: close kills it rather than asking it to stop
                running.append(w.key)
                w.key, w.deadline = "", math.inf
        for key in running + queued:
            self._finish(key, None, f"key {key!r}: {reason}")

    def _stop_workers(self) -> None:
        """Idle workers are asked to exit, the rest killed; every one reaped, its group killed."""
        for w in self._workers:
            w.ask_to_stop()
        for w in self._workers:
            w.stop()

    def _wake(self) -> None:
        """Wake the collector. Called holding the lock: ``close`` closes the pipe under it."""
        if self._wake_w < 0:
            return
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full: the collector is awake anyway
            pass

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
