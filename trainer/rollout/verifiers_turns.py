"""A verifiers 0.4 environment's episodes, as ``EpisodeRollout``'s environment side.

The environment runs unchanged on an event loop of its own (a thread of the engine process):
its harness calls the model, runs the tools and asks the rubric for the reward, and every
model call of it (``vf.Client.get_response``) becomes one turn of an in-flight episode.
``open(gid.k)`` answers with the opening prompt's ids (``Scored(gid.k.-1)``); each
``submit_turn(gid.k.t)`` hands the tagged reply to the harness, whose next call gives the new
tokens (``Scored(gid.k.t)``) or whose end gives ``Turn(done, reward)``.

A rollout is one episode per seat the policy plays (``task.verifiers.seats``): gid.k is seat
``k % seats``, and the rollout starts once its last seat's episode is open; a seat's trace's
model calls are its episode's turns, the trace's reward its reward.

Invariants. Turn t+1's prompt ids begin with turn t's prompt and reply ids exactly; a prompt
that does not is refused by name (re-tokenization drift) and fails its rollout's episodes, as
an error of the rollout does (named by the environment, the error and its traceback). The
environment's wait (``timeout_s``) runs only while the engine samples none of its seats. One
``Scored`` answers each ``open`` and each ``submit_turn``. Episodes of an earlier process are
not resumed (the harness's coroutines die with it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import verifiers.v1 as vf
from renderers.base import ToolCallParseStatus
from verifiers.v1.clients.train import (
    _is_valid_incremental_tail,
    response_from_generate,
    serialize_completion,
    tool_to_wire,
)
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import ProviderError

from inflight.trainer.rollout.scoring_worker import Scored
from inflight.trainer.tasks.episode import RetokenizationDrift, drift_position
from inflight.trainer.tasks.task import EpisodeView, Prompt, Turn

log = logging.getLogger("inflight.rollout")

SCHEME = "inflight://"
"""The base URL of a verifiers ``TrainClientConfig`` whose model calls an engine of this process takes."""
_CLIENTS: dict[str, Any] = {}
"""Base URL -> the ``vf.Client`` that answers it (``route_model_calls``)."""


def route_model_calls() -> None:
    """Let a ``TrainClientConfig(base_url="inflight://...")`` resolve to this process's client
    for that URL. verifiers 0.4.0's interception server builds each model client with the
    name ``resolve_client`` of ``verifiers.v1.interception.server``; this wraps that name
    once (idempotent), and every other config resolves as before."""
    import verifiers.v1.interception.server as server

    resolve = server.resolve_client
    if getattr(resolve, "inflight_route", False):
        return

    def resolve_client(config: Any) -> Any:
        url = str(getattr(config, "base_url", "") or "")
        return _CLIENTS[url] if url.startswith(SCHEME) else resolve(config)

    resolve_client.inflight_route = True  # type: ignore[attr-defined]
    server.resolve_client = resolve_client


@dataclass
class _Episode:
    key: str
    """``"<gid>.<k>"``: one seat of one rollout."""
    seat: str = "agent"
    context: list[int] | None = None
    """The last turn's prompt and reply ids: the next prompt must begin with them."""
    turn: int = -1
    """The turn whose answer the environment owes (-1: the opening prompt)."""
    reply: asyncio.Future | None = None
    waits_on_engine: bool = False
    spent: bool = False
    """The driver took the last turn (``EpisodeView.last``): a further model call is refused."""
    rollout: _Rollout | None = None


@dataclass
class _Rollout:
    """One rollout of the environment (verifiers' ``run_slot``): an episode per seat the policy plays."""

    episodes: list[_Episode]
    running: asyncio.Future | Any = None
    task: Any = None
    """The rollout's task (verifiers' ``run_slot``)."""
    failure: str = ""
    on_engine: int = 0
    """Its seats' model calls the engine is sampling: the environment waits on none of them at 0."""
    last: _Episode | None = None
    """The seat whose reply the environment took last."""
    deadline: Any = None
    """The ``asyncio.TimerHandle`` of the environment's wait (``timeout_s``)."""
    traces: list = field(default_factory=list)


class VerifiersTurns:
    """The environment side of ``EpisodeRollout`` for ``task.name = "verifiers"``: the same
    surface as ``ScoringPool`` (``submit_turn``, ``poll``, ``cancel``, ``close``), and ``open``."""

    resumable = False

    def __init__(self, cfg: Any, tokenizer: Any, engine_id: str) -> None:
        from inflight.trainer.envs.verifiers_env import policy_seats, take_environment, taskset_rows
        from inflight.trainer.envs.verifiers_render import make_renderer

        route_model_calls()
        self._pythonpath = _share_sys_path()
        self.env_id, self.timeout_s = cfg.task.env_id, cfg.task.scoring.timeout_s
        self.env = take_environment(cfg)
        self.tasks = taskset_rows(self.env, cfg)
        self.seats = policy_seats(cfg)
        v = cfg.task.verifiers
        self.renderer = make_renderer(tokenizer, v.renderer, v.renderer_options, cfg.task.tool_parser)
        self.url = f"{SCHEME}{engine_id}-{id(self):x}"
        _CLIENTS[self.url] = EngineClient(self)
        self.ctx = vf.ModelContext(model="policy", client=vf.TrainClientConfig(base_url=self.url),
                                   sampling=vf.SamplingConfig())
        self.episodes: dict[str, _Episode] = {}
        self._by_trace: dict[str, _Episode] = {}
        self._done: deque[Scored] = deque()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inflight-verifiers", daemon=True)
        self._thread.start()
        self._ready = threading.Event()
        self._stop = asyncio.run_coroutine_threadsafe(self._make_event(), self._loop).result()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)

    # -- EpisodeRollout's side (the engine process's thread) -------------------------------
    def wait_ready(self, timeout_s: float = 120.0) -> bool:
        """The environment serves (its shared tool servers up), or its own error raised here."""
        for _ in range(max(1, int(timeout_s / 0.05))):
            if self._ready.wait(0.05):
                return True
            if self._serving.done():
                self._serving.result()  # raises the environment's own error
                raise RuntimeError(f"verifiers environment {self.env_id!r} stopped serving before it started")
        raise TimeoutError(f"verifiers environment {self.env_id!r} did not start serving in {timeout_s:g} s")

    def open(self, key: str, prompt: Prompt) -> None:
        """Start episode ``key`` (``"<gid>.<k>"``) of taskset row ``prompt.meta["row"]``: seat
        ``k % seats`` of a rollout, which starts once its last seat's episode is open."""
        gid, k = key.rsplit(".", 1)
        n = len(self.seats)
        episode = _Episode(key, seat=self.seats[int(k) % n])
        with self._lock:
            self.episodes[key] = episode
            if int(k) % n != n - 1:
                return
            rollout = _Rollout([self.episodes[f"{gid}.{j}"] for j in range(int(k) - n + 1, int(k) + 1)])
        for e in rollout.episodes:
            e.rollout = rollout
        task = self.tasks[int(prompt.meta["row"])]
        rollout.running = asyncio.run_coroutine_threadsafe(self._run(rollout, task), self._loop)

    def submit_turn(self, key: str, view: EpisodeView) -> None:
        """Turn ``key``'s reply (``view.reply_ids``, ``view.reply_logprobs``) goes to the harness."""
        with self._lock:
            episode = self.episodes.get(key.rsplit(".", 1)[0])
        if episode is None:  # cancelled meanwhile
            return
        episode.waits_on_engine = False
        reply = (list(view.reply_ids), list(view.reply_logprobs), view.finish_reason, view.last)
        self._loop.call_soon_threadsafe(self._reply, episode, reply)

    def poll(self) -> list[Scored]:
        with self._lock:
            out = list(self._done)
            self._done.clear()
        return out

    def cancel(self, keys: Sequence[str], why: str) -> None:
        """Stop the episodes of ``keys`` (``"<gid>.<k>.<turn>"``); one waiting on its environment
        (not on the engine) comes back ``cancelled``."""
        for key in keys:
            with self._lock:
                episode = self.episodes.pop(key.rsplit(".", 1)[0], None)
                if episode is not None and not episode.waits_on_engine:
                    self._done.append(Scored(key, None, why, cancelled=True))
            if episode is not None and episode.rollout is not None:
                episode.rollout.running.cancel()

    def pending(self) -> int:
        return sum(not e.waits_on_engine for e in self.episodes.values())

    def close(self) -> None:
        for rollout in {id(e.rollout): e.rollout for e in self.episodes.values() if e.rollout}.values():
            rollout.running.cancel()
        self._loop.call_soon_threadsafe(self._stop.set)
        try:
            self._serving.result(timeout=60)
        except Exception as e:  # closing: the environment's teardown error is only logged
            log.warning("rollout: verifiers environment %r stopped with %s: %s", self.env_id, type(e).__name__, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        _CLIENTS.pop(self.url, None)
        import os

        if self._pythonpath is None:  # the process's environment as it was (a later subprocess sees no change)
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = self._pythonpath

    # -- on the event loop ------------------------------------------------------------------
    async def _make_event(self) -> asyncio.Event:
        return asyncio.Event()

    async def _serve(self) -> None:
        async with self.env.serving():
            self._ready.set()
            await self._stop.wait()

    async def _run(self, rollout: _Rollout, task: Any) -> None:
        """One rollout of ``task``; its end (each seat's reward, or the failure) answers each
        seat's last turn. Each answer of the environment to a reply takes at most ``timeout_s``
        (its opening, which starts its tool servers, is bounded by verifiers' own ``timeout``)."""
        def minted(trace: Any) -> None:
            rollout.traces.append(trace.id)
            seat = getattr(trace.agent, "name", "agent")
            if seat in self.seats:  # a seat the policy does not play calls its own model
                self._by_trace[trace.id] = rollout.episodes[self.seats.index(seat)]

        rollout.task = asyncio.ensure_future(self.env.run_slot(self.env.slots(task, 1)[0], self.ctx,
                                                               on_trace=minted))
        try:
            outcomes = _outcomes(await rollout.task, self.env_id, self.seats)
        except asyncio.CancelledError:
            if not rollout.failure:  # cancelled by EpisodeRollout: nothing to answer
                rollout.task.cancel()
                raise
            outcomes = [(None, "", "")] * len(self.seats)
        except Exception as e:  # the environment's failure is its episodes'
            import traceback

            outcomes = [(None, f"verifiers environment {self.env_id!r}: {type(e).__name__}: {e}",
                         traceback.format_exc())] * len(self.seats)
        finally:
            self._unwatch(rollout)
            for trace_id in rollout.traces:
                self._by_trace.pop(trace_id, None)
        for episode, (reward, error, trace) in zip(rollout.episodes, outcomes, strict=True):
            if rollout.failure:  # refused or timed out here (drift, the budget, a hang): named by us
                error, trace, reward = rollout.failure, "", None
            elif reward is not None and episode.context is None:
                reward, error = None, f"verifiers environment {self.env_id!r}: seat {episode.seat!r} took no turn"
            turn = Turn(done=True, reward=reward) if reward is not None else None
            self._answer(episode, Scored(f"{episode.key}.{episode.turn}", None, error, turn=turn, trace=trace))

    def _watch(self, rollout: _Rollout) -> None:
        """The environment has the rollout now (the engine samples none of its seats): it
        answers within ``timeout_s`` or its episodes fail."""
        self._unwatch(rollout)
        if rollout.on_engine == 0:
            rollout.deadline = self._loop.call_later(self.timeout_s, self._timed_out, rollout)

    def _unwatch(self, rollout: _Rollout) -> None:
        if rollout.deadline is not None:
            rollout.deadline.cancel()
            rollout.deadline = None

    def _timed_out(self, rollout: _Rollout) -> None:
        turn = rollout.last.turn if rollout.last is not None else -1
        rollout.failure = (f"verifiers environment {self.env_id!r}: its answer to turn {turn} took longer "
                           f"than task.scoring.timeout_s={self.timeout_s:g} (a tool or the rubric hung)")
        rollout.task.cancel()

    def _reply(self, episode: _Episode, reply: tuple) -> None:
        """The engine's reply reaches the harness; the environment has the rollout again."""
        rollout = episode.rollout
        assert rollout is not None
        rollout.on_engine -= 1
        rollout.last = episode
        self._watch(rollout)
        _resolve(episode.reply, reply)

    def _answer(self, episode: _Episode, scored: Scored) -> None:
        episode.waits_on_engine = scored.turn is not None and not scored.turn.done
        with self._lock:
            if self.episodes.get(episode.key) is episode:
                self._done.append(scored)
                if scored.turn is None or scored.turn.done:
                    del self.episodes[episode.key]

    async def model_call(self, session_id: str | None, prompt_ids: list[int]) -> tuple[list[int], list[float], str]:
        """One model call of the seat whose trace is ``session_id``: the prompt goes to the
        engine as its episode's next turn; returns the reply's ids, log-probs and finish reason."""
        episode = self._by_trace.get(session_id or "")
        if episode is None or episode.rollout is None:
            raise RuntimeError(f"a model call of an unknown rollout ({session_id!r}), or of a seat the policy does "
                               f"not play (task.verifiers.seats={list(self.seats)})")
        rollout = episode.rollout
        if episode.spent:  # a 4xx: the harness stops, the rubric scores what there is
            raise ProviderError("the episode's turns or tokens are spent (task.episode)", status_code=400)
        context = episode.context or []
        if (at := drift_position(prompt_ids, context)) is not None:
            rollout.failure = (f"verifiers environment {self.env_id!r}: re-tokenization drift at turn "
                               f"{episode.turn + 1}: its prompt ids differ from the episode's token ids at "
                               f"position {at} of {len(context)} (the renderer did not bridge from them)")
            raise RetokenizationDrift(rollout.failure)
        episode.reply = asyncio.get_running_loop().create_future()
        rollout.on_engine += 1
        self._unwatch(rollout)  # the engine has it now
        self._answer(episode, Scored(f"{episode.key}.{episode.turn}", None,
                                     turn=Turn(observation_ids=list(prompt_ids[len(context):]))))
        ids, logprobs, finish_reason, last = await episode.reply
        episode.turn += 1
        episode.context, episode.spent = list(prompt_ids) + ids, last
        return ids, logprobs, finish_reason


def _share_sys_path() -> str | None:
    """The environment's tool servers (``python -m`` of a toolset's module, in a directory of
    their own) import what this process imports: its own directories on ``sys.path`` (the
    working directory, a config file's) go into ``PYTHONPATH`` until ``close``. Returns its
    value before (None: unset)."""
    import os
    import sys

    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    own = [os.path.realpath(p or ".") for p in sys.path]
    own = [p for p in own if os.path.isdir(p) and not any(p.startswith(x + os.sep) or p == x for x in prefixes)]
    before = os.environ.get("PYTHONPATH")
    current = [p for p in (before or "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(current + own))
    return before


def _resolve(future: asyncio.Future | None, value: Any) -> None:
    if future is not None and not future.done():
        future.set_result(value)


def _outcomes(episode: Any, env_id: str, seats: Sequence[str]) -> list[tuple[float | None, str, str]]:
    """A finished verifiers ``Episode`` -> (reward, error, traceback) of each seat of ``seats``;
    an error anywhere in it is every seat's."""
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if errors:
        e = errors[0]
        return [(None, f"verifiers environment {env_id!r}: {e.type}: {e.message}", e.traceback or "")] * len(seats)
    if not episode.traces:
        return [(None, f"verifiers environment {env_id!r}: the episode ran no agent", "")] * len(seats)
    by_seat = {getattr(t.agent, "name", "agent"): t for t in episode.traces}
    out: list[tuple[float | None, str, str]] = []
    for seat in seats:
        trace = by_seat.get(seat)
        named = f" (seat {seat!r})" if len(seats) > 1 else ""
        if trace is None:
            out.append((None, f"verifiers environment {env_id!r}: seat {seat!r} ran no agent", ""))
        elif trace.reward is None:
            out.append((None, f"verifiers environment {env_id!r}: its rubric gave no reward{named}", ""))
        else:
            out.append((float(trace.reward), "", ""))
    return out


class EngineClient(vf.Client):
    """The ``vf.Client`` of ``VerifiersTurns``: renders each model call to token ids (bridging
    from the episode's last turn, as verifiers' ``TrainClient`` does) and samples it as the
    episode's next turn."""

    def __init__(self, turns: VerifiersTurns) -> None:
        self.turns, self.renderer = turns, turns.renderer

    async def get_response(self, dialect: Any, body: dict, sampling: Any, session_id: str | None = None,
                           turn: Any = None, headers: Any = None) -> Any:
        if not isinstance(dialect, ChatDialect):
            raise NotImplementedError(f"{type(dialect).__name__}: only chat completions are rendered")
        if turn is not None:
            prompt, tools = turn.prompt, turn.tools
        else:
            request = dialect.parse_request(body)
            prompt, tools = request.messages, request.tools
        wire_tools = [tool_to_wire(t) for t in tools] if tools else None
        rendered, bridged_turn = None, None
        tail = [message_to_wire(m) for m in turn.tail] if turn is not None else []
        previous = turn.previous_renderer_token_ids() if turn is not None and _is_valid_incremental_tail(tail) \
            else None
        if previous is not None:
            rendered = self.renderer.bridge_to_next_turn(previous[0], previous[1], tail, tools=wire_tools)
            bridged_turn = turn if rendered is not None else None
        if rendered is None:
            rendered = self.renderer.render([message_to_wire(m) for m in prompt], tools=wire_tools,
                                            add_generation_prompt=True)
        prompt_ids = list(rendered.token_ids)
        ids, logprobs, finish = await self.turns.model_call(session_id, prompt_ids)
        parsed = self.renderer.parse_response(ids, prompt_ids=prompt_ids, tools=wire_tools)
        if finish == "stop" and any(c.status == ToolCallParseStatus.OK for c in parsed.tool_calls):
            finish = "tool_calls"
        result = {"prompt_ids": prompt_ids, "completion_ids": ids, "completion_logprobs": logprobs,
                  "content": parsed.content, "reasoning_content": parsed.reasoning_content,
                  "tool_calls": parsed.tool_calls, "finish_reason": finish, "prompt_attribution": rendered}
        response = response_from_generate(result, body["model"], bridged_turn)
        response.raw = serialize_completion(response, body["model"])
        return response
