"""Engine-side helpers: start the in-flight worker on an ``LLM`` or ``AsyncLLM``, and read
each completion's tokens, behaviour log-probs and per-token version tags.

Request with ``SamplingParams(logprobs=0)`` so each output token carries its own
(processed) log-prob; the version tags come from vLLM's ``weight_versions`` spans, whose
boundaries the commit coordinator places exactly at the commits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from inflight.engine.engine_config import InflightConfig
from inflight.engine.rpc import StartReport, WorkerStatus, as_result
from inflight.versions import tags_and_labels, tags_from_spans


@dataclass(frozen=True)
class TaggedCompletion:
    """One completion with a behaviour log-prob and a policy version per token."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str | None
    text: str
    labels: list[str] = field(default_factory=list)
    """Each token's version label: ``versions[i]`` as a string, or the hybrid that sampled it
    during a layer-granular commit (``inflight.layer_groups``; ``versions[i]`` is its oldest)."""

    @property
    def prompt_label(self) -> str:
        """The label of the weights that computed the prompt's KV, prefix-cache hits included:
        the first token's. Every commit invalidates the cache and restarts prefills it catches
        half done (``inflight.engine.prefix_cache``), so a prompt is computed under one label,
        in the step that samples its first token. A replay computes the prompt under it, and
        the input at token j under token j+1's label (the step that fed it to the model)."""
        if not self.labels:
            raise ValueError("a completion of no tokens has no prompt label")
        return self.labels[0]

    @property
    def prompt_version(self) -> int:
        """``prompt_label``'s version (its oldest, for a hybrid)."""
        if not self.versions:
            raise ValueError("a completion of no tokens has no prompt version")
        return self.versions[0]


def _sampled_logprobs(completion: Any) -> list[float]:
    if completion.logprobs is None:
        raise ValueError("completion has no log-probs: request with SamplingParams(logprobs=0)")
    if len(completion.logprobs) != len(completion.token_ids):
        raise ValueError(f"{len(completion.token_ids)} tokens but {len(completion.logprobs)} log-prob entries")
    return [float(step[tok].logprob) for tok, step in zip(completion.token_ids, completion.logprobs)]


def tagged(completion: Any) -> TaggedCompletion:
    """Tokens, behaviour log-probs and version tags of a *finished* ``CompletionOutput``."""
    tokens = list(completion.token_ids)
    versions, labels = tags_and_labels(completion.weight_versions, len(tokens))
    return TaggedCompletion(tokens, _sampled_logprobs(completion), versions, completion.finish_reason, completion.text,
                            labels)


def _report(reports: list[Any]) -> StartReport:
    """The first worker's report, with every worker's rank (one per TP rank)."""
    typed = [as_result(r, StartReport) for r in reports]
    return msgspec.structs.replace(typed[0], ranks=tuple(r.rank for r in typed))


def start_inflight(llm: Any, config: InflightConfig) -> StartReport:
    """Start in-flight updates on an ``LLM``: the commit coordinator in EngineCore, a listener
    on every worker. Returns the first worker's report with ``ranks`` (all workers)."""
    return _report(llm.collective_rpc("inflight_start", args=(config.to_json(),)))


async def start_inflight_async(engine: Any, config: InflightConfig) -> StartReport:
    """Start in-flight updates on an ``AsyncLLM``."""
    return _report(await engine.collective_rpc("inflight_start", args=(config.to_json(),)))


def policy_lora(config: InflightConfig) -> Any:
    """The ``LoRARequest`` every request to an adapter engine (``InflightConfig.adapter``) names."""
    if config.adapter is None:
        raise ValueError("policy_lora: InflightConfig.adapter is None (this engine serves full-model updates)")
    from inflight.engine.adapter_engine import policy_request

    return policy_request(config.adapter)


def coordinator_of(llm: Any) -> Any:
    """The commit coordinator of an ``LLM`` whose EngineCore runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): its ``steps``, ``live_version``, ``history``."""
    from inflight.engine.coordinator import ATTR

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise ValueError("this LLM's EngineCore runs in another process; use inflight_status(llm)")
    return core.__dict__[ATTR]


def inflight_status(llm: Any) -> WorkerStatus:
    """The first worker's status, with its engine's (``engine``)."""
    return as_result(llm.collective_rpc("inflight_status")[0], WorkerStatus)


async def inflight_status_async(engine: Any) -> WorkerStatus:
    return as_result((await engine.collective_rpc("inflight_status"))[0], WorkerStatus)


async def stream_tagged(engine: Any, prompt: Any, sampling_params: Any, request_id: str,
                        lora_request: Any = None) -> AsyncIterator[tuple[Any, list[int]]]:
    """``AsyncLLM.generate`` that also yields the version of every token seen so far.

    Final outputs carry vLLM's spans; for intermediate ones the spans are read from the
    front end's request state (vLLM 0.32 ``OutputProcessor.request_states``), which the
    output handler fills before it hands the output to this generator. Needs ``n=1`` and
    the default cumulative output kind. ``lora_request``: ``policy_lora(config)`` on an
    adapter engine.
    """
    from vllm.sampling_params import RequestOutputKind

    if sampling_params.n != 1 or sampling_params.output_kind != RequestOutputKind.CUMULATIVE:
        raise ValueError("stream_tagged needs n=1 and output_kind=CUMULATIVE")
    processor = engine.output_processor
    starts: list[tuple[str, int]] = []
    async for out in engine.generate(prompt, sampling_params, request_id, lora_request=lora_request):
        completion = out.outputs[0]
        n = len(completion.token_ids)
        if completion.weight_versions is not None:
            yield out, tags_from_spans(completion.weight_versions, n)
            continue
        for internal_id in processor.external_req_ids.get(request_id, []):
            state = processor.request_states.get(internal_id)
            if state is not None:
                starts = list(state.weight_version_starts)
        yield out, _tags_from_starts(starts, n)


class _Span(NamedTuple):
    version: str
    start: int
    end: int


def _tags_from_starts(starts: list[tuple[str, int]], n: int) -> list[int]:
    """Spans from ``(version, first token)`` starts, cut at the ``n`` tokens this output shows
    (the request state may already hold starts of later tokens)."""
    cut = [(v, s) for v, s in starts if s < n]
    ends = [s for _, s in cut[1:]] + [n]
    return tags_from_spans([_Span(v, s, e) for (v, s), e in zip(cut, ends)] if n else None, n)
