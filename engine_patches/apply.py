"""Turning staged checkpoint-format tensors into live weights, and knowing what to expect.

Staged tensors carry Hugging Face checkpoint names (``...q_proj.weight``); vLLM stacks some
of them (``qkv_proj``, ``gate_up_proj``) and, on CPU, prepacks linear weights for oneDNN
(``layer.weight`` becomes an empty tensor). So every strategy goes through the model's own
weight loaders, which know the name mapping and the shard offsets. An applier has three
phases: ``prepare`` (listener thread, while the engine decodes), ``apply`` (under the step
gate's lock: the stall) and ``restore`` (after a failed apply).

- ``swap`` (eager CPU, the default there): load + re-pack into shadow modules in
  ``prepare``; ``apply`` swaps module attributes. See ``engine_patches.swap``.
- ``reload`` (compiled CPU, quantized models): vLLM's layerwise reload in ``apply``, which
  re-runs each layer's processing (the re-pack) into the original storage. A plain
  ``load_weights`` after start-up is wrong on CPU: it writes into empty prepacked placeholders.
- ``copy`` (CUDA, unquantized): ``model.load_weights`` in ``apply``: one device copy per
  tensor into the live storage that CUDA graphs captured.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from inflight.transport.layout import dtype_name
from inflight.transport.listener import TensorSchema

log = logging.getLogger("inflight.apply")

Strategy = Literal["auto", "reload", "copy"]

_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                       "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def checkpoint_dir(model: str, revision: str | None = None) -> Path:
    """The local directory holding ``model``'s checkpoint (a path, or a cached hub snapshot)."""
    if os.path.isdir(model):
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, revision=revision, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))


def checkpoint_schema(model_dir: Path, engine_dtype: torch.dtype) -> TensorSchema:
    """Every tensor of the safetensors checkpoint, float ones in the engine's dtype."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"inflight: no *.safetensors in {model_dir}; the update schema comes from the checkpoint")
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                raw = sl.get_dtype()
                if raw not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"inflight: checkpoint tensor {name} has dtype {raw}, which updates cannot carry")
                wire = _SAFETENSORS_DTYPES[raw]
                if wire in ("float32", "float16", "bfloat16", "float64"):
                    wire = dtype_name(engine_dtype)
                tensors[name] = (tuple(sl.get_shape()), wire)
    return TensorSchema(tensors)


def resolve_strategy(strategy: Strategy, device: torch.device, quantized: bool, eager: bool) -> Literal["swap", "reload", "copy"]:
    if strategy == "auto":
        if device.type == "cpu":
            return "swap" if eager and not quantized else "reload"
        return "reload" if quantized else "copy"
    if strategy == "copy" and device.type == "cpu":
        raise ValueError("inflight: commit='copy' is wrong on CPU (linear weights are prepacked); use 'swap' or 'reload'")
    if strategy == "swap" and (device.type != "cpu" or not eager or quantized):
        raise ValueError("inflight: commit='swap' needs an eager (enforce_eager=True), unquantized CPU engine")
    if strategy not in ("swap", "reload", "copy"):
        raise ValueError(f"inflight: commit strategy {strategy!r} is not auto, swap, reload or copy")
    return strategy


class _ExpectedNoWeights(logging.Filter):
    """Drops the layerwise reload's "<Layer>: Failed to load weights" warning for layers that
    never get checkpoint tensors (rotary embeddings, a tied LM head): it fires on every commit."""

    def __init__(self, layer_names: set[str]) -> None:
        super().__init__()
        self.layer_names = layer_names

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.layer_names)


def process_after_loading(module: torch.nn.Module) -> None:
    """Re-run ``module``'s processing of freshly loaded weights, as a weight update needs it.

    vLLM's unquantized FusedMoE method knows a first load from an update: on an update
    (its expert kernel already built) it copies the loaded weights into the live storage,
    which CUDA graphs captured, and skips the experts' own processing. On CPU that step is
    the grouped-GEMM prepack (``CPUUnquantizedExperts.process_weights_after_loading``), so
    an update (vLLM's layerwise reload included) would leave unpacked bytes in a packed
    layout: measured here, log-probs off by 1.06 on a tiny Qwen3-MoE. Run it here, after the
    method, on whatever module holds the new weights (the live layer, or a swap's twin)."""
    method = getattr(module, "quant_method", None)
    if method is None or not hasattr(method, "process_weights_after_loading"):
        return
    method.process_weights_after_loading(module)
    kernel = getattr(method, "moe_kernel", None)
    if kernel is not None and _cpu_unquantized_moe(method):
        kernel.fused_experts.process_weights_after_loading(module)


def _cpu_unquantized_moe(method: Any) -> bool:
    try:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without these: nothing of this kind to repair
        return False
    return isinstance(method, UnquantizedFusedMoEMethod) and method.unquantized_backend == UnquantizedMoeBackend.CPU


def _reprocess(modules: list[torch.nn.Module]) -> None:
    for module in modules:
        process_after_loading(module)


class InStorageApplier:
    """``reload`` and ``copy``: the staged tensors are written into the live storage at commit.

    ``reload`` is vLLM's layerwise reload (re-runs each layer's processing: the CPU re-pack,
    quantization); ``copy`` is the model's ``load_weights``, one device copy per tensor.
    """

    def __init__(self, model_runner: Any, strategy: Literal["reload", "copy"]) -> None:
        self.runner = model_runner
        self.strategy = strategy
        model = model_runner.get_model()
        self._tied = self._modules_sharing_parameters(model)
        # CPU MoE experts whose re-pack vLLM's reload skips (``process_after_loading``)
        self._experts = [m for m in model.modules() if _cpu_unquantized_moe(getattr(m, "quant_method", None))]
        quiet = {type(m).__name__ for m in self._tied} | {
            type(m).__name__ for m in model.modules() if not m._parameters and "Rotary" in type(m).__name__
        }
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedNoWeights(quiet))
        self._weights: Mapping[str, torch.Tensor] | None = None

    @staticmethod
    def _modules_sharing_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
        owners: dict[int, list[torch.nn.Module]] = {}
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), []).append(module)
        return [m for ms in owners.values() if len(ms) > 1 for m in ms]

    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights

    def discard(self) -> None:
        self._weights = None

    @torch.no_grad()
    def apply(self) -> None:
        if self._weights is None:
            raise RuntimeError("commit without a prepared version")
        self._write(self._weights)
        self._weights = None

    def _write(self, weights: Mapping[str, torch.Tensor]) -> None:
        if self.strategy == "reload":
            self.runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
            # a tied LM head gets no tensors of its own, so its derived state (the CPU
            # prepacked copy) must be rebuilt from the embedding it shares
            _reprocess(self._tied)
            self._repack_experts()
        else:
            self.runner.get_model().load_weights(iter(weights.items()))

    def release_rollback(self) -> None:
        """Nothing is held beyond the staged bytes, which the listener owns."""

    @torch.no_grad()
    def restore(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        """Put the last good weights back: the previous staged version, or the checkpoint on
        disk (the caller checks that the engine still serves the version on disk)."""
        if previous is not None:
            self._write(previous)
            return
        log.warning("inflight: restoring the checkpoint from disk")
        self.runner.reload_weights(is_checkpoint_format=True)
        _reprocess(self._tied)
        self._repack_experts()

    def _repack_experts(self) -> None:
        """The reload ran the MoE method's update path, which left the new expert weights
        unpacked in the live storage: pack them (see ``process_after_loading``)."""
        for module in self._experts:
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)

    undo = restore  # taking back a successful apply writes the same previous weights back


def make_applier(model_runner: Any, strategy: Strategy, schema: TensorSchema, *, quantized: bool, eager: bool):
    """The applier for this engine; ``auto`` falls back from swap to reload when routing is not plain."""
    from engine_patches.swap import RoutingError, SwapApplier

    chosen = resolve_strategy(strategy, torch.device(model_runner.device), quantized, eager)
    model_class = type(model_runner.get_model()).__name__
    if chosen == "swap":
        from inflight.transport.layout import torch_dtype

        shapes = {n: (shape, torch_dtype(dt)) for n, (shape, dt) in schema.tensors.items()}
        try:
            return SwapApplier(model_runner.get_model(), shapes)
        except RoutingError as e:
            if strategy == "swap":
                raise RoutingError(f"inflight: commit='swap' is not possible for {model_class}: {e}") from e
            log.warning("inflight: swap commits unavailable for %s (%s); using reload", model_class, e)
            chosen = "reload"
        except Exception as e:  # a model's loader we did not foresee: refuse, naming it, rather than a bare error
            raise RuntimeError(f"inflight: building the swap commit for {model_class} failed: {e!r}; "
                               f"start with InflightConfig(commit='reload')") from e
    try:
        return InStorageApplier(model_runner, chosen)
    except Exception as e:
        raise RuntimeError(f"inflight: building the {chosen} commit for {model_class} failed: {e!r}") from e
