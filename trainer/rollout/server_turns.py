"""Episodes as clients of the engine's server: each turn one request to ``vllm serve``'s
token-in/token-out ``/inference/v1/generate`` (an in-flight engine's server: ``--enable-scale-out``).

``ServerTurns`` stands where the in-process engine stands for ``EpisodeRollout``: its
``add_request`` and ``abort`` are the driver's callbacks, and ``finished()`` hands back each
finished request's replies, tagged from the server's ``weight_versions`` spans, for
``EpisodeRollout.submit_turn`` (or the error that failed it, for ``fail_turn``), their text
detokenized by the server as the in-process engine's is. Requests run on
an event loop in a thread of their own: the caller never waits on the network.

Invariants: what is sent is the episode's token ids, never text, so nothing is tokenized twice
(turn k+1 begins with turn k's prompt and reply ids by construction); every request carries a
seed derived from its id (``request_seed``), so the same episode samples the same tokens here
and in-process; a response whose tokens, log-probs and spans disagree, or that the server
aborted, fails its turn by the request's id and never becomes a sample.
"""

from __future__ import annotations

import asyncio
import threading
import zlib
from collections import deque
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

from inflight.engine.client import TaggedCompletion
from inflight.versions import VersionTagError, tags_and_labels


def request_seed(run_seed: int, request_id: str) -> int:
    """The sampling seed of request ``request_id`` in a run seeded ``run_seed``: the same on the
    server and in-process, different for every request."""
    return (zlib.crc32(request_id.encode()) ^ (run_seed * 0x9E3779B1)) & 0x7FFFFFFF


class ServerTurns:
    """Turns on an engine's server (``base_url``, e.g. ``http://127.0.0.1:8000``).

    ``sampling``: the vLLM ``sampling_params`` every request shares (temperature, top_k, top_p,
    stop_token_ids, ...); each request adds its ``n``, ``max_tokens``, ``seed`` and ``logprobs``.
    ``timeout_s``: the most one request may take before its turn fails."""

    def __init__(self, base_url: str, sampling: Mapping[str, Any], *, run_seed: int = 0,
                 api_key: str | None = None, timeout_s: float = 600.0) -> None:
        import httpx

        self.url = base_url.rstrip("/") + "/inference/v1/generate"
        self.abort_url = base_url.rstrip("/") + "/inference/v1/abort_requests"
        self.sampling, self.run_seed = dict(sampling), run_seed
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._done: deque[tuple[str, list[TaggedCompletion] | None, str]] = deque()
        self._running: dict[str, Any] = {}  # request id -> its concurrent.futures.Future
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="inflight-server-turns", daemon=True)
        self._thread.start()
        self._http = httpx.AsyncClient(timeout=timeout_s, headers=headers)

    def add_request(self, request_id: str, prompt: Any, ids: list[int], max_tokens: int, n: int) -> None:
        """Send one turn (``EpisodeRollout``'s ``AddRequest``); never waits."""
        body = {"request_id": request_id, "token_ids": list(ids), "output_mode": "text",
                "sampling_params": {**self.sampling, "n": n, "max_tokens": max_tokens, "logprobs": 0,
                                    "seed": request_seed(self.run_seed, request_id)}}
        future = asyncio.run_coroutine_threadsafe(self._generate(request_id, body, n), self._loop)
        with self._lock:
            self._running[request_id] = future

    def abort(self, request_ids: list[str]) -> None:
        """Cancel turns (``EpisodeRollout``'s ``AbortRequests``): their results never come back."""
        cancel = set(request_ids)
        with self._lock:
            futures = [self._running.pop(rid) for rid in request_ids if rid in self._running]
            ended = [d for d in self._done if d[0] in cancel]  # ended, not yet read: never read
            for d in ended:
                self._done.remove(d)
        for future in futures:
            future.cancel()
        if futures:
            asyncio.run_coroutine_threadsafe(self._post_abort(list(request_ids)), self._loop)

    def finished(self) -> list[tuple[str, list[TaggedCompletion] | None, str]]:
        """The turns that ended since the last call: ``(request id, its replies, "")``, or
        ``(request id, None, why it failed)``; never waits."""
        with self._lock:
            out = list(self._done)
            self._done.clear()
        return out

    def close(self) -> None:
        with self._lock:
            running = list(self._running)
        self.abort(running)
        asyncio.run_coroutine_threadsafe(self._http.aclose(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    # -- on the event loop --------------------------------------------------------------------
    async def _generate(self, request_id: str, body: dict, n: int) -> None:
        try:
            response = await self._http.post(self.url, json=body)
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}: {response.text[:300]}")
            result: tuple[list[TaggedCompletion] | None, str] = (self._replies(response.json(), n), "")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the network, the server, a malformed answer: the turn fails, named
            result = (None, f"request {request_id} to {self.url} failed ({type(e).__name__}: {e})")
        with self._lock:
            if self._running.pop(request_id, None) is None:
                return  # aborted meanwhile
            self._done.append((request_id, *result))

    async def _post_abort(self, request_ids: list[str]) -> None:
        try:
            await self._http.post(self.abort_url, json={"request_ids": request_ids})
        except Exception:  # the server may be gone: nothing left to cancel there
            pass

    def _replies(self, payload: Mapping[str, Any], n: int) -> list[TaggedCompletion]:
        choices = sorted(payload.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != n:
            raise ValueError(f"{len(choices)} choices for n={n}")
        return [tagged_choice(c) for c in choices]


def tagged_choice(choice: Mapping[str, Any]) -> TaggedCompletion:
    """One choice of an in-flight engine's server (``/inference/v1/generate``, or the OpenAI
    endpoints with ``return_token_ids`` and ``logprobs``) as a ``TaggedCompletion``: its token
    ids, the sampled tokens' log-probs and the tags of its ``weight_versions`` spans.
    ValueError where they disagree or the server aborted it."""
    if choice.get("finish_reason") == "abort":
        raise ValueError("the server aborted the request")
    tokens = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(content)} log-probs")
    spans = [SimpleNamespace(version=str(s["version"]), start=int(s["start"]), end=int(s["end"]))
             for s in choice.get("weight_versions") or []]
    try:
        versions, labels = tags_and_labels(spans, len(tokens))
    except VersionTagError as e:
        raise ValueError(f"version spans: {e} (is the server an in-flight engine's?)") from None
    text = choice["text"] if "text" in choice else (choice.get("message") or {}).get("content") or ""
    return TaggedCompletion(tokens, [float(c["logprob"]) for c in content], versions, choice.get("finish_reason"),
                            text, labels)
