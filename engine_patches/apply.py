"""Turning staged checkpoint-format tensors into live weights, and knowing what to expect.

Staged tensors carry Hugging Face checkpoint names (``...q_proj.weight``); vLLM stacks some
of them (``qkv_proj``, ``gate_up_proj``) and, on CPU, prepacks linear weights for oneDNN
(``layer.weight`` becomes an empty tensor). So the commit always goes through the model's
own ``load_weights``, which knows the name mapping and the shard offsets:

- ``reload`` (CPU, quantized models): ``model_runner.reload_weights(is_checkpoint_format=True)``,
  vLLM's layerwise reload, which re-runs each layer's ``process_weights_after_loading``
  (the re-pack) and copies the result into the original storage. A plain ``load_weights``
  after start-up is wrong on CPU: it writes into the empty prepacked placeholders.
- ``copy`` (CUDA, unquantized): ``model.load_weights``: one device copy per tensor into the
  live parameters, no processing.

Modules that share a parameter with another (a tied LM head) receive no weights of their
own during a reload, so their derived state (the CPU prepacked LM head) is rebuilt here.
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


def resolve_strategy(strategy: Strategy, device: torch.device, quantized: bool) -> Literal["reload", "copy"]:
    if strategy == "auto":
        return "reload" if device.type == "cpu" or quantized else "copy"
    if strategy == "copy" and device.type == "cpu":
        raise ValueError("inflight: commit='copy' is wrong on CPU (linear weights are prepacked); use 'reload'")
    if strategy not in ("reload", "copy"):
        raise ValueError(f"inflight: commit strategy {strategy!r} is not auto, reload or copy")
    return strategy


class _ExpectedNoWeights(logging.Filter):
    """Drops the layerwise reload's "<Layer>: Failed to load weights" warning for layers that
    never get checkpoint tensors (rotary embeddings, a tied LM head): it fires on every commit."""

    def __init__(self, layer_names: set[str]) -> None:
        super().__init__()
        self.layer_names = layer_names

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.layer_names)


class WeightApplier:
    """Applies a full checkpoint-format state to one worker's model."""

    def __init__(self, model_runner: Any, strategy: Strategy, *, quantized: bool) -> None:
        self.runner = model_runner
        self.strategy = resolve_strategy(strategy, torch.device(model_runner.device), quantized)
        model = model_runner.get_model()
        self._tied = self._modules_sharing_parameters(model)
        quiet = {type(m).__name__ for m in self._tied} | {
            type(m).__name__ for m in model.modules() if not m._parameters and "Rotary" in type(m).__name__
        }
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedNoWeights(quiet))

    @staticmethod
    def _modules_sharing_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
        owners: dict[int, list[torch.nn.Module]] = {}
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), []).append(module)
        return [m for ms in owners.values() if len(ms) > 1 for m in ms]

    @torch.no_grad()
    def apply(self, weights: Mapping[str, torch.Tensor]) -> None:
        if self.strategy == "reload":
            self.runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
            for module in self._tied:
                method = getattr(module, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)
        else:
            self.runner.get_model().load_weights(iter(weights.items()))

    def restore(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        """Put the last good weights back: the previous staged version, or the checkpoint on disk."""
        if previous is not None:
            self.apply(previous)
            return
        log.warning("inflight: restoring the checkpoint from disk")
        self.runner.reload_weights(is_checkpoint_format=True)
        for module in self._tied:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
