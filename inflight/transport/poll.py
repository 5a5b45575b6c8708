"""The one wait loop of the transport: poll a condition with back-off until it holds.

Every wait on the store (a key, a roster, a generation, the engine's readiness) and on an
NCCL collective polls rather than blocks: a blocking ``store.wait`` logs a c10d warning on
every timeout, and NCCL's ``Work.wait`` does not block the host at all. Each such wait is
``poll_until``, so each has a deadline (or a ``stop`` event), a way to learn that what it
waits for will never come (``give_up``), and an error that says who waited for what.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from inflight.transport.errors import GaveUp, TransportTimeout

T = TypeVar("T")


def poll_until(ready: Callable[[], T | None], *, timeout_s: float | None, what: str, who: str,
               stop: threading.Event | None = None, give_up: Callable[[], bool] | None = None,
               first_pause_s: float = 0.0002, max_pause_s: float = 0.005, ask_every_s: float = 0.25) -> T:
    """Call ``ready()`` until it returns something other than None, and return that.

    Between calls it sleeps, doubling the pause from ``first_pause_s`` up to ``max_pause_s``
    (a quick answer is seen at once, a long wait costs little CPU). Raises
    ``TransportTimeout`` after ``timeout_s`` (None: no deadline), ``InterruptedError`` once
    ``stop`` is set, and ``GaveUp`` when ``give_up()``, asked every ``ask_every_s`` after a
    ``ready()`` that said no (a value that came is taken), says it will never come.
    Exceptions of ``ready`` and ``give_up`` propagate.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = first_pause_s
    next_ask = time.monotonic() + ask_every_s
    while True:
        value = ready()
        if value is not None:
            return value
        now = time.monotonic()
        if give_up is not None and now > next_ask:
            next_ask = now + ask_every_s
            if give_up():
                raise GaveUp(f"{who}: gave up waiting for {what}")
        if stop is not None and stop.is_set():
            raise InterruptedError(f"{who}: stopped while waiting for {what}")
        if deadline is not None and now > deadline:
            raise TransportTimeout(f"{who}: no {what} within {timeout_s:.1f}s")
        time.sleep(pause)
        pause = min(pause * 2, max_pause_s)



def call_beside(fn: Callable[[], T], wait: Callable[[Callable[[], bool | None]], object]) -> T:
    """``fn()`` (a blocking native call) on a helper thread, while ``wait`` polls whether it
    has returned (``wait(done)``, a ``poll_until`` with the caller's deadline, ``stop`` and
    ``give_up``); ``fn``'s result, or its error raised here. A call ``wait`` gives up on
    cannot be cancelled: it is left to end on its daemon thread, its result discarded."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    helper = threading.Thread(target=run, name="inflight-beside", daemon=True)
    helper.start()
    wait(lambda: None if helper.is_alive() else True)
    if "error" in box:
        raise box["error"]
    return box["value"]


def call_unless_stopped(fn: Callable[[], T], *, stop: threading.Event, what: str, who: str) -> T:
    """``fn()`` beside (``call_beside``) a wait that ``stop`` ends (``poll_until``'s
    ``InterruptedError``, naming ``what``): gloo's rendezvous, which cannot be cancelled."""
    return call_beside(fn, lambda done: poll_until(done, timeout_s=None, what=what, who=who, stop=stop))
