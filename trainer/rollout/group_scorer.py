"""Finished GRPO groups become scored ``RolloutGroup``s, off the engine's critical path.

The engine process's rollout loop hands every finished request (one group of ``n``
completions) to ``GroupScorer.submit`` and, every turn of its loop, takes back the groups
whose rewards came in (``collect``). Rewards are computed by ``task.score`` in
``inflight.trainer.rollout.scoring_pool.ScoringPool``'s worker processes (``task.scoring``): a slow verifier never
stops decoding, and one that raises, hangs past ``timeout_s``, exceeds its memory cap or
returns a reward that is not a finite number fails its group alone. A failed group is
logged (every failure, one line with the task, the group and the error, the task's
traceback after it), counted, and dropped, and the first of each kind is reported to the
trainer, which shows it; ``max_failed_in_a_row`` failures one after the other stop the run with the
last one's message (a fatal report: the trainer stops, the engine is not restarted). Groups
reach the queue in the order their scoring finishes; their tokens, log-probs and tags are
the engine's, untouched.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from inflight.protocol import EngineReport, RolloutGroup, RolloutSample, Sampling
from inflight.trainer.rollout.scoring_pool import ScoringPool
from inflight.trainer.rollout.scoring_worker import engine_task_factory

log = logging.getLogger("inflight.rollout")


class ScoringFailed(RuntimeError):
    """Scoring failed for ``task.scoring.max_failed_in_a_row`` groups one after the other."""


class GroupScorer:
    """One engine's scoring: finished requests in, scored ``RolloutGroup``s out."""

    def __init__(self, cfg: Any, model_dir: str, engine_id: str, sampling: Sampling,
                 ledger_path: Path | None = None) -> None:
        s = cfg.task.scoring
        self.cfg, self.engine_id, self.sampling = cfg, engine_id, sampling
        self.pool = ScoringPool(engine_task_factory(cfg, model_dir), workers=s.workers, timeout_s=s.timeout_s,
                                memory_mb=s.memory_mb, max_workers=s.max_workers)
        self.waiting: dict[str, tuple[Any, Any]] = {}  # request id -> (its finished output, its prompt)
        self.ledger_path = ledger_path
        """Where the ledger outlives this process (``<run.out_dir>/ledger-e<i>.json``): a restarted
        or resumed engine of the same index goes on counting from it. None: nowhere."""
        saved = json.loads(ledger_path.read_text()) if ledger_path is not None and ledger_path.exists() else {}
        self.scored, self.failed = int(saved.get("groups_scored", 0)), int(saved.get("groups_failed", 0))
        self.failed_in_a_row = 0
        self._kinds_logged: set[str] = set()
        self.on_report: Callable[[EngineReport], object] = lambda report: None
        """Where a failure's report goes besides the log: the engine's rollout queue, whose
        trainer shows it (the first of each kind) and stops the run on a fatal one."""

    def wait_ready(self) -> None:
        """Fail now, with the task's own error, if no worker can build the task."""
        self.pool.wait_ready()

    def __len__(self) -> int:
        """Groups submitted whose rewards have not come back."""
        return len(self.waiting)

    def decoding(self, requests: dict) -> int:
        """Groups on the engine, of its ``requests`` (request id -> prompt): one request each."""
        return len(requests)

    def submit(self, out: Any, prompt: Any) -> None:
        from inflight.trainer.tasks import Completion

        self.waiting[out.request_id] = (out, prompt)
        self.pool.submit(out.request_id, [prompt] * len(out.outputs),
                         [Completion(c.text, c.token_ids, c.finish_reason or "") for c in out.outputs])

    def collect(self) -> list[RolloutGroup]:
        """The groups scored since the last call (never waits); failed ones are logged and dropped."""
        results = self.pool.poll()
        try:
            return self._collect(results)
        finally:
            if results:
                self.save_ledger()

    def _collect(self, results: list) -> list[RolloutGroup]:
        groups = []
        for s in results:
            out, prompt = self.waiting.pop(s.key)
            if s.rewards is not None:
                self.scored += 1
                self.failed_in_a_row = 0
                groups.append(self.group_of(out, prompt, s.rewards))
                continue
            self.failed += 1
            self.failed_in_a_row += 1
            self._report(s.key, prompt, s.error, trace=s.trace)
        return groups

    def _report(self, key: str, prompt: Any, error: str, *, what: str = "", then: str = "the group is dropped",
                trace: str = "") -> None:
        """Every failure: one line in the engine's log naming the task, ``what`` failed (default:
        scoring group ``key``) and the error, the task's traceback after it; the first of each
        kind also to the trainer's console. Past ``max_failed_in_a_row`` in a row, the run stops."""
        error = re.sub(r"^key '[^']*': ", "", error)  # the pool's key is the group's id, named below
        kind = " ".join(error.split()[:3])  # "Faulty.score raised ValueError:"
        task = self.cfg.task.name
        line = (f"task {task}: {what} failed" if what else f"task {task} failed to score group {key}") + (
            f" (prompt {prompt.display[:80]!r}): {error}; {then}")
        log.warning("rollout: %s (%d failed so far, %d scored)%s", line, self.failed, self.scored,
                    f"\n{trace.rstrip()}" if trace else "")
        if kind not in self._kinds_logged:
            self._kinds_logged.add(kind)
            self.on_report(EngineReport(engine_id=self.engine_id, message=line))
        limit = self.cfg.task.scoring.max_failed_in_a_row
        if self.failed_in_a_row >= limit:
            message = (f"task {task}: " + (f"{limit} episodes failed in a row" if what else
                                             f"scoring failed for {limit} groups in a row")
                       + f" (task.scoring.max_failed_in_a_row); the last, {what or f'group {key}'}: {error}")
            self.on_report(EngineReport(engine_id=self.engine_id, message=message, fatal=True))
            raise ScoringFailed(message)

    def group_of(self, out: Any, prompt: Any, rewards: Sequence[float]) -> RolloutGroup:
        """A finished request's completions, tagged, with their rewards."""
        from inflight.engine.client import tagged
        from inflight.engine.routing import routing_fields

        samples = []
        for i, completion in enumerate(out.outputs):
            t = tagged(completion)
            routing = routing_fields(completion) if self.cfg.loss.routing_replay else {}
            samples.append(RolloutSample(
                sample_id=f"{out.request_id}-{i}", group_id=out.request_id, prompt_ids=list(out.prompt_token_ids),
                token_ids=t.token_ids, logprobs=t.logprobs, versions=t.versions, reward=float(rewards[i]),
                hybrid_tokens=sum(">" in s for s in t.labels),
                finish_reason=t.finish_reason or "", prompt_text=prompt.display, completion_text=t.text, **routing))
        return RolloutGroup(group_id=out.request_id, samples=tuple(samples), engine_id=self.engine_id,
                            sampling=self.sampling, engine_ledger=self.ledger())

    def ledger(self) -> dict[str, int]:
        """Groups scored and failed so far (``RolloutGroup.engine_ledger``)."""
        return {"groups_scored": self.scored, "groups_failed": self.failed}

    def save_ledger(self) -> None:
        """``ledger()`` to ``ledger_path``, atomically (a kill leaves the last whole one)."""
        if self.ledger_path is None:
            return
        tmp = self.ledger_path.with_name(self.ledger_path.name + ".tmp")
        tmp.write_text(json.dumps(self.ledger()))
        os.replace(tmp, self.ledger_path)

    def close(self) -> None:
        self.pool.close()
