"""Per-token policy-version tags: from the engine's version spans to one tag per token.

vLLM reports, per completion, contiguous spans ``(version, start, end)`` over the output
token indices; in an in-flight engine the span boundaries are exactly the commits. A
sequence sampled across three updates carries three spans. This module turns spans into
a tag per token and measures lag against the trainer's version. It imports nothing from
vLLM: spans are anything with ``version``, ``start`` and ``end``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from inflight.layer_groups import LabelError, parse_label


class Span(Protocol):
    version: str
    start: int
    end: int


class VersionTagError(ValueError):
    """Spans that do not tile the tokens, or a label that is neither a version nor a hybrid."""


def labels_from_spans(spans: Iterable[Span] | None, num_tokens: int) -> list[str]:
    """One version label per output token (``"5"``, or a hybrid ``"5>6:3"`` of a layer-granular
    commit: ``inflight.layer_groups``); spans must tile ``[0, num_tokens)`` in order."""
    if spans is None:
        if num_tokens:
            raise VersionTagError(f"{num_tokens} tokens but no version spans (is the engine running inflight?)")
        return []
    labels: list[str] = []
    for span in spans:
        if span.start != len(labels) or span.end < span.start:
            raise VersionTagError(f"span {span.version}@[{span.start},{span.end}) does not continue at token "
                                  f"{len(labels)}")
        labels.extend([span.version] * (span.end - span.start))
    if len(labels) != num_tokens:
        raise VersionTagError(f"spans cover {len(labels)} tokens, completion has {num_tokens}")
    return labels


def tags_from_spans(spans: Iterable[Span] | None, num_tokens: int) -> list[int]:
    """One integer version per output token: the version, or for a hybrid the oldest version
    any of its groups holds (the lag of a hybrid token counts from it)."""
    return tags_and_labels(spans, num_tokens)[0]


def tags_and_labels(spans: Iterable[Span] | None, num_tokens: int) -> tuple[list[int], list[str]]:
    """``tags_from_spans`` and ``labels_from_spans`` of the same spans, read once."""
    labels = labels_from_spans(spans, num_tokens)
    cache: dict[str, int] = {}
    try:
        return [cache[s] if s in cache else cache.setdefault(s, parse_label(s).oldest) for s in labels], labels
    except LabelError as e:
        raise VersionTagError(str(e)) from None


def boundaries(tags: Sequence[int]) -> dict[int, int]:
    """Index of the first token of each version in ``tags``."""
    out: dict[int, int] = {}
    for i, v in enumerate(tags):
        out.setdefault(v, i)
    return out


def is_monotone(tags: Sequence[int]) -> bool:
    return all(a <= b for a, b in zip(tags, tags[1:]))


@dataclass(frozen=True)
class LagSummary:
    """How stale a batch of tokens is relative to the trainer's current version."""

    histogram: dict[int, int]
    mean: float
    max: int

    @classmethod
    def of(cls, tags: Iterable[int], current: int) -> LagSummary:
        hist: dict[int, int] = {}
        for v in tags:
            lag = current - v
            if lag < 0:
                raise VersionTagError(f"token tagged v{v} is newer than the trainer's v{current}")
            hist[lag] = hist.get(lag, 0) + 1
        n = sum(hist.values())
        mean = sum(k * c for k, c in hist.items()) / n if n else 0.0
        return cls(dict(sorted(hist.items())), mean, max(hist, default=0))
