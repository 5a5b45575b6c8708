"""The ``reload`` and ``copy`` commits: the staged tensors are written into the live storage
at the commit, inside the stall.

- ``reload`` (compiled CPU, quantized models): vLLM's layerwise reload, which re-runs each
  layer's processing (the CPU re-pack, quantization) into the original storage. A plain
  ``load_weights`` after start-up is wrong on CPU: it writes into empty prepacked placeholders.
- ``copy`` (CUDA, unquantized): ``model.load_weights``, one device copy per tensor into the
  live storage that CUDA graphs captured.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

import torch

from engine_patches.commit.postload import cpu_unquantized_moe, modules_sharing_parameters, reprocess



class _ExpectedNoWeights(logging.Filter):
    """Drops the layerwise reload's "<Layer>: Failed to load weights" warning for layers that
    never get checkpoint tensors (rotary embeddings, a tied LM head): it fires on every commit."""

    def __init__(self, layer_names: set[str]) -> None:
        super().__init__()
        self.layer_names = layer_names

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.layer_names)


class InStorageApplier:
    """``reload`` and ``copy``: the staged tensors are written into the live storage at commit.

    ``reload`` is vLLM's layerwise reload (re-runs each layer's processing: the CPU re-pack,
    quantization); ``copy`` is the model's ``load_weights``, one device copy per tensor.
    """

    def __init__(self, model_runner: Any, strategy: Literal["reload", "copy"]) -> None:
        self.runner = model_runner
        self.strategy = strategy
        model = model_runner.get_model()
        self._tied = modules_sharing_parameters(model)
        # CPU MoE experts whose re-pack vLLM's reload skips (``process_after_loading``)
        self._experts = [m for m in model.modules() if cpu_unquantized_moe(getattr(m, "quant_method", None))]
        quiet = {type(m).__name__ for m in self._tied} | {
            type(m).__name__ for m in model.modules() if not m._parameters and "Rotary" in type(m).__name__
        }
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedNoWeights(quiet))
        self._weights: Mapping[str, torch.Tensor] | None = None

    def feed(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Nothing to do per bucket: the commit writes every tensor at once."""

    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        self._weights = weights

    def shard_plan(self) -> None:
        """vLLM's loaders take whole checkpoint tensors here: no shard plan."""
        return None

    def held_bytes(self) -> int:
        """``reload``: vLLM's layerwise reload materializes each layer's parameters anew and
        re-runs its processing; measured on a CPU engine (``bench.staging_memory``), the
        commit's peak grows the engine's memory by the model's parameter bytes. ``copy``
        writes straight into the live storage: nothing."""
        if self.strategy == "copy":
            return 0
        unique = {p.untyped_storage().data_ptr(): p.numel() * p.element_size() for p in self.runner.get_model().parameters()}
        return sum(unique.values())

    def close(self) -> None:
        """No thread of its own."""

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
            reprocess(self._tied)
            self._repack_experts()
        else:
            self.runner.get_model().load_weights(iter(weights.items()))

    def release_rollback(self) -> None:
        """Nothing is held beyond the staged bytes, which the listener owns."""

    @torch.no_grad()
    def restore(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        """Put the last good weights back: the live version's bytes, kept in memory
        (``keep_rollback``; the weights the engine loaded are read into them at start)."""
        if previous is None:
            raise RuntimeError("no rollback copy (keep_rollback=False)")
        self._write(previous)

    def _repack_experts(self) -> None:
        """The reload ran the MoE method's update path, which left the new expert weights
        unpacked in the live storage: pack them (see ``process_after_loading``)."""
        for module in self._experts:
            module.quant_method.moe_kernel.fused_experts.process_weights_after_loading(module)

    undo = restore  # taking back a successful apply writes the same previous weights back
