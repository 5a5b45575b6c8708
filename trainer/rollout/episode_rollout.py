"""The rollout driver: every task's episodes on the in-flight engine, the environment off its thread.

An episode is a prompt and the policy's replies: one, scored by ``Task.score`` (single-turn), or each answered by
an ``EpisodeTask``'s environment (``turn``) until it ends. The rollout loop drives both (``EpisodeRollout``)::

    start_group(gid, prompt, ids) --> K episodes: one request of n = K ("gid.*.0", single-turn), or a
                                      request "gid.k.0" each (n = 1; the prefix cache prefills it once)
    engine step: turn finished    --> submit(out): reply tokens, tags and log-probs appended to its
                                      Transcript; the environment asked in the scoring processes (timeout,
                                      memory cap: Task.score for the K replies at once, or EpisodeTask.turn)
    collect(), every loop turn    --> observation: its tokens appended (masked), request "gid.k.<turn+1>"
                                      continues the episode's token ids
                                  --> done: the episode's reward; once all K are done, the group is a
                                      RolloutGroup (one sample per episode)
                                  --> failed (raised, hung, garbage, out of budget): logged and counted; the
                                      group dropped or the episode rewarded ``failure_reward`` (``on_failure``)

Invariants: decoding never waits for the environment; every token keeps the version that sampled it (an episode
spans the commits made while it runs); ``counts``, the episode ledger, has every episode started in exactly one of
running, finished, failed or dropped; the journal keeps it and the episodes in flight across engine processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inflight.protocol import EngineReport, RolloutGroup, RolloutSample, Sampling
from inflight.trainer.rollout.episode_journal import EpisodeJournal
from inflight.trainer.rollout.failure_log import FailureLog
from inflight.trainer.rollout.scoring_pool import ScoringPool
from inflight.trainer.rollout.scoring_worker import engine_task_factory
from inflight.trainer.tasks.episode import ObservationRenderer, Transcript
from inflight.trainer.tasks.task import Completion, Turn
from inflight.trainer.tasks.tool_calls import ToolCallParser

log = logging.getLogger("inflight.rollout")

AddRequest = Callable[[str, Any, list[int], int, int], None]
"""``(request_id, prompt, token_ids, max_tokens, n)``: start one turn on the engine (n samples of it)."""
AbortRequests = Callable[[list[str]], None]
ALL = "*"
"""The episode index of a single-turn group's one request and scoring call: all K episodes."""


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
    one_turn: bool = False
    """A single-turn task's group: one request of n = K, scored at once."""


class EpisodeRollout:
    """One engine's episodes: turns in, environment calls out, finished groups back."""

    def __init__(self, cfg: Any, model_dir: str, engine_id: str, sampling: Sampling, tokenizer: Any,
                 add_request: AddRequest, abort: AbortRequests, *, episodic: bool,
                 journal: Path | None = None) -> None:
        if episodic and cfg.loss.routing_replay:
            raise ValueError(f"task.name={cfg.task.name!r} is a multi-turn task: loss.routing_replay does not "
                             "cover the environment's tokens between turns (set loss.routing_replay=false)")
        s = cfg.task.scoring
        self.cfg, self.engine_id, self.sampling, self.episodic = cfg, engine_id, sampling, episodic
        if cfg.task.name == "verifiers":  # the environment runs its own loop: each model call is a turn
            from inflight.trainer.rollout.verifiers_turns import VerifiersTurns

            self.pool: Any = VerifiersTurns(cfg, tokenizer, engine_id)
        else:
            self.pool = ScoringPool(engine_task_factory(cfg, model_dir), workers=s.workers, timeout_s=s.timeout_s,
                                    memory_mb=s.memory_mb, max_workers=s.max_workers)
        self.failures = FailureLog(cfg, engine_id)
        self.episode_cfg = cfg.task.episode
        self.renderer = ObservationRenderer(tokenizer, cfg.task.chat) if episodic else None
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

    @property
    def on_report(self) -> Callable[[EngineReport], object]:
        return self.failures.on_report

    @on_report.setter
    def on_report(self, sink: Callable[[EngineReport], object]) -> None:
        self.failures.on_report = sink

    # -- what the rollout loop calls ---------------------------------------------------------
    def wait_ready(self) -> None:
        """Fail now, with the task's own error, if no scoring process can build the task."""
        self.pool.wait_ready()

    def resume(self) -> None:
        """Take on the episodes an earlier process of this engine left in its journal
        (``task.episode.on_restart``); call once the engine takes requests."""
        recovered, self._recovered = self._recovered, None
        if recovered is None or self.journal is None:
            return
        for gid, group in recovered.groups.items():
            running = [k for k, done in enumerate(group.done) if not done]
            if self.episode_cfg.on_restart == "drop" or not getattr(self.pool, "resumable", True):
                self.counts["dropped"] += len(running)
                self.journal.leave(gid, self.counts)
                log.warning("rollout: group %s dropped on restart with %d episodes running (task.episode.on_restart)",
                            gid, len(running))
                continue
            group.decoding = set()
            self.groups[gid] = group
            self.counts["resumed"] += len(running)
            self._resume_group(gid, group, running)
        if recovered.groups:
            log.info("rollout: %d groups from the journal (%s); ledger %s", len(recovered.groups),
                     self.episode_cfg.on_restart, self.counts)

    def _resume_group(self, gid: str, group: EpisodeGroup, running: list[int]) -> None:
        if group.one_turn:
            if all(e.turns for e in group.episodes):  # sampled: its scoring was lost with the process
                self._score_group(gid)
            else:
                self._start_one_turn(gid)
            return
        for k in running:
            e = group.episodes[k]
            if e.turns > len(e.observations):  # its environment's answer was lost with the process: ask again
                self.pool.submit_turn(f"{gid}.{k}.{e.turns - 1}", e.view(last=self._last(e)))
            else:
                self._next_turn(gid, k)

    def start_group(self, gid: str, prompt: Any, ids: list[int] | None) -> None:
        """K episodes of ``prompt`` (token ids ``ids``), their first turns on the engine. With
        ``ids`` None (``Task.renders_prompt``) the environment gives each episode's opening ids first."""
        k = self.cfg.rollout.group_size
        group = EpisodeGroup(prompt, [Transcript(prompt, list(ids or ())) for _ in range(k)], [False] * k,
                             one_turn=not self.episodic)
        self.groups[gid] = group
        self.counts["started"] += k
        if group.one_turn:
            self._start_one_turn(gid)
        else:
            for i in range(k):
                self._next_turn(gid, i) if ids is not None else self.pool.open(f"{gid}.{i}", prompt)
        self._record(gid)

    def decoding(self) -> int:
        """Groups with a turn on the engine."""
        return sum(1 for g in self.groups.values() if g.decoding)

    def __len__(self) -> int:
        """Groups none of whose turns is on the engine: every live episode waits on its environment."""
        return sum(1 for g in self.groups.values() if not g.decoding)

    def submit(self, out: Any, prompt: Any) -> None:
        """A finished request of the in-process engine (a vLLM ``RequestOutput``): ``submit_turn``."""
        from inflight.engine.client import tagged

        routing = None
        if self.cfg.loss.routing_replay:
            from inflight.engine.routing import routing_fields

            routing = [routing_fields(c) for c in out.outputs]
        self.submit_turn(out.request_id, [tagged(c) for c in out.outputs], routing)

    def submit_turn(self, request_id: str, completions: list[Any], routing: list[dict] | None = None) -> None:
        """A finished turn, from the engine or its server: its replies (``TaggedCompletion``s, one
        per episode of a single-turn group) join the transcripts; the environment is asked next."""
        gid, k, _ = _split(request_id)
        group = self.groups.get(gid)
        if group is None:  # dropped while this turn was on its way back (an abort came too late)
            return
        group.decoding.discard(request_id)
        if group.failed:  # the group is dropped: its other turns end here
            return
        for i, t in enumerate(completions):
            episode = group.episodes[i if k is None else k]
            episode.add_reply(t.text, t.token_ids, t.logprobs, t.versions, t.finish_reason or "",
                              sum(">" in s for s in t.labels))
            episode.tool_calls = self.tool_calls.parse(t.text) if self.tool_calls is not None else ()
            if k is None and routing is not None:
                episode.routing_fields = routing[i]
        self._record(gid)
        if k is None:
            self._score_group(gid)
        else:
            episode = group.episodes[k]
            self.pool.submit_turn(request_id, episode.view(last=self._last(episode)))

    def fail_turn(self, request_id: str, error: str) -> None:
        """A turn the engine's server could not sample (the request failed, the server went
        away): its episode fails (a single-turn group: all of it), named by ``error``."""
        gid, k, _ = _split(request_id)
        group = self.groups.get(gid)
        if group is None:
            return
        group.decoding.discard(request_id)
        if group.failed:
            return
        if k is None:
            self._fail_group(gid, error)
        else:
            self._fail(gid, k, error)

    def collect(self) -> list[RolloutGroup]:
        """Apply the environment's answers that came back (never waits); the groups finished."""
        finished = []
        for s in self.pool.poll():
            gid, k, _ = _split(s.key)
            group = self.groups.get(gid)
            if group is None or group.failed:
                self.counts["turns_cancelled"] += s.cancelled
                continue
            if k is None:
                self._scored(gid, s.rewards, s.error, s.trace)
            elif s.turn is not None and not group.episodes[k].prompt_ids:  # the environment's opening prompt
                group.episodes[k].prompt_ids = list(s.turn.observation_ids or ())
                self._next_turn(gid, k)
            elif s.turn is None:
                self._fail(gid, k, s.error, s.trace)
            elif s.turn.done:
                self._end(gid, k, s.turn)
            else:
                self._observe(gid, k, s.turn)
            if gid in self.groups and all(self.groups[gid].done):
                finished.append(self._finish(gid))
            elif gid in self.groups:
                self._record(gid)
        return finished

    def drop_decoding(self, why: str) -> None:
        """Drop every group with a turn on the engine (its requests aborted; counted)."""
        for gid in [gid for gid, g in self.groups.items() if g.decoding]:
            self._drop(gid, why)

    def close(self) -> None:
        """Stop the environment's processes. The episodes still running stay in the journal
        for the next process of this engine; without one they are dropped (counted)."""
        if self.journal is None:
            for gid in list(self.groups):
                self._drop(gid, "the engine process is stopping")
        else:
            self.journal.close()
        self.pool.close()

    def ledger(self) -> dict[str, int]:
        """The ledger as ``RolloutGroup.engine_ledger`` carries it."""
        c = self.counts
        return {k if k.startswith(("groups_", "turns_")) else f"episodes_{k}": v for k, v in c.items()}

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

    def _start_one_turn(self, gid: str) -> None:
        group = self.groups[gid]
        rid = _group_key(gid)
        group.decoding.add(rid)
        self.add_request(rid, group.prompt, list(group.episodes[0].prompt_ids), self.cfg.task.completion_tokens,
                         len(group.episodes))

    def _score_group(self, gid: str) -> None:
        """A single-turn group's K replies to ``Task.score`` at once."""
        group = self.groups[gid]
        self.pool.submit(_group_key(gid), [group.prompt] * len(group.episodes),
                         [Completion(e.text(), e.token_ids, e.finish_reason) for e in group.episodes])

    def _scored(self, gid: str, rewards: list[float] | None, error: str, trace: str) -> None:
        if rewards is None:
            self._fail_group(gid, error, trace)
            return
        for k, reward in enumerate(rewards):
            self._end(gid, k, Turn(done=True, reward=reward))

    def _next_turn(self, gid: str, k: int) -> None:
        episode = self.groups[gid].episodes[k]
        rid = f"{gid}.{k}.{episode.turns}"
        self.groups[gid].decoding.add(rid)
        self.add_request(rid, episode.prompt, episode.context_ids(),
                         min(self.cfg.task.completion_tokens, self._room(episode)), 1)

    def _observe(self, gid: str, k: int, turn: Turn) -> None:
        episode = self.groups[gid].episodes[k]
        assert self.renderer is not None
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

    def _end(self, gid: str, k: int, turn: Turn) -> None:
        self.groups[gid].episodes[k].end(turn)
        self._episode_done(gid, k, "finished")

    def _fail(self, gid: str, k: int, error: str, trace: str = "") -> None:
        self._episode_done(gid, k, "failed")
        self._failed(gid, k, error, trace)

    def _fail_group(self, gid: str, error: str, trace: str = "") -> None:
        """A single-turn group's one request or scoring call failed: every episode of it."""
        for k in range(len(self.groups[gid].episodes)):
            self._episode_done(gid, k, "failed")
        self._failed(gid, None, error, trace)

    def _failed(self, gid: str, k: int | None, error: str, trace: str) -> None:
        """Episode ``k`` (None: every episode of a single-turn group) failed: rewarded
        ``failure_reward`` or its group dropped (``task.episode.on_failure``), and reported."""
        group = self.groups[gid]
        failed = range(len(group.episodes)) if k is None else [k]
        if self.episode_cfg.on_failure == "reward":
            for i in failed:
                group.episodes[i].reward = self.episode_cfg.failure_reward
            then = f"the episode gets task.episode.failure_reward={self.episode_cfg.failure_reward:g}"
        else:
            group.failed = error
            self.counts["groups_failed"] += 1
            then = "its group is dropped" if k is not None else "the group is dropped"
        episode = "" if k is None else f"{gid}.{k} (turn {group.episodes[k].turns})"
        so_far = f"{self.counts['failed']} failed so far, {self.counts['groups_scored']} scored"
        try:
            self.failures.report(error, group.prompt, group=gid, episode=episode, then=then, trace=trace,
                                 so_far=so_far)
        finally:  # report raises ScoringFailed past the limit
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
        if group.one_turn:
            self.pool.cancel([_group_key(gid)], f"group {gid} was dropped")
        else:
            self.pool.cancel([f"{gid}.{k}.{group.episodes[k].turns - 1}" for k in running],
                             f"group {gid} was dropped")  # counted as they come back
        self.counts["dropped"] += len(running)
        if self.journal is not None:
            self.journal.leave(gid, self.counts)
        if running and count:
            log.info("rollout: group %s dropped with %d episodes running: %s", gid, len(running), why)

    def _finish(self, gid: str) -> RolloutGroup:
        group = self.groups.pop(gid)
        self.failures.finished(gid)  # a group with no failed episode ends a run of failed ones
        self.counts["groups_scored"] += 1
        self.counts["shipped"] += len(group.episodes)
        if self.journal is not None:
            self.journal.leave(gid, self.counts)
        samples = tuple(_sample(gid, k, e) for k, e in enumerate(group.episodes))
        return RolloutGroup(group_id=gid, samples=samples, engine_id=self.engine_id, sampling=self.sampling,
                            engine_ledger=self.ledger())


def _group_key(gid: str) -> str:
    """A single-turn group's request id, and its scoring call's key."""
    return f"{gid}.{ALL}.0"


def _split(key: str) -> tuple[str, int | None, int]:
    """``"<group id>.<episode>.<turn>"`` -> its parts (group ids hold dots themselves); the
    episode ``*`` (every episode of a single-turn group) -> None."""
    gid, k, turn = key.rsplit(".", 2)
    return gid, None if k == ALL else int(k), int(turn)


def _sample(gid: str, k: int, e: Transcript) -> RolloutSample:
    return RolloutSample(sample_id=f"{gid}-{k}", group_id=gid, prompt_ids=list(e.prompt_ids), token_ids=e.token_ids,
                         logprobs=e.logprobs, versions=e.versions, reward=float(e.reward or 0.0),
                         hybrid_tokens=e.hybrid_tokens, finish_reason=e.finish_reason,
                         prompt_text=e.prompt.display, completion_text=e.text(),
                         observation=e.observation if any(e.observation) else [], **e.routing_fields)
