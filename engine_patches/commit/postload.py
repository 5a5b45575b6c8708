"""vLLM's processing of freshly loaded weights, re-run as a weight update needs it.

vLLM runs each layer's ``process_weights_after_loading`` once, after the first load (the
CPU oneDNN prepack, the CPU MoE grouped-GEMM pack, quantization). A weight update must
redo what that step derived from the weights, on whichever module holds the new ones.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch


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
    if kernel is not None and cpu_unquantized_moe(method):
        kernel.fused_experts.process_weights_after_loading(module)


def cpu_unquantized_moe(method: Any) -> bool:
    """Whether ``method`` is vLLM's unquantized FusedMoE method on its CPU backend."""
    try:
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # a vLLM without these: nothing of this kind to repair
        return False
    return isinstance(method, UnquantizedFusedMoEMethod) and method.unquantized_backend == UnquantizedMoeBackend.CPU


def reprocess(modules: list[torch.nn.Module]) -> None:
    """``process_after_loading`` on each of ``modules``."""
    for module in modules:
        process_after_loading(module)


def modules_sharing_parameters(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules holding a parameter another module holds too (a tied LM head and its
    embedding): a reload gives the head no tensor of its own, so its derived state must be
    rebuilt from the embedding it shares."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(module)
    return [m for ms in owners.values() if len(ms) > 1 for m in ms]


KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".q_scale", ".kv_scale", ".prob_scale")
"""Checkpoint tensors an FP8 KV cache reads: attention's processing derives its float scales from them."""


def copy_refusals(model: torch.nn.Module, names: Collection[str] = ()) -> list[str]:
    """The layer kinds of ``model`` that a plain copy commit (``load_weights`` into the live
    storage, no post-load processing) would leave wrong on a GPU, by name; ``names``: the
    checkpoint's tensors (what an update carries).

    vLLM's post-load processing derives state from weights: MLA attention keeps ``W_UK_T`` and
    ``W_UV`` computed from ``kv_b_proj``; FlashInfer MoE backends re-lay the experts (CUTLASS
    swaps the w1/w3 halves, TRTLLM re-blocks); quantized methods repack. A copy leaves that
    state at the old version, silently. Proven to need none on CUDA: unquantized linear and
    embedding layers (their processing only prepacks on CPU), layers with no processing of
    their own (norms), and plain ``Attention`` while the checkpoint holds no KV-cache scales
    (its processing derives float scales from them: with scales in an update, a copy would
    leave those at the old version). Anything else is named here, and the copy commit is not
    used."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    copy_safe_methods = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    scales = any(n.endswith(KV_SCALE_SUFFIXES) for n in names)
    found: set[str] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if module._parameters and method is not None and type(method) not in copy_safe_methods:
            found.add(f"{type(module).__name__} ({type(method).__name__})")
        elif type(module) is Attention and scales:
            found.add("Attention (KV-cache scales in the checkpoint)")
        elif type(module) is not Attention and any("process_weights_after_loading" in vars(c)
                                                   for c in type(module).__mro__ if c is not torch.nn.Module):
            found.add(type(module).__name__)
    return sorted(found)
