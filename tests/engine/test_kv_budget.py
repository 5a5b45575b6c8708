"""Staging's device bytes come out of the KV cache's budget before vLLM sizes it, on an engine
built with a staging intent (``inflight.engine.kv_budget``): the arithmetic and its refusal,
the intent's way to the worker, ``inflight_start`` holding its config to what was set
aside, and, on a GPU, the KV cache that vLLM allocates."""

from __future__ import annotations

import gc
import types
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pytest
import torch

from inflight.engine.engine_config import STAGING_INTENT_KEY, InflightConfig, StagingIntent, engine_kwargs
from inflight.memory import (
    CUDA_MARGIN_BYTES,
    WSUM_TEMP_BYTES,
    MemoryBudget,
    Part,
    SetAside,
    StagingMemoryError,
    StagingNeed,
    check_fits,
    kv_cache_after_staging,
    update_bytes,
)
from inflight.transport.group_config import GroupConfig

GiB = 1 << 30
MiB = 1 << 20
CUDA = torch.device("cuda", 0)


def _device_need(update: int) -> StagingNeed:
    """Device staging with a rollback copy: 2 x ``update`` on the device."""
    return StagingNeed(update, 2, "device",
                       (Part("staging", update, "device"), Part("rollback copy", update, "device")))


def test_the_kv_cache_gets_what_vllm_computed_less_staging_and_the_margin() -> None:
    assert kv_cache_after_staging(10 * GiB, _device_need(GiB), device=CUDA, total=80 * GiB,
                                  utilization=0.9) == 10 * GiB - 2 * GiB - CUDA_MARGIN_BYTES
    # host staging leaves only the bucket windows and the checksum temporaries on the device
    host = StagingNeed(GiB, 2, "host", (Part("staging", GiB, "host"), Part("rollback copy", GiB, "host"),
                                         Part("landing windows", 2 * 256 * MiB, "device"),
                                         Part("checksum temporaries", WSUM_TEMP_BYTES, "device")))
    assert kv_cache_after_staging(10 * GiB, host, device=CUDA, total=80 * GiB, utilization=0.9) == (
        10 * GiB - 512 * MiB - WSUM_TEMP_BYTES - CUDA_MARGIN_BYTES)


def test_a_budget_staging_does_not_fit_is_refused_with_the_bytes_and_a_utilization_that_fits() -> None:
    with pytest.raises(StagingMemoryError,
                       match=r"gpu_memory_utilization=0\.90 leaves only 1\.00 GiB of 80\.00 GiB") as exc:
        kv_cache_after_staging(GiB, _device_need(GiB), device=CUDA, total=80 * GiB, utilization=0.9)
    msg = str(exc.value)
    assert "2.00 GiB (staging 1.00, rollback copy 1.00) + 0.50 GiB margin of device memory per rank" in msg
    assert "gpu_memory_utilization=0.90 leaves only 1.00 GiB of 80.00 GiB" in msg
    # 2.5 GiB set aside - 1 GiB available = 1.5 GiB short of 80 GiB: 0.9 + 0.01875, strictly above -> 0.92
    assert "gpu_memory_utilization>=0.92" in msg and "staging='host'" in msg and "keep_rollback=False" in msg
    with pytest.raises(StagingMemoryError, match="No gpu_memory_utilization leaves room for it on this GPU"):
        kv_cache_after_staging(GiB, _device_need(40 * GiB), device=CUDA, total=80 * GiB, utilization=0.9)


def test_start_checks_the_config_against_what_was_set_aside_not_the_free_memory() -> None:
    need = _device_need(GiB)
    nothing_free = MemoryBudget(0, 80 * GiB, 64 * GiB, 512 * GiB)  # the set-aside is what counts
    enough = SetAside(2 * GiB + CUDA_MARGIN_BYTES, "StagingIntent(...)", 40 * GiB)
    check_fits(need, device=CUDA, budget=nothing_free, gpu_memory_utilization=0.9, set_aside=enough)
    short = SetAside(GiB + CUDA_MARGIN_BYTES, "StagingIntent(keep_rollback=False)", 40 * GiB)
    with pytest.raises(StagingMemoryError, match=r"set aside 1\.50 GiB before sizing its KV cache") as exc:
        check_fits(need, device=CUDA, budget=nothing_free, gpu_memory_utilization=0.9, set_aside=short)
    assert "stages 2.00 GiB (staging 1.00, rollback copy 1.00) + 0.50 GiB margin" in str(exc.value)
    assert "set aside 1.50 GiB before sizing its KV cache, for StagingIntent(keep_rollback=False)" in str(exc.value)


def test_the_intent_is_validated_and_rides_in_additional_config() -> None:
    config = InflightConfig(group=GroupConfig(port=1, world_size=2, backend="gloo"), staging="host", max_bucket_mb=64)
    kwargs = engine_kwargs(reserve_staging=config, additional_config={"other": 1}, max_num_seqs=4)
    assert kwargs["max_num_seqs"] == 4 and kwargs["additional_config"]["other"] == 1
    intent = StagingIntent.from_additional_config(kwargs["additional_config"])
    assert intent == StagingIntent(staging="host", max_bucket_mb=64, backend="gloo") == StagingIntent.of(config)
    assert "additional_config" not in engine_kwargs()  # an engine without the intent is built as before
    assert StagingIntent.from_additional_config({}) is None
    with pytest.raises(ValueError, match=r"StagingIntent.staging='gpu' is not one of 'device', 'host'"):
        StagingIntent(staging="gpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="StagingIntent.max_bucket_mb=0 must be > 0"):
        StagingIntent(max_bucket_mb=0)
    with pytest.raises(ValueError, match=r"unknown fields \['stagging'\]"):
        StagingIntent.from_additional_config({STAGING_INTENT_KEY: {"stagging": "host"}})


def test_the_wrapper_sets_aside_only_on_an_engine_built_with_the_intent(monkeypatch) -> None:
    """vLLM's own figure comes back unchanged without the intent and when the user sized the KV
    cache (``kv_cache_memory_bytes``); with it, less the staging, remembered on the worker."""
    from vllm.v1.worker.gpu_worker import Worker

    import inflight.engine.kv_budget as kv_budget

    monkeypatch.setattr(Worker, "determine_available_memory", lambda self: 10 * GiB)  # vLLM's figure
    kv_budget.patch_available_memory()
    kv_budget.patch_available_memory()  # idempotent
    monkeypatch.setattr(kv_budget, "intended_need", lambda worker, intent: _device_need(GiB))

    def worker(additional: dict, kv_bytes: int | None) -> Any:
        return types.SimpleNamespace(
            cache_config=types.SimpleNamespace(kv_cache_memory_bytes=kv_bytes, gpu_memory_utilization=0.9),
            vllm_config=types.SimpleNamespace(additional_config=additional),
            init_snapshot=types.SimpleNamespace(total_memory=80 * GiB), model_runner=types.SimpleNamespace(device=CUDA),
            available_kv_cache_memory_bytes=10 * GiB)

    intent = engine_kwargs(reserve_staging=StagingIntent())["additional_config"]
    plain, sized, built = worker({}, None), worker(intent, 4 * GiB), worker(intent, None)
    assert Worker.determine_available_memory(plain) == 10 * GiB and not hasattr(plain, kv_budget.SET_ASIDE_ATTR)
    assert Worker.determine_available_memory(sized) == 10 * GiB and not hasattr(sized, kv_budget.SET_ASIDE_ATTR)
    left = 8 * GiB - CUDA_MARGIN_BYTES
    assert Worker.determine_available_memory(built) == left == built.available_kv_cache_memory_bytes
    assert getattr(built, kv_budget.SET_ASIDE_ATTR) == SetAside(2 * GiB + CUDA_MARGIN_BYTES, repr(StagingIntent()),
                                                                10 * GiB)


def _intent_on_worker(worker: Any) -> Any:
    return worker.vllm_config.additional_config.get(STAGING_INTENT_KEY)


def _set_aside_on_worker(worker: Any) -> SetAside | None:
    from inflight.engine.kv_budget import SET_ASIDE_ATTR

    return getattr(worker, SET_ASIDE_ATTR, None)


def _reserve_on_worker(wrapper: Any, available: int) -> int:
    """The step a GPU worker's ``determine_available_memory`` takes, on this CPU worker (a
    callable RPC gets vLLM's wrapper, which reads through to the worker but keeps what is set)."""
    from inflight.engine.kv_budget import reserve_before_kv_cache

    return reserve_before_kv_cache(wrapper.worker, available, total=16 * GiB, utilization=0.9)


def _param_bytes(worker: Any) -> int:
    return sum(p.numel() * p.element_size() for p in worker.model_runner.get_model().parameters())


def test_the_intent_reaches_the_worker_and_start_refuses_a_config_needing_more_than_was_set_aside(
        tiny_llama, port) -> None:
    """vLLM CPU sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` and sets nothing aside; the
    set-aside step of a GPU worker is run here on the CPU worker, with its loaded model."""
    from vllm import LLM, SamplingParams

    from inflight.engine.client import start_inflight
    from inflight.engine.commit.engine_checkpoint import checkpoint_schema

    group = GroupConfig(port=port, world_size=2)
    fits = InflightConfig(group=group, commit="reload", keep_rollback=False)
    llm = LLM(str(tiny_llama), enforce_eager=True, dtype="float32", max_model_len=256, seed=0,
              **engine_kwargs(reserve_staging=fits))
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    try:
        assert llm.collective_rpc(_intent_on_worker) == [StagingIntent.of(fits).to_dict()]
        assert llm.collective_rpc(_set_aside_on_worker) == [None]  # the CPU engine's KV space is the user's
        # the staging buffer and what the reload commit materializes: the checkpoint's bytes and the engine's
        expected = update_bytes(checkpoint_schema(tiny_llama, torch.float32)) + llm.collective_rpc(_param_bytes)[0]
        assert llm.collective_rpc(_reserve_on_worker, args=(GiB,)) == [GiB - expected]
        assert llm.collective_rpc(_set_aside_on_worker)[0].nbytes == expected

        needs_more = InflightConfig(group=group, commit="reload", keep_rollback=True)  # + the rollback copy
        with pytest.raises(Exception, match=r"inflight: this config stages .* GiB \(staging .*rollback copy") as exc:
            start_inflight(llm, needs_more)
        assert "before sizing its KV cache, for StagingIntent(staging='device', keep_rollback=False" in str(exc.value)
        assert len(llm.generate(["1+1="], sp, use_tqdm=False)[0].outputs[0].token_ids) == 4  # still serving

        report = start_inflight(llm, fits)
        assert report.reserved_bytes == expected  # what was set aside is what start reserved
        assert len(llm.generate(["1+1="], sp, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        llm.collective_rpc("inflight_stop")
        del llm
        exc = None  # the refusal's traceback holds the engine through start_inflight's frames
        gc.collect()  # collected now, not under a later test's engine


def _kv_cache_of(worker: Any) -> tuple[int, int, int, tuple[int, int] | None]:
    """(blocks, bytes per block over all layers, vLLM's available figure, (set aside, figure before))."""
    cfg = worker.model_runner.kv_cache_config
    block = max(t.size for t in cfg.kv_cache_tensors) // cfg.num_blocks  # groups alias one allocation of every layer
    aside = _set_aside_on_worker(worker)
    return (cfg.num_blocks, block, int(worker.available_kv_cache_memory_bytes),
            None if aside is None else (aside.nbytes, aside.kv_before))


def _boot_gpu_engine(model_dir: str, port: int,
                     intent: bool) -> tuple[tuple[int, int, int, tuple[int, int] | None], int]:
    """In a fresh process, so both engines are profiled from the same state: the KV cache, and
    the staging ``inflight_start`` reserved (0 without the intent)."""
    from vllm import LLM

    from inflight.engine.client import start_inflight

    config = InflightConfig(group=GroupConfig(port=port, world_size=2))
    llm = LLM(model_dir, enforce_eager=True, dtype="float32", max_model_len=256, seed=0, gpu_memory_utilization=0.1,
              **engine_kwargs(reserve_staging=config if intent else None))
    kv = llm.collective_rpc(_kv_cache_of)[0]
    staged = start_inflight(llm, config).reserved_bytes if intent else 0
    llm.collective_rpc("inflight_stop")
    del llm
    gc.collect()  # vLLM's teardown before the process exits
    return kv, staged


PROFILE_NOISE = 64 * MiB
"""How far vLLM's profiled KV budget may differ between two boots of one engine (non-torch
memory is measured at the driver's granularity); far below the margin alone."""


@pytest.mark.gpu
def test_a_gpu_engine_built_with_the_intent_has_a_kv_cache_smaller_by_the_staging_bytes(tiny_llama, port) -> None:
    pytest.importorskip("vllm", reason="a CUDA machine without vLLM (a trainer's)")

    def boot(intent: bool) -> tuple[tuple[int, int, int, tuple[int, int] | None], int]:
        with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
            return pool.submit(_boot_gpu_engine, str(Path(tiny_llama)), port, intent).result()

    (blocks_a, block, avail_a, aside_a), _ = boot(False)
    (blocks_b, block_b, avail_b, aside_b), staged = boot(True)
    assert aside_a is None and aside_b is not None and block_b == block
    nbytes, before = aside_b
    # device staging, on the GPU: every byte inflight_start reserved was set aside, with the margin
    assert nbytes == staged + CUDA_MARGIN_BYTES
    assert avail_b == before - nbytes  # the figure vLLM sized the KV cache from
    for blocks, avail in ((blocks_a, avail_a), (blocks_b, avail_b)):
        assert 0 <= avail - blocks * block < block  # the KV cache is that figure, in whole blocks
    assert abs(before - avail_a) <= PROFILE_NOISE
    shrink = (blocks_a - blocks_b) * block
    assert abs(shrink - nbytes) <= block + abs(before - avail_a)
