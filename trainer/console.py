"""The run's console: one progress bar, each warning once, the engines' output in files.

A spawned engine writes to ``<run.out_dir>/engine<i>.log`` rather than the trainer's console:
vLLM logs every step of its start-up and repeats some warnings per step, which would bury the
training bar. The trainer's own process shows no library progress bars and each distinct
warning once; errors always reach the console.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from tqdm import tqdm

_NUMBER = re.compile(r"\d+")


class OncePerMessage(logging.Filter):
    """Lets each distinct warning through once. Messages that differ only in their numbers (a
    step, a process id, a source line) are the same warning: an ESS warning of every step, or
    one library notice per engine step, would otherwise fill the screen. Errors always pass."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        # the first line: a captured Python warning's second line is the source line that raised it
        key = (record.name, record.levelno, _NUMBER.sub("#", record.getMessage().partition("\n")[0]))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class _ConsoleHandler(logging.Handler):
    """stderr, through ``tqdm.write``: a warning printed mid-run goes above the bar, not into it."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(logging.BASIC_FORMAT))  # what logging.basicConfig prints
        self.addFilter(OncePerMessage())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record).rstrip("\n"), file=sys.stderr)  # a captured warning ends in one
        except Exception:
            self.handleError(record)


def quiet_libraries() -> None:
    """This process's console: no progress bars of Hugging Face libraries (their loading and
    saving bars would stack under the training bar), Python warnings and transformers' logs
    through logging, and one root handler that prints each distinct warning once (it replaces
    a plain stream handler of ``logging.basicConfig``, so nothing prints twice, and the one a
    previous call added, so each run shows its own warnings)."""
    # read at import: covers the processes started from this one (engines, their workers)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import huggingface_hub.utils
    import transformers.utils.logging as hf_logging

    huggingface_hub.utils.disable_progress_bars()  # this process, which may have imported them already
    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()  # transformers prints through its own handler, past any filter
    hf_logging.enable_propagation()
    logging.captureWarnings(True)
    root = logging.getLogger()
    # exactly these types: not pytest's capture handlers (StreamHandler subclasses), nor a file's
    for h in [h for h in root.handlers if type(h) in (logging.StreamHandler, _ConsoleHandler)]:
        root.removeHandler(h)
    root.addHandler(_ConsoleHandler())


def engine_log(out_dir: str | Path, index: int) -> Path:
    """Where spawned engine ``index`` of the run in ``out_dir`` writes its output."""
    return Path(out_dir) / f"engine{index}.log"


def log_to_file(path: str | Path, title: str) -> None:
    """Point this process's stdout and stderr at ``path`` (appended, after a ``title`` line).

    At the file descriptors, not ``sys.stdout``: C++ warnings of torch, and the worker
    processes a tensor parallel engine starts, write to descriptors 1 and 2 directly. Call it
    before vLLM is imported: its import already logs."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # appends from several processes interleave whole
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # line by line: the lines before a crash reach the file
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    print(f"--- {title}, {time.strftime('%Y-%m-%d %H:%M:%S')} ---")


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of the log at ``path``, indented ("" if it has none). A progress
    bar's line is its last redraw."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    kept = [s for line in text.split("\n") if (s := line.rpartition("\r")[2].rstrip())]
    return "\n".join("    " + s for s in kept[-lines:])


def last_error(path: Path) -> str:
    """The last line of the log at ``path`` that reads as an error (a Python exception's
    ``SomeError: ...`` line, or one that says error), else its last line; "" without one."""
    lines = [line.strip() for line in log_tail(path, lines=200).split("\n") if line.strip()]
    for line in reversed(lines):
        if _ERROR.search(line):
            return line
    return lines[-1] if lines else ""


_ERROR = re.compile(r"\b\w*(Error|Exception)\b:|\berror\b", re.IGNORECASE)


class Interrupt:
    """Ctrl-C in the training loop: the first asks the loop to stop after the step it is in
    (``asked``; the run then leaves its checkpoint, plot and summary as at its end); a second
    stops at once. Installed from the main thread only (elsewhere Ctrl-C is the caller's)."""

    def __init__(self) -> None:
        self.asked = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.asked:
            self.restore()
            raise KeyboardInterrupt
        self.asked = True
        tqdm.write("inflight: Ctrl-C: stopping after this step, with a checkpoint, the plot and the summary "
                   "(Ctrl-C again: stop at once)")

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


class BarText:
    """The training bar's text after the step counts: mean reward and samples trained per wall
    second over the last ``window`` steps, the last row's mean lag and engine stall (the
    commit of the push that landed last; "-" before the first), its step time with the share
    spent waiting for rollouts and its peak resident memory, and the failed episodes so far
    once there are any (a single-turn group that fails is its K episodes)."""

    def __init__(self, group_size: int, window: int = 20) -> None:
        self.group_size = group_size
        self.marks: deque[tuple[float, int]] = deque([(time.perf_counter(), 0)], maxlen=window + 1)
        """(time, samples trained so far) at the loop's start and after each of the last steps."""
        self.rewards: deque[float] = deque(maxlen=window)

    def __call__(self, row: dict[str, Any]) -> str:
        self.rewards.append(row["reward_mean"])
        self.marks.append((time.perf_counter(), self.marks[-1][1] + len(row["group_ids"]) * self.group_size))
        (t0, n0), (t1, n1) = self.marks[0], self.marks[-1]
        stall = row.get("stall_ms")
        failed = row.get("rollout_episodes_failed", 0)  # a group's failure is its episodes'; counted once
        step_ms = row.get("step_ms", 0.0)
        return (f"reward {sum(self.rewards) / len(self.rewards):.2f} lag {row['lag_mean']:.1f} "
                f"stall {'-' if stall is None else f'{stall:.1f}ms'} {(n1 - n0) / max(t1 - t0, 1e-9):.1f} samples/s "
                f"step {1e-3 * step_ms:.1f}s (wait {100 * row.get('wait_ms', 0.0) / max(step_ms, 1e-9):.0f}%) "
                f"peak {row.get('peak_rss_gb', 0.0):.1f}GB" + (f" failed {failed}" if failed else ""))
