"""Staging memory is accounted before the first push: the exact bytes, the refusal that
names them and a setting that fits, the reservation at start; and, on CUDA, the order of
a commit's copies against the next forward pass."""

from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file

from engine_patches.commit.checkpoint import checkpoint_schema
from inflight.staging import (
    StagingMemoryError,
    StagingNeed,
    check_fits,
    ordered_commit,
    ready_event,
    staging_need,
    update_bytes,
)
from inflight.transport.layout import plan_tensors
from inflight.staging import StagingPool

GiB = 1 << 30


def test_update_bytes_is_exactly_what_the_trainer_packs(tiny_qwen) -> None:
    schema = checkpoint_schema(tiny_qwen, torch.float32)
    state = load_file(str(tiny_qwen / "model.safetensors"))
    _, packed = plan_tensors((n, tuple(t.shape), "float32") for n, t in state.items())
    assert update_bytes(schema) == packed
    need = staging_need(schema, staging="device", keep_rollback=True)
    assert need.nbytes == 2 * packed
    assert staging_need(schema, staging="host", keep_rollback=False).nbytes == packed


def test_a_gpu_that_cannot_stage_is_refused_with_the_bytes_and_a_utilization_that_fits() -> None:
    need = StagingNeed(update_bytes=GiB, copies=2, where="device")
    cuda = torch.device("cuda", 0)
    check_fits(need, device=cuda, free_bytes=3 * GiB, total_bytes=80 * GiB, gpu_memory_utilization=0.9)  # fits
    with pytest.raises(StagingMemoryError) as exc:
        check_fits(need, device=cuda, free_bytes=int(1.5 * GiB), total_bytes=80 * GiB, gpu_memory_utilization=0.9)
    msg = str(exc.value)
    # 2 GiB + 0.5 GiB margin - 1.5 GiB free = 1 GiB short of 80 GiB: 0.9 - 1/80 = 0.8875 -> 0.88
    assert "2.00 GiB of device memory (2 x 1.00 GiB update, one kept for rollback)" in msg
    assert "1.50 GiB of 80.00 GiB is free" in msg and "gpu_memory_utilization=0.90" in msg
    assert "gpu_memory_utilization<=0.88" in msg and "staging='host'" in msg
    with pytest.raises(StagingMemoryError, match="cannot stage on this GPU at any gpu_memory_utilization"):
        check_fits(StagingNeed(update_bytes=60 * GiB, copies=2, where="device"), device=cuda, free_bytes=GiB,
                   total_bytes=80 * GiB, gpu_memory_utilization=0.9)


def test_a_cpu_engine_that_cannot_stage_names_the_kv_cache_space_to_give_up() -> None:
    need = StagingNeed(update_bytes=GiB, copies=2, where="device", extra_bytes=GiB // 2)
    with pytest.raises(StagingMemoryError) as exc:
        check_fits(need, device=torch.device("cpu"), free_bytes=GiB, total_bytes=16 * GiB, gpu_memory_utilization=None)
    assert "2.50 GiB of device memory" in str(exc.value) and "+ 0.50 GiB prepared weights" in str(exc.value)
    assert "Lower VLLM_CPU_KVCACHE_SPACE by 2 GiB" in str(exc.value)


def test_the_pool_hands_out_what_it_reserved() -> None:
    pool = StagingPool(torch.device("cpu"))
    pool.reserve(1000, 2)
    ptrs = {t.data_ptr() for t in pool._free}
    a, b = pool.take(900), pool.take(1000)
    assert {a.data_ptr(), b.data_ptr()} == ptrs
    pool.give(a)
    assert pool.take(1000).data_ptr() == a.data_ptr()


def test_engine_reserves_at_start_and_refuses_a_budget_it_would_not_fit(tiny_qwen, monkeypatch, port) -> None:
    import engine_patches.worker as worker
    from vllm import LLM, SamplingParams

    from engine_patches.config import InflightConfig, engine_kwargs
    from engine_patches.client import start_inflight
    from inflight.transport.group import GroupConfig

    llm = LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=256, seed=0, **engine_kwargs())
    config = InflightConfig(group=GroupConfig(port=port, world_size=2))
    schema = checkpoint_schema(tiny_qwen, torch.float32)
    params = sum(t.numel() * 4 for t in load_file(str(tiny_qwen / "model.safetensors")).values())  # tied: embedding once
    try:
        monkeypatch.setattr(worker, "memory_budget", lambda device, need: (need.nbytes - 1, 16 * GiB))  # forced: 1 B short
        with pytest.raises(Exception, match="inflight: staging needs .* GiB of device memory") as exc:
            start_inflight(llm, config)
        assert "Lower VLLM_CPU_KVCACHE_SPACE" in str(exc.value)
        sp = SamplingParams(temperature=0.0, max_tokens=4)
        assert len(llm.generate(["1+1="], sp, use_tqdm=False)[0].outputs[0].token_ids) == 4  # still serving
        monkeypatch.undo()
        report = start_inflight(llm, config)  # nothing was left half-started
        # two update buffers (staging + rollback) and the swap commit's prepared and swapped-out
        # weights, in the engine's shapes: vLLM pads the (tied) vocabulary to a multiple of 64
        vocab, hidden = schema.tensors["model.embed_tokens.weight"][0]
        engine_params = params + (-(-vocab // 64) * 64 - vocab) * hidden * 4
        assert report.staging_bytes == 2 * update_bytes(schema) + 2 * engine_params
    finally:
        llm.collective_rpc("inflight_stop")
        del llm
        exc = None  # the refusal's traceback holds start_inflight's frames, and through them the engine
        # Collected now, not under a later test's engine: vLLM's teardown of an engine resets
        # the process's parallel groups (a later test then failed "pipeline model parallel
        # group is not initialized").
        gc.collect()


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
    assert total.item() == live.numel()
