"""The trainer's side of an adapter-only (LoRA) run: the PEFT wrap of the policy, its first
version on disk, and the tensors a push sends.

Only the adapter trains; the base weights the engines loaded never move. A push sends
exactly what PEFT saves (``get_peft_model_state_dict``: ``...q_proj.lora_A.weight``
``[r, in]``, ``...lora_B.weight`` ``[out, r]``, unscaled), so an engine folds alpha/r into
B with vLLM's own loader code, bit for bit as if it read the file
(``inflight.engine.commit.lora_slot``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class LoRAOptions:
    """``[model.lora]``: train a LoRA adapter instead of the whole model (``rank`` > 0)."""

    rank: int = 0
    """The adapter's rank ``r``; 0: train the whole model."""
    alpha: float = 16.0
    """PEFT's ``lora_alpha``: the adapter's output is scaled by alpha / rank."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """The linear layers that get an adapter, by module name (attention and MLP projections)."""
    dropout: float = 0.0
    """PEFT's ``lora_dropout`` on the adapter's input while training (the engine applies none)."""

    def __post_init__(self) -> None:
        if type(self.rank) is not int or self.rank < 0:
            raise ValueError(f"model.lora.rank={self.rank!r} must be an int >= 0 (0: no adapter)")
        if not self.alpha > 0:
            raise ValueError(f"model.lora.alpha={self.alpha} must be > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.lora.dropout={self.dropout} must be in [0, 1)")
        if self.rank and not self.target_modules:
            raise ValueError("model.lora.target_modules=[] must name at least one module")
        from inflight.adapter import UNSUPPORTED_TARGETS, VLLM_LORA_RANKS

        bad = [t for t in self.target_modules if any(u in t for u in UNSUPPORTED_TARGETS)]
        if bad:
            raise ValueError(f"model.lora.target_modules={list(self.target_modules)}: {bad} cannot be updated in "
                             "flight (embedding, LM head and expert adapters)")
        if self.rank > VLLM_LORA_RANKS[-1]:
            raise ValueError(f"model.lora.rank={self.rank} > {VLLM_LORA_RANKS[-1]}, the largest vLLM serves")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def peft_config(self) -> Any:
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(self.target_modules),
                          lora_dropout=self.dropout, bias="none", task_type="CAUSAL_LM")


def write_first_adapter(base_dir: Path, options: LoRAOptions, out: Path, *, seed: int) -> Path:
    """Version 0 of the adapter, written as a PEFT directory before any engine starts: PEFT's
    own initialisation (A random, B zero: the policy starts as the base model)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    get_peft_model(base, options.peft_config()).save_pretrained(str(out))
    return out


def load_trainable(base_dir: Path, adapter_dir: Path) -> Any:
    """The policy: the base model with the adapter of ``adapter_dir``, only the adapter trainable."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)  # fp32 master weights
    return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)


def empty_trainable(base_dir: Path, adapter_dir: Path) -> Any:
    """``load_trainable``'s model on the meta device, nothing read but the two configs: a
    following trainer rank's, whose shards come from rank 0 (``TrainerRanks.fill_from_rank_0``)."""
    from peft import PeftConfig, get_peft_model

    from inflight.trainer.models import empty_model

    config = PeftConfig.from_pretrained(str(adapter_dir))
    config.inference_mode = False
    return get_peft_model(empty_model(base_dir), config)


def adapter_weights(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the names PEFT saves them, as the live parameters (never a
    copy: peft 0.22 returns full copies of FSDP2-sharded parameters, which a caller holding
    them would read stale after the next step). PEFT's name of a parameter drops ``.<adapter>``."""
    from peft import get_peft_model_state_dict

    saved = list(get_peft_model_state_dict(model))
    tag = f".{model.active_adapter}"
    live = {name.replace(tag, ""): p.detach() for name, p in model.named_parameters() if tag in name}
    missing = [n for n in saved if n not in live]
    if missing:
        raise ValueError(f"adapter tensors PEFT saves that are no live parameter: {missing[:4]}")
    return {n: live[n] for n in saved}


def load_adapter_weights(model: Any, weights: dict[str, torch.Tensor]) -> None:
    """Set ``model``'s adapter to ``weights`` (names as ``adapter_weights`` gives them)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, weights)
    if result.unexpected_keys:
        raise ValueError(f"adapter tensors the model does not have: {result.unexpected_keys[:4]}")
