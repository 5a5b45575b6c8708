"""Per-token version spans on the OpenAI server's ``/v1/completions`` and ``/v1/chat/completions``.

vLLM 0.32 returns ``weight_versions`` spans (``[{"version", "start", "end"}]`` over the output
tokens) from ``/inference/v1/generate`` only. ``patch_openai_spans`` adds the same field to the
two OpenAI endpoints, from the ``CompletionOutput`` each choice was built from: on every choice
of a full response, and, streamed, on each choice's final chunk (the one with its
``finish_reason``), as ``/inference/v1/generate`` streams them. The spans cover the choice's
whole output. Response models allow extra fields, so clients that do not know it ignore it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

_MARK = "__inflight_spans__"


def spans_of(output: Any) -> list[dict[str, Any]] | None:
    """A ``CompletionOutput``'s version spans as JSON objects, or None where it has none."""
    spans = getattr(output, "weight_versions", None)
    return None if spans is None else [dataclasses.asdict(s) for s in spans]


def patch_openai_spans() -> None:
    """Wrap the full and streamed generators of ``OpenAIServingCompletion`` and
    ``OpenAIServingChat`` (vLLM 0.32.0) so each choice carries ``weight_versions``. Idempotent;
    raises if vLLM no longer has them."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    if getattr(OpenAIServingCompletion.request_output_to_completion_response, _MARK, False):
        return
    patched = {
        (OpenAIServingCompletion, "request_output_to_completion_response"): _full_completion,
        (OpenAIServingChat, "chat_completion_full_generator"): _full_chat,
        (OpenAIServingCompletion, "completion_stream_generator"): _streamed_completion,
        (OpenAIServingChat, "chat_completion_stream_generator"): _streamed_chat,
    }
    for (cls, name), wrap in patched.items():
        fn = functools.wraps(getattr(cls, name))(wrap(getattr(cls, name)))
        setattr(fn, _MARK, True)
        setattr(cls, name, fn)


def _full_completion(original: Callable) -> Callable:
    def request_output_to_completion_response(self, final_res_batch, *args, **kwargs):
        response = original(self, final_res_batch, *args, **kwargs)
        outputs = [o for res in final_res_batch for o in res.outputs]  # the choices' order
        if len(outputs) == len(response.choices):
            for choice, output in zip(response.choices, outputs):
                choice.weight_versions = spans_of(output)
        return response
    return request_output_to_completion_response


def _full_chat(original: Callable) -> Callable:
    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        last: list[Any] = []

        async def watched():
            async for res in result_generator:
                last[:] = [res]
                yield res
        response = await original(self, request, watched(), *args, **kwargs)
        if last and hasattr(response, "choices"):
            by_index = {o.index: o for o in last[0].outputs}
            for choice in response.choices:
                if choice.index in by_index:
                    choice.weight_versions = spans_of(by_index[choice.index])
        return response
    return chat_completion_full_generator


def _streamed_completion(original: Callable) -> Callable:
    def completion_stream_generator(self, request, engine_inputs, result_generator, *args, **kwargs):
        n = 1 if request.n is None else request.n
        spans: dict[int, list[dict[str, Any]] | None] = {}

        async def watched():
            async for prompt_idx, res in result_generator:
                _finished_spans(res.outputs, spans, lambda o, p=prompt_idx: o.index + p * n)
                yield prompt_idx, res
        return _with_spans(original(self, request, engine_inputs, watched(), *args, **kwargs), spans)
    return completion_stream_generator


def _streamed_chat(original: Callable) -> Callable:
    def chat_completion_stream_generator(self, request, result_generator, *args, **kwargs):
        spans: dict[int, list[dict[str, Any]] | None] = {}

        async def watched():
            async for res in result_generator:
                _finished_spans(res.outputs, spans, lambda o: o.index)
                yield res
        return _with_spans(original(self, request, watched(), *args, **kwargs), spans)
    return chat_completion_stream_generator


def _finished_spans(outputs: Any, spans: dict, index_of: Callable[[Any], int]) -> None:
    """Record the spans of each output that finished (a finished output carries its whole
    request's spans, streamed or not), by the index of the choice it streams as."""
    for output in outputs:
        if output.finish_reason is not None:
            spans[index_of(output)] = spans_of(output)


async def _with_spans(chunks: AsyncIterator[str], spans: dict) -> AsyncIterator[str]:
    """The stream's SSE events, each choice's final chunk given the ``weight_versions`` its
    output finished with (the output is read before the chunk built from it is sent)."""
    async for event in chunks:
        if '"finish_reason":"' in event and event.startswith("data: {"):
            body = json.loads(event[len("data: "):])
            for choice in body.get("choices") or ():
                if choice.get("finish_reason") is not None and choice.get("index") in spans:
                    choice["weight_versions"] = spans[choice["index"]]
            event = f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
        yield event
