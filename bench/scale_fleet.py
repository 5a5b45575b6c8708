"""From a scenario (published hardware and model figures, one TOML per fleet) to what
``scale_model.simulate`` needs: slots, a decode step time and, per way of updating, what an
update costs the engine.

Variants of the in-flight mode differ only in where the staged version waits and how much
of it: ``inflight`` (device memory; every TP rank stages the full checkpoint S),
``inflight_host`` (pinned host memory, S per rank, one bucket on the device; the commit
becomes a host-to-device copy), and their ``_shard`` forms: each rank is sent and stages only
the boxes its weight loaders read (``inflight.shard_plan``), computed from the model's
published shapes by ``scale_shapes`` (about S / TP, plus what every rank reads whole), and
the trainer sends an engine the sum over its ranks. These four are built: the shard-targeted
transfer is what the engine does wherever its commit records its loaders (the CPU ``swap``
commit today; a GPU ``copy``/``reload`` commit sends no plan yet and is sent whole tensors).

``inflight_layer`` and ``inflight_host_layer`` (not built for a GPU: the engine's layer-granular
commit, ``commit_unit="layer"``, needs the CPU ``swap`` commit today) are the shard transfer
committed one layer group at a time (``scale_shapes.group_bytes``): a rank stages
``staged_groups`` groups, not its shard, and each group's commit is one device copy of its
bytes plus the whole-model commit's fixed cost (``commit_fixed_s``, one collective_rpc), at
its own step boundary. On the host, each group is copied into a device slot before its commit,
off the stall. No rollback copy is counted: the swap commit the engine's layer mode uses puts a
failed group's modules back, and an update stopped part-way leaves a labelled hybrid; a GPU
copy commit would need one more group slot for the same.

Every mode's transfer runs at the fastest published update rate (``transfers.toml``, beside
the scenarios) that the engine can take in, at most ``tp`` x one NIC's line rate: pause is
held to the strongest published figure. ``Scenario.via`` puts another system's rate in its place.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path

from inflight.bench.scale_model import Lengths, StepTime, Update
from inflight.bench.scale_shapes import Arch, group_bytes, link_bytes, rank_bytes, staging_bytes

VARIANTS = ("none", "batch", "pause", "inflight", "inflight_host", "inflight_shard", "inflight_host_shard",
            "inflight_layer", "inflight_host_layer")
LAYERED = ("inflight_layer", "inflight_host_layer")
BUILT = tuple(v for v in VARIANTS if v not in LAYERED)  # the shard modes: the engine's shard-targeted transfer
GB = 1e9
# package data: inflight.bench.scale runs from an installed wheel too
SCENARIOS = Path(__file__).resolve().parent / "scenarios"
TRANSFERS = "transfers.toml"  # the published update times, beside the scenarios: not a scenario
LINKS = "links.toml"  # slower links between the pools (scale_links), beside them: not a scenario either


def scenario_paths(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.toml") if p.name not in (TRANSFERS, LINKS))


def _check_positive(obj: object, *, allow_zero: tuple[str, ...] = ()) -> None:
    for f in fields(obj):  # type: ignore[arg-type]
        v = getattr(obj, f.name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            if v < 0 or (v == 0 and f.name not in allow_zero):
                raise ValueError(f"{type(obj).__name__}.{f.name}={v} must be "
                                 f"{'>= 0' if f.name in allow_zero else '> 0'}")


@dataclass(frozen=True, kw_only=True)
class Model:
    params_b: float  # total parameters, billions
    active_params_b: float  # parameters each token goes through (= params_b for a dense model)
    bytes_per_param: float  # of the checkpoint the engine serves (2: bf16, 1: fp8)
    kv_bytes_per_token_gpu: float  # KV cache per token on one GPU of an engine

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.active_params_b > self.params_b:
            raise ValueError(f"Model.active_params_b={self.active_params_b} exceeds params_b={self.params_b}")


@dataclass(frozen=True, kw_only=True)
class Fleet:
    engines: int
    tp: int
    pp: int = 1
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        _check_positive(self)


@dataclass(frozen=True, kw_only=True)
class Gpu:
    name: str
    memory_gb: float
    hbm_tbps: float  # peak HBM bandwidth
    tflops: float  # dense peak in the serving dtype
    h2d_gbps: float  # achieved pinned host-to-device copy rate
    host_memory_gb_per_node: float

    def __post_init__(self) -> None:
        _check_positive(self)


@dataclass(frozen=True, kw_only=True)
class Serving:
    mem_util: float  # vLLM gpu_memory_utilization
    reserve_gb: float  # activations, CUDA graphs, allocator slack per GPU
    max_num_seqs: int
    mbu: float  # achieved fraction of peak HBM bandwidth in decode
    mfu: float  # achieved fraction of peak FLOP/s
    step_overhead_ms: float  # scheduler, sampling, launches, TP collectives per step

    def __post_init__(self) -> None:
        _check_positive(self, allow_zero=("reserve_gb", "step_overhead_ms"))
        for name in ("mem_util", "mbu", "mfu"):
            if getattr(self, name) > 1:
                raise ValueError(f"Serving.{name}={getattr(self, name)} must be <= 1")


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """A published weight update: ``gb`` received by each engine in ``seconds``, load included."""

    system: str
    model: str
    gb: float
    seconds: float

    def __post_init__(self) -> None:
        _check_positive(self)

    @property
    def gbps(self) -> float:
        return self.gb / self.seconds


def engine_rate(transfers: tuple[Transfer, ...], system: str, tp: int, nic_gbps: float) -> float:
    """The GB/s one engine of ``tp`` GPUs receives an update at by ``system``: its fastest
    published rate, as far as the engine's NICs take it in."""
    rates = [t.gbps for t in transfers if t.system == system]
    if not rates:
        raise ValueError(f"engine_rate: no published update by system={system!r} ({TRANSFERS})")
    return min(max(rates), tp * nic_gbps)


@dataclass(frozen=True, kw_only=True)
class Link:
    engine_gbps: float  # rate at which one engine receives a whole update (GB/s)
    nic_gbps: float  # line rate into one GPU: an engine takes in at most tp x this
    egress_gbps: float  # trainer side, all engines together; 0: not the bottleneck
    load_fixed_s: float  # pause path per update: pause/resume and finish_weight_update post-processing
    commit_fixed_s: float  # in-flight: one step-boundary RPC to every worker

    def __post_init__(self) -> None:
        _check_positive(self, allow_zero=("egress_gbps", "load_fixed_s", "commit_fixed_s"))


@dataclass(frozen=True, kw_only=True)
class Updates:
    every_s: float  # a new version per trainer step
    rollback: bool  # keep_rollback: the previous version is staged too
    bucket_gb: float  # device memory of host staging (one bucket)
    staging_hbm_passes: float  # HBM traffic per staged byte (write, checksum/NaN read, copy-out)
    commit_hbm_passes: float  # HBM traffic per live byte at the commit (read staging + write live)
    staged_groups: int = 2  # layer-granular commit: groups a rank stages at once (InflightConfig default)
    wire_ratio: float = 1.0  # bytes on the wire / the dense update's (a sparse delta: < 1; scale_links)

    def __post_init__(self) -> None:
        _check_positive(self, allow_zero=("staging_hbm_passes",))
        if self.wire_ratio > 1:
            raise ValueError(f"Updates.wire_ratio={self.wire_ratio} must be <= 1 (a delta never sends more than dense)")


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    model: Model
    arch: Arch
    transfers: tuple[Transfer, ...]
    fleet: Fleet
    gpu: Gpu
    serving: Serving
    link: Link
    updates: Updates
    prompt_tokens: int
    lengths: Lengths

    @classmethod
    def load(cls, path: Path) -> Scenario:
        raw = tomllib.loads(path.read_text())
        try:
            work = raw["workload"]
            transfers = tuple(Transfer(**t) for t in tomllib.loads((path.parent / TRANSFERS).read_text())["update"])
            fleet = Fleet(**raw["fleet"])
            fastest = max(transfers, key=lambda t: t.gbps).system
            link = Link(engine_gbps=engine_rate(transfers, fastest, fleet.tp, raw["link"]["nic_gbps"]), **raw["link"])
            return cls(name=raw["name"], model=Model(**raw["model"]), arch=Arch.from_config(raw["arch"]),
                       transfers=transfers, fleet=fleet, gpu=Gpu(**raw["gpu"]), serving=Serving(**raw["serving"]),
                       link=link, updates=Updates(**raw["updates"]), prompt_tokens=work["prompt_tokens"],
                       lengths=Lengths(**work["lengths"]))
        except (KeyError, TypeError, OSError) as e:
            raise ValueError(f"{path}: {e}") from e

    def via(self, system: str) -> Scenario:
        """This scenario with every transfer at ``system``'s published rate (``engine_rate``)."""
        gbps = engine_rate(self.transfers, system, self.fleet.tp, self.link.nic_gbps)
        return dataclasses.replace(self, link=dataclasses.replace(self.link, engine_gbps=gbps))

    def replace(self, *, lengths: Lengths | None = None, every_s: float | None = None) -> Scenario:
        """This scenario with other request lengths or another update cadence (the sweeps)."""
        upd = self.updates if every_s is None else dataclasses.replace(self.updates, every_s=every_s)
        return dataclasses.replace(self, updates=upd, lengths=lengths or self.lengths)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One variant of one scenario, ready to simulate (``slots`` 0: it does not fit)."""

    variant: str
    slots: int
    step: StepTime
    update: Update
    kv_tokens: float  # KV cache capacity per engine, tokens
    staging_gb_gpu: float  # device memory the variant takes from the KV cache, per GPU
    host_gb_node: float  # pinned host memory per node (host staging)
    note: str = ""


def plan(s: Scenario, variant: str) -> Plan:
    """Memory, concurrency, step time and update costs of ``variant`` on scenario ``s``."""
    if variant not in VARIANTS:
        raise ValueError(f"plan: variant={variant!r} is not one of {VARIANTS}")
    m, f, g, sv, ln, u = s.model, s.fleet, s.gpu, s.serving, s.link, s.updates
    size = m.params_b * 1e9 * m.bytes_per_param  # the checkpoint, bytes (S)
    ranks = f.tp * f.pp
    shard = size / ranks  # live weights per GPU
    copies = 2 if u.rollback else 1
    # what one rank keeps of a staged version, and what the trainer sends one engine: the whole
    # checkpoint, or (_shard) the rank's boxes, the most any rank reads, and the sum over ranks
    layered = variant in LAYERED
    boxed = variant.endswith("_shard") or layered
    per_rank = staging_bytes(s.arch, f.tp, m.bytes_per_param) if boxed else size
    sent = link_bytes(s.arch, f.tp, m.bytes_per_param) if boxed else size
    on_host = variant.startswith("inflight_host")
    staging = 0.0 if not variant.startswith("inflight") else u.bucket_gb * GB if on_host else per_rank * copies
    host = per_rank * copies * f.gpus_per_node if on_host else 0.0
    if layered:  # staged_groups slots of the largest group on the device (and as many on the host)
        slots_bytes = u.staged_groups * layer_slot_bytes(s)
        staging = slots_bytes + (u.bucket_gb * GB if on_host else 0.0)  # host: the landing bucket too
        host = slots_bytes * f.gpus_per_node if on_host else 0.0
    free = g.memory_gb * GB * sv.mem_util - shard - sv.reserve_gb * GB - staging
    kv_tokens = max(free, 0.0) / m.kv_bytes_per_token_gpu
    _, age = s.lengths.moments()
    held = s.prompt_tokens + age  # KV a running request holds on average
    slots = min(sv.max_num_seqs, math.floor(kv_tokens / held))
    note = ""
    if variant.startswith("inflight") and f.pp > 1:
        slots, note = 0, "refused: pipeline parallel"
    elif slots < 1:
        slots, note = 0, f"does not fit: {staging / GB:.0f} GB staging per GPU"
    elif host > g.host_memory_gb_per_node * GB:
        slots, note = 0, f"does not fit: {host / GB:.0f} GB pinned host memory per node"
    hbm = g.hbm_tbps * 1e12 * sv.mbu
    step = StepTime(overhead_s=sv.step_overhead_ms / 1e3, weights_max_s=shard / hbm,
                    weights_per_seq_s=m.active_params_b * 1e9 * m.bytes_per_param / ranks / hbm,
                    kv_per_seq_s=held * m.kv_bytes_per_token_gpu / hbm,
                    flops_per_seq_s=2 * m.active_params_b * 1e9 / ranks / (g.tflops * 1e12 * sv.mfu))
    wire = sent * u.wire_ratio  # what crosses the link: the update, or its sparse delta
    transfer = max(wire / (ln.engine_gbps * GB), f.engines * wire / (ln.egress_gbps * GB) if ln.egress_gbps else 0.0)
    if variant == "none":
        update = Update(mode="none")
    elif layered:
        update = layer_update(s, transfer, hbm, on_host)
    elif variant in ("pause", "batch"):  # the engine waits for the transfer and the load
        load = shard * u.commit_hbm_passes / hbm + ln.load_fixed_s
        update = Update(mode=variant, every_s=u.every_s, stall_s=transfer + load)
    else:  # staged beside decoding: every rank's HBM sees what it is sent go by
        live = per_rank if boxed else shard  # the commit copies the rank's part into its live weights
        commit = live / (g.h2d_gbps * GB) if on_host else live * u.commit_hbm_passes / hbm
        stolen = per_rank * u.staging_hbm_passes / hbm  # HBM time decode loses while staging
        update = Update(mode="inflight", every_s=u.every_s, stall_s=commit + ln.commit_fixed_s, stage_s=transfer,
                        stage_cost_s=stolen)
    return Plan(variant=variant, slots=slots, step=step, update=update, kv_tokens=kv_tokens,
                staging_gb_gpu=staging / GB, host_gb_node=host / GB, note=note)


def layer_groups_by_rank(s: Scenario) -> list[tuple[int, ...]]:
    """Each rank's bytes of each layer group (commit order) in scenario ``s``."""
    return [group_bytes(s.arch, s.fleet.tp, r, s.model.bytes_per_param) for r in range(s.fleet.tp)]


def layer_slot_bytes(s: Scenario) -> int:
    """One staging slot of a layer-granular update: the largest group any rank holds."""
    return max(max(g) for g in layer_groups_by_rank(s))


def layer_update(s: Scenario, transfer: float, hbm: float, on_host: bool) -> Update:
    """A layer-granular update: per group, its commit (the fixed cost of a step-boundary RPC,
    ``commit_fixed_s``, plus one device copy of the group's bytes on the slowest rank, at the
    HBM rate the whole-model commit uses), its share of the link's ``transfer`` seconds (its
    bytes over all ranks), and, staged on the host, its copy into a device slot before it can
    commit. Staging costs decode the same HBM traffic as the shard mode's, plus, on the host,
    the write into the slot."""
    ranks, u = layer_groups_by_rank(s), s.updates
    most, sent = [max(g) for g in zip(*ranks)], [sum(g) for g in zip(*ranks)]
    stalls = tuple(s.link.commit_fixed_s + b * u.commit_hbm_passes / hbm for b in most)
    stage = tuple(transfer * b / sum(sent) for b in sent)
    ready = tuple(b / (s.gpu.h2d_gbps * GB) for b in most) if on_host else ()
    stolen = max(sum(g) for g in ranks) * (u.staging_hbm_passes + (1 if on_host else 0)) / hbm
    return Update(mode="layer", every_s=u.every_s, stall_s=sum(stalls), stage_s=sum(stage), stage_cost_s=stolen,
                  group_stall_s=stalls, group_stage_s=stage, group_ready_s=ready, staged_groups=u.staged_groups)


def bytes_row(s: Scenario) -> dict:
    """What one update moves in scenario ``s`` (GB): the checkpoint, what the trainer sends one
    engine with shard targeting (every rank its boxes), and what one rank stages at most."""
    a, tp, b = s.arch, s.fleet.tp, s.model.bytes_per_param
    top = max((rank_bytes(a, tp, r, b) for r in range(tp)), key=lambda r: r.total)
    size = rank_bytes(a, 1, 0, b).total
    return {"scenario": s.name, "tp": tp, "checkpoint_gb": round(size / GB, 2),
            "link_gb": round(link_bytes(a, tp, b) / GB, 2), "rank_gb": round(top.total / GB, 2),
            "rank_whole_gb": round(top.replicated / GB, 2), "rank_over_even": round(top.total * tp / size, 4),
            "rank_rollback_gb": round(2 * top.total / GB, 2)}


def published_rows(s: Scenario) -> list[dict]:
    """Pause's update (transfer and load, seconds) in scenario ``s`` at each system's published rate."""
    out = []
    for system in dict.fromkeys(t.system for t in s.transfers):
        v = s.via(system)
        out.append({"scenario": s.name, "system": system, "engine_gbps": round(v.link.engine_gbps, 1),
                    "pause_s": round(plan(v, "pause").update.stall_s, 3)})
    return out
