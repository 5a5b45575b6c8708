"""How a staged version becomes live: the commit strategy interface, and the choice of one.

Staged tensors carry Hugging Face checkpoint names; vLLM stacks some of them (``qkv_proj``, ``gate_up_proj``)
and, on CPU, prepacks linear weights for oneDNN (``layer.weight`` becomes an empty tensor). So every strategy
goes through the model's own weight loaders, which know the name mapping and the shard offsets.

Phases, by thread (ordering invariant: live weights change only in ``apply``, ``restore`` and ``undo``, on
the engine's execution thread, between two steps):
- listener thread, while the engine decodes: ``feed`` (each bucket's verified tensors), ``prepare`` (after
  the last bucket), ``discard`` (the update was refused or superseded);
- execution thread, inside the stall: ``apply``; after a failed ``apply``, ``restore``; after a successful
  ``apply`` that another rank of the engine failed, ``undo``.

Strategies, one module each, found by name in a lazy registry (``STRATEGIES``, ``LAYER_STRATEGIES``:
imported only when chosen): ``swap`` (eager CPU: load and re-pack into shadow modules before the commit, swap
attributes at it; ``inflight.engine.commit.swap``), ``reload`` and ``copy`` (write into the live storage at
the commit; ``inflight.engine.commit.reload``, ``inflight.engine.commit.copy``). ``swap`` and ``copy`` replay
a load plan recorded at start and so expose a shard plan (each tensor-parallel rank stages only what its
loaders read); ``reload`` takes whole tensors. ``copy`` on CPU needs linears that keep their weights
(``INFLIGHT_CPU_PLAIN_GEMM=1``: ``inflight.engine.patch``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from inflight.engine.commit.loaders import LoaderMapError, Shapes, copy_refusals
from inflight.protocol import CommitInfo, CommitUnit, ShardPlan
from inflight.settings import PLAIN_CPU_GEMM_ENV, CommitChoice
from inflight.settings import CommitStrategyName as Resolved
from inflight.staging import StagedVersion, StagingPool
from inflight.transport.bucket import torch_dtype
from inflight.transport.schema import TensorSchema

log = logging.getLogger("inflight.commit")

class CommitFailed(RuntimeError):
    """The commit did not take; the target already restored the previous weights."""


class CommitTarget(Protocol):
    """What the listener commits into: an engine worker, or a plain dict in tests."""

    @property
    def live_version(self) -> int: ...

    def steps(self) -> int:
        """Engine steps run so far (monotone), to measure decoding during a transfer."""
        ...

    def prepare(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Do everything the commit can do ahead of time (off the critical path); live weights
        stay untouched. Raising refuses the update."""
        ...

    def prepare_part(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """Called during the receive with each bucket's newly complete tensors (verified and
        finite, each once), so the target can do their share of ``prepare`` while later
        buckets are on the wire; ``prepare`` follows with every tensor. Raising refuses the
        update, like ``prepare``."""
        ...

    def discard(self) -> None:
        """Drop what ``prepare`` built (the update was aborted or superseded)."""
        ...

    def commit(self, version: int, staged: StagedVersion, pool: StagingPool) -> CommitInfo:
        """Make ``staged.views`` live at a step boundary; on failure restore the previous
        weights and raise ``CommitFailed``. ``staged`` is the target's from the call on: it
        gives its buffer back to ``pool`` once nothing needs it."""
        ...

    def leave(self) -> None:
        """Called on the trainer's ``Shutdown`` before the worker answers it: release whatever
        else of the worker's holds the trainer's store (the engine's coordinator)."""
        ...

    def begin_commit(self, version: int, staged: StagedVersion, pool: StagingPool, part: int = 0,
                     parts: int = 0) -> Any:
        """Layer-granular updates: hand group ``part`` over for the engine to commit at its next
        step boundary without waiting (``UpdateListener._on_layer_announce``); returns a handle."""
        ...

    def finish_commit(self, pending: Any) -> CommitInfo:
        """The outcome of a ``begin_commit``; ``CommitFailed`` if it did not go live."""
        ...

    def refuse_commit(self, version: int, part: int, parts: int, reason: str) -> None:
        """Layer-granular: this rank refused group ``part`` that the other ranks may hand over."""
        ...


class CommitStrategy(Protocol):
    """One engine worker's way of making a prepared version live."""

    name: Resolved

    def feed(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Listener thread: these verified tensors of the version being staged arrived."""

    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Listener thread: every tensor arrived; do all the commit can do ahead of time."""

    def discard(self) -> None:
        """Listener thread: drop what ``feed``/``prepare`` built; nothing live changed."""

    def apply(self) -> None:
        """Execution thread, inside the stall: make the prepared version live."""

    def restore(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        """Execution thread: after a failed ``apply``, put the last good weights back."""

    def undo(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        """Execution thread: take back a successful ``apply`` (another rank failed)."""

    def release_rollback(self) -> None:
        """The engine committed and keeps no rollback copy: drop what ``undo`` would need."""

    def shard_plan(self) -> ShardPlan | None:
        """What this worker's loaders read of each checkpoint tensor (``inflight.shard_plan``),
        or None where the strategy hands whole tensors to vLLM's loaders."""

    def held_bytes(self) -> int:
        """Memory the strategy holds or allocates beside the live weights and the staged bytes,
        at its peak (``inflight.memory`` counts it with the rest of staging)."""

    def close(self) -> None:
        """Stop any thread of the strategy's own."""


def cpu_gemm_prepacking(dtypes: Iterable[torch.dtype]) -> str | None:
    """The kernel vLLM 0.32's CPU GEMM dispatch (``vllm.model_executor.layers.utils.
    dispatch_cpu_unquantized_gemm``) packs linear weights of these dtypes for, moving them out
    of their parameters, or None where every linear keeps its weight (the plain
    ``torch.nn.functional.linear`` fallback: ``inflight.engine.patch.use_plain_cpu_gemm``).
    Mirrors the dispatch's order; the sgl kernel is counted for any bf16/fp16 weight on AMX
    (the dispatch takes it for small, aligned ones), so the answer errs towards refusing."""
    import vllm._custom_ops as ops
    from vllm.platforms import CpuArchEnum, current_platform

    dtypes = set(dtypes)
    if current_platform.is_zen_cpu() and hasattr(torch.ops.zentorch, "zentorch_linear_unary"):
        return "zentorch"
    amx = torch.cpu._is_amx_tile_supported()
    if amx and (torch.bfloat16 in dtypes or (torch.float16 in dtypes and torch.cpu._is_amx_fp16_supported())):
        return "the sgl AMX kernel"
    if getattr(ops, "_supports_onednn", False) and current_platform.get_cpu_architecture() != CpuArchEnum.POWERPC:
        return "oneDNN"
    return None


def resolve_strategy(strategy: CommitChoice, device: torch.device, quantized: bool, eager: bool,
                     copy_refused: Sequence[str] = (), cpu_prepack: str | None = "oneDNN") -> Resolved:
    """The strategy ``strategy`` names for this engine (``auto``: the best that is right).
    ``copy_refused``: the layer kinds a plain copy would leave stale (``loaders.copy_refusals``);
    ``cpu_prepack``: on CPU, the kernel the GEMM dispatch prepacks linear weights for
    (``cpu_gemm_prepacking``; None: they stay in their parameters, and ``copy`` is right)."""
    if strategy == "auto":
        if device.type == "cpu":
            return "swap" if eager and not quantized else "reload"
        if copy_refused and not quantized:
            log.info("inflight: copy commits would skip the post-load processing of %s; using reload", copy_refused)
        return "reload" if quantized or copy_refused else "copy"
    if strategy == "copy" and copy_refused:
        raise ValueError(f"inflight: commit='copy' would leave the post-load state of {copy_refused} at the old "
                         "version (the copy skips vLLM's processing of loaded weights); use 'reload'")
    if strategy == "copy" and device.type == "cpu" and cpu_prepack is not None:
        raise ValueError(f"inflight: commit='copy' is wrong on this CPU engine: vLLM prepacks its linear weights for "
                         f"{cpu_prepack}, so a copy would write into emptied parameters; use 'swap' or 'reload', or "
                         f"start the engine with {PLAIN_CPU_GEMM_ENV}=1 (linears keep their weights; slower GEMMs)")
    if strategy == "swap" and (device.type != "cpu" or not eager or quantized):
        raise ValueError("inflight: commit='swap' needs an eager (enforce_eager=True), unquantized CPU engine")
    return strategy


STRATEGIES: dict[str, str] = {
    "swap": "inflight.engine.commit.swap:SwapStrategy",
    "reload": "inflight.engine.commit.reload:ReloadStrategy",
    "copy": "inflight.engine.commit.copy:CopyStrategy",
}
"""The whole-model commit strategies by name, as ``"module:Class"``: a class is imported
only when an engine chooses it (as vLLM's ``weight_transfer`` factory registers its
engines), and offers ``build(model_runner, shapes, *, window)``. ``lora`` is built by
``inflight.engine.adapter_engine``, with the adapter's own start-up steps."""
LAYER_STRATEGIES: dict[str, str] = {
    "swap": "inflight.engine.commit.swap:LayerSwapStrategy",
    "copy": "inflight.engine.commit.copy:LayerCopyStrategy",
}
"""The strategies that commit one layer group at a time (``commit_unit="layer"``), likewise."""
FALLBACKS: dict[str, str] = {"swap": "reload"}
"""Where ``auto`` goes when the strategy it chose cannot take this model's loaders
(``LoaderMapError``: they do more than route tensors); a named strategy is refused instead."""


def strategy_class(name: str, unit: CommitUnit = "model") -> type:
    """The class registered as ``name`` for ``unit`` (``STRATEGIES``, ``LAYER_STRATEGIES``), imported now."""
    registry = LAYER_STRATEGIES if unit == "layer" else STRATEGIES
    if name not in registry:
        raise ValueError(f"inflight: no commit strategy {name!r} for commit_unit={unit!r} (known: {sorted(registry)})")
    module, _, cls = registry[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def _copy_checks(model: torch.nn.Module, strategy: CommitChoice, device: torch.device,
                 schema: TensorSchema) -> tuple[list[str], str | None]:
    """What ``resolve_strategy`` needs to judge a copy: the layer kinds it would leave stale,
    and on CPU the kernel the GEMM dispatch prepacks for."""
    # a copy is checked for stale post-load state wherever it may be chosen: on GPU by ``auto``,
    # on CPU only when named (``auto`` never picks it there)
    check_copy = strategy == "copy" or (strategy == "auto" and device.type != "cpu")
    refused = copy_refusals(model, schema.tensors) if check_copy else []
    prepack = None
    if device.type == "cpu" and strategy == "copy":
        prepack = cpu_gemm_prepacking(p.dtype for p in model.parameters() if p.is_floating_point())
    return refused, prepack


def make_strategy(model_runner: Any, strategy: CommitChoice, schema: TensorSchema, *, quantized: bool,
                  eager: bool, commit_unit: CommitUnit = "model", window: int = 2) -> CommitStrategy:
    """The commit strategy for this engine; ``auto`` falls back from swap to reload when the
    model's loaders do more than route tensors (``FALLBACKS``). ``commit_unit="layer"``: the
    swap or copy commit one layer group at a time (``window`` groups prepared at most), or an
    error saying why not. Reads only ``model_runner.device`` and ``model_runner.get_model()``
    before the chosen class's ``build``."""
    device = torch.device(model_runner.device)
    model = model_runner.get_model()
    chosen = resolve_strategy(strategy, device, quantized, eager, *_copy_checks(model, strategy, device, schema))
    model_class = type(model).__name__
    shapes = {n: (shape, torch_dtype(dt)) for n, (shape, dt) in schema.tensors.items()}
    if commit_unit == "layer":
        if chosen not in LAYER_STRATEGIES:
            raise ValueError("inflight: commit_unit='layer' needs the swap commit (an eager, unquantized CPU engine) "
                             f"or the copy commit (CUDA, unquantized); this engine commits with {chosen!r}")
        try:
            return strategy_class(chosen, "layer").build(model_runner, shapes, window=window)
        except LoaderMapError as e:
            raise LoaderMapError(f"inflight: commit_unit='layer' is not possible for {model_class}: {e}") from e
    return _build(model_runner, strategy, chosen, shapes, model_class)


def _build(model_runner: Any, strategy: CommitChoice, chosen: Resolved, shapes: Shapes,
           model_class: str) -> CommitStrategy:
    """Build ``chosen`` (``strategy``: what was asked for), or under ``auto`` its fallback
    (``FALLBACKS``) when the model's loaders do more than route tensors."""
    fallback = FALLBACKS.get(chosen)
    try:
        return strategy_class(chosen).build(model_runner, shapes)
    except LoaderMapError as e:
        if fallback is None:
            raise RuntimeError(f"inflight: building the {chosen} commit for {model_class} failed: {e!r}") from e
        if strategy != "auto":
            raise LoaderMapError(f"inflight: commit={chosen!r} is not possible for {model_class}: {e}") from e
        log.warning("inflight: %s commits unavailable for %s (%s); using %s", chosen, model_class, e, fallback)
    except Exception as e:  # a model's loader we did not foresee: refuse, naming it, rather than a bare error
        hint = "" if fallback is None else f"; start with InflightConfig(commit={fallback!r})"
        raise RuntimeError(f"inflight: building the {chosen} commit for {model_class} failed: {e!r}{hint}") from e
    return _build(model_runner, fallback, fallback, shapes, model_class)
