"""An agent harness's episode on the engine's server, recorded as one tagged sample.

A harness written against the ``openai`` SDK (or anything that takes an ``httpx`` client)
talks to an in-flight engine's ``vllm serve`` unchanged: its client gets
``ChatTranscript.http_client()`` (or ``async_http_client()``). Every ``/v1/chat/completions``
call then goes out with ``return_token_ids`` and ``logprobs``; a ``/inference/v1/generate``
call (verifiers' ``TrainClient``, renderers) goes as it is. Each comes back with the prompt
ids, reply ids, the reply's behaviour log-probs and its ``weight_versions`` spans; the
transcript keeps them, turn by turn, and ``sample`` returns the episode as one
``RolloutSample``: the first prompt, then every reply (tagged) and the tokens the harness
added between them (observations: masked, log-prob 0, the version of the token before).
``SessionTranscripts`` keeps one transcript per episode of a client that many share, by the
session header its calls carry (verifiers' ``X-Session-ID``).

Invariants: turn k+1's prompt ids begin with turn k's prompt and reply ids exactly (no
re-tokenization drift); a call that breaks this is answered with HTTP 400 naming the turn
and the position, never reaches a sample, and fails the transcript (``failure``). Streaming
and ``n > 1`` are refused in the same way: an episode is one reply per call.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from inflight.engine.client import TaggedCompletion
from inflight.protocol import RolloutSample
from inflight.trainer.rollout.server_turns import tagged_choice
from inflight.trainer.tasks.episode import drift_position

CHAT_PATH = "/chat/completions"
GENERATE_PATH = "/inference/v1/generate"
SESSION_HEADER = "X-Session-ID"
"""verifiers' session header: the rollout (its trace) a model call belongs to."""


@dataclass(frozen=True)
class ChatCall:
    """One model call of the episode: the ids the server rendered it to, and its reply."""

    prompt_ids: list[int]
    reply: TaggedCompletion


class ChatTranscript:
    """The model calls of one episode, in order; ``name`` identifies it in errors."""

    def __init__(self, name: str = "episode") -> None:
        self.name = name
        self.calls: list[ChatCall] = []
        self.failure = ""

    # -- what the harness's client uses -----------------------------------------------------
    def http_client(self, **kwargs: Any) -> httpx.Client:
        """An ``httpx.Client`` whose chat completions this transcript records (``kwargs`` go to it)."""
        return httpx.Client(transport=_Recording(lambda _: self, httpx.HTTPTransport()), **kwargs)

    def async_http_client(self, **kwargs: Any) -> httpx.AsyncClient:
        """``http_client`` for asyncio harnesses (``openai.AsyncOpenAI(http_client=...)``)."""
        return httpx.AsyncClient(transport=_AsyncRecording(lambda _: self, httpx.AsyncHTTPTransport()), **kwargs)

    # -- the record ---------------------------------------------------------------------------
    def outgoing(self, body: dict[str, Any], *, generate: bool = False) -> dict[str, Any]:
        """A request as it goes to the server: a chat request with token ids and log-probs
        asked for, a generate request as it is. ValueError for what an episode cannot record
        (streaming, several choices, a generate request without its prompt's token ids)."""
        params = (body.get("sampling_params") or {}) if generate else body
        if body.get("stream"):
            raise ValueError("a streamed request (stream=True) is not recorded: call without streaming")
        if int(params.get("n") or 1) != 1:
            raise ValueError(f"n={params['n']}: an episode takes one reply per call")
        if generate:
            if not isinstance(body.get("token_ids"), list):
                raise ValueError("a generate request without token_ids is not recorded")
            return {**body, "output_mode": "text"}  # log-probs as "token_id:N" (renderers reads them so)
        return {**body, "return_token_ids": True, "logprobs": True, "top_logprobs": 0}

    def record(self, response: Mapping[str, Any], prompt_ids: list[int] | None = None) -> ChatCall:
        """Add one call's response (the JSON body; ``prompt_ids``: the request's, where the
        response may not repeat them); ValueError naming the call's fault,
        ``RetokenizationDrift``'s message for a prompt that does not continue the episode."""
        turn = len(self.calls)
        choices = response.get("choices") or []
        prompt_ids = list(response.get("prompt_token_ids") or prompt_ids or [])
        if len(choices) != 1 or not prompt_ids:
            raise ValueError(f"{self.name}, turn {turn}: {len(choices)} choices, prompt ids "
                             f"{'present' if prompt_ids else 'missing'} "
                             "(is it an in-flight engine's server, called with return_token_ids?)")
        try:
            reply = tagged_choice(choices[0])
        except ValueError as e:
            raise ValueError(f"{self.name}, turn {turn}: {e}") from None
        if not reply.token_ids:
            raise ValueError(f"{self.name}, turn {turn}: a reply of no tokens")
        context = self.context()
        if (at := drift_position(prompt_ids, context)) is not None:
            raise ValueError(f"{self.name}: re-tokenization drift at turn {turn}: its prompt ids differ from the "
                             f"episode's token ids at position {at} of {len(context)} (the harness changed or "
                             "re-rendered an earlier turn)")
        call = ChatCall(prompt_ids, reply)
        self.calls.append(call)
        return call

    def context(self) -> list[int]:
        """The episode's token ids so far: the last call's prompt and reply."""
        if not self.calls:
            return []
        last = self.calls[-1]
        return last.prompt_ids + last.reply.token_ids

    def sample(self, *, sample_id: str, group_id: str, reward: float) -> RolloutSample:
        """The episode as one sample for the trainer; ValueError if it failed or made no call."""
        if self.failure:
            raise ValueError(f"{self.name} failed, no sample: {self.failure}")
        if not self.calls:
            raise ValueError(f"{self.name} made no model call")
        tokens, logprobs, versions, observation, hybrid = [], [], [], [], 0
        for prev, call in zip([None, *self.calls], self.calls):
            if prev is not None:
                added = call.prompt_ids[len(prev.prompt_ids) + len(prev.reply.token_ids):]
                tokens += added
                logprobs += [0.0] * len(added)
                versions += [versions[-1]] * len(added)
                observation += [True] * len(added)
            tokens += call.reply.token_ids
            logprobs += call.reply.logprobs
            versions += call.reply.versions
            observation += [False] * len(call.reply.token_ids)
            hybrid += sum(">" in label for label in call.reply.labels)  # labels: inflight.layer_groups
        return RolloutSample(sample_id=sample_id, group_id=group_id, prompt_ids=self.calls[0].prompt_ids,
                             token_ids=tokens, logprobs=logprobs, versions=versions, reward=float(reward),
                             finish_reason=self.calls[-1].reply.finish_reason or "", hybrid_tokens=hybrid,
                             observation=observation if any(observation) else [])

    def refused(self, why: str) -> httpx.Response:
        """The answer to a call the transcript refuses: HTTP 400 naming why (an SDK raises it
        as a bad request, never retries it); the transcript fails with it."""
        self.failure = self.failure or why
        return httpx.Response(400, json={"error": {"message": why, "type": "BadRequestError", "code": 400}})


class SessionTranscripts:
    """One ``ChatTranscript`` per session of a client that many episodes share: a call goes to
    the transcript of its ``X-Session-ID`` header (a call without one is refused)."""

    def __init__(self) -> None:
        self.sessions: dict[str, ChatTranscript] = {}

    def of(self, request: httpx.Request) -> ChatTranscript:
        session = request.headers.get(SESSION_HEADER, "")
        if session not in self.sessions:
            self.sessions[session] = ChatTranscript(f"session {session!r}" if session else "a call without a session")
            if not session:
                self.sessions[session].failure = f"a model call without its {SESSION_HEADER} header"
        return self.sessions[session]

    def async_http_client(self, **kwargs: Any) -> httpx.AsyncClient:
        """An ``httpx.AsyncClient`` whose model calls these transcripts record, by session."""
        return httpx.AsyncClient(transport=_AsyncRecording(self.of, httpx.AsyncHTTPTransport()), **kwargs)


def _is_recorded(request: httpx.Request) -> bool:
    path = request.url.path
    return request.method == "POST" and (path.endswith(CHAT_PATH) or path.endswith(GENERATE_PATH))


def _outgoing(transcript: ChatTranscript, request: httpx.Request) -> httpx.Response | tuple[httpx.Request, Any]:
    """What a transport sends for a recorded ``request``: as ``ChatTranscript.outgoing``
    rewrites it, with the prompt ids a generate request carries (the response need not repeat
    them; None for a chat request), or the transcript's refusal."""
    if transcript.failure:
        return transcript.refused(transcript.failure)
    generate = request.url.path.endswith(GENERATE_PATH)
    try:
        body = transcript.outgoing(json.loads(request.content or b"{}"), generate=generate)
    except ValueError as e:
        return transcript.refused(f"{transcript.name}: {e}")
    headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
    sent = httpx.Request(request.method, request.url, headers=headers, json=body, extensions=request.extensions)
    return sent, body.get("token_ids") if generate else None


class _Recording(httpx.BaseTransport):
    def __init__(self, pick: Callable[[httpx.Request], ChatTranscript], inner: httpx.BaseTransport) -> None:
        self.pick, self.inner = pick, inner

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_recorded(request):
            return self.inner.handle_request(request)
        transcript = self.pick(request)
        outgoing = _outgoing(transcript, request)
        if isinstance(outgoing, httpx.Response):
            return outgoing
        sent, prompt_ids = outgoing
        response = self.inner.handle_request(sent)
        response.read()
        return _recorded(transcript, prompt_ids, response)

    def close(self) -> None:
        self.inner.close()


class _AsyncRecording(httpx.AsyncBaseTransport):
    def __init__(self, pick: Callable[[httpx.Request], ChatTranscript], inner: httpx.AsyncBaseTransport) -> None:
        self.pick, self.inner = pick, inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not _is_recorded(request):
            return await self.inner.handle_async_request(request)
        transcript = self.pick(request)
        outgoing = _outgoing(transcript, request)
        if isinstance(outgoing, httpx.Response):
            return outgoing
        sent, prompt_ids = outgoing
        response = await self.inner.handle_async_request(sent)
        await response.aread()
        return _recorded(transcript, prompt_ids, response)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _recorded(transcript: ChatTranscript, prompt_ids: Any, response: httpx.Response) -> httpx.Response:
    """``response`` after the transcript took it: as it came where the server refused the call,
    HTTP 400 where the transcript refuses what came back."""
    if response.status_code != 200:
        return response
    try:
        transcript.record(response.json(), prompt_ids)
    except ValueError as e:
        return transcript.refused(str(e))
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-encoding")}
    return httpx.Response(200, headers=headers, content=response.content)
