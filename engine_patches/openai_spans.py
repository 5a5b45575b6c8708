"""Per-token version spans on the OpenAI server's ``/v1/completions`` and ``/v1/chat/completions``.

vLLM 0.32 returns ``weight_versions`` spans (``[{"version", "start", "end"}]`` over the output
tokens) from ``/inference/v1/generate`` only. ``patch_openai_spans`` adds the same field to
each non-streamed choice of the two OpenAI endpoints, from the ``CompletionOutput`` the choice
was built from, so a harness on the OpenAI API reads which version sampled each token
(``inflight.versions.tags_from_spans``). The response models allow extra fields, so clients
that do not know the field ignore it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

_MARK = "__inflight_spans__"


def spans_of(output: Any) -> list[dict[str, Any]] | None:
    """A ``CompletionOutput``'s version spans as JSON objects, or None where it has none."""
    spans = getattr(output, "weight_versions", None)
    return None if spans is None else [dataclasses.asdict(s) for s in spans]


def patch_openai_spans() -> None:
    """Wrap ``OpenAIServingCompletion.request_output_to_completion_response`` and
    ``OpenAIServingChat.chat_completion_full_generator`` (vLLM 0.32.0) so each choice carries
    ``weight_versions``. Idempotent; raises if vLLM no longer has them."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

    completion = OpenAIServingCompletion.request_output_to_completion_response
    chat = OpenAIServingChat.chat_completion_full_generator
    if getattr(completion, _MARK, False):
        return

    @functools.wraps(completion)
    def request_output_to_completion_response(self, final_res_batch, *args, **kwargs):
        response = completion(self, final_res_batch, *args, **kwargs)
        outputs = [o for res in final_res_batch for o in res.outputs]  # the choices' order
        if len(outputs) == len(response.choices):
            for choice, output in zip(response.choices, outputs):
                choice.weight_versions = spans_of(output)
        return response

    @functools.wraps(chat)
    async def chat_completion_full_generator(self, request, result_generator, *args, **kwargs):
        last: list[Any] = []

        async def watched():
            async for res in result_generator:
                last[:] = [res]
                yield res
        response = await chat(self, request, watched(), *args, **kwargs)
        if last and hasattr(response, "choices"):
            by_index = {o.index: o for o in last[0].outputs}
            for choice in response.choices:
                if choice.index in by_index:
                    choice.weight_versions = spans_of(by_index[choice.index])
        return response

    for fn in (request_output_to_completion_response, chat_completion_full_generator):
        setattr(fn, _MARK, True)
    OpenAIServingCompletion.request_output_to_completion_response = request_output_to_completion_response
    OpenAIServingChat.chat_completion_full_generator = chat_completion_full_generator
