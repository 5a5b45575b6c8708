"""The memory an in-flight worker holds beside the engine's own: every byte counted, per
node, checked before anything is allocated, then allocated at that exact size.

vLLM sizes its KV cache at engine start, before any worker extension runs, so a worker that allocated on
its first push would fail mid-update. ``inflight_start`` therefore counts what it needs (``staging_need``),
refuses to start with the figure and a setting that would fit when it is not free (``check_fits``), and
otherwise allocates it at once. An engine built with a staging intent (``engine_kwargs(reserve_staging=...)``)
has its device bytes taken out of the KV cache's budget before vLLM sizes it (``kv_cache_after_staging``,
applied by ``inflight.engine.kv_budget``), and is checked against that ``SetAside``, not free memory.

Counted: the staging buffer (one update); the rollback copy (``keep_rollback``, ``reload`` and ``copy``
commits); for sparse updates (``keep_base``) the live version's bytes and one update's wire bytes; the
commit strategy's own memory (``CommitStrategy.held_bytes``); bucket windows (GPU data plane only); the
checksum temporaries. Why each exists: docs/design.md, "Design notes by module".

Invariants: an engine that started can always stage. Host buffers are plain allocations of the exact size,
registered with CUDA (``pinned_exact``), not PyTorch's power-of-two caching host allocator, and written
once when reserved, so they are resident from the start (an untouched allocation would count as free to
the next engine starting on the node). The tensor-parallel workers of a node share its RAM: host bytes are
checked for all of them at once.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from inflight.protocol import ALIGN, DTYPE_ITEMSIZE, ShardPlan
from inflight.settings import StagingPlace
from inflight.transport.schema import TensorSchema

WSUM_CHUNK_WORDS = 1 << 22
"""int64 words a ``wsum64`` checksum sums per step (``inflight.transport.bucket.checksum``)."""
WSUM_TEMP_BYTES = 2 * 8 * WSUM_CHUNK_WORDS
"""Device temporaries of one ``wsum64`` chunk (its weights and their products)."""

GiB = float(1 << 30)
CUDA_MARGIN_BYTES = 512 << 20
"""Left free on a GPU beyond staging: allocator fragmentation and NCCL's own buffers."""


class StagingMemoryError(RuntimeError):
    """The engine cannot hold the staging buffers it would need."""


def tensor_bytes(schema: TensorSchema, plan: ShardPlan | None = None) -> dict[str, int]:
    """Each tensor's bytes in the aligned flat layout: whole, or, with this worker's shard
    ``plan``, the box it reads."""
    boxes = {} if plan is None else {s.name: s.length for s in plan.shards}
    return {name: -(-math.prod(boxes.get(name, shape)) * DTYPE_ITEMSIZE[dtype] // ALIGN) * ALIGN
            for name, (shape, dtype) in schema.tensors.items()}


def update_bytes(schema: TensorSchema, plan: ShardPlan | None = None, names: Iterable[str] | None = None) -> int:
    """Bytes of one update on the wire and in staging (``tensor_bytes`` summed): every tensor,
    or those of ``names``."""
    sizes = tensor_bytes(schema, plan)
    return sum(sizes.values()) if names is None else sum(sizes[n] for n in names)


@dataclass(frozen=True)
class Part:
    what: str
    nbytes: int
    place: StagingPlace
    """``device``: the engine's device (host RAM on a CPU engine); ``host``: host RAM."""


@dataclass(frozen=True)
class StagingNeed:
    """Every buffer one worker holds beside the engine's own, by where it lives."""

    update_bytes: int
    copies: int
    """Update-sized buffers: the one staged, plus the rollback copy (``reload``/``copy`` commits)."""
    where: StagingPlace
    """Where those live: ``device`` (the engine's device) or ``host`` (pinned host memory)."""
    parts: tuple[Part, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def bytes_on(self, place: StagingPlace, device: torch.device) -> int:
        """Bytes in ``place``; on a CPU engine both places are host RAM."""
        return sum(p.nbytes for p in self.parts if p.place == place or device.type == "cpu")

    def describe(self, place: StagingPlace | None = None, device: torch.device | None = None) -> str:
        parts = [p for p in self.parts
                 if place is None or p.place == place or (device is not None and device.type == "cpu")]
        total = sum(p.nbytes for p in parts)
        items = ", ".join(f"{p.what} {p.nbytes / GiB:.2f}" for p in parts if p.nbytes)
        return f"{total / GiB:.2f} GiB ({items})"


def staging_need(schema: TensorSchema, *, plan: ShardPlan | None = None, staging: StagingPlace, rollback_copy: bool,
                 commit_bytes: int = 0, commit: str = "swap", bucket_bytes: int = 0, plane_cuda: bool = False,
                 mac: bool = False, groups: Sequence[Sequence[str]] = (), window: int = 0,
                 base_copy: bool = False) -> StagingNeed:
    """What a worker holds (see the module docstring). ``plane_cuda``: buckets land on the
    engine's GPU (NCCL), where the windows and checksum temporaries live; ``mac``: a secret
    is set; ``plan``: this worker's shard plan, whose boxes alone it stages (in a
    point-to-point generation); ``groups`` and ``window``: a layer-granular commit stages
    ``window`` layer groups at most, each as large as the largest of ``groups``;
    ``base_copy``: sparse updates are taken (``keep_base``)."""
    if groups and window:
        sizes = tensor_bytes(schema, plan)
        n = max(sum(sizes[name] for name in g) for g in groups)
        parts = [Part(f"staging ({window} layer groups)", window * n, staging)]
        if rollback_copy:
            raise ValueError("a layer-granular commit keeps no rollback copy (it commits with swap)")
        copies = window
    else:
        n = update_bytes(schema, plan)
        copies = 2 if rollback_copy else 1
        parts = [Part("staging", n, staging)]
    if rollback_copy:
        parts.append(Part("rollback copy", n, staging))
    if base_copy:
        if groups and window:
            raise ValueError("a layer-granular commit takes dense updates only (keep_base=False)")
        if not rollback_copy:  # else the rollback copy is the base
            parts.append(Part("sparse base", n, staging))
        parts.append(Part("sparse wire bytes", n, staging))
        copies += 1 + (not rollback_copy)
    if commit_bytes:
        parts.append(Part(f"{commit} commit", commit_bytes, "device"))
    if plane_cuda:
        if staging == "host":
            parts.append(Part("landing windows", 2 * bucket_bytes, "device"))
        if mac:
            parts.append(Part("MAC host copy", bucket_bytes, "host"))
        parts.append(Part("checksum temporaries", WSUM_TEMP_BYTES, "device"))
    return StagingNeed(n, copies, staging, tuple(parts))


@dataclass(frozen=True)
class MemoryBudget:
    """Free and total bytes, measured before anything was reserved: on the engine's device
    (for a CPU engine, the host) and on the host."""

    device_free: int
    device_total: int
    host_free: int
    host_total: int


def memory_budget(device: torch.device) -> MemoryBudget:
    import psutil

    vm = psutil.virtual_memory()
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return MemoryBudget(free, total, vm.available, vm.total)
    return MemoryBudget(vm.available, vm.total, vm.available, vm.total)


@dataclass(frozen=True)
class SetAside:
    """What a worker took out of its KV cache's budget for staging, before vLLM sized it."""

    nbytes: int
    """Staging's device bytes at the intent's settings, with the GPU margin (``set_aside_bytes``)."""
    built_for: str
    """The intent it was computed for, as the refusal names it."""
    kv_before: int
    """What vLLM would have given the KV cache without it."""


def set_aside_bytes(need: StagingNeed, device: torch.device) -> int:
    """Device bytes to keep out of the KV cache for ``need``: its device part, and on a GPU the
    margin ``check_fits`` keeps free beside it (fragmentation, the weight group's NCCL buffers)."""
    return need.bytes_on("device", device) + (CUDA_MARGIN_BYTES if device.type == "cuda" else 0)


def kv_cache_after_staging(available: int, need: StagingNeed, *, device: torch.device, total: int,
                           utilization: float) -> int:
    """What the KV cache may have once ``need`` is set aside: ``available`` (vLLM's figure, its
    requested memory less weights, activation peak and graphs) less ``set_aside_bytes``.
    Raise ``StagingMemoryError`` naming the bytes and a setting that fits when nothing is left."""
    nbytes = set_aside_bytes(need, device)
    if nbytes < available:
        return available - nbytes
    margin = f" + {CUDA_MARGIN_BYTES / GiB:.2f} GiB margin" if device.type == "cuda" else ""
    fit = round(math.floor(100 * (utilization + (nbytes - available) / total)) / 100 + 0.01, 2)  # strictly above
    msg = (f"inflight: staging needs {need.describe('device', device)}{margin} of device memory per rank, set aside "
           f"before the KV cache, but vLLM's budget at gpu_memory_utilization={utilization:.2f} leaves only "
           f"{available / GiB:.2f} GiB of {total / GiB:.2f} GiB for the KV cache. ")
    msg += (f"Start the engine with gpu_memory_utilization>={fit:.2f}, or " if fit <= 1 else
            "No gpu_memory_utilization leaves room for it on this GPU: ")
    msg += "set staging='host' (only bucket windows stay on the device), or keep_rollback=False."
    raise StagingMemoryError(msg)


def check_fits(need: StagingNeed, *, device: torch.device, budget: MemoryBudget, node_workers: int = 1,
               gpu_memory_utilization: float | None = None, set_aside: SetAside | None = None) -> None:
    """Raise ``StagingMemoryError`` naming the bytes and a setting that would fit, unless
    ``need`` fits: device bytes in what was set aside for them before the KV cache was sized
    (``set_aside``) or else in the device's free memory (less a margin on a GPU), and host
    bytes of all ``node_workers`` workers of this engine on this node (each needs the same) in
    the host's."""
    if set_aside is not None:
        _check_set_aside(need, device, set_aside)
    elif device.type == "cuda":
        _check_gpu(need, device, budget, gpu_memory_utilization)
    host = need.bytes_on("host", device) * node_workers
    if host <= budget.host_free:
        return
    deficit = host - budget.host_free
    who = f"{node_workers} workers of this engine on this node x " if node_workers > 1 else ""
    msg = (f"inflight: staging needs {who}{need.describe('host', device)} of host memory, but only "
           f"{budget.host_free / GiB:.2f} GiB of {budget.host_total / GiB:.2f} GiB is free on this host.")
    if device.type == "cpu":
        msg += f" Lower VLLM_CPU_KVCACHE_SPACE by {math.ceil(deficit / GiB / node_workers)} GiB, or "
    else:
        msg += " Free host memory, or "
    msg += "set InflightConfig(keep_rollback=False)." if need.copies > 1 else "use a smaller max_bucket_mb."
    raise StagingMemoryError(msg)


def _check_gpu(need: StagingNeed, device: torch.device, budget: MemoryBudget, utilization: float | None) -> None:
    nbytes = need.bytes_on("device", device)
    if nbytes + CUDA_MARGIN_BYTES <= budget.device_free:
        return
    assert utilization is not None
    deficit = nbytes + CUDA_MARGIN_BYTES - budget.device_free
    fit = math.floor(100 * (utilization - deficit / budget.device_total)) / 100
    msg = (f"inflight: staging needs {need.describe('device', device)} of device memory, but only "
           f"{budget.device_free / GiB:.2f} GiB of {budget.device_total / GiB:.2f} GiB is free after vLLM sized its "
           f"KV cache at gpu_memory_utilization={utilization:.2f}. ")
    msg += (f"Start the engine with gpu_memory_utilization<={fit:.2f}, or " if fit > 0 else "The model cannot stage on "
            "this GPU at any gpu_memory_utilization: use ")
    msg += "InflightConfig(staging='host') (commit becomes a host-to-device copy), or keep_rollback=False."
    raise StagingMemoryError(msg)


def _check_set_aside(need: StagingNeed, device: torch.device, set_aside: SetAside) -> None:
    nbytes = set_aside_bytes(need, device)
    if nbytes <= set_aside.nbytes:
        return
    margin = f" + {CUDA_MARGIN_BYTES / GiB:.2f} GiB margin" if device.type == "cuda" else ""
    raise StagingMemoryError(
        f"inflight: this config stages {need.describe('device', device)}{margin} of device memory per rank, but the "
        f"engine set aside {set_aside.nbytes / GiB:.2f} GiB before sizing its KV cache, for {set_aside.built_for}. "
        "Start it with those settings, or ones that stage less on the device (staging='host', keep_rollback=False), "
        "or build the engine with engine_kwargs(reserve_staging=<this config>).")


def pinned_exact(nbytes: int) -> torch.Tensor:
    """``nbytes`` of pinned host memory, exactly: a plain host allocation registered with CUDA
    (``cudaHostRegister``), unregistered when the tensor is collected (before the memory is
    freed: views keep the storage alive, not the registration)."""
    t = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0:
        return t
    t.zero_()  # resident now (registration pins the pages either way)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 0))
    if err != 0:
        raise RuntimeError(f"inflight: pinning {nbytes} B of host memory failed (cudaError {err}); the host's "
                           "locked-memory limit (ulimit -l) may be too low")
    weakref.finalize(t, _unregister, t.data_ptr())
    return t


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


@dataclass
class BucketWindows:
    """A worker's reserved bucket windows (see the module docstring), sized for buckets of
    up to ``bucket_bytes``; the receiver refuses an update with larger ones."""

    bucket_bytes: int
    landing: list[torch.Tensor]
    mac_host: torch.Tensor | None

    @classmethod
    def reserve(cls, bucket_bytes: int, plane: torch.device, *, landing: bool, mac: bool) -> BucketWindows | None:
        """The windows a GPU data plane needs (None where buckets land in the staging buffer)."""
        if plane.type != "cuda" or not (landing or mac):
            return None
        return cls(bucket_bytes,
                   [torch.empty(bucket_bytes, dtype=torch.uint8, device=plane) for _ in range(2 if landing else 0)],
                   pinned_exact(bucket_bytes) if mac else None)
