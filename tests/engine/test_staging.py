"""Staging memory is accounted before the first push: every part and why it exists, the
exact bytes, per node, the refusal that names them and a setting that fits, the
reservation at start (resident, at its exact size); and, on CUDA, the order of a commit's
copies against the next forward pass."""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file

from inflight.engine.commit.engine_checkpoint import checkpoint_schema
from inflight.memory import (
    WSUM_TEMP_BYTES,
    MemoryBudget,
    StagingMemoryError,
    StagingNeed,
    check_fits,
    pinned_exact,
    staging_need,
    update_bytes,
)
from inflight.staging import StagingPool, copy_into, ordered_commit, ready_event
from inflight.transport.bucket import plan_tensors

GiB = 1 << 30
MiB = 1 << 20


def _need(update: int, *, copies: int = 2, prepared: int = 0, where: str = "device") -> StagingNeed:
    from inflight.memory import Part

    parts = [Part("staging", update, where)] + ([Part("rollback copy", update, where)] if copies == 2 else [])
    if prepared:
        parts.append(Part("swap commit", prepared, "device"))
    return StagingNeed(update, copies, where, tuple(parts))  # type: ignore[arg-type]


def test_update_bytes_is_exactly_what_the_trainer_packs_and_each_part_is_named(tiny_qwen) -> None:
    schema = checkpoint_schema(tiny_qwen, torch.float32)
    state = load_file(str(tiny_qwen / "model.safetensors"))
    _, packed = plan_tensors((n, tuple(t.shape), "float32") for n, t in state.items())
    assert update_bytes(schema) == packed
    reload = staging_need(schema, staging="device", rollback_copy=True)
    assert reload.nbytes == 2 * packed and [p.what for p in reload.parts] == ["staging", "rollback copy"]
    swap = staging_need(schema, staging="device", rollback_copy=False, commit_bytes=3 * packed)
    assert swap.nbytes == 4 * packed and swap.copies == 1
    # a GPU data plane staging to host memory: two landing windows on the GPU, a host copy
    # of one bucket for its MAC, and wsum64's chunk temporaries
    gpu = staging_need(schema, staging="host", rollback_copy=True, bucket_bytes=64 * MiB, plane_cuda=True, mac=True)
    cuda = torch.device("cuda", 0)
    assert gpu.bytes_on("host", cuda) == 2 * packed + 64 * MiB
    assert gpu.bytes_on("device", cuda) == 2 * 64 * MiB + WSUM_TEMP_BYTES
    # gloo on a CPU engine: buckets land in the staging buffer itself, a bad one too
    assert staging_need(schema, staging="device", rollback_copy=True, bucket_bytes=64 * MiB).nbytes == 2 * packed


def test_a_gpu_that_cannot_stage_is_refused_with_the_bytes_and_a_utilization_that_fits() -> None:
    need = _need(GiB)
    cuda = torch.device("cuda", 0)
    roomy = MemoryBudget(3 * GiB, 80 * GiB, 64 * GiB, 512 * GiB)
    check_fits(need, device=cuda, budget=roomy, gpu_memory_utilization=0.9)  # fits
    with pytest.raises(StagingMemoryError, match=r"1\.50 GiB of 80\.00 GiB is free") as exc:
        check_fits(need, device=cuda, budget=MemoryBudget(int(1.5 * GiB), 80 * GiB, 64 * GiB, 512 * GiB),
                   gpu_memory_utilization=0.9)
    msg = str(exc.value)
    # 2 GiB + 0.5 GiB margin - 1.5 GiB free = 1 GiB short of 80 GiB: 0.9 - 1/80 = 0.8875 -> 0.88
    assert "2.00 GiB (staging 1.00, rollback copy 1.00) of device memory" in msg
    assert "1.50 GiB of 80.00 GiB is free" in msg and "gpu_memory_utilization=0.90" in msg
    assert "gpu_memory_utilization<=0.88" in msg and "staging='host'" in msg
    with pytest.raises(StagingMemoryError, match="cannot stage on this GPU at any gpu_memory_utilization"):
        check_fits(_need(60 * GiB), device=cuda, budget=MemoryBudget(GiB, 80 * GiB, 64 * GiB, 512 * GiB),
                   gpu_memory_utilization=0.9)


def test_a_cpu_engine_that_cannot_stage_names_the_kv_cache_space_to_give_up() -> None:
    need = _need(GiB, prepared=GiB // 2)
    cpu = torch.device("cpu")
    with pytest.raises(StagingMemoryError, match="Lower VLLM_CPU_KVCACHE_SPACE by 2 GiB") as exc:
        check_fits(need, device=cpu, budget=MemoryBudget(GiB, 16 * GiB, GiB, 16 * GiB))
    assert "2.50 GiB (staging 1.00, rollback copy 1.00, swap commit 0.50) of host memory" in str(exc.value)
    assert "Lower VLLM_CPU_KVCACHE_SPACE by 2 GiB" in str(exc.value)


def test_host_memory_is_checked_for_every_worker_of_the_engine_on_the_node() -> None:
    """Tensor parallel workers on one host share its RAM: what fits one of them may not fit two."""
    need = _need(GiB)  # 2 GiB per worker
    cpu = torch.device("cpu")
    budget = MemoryBudget(3 * GiB, 16 * GiB, 3 * GiB, 16 * GiB)
    check_fits(need, device=cpu, budget=budget, node_workers=1)
    with pytest.raises(StagingMemoryError, match=r"2 workers of this engine on this node x 2\.00 GiB") as exc:
        check_fits(need, device=cpu, budget=budget, node_workers=2)
    assert "2 workers of this engine on this node x 2.00 GiB" in str(exc.value)
    assert "Lower VLLM_CPU_KVCACHE_SPACE by 1 GiB" in str(exc.value)  # per worker: 4 - 3 GiB over 2
    # a GPU engine's host staging (pinned) counts per node too; its device memory per GPU
    gpu_need = _need(GiB, where="host")
    roomy_gpu = MemoryBudget(80 * GiB, 80 * GiB, 3 * GiB, 16 * GiB)
    check_fits(gpu_need, device=torch.device("cuda", 0), budget=roomy_gpu, node_workers=1, gpu_memory_utilization=0.9)
    with pytest.raises(StagingMemoryError, match="Free host memory"):
        check_fits(gpu_need, device=torch.device("cuda", 0), budget=roomy_gpu, node_workers=2,
                   gpu_memory_utilization=0.9)


def resident_fraction(t: torch.Tensor) -> float:
    """The fraction of ``t``'s pages in memory now (``mincore``): an allocation nothing wrote
    to has none, whatever the process's RSS says (freed memory the allocator reuses is
    resident already, so an RSS delta can show nothing)."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / pages


def _pool_residency(worker) -> list[float]:
    """Inside the worker: how resident each of its staging buffers is."""
    pool = worker._inflight_pool
    return [resident_fraction(t) for t in pool._free]


def test_the_pool_hands_out_what_it_reserved_and_the_reservation_is_resident() -> None:
    import mmap

    untouched = mmap.mmap(-1, 64 * MiB)  # a fresh mapping nothing wrote to: the probe sees it is not resident
    assert resident_fraction(torch.frombuffer(untouched, dtype=torch.uint8)) < 0.5
    pool = StagingPool(torch.device("cpu"))
    pool.reserve(64 * MiB, 2)
    # written at once: an untouched allocation is not resident, so the next engine starting on
    # the node would count it as free
    assert [resident_fraction(t) for t in pool._free] == [1.0, 1.0]
    ptrs = {t.data_ptr() for t in pool._free}
    a, b = pool.take(60 * MiB), pool.take(64 * MiB)
    assert {a.data_ptr(), b.data_ptr()} == ptrs
    pool.give(a)
    assert pool.take(64 * MiB).data_ptr() == a.data_ptr()


def test_engine_reserves_at_start_and_refuses_a_budget_it_would_not_fit(tiny_qwen, monkeypatch, port) -> None:
    from vllm import LLM, SamplingParams

    import inflight.engine.worker as worker
    from inflight.engine.client import start_inflight
    from inflight.engine.engine_config import InflightConfig, engine_kwargs
    from inflight.transport.group_config import GroupConfig

    llm = LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=256, seed=0, **engine_kwargs())
    config = InflightConfig(group=GroupConfig(port=port, world_size=2))
    schema = checkpoint_schema(tiny_qwen, torch.float32)
    # tied: embedding once
    params = sum(t.numel() * 4 for t in load_file(str(tiny_qwen / "model.safetensors")).values())
    try:
        tight = MemoryBudget(GiB // 1024, 16 * GiB, GiB // 1024, 16 * GiB)  # forced: 1 MiB free
        monkeypatch.setattr(worker, "memory_budget", lambda device: tight)
        with pytest.raises(Exception, match="inflight: staging needs .* GiB .* of host memory") as exc:
            start_inflight(llm, config)
        assert "Lower VLLM_CPU_KVCACHE_SPACE" in str(exc.value)
        sp = SamplingParams(temperature=0.0, max_tokens=4)
        assert len(llm.generate(["1+1="], sp, use_tqdm=False)[0].outputs[0].token_ids) == 4  # still serving
        monkeypatch.undo()
        report = start_inflight(llm, config)  # nothing was left half-started
        # the swap commit: one staging buffer (no rollback copy: it swaps the old modules back)
        # and one prepared version (shadow parameters and their re-packed copies), in the
        # engine's shapes: vLLM pads the (tied) vocabulary to a multiple of 64
        vocab, hidden = schema.tensors["model.embed_tokens.weight"][0]
        engine_params = params + (-(-vocab // 64) * 64 - vocab) * hidden * 4
        assert report.commit == "swap"
        assert report.reserved_bytes == update_bytes(schema) + 2 * engine_params
        assert llm.collective_rpc(_pool_residency) == [[1.0]]  # the staging buffer is resident from the start
    finally:
        llm.collective_rpc("inflight_stop")
        del llm
        exc = None  # the refusal's traceback holds start_inflight's frames, and through them the engine
        # Collected now, not under a later test's engine: vLLM's teardown of an engine resets
        # the process's parallel groups (a later test then failed "pipeline model parallel
        # group is not initialized").
        gc.collect()


@pytest.mark.gpu
def test_pinned_staging_is_allocated_at_its_exact_size() -> None:
    """The caching host allocator would round 1.5 GiB + 1 B up to 2 GiB; the pool registers a
    plain allocation instead, so the bytes pinned are the bytes counted."""
    before = torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0)
    nbytes = 3 * GiB // 2 + 1
    pool = StagingPool(torch.device("cpu"), pin=True)
    pool.reserve(nbytes, 1)
    buf = pool.take(nbytes)
    assert buf.is_pinned() and buf.numel() == nbytes
    assert torch.cuda.host_memory_stats().get("allocated_bytes.all.current", 0) == before  # not the caching allocator
    dev = torch.device("cuda", torch.cuda.current_device())
    buf[-1] = 7
    on_gpu = buf.to(dev, non_blocking=True)  # an asynchronous copy out of pinned memory
    torch.cuda.synchronize()
    assert int(on_gpu[-1]) == 7
    small = pinned_exact(5)
    assert small.is_pinned() and small.numel() == 5


@pytest.mark.gpu
def test_commit_copies_are_ordered_after_staging_and_before_the_next_forward() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    live = torch.zeros(64 << 20, device=dev)  # 256 MiB: long copies, so a missing wait shows
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):  # the listener's staging stream, made slow on purpose
        staged = torch.empty_like(live)
        torch.cuda._sleep(200_000_000)
        staged.fill_(1.0)
        ready = ready_event(dev)
    ordered_commit(dev, ready, lambda: live.copy_(staged))  # on this thread's current stream
    forward = torch.cuda.Stream(dev)
    with torch.cuda.stream(forward):  # the next "forward", on another stream, launched right away
        total = live.sum()
    forward.synchronize()  # .item() below copies on the default stream, which does not wait for this one
    assert total.item() == live.numel()


@pytest.mark.gpu
def test_a_host_staged_commit_copies_every_tensor_and_is_done_when_the_commit_returns() -> None:
    """Pinned host staging into GPU weights: ``copy_into`` queues every copy non-blocking and
    ``ordered_commit``'s one synchronize ends them, so the staging is free to reuse at once."""
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(n, generator=g).pin_memory() for n in (1, 7, 1 << 20, 3 << 20, 5)]
    expected = [s.clone() for s in sources]
    destinations = [torch.zeros(s.numel(), device=dev) for s in sources]
    ordered_commit(dev, None, lambda: copy_into(destinations, sources))
    for s in sources:  # reused by the next update's staging the moment the commit returns
        s.fill_(-1.0)
    assert all(torch.equal(d.cpu(), e) for d, e in zip(destinations, expected))
