"""``FailureLog``: ``task.scoring.max_failed_in_a_row`` counts groups, as documented, and the
console's line names the file and line of the task's code that raised."""

from __future__ import annotations

import asyncio.tasks
import traceback

import pytest

from inflight.trainer.config_files import config_from_dict
from inflight.trainer.rollout.failure_log import FailureLog, ScoringFailed, raised_at
from inflight.trainer.tasks.task import Prompt


def _log(limit: int) -> tuple[FailureLog, list]:
    log = FailureLog(config_from_dict({"task": {"scoring": {"max_failed_in_a_row": limit}}}), "e0")
    reports: list = []
    log.on_report = reports.append
    return log, reports


def _episode(log: FailureLog, group: str, k: int) -> None:
    log.report("boom", Prompt("q"), group=group, episode=f"{group}.{k} (turn 1)", then="its group is dropped")


def test_max_failed_in_a_row_counts_groups_not_episodes() -> None:
    """Three failed episodes of two groups are two groups in a row (limit 3: no stop); a group
    that finishes clean starts the count again; three groups failing in a row stop the run,
    named in groups. A group that ships with a failed episode (on_failure = "reward") does not
    reset the count."""
    log, reports = _log(3)
    _episode(log, "a", 0)
    _episode(log, "a", 1)
    _episode(log, "b", 0)
    assert log.in_a_row == 2 and not any(r.fatal for r in reports)
    log.finished("b")  # b shipped with its failed episode: still a failed group
    assert log.in_a_row == 2
    log.finished("c")  # c had none
    assert log.in_a_row == 0
    _episode(log, "d", 0)
    _episode(log, "e", 0)
    _episode(log, "e", 1)
    with pytest.raises(ScoringFailed, match=r"3 groups failed in a row \(task.scoring.max_failed_in_a_row\); "
                                            r"the last, episode f.0 \(turn 1\): boom"):
        _episode(log, "f", 0)
    assert [r.fatal for r in reports] == [False, True]  # the first of its kind, then the stop


def _raise_here() -> None:
    raise ValueError("the rubric raised")


def test_the_console_line_names_the_file_and_line_that_raised() -> None:
    """The first failure of a kind reaches the console (``EngineReport``) with ``file:line in
    function`` of the innermost frame of the task's own code in its traceback; frames of the
    installed packages below it (verifiers, asyncio) are passed over."""
    try:
        _raise_here()
    except ValueError:
        trace = traceback.format_exc()
    library = f'  File "{asyncio.tasks.__file__}", line 277, in __step\n    result = coro.send(None)\n'
    line = _raise_here.__code__.co_firstlineno + 1
    assert raised_at(trace + library) == f"tests/unit/test_failure_log.py:{line} in _raise_here"
    log, reports = _log(5)
    log.report("verifiers environment 'calc': RuntimeError: the rubric raised", Prompt("q"), group="g",
               episode="g.0 (turn 2)", then="its group is dropped", trace=trace)
    assert reports[0].message == ("task repeat_digit: episode g.0 (turn 2) failed (prompt 'q'): verifiers environment "
                                  "'calc': RuntimeError: the rubric raised (at tests/unit/test_failure_log.py:"
                                  f"{line} in _raise_here); its group is dropped")
    assert raised_at("no traceback") == ""
