"""Exact prefix caching across in-flight commits: no request admitted after a commit reuses
KV or recurrent state computed, wholly or in part, under weights that are no longer live.

``PrefixCacheGuard.on_commit`` runs inside the commit window (the coordinator's step lock, the engine thread,
before the next ``schedule``) and: 1. restarts every request caught mid-prefill (vLLM's own preemption), so a
prompt's KV is computed under one label, the first token's (``TaggedCompletion.prompt_label``); 2. stops every
request that holds KV from inserting more blocks into the index (it decodes on, on its own blocks: stale KV,
exact behaviour log-probs); 3. drops the block pool's hash index (blocks, tables and reference counts untouched).
Every KV cache group of an engine shares that one pool and enters its index through
``KVCacheCoordinator.cache_blocks``, so the steps hold for every manager whose reusable state is all in the
index (``GUARDED_MANAGERS``). A request vLLM preempts for KV space is recomputed under the label of the step
that resumes it; where a commit fell in between it is counted in ``PrefixCacheStats.recomputed``. ``problems``
checks the engine at start; ``caching_off_reason`` says, from a model's config alone, where
``engine_kwargs(model=...)`` turns caching off instead. Why and how: docs/design.md.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import msgspec

from inflight.engine.rpc import PrefixCacheStats

GUARDED_MANAGERS = ("FullAttentionManager", "SlidingWindowManager", "ChunkedLocalAttentionManager", "MambaManager")
"""vLLM 0.32's KV cache managers (``vllm/v1/core/single_type_kv_cache_manager.py``) whose reusable state
is all in the block pool's hash index and enters it through ``KVCacheCoordinator.cache_blocks``: full
attention; sliding-window and chunked local attention (the blocks a window still needs); Mamba,
short-convolution and linear-attention state (``MambaManager``: state at block boundaries, whole
blocks or, with fine-grained hits, partial ones)."""

CPU_MAMBA2_MODEL_TYPES = frozenset({"falcon_h1", "granitemoehybrid", "mamba2", "nemotron_h", "zamba2"})
"""Model types whose vLLM 0.32 models have Mamba2 mixers (``MambaMixer2``). With prefix caching vLLM
keeps their state in "align" mode, which needs the scan's state at each block boundary; the CPU scan
(``ops/cpu/mamba_ssm.py``) returns only the final state, so the first prompt longer than a block fails."""

CPU_SHORT_CONV_MODEL_TYPES = frozenset({"lfm2", "lfm2_moe"})
"""Model types whose vLLM 0.32 models keep short-convolution state (``ShortConv``). On CPU a prompt
served that state from the cache does not continue as the prompt computed whole did, before any
commit (docs/LOG.md): caching would make behaviour log-probs inexact."""


def caching_off_reason(model: str) -> str | None:
    """Why prefix caching must be off for ``model`` (a local directory or a hub id) on this
    platform, from its config alone, or None (caching on; ``problems`` checks the engine at
    start). A config that cannot be read gives None: the start-time check still holds."""
    from transformers import AutoConfig
    from vllm.platforms import current_platform

    try:
        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError):
        return None
    if not current_platform.is_cpu():
        return None
    text = getattr(config, "get_text_config", lambda: config)()
    model_type = getattr(text, "model_type", None)
    layers = getattr(text, "layer_types", None) or ()
    mamba_layers = {"mamba", "linear_attention"} & set(layers)  # Granite-4 names them either way; some have none
    if model_type in CPU_MAMBA2_MODEL_TYPES and (model_type != "granitemoehybrid" or mamba_layers):
        return (f"{model_type}'s Mamba2 layers: vLLM 0.32's CPU scan returns no state at block boundaries, which "
                "its prefix caching (mamba_cache_mode='align') needs; the first prompt longer than a block would "
                "fail")
    if model_type in CPU_SHORT_CONV_MODEL_TYPES:
        return (f"{model_type}'s short convolutions: on vLLM 0.32's CPU build, convolution state served from the "
                "prefix cache does not reproduce the prompt computed whole, so behaviour log-probs would be inexact")
    return None


def problems(scheduler: Any) -> list[str]:
    """Why this engine's prefix cache cannot be kept exact across commits ([] if it can)."""
    manager = scheduler.kv_cache_manager
    if not manager.enable_caching:
        return []
    found = []
    coordinator = manager.coordinator
    groups = coordinator.kv_cache_config.kv_cache_groups
    cached = [m for m, g in zip(coordinator.single_type_managers, groups) if g.kv_cache_spec.prefix_cacheable]
    others = sorted({type(m).__name__ for m in cached} - set(GUARDED_MANAGERS))
    if others:
        found.append(f"KV cache managers {others} (guarded: {', '.join(GUARDED_MANAGERS)})")
    if any(m.block_pool is not coordinator.block_pool for m in coordinator.single_type_managers):
        found.append("a KV cache group keeps its blocks in a second pool")
    if getattr(scheduler, "connector", None) is not None:
        found.append("a KV connector (offload or transfer) holds KV this guard does not invalidate")
    if found:
        return [f"enable_prefix_caching cannot be kept exact across commits here: {'; '.join(found)}; start the "
                "engine with enable_prefix_caching=False"]
    return []


class PrefixCacheGuard:
    """Keeps one engine's prefix cache exact across its commits (see the module docstring).

    Ordering invariants: ``on_commit`` runs only inside a commit window, on the thread that
    steps the engine (or, for an idle in-process engine, under the step lock with no
    request running); ``_cache_blocks`` runs inside ``schedule``, on the same thread."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.pool = scheduler.kv_cache_manager.block_pool
        self.enabled = bool(scheduler.kv_cache_manager.enable_caching)
        self._frozen: dict[str, int] = {}  # request id -> its preemptions when it was frozen
        self._sampled_at_preemption: dict[str, int] = {}
        self._recomputed_ids: deque[str] = deque(maxlen=64)
        self._counted: set[str] = set()  # counted in ``recomputed`` (once per request)
        self.stats = PrefixCacheStats(enabled=self.enabled)
        if self.enabled:
            guard_cache_blocks(scheduler.kv_cache_manager.coordinator, self)

    def on_commit(self) -> None:
        """The three steps of the module docstring, in the commit window."""
        if not self.enabled:
            return
        from vllm.v1.request import RequestStatus

        t0 = time.perf_counter()
        restarted = self._restart_partial_prefills()
        self._frozen = {r.request_id: r.num_preemptions for r in self.scheduler.running}
        self._counted &= set(self.scheduler.requests)
        for request in list(self.scheduler.requests.values()):  # preempted earlier, resumed under the new weights
            if request.status == RequestStatus.PREEMPTED and request.request_id not in self._frozen:
                self._count_recomputed(request)
        dropped = self._drop_index()
        s = self.stats
        self.stats = msgspec.structs.replace(
            s, invalidations=s.invalidations + 1, dropped_blocks=s.dropped_blocks + dropped,
            restarted_prefills=s.restarted_prefills + restarted, frozen_requests=s.frozen_requests + len(self._frozen),
            last_commit_us=1e6 * (time.perf_counter() - t0))

    def _restart_partial_prefills(self) -> int:
        """Preempt (vLLM's own ``_preempt_request``, as its cache reset does) every running
        request whose prompt or recomputation is only partly computed."""
        scheduler, now, restarted = self.scheduler, time.monotonic(), 0
        for request in list(scheduler.running):
            if not _mid_prefill(request):
                continue
            scheduler.running.remove(request)
            scheduler._preempt_request(request, now)
            # as in Scheduler.reset_prefix_cache: the model runner must drop its copy of the request
            scheduler.prev_step_scheduled_req_ids.discard(request.request_id)
            restarted += 1
        return restarted

    def _drop_index(self) -> int:
        """Forget every hash the block pool holds; blocks, tables and ref counts stay."""
        from vllm.v1.core.block_pool import BlockHashToBlockMap
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        pool = self.pool
        blocks: dict[int, Any] = {}
        for entry in pool.cached_block_hash_to_block._cache.values():
            for block in (entry,) if isinstance(entry, KVCacheBlock) else entry.values():
                blocks[block.block_id] = block
        for block in blocks.values():
            block.reset_hash()
        pool.cached_block_hash_to_block = BlockHashToBlockMap()
        pool.cached_block_hashes_by_block.clear()
        if pool.metrics_collector is not None:
            pool.metrics_collector.reset()
        return len(blocks)

    def may_cache(self, request: Any) -> bool:
        """Whether ``request``'s newly full blocks may enter the index now."""
        seen = self._frozen.get(request.request_id)
        if seen is None:
            return True
        if request.num_preemptions > seen:  # preempted since: its KV is being recomputed under the live weights
            del self._frozen[request.request_id]
            self._count_recomputed(request)
            return True
        return False

    def _count_recomputed(self, request: Any) -> None:
        if request.num_output_tokens > 0 and request.request_id not in self._counted:
            self._counted.add(request.request_id)
            self._recomputed_ids.append(request.request_id)
            self.stats = msgspec.structs.replace(self.stats, recomputed=self.stats.recomputed + 1,
                                                 recomputed_ids=tuple(self._recomputed_ids))


def _mid_prefill(request: Any) -> bool:
    """A running request whose prompt (or, after a preemption, its recomputation) is partly
    computed: its next forward would extend KV of the weights being replaced."""
    computed = request.num_computed_tokens
    if computed <= 0:
        return False
    if request.num_output_tokens == 0:
        return computed < request.num_prompt_tokens
    return computed < request.num_tokens - 1


def guard_cache_blocks(coordinator: Any, guard: PrefixCacheGuard) -> None:
    """Send one engine's ``KVCacheCoordinator.cache_blocks`` (vLLM 0.32.0; both of
    ``KVCacheManager``'s callers go through it) past ``guard.may_cache``: a request that
    held KV at a commit inserts no more blocks into the index. Bound on this instance
    only, from ``inflight_start``; idempotent (a second guard replaces the first)."""
    original = getattr(coordinator.cache_blocks, "__inflight_original__", coordinator.cache_blocks)

    def cache_blocks(request: Any, num_computed_tokens: int) -> None:
        if guard.may_cache(request):
            original(request, num_computed_tokens)

    cache_blocks.__inflight_original__ = original  # type: ignore[attr-defined]
    coordinator.cache_blocks = cache_blocks
