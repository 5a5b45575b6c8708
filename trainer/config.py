"""Training configuration: frozen keyword-only dataclasses, read from a TOML file.

Every field has a docstring and a default; unknown keys and bad values fail at load with
the dotted path of the offending key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from inflight.adapter import AdapterSpec
from inflight.engine.engine_config import InflightConfig
from inflight.protocol import CommitUnit, ModelDtype, Sampling
from inflight.settings import Backend, PushEncoding, RolloutMode, TrackerName, check_choices
from inflight.trainer.lora_policy import LoRAOptions
from inflight.trainer.loss_config import LossConfig
from inflight.trainer.optim import OptimConfig
from inflight.trainer.tasks.task_config import ArithmeticConfig, JsonlConfig, TaskConfig  # noqa: F401  (sections of TrainConfig)
from inflight.trainer.tiny_model import TinyModelConfig
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where and how long."""

    name: str = "run"
    """Run name (a config file without one: the file's name, ``my_run.toml`` -> ``my_run``)."""
    out_dir: str = ""
    """Where metrics.jsonl, samples.jsonl, the plot, the summary and the checkpoint land (empty:
    ``runs/<name>``, from the working directory)."""
    steps: int = 100
    """Optimizer steps (= weight versions pushed)."""
    seed: int = 0
    """Seeds python, torch and the engine's sampler."""
    checkpoint_every: int = 10
    """Save a checkpoint every N steps (0: only at the end), so a crash (the kernel's out-of-memory
    killer, a lost machine) loses at most N steps: ``run.resume = true`` goes on from it, and an
    engine that dies restarts from it. Each one writes the weights and the optimizer's state."""
    resume: bool = False
    """Continue from ``out_dir/checkpoint`` if it exists."""
    report_to: tuple[TrackerName, ...] = ("jsonl",)
    """Where each step's metrics go: ``jsonl`` (metrics.jsonl, always written: added when left out)
    and any of ``tensorboard``, ``wandb``, ``trackio``, each its extra (docs/training.md, *Experiment trackers*)."""
    project: str = "inflight"
    """The W&B / Trackio project the run is logged under (its name there: ``name``)."""
    rank_timeout_s: float = 300.0
    """With several trainer ranks (``--nproc``, ``torchrun``): how long a rank waits for another
    within a step (a collective, an order, a rank's share of the batch) before the run stops,
    naming the rank that did not answer. A rank that dies is seen at once; this catches one that hangs."""

    def __post_init__(self) -> None:
        check_choices(self, "run")
        if not self.rank_timeout_s > 0:
            raise ValueError(f"run.rank_timeout_s={self.rank_timeout_s} must be > 0")
        if not self.out_dir:
            object.__setattr__(self, "out_dir", f"runs/{self.name}")
        # jsonl always: the plot, the summary and a resumed run read metrics.jsonl
        object.__setattr__(self, "report_to",
                           tuple(self.report_to) if "jsonl" in self.report_to else ("jsonl", *self.report_to))
        if self.steps < 1:
            raise ValueError(f"run.steps={self.steps} must be >= 1")
        if self.checkpoint_every < 0:
            raise ValueError(f"run.checkpoint_every={self.checkpoint_every} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy."""

    path: str = ""
    """A Hugging Face causal LM directory, a hub id, or ``smollm2`` (SmolLM2-135M-Instruct from
    the ``smollm2`` extra, converted once: ``trainer/models.py``); empty builds the tiny demo model."""
    dtype: ModelDtype = "float32"
    """Engine dtype, and the dtype weights are cast to before they travel."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the tiny model when ``path`` is empty."""
    lora: LoRAOptions = field(default_factory=LoRAOptions)
    """``rank`` > 0: train a LoRA adapter on the fixed base; pushes carry the adapter alone."""

    def __post_init__(self) -> None:
        check_choices(self, "model")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Greedy evaluation on the task's fixed held-out prompts, by the trainer on its own weights."""

    every: int = 0
    """Evaluate before training and every N steps (and after the last); 0: never, and nothing is held out."""
    prompts: int = 32
    """Size of the held-out set (held out of training when ``every`` > 0)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"eval.every={self.every} must be >= 0 (0: off)")
        if self.prompts < 1:
            raise ValueError(f"eval.prompts={self.prompts} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Sampling and the rollout queue."""

    group_size: int = 8
    """Samples per prompt (a GRPO group)."""
    groups_per_step: int = 8
    """Groups per optimizer step."""
    in_flight_groups: int = 16
    """Groups the engine keeps decoding at once."""
    temperature: float = 1.0
    """Sampling temperature; the trainer scores with the same temperature."""
    top_k: int = 0
    """Sample from the k most likely tokens only (0: off). The trainer scores its policy under
    the same filter (``inflight.trainer.sampling_filter``), so behaviour and policy log-probs stay
    comparable; a token the current policy's filter excludes gets ratio 0."""
    top_p: float = 1.0
    """Sample from the smallest set of most likely tokens whose probability reaches top_p
    (nucleus sampling; 1: off), after top_k; mirrored in the trainer like top_k."""
    queue_capacity: int = 32
    """Groups the queue holds before the engine waits."""
    admit_lag: int = 8
    """Groups with any token older than this many versions are dropped at the queue."""
    queue_timeout_s: float = 300.0
    """How long the trainer waits for the next group before it reports the engine gone."""
    mode: RolloutMode = "inflight"
    """inflight: the engine samples continuously and commits updates between decode steps.
    batch: the baseline of synchronous RL: the engine samples one step's groups with the
    current version, then waits idle for the next version.
    pause: the baseline of today's async RL (PipelineRL, prime-rl, TRL's async GRPO): sampling
    runs ahead as in inflight, but each update goes through vLLM's native path, between two
    steps, with the engine paused (``pause_scheduler(mode="keep")``, ``update_weights``,
    resume; ``inflight.trainer.native_update``), and every request carries the ``cache_salt``
    of the version live when it was added. One engine, tensor parallel size 1, whole-model
    dense updates, no LoRA, no routing replay; a lost engine stops the run."""

    def __post_init__(self) -> None:
        for name in ("group_size", "groups_per_step", "in_flight_groups", "queue_capacity"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if self.group_size < 2:
            raise ValueError(f"rollout.group_size={self.group_size}: GRPO needs at least 2 samples per group")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature={self.temperature} must be > 0")
        if self.top_k < 0:
            raise ValueError(f"rollout.top_k={self.top_k} must be >= 0 (0: off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1] (1: off)")
        if self.admit_lag < 0:
            raise ValueError(f"rollout.admit_lag={self.admit_lag} must be >= 0")
        check_choices(self, "rollout")

    def sampling(self) -> Sampling:
        """The distribution the engine samples and the trainer scores."""
        return Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """The weight group between the trainer and the engines. Each default is the library's
    own (``GroupConfig``, ``PushConfig``, ``InflightConfig``): one default per setting, and
    ``group_config``/``push_config``/``inflight_config`` below are the only mapping."""

    host: str = GroupConfig.host
    """Address the trainer's store listens on (and the engines connect to)."""
    port: int = 0
    """Store port; 0: the trainer holds a free one (``reserve_port``) and hands it to the engines it spawns."""
    backend: Backend = GroupConfig.backend
    """Data plane: ``auto`` is NCCL when the trainer and the engine each have a GPU (a spawned
    engine gets every visible GPU but the trainer's first), else gloo (CPU, or one shared GPU,
    which NCCL cannot connect to itself)."""
    bucket_mb: float = PushConfig.bucket_mb
    """Bucket size of weight pushes (the pusher's ``PushConfig.bucket_mb``); each engine
    reserves its landing room for buckets this large (``InflightConfig.max_bucket_mb``)."""
    collective_timeout_s: float = GroupConfig.timeout_s
    """Connecting, joining a generation, and each bucket's broadcast: an engine whose trainer
    stalls this long mid-transfer drops the update and rejoins."""
    reply_timeout_s: float = PushConfig.reply_timeout_s
    """A worker's reply to each phase of a push (accepted, staged, committed): a push the
    engines do not answer within it fails, and the fleet goes on without the silent ones."""
    stale_timeout_s: float = InflightConfig.stale_timeout_s
    """A staged version whose ``Commit`` does not come within this is dropped (the trainer died)."""
    rejoin_timeout_s: float = 600.0
    """After a failure, how long the trainer waits for the engine to come back (start-up included)."""
    insecure: bool = GroupConfig.insecure
    """Allow a non-loopback ``host`` without ``INFLIGHT_SECRET`` (``GroupConfig.insecure``)."""
    encoding: PushEncoding = PushConfig.encoding
    """``sparse``: each push sends only the elements that changed, in the engine's dtype,
    against the version the engine serves, where that is smaller (``PushConfig.encoding``);
    the engines keep their live version's bytes for it (``InflightConfig.keep_base``). Pays
    on slow links and bf16 engines, where most weights do not change between two steps."""

    def __post_init__(self) -> None:
        check_choices(self, "transport")
        if type(self.port) is not int or not 0 <= self.port < 65536:
            raise ValueError(f"transport.port={self.port!r} is not a TCP port (0: a free one)")
        if not self.bucket_mb > 0:
            raise ValueError(f"transport.bucket_mb={self.bucket_mb} must be > 0")
        for name in ("collective_timeout_s", "reply_timeout_s", "stale_timeout_s", "rejoin_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"transport.{name}={getattr(self, name)} must be > 0")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The vLLM engine process."""

    spawn: bool = True
    """Start the engines from the trainer. False: start each yourself with
    ``python -m inflight.trainer.rollout.engine_process``."""
    count: int = 1
    """Engines in the fleet. Each samples its own groups into the one rollout queue."""
    tensor_parallel_size: int = 1
    """vLLM tensor parallel size of every engine. Engine i's T workers take weight-group ranks
    1 + i*T .. (i+1)*T (``ranks``), so the group's world size is 1 + count*T. A spawned
    engine uses vLLM's ``mp`` executor for T > 1, with its own GPU per worker, or on CPU its
    own cores per worker (``VLLM_CPU_OMP_THREADS_BIND``, unless you set it)."""
    max_num_seqs: int = 256
    """vLLM's cap on concurrently decoded sequences."""
    max_model_len: int = 256
    """Prompt + completion limit."""
    kv_cache_gb: int = 1
    """CPU KV cache (VLLM_CPU_KVCACHE_SPACE); on GPU use gpu_memory_utilization."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory the engine may take (GPU only)."""
    max_restarts: int = 3
    """A spawned engine that dies is restarted this many times before the run fails."""
    prefix_caching: bool = True
    """vLLM's automatic prefix caching: the ``group_size`` samples of a group share their
    prompt's prefill. Every commit invalidates it exactly (``inflight.engine.prefix_cache``);
    False prefills every sample's prompt itself. True leaves it on unless the model rules it out
    (``engine_kwargs(model=...)`` logs why)."""
    speculative_tokens: int = 0
    """Draft tokens n-gram prompt lookup proposes per step (vLLM's ``speculative_config`` with
    method ``ngram``: 1-3 token n-grams of the prompt and the completion so far); 0 turns
    n-gram speculation off (a draft model is ``draft``'s). Each accepted token carries the
    label of the step that verified it (``inflight.engine.spec_decode``); the engine then steps
    synchronously."""
    commit_unit: CommitUnit = "model"
    """What an engine commits at once (``InflightConfig.commit_unit``): the whole model, or one
    layer group per step boundary (staging of two groups, a stall of one group's swap; tokens
    sampled mid-update are tagged with the hybrid that sampled them)."""
    launcher: Literal["process", "ray"] = "process"
    """How spawned engines start: ``process``, one process each on this machine; ``ray``, one
    Ray actor each, in a placement group of its own (``inflight.trainer.ray_launcher``), on the Ray
    cluster at ``ray_address`` (needs the ``ray`` extra)."""
    ray_address: str = ""
    """``launcher = "ray"``: the cluster to join (``ray.init(address=...)``); empty starts a local one."""
    ray_cpus: float = 1.0
    """``launcher = "ray"``: CPUs in each engine's placement group bundle (plus one GPU per
    tensor parallel worker where the cluster has GPUs)."""

    def __post_init__(self) -> None:
        check_choices(self, "engine")
        if not self.ray_cpus > 0:
            raise ValueError(f"engine.ray_cpus={self.ray_cpus} must be > 0")
        if self.max_restarts < 0:
            raise ValueError(f"engine.max_restarts={self.max_restarts} must be >= 0")
        for key in ("count", "tensor_parallel_size", "max_num_seqs", "kv_cache_gb"):
            if type(value := getattr(self, key)) is not int or value < 1:
                raise ValueError(f"engine.{key}={value!r} must be a whole number >= 1")
        if type(self.speculative_tokens) is not int or self.speculative_tokens < 0:
            raise ValueError(f"engine.speculative_tokens={self.speculative_tokens!r} must be a whole number >= 0")
        if type(self.max_model_len) is not int or self.max_model_len < 2:
            raise ValueError(f"engine.max_model_len={self.max_model_len!r} must be a whole number >= 2")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"engine.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")

    def ranks(self, index: int) -> tuple[int, ...]:
        """The fleet ranks of engine ``index``'s workers (the trainer is 0): how metrics and seeds
        name them. In its own weight group (``GroupConfig.for_engine``) the engine's workers are
        ranks 1 .. ``tensor_parallel_size``."""
        t = self.tensor_parallel_size
        return tuple(range(1 + index * t, 1 + (index + 1) * t))

    @property
    def tp_sizes(self) -> list[int]:
        """Each engine's tensor parallel size: its weight group is the trainer and that many workers."""
        return [self.tensor_parallel_size] * self.count


@dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """A draft model the engines speculate with (vLLM's ``draft_model`` method), trained online by
    distillation from the policy's own samples and pushed with every update: it commits with the
    policy at the same step boundary (``inflight.engine.commit.drafted``), so it never proposes
    from weights the engine dropped. Off unless ``path`` or ``layers`` names one."""

    path: str = ""
    """A draft checkpoint (a directory or a hub id) of the policy's tokenizer; empty: none, or the
    one ``layers`` builds."""
    layers: int = 0
    """Build the draft from the policy itself: its embeddings, its first ``layers`` decoder
    layers, its final norm and LM head (``inflight.trainer.draft``). 0: build none."""
    speculative_tokens: int = 3
    """Tokens the draft proposes per engine step; the policy verifies them all in that step."""
    train: bool = True
    """Distill the draft each step: cross-entropy on the batch's sampled completion tokens, the
    policy's own samples (the draft's loss is logged as ``draft_loss``). False: it stays as it
    started, and is still pushed with every update (the frozen control)."""
    learning_rate: float = 1e-3
    """AdamW's learning rate for the draft (its own optimizer, on the trainer's rank 0)."""
    steps_per_update: int = 1
    """Distillation steps on each batch, between two pushes."""

    def __post_init__(self) -> None:
        if type(self.layers) is not int or self.layers < 0:
            raise ValueError(f"draft.layers={self.layers!r} must be a whole number >= 0")
        if self.path and self.layers:
            raise ValueError(f"draft.path={self.path!r} and draft.layers={self.layers}: name one draft, not both")
        for key in ("speculative_tokens", "steps_per_update"):
            if type(value := getattr(self, key)) is not int or value < 1:
                raise ValueError(f"draft.{key}={value!r} must be a whole number >= 1")
        if not self.learning_rate > 0:
            raise ValueError(f"draft.learning_rate={self.learning_rate} must be > 0")

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.layers)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)

    def __post_init__(self) -> None:
        # an in-flight engine samples with a version the trainer has already moved past, and
        # starts only groups that will be within loss.max_lag (inflight.trainer.rollout.engine_process.may_start_group):
        # with 0 it would never start one
        if self.rollout.mode == "inflight" and self.loss.max_lag < 1:
            raise ValueError(f"loss.max_lag={self.loss.max_lag} with rollout.mode='inflight': in-flight samples lag "
                             "the trainer by 1 at least; use max_lag >= 1, or rollout.mode='batch'")
        if self.rollout.mode == "pause":
            _check_pause(self)
        if self.engine.speculative_tokens and self.loss.routing_replay:
            raise ValueError(f"engine.speculative_tokens={self.engine.speculative_tokens} with loss.routing_replay: "
                             "routing is recorded for one token per step (set one of them off)")
        if self.draft.enabled:
            _check_draft(self)
        if self.model.lora.enabled and (self.loss.routing_replay or self.engine.commit_unit != "model"):
            raise ValueError("model.lora.rank > 0: an adapter run commits the whole adapter at once and replays no "
                             "routing (set loss.routing_replay=false, engine.commit_unit='model')")
        if self.optim.warmup_steps >= self.run.steps:
            raise ValueError(f"optim.warmup_steps={self.optim.warmup_steps} must be below run.steps={self.run.steps}")
        if self.task.completion_tokens >= self.engine.max_model_len:
            raise ValueError(f"task.completion_tokens={self.task.completion_tokens} leaves no room for a prompt in "
                             f"engine.max_model_len={self.engine.max_model_len}")
        if self.optim.micro_batch_tokens < self.engine.max_model_len and self.loss.m2_threshold == 0:
            raise ValueError(f"optim.micro_batch_tokens={self.optim.micro_batch_tokens} is below "
                             f"engine.max_model_len={self.engine.max_model_len}: a sample that long could not be "
                             f"trained in one pass; set optim.micro_batch_tokens >= {self.engine.max_model_len}")

def _whole_model_settings(cfg: TrainConfig) -> dict[str, tuple[object, object]]:
    """Settings -> (their value, what a whole-model update on one worker per engine needs)."""
    return {"engine.tensor_parallel_size": (cfg.engine.tensor_parallel_size, 1),
            "engine.commit_unit": (cfg.engine.commit_unit, "model"),
            "transport.encoding": (cfg.transport.encoding, "dense"), "model.lora.rank": (cfg.model.lora.rank, 0),
            "loss.routing_replay": (cfg.loss.routing_replay, False)}


def _refuse_unless(needs: dict[str, tuple[object, object]], why: str, instead: str) -> None:
    """``ValueError`` naming the first setting of ``needs`` that is not what it needs, ``why``, and
    what to set it to (or ``instead``)."""
    for key, (value, needed) in needs.items():
        if value != needed:
            raise ValueError(f"{key}={value!r} {why}; set {key}={needed!r}, or {instead}")


def _check_draft(cfg: TrainConfig) -> None:
    """A draft model speculates on whole-model, whole-weight pushes of one engine process per
    engine: refuse, by name, every setting it does not cover."""
    if cfg.engine.speculative_tokens:
        raise ValueError(f"engine.speculative_tokens={cfg.engine.speculative_tokens} (n-gram lookup) with a draft "
                         "model: an engine speculates one way; the draft's count is draft.speculative_tokens")
    _refuse_unless(_whole_model_settings(cfg), "with a draft model (draft.path / draft.layers): the draft commits "
                   "whole, with the whole policy, on one worker per engine", "no draft")
    if cfg.rollout.mode == "pause":
        raise ValueError("rollout.mode='pause' with a draft model (draft.path / draft.layers): vLLM's native update "
                         "carries no draft; use rollout.mode='inflight' or 'batch', or no draft")


def _check_pause(cfg: TrainConfig) -> None:
    """``rollout.mode = "pause"`` runs vLLM's native update on one in-process engine: refuse,
    by name, every setting it does not cover."""
    _refuse_unless({"engine.count": (cfg.engine.count, 1), "engine.launcher": (cfg.engine.launcher, "process"),
                    **_whole_model_settings(cfg)},
                   "with rollout.mode='pause': the native pause-and-update path runs on one whole-model engine",
                   "rollout.mode='inflight'")
    if cfg.loss.max_lag < 1:
        raise ValueError(f"loss.max_lag={cfg.loss.max_lag} with rollout.mode='pause': samples drawn ahead lag the "
                         "trainer by 1 at least; use max_lag >= 1, or rollout.mode='batch'")


def group_config(cfg: TrainConfig, *, port: int, backend: Backend | None = None) -> GroupConfig:
    """The base of this run's weight groups, one per engine (``GroupConfig.for_engine``) on the
    trainer's store (``backend``: the placement's, default ``transport.backend``)."""
    t = cfg.transport
    return GroupConfig(host=t.host, port=port, timeout_s=t.collective_timeout_s,
                       backend=backend or t.backend, insecure=t.insecure)


def push_config(cfg: TrainConfig) -> PushConfig:
    """How the trainer packs and sends this run's pushes."""
    return PushConfig(bucket_mb=cfg.transport.bucket_mb, dtype=cfg.model.dtype,
                      reply_timeout_s=cfg.transport.reply_timeout_s, encoding=cfg.transport.encoding)


def inflight_config(cfg: TrainConfig, group: GroupConfig, *, rank: int, initial_version: int,
                    adapter: AdapterSpec | None = None) -> InflightConfig:
    """What engine ``rank``'s workers need to join ``group`` and commit this run's pushes."""
    return InflightConfig(group=group, rank=rank, initial_version=initial_version,
                          max_bucket_mb=cfg.transport.bucket_mb, stale_timeout_s=cfg.transport.stale_timeout_s,
                          record_routing=cfg.loss.routing_replay, commit_unit=cfg.engine.commit_unit, adapter=adapter,
                          keep_base=cfg.transport.encoding == "sparse")
