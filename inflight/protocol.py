"""The wire protocol between the trainer and the engine workers: one module, imported by
both sides, importing only msgspec. Every message is a frozen, tagged msgspec Struct encoded as msgpack, and
each channel has one typed decoder, so a peer can only produce that channel's types. No pickle. Channels:
- control (trainer -> workers, on the store): ``UpdateAnnounce`` | ``Commit`` | ``Abort`` | ``Shutdown``
- frames (trainer -> workers, in-band on the data plane): ``BucketHeader`` + bytes, or one ``Abort``
- replies (each worker -> trainer, on the store): ``Accepted`` | ``Staged`` | ``Rejected`` | ``Committed``
- rollouts (engine -> trainer, the rollout queue): ``RolloutGroup`` of ``RolloutSample``; ``EngineReport``
- trainer ranks (rank 0 <-> the others, ``inflight.trainer.ranks``): ``TrainerSetup`` | ``TrainerOrder`` |
  ``TrainerSave`` | ``TrainerStop``; ``TrainerPart``
- engine (each worker <-> its engine's commit coordinator, on the store): ``CommitReady`` | ``EngineCommitted``
  | ``EngineCommitFailed``; the coordinator's ``collective_rpc`` results ``WorkerCommitResult``,
  ``WorkerSettleResult``; a commit's ``CommitInfo``

One update (two-phase): ``UpdateAnnounce(v)`` -> ``Accepted``/``Rejected`` from every worker -> each bucket's
frame if all accepted, else one ``Abort`` frame -> ``Staged``/``Rejected`` -> ``Commit(v)`` if all staged,
else ``Abort(v)`` -> ``CommitReady(v)``; the coordinator commits v on all of its engine's workers at one step
boundary, or on none -> ``Committed``/``Rejected``. A layer-granular update sends one announce per layer group
and no ``Commit``: each worker posts ``CommitReady`` as a group verifies and replies ``Committed`` once it is
live. Every worker takes every frame, so the data plane never falls out of step; frames are broadcast, or,
when every member sent a ``ShardPlan``, sent to each worker alone (``ForEachRank``).
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Union  # typing only: the protocol imports nothing else

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = 2

# Names are torch dtype names without the "torch." prefix.
ModelDtype = Literal["float32", "bfloat16"]
"""The dtypes an engine serves and a trainer trains in (``model.dtype``)."""
CastDtype = Literal[ModelDtype, "float16"]
"""The dtypes a push may cast weights to (``PushConfig.dtype``)."""
WireDtype = Literal[CastDtype, "float64", "float8_e4m3fn", "float8_e5m2", "int64", "int32", "int8", "uint8", "bool"]
DTYPE_ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
                                  "float8_e4m3fn": 1, "float8_e5m2": 1,  # float8: an FP8 checkpoint's
                                  "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}
ALIGN = 64
"""Every tensor's offset in an update's byte stream is a multiple of this many bytes (a cache
line; every wire dtype's size divides it), and so is every bucket's size."""
ChecksumAlgo = Literal["xxh3", "crc32", "wsum64"]
"""A bucket's checksum (``inflight.transport.bucket.checksum``)."""
CommitUnit = Literal["model", "layer"]
"""What an engine commits at once: the whole model, or one layer group (``inflight.layer_groups``)."""
RejectCode = Literal[
    "bad_message", "stale_version", "unknown_tensor", "missing_tensor", "bad_shape", "bad_dtype", "bad_layout",
    "checksum", "short_bucket", "bucket_order", "incomplete", "prepare_failed", "commit_failed", "timeout",
    "aborted", "nonfinite", "no_memory", "unauthenticated", "wrong_base"]
# Key prefix, under the group's name in its store, of one engine's commit channel.
ENGINE_CHANNEL = "engine"

NonNeg = Annotated[int, Meta(ge=0)]
Pos = Annotated[int, Meta(gt=0)]


class ProtocolError(ValueError):
    """A message that does not decode into the channel's types, or breaks an invariant."""


class AuthError(ProtocolError):
    """A message not sealed with this side's shared secret (``INFLIGHT_SECRET``s differ, only
    one side has one, or a stray client wrote it)."""


class Wire(Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind"):
    """Base of every message: frozen, unknown fields rejected, tagged by ``kind``."""


class TensorSpec(Struct, frozen=True, forbid_unknown_fields=True):
    """Where one named tensor sits in the flat byte stream of an update."""

    name: Annotated[str, Meta(min_length=1)]
    shape: tuple[NonNeg, ...]
    dtype: WireDtype
    offset: NonNeg
    nbytes: NonNeg
    start: tuple[NonNeg, ...] = ()
    """With a shard plan: where the box starts in the whole tensor (``shape`` is the box's)."""

    def __post_init__(self) -> None:
        numel = 1
        for d in self.shape:
            numel *= d
        if self.start and len(self.start) != len(self.shape):
            raise ValueError(f"tensor {self.name!r}: box start {self.start} for shape {self.shape}")
        if numel * DTYPE_ITEMSIZE[self.dtype] != self.nbytes:
            raise ValueError(
                f"tensor {self.name!r}: nbytes={self.nbytes} but shape {self.shape} of {self.dtype} "
                f"needs {numel * DTYPE_ITEMSIZE[self.dtype]}"
            )
        if self.offset % DTYPE_ITEMSIZE[self.dtype]:
            raise ValueError(f"tensor {self.name!r}: offset {self.offset} not aligned to {self.dtype}")


class BucketSpec(Struct, frozen=True, forbid_unknown_fields=True):
    """One fixed-size window ``[offset, offset + nbytes)`` of the flat stream."""

    index: NonNeg
    offset: NonNeg
    nbytes: Pos


SparseCodec = Literal["index", "xor_zstd"]
"""How a changed tensor travels in a sparse update (``inflight.transport.delta``)."""


class Changed(Struct, frozen=True, forbid_unknown_fields=True):
    """One tensor of a sparse update that travels as its changes against the base. ``index``
    codec: the flat indices of the elements that changed (the int32 wire tensor ``index``)
    and their new values (the wire tensor ``values``, in the tensor's dtype). ``xor_zstd``:
    the tensor's bits xor the base's, zstd-compressed (``values``, uint8; no ``index``).
    ``digest``: the announce's checksum of the whole rebuilt tensor's bytes, the result, not
    the delta."""

    name: Annotated[str, Meta(min_length=1)]
    values: Annotated[str, Meta(min_length=1)]
    digest: NonNeg
    codec: SparseCodec = "index"
    index: str = ""


class Delta(Struct, frozen=True, forbid_unknown_fields=True):
    """A sparse update (``inflight.transport.delta``): the announce's tensors are the wire
    stream, and ``result`` lays the weights out as a dense update of them would. A result
    tensor is either a wire tensor of its name, sent whole, or ``changed`` against the bytes
    of ``base_version`` the worker keeps; a worker without them refuses (``wrong_base``)."""

    base_version: NonNeg
    result: tuple[TensorSpec, ...]
    result_bytes: NonNeg
    changed: tuple[Changed, ...]


class UpdateAnnounce(Wire, tag="announce"):
    """Trainer -> workers: the complete layout of policy version ``version``."""

    version: NonNeg
    total_bytes: NonNeg
    bucket_bytes: Pos
    checksum_algo: ChecksumAlgo
    tensors: tuple[TensorSpec, ...]
    buckets: tuple[BucketSpec, ...]
    protocol: int = PROTOCOL_VERSION
    plan_digest: str = ""
    """The digest of the worker's ``ShardPlan`` its boxes follow ("": whole tensors)."""
    part: NonNeg = 0
    parts: NonNeg = 0
    """Layer-granular (``parts`` > 0): exactly the tensors of layer group ``part`` of ``parts``."""
    delta: Delta | None = None
    """A sparse update: how its wire tensors rebuild the weights (None: the tensors are the weights)."""

    def __post_init__(self) -> None:
        if self.protocol != PROTOCOL_VERSION:
            raise ValueError(f"protocol {self.protocol} != {PROTOCOL_VERSION}")
        if self.parts and self.part >= self.parts:
            raise ValueError(f"part {self.part} of {self.parts}: parts count from 0")
        end = 0
        for i, b in enumerate(self.buckets):
            if b.index != i or b.offset != end:
                raise ValueError(f"bucket {b.index} at offset {b.offset}: buckets must tile the stream in order")
            if b.nbytes > self.bucket_bytes:
                raise ValueError(f"bucket {b.index} has {b.nbytes} bytes > bucket_bytes={self.bucket_bytes}")
            end += b.nbytes
        if end != self.total_bytes:
            raise ValueError(f"buckets cover {end} bytes, total_bytes={self.total_bytes}")
        _check_layout(self.tensors, self.total_bytes)
        if self.delta is not None:
            _check_delta(self.delta, self.tensors, layered=self.parts > 0)


def _check_layout(tensors: tuple[TensorSpec, ...], total_bytes: int) -> None:
    names: set[str] = set()
    for t in tensors:
        if t.name in names:
            raise ValueError(f"tensor {t.name!r} listed twice")
        names.add(t.name)
        if t.offset + t.nbytes > total_bytes:
            raise ValueError(f"tensor {t.name!r} ends at {t.offset + t.nbytes} > total_bytes={total_bytes}")
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors if t.nbytes)
    for (_, a_end, a), (b_start, _, b) in zip(spans, spans[1:]):
        if b_start < a_end:
            raise ValueError(f"tensors {a!r} and {b!r} overlap")


def _check_delta(delta: Delta, tensors: tuple[TensorSpec, ...], *, layered: bool) -> None:
    """Every result tensor is a wire tensor of its shape and dtype, or an index (int32) and
    values (its dtype) of one length; every wire tensor is used once."""
    if layered:
        raise ValueError("a sparse update is whole-model: layer groups travel dense")
    _check_layout(delta.result, delta.result_bytes)
    wire = {t.name: t for t in tensors}
    changed = {c.name: c for c in delta.changed}
    used: list[str] = []
    for r in delta.result:
        c = changed.pop(r.name, None)
        if c is None:
            w = wire.get(r.name)
            if w is None or (w.shape, w.dtype) != (r.shape, r.dtype):
                raise ValueError(f"delta: result tensor {r.name!r} is neither sent whole nor changed")
            used.append(r.name)
            continue
        index, values = wire.get(c.index), wire.get(c.values)
        if c.codec == "xor_zstd":
            if values is None or values.dtype != "uint8" or len(values.shape) != 1 or c.index:
                raise ValueError(f"delta: {r.name!r} changes by wire tensor {c.values!r}, which is not one uint8 "
                                 "zstd frame (and no index)")
            used.append(c.values)
            continue
        if index is None or values is None or index.dtype != "int32" or values.dtype != r.dtype \
                or len(index.shape) != 1 or index.shape != values.shape:
            raise ValueError(f"delta: {r.name!r} changes by wire tensors {c.index!r} and {c.values!r}, which are "
                             f"not an int32 index and {r.dtype} values of one length")
        used += [c.index, c.values]
    if changed:
        raise ValueError(f"delta: changes for tensors not in the result: {sorted(changed)[:3]}")
    if sorted(used) != sorted(wire):
        raise ValueError(f"delta: wire tensors used {len(used)} times for {len(wire)} sent (each exactly once)")


class BucketHeader(Wire, tag="bucket"):
    """Sent in-band right before bucket ``index``'s bytes, so order and size are checked; its
    checksum and MAC are made as it is packed (the announce goes before any byte is read)."""

    version: NonNeg
    index: NonNeg
    offset: NonNeg
    nbytes: Pos
    checksum: NonNeg
    mac: bytes = b""
    """With a shared secret: the bucket's keyed MAC (``auth.bucket_mac``). The checksum catches
    corruption; ``wsum64`` is linear, so only the MAC stops a forged bucket with a valid one."""


class ForEachRank(Wire, tag="for_each_rank"):
    """Trainer -> workers: message ``seq`` differs per worker; each reads its own at ``msg/<seq>/<rank>``."""


class Commit(Wire, tag="commit"):
    """Trainer -> workers: every bucket of ``version`` was sent; swap it in at the next step boundary."""

    version: NonNeg


class Abort(Wire, tag="abort"):
    """Trainer -> workers: drop the staged ``version``; live weights stay as they are."""

    version: NonNeg
    reason: str = ""


class Shutdown(Wire, tag="shutdown"):
    """Trainer -> workers: the trainer is leaving the group; stop listening."""
    reason: str = ""


class TensorShard(Struct, frozen=True, forbid_unknown_fields=True):
    """The box of checkpoint tensor ``name`` one worker's loaders read: ``start[i]`` ..
    ``start[i] + length[i]`` along every dim (the whole tensor: zeros and its shape)."""

    name: Annotated[str, Meta(min_length=1)]
    start: tuple[NonNeg, ...]
    length: tuple[NonNeg, ...]


class ShardPlan(Struct, frozen=True, forbid_unknown_fields=True):
    """What one worker consumes of each checkpoint tensor (``inflight.shard_plan``), sent in
    its ``Joined``; ``digest`` (of the shards) is checked by the trainer and echoed back."""

    shards: tuple[TensorShard, ...]
    fallbacks: tuple[str, ...] = ()
    """Tensors whose loaders do more than copy boxes of them: they need the whole tensor."""
    digest: str = ""


class Joined(Wire, tag="joined"):
    """Worker -> trainer, once per group generation, before the data plane forms: who joins
    and which version it serves (a restarted trainer continues above the engines' versions)."""

    rank: NonNeg
    live_version: NonNeg
    incarnation: str
    """A random id per worker process: a restarted engine is told apart from a rejoining one."""
    engine_ranks: tuple[NonNeg, ...] = ()
    """Every weight-group rank of this worker's engine (empty: ``rank``); admitted whole or not at all."""
    plan: ShardPlan | None = None
    """What this worker's loaders read of each tensor; None: it needs every tensor whole."""
    label: str = ""
    """A hybrid the engine serves (``inflight.layer_groups``; ``live_version`` is its oldest)."""
    commit_unit: CommitUnit = "model"
    """``layer``: the trainer sends this worker one announce per layer group."""
    wire_dtypes: dict[str, str] = {}
    """Tensors an update carries in a dtype of their own (not the push's), by name: fp32 ones of a bf16 engine."""
    keeps_base: bool = False
    """This worker keeps its live version's bytes (``InflightConfig.keep_base``): sparse updates against it can
    rebuild."""


class Accepted(Wire, tag="accepted"):
    """Worker -> trainer: the announce is valid and staging is ready for its buckets."""
    rank: NonNeg
    version: NonNeg


class Staged(Wire, tag="staged"):
    """Worker -> trainer: every bucket of ``version`` arrived and matched its checksum
    (``steps_during_transfer``: engine steps run while they arrived)."""

    rank: NonNeg
    version: NonNeg
    receive_ms: Annotated[float, Meta(ge=0)]
    steps_during_transfer: NonNeg


class Rejected(Wire, tag="rejected"):
    """Worker -> trainer: the update was refused; live weights and version are unchanged."""

    rank: NonNeg
    version: NonNeg
    code: RejectCode
    reason: str
    live_version: NonNeg


class Left(Wire, tag="left"):
    """Worker -> trainer, the answer to ``Shutdown``: this worker (and its engine's coordinator)
    let go of the trainer's store, so the trainer may close it without a peer's read failing."""

    rank: NonNeg


class Committed(Wire, tag="committed"):
    """Worker -> trainer: ``version`` is live from engine step ``step + 1`` on (``step``: model
    steps before the commit). ``tokens_at_commit``: each running request's (user id) output
    tokens at the commit, the index of its first token tagged ``version``;
    ``steps_since_first_bucket``: steps decoded between the first bucket and the commit."""

    rank: NonNeg
    version: NonNeg
    step: NonNeg
    commit_ms: Annotated[float, Meta(ge=0)]
    steps_since_first_bucket: NonNeg
    tokens_at_commit: dict[str, NonNeg] = {}
    part: NonNeg = 0
    parts: NonNeg = 0
    label: str = ""  # layer-granular: the group committed and the label it left


# the commit round trip inside one engine: its workers and its commit coordinator ----------
# (engine channel, on the store; collective_rpc results)

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


class CommitInfo(Struct, frozen=True, forbid_unknown_fields=True):
    """What a commit came to on one worker: the step it went live after, its stall, the tokens
    each request had then, and the engine's label from then on (a hybrid after a layer group's)."""

    step: NonNeg
    commit_ms: Annotated[float, Meta(ge=0)]
    tokens_at_commit: dict[str, NonNeg] = {}
    label: str = ""


class WorkerCommitResult(Struct, frozen=True, forbid_unknown_fields=True):
    """``inflight_commit``: one worker's part of an engine's commit, on its execution thread."""

    rank: NonNeg
    version: NonNeg
    ok: bool
    applied: bool = False
    """Whether the new weights went live here (to be taken back if another rank failed)."""
    error: str = ""
    ms: float = 0.0
    thread: str = ""
    main_thread: bool = False
    execution_thread: bool | None = None
    """Whether it ran on the thread of the worker's model steps (None: not known)."""


class WorkerSettleResult(Struct, frozen=True, forbid_unknown_fields=True):
    """``inflight_confirm`` / ``inflight_rollback``: one worker kept ``version`` as its live
    one, or took it back (or had nothing of it live)."""

    rank: NonNeg
    version: NonNeg
    ok: bool
    error: str = ""


class RolloutSample(Wire, tag="sample"):
    """One completion with its per-token behaviour log-probs and policy-version tags."""

    sample_id: Annotated[str, Meta(min_length=1)]
    group_id: Annotated[str, Meta(min_length=1)]
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[NonNeg]
    reward: float
    finish_reason: str = ""
    prompt_text: str = ""
    completion_text: str = ""
    routing: bytes = b""
    """Mixture-of-experts engines recording routing: each token's top-k expert ids in every MoE
    layer, int16 little-endian, row-major ``[tokens, routing_layers, routing_k]`` (empty: none)."""
    routing_layers: NonNeg = 0
    routing_k: NonNeg = 0
    hybrid_tokens: NonNeg = 0
    """Tokens sampled by a hybrid of a layer-granular update (tagged with its oldest version)."""
    observation: list[bool] = []
    """A multi-turn episode (``inflight.trainer.tasks.episode``): True on the environment's tokens
    (observations, tool output) between the policy's turns. They carry log-prob 0 and the
    version of the token before them, and are masked from the loss. Empty: every token is
    the policy's."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.hybrid_tokens > n:
            raise ValueError(f"sample {self.sample_id!r}: {self.hybrid_tokens} hybrid tokens of {n}")
        if self.observation and (len(self.observation) != n or self.observation[0]):
            raise ValueError(f"sample {self.sample_id!r}: {len(self.observation)} observation flags for {n} tokens "
                             f"(the first token is the policy's)")
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"sample {self.sample_id!r}: {n} tokens but {len(self.logprobs)} log-probs "
                f"and {len(self.versions)} version tags"
            )
        if self.routing and len(self.routing) != 2 * n * self.routing_layers * self.routing_k:
            raise ValueError(
                f"sample {self.sample_id!r}: {len(self.routing)} routing bytes for {n} tokens x "
                f"{self.routing_layers} layers x {self.routing_k} experts (int16)"
            )


class Sampling(Struct, frozen=True, forbid_unknown_fields=True):
    """The sampling parameters a group was drawn with, as the engine applied them. The behaviour
    log-probs are the engine's *processed* distribution (vLLM's ``processed_logprobs``: after
    penalties, temperature, top-k, top-p and min-p); the trainer scores its policy under its
    own temperature, top-k and top-p, and any difference biases every importance ratio."""

    temperature: float = 1.0
    top_k: int = 0
    """0 or -1: off."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def transforms(self) -> list[str]:
        """The transforms beyond temperature that are on, as ``name=value``."""
        off = {"top_k": (0, -1), "top_p": (1.0,), "min_p": (0.0,), "repetition_penalty": (1.0,),
               "presence_penalty": (0.0,), "frequency_penalty": (0.0,)}
        return [f"{name}={getattr(self, name)}" for name, neutral in off.items() if getattr(self, name) not in neutral]


class VersionSpecStats(Struct, frozen=True, forbid_unknown_fields=True):
    """Speculative decoding under one live version (``inflight.engine.spec_decode``): in the
    worker's status, and with each rollout group the engine ships (``RolloutGroup.engine_spec``)."""

    version: NonNeg
    steps: NonNeg = 0
    """Request-steps that emitted tokens under this version (a request in one engine step)."""
    emitted: NonNeg = 0
    """Tokens those request-steps emitted."""
    drafted: NonNeg = 0
    """Draft tokens they verified."""
    accepted: NonNeg = 0
    """Draft tokens they accepted."""

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0


class RolloutGroup(Wire, tag="group"):
    """All samples drawn for one prompt (a GRPO group), sent together once the last finishes."""

    group_id: Annotated[str, Meta(min_length=1)]
    samples: tuple[RolloutSample, ...]
    engine_id: str = ""
    """Which engine of the fleet sampled it (``inflight.trainer.rollout.engine_process``: ``e<index>``)."""
    sampling: Sampling | None = None
    """How it was sampled (None: not reported); the trainer refuses groups whose distribution
    it cannot reproduce (``inflight.rollout_queue.check_group``)."""
    engine_ledger: dict[str, int] = {}
    """The engine's rollout totals when it shipped this group: groups scored and failed, and
    for a multi-turn task its episodes started, finished, failed, dropped and shipped
    (``inflight.trainer.rollout.episode_rollout.EpisodeRollout.counts``). Empty: not reported."""
    engine_spec: tuple[VersionSpecStats, ...] = ()
    """The engine's speculative decoding when this group finished, per live version, oldest
    first, counted since the engine started (``EngineState.spec_decode``). Empty: no speculation."""

    def __post_init__(self) -> None:
        for s in self.samples:
            if s.group_id != self.group_id:
                raise ValueError(f"sample {s.sample_id!r} of group {s.group_id!r} filed under {self.group_id!r}")


class EngineReport(Wire, tag="report"):
    """Engine -> trainer, through the rollout queue's store: a problem the trainer must show
    (``fatal = False``: the first failure of a kind) or stop the run for (``fatal``)."""

    engine_id: str
    message: Annotated[str, Meta(min_length=1)]
    fatal: bool = False


class Roster(Wire, tag="roster"):
    """Trainer -> workers, once per group generation: the worker ranks that formed it, in
    data-plane order (the i-th member is data-plane rank i + 1). A worker not listed waits
    for the next generation."""

    generation: Pos
    members: tuple[Pos, ...]
    point_to_point: bool = False
    """Every member sent a shard plan: frames go to each worker alone, each its own bytes."""


class TrainerSetup(Wire, tag="trainer_setup"):
    """Trainer rank 0 -> every other rank, once: where the policy the ranks shard is, so each
    loads the same weights (``inflight.trainer.ranks``)."""

    model_dir: Annotated[str, Meta(min_length=1)]
    reference_dir: str = ""
    """``loss.kl_coef``'s reference model ("": ``model_dir``)."""
    adapter_dir: str = ""
    """A LoRA run's adapter, trained on ``model_dir`` as its frozen base ("": no adapter)."""
    resume: bool = False
    """Every rank loads its share of the optimizer state from ``model_dir``'s checkpoint."""


class TrainerOrder(Wire, tag="trainer_order"):
    """Rank 0 -> rank r, once per optimizer step: r's whole groups of the batch, and what the
    step needs of the rest of it."""

    step: Annotated[int, Meta(ge=0)]
    """The optimizer step (0 for the first)."""
    version: int
    """The trainer's version the loss scores against."""
    groups: tuple[RolloutGroup, ...]
    n_tokens: Annotated[float, Meta(gt=0)]
    """The whole batch's real completion tokens: every rank's loss divides by it."""
    passes: Annotated[int, Meta(ge=1)] = 1
    """Forward and backward passes (micro-batches): the same on every rank, whose FSDP
    collectives pair up pass by pass."""


class TrainerSave(Wire, tag="trainer_save"):
    """Rank 0 -> every other rank: write your share of the optimizer state into ``path`` (one
    ``torch.distributed.checkpoint``, written by all ranks at once)."""

    path: Annotated[str, Meta(min_length=1)]


class TrainerStop(Wire, tag="trainer_stop"):
    """Rank 0 -> every other rank: the run is over (``reason`` says why); leave."""

    reason: str = ""


class TrainerPart(Wire, tag="trainer_part"):
    """Rank r -> rank 0, once per step: r's rows of the batch's log-probs, entropies and
    reference log-probs, float32 bytes (rows x cols), for the whole batch's metrics."""

    rows: Annotated[int, Meta(ge=0)]
    cols: Annotated[int, Meta(ge=0)]
    logp: bytes
    entropy: bytes
    ref: bytes = b""
    routing_rows: NonNeg = 0
    """Routing replay (``loss.routing_replay``): the (token, MoE layer) rows r replayed, and
    those where r's router would have chosen other experts than the engine did."""
    routing_differ: NonNeg = 0
    tokens: NonNeg = 0
    """The tokens r ran forward as laid out, and of those the ones before a completion."""
    prompt_tokens: NonNeg = 0


ControlMessage = Union[UpdateAnnounce, ForEachRank, Commit, Abort, Shutdown, Roster]
FrameMessage = Union[BucketHeader, Abort]
ReplyMessage = Union[Joined, Accepted, Staged, Rejected, Committed, Left]
EngineMessage = Union[CommitReady, EngineCommitted, EngineCommitFailed]

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Wire) -> bytes:  # any protocol message, as msgpack bytes
    return _encoder.encode(msg)


def decoder(types: Any, channel: str) -> Callable[[bytes | memoryview], Any]:
    """A decoder of one channel: it yields only that channel's types, or raises ``ProtocolError``."""
    decoder = msgspec.msgpack.Decoder(types)

    def decode(data: bytes | memoryview) -> Any:
        try:
            return decoder.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise ProtocolError(f"bad {channel} message: {e}") from None
    return decode


decode_control: Callable[[bytes | memoryview], ControlMessage] = decoder(ControlMessage, "control")
decode_frame: Callable[[bytes | memoryview], FrameMessage] = decoder(FrameMessage, "frame")
decode_reply: Callable[[bytes | memoryview], ReplyMessage] = decoder(ReplyMessage, "reply")
decode_engine: Callable[[bytes | memoryview], EngineMessage] = decoder(EngineMessage, "engine")
decode_sample: Callable[[bytes | memoryview], RolloutSample] = decoder(RolloutSample, "rollout sample")
decode_group: Callable[[bytes | memoryview], RolloutGroup] = decoder(RolloutGroup, "rollout group")
decode_report: Callable[[bytes | memoryview], EngineReport] = decoder(EngineReport, "engine report")
decode_trainer: Callable[[bytes | memoryview], TrainerSetup | TrainerOrder | TrainerSave | TrainerStop] = decoder(
    Union[TrainerSetup, TrainerOrder, TrainerSave, TrainerStop], "trainer order")
decode_trainer_part: Callable[[bytes | memoryview], TrainerPart] = decoder(TrainerPart, "trainer part")

