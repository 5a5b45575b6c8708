"""The worker side of ``inflight.trainer.rollout.scoring_pool``: what runs in a scoring process, and the engine's
handle on one.

Design. ``workers`` processes, each a fresh interpreter (``sys.executable -c``, the
engine's ``sys.path`` sent first: what ``spawn`` does; the engine, which holds vLLM's
threads, is never forked) in a process group of its own. Not ``multiprocessing``'s
``spawn`` context itself: the trainer starts a TP=1 engine as a daemonic
``multiprocessing`` process, which may not have ``multiprocessing`` children, and each
spawned child would re-import the engine's ``__main__`` (torch with it) before scoring. A
worker unpickles ``make_task`` (importing its modules), caps its address space
(``RLIMIT_AS``, ``memory_mb``), then builds its task once with ``make_task()``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import multiprocessing
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Set
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from inflight.trainer.tasks.episode import check_turn
from inflight.trainer.tasks.task import Task, Turn

if TYPE_CHECKING:
    from inflight.trainer.config import TrainConfig

log = logging.getLogger("inflight.scoring")

WAKE_S = 0.05
"""The longest the collector blocks before it looks at deadlines again."""
JOIN_S = 2.0
TRACE_CHARS = 4000
"""The most of a task's traceback a result carries (its end: the frames that raised)."""
"""How long a stopped or killed worker gets to exit before it is killed (again)."""


class Scored(msgspec.Struct, frozen=True):
    """One submission's outcome: ``rewards`` (one per completion, finite), or for a turn
    (``ScoringPool.submit_turn``) the environment's ``turn``; else ``error``."""

    key: str
    rewards: list[float] | None
    error: str = ""
    turn: Any = None
    """A ``inflight.trainer.tasks.episode.Turn``."""
    trace: str = ""
    """The task's traceback, when ``error`` is an exception it raised (for the engine's log)."""
    cancelled: bool = False
    """``ScoringPool.cancel`` took it out, queued or running."""

    @property
    def ok(self) -> bool:
        return self.rewards is not None or self.turn is not None


# -- checks shared by both sides ---------------------------------------------------------------
def check_rewards(rewards: Any, n: int) -> list[float]:
    """``rewards`` as ``n`` finite floats; ValueError naming what is wrong (and where) otherwise."""
    try:
        if isinstance(rewards, (str, bytes, Mapping, Set)) or not hasattr(rewards, "__iter__"):
            raise TypeError
        length = len(rewards)
    except TypeError:  # a string, a mapping, a set, a generator, a 0-d array, ...
        raise ValueError(f"{_short(rewards)} ({type(rewards).__name__}), not a list of {n} floats") from None
    if length != n:
        raise ValueError(f"{length} rewards for {n} completions")
    out = []
    for i, x in enumerate(rewards):
        if x is None or isinstance(x, (str, bytes)) or not hasattr(x, "__float__"):
            raise ValueError(f"reward [{i}] is {_short(x)} ({type(x).__name__}), not a number")
        try:
            value = float(x)
        except (TypeError, ValueError) as e:
            raise ValueError(f"reward [{i}] is {_short(x)} ({type(x).__name__}), not a number ({e})") from None
        if not math.isfinite(value):
            raise ValueError(f"reward [{i}] is {value!r}: NaN and inf are not rewards")
        out.append(value)
    return out


def _short(x: Any, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def check_settings(make_task: Any, workers: Any, timeout_s: Any, memory_mb: Any, start_timeout_s: Any,
                   max_workers: Any = None) -> None:
    """ValueError naming the first bad setting."""
    if not callable(make_task):
        raise ValueError(f"make_task={make_task!r} is not callable (a factory returning a Task)")
    try:
        pickle.dumps(make_task)
    except Exception as e:
        raise ValueError(f"make_task={make_task!r} cannot be pickled for a worker process ({type(e).__name__}: "
                         f"{first_line(e)}): use a module-level function, or functools.partial of one") from None
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} must be an int >= 1")
    if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(max_workers, int)
                                    or max_workers < workers):
        raise ValueError(f"max_workers={max_workers!r} must be an int >= workers={workers}")
    for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")
    if memory_mb is not None and (isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 64):
        raise ValueError(f"memory_mb={memory_mb!r} must be None (no cap) or an int >= 64 (MiB of address space)")


# -- the worker process ------------------------------------------------------------------------
BOOT = """\
import sys
from multiprocessing.connection import Connection
conn = Connection({fd})
sys.path[:], boot = conn.recv()
from inflight.trainer.rollout.scoring_worker import _worker_main
_worker_main(conn, boot)
"""
"""What a worker's fresh interpreter runs: the engine's ``sys.path`` first, then the loop."""


def _worker_main(conn: Connection, boot: bytes) -> None:
    """A scoring worker: the memory cap, the task built once; then it answers
    ``(key, pickled call)`` calls (``_score``) until None or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's: it closes the pool
    memory_mb, parent_pid, factory = pickle.loads(boot)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="scoring-parent-watch", daemon=True).start()
    try:  # imports the factory's modules: before the cap, as the engine's own imports are
        make_task: Callable[[], Task] | None = pickle.loads(factory)
        build_error = ""
    except Exception as e:
        make_task = None
        build_error = f"make_task could not be loaded in the worker ({type(e).__name__}: {first_line(e)})"
    if memory_mb is not None:
        soft, hard = memory_mb << 20, resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    task = None
    if make_task is not None:
        task, build_error = _build(make_task, memory_mb)
    conn.send(("ready", build_error))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        key, data = message
        result, error, trace = _score(task, build_error, key, data, memory_mb)
        conn.send(("result", key, result, error, trace))


def _watch_parent(parent_pid: int) -> None:
    """Take the worker (and its group) down once the engine process is gone, even mid-call."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(0)


def _build(make_task: Callable[[], Task], memory_mb: int | None) -> tuple[Task | None, str]:
    try:
        task = make_task()
    except MemoryError:
        return None, f"make_task() ran out of memory under memory_mb={memory_mb} MiB"
    except Exception as e:
        return None, f"make_task() raised {type(e).__name__}: {first_line(e)}"
    if not callable(getattr(task, "score", None)):
        return None, f"make_task() returned {type(task).__name__}, which has no score()"
    return task, ""


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _score(task: Task | None, build_error: str, key: str, data: bytes,
           memory_mb: int | None) -> tuple[list[float] | Turn | None, str, str]:
    """One call, ``("score", prompts, completions)`` or ``("turn", episode)``: (its result,
    or an error string that names the key; the task's traceback when it raised)."""
    if task is None:
        return None, f"key {key!r}: {build_error}", ""
    try:
        kind, *args = pickle.loads(data)
    except Exception as e:
        return None, f"key {key!r}: the worker could not unpickle the call ({type(e).__name__}: {first_line(e)})", ""
    method = f"{type(task).__name__}.{kind}"
    try:
        out = task.turn(*args) if kind == "turn" else task.score(*args)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
    except MemoryError:
        cap = "no memory_mb cap" if memory_mb is None else f"the worker's cap of memory_mb={memory_mb} MiB"
        return None, f"key {key!r}: {method} ran out of memory (MemoryError) under {cap}", ""
    except (Exception, asyncio.CancelledError) as e:
        return (None, f"key {key!r}: {method} raised {type(e).__name__}: {first_line(e)}",
                traceback.format_exc()[-TRACE_CHARS:])
    try:
        return (check_turn(out, last=args[0].last) if kind == "turn" else check_rewards(out, len(args[1]))), "", ""
    except ValueError as e:
        return None, f"key {key!r}: {method} returned {e}", ""


# -- the engine's side -------------------------------------------------------------------------
WorkerState = Literal["starting", "idle", "busy", "down"]
LIVE: tuple[WorkerState, ...] = ("starting", "idle", "busy")


@dataclass(eq=False)
class WorkerProcess:
    """One slot's process, as the collector sees it. ``down``: it could not start (``error``
    says why); it is restarted when calls wait (``inflight.trainer.rollout.scoring_pool`` invariant 7)."""

    slot: int
    proc: subprocess.Popen[bytes]
    conn: Connection
    exit_fd: int | None
    """A pidfd, readable once the process has exited (None: no pidfd here; polled instead)."""
    started: float
    state: WorkerState = "starting"
    key: str = ""
    deadline: float = math.inf
    error: str = ""
    """Alive: why ``make_task`` failed (every call fails with it). Down: why it did not start."""

    @classmethod
    def start(cls, slot: int, boot: bytes) -> WorkerProcess:
        """A fresh interpreter (never a fork of the engine), in a process group of its own; its
        end of the pipe is the only descriptor it inherits. ``boot``: the pool's pickled
        (memory cap, engine pid, pickled ``make_task``)."""
        parent, child = multiprocessing.Pipe(duplex=True)
        try:
            proc = subprocess.Popen([sys.executable, "-c", BOOT.format(fd=child.fileno())], pass_fds=(child.fileno(),),
                                    stdin=subprocess.DEVNULL, process_group=0)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()  # the worker holds its end: its exit closes the pipe
        w = cls(slot, proc, parent, pidfd(proc.pid), time.monotonic())
        try:
            parent.send((list(sys.path), boot))
        except OSError:
            pass  # it is gone already: its exit says how
        return w

    def ask_to_stop(self) -> None:
        """An idle worker is asked to exit; a starting or busy one is killed."""
        if self.state == "idle":
            try:
                self.conn.send(None)
            except (OSError, ValueError):
                pass
        elif self.state != "down":
            self.kill()

    def stop(self) -> None:
        """Reap it (killed if it does not exit within ``JOIN_S``), kill what its verifier left in
        its group, close its pipe: ``down``."""
        if self.state == "down":
            return
        if self.reap(JOIN_S) is None:
            self.kill()
            self.reap(JOIN_S)
        self.kill()
        self.release()
        self.state = "down"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL its process group: the worker and whatever its verifier started."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is gone already
            self.proc.kill()  # a no-op once it is reaped

    def reap(self, timeout_s: float) -> int | None:
        """Its exit code once it has exited within ``timeout_s``, else None."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def release(self) -> None:
        self.conn.close()
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None


def describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code (it closed its pipe but kept running; killed)"
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = ", as the kernel's OOM killer sends" if -code == signal.SIGKILL else ""
    return f"exit code {code} ({name}{hint})"


def pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: the collector polls the process instead
        return None


# -- the engine's task, in a worker ----------------------------------------------------------
def engine_task(cfg: TrainConfig, model_dir: str) -> Task:
    """The task ``cfg`` names, as the engine builds it (``build_task``), the tokenizer read from
    ``model_dir``; the built-in tasks that need none (arithmetic, jsonl) get None and the
    worker never imports transformers."""
    from inflight.trainer.envs import build_task

    tokenizer = None
    if cfg.task.name not in ("arithmetic", "jsonl"):
        from transformers import AutoTokenizer

        from inflight.trainer.tasks.tool_calls import use_chat_template

        tokenizer = use_chat_template(AutoTokenizer.from_pretrained(str(model_dir)), cfg.task.chat_template)
    return build_task(cfg, tokenizer)


def engine_task_factory(cfg: TrainConfig, model_dir: str) -> Callable[[], Task]:
    """``make_task`` for the engine's pool: ``ScoringPool(engine_task_factory(cfg, model_dir))``."""
    return functools.partial(engine_task, cfg, str(model_dir))
