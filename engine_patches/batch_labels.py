"""Version labels per batch, for engines whose batches outlive a step (async scheduling).

Under async scheduling vLLM 0.32 runs ``EngineCore.step_with_batch_queue``: each call
schedules batch t+1, dispatches its forward and its sampling, and only then takes batch t
off the queue, processes its output and stamps it with the engine's weight version
(``_attach_weight_version``, which vLLM documents as changing only while paused). A commit
lands at the start of a call, on the engine thread, under the coordinator's step lock: on
every worker it sits between ``sample_tokens(t)`` and ``execute_model(t+1)`` (the ``uni``
executor runs both inline; the ``mp`` executor hands the commit's ``collective_rpc`` to each
worker behind them in one ordered queue), so batch t was computed by the old weights and
batch t+1 by the new ones. But batch t's output is processed after the commit: stamped with
the label of the moment, it would carry the new label.

``BatchLabels`` stamps each batch with the label of the weights that computed it instead:
the batch queue becomes a ``LabelledQueue``, which records the label live when a batch
enters it (after its forward was dispatched, after any commit of that call) and hands that
label to ``attach`` when the batch leaves. Engines that step one batch at a time
(``EngineCore.step``) have no batch queue and keep vLLM's own stamping.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class LabelledQueue(deque):
    """vLLM's batch queue (a ``deque`` of (future, scheduler output, execute future)), each
    entry remembered with the label live when it entered. vLLM only ``appendleft``s, ``pop``s,
    takes ``len`` and truth of it."""

    def __init__(self, entries: Any, maxlen: int | None, label_of: Any) -> None:
        super().__init__(entries, maxlen)
        self._label_of = label_of
        self._labels: deque[str] = deque(label_of() for _ in range(len(self)))
        self.popped: str | None = None
        """The label of the batch last taken off the queue, until ``attach`` uses it."""

    def appendleft(self, entry: Any) -> None:
        super().appendleft(entry)
        self._labels.appendleft(self._label_of())

    def pop(self) -> Any:
        entry = super().pop()
        self.popped = self._labels.pop()
        return entry

    def clear(self) -> None:
        super().clear()
        self._labels.clear()


class BatchLabels:
    """Installs a ``LabelledQueue`` on an ``EngineCore`` that has a batch queue, and stamps each
    processed batch's outputs with its own label (see the module docstring)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        queue = core.batch_queue
        self.queue = None if queue is None else LabelledQueue(queue, queue.maxlen, lambda: core._weight_version)

    def install(self) -> None:
        """Replace the queue and the stamping on this ``EngineCore`` instance (vLLM 0.32.0's
        ``batch_queue`` and ``_attach_weight_version``); nothing on an engine without a queue."""
        if self.queue is None:
            return
        self.core.batch_queue = self.queue
        self.core._attach_weight_version = self.attach

    def attach(self, outputs: dict[int, Any]) -> None:
        """``EngineCore._attach_weight_version`` for the batch just taken off the queue."""
        label, self.queue.popped = self.queue.popped, None  # installed only where there is a queue
        for eco in outputs.values():
            eco.weight_version = self.core._weight_version if label is None else label
