"""The ``reload`` commit: the staged tensors are written into the live storage at the
commit, inside the stall, by vLLM's layerwise reload.

``reload`` (compiled CPU, quantized models) re-runs each layer's processing (the CPU
re-pack, quantization) into the original storage. It takes whole checkpoint tensors (the
reload materializes each layer in checkpoint format and runs its loaders on them), so it
has no shard plan: every rank stages every tensor whole. A plain ``load_weights`` after
start-up is wrong on a prepacking CPU engine: it writes into empty prepacked placeholders.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from inflight.engine.commit.loaders import Shapes, cpu_unquantized_moe, modules_sharing_parameters, reprocess
from inflight.protocol import ShardPlan


class _ExpectedNoWeights(logging.Filter):
    """Drops the layerwise reload's "<Layer>: Failed to load weights" warning for layers that
    never get checkpoint tensors (rotary embeddings, a tied LM head): it fires on every commit."""

    def __init__(self, layer_names: set[str]) -> None:
        super().__init__()
        self.layer_names = layer_names

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.layer_names)


def reload_peak_bytes(model: torch.nn.Module) -> int:
    """What vLLM's layerwise reload holds beyond the live model on a GPU (vLLM 0.32,
    ``model_executor/model_loader/reload/layerwise.py``): each module with weights of its own
    is materialized anew while its weights load, processed, and copied back into the original
    storage; a checkpoint whose order interleaves two modules holds two at once (vLLM warns
    then). So the two largest modules' own parameters and buffers, not the model again."""
    sizes = sorted((sum(t.numel() * t.element_size() for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))
                    for m in model.modules()), reverse=True)
    return sum(sizes[:2])


class ReloadStrategy:
    """``reload``: the staged tensors are written into the live storage at commit by vLLM's
    layerwise reload (re-runs each layer's processing: the CPU re-pack, quantization)."""

    name = "reload"

    def __init__(self, model_runner: Any) -> None:
        self.runner = model_runner
        model = model_runner.get_model()
        # CPU MoE experts whose re-pack vLLM's reload skips (``process_after_loading``), packed once each
        self._experts = [m for m in model.modules() if cpu_unquantized_moe(getattr(m, "quant_method", None))]
        # modules sharing a parameter, other than those experts: a GLM-4.5 router shares its bias with
        # the routed experts, and reprocessing those as tied too packed their bytes twice
        self._tied = [m for m in modules_sharing_parameters(model) if not any(m is e for e in self._experts)]
        quiet = {type(m).__name__ for m in self._tied} | {
            type(m).__name__ for m in model.modules() if not m._parameters and "Rotary" in type(m).__name__
        }
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_ExpectedNoWeights(quiet))
        self._weights: Mapping[str, torch.Tensor] | None = None

    @classmethod
    def build(cls, model_runner: Any, shapes: Shapes, *, window: int = 2) -> ReloadStrategy:
        """The strategy registry's constructor (``commit.base.make_strategy``): the reload
        reads whole tensors through vLLM, so it needs neither the shapes nor a window."""
        return cls(model_runner)

    def feed(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Nothing to do per bucket: the commit writes every tensor at once."""

    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Keep the staged views."""
        self._weights = weights

    def shard_plan(self) -> ShardPlan | None:
        """None: vLLM's loaders take whole checkpoint tensors."""
        return None

    def held_bytes(self) -> int:
        """On CPU: measured on a CPU engine (``inflight.bench.staging_memory``), the commit's
        peak grows the engine's memory by the model's parameter bytes (the re-pack makes new
        packed weights). On a GPU: ``reload_peak_bytes``."""
        model = self.runner.get_model()
        if torch.device(self.runner.device).type != "cpu":
            return reload_peak_bytes(model)
        unique = {p.untyped_storage().data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
        return sum(unique.values())

    def close(self) -> None:
        """No thread of its own."""

    def discard(self) -> None:
        self._weights = None

    @torch.no_grad()
    def apply(self) -> None:
        if self._weights is None:
            raise RuntimeError("commit without a prepared version")
        weights = self._weights
        self._weights = None
        self._write(weights)

    def _write(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Whole checkpoint tensors through vLLM's layerwise reload."""
        self.runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        # a tied LM head gets no tensors of its own, so its derived state (the CPU
        # prepacked copy) must be rebuilt from the embedding it shares
        reprocess(self._tied)
        self._repack_experts()

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
