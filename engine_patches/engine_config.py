"""Configuration of an in-flight engine worker; travels to the worker as JSON."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from inflight.adapter import AdapterSpec
from inflight.engine.prefix_cache import caching_off_reason
from inflight.protocol import CommitUnit
from inflight.settings import Backend, CommitChoice, StagingPlace, check_choices
from inflight.transport.group_config import GroupConfig

log = logging.getLogger(__name__)

WORKER_EXTENSION = "inflight.engine.worker.InflightWorkerExtension"
STAGING_INTENT_KEY = "inflight_staging"
"""The key of the staging intent in vLLM's ``additional_config`` (``engine_kwargs(reserve_staging=...)``)."""


@dataclass(frozen=True, kw_only=True)
class PackedWireConfig:
    """vLLM's ``nccl`` weight-transfer wire, as a trainer of that backend sends its init info
    (``NCCLWeightTransferInitInfo``, e.g. TRL's ``WeightTransferClient``): the engine's
    workers join the trainer's group and receive its packed broadcast on the listener thread
    (``inflight.transport.packed_wire``; ``inflight.engine.packed_receiver``)."""

    master_address: str | None = None
    """Where the trainer (group rank 0) hosts the group's rendezvous store."""
    master_port: int | None = None
    """Its port."""
    rank_offset: int = 1
    """Group rank of this engine's first worker (worker i joins as ``rank_offset + i``)."""
    world_size: int
    """The trainer and every receiving worker."""
    nccl_unique_id_b64: str | None = None
    """vLLM's torch-free rendezvous (NCCL only): the trainer's ``ncclUniqueId``, base64."""
    packed: bool = False
    """Chunks of many tensors (``packed_buffer_size_bytes`` each, at least); else one
    broadcast per tensor."""
    packed_buffer_size_bytes: int = 1 << 30
    """vLLM's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES``: where a chunk is cut."""
    packed_num_buffers: int = 2
    """The sender's buffers in flight (no effect on the bytes or their order)."""

    def __post_init__(self) -> None:
        if (self.master_address is None or self.master_port is None) == (self.nccl_unique_id_b64 is None):
            raise ValueError("PackedWireConfig: give master_address and master_port, or nccl_unique_id_b64 (one of the "
                             f"two rendezvous), not master_address={self.master_address!r}, "
                             f"master_port={self.master_port!r} with nccl_unique_id_b64 "
                             f"{'set' if self.nccl_unique_id_b64 else 'unset'}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"PackedWireConfig.master_port={self.master_port} is not a TCP port")
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(f"PackedWireConfig.rank_offset={self.rank_offset} outside 1..world_size-1="
                             f"{self.world_size - 1} (the trainer is rank 0)")
        if self.packed_buffer_size_bytes <= 0 or self.packed_num_buffers <= 0:
            raise ValueError(f"PackedWireConfig.packed_buffer_size_bytes={self.packed_buffer_size_bytes} and "
                             f"packed_num_buffers={self.packed_num_buffers} must be > 0")


@dataclass(frozen=True, kw_only=True)
class InflightConfig:
    """What one engine worker needs to join the weight group and commit updates."""

    group: GroupConfig
    """Where the trainer's group lives; ``world_size`` counts the trainer and every engine worker."""
    rank: int = 1
    """The weight-group rank of this engine's first worker (the trainer is 0). An engine with
    W workers (tensor parallel size W) takes ranks ``rank .. rank + W - 1``: worker i of the
    engine (vLLM's worker rank) joins as ``rank + i``."""
    initial_version: int = 0
    """Version of the weights the engine loaded (non-zero when resuming from a checkpoint)."""
    commit: CommitChoice = "auto"
    """How staged weights become live: ``swap`` (load and re-pack before the commit, swap at it;
    eager CPU), ``reload`` (layerwise reload at the commit; compiled CPU, quantized), ``copy``
    (one device copy per tensor; CUDA, unquantized); ``auto`` picks in that order."""
    commit_timeout_s: float = 30.0
    """Longest wait for a step boundary once a commit is requested."""
    stale_timeout_s: float = 120.0
    """A staged version whose ``Commit`` does not come within this is dropped (the trainer died)."""
    listener_nice: int = 0
    """Scheduling priority (Linux nice, 0..19) of the listener thread. 0, an equal share, by
    default: an update that cannot stage cannot land. Measured with the training loop on
    split cores (the engine alone on one core that decode keeps busy, ``inflight.bench.e2e``), nice
    19 starved staging: a 1.3 MB push took 220 ms, the trainer waited for it every step and
    the engine sampled at the lag limit; at 0 the push took 63 ms and the step 158 ms
    against 225. 19 makes staging yield to decode where both share idle cores (what
    ``inflight.bench.inflight --listener-nice 19`` measured); on a GPU engine the listener mostly
    waits on the device and its priority matters little."""
    listener_cpus: tuple[int, ...] = ()
    """CPUs the listener thread runs on (Linux affinity); () keeps the worker thread's. On a
    host whose engine thread is pinned (vLLM's CPU backend binds it to its OpenMP cores),
    a listener on other cores takes no CPU from decode: the two share only the GIL."""
    staging: StagingPlace = "device"
    """Where a version waits between its buckets' arrival and its commit. ``device``: the
    engine's device; the commit is a device-to-device copy (or, on CPU, a swap), but the
    staging bytes come out of memory the KV cache could have had. ``host``: pinned host
    memory; no device memory beyond one bucket, but the commit becomes a host-to-device
    copy of this rank's shard, inside the stall. The same on a CPU engine."""
    keep_rollback: bool = True
    """Keep the live version's bytes staged after each commit, so a commit that fails on any
    rank restores the exact previous weights on every rank. Costs one more update's bytes
    (where ``staging`` says); the weights the engine loaded are read into it at start, so a
    failed first commit restores them from memory too. Nothing is ever read from disk inside
    the engine's stall: without it, a failed ``reload``/``copy`` commit stops the engine
    (fail-stop, with the reason; a supervisor restarts it) rather than serve a mix of two
    versions. The ``swap`` commit needs no copy: it swaps the old modules back, which it
    keeps only inside the commit's window."""
    keep_base: bool = False
    """Take sparse updates (``PushConfig(encoding="sparse")``, ``inflight.transport.delta``):
    keep the live version's bytes after each commit, the base the next update's changed
    elements are written onto. Costs one update's bytes for the base (none where the
    rollback copy already holds them) and one for a sparse update's wire bytes, where
    ``staging`` says. Whole-model commits only (``commit_unit="model"``)."""
    max_bucket_mb: float = 256.0
    """The largest bucket this worker lands, in MiB: its bucket windows (scratch for a bad
    bucket; landing windows for host staging on a GPU) are reserved at start at this size,
    and an update in larger buckets is refused. The trainer's ``bucket_mb`` must not exceed
    it (the training entry point passes its own)."""
    check_finite: bool = True
    """Refuse updates with NaN or Inf in any floating tensor, before they are staged."""
    record_routing: bool = False
    """Mixture-of-experts engines: record, for every sampled token, the top-k expert ids of
    every MoE layer (``CompletionOutput.routed_experts``, ``[tokens, moe_layers, k]`` int16,
    ``inflight.engine.routing``), for routing replay in the trainer. Costs one small RPC per
    engine step and 2 x layers x k bytes per token; refused on a model without MoE layers."""
    commit_unit: CommitUnit = "model"
    """What commits at once. ``model``: the whole version, at one step boundary (a version is
    atomic across the engine's ranks and, with one weight group, across engines). ``layer``:
    one layer group at a time (``inflight.layer_groups``: the embeddings, each decoder layer,
    the final norm and head), each at the first step boundary after its bytes arrived and
    were verified and prepared on every rank; the engine serves, and tags tokens with, the
    hybrid in between (``"5>6:3"``). Staging holds ``staged_groups`` groups, not a model; the
    stall of each commit is one group's. Needs the ``swap`` or the ``copy`` commit."""
    staged_groups: int = 2
    """``commit_unit="layer"``: layer groups staged at once on a rank (1 or 2): one waits for
    its step boundary while the next arrives. More would not shorten an update: groups
    commit one per engine step, so an update takes at least as many steps as it has groups,
    and two already keep the wire busy while a commit waits for its step."""
    require_processed_logprobs: bool = True
    """Refuse to start unless the engine reports processed (temperature-scaled) log-probs,
    the behaviour log-probs the trainer's importance ratios need."""
    adapter: AdapterSpec | None = None
    """An adapter-only engine: the base weights never move; updates carry the policy LoRA
    adapter's tensors, which commit into the engine's one adapter slot (the ``lora``
    commit). Start the engine with ``engine_kwargs(adapter=...)``; every request must
    name this adapter (``inflight.engine.client.policy_lora``)."""
    wire: PackedWireConfig | None = None
    """Receive vLLM's ``nccl`` wire (its packed broadcast) instead of the trainer's weight
    group: set by the RL API's ``init_weight_transfer_engine`` when a trainer of that backend
    sends its init info (``inflight.engine.rl_api``). ``group`` is then the engine's own
    commit channel, a store EngineCore hosts on loopback."""
    checkpoints: bool = False
    """Take updates from checkpoint directories (prime-rl's ``update_weights_from_path``, the
    RL API's ``update_info.weight_dir``) instead of the trainer's weight group: each is read
    into staging while the engine decodes (``inflight.engine.checkpoint_reader``). ``group`` is
    then the engine's own commit channel, as with ``wire``."""

    def __post_init__(self) -> None:
        if not 1 <= self.rank < self.group.world_size:
            raise ValueError(f"InflightConfig.rank={self.rank} outside 1..{self.group.world_size - 1}")
        if self.initial_version < 0:
            raise ValueError(f"InflightConfig.initial_version={self.initial_version} must be >= 0")
        check_choices(self, "InflightConfig")
        if not 0 <= self.listener_nice <= 19:
            raise ValueError(f"InflightConfig.listener_nice={self.listener_nice} must be in 0..19")
        if len(set(self.listener_cpus)) != len(self.listener_cpus) or any(c < 0 for c in self.listener_cpus):
            raise ValueError(f"InflightConfig.listener_cpus={self.listener_cpus} must be distinct CPU numbers >= 0")
        for name in ("commit_timeout_s", "stale_timeout_s", "max_bucket_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"InflightConfig.{name}={getattr(self, name)} must be > 0")
        if self.staged_groups not in (1, 2):
            raise ValueError(f"InflightConfig.staged_groups={self.staged_groups} must be 1 or 2")
        if self.adapter is not None and (self.commit not in ("auto", "lora") or self.commit_unit != "model"):
            raise ValueError(f"InflightConfig.commit={self.commit!r}, commit_unit={self.commit_unit!r} with an "
                             "adapter: adapter updates commit whole, into the adapter slot ('auto' or 'lora', 'model')")
        if self.adapter is None and self.commit == "lora":
            raise ValueError("InflightConfig.commit='lora' needs InflightConfig.adapter (the policy adapter's spec)")
        if self.keep_base and self.commit_unit == "layer":
            raise ValueError("InflightConfig.keep_base=True with commit_unit='layer': layer groups travel dense; "
                             "sparse updates need whole-model commits")
        if self.wire is not None and (self.adapter is not None or self.keep_base or self.commit_unit != "model"):
            raise ValueError("InflightConfig.wire (vLLM's nccl wire) carries whole models: no adapter, keep_base or "
                             f"commit_unit={self.commit_unit!r} with it")
        if self.checkpoints and (self.wire is not None or self.adapter is not None or self.keep_base
                                 or self.commit_unit != "model"):
            raise ValueError("InflightConfig.checkpoints=True reads whole models from directories: no wire, adapter, "
                             f"keep_base or commit_unit={self.commit_unit!r} with it")
        if self.commit_unit == "layer" and self.commit == "reload":
            raise ValueError("InflightConfig.commit='reload' with commit_unit='layer': layer-granular commits need the "
                             "'swap' (eager CPU) or 'copy' (CUDA) commit; 'auto' picks the right one")

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, data: str | bytes) -> InflightConfig:
        """Parse and validate; unknown fields (a typo, a setting of another version) are an
        error naming them, never silently dropped: msgspec ignores them in dataclasses."""
        try:
            raw = msgspec.json.decode(data)
            if not isinstance(raw, dict):
                raise ValueError(f"InflightConfig JSON must be an object, not {type(raw).__name__}")
            refuse_unknown(cls, raw, "InflightConfig")
            refuse_unknown(GroupConfig, raw.get("group"), "InflightConfig.group")
            refuse_unknown(AdapterSpec, raw.get("adapter"), "InflightConfig.adapter")
            refuse_unknown(PackedWireConfig, raw.get("wire"), "InflightConfig.wire")
            return msgspec.json.decode(data, type=cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise ValueError(f"InflightConfig JSON: {e}") from None


def refuse_unknown(cls: type, raw: Any, where: str) -> None:
    if not isinstance(raw, dict):
        return  # a wrong type is msgspec's to name
    unknown = sorted(set(raw) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown} (known: {', '.join(f.name for f in fields(cls))})")


_DEFAULTS = {f.name: f.default for f in fields(InflightConfig)}


@dataclass(frozen=True, kw_only=True)
class StagingIntent:
    """The staging an engine will be started with (``inflight_start``), known when it is built,
    so that a GPU worker sets its device bytes aside before vLLM sizes the KV cache
    (``inflight.engine.kv_budget``). ``inflight_start`` then refuses a config that needs more
    device memory than was set aside. Defaults are ``InflightConfig``'s."""

    staging: StagingPlace = _DEFAULTS["staging"]
    keep_rollback: bool = _DEFAULTS["keep_rollback"]
    keep_base: bool = _DEFAULTS["keep_base"]
    max_bucket_mb: float = _DEFAULTS["max_bucket_mb"]
    commit: CommitChoice = _DEFAULTS["commit"]
    backend: Backend = "auto"
    """The weight group's data plane (``GroupConfig.backend``): on a GPU, NCCL lands buckets on
    the device and gloo stages through host memory."""
    adapter: AdapterSpec | None = None
    """``InflightConfig.adapter``: staging holds the adapter, not the model."""

    def __post_init__(self) -> None:
        check_choices(self, "StagingIntent")
        if type(self.keep_rollback) is not bool:
            raise ValueError(f"StagingIntent.keep_rollback={self.keep_rollback!r} must be a bool")
        if not self.max_bucket_mb > 0:
            raise ValueError(f"StagingIntent.max_bucket_mb={self.max_bucket_mb} must be > 0")

    @classmethod
    def of(cls, config: InflightConfig) -> StagingIntent:
        """The intent of the config the engine will be started with."""
        return cls(staging=config.staging, keep_rollback=config.keep_rollback, keep_base=config.keep_base,
                   max_bucket_mb=config.max_bucket_mb,
                   commit=config.commit, backend=config.group.backend, adapter=config.adapter)

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_additional_config(cls, additional: Any) -> StagingIntent | None:
        """The intent ``engine_kwargs`` recorded in vLLM's ``additional_config``, or None (an
        engine not built with one); a malformed one is an error naming it."""
        raw = additional.get(STAGING_INTENT_KEY) if isinstance(additional, dict) else None
        if raw is None:
            return None
        refuse_unknown(cls, raw, f"additional_config[{STAGING_INTENT_KEY!r}]")
        try:
            return msgspec.convert(raw, type=cls)
        except msgspec.ValidationError as e:
            raise ValueError(f"additional_config[{STAGING_INTENT_KEY!r}]: {e}") from None


def engine_kwargs(*, model: str | os.PathLike | None = None,
                  reserve_staging: StagingIntent | InflightConfig | None = None, adapter: AdapterSpec | None = None,
                  rl_api: bool = False, **overrides: object) -> dict[str, object]:
    """Engine arguments an in-flight engine needs, for ``LLM(...)`` / ``AsyncEngineArgs(...)``.

    - with ``model`` (a directory or a hub id): the model, and prefix caching decided for it;
    - the worker extension that receives and commits weights;
    - prefix caching on: every commit invalidates it exactly, in the commit's window
      (``inflight.engine.prefix_cache``), so the K samples of a group share their prompt's
      prefill and no request admitted after a commit reuses KV or recurrent state of earlier
      weights, on full, sliding-window, chunked local and hybrid (Mamba, convolution, linear
      attention) models alike; ``enable_prefix_caching=False`` turns it off. With ``model``,
      where the model's config shows caching cannot run or be kept exact here
      (``prefix_cache.caching_off_reason``), it is off and one logged line says why;
    - async scheduling as vLLM chooses it (on a GPU, on; vLLM's CPU build turns it off): a
      commit sits between one batch's sampling and the next one's forward, and each batch's
      tokens carry the label of the weights that computed them (``inflight.engine.batch_labels``);
    - processed log-probs: behaviour log-probs of the distribution actually sampled from;
    - vLLM's neutral sampling defaults, not the model's ``generation_config.json`` (its top-k,
      top-p, penalties would apply to every request that leaves them unset, and the trainer
      scores with the temperature alone; the worker refuses such an engine);
    - with ``reserve_staging`` (the ``InflightConfig`` the engine will be started with, or its
      ``StagingIntent``): the intent, in ``additional_config``, which reaches every worker, so
      a GPU worker subtracts staging's device bytes from what vLLM may give its KV cache
      (``inflight.engine.kv_budget``). Without it the KV cache is sized as vLLM alone would,
      and ``inflight_start`` checks staging against the memory left free;
    - with ``adapter`` (``InflightConfig.adapter``): LoRA with one adapter slot, of the
      adapter's rank, wrapping only the adapter's target modules (``inflight.adapter``);
    - with ``rl_api``: the ``inflight`` weight-transfer backend, so clients of vLLM's RL API
      (``init_weight_transfer_engine`` ... ``finish_weight_update``) commit in flight
      (``inflight.engine.rl_api``).
    """
    kwargs: dict[str, object] = dict(
        worker_extension_cls=WORKER_EXTENSION,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
    )
    if adapter is not None:
        shape = adapter.shape()
        # one slot, one cached adapter: the policy's, pinned at start; no other can evict it
        kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=shape.max_lora_rank,
                      lora_target_modules=list(shape.target_modules), fully_sharded_loras=False)
    if rl_api:
        kwargs["weight_transfer_config"] = {"backend": "inflight"}
    if model is not None:
        kwargs["model"] = os.fspath(model)
        reason = None if "enable_prefix_caching" in overrides else caching_off_reason(kwargs["model"])
        if reason is not None:
            log.warning("inflight: prefix caching off for %s: %s", kwargs["model"], reason)
            kwargs["enable_prefix_caching"] = False
    kwargs.update(overrides)
    if reserve_staging is not None:
        intent = reserve_staging if isinstance(reserve_staging, StagingIntent) else StagingIntent.of(reserve_staging)
        additional = overrides.get("additional_config") or {}
        if not isinstance(additional, dict):
            raise ValueError(f"engine_kwargs: additional_config={additional!r} must be a dict to carry the staging "
                             "intent")
        kwargs["additional_config"] = {**additional, STAGING_INTENT_KEY: intent.to_dict()}
    return kwargs
