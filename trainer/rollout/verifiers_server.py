"""A verifiers environment's episodes with its own harness, against an in-flight engine's server.

The environment runs as verifiers runs it: its harness drives the model through verifiers'
interception server and the run's own client, ``TrainClient`` (renderers, then
``/inference/v1/generate``) or ``EvalClient`` (``/v1/chat/completions``). Only that client's
HTTP transport changes: every client verifiers builds for a ``base_url`` given to
``ServerEpisodes`` records its calls in a ``ChatTranscript`` per rollout (the call's
``X-Session-ID``, which is the trace's id). Each trace is one tagged sample, its reward the
rubric's. A trace whose calls were refused (drift, streaming) or that ended in an error gives
no sample, and the error names the environment and the trace.
"""

from __future__ import annotations

import functools
from typing import Any

from inflight.protocol import RolloutSample
from inflight.trainer.rollout.chat_transcript import SessionTranscripts

_RECORDERS: dict[str, SessionTranscripts] = {}
"""A client config's base URL -> the transcripts of the clients verifiers builds for it."""
_MARK = "inflight_records"


def record_clients() -> None:
    """Wrap ``resolve_client`` of ``verifiers.v1.interception.server`` (verifiers 0.4.0: the
    name its interception server builds each model client with) so a client for a registered
    base URL records its calls. Idempotent; every other config resolves as before."""
    import verifiers.v1.interception.server as server

    resolve = server.resolve_client
    if getattr(resolve, _MARK, False):
        return

    @functools.wraps(resolve)
    def resolve_client(config: Any) -> Any:
        client = resolve(config)
        transcripts = _RECORDERS.get(str(getattr(config, "base_url", "") or ""))
        return client if transcripts is None else _recording(client, transcripts)

    setattr(resolve_client, _MARK, True)
    server.resolve_client = resolve_client


def _recording(client: Any, transcripts: SessionTranscripts) -> Any:
    """``client`` (a ``TrainClient``: an ``AsyncOpenAI``; an ``EvalClient``: an ``httpx``
    client) with its HTTP client replaced by one that records into ``transcripts``."""
    http = getattr(client, "client", None)
    if hasattr(http, "with_options"):  # openai.AsyncOpenAI
        client.client = http.with_options(http_client=transcripts.async_http_client(timeout=http.timeout))
    elif http is not None and hasattr(http, "send"):  # httpx.AsyncClient
        client.client = transcripts.async_http_client(timeout=http.timeout)
    else:
        raise TypeError(f"{type(client).__name__}: no HTTP client to record (verifiers' clients changed?)")
    return client


class ServerEpisodes:
    """Episodes of ``env`` (a loaded ``vf.Env``, its harness its own) whose model calls go to
    the in-flight engine's server at ``ctx.client.base_url``; ``name`` names it in errors."""

    def __init__(self, env: Any, ctx: Any, name: str) -> None:
        record_clients()
        self.env, self.ctx, self.name = env, ctx, name
        self.url = str(ctx.client.base_url)
        self.transcripts = _RECORDERS.setdefault(self.url, SessionTranscripts())

    async def run(self, task: Any, *, group_id: str, sample_id: str) -> list[RolloutSample]:
        """One episode of ``task`` (``env.run_slot``): a sample per trace (seat) in the order
        verifiers finished them. ValueError naming the trace where one cannot become a sample."""
        episode = await self.env.run_slot(self.env.slots(task, 1)[0], self.ctx)
        transcripts = [self.transcripts.sessions.pop(trace.id, None) for trace in episode.traces]  # none kept
        if episode.errors:
            e = episode.errors[0]
            raise ValueError(f"verifiers environment {self.name!r}: {e.type}: {e.message}")
        return [self._sample(trace, transcript, group_id=group_id, sample_id=f"{sample_id}.{k}" if k else sample_id)
                for k, (trace, transcript) in enumerate(zip(episode.traces, transcripts))]

    def _sample(self, trace: Any, transcript: Any, *, group_id: str, sample_id: str) -> RolloutSample:
        where = f"verifiers environment {self.name!r}, trace {trace.id} ({getattr(trace.agent, 'name', 'agent')})"
        if trace.errors:
            e = trace.errors[0]
            raise ValueError(f"{where}: {e.type}: {e.message}")
        if transcript is None:
            raise ValueError(f"{where}: no model call reached {self.url} (is the run's client this server's?)")
        try:
            return transcript.sample(sample_id=sample_id, group_id=group_id, reward=float(trace.reward))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
