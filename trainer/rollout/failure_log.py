"""Every rollout failure said once where a person looks: a line in the engine's log, the
first of each kind on the trainer's console, and a stop past ``task.scoring.max_failed_in_a_row``."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from inflight.protocol import EngineReport

log = logging.getLogger("inflight.rollout")


class ScoringFailed(RuntimeError):
    """Scoring failed for ``task.scoring.max_failed_in_a_row`` groups one after the other."""


class FailureLog:
    """One engine's failures: ``report`` each; the run stops after too many in a row."""

    def __init__(self, cfg: Any, engine_id: str) -> None:
        self.cfg, self.engine_id = cfg, engine_id
        self.in_a_row = 0
        self._kinds: set[str] = set()
        self.on_report: Callable[[EngineReport], object] = lambda report: None
        """Where a failure's report goes besides the log: the engine's rollout queue, whose
        trainer shows it (the first of each kind) and stops the run on a fatal one."""

    def success(self) -> None:
        self.in_a_row = 0

    def report(self, error: str, prompt: Any, *, group: str, episode: str = "", then: str, trace: str = "",
               so_far: str = "") -> None:
        """One failure: a line in the engine's log naming the task, what failed (``episode``, as
        "<group>.<k> (turn N)"; without one, the scoring of ``group``) and the error, the task's
        traceback after it; the first of each kind also to the trainer's console. Past
        ``max_failed_in_a_row`` in a row, a fatal report and ``ScoringFailed``."""
        self.in_a_row += 1
        error = re.sub(r"^key '[^']*': ", "", error)  # the pool's key is named below
        kind = " ".join(error.split()[:3])  # "Faulty.score raised ValueError:"
        task = self.cfg.task.name
        said = f"task {task}: episode {episode} failed" if episode else f"task {task} failed to score group {group}"
        line = f"{said} (prompt {prompt.display[:80]!r}): {error}; {then}"
        log.warning("rollout: %s (%s)%s", line, so_far, f"\n{trace.rstrip()}" if trace else "")
        if kind not in self._kinds:
            self._kinds.add(kind)
            self.on_report(EngineReport(engine_id=self.engine_id, message=line))
        limit = self.cfg.task.scoring.max_failed_in_a_row
        if self.in_a_row >= limit:
            message = (f"task {task}: " + (f"{limit} episodes failed in a row" if episode else
                                             f"scoring failed for {limit} groups in a row")
                       + " (task.scoring.max_failed_in_a_row); the last, "
                       + (f"episode {episode}" if episode else f"group {group}") + f": {error}")
            self.on_report(EngineReport(engine_id=self.engine_id, message=message, fatal=True))
            raise ScoringFailed(message)
