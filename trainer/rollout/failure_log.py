"""Every rollout failure said once where a person looks: a line in the engine's log, the
first of each kind on the trainer's console (naming the file and line of the task's code that
raised), and a stop past ``task.scoring.max_failed_in_a_row`` groups failed one after the other.

A group counts once, at its first failed episode (or its failed scoring); a group that
finishes with none resets the count."""

from __future__ import annotations

import logging
import os
import re
import sys
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
        """Groups failed one after the other."""
        self._streak: set[str] = set()
        """The groups the count holds."""
        self._kinds: set[str] = set()
        self.on_report: Callable[[EngineReport], object] = lambda report: None
        """Where a failure's report goes besides the log: the engine's rollout queue, whose
        trainer shows it (the first of each kind) and stops the run on a fatal one."""

    def finished(self, group: str) -> None:
        """``group`` finished: without a failed episode, the count starts again."""
        if group in self._streak:
            self._streak.discard(group)
        else:
            self.in_a_row, self._streak = 0, set()

    def report(self, error: str, prompt: Any, *, group: str, episode: str = "", then: str, trace: str = "",
               so_far: str = "") -> None:
        """One failure: a line in the engine's log naming the task, what failed (``episode``, as
        "<group>.<k> (turn N)"; without one, the scoring of ``group``) and the error, the task's
        traceback after it; the first of each kind also to the trainer's console. Past
        ``max_failed_in_a_row`` groups in a row, a fatal report and ``ScoringFailed``."""
        if group not in self._streak:
            self._streak.add(group)
            self.in_a_row += 1
        error = re.sub(r"^key '[^']*': ", "", error)  # the pool's key is named below
        kind = " ".join(error.split()[:3])  # "Faulty.score raised ValueError:"
        task = self.cfg.task.name
        said = f"task {task}: episode {episode} failed" if episode else f"task {task} failed to score group {group}"
        where = raised_at(trace)
        line = f"{said} (prompt {prompt.display[:80]!r}): {error}" + (f" (at {where})" if where else "") + f"; {then}"
        log.warning("rollout: %s (%s)%s", line, so_far, f"\n{trace.rstrip()}" if trace else "")
        if kind not in self._kinds:
            self._kinds.add(kind)
            self.on_report(EngineReport(engine_id=self.engine_id, message=line))
        limit = self.cfg.task.scoring.max_failed_in_a_row
        if self.in_a_row >= limit:
            message = (f"task {task}: " + (f"{limit} groups failed in a row" if episode else
                                             f"scoring failed for {limit} groups in a row")
                       + " (task.scoring.max_failed_in_a_row); the last, "
                       + (f"episode {episode}" if episode else f"group {group}") + f": {error}")
            self.on_report(EngineReport(engine_id=self.engine_id, message=message, fatal=True))
            raise ScoringFailed(message)


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)', re.MULTILINE)


def raised_at(trace: str) -> str:
    """``file:line in function`` of the frame that raised in the traceback text ``trace``: the
    innermost frame of the task's own code (outside the Python installation and its
    packages), else the innermost; "" without one. A file under the working directory is
    named relative to it."""
    frames = _FRAME.findall(trace or "")
    if not frames:
        return ""
    installed = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    own = [f for f in frames if not os.path.realpath(f[0]).startswith(installed) and not f[0].startswith("<")]
    path, line, function = (own or frames)[-1]
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:  # another drive
        pass
    return f"{path}:{line} in {function}"
