"""The engine channel: inside one engine, through the trainer's store, each worker and the
engine's commit coordinator (in EngineCore's process). Every worker posts ``CommitReady`` for
the version (or layer group) it staged, verified and prepared; the coordinator commits it on
every worker at one step boundary, or on none, and posts ``EngineCommitted`` or
``EngineCommitFailed``. Typed and sealed like the trainer's wire protocol (``inflight.protocol``),
whose base and decoders it uses; it never reaches the trainer.
"""

from __future__ import annotations

from typing import Annotated, Callable, Union

from msgspec import Meta

from inflight.protocol import NonNeg, Wire, decoder

class CommitReady(Wire, tag="commit_ready"):
    """Worker -> its engine's coordinator: ``version`` is staged and prepared on this rank and
    the trainer's ``Commit`` for it arrived; the coordinator commits once every rank is ready."""

    rank: NonNeg
    version: NonNeg
    part: NonNeg = 0
    parts: NonNeg = 0
    refused: str = ""
    """Layer-granular: why this rank refused group ``part`` that the other ranks may hand over."""


class EngineCommitted(Wire, tag="engine_committed"):
    """Coordinator -> the engine's workers: every rank made ``version`` (or its group ``part``)
    live between engine steps ``step`` and ``step + 1``; meaning of the fields as in ``Committed``."""

    version: NonNeg
    step: NonNeg
    commit_ms: Annotated[float, Meta(ge=0)]
    tokens_at_commit: dict[str, NonNeg] = {}
    part: NonNeg = 0
    parts: NonNeg = 0
    label: str = ""  # the engine's version label from step ``step + 1`` on


class EngineCommitFailed(Wire, tag="engine_commit_failed"):
    """Coordinator -> the engine's workers: ``version`` did not go live on any rank; every
    rank that had applied it rolled back, and the label stays at ``live_version``."""

    version: NonNeg
    reason: str
    live_version: NonNeg


EngineMessage = Union[CommitReady, EngineCommitted, EngineCommitFailed]
decode_engine: Callable[[bytes | memoryview], EngineMessage] = decoder(EngineMessage, "engine")
