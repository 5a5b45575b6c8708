"""Typed results of the worker's ``collective_rpc`` methods (worker -> EngineCore -> client).

Plain (untagged) msgspec Structs. An in-process client (``LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``) gets them as they are; across vLLM's EngineCore
process boundary they are msgpack maps, which arrive as dicts (and as JSON objects from
``vllm serve``'s ``/collective_rpc``): ``inflight.engine.client`` converts them back with
``as_result``, so every caller reads the same types.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from msgspec import Struct

from inflight.protocol import NonNeg, VersionSpecStats, WorkerCommitResult

R = TypeVar("R")


class _Result(Struct, frozen=True, forbid_unknown_fields=True):
    pass


class StartReport(_Result):
    """``inflight_start``: what one worker set up."""

    rank: NonNeg
    instance_id: str
    commit: str
    """The commit strategy in use (swap, reload, copy)."""
    schema_tensors: NonNeg
    staging: str
    """Where staging lives: device or host."""
    reserved_bytes: NonNeg
    """Every byte this worker holds for updates (``inflight.memory.StagingNeed``): the staging,
    the rollback copy, the commit's own memory, landing windows; what it set aside before the
    KV cache on an engine built with the intent. Not the staging alone."""
    node_workers: NonNeg = 1
    """Workers of this engine on this worker's host: host staging was checked for all of them."""
    plan_digest: str = ""
    """Digest of this worker's shard plan (``inflight.shard_plan``); empty: it reads whole tensors."""
    routing: tuple[NonNeg, NonNeg] | None = None
    """(MoE layers, top-k) recorded per token, or None."""
    ranks: tuple[NonNeg, ...] = ()
    """Filled by the client: every worker's rank (one per tensor parallel rank)."""


BAD_INPUT, OUT_OF_ORDER, ENGINE_SETUP = 400, 409, 500
"""A refused RL API call's HTTP status (``RLCallResult.status``, ``inflight.engine.transfer_engine.
RLApiError.status``): the call's input is wrong; the call comes out of order (an update not
open, or open already; before the engine's start; a version or config the engine's state
refuses); the engine itself was started wrong."""


class RLCallResult(_Result):
    """``inflight_rl_*``: one worker's part of a call of vLLM's RL API on the ``inflight``
    backend (``inflight.engine.transfer_engine``). A refusal comes back as ``ok=False`` with
    its reason, never raised: an error raised in one worker of vLLM's ``mp`` executor leaves
    the other workers' replies queued for the next call."""

    rank: NonNeg
    ok: bool = True
    error: str = ""
    status: int = BAD_INPUT
    """A refusal's HTTP status."""
    version: NonNeg | None = None
    """``update_weights``: the version of the update this worker was told of."""


class PrefixCacheStats(_Result):
    """What an engine's prefix-cache guard did since it started (``inflight.engine.prefix_cache``)."""

    enabled: bool = False
    """Whether the engine runs with prefix caching (then every commit invalidates it exactly)."""
    invalidations: NonNeg = 0
    """Commits that dropped the block pool's hash index."""
    dropped_blocks: NonNeg = 0
    """Blocks whose cached KV those commits made unreachable."""
    restarted_prefills: NonNeg = 0
    """Requests caught mid-prefill at a commit and recomputed under the new weights."""
    frozen_requests: NonNeg = 0
    """Requests that held KV at a commit (summed over commits): they decode on their own
    blocks and insert none into the index."""
    recomputed: NonNeg = 0
    """Requests whose KV vLLM recomputed (a preemption for KV space) under weights newer than
    those their earlier tokens were sampled with."""
    recomputed_ids: tuple[str, ...] = ()
    """The last of those (up to 64), by vLLM request id."""
    last_commit_us: float = 0.0
    """What the last invalidation took inside the commit window."""


class EngineState(_Result):
    """The engine's commit coordinator, as ``inflight_status`` reports it."""

    live_version: NonNeg
    steps: NonNeg
    broken: str
    commits: NonNeg
    label: str = ""
    """The version label outputs carry now (a hybrid mid layer-granular update)."""
    prefix_cache: PrefixCacheStats = PrefixCacheStats()
    spec_decode: tuple[VersionSpecStats, ...] = ()
    """Per live version, oldest first (at most ``spec_decode.KEPT_VERSIONS``); empty without speculation."""


class WorkerStatus(_Result):
    """``inflight_status``: one worker's listener and commits, with its engine's state."""

    started: bool
    rank: NonNeg = 0
    joined: bool = False
    listening: bool = False
    generation: tuple[str, NonNeg] | None = None
    live_version: NonNeg = 0
    model_steps: NonNeg = 0
    """Engine steps this worker ran the model in (its ``execute_model`` calls with tokens scheduled)."""
    committed: NonNeg = 0
    rejections: dict[str, NonNeg] = {}
    rejoins: NonNeg = 0
    dropped_staging: NonNeg = 0
    aborted: NonNeg = 0
    """Updates the trainer called off after this worker accepted them (``ListenerStats.aborted``)."""
    last_error: str = ""
    commits: tuple[WorkerCommitResult, ...] = ()
    engine: EngineState | None = None
    staging_peak_bytes: NonNeg = 0
    """The most staging bytes this worker ever held at once (``StagingPool.peak_bytes``)."""


def as_result(value: Any, kind: type[R]) -> R:
    """``value`` as ``kind``: a result as returned in-process, or its map from another process."""
    return value if isinstance(value, kind) else msgspec.convert(value, kind)
