"""Multi-turn episodes on the in-flight engine: one request per turn, the environment off the engine thread.

The engine process's rollout loop drives an ``EpisodeTask`` through ``EpisodeRollout``
(in place of ``inflight.trainer.rollout.group_scorer.GroupScorer``, whose interface it keeps)::

    start_group(gid, prompt, ids) --> K episodes, each a request "gid.k.0" (n = 1, the same
                                      prompt: the prefix cache prefills it once)
    engine step: turn finished    --> submit(out): reply tokens, tags and log-probs appended
                                      to its Transcript; EpisodeTask.turn queued in the
                                      scoring processes (timeout, memory cap); decoding goes on
    collect(), every loop turn    --> observation: its tokens appended (masked), request
                                      "gid.k.<turn+1>" continues the episode's token ids
                                  --> done: the episode's reward; once all K are done, the
                                      group is a RolloutGroup (one sample per episode)
                                  --> failed (raised, hung, garbage, out of budget): logged and
                                      counted; the group is dropped or the episode rewarded
                                      ``failure_reward`` (``task.episode.on_failure``)

Every token keeps the version that sampled it; an episode spans as many commits as happen
while it runs (its tools included). ``counts`` is the episode ledger: every episode started
is, at any moment, exactly one of running, finished, failed or dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.protocol import RolloutGroup, RolloutSample, Sampling
from inflight.trainer.rollout.episode_journal import EpisodeJournal
from inflight.trainer.rollout.group_scorer import GroupScorer
from inflight.trainer.tasks.episode import ObservationRenderer, Transcript, Turn
from inflight.trainer.tasks.tool_calls import ToolCallParser

log = logging.getLogger("inflight.rollout")

AddRequest = Callable[[str, Any, list[int], int], None]
"""``(request_id, prompt, token_ids, max_tokens)``: start one turn on the engine."""
AbortRequests = Callable[[list[str]], None]


@dataclass
class EpisodeGroup:
    """K episodes of one opening prompt: a GRPO group."""

    prompt: Any
    episodes: list[Transcript]
    done: list[bool]
    decoding: set[str] = field(default_factory=set)
    """Request ids of its turns on the engine now."""
    failed: str = ""
    """The first failure of an episode, when it drops the group."""


class EpisodeRollout(GroupScorer):
    """One engine's episodes: turns in, environment calls out, finished groups back."""

    def __init__(self, cfg: Any, model_dir: str, engine_id: str, sampling: Sampling, tokenizer: Any,
                 add_request: AddRequest, abort: AbortRequests, journal: Path | None = None) -> None:
        super().__init__(cfg, model_dir, engine_id, sampling)  # no ledger file: the journal holds the ledger
        if cfg.loss.routing_replay:
            raise ValueError(f"task.name={cfg.task.name!r} is a multi-turn task: loss.routing_replay does not "
                             "cover the environment's tokens between turns (set loss.routing_replay=false)")
        self.episode_cfg = cfg.task.episode
        self.renderer = ObservationRenderer(tokenizer, cfg.task.chat)
        self.tool_calls = ToolCallParser(cfg.task.tool_parser, tokenizer) if cfg.task.tool_parser else None
        """Reads each reply's tool calls into ``EpisodeView.tool_calls`` (``task.tool_parser``)."""
        self.add_request, self.abort = add_request, abort
        self.max_model_len = cfg.engine.max_model_len
        self.groups: dict[str, EpisodeGroup] = {}
        self.counts = {"started": 0, "finished": 0, "failed": 0, "dropped": 0, "shipped": 0, "groups_scored": 0,
                       "groups_failed": 0, "resumed": 0, "turns_cancelled": 0}
        """The episode ledger, over every process of this engine index: started = running +
        finished + failed + dropped; ``shipped``: the episodes of the groups that went to the
        queue (finished ones, and failed ones under on_failure = "reward"); ``resumed``: those
        an earlier process left running that this one took on; ``turns_cancelled``: environment
        turns of dropped groups taken out of the scoring processes, queued or running."""
        self.journal = EpisodeJournal(journal) if journal is not None else None
        self._recovered = self.journal.read() if self.journal is not None else None
        if self._recovered is not None:
            self.counts.update(self._recovered.counts)  # the ledger goes on across the engine's processes
        self.scored, self.failed = self.counts["groups_scored"], self.counts["failed"]

    # -- what the rollout loop calls ---------------------------------------------------------
    def resume(self) -> None:
        """Take on the episodes an earlier process of this engine left in its journal
        (``task.episode.on_restart``); call once the engine takes requests."""
        recovered, self._recovered = self._recovered, None
        if recovered is None or self.journal is None:
            return
        for gid, group in recovered.groups.items():
            running = [k for k, done in enumerate(group.done) if not done]
            if self.episode_cfg.on_restart == "drop":
                self.counts["dropped"] += len(running)
                self.journal.leave(gid, self.counts)
                log.warning("rollout: group %s dropped on restart with %d episodes running (task.episode.on_restart)",
                            gid, len(running))
                continue
            group.decoding = set()
            self.groups[gid] = group
            self.counts["resumed"] += len(running)
            for k in running:
                e = group.episodes[k]
                if e.turns > len(e.observations):  # its environment's answer was lost with the process: ask again
                    self.pool.submit_turn(f"{gid}.{k}.{e.turns - 1}", e.view(last=self._last(e)))
                else:
                    self._next_turn(gid, k)
        if recovered.groups:
            log.info("rollout: %d groups from the journal (%s); ledger %s", len(recovered.groups),
                     self.episode_cfg.on_restart, self.counts)

    def start_group(self, gid: str, prompt: Any, ids: list[int]) -> None:
        """K episodes of ``prompt`` (token ids ``ids``), their first turns on the engine."""
        k = self.cfg.rollout.group_size
        group = EpisodeGroup(prompt, [Transcript(prompt, list(ids)) for _ in range(k)], [False] * k)
        self.groups[gid] = group
        self.counts["started"] += k
        for i in range(k):
            self._next_turn(gid, i)
        self._record(gid)

    def decoding(self, requests: dict) -> int:
        """Groups with a turn on the engine (``requests`` holds one per episode decoding)."""
        return sum(1 for g in self.groups.values() if g.decoding)

    def __len__(self) -> int:
        """Groups none of whose turns is on the engine: every live episode waits on its environment."""
        return sum(1 for g in self.groups.values() if not g.decoding)

    def submit(self, out: Any, prompt: Any) -> None:
        """A finished turn: its reply joins the transcript; the environment is asked for the next step."""
        from inflight.engine.client import tagged

        gid, k, turn = _split(out.request_id)
        group = self.groups[gid]
        group.decoding.discard(out.request_id)
        if group.failed:  # the group is dropped: its other turns end here
            return
        t = tagged(out.outputs[0])
        episode = group.episodes[k]
        episode.add_reply(t.text, t.token_ids, t.logprobs, t.versions, t.finish_reason or "",
                          sum(">" in s for s in t.labels))
        episode.tool_calls = self.tool_calls.parse(t.text) if self.tool_calls is not None else ()
        self._record(gid)
        self.pool.submit_turn(out.request_id, episode.view(last=self._last(episode)))

    def collect(self) -> list[RolloutGroup]:
        """Apply the environment's answers that came back (never waits); the groups finished."""
        finished = []
        for s in self.pool.poll():
            gid, k, _ = _split(s.key)
            group = self.groups.get(gid)
            if group is None or group.failed:
                self.counts["turns_cancelled"] += s.cancelled
                continue
            if s.turn is None:
                self._fail(gid, k, s.error, s.trace)
            elif s.turn.done:
                group.episodes[k].end(s.turn)
                self._episode_done(gid, k, "finished")
            else:
                self._observe(gid, k, s.turn)
            if gid in self.groups and all(self.groups[gid].done):
                finished.append(self._finish(gid))
            elif gid in self.groups:
                self._record(gid)
        return finished

    def close(self) -> None:
        """Stop the environment's processes. The episodes still running stay in the journal
        for the next process of this engine; without one they are dropped (counted)."""
        if self.journal is None:
            for gid in list(self.groups):
                self._drop(gid, "the engine process is stopping")
        else:
            self.journal.close()
        super().close()

    # -- turns -------------------------------------------------------------------------------
    def _record(self, gid: str) -> None:
        if self.journal is not None:
            self.journal.group(gid, self.groups[gid], self.counts)
            self.journal.compact_past(self.groups, self.counts)

    def _last(self, episode: Transcript) -> bool:
        return episode.turns >= self.episode_cfg.max_turns or self._room(episode) < 1

    def _room(self, episode: Transcript) -> int:
        """Tokens the episode's next turn may sample: its budget and the engine's context."""
        return episode.room(self.episode_cfg.max_tokens, self.max_model_len)

    def _next_turn(self, gid: str, k: int) -> None:
        episode = self.groups[gid].episodes[k]
        rid = f"{gid}.{k}.{episode.turns}"
        self.groups[gid].decoding.add(rid)
        self.add_request(rid, episode.prompt, episode.context_ids(), min(self.cfg.task.completion_tokens,
                                                                         self._room(episode)))

    def _observe(self, gid: str, k: int, turn: Turn) -> None:
        episode = self.groups[gid].episodes[k]
        try:
            ids = self.renderer.ids(turn, episode.token_ids, episode.finish_reason)
            text = self.renderer.text(turn)
        except Exception as e:  # a template that cannot render the message, ids past the vocabulary
            self._fail(gid, k, f"the observation could not be rendered ({type(e).__name__}: {e})")
            return
        episode.add_observation(turn, ids, text)
        if self._room(episode) < 1:
            self._fail(gid, k, f"the observation took the episode to {len(episode.token_ids)} tokens, past "
                               f"task.episode.max_tokens={self.episode_cfg.max_tokens} or engine.max_model_len="
                               f"{self.max_model_len}, before its last turn")
            return
        self._next_turn(gid, k)

    def _fail(self, gid: str, k: int, error: str, trace: str = "") -> None:
        group = self.groups[gid]
        self._episode_done(gid, k, "failed")
        self.failed += 1
        self.failed_in_a_row += 1
        if self.episode_cfg.on_failure == "reward":
            group.episodes[k].reward = self.episode_cfg.failure_reward
            then = f"the episode gets task.episode.failure_reward={self.episode_cfg.failure_reward:g}"
        else:
            group.failed = error
            self.counts["groups_failed"] += 1
            then = "its group is dropped"
        try:
            self._report(f"{gid}.{k}", group.prompt, error, what=f"episode {gid}.{k} (turn {group.episodes[k].turns})",
                         then=then, trace=trace)  # raises ScoringFailed past the limit
        finally:
            if group.failed:
                self._drop(gid, "", count=False)

    def _episode_done(self, gid: str, k: int, how: str) -> None:
        group = self.groups[gid]
        group.done[k] = True
        self.counts[how] += 1

    def _drop(self, gid: str, why: str, *, count: bool = True) -> None:
        """The group leaves: its turns on the engine are aborted; its running episodes counted dropped."""
        group = self.groups.pop(gid)
        if group.decoding:
            self.abort(sorted(group.decoding))
        running = [k for k, done in enumerate(group.done) if not done]
        self.pool.cancel([f"{gid}.{k}.{group.episodes[k].turns - 1}" for k in running if group.episodes[k].turns],
                         f"group {gid} was dropped")  # counted as their results come back
        self.counts["dropped"] += len(running)
        if self.journal is not None:
            self.journal.leave(gid, self.counts)
        if running and count:
            log.info("rollout: group %s dropped with %d episodes running: %s", gid, len(running), why)

    def _finish(self, gid: str) -> RolloutGroup:
        group = self.groups.pop(gid)
        self.scored += 1
        self.counts["groups_scored"] = self.scored
        self.failed_in_a_row = 0
        self.counts["shipped"] += len(group.episodes)
        if self.journal is not None:
            self.journal.leave(gid, self.counts)
        samples = tuple(_sample(gid, k, e) for k, e in enumerate(group.episodes))
        return RolloutGroup(group_id=gid, samples=samples, engine_id=self.engine_id, sampling=self.sampling,
                            engine_ledger=self.ledger())

    def ledger(self) -> dict[str, int]:
        c = self.counts
        return {k if k.startswith(("groups_", "turns_")) else f"episodes_{k}": v for k, v in c.items()}


def _split(key: str) -> tuple[str, int, int]:
    """``"<group id>.<episode>.<turn>"`` -> its parts (group ids hold dots themselves)."""
    gid, k, turn = key.rsplit(".", 2)
    return gid, int(k), int(turn)


def _sample(gid: str, k: int, e: Transcript) -> RolloutSample:
    return RolloutSample(sample_id=f"{gid}-{k}", group_id=gid, prompt_ids=list(e.prompt_ids), token_ids=e.token_ids,
                         logprobs=e.logprobs, versions=e.versions, reward=float(e.reward or 0.0),
                         hybrid_tokens=e.hybrid_tokens, finish_reason=e.finish_reason,
                         prompt_text=e.prompt.display, completion_text=e.text(), observation=e.observation)
