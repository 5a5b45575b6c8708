"""The step gate: where a staged version meets the engine's step loop.

One ``StepGate`` per engine, shared by the EngineCore thread (which runs steps) and the
worker's listener thread (which asks for commits). They live in the same process because
in-flight engines run one worker (uniproc executor) inside EngineCore's process.

Ordering invariants:
- a whole engine step (schedule, forward, sample, label the outputs) runs under ``lock``;
- a commit runs under ``lock`` too, so no forward pass ever sees a half-applied update;
- the version label EngineCore attaches to a step's outputs is written at the start of
  that step, under the same lock, from ``live_version``, which only a commit moves. So the
  weights a token was sampled with and the tag it carries always agree;
- a requested commit runs at the earliest step boundary: at the start of the next step
  (engine thread) or as soon as the lock is free (listener thread, e.g. an idle engine),
  whichever comes first, exactly once.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from inflight.transport.listener import CommitInfo

# EngineCore.vllm_config.instance_id -> gate; read by the patched EngineCore.step.
_GATES: dict[str, StepGate] = {}


def gate_for(instance_id: str) -> StepGate | None:
    return _GATES.get(instance_id)


class _Pending:
    def __init__(self, version: int, apply: Callable[[], None]) -> None:
        self.version = version
        self.apply = apply
        self.done = threading.Event()
        self.info: CommitInfo | None = None
        self.error: BaseException | None = None


class StepGate:
    def __init__(self, instance_id: str, initial_version: int = 0) -> None:
        self.instance_id = instance_id
        self.lock = threading.Lock()
        self.live_version = initial_version
        self.steps = 0  # model steps completed; the label of step k+1 is set after k
        self._pending: _Pending | None = None
        self._slot = threading.Lock()  # guards _pending: taken once, by whichever thread runs it
        self._engine_core: Callable[[], Any] = lambda: None

    def register(self) -> None:
        if self.instance_id in _GATES:
            raise RuntimeError(f"an in-flight gate already serves engine {self.instance_id}")
        _GATES[self.instance_id] = self

    def unregister(self) -> None:
        _GATES.pop(self.instance_id, None)

    # -- engine thread --------------------------------------------------------------------
    @contextmanager
    def step(self, engine_core: Any):
        """Wrap one EngineCore step; yields a callback to report whether the model ran."""
        with self.lock:
            self._engine_core = weakref.ref(engine_core)
            self._run_pending_locked()
            engine_core._weight_version = str(self.live_version)
            executed = [False]
            yield lambda ran: executed.__setitem__(0, bool(ran))
            if executed[0]:
                self.steps += 1

    # -- listener thread ------------------------------------------------------------------
    def commit(self, version: int, apply: Callable[[], None], timeout_s: float) -> CommitInfo:
        """Run ``apply`` at the next step boundary and move the label to ``version``.

        ``apply`` must leave the previous weights live if it raises; the error is re-raised here.
        """
        pending = _Pending(version, apply)
        with self._slot:
            self._pending = pending
        # Take the lock ourselves too: an idle engine runs no step that would pick it up.
        if self.lock.acquire(timeout=timeout_s):
            try:
                self._run_pending_locked()
            finally:
                self.lock.release()
        if not pending.done.wait(timeout_s):
            with self._slot:
                if self._pending is pending:  # never started: withdraw it, nothing changed
                    self._pending = None
                    raise TimeoutError(f"commit of v{version} did not reach a step boundary within {timeout_s}s")
            pending.done.wait()  # already running under the lock: let it finish
        if pending.error is not None:
            raise pending.error
        assert pending.info is not None
        return pending.info

    def _run_pending_locked(self) -> None:
        with self._slot:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        try:
            pending.apply()
        except BaseException as e:  # reported to the listener, which keeps the old version live
            pending.error = e
        else:
            self.live_version = pending.version
            pending.info = CommitInfo(step=self.steps, commit_ms=1e3 * (time.perf_counter() - t0),
                                      tokens_at_commit=self._output_tokens())
        finally:
            pending.done.set()

    def _output_tokens(self) -> dict[str, int]:
        """Output tokens so far of every unfinished request, by the user's request id."""
        core = self._engine_core()
        if core is None:
            return {}
        # Worker-side ids are "<user id>-<8 random chars>" (vLLM 0.32 input processor).
        return {rid.rsplit("-", 1)[0]: req.num_output_tokens for rid, req in core.scheduler.requests.items()}
