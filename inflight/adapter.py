"""The policy adapter (LoRA) a run trains and its engines serve: what both sides agree on.

An adapter run keeps the base weights fixed on every engine and moves only the adapter.
The trainer writes the first version as a PEFT directory (``adapter_config.json`` and
``adapter_model.safetensors``) before the engines start; each engine starts with LoRA
enabled, one adapter slot, and that directory pinned in it (``inflight.engine.adapter_engine``).
Every later version is the same tensors, pushed in flight like a full model's.

``adapter_config.json`` fixes, for the whole run, what the engine's slot is built for:
the rank, the scaling, the target modules. An update carries only A and B matrices of
those shapes (the engine's schema is the directory's tensor list), so an adapter of
another rank, other modules or another dtype is refused at its announce.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``)."""
UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head", "embed", "wte", "experts")
"""Module names whose LoRA wrappers hold other layouts (embeddings, the LM head, fused
experts): an adapter on them is refused at start, naming them."""


@dataclass(frozen=True, kw_only=True)
class AdapterSpec:
    """The policy adapter an engine serves: one LoRA slot, pinned at start, that every
    rollout request names."""

    path: str
    """The PEFT directory of the version the engine starts with, readable on the engine's host."""
    name: str = "policy"
    """The adapter's name in requests (``LoRARequest.lora_name``; ``model`` on ``vllm serve``)."""
    int_id: int = 1
    """The adapter's id in requests (``LoRARequest.lora_int_id``); vLLM ids start at 1."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("AdapterSpec.path='' must name the PEFT directory of the first adapter version")
        if not self.name:
            raise ValueError("AdapterSpec.name='' must name the adapter")
        if type(self.int_id) is not int or self.int_id < 1:
            raise ValueError(f"AdapterSpec.int_id={self.int_id!r} must be an int >= 1")

    def shape(self) -> AdapterShape:
        return AdapterShape.read(Path(self.path))


@dataclass(frozen=True, kw_only=True)
class AdapterShape:
    """What a PEFT ``adapter_config.json`` fixes for a run."""

    r: int
    """The rank (the largest, where ``rank_pattern`` gives some modules another)."""
    target_modules: tuple[str, ...]
    """The module names the adapter covers, as PEFT's ``target_modules`` list."""

    @classmethod
    def read(cls, path: Path) -> AdapterShape:
        """Read and check a PEFT directory; a ``ValueError`` names everything an in-flight
        adapter slot cannot hold."""
        config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
        for f in (config_file, weights_file):
            if not f.is_file():
                raise ValueError(f"inflight: the adapter directory {path} has no {f.name} (write it with PEFT's "
                                 "save_pretrained)")
        raw = json.loads(config_file.read_text())
        problems = []
        if raw.get("peft_type", "LORA") != "LORA":
            problems.append(f"peft_type={raw.get('peft_type')!r} (only LORA)")
        if raw.get("use_dora"):
            problems.append("use_dora=true (DoRA's magnitude vector has no slot)")
        if raw.get("bias", "none") != "none":
            problems.append(f"bias={raw.get('bias')!r} (adapter biases have no slot; use 'none')")
        if raw.get("modules_to_save"):
            problems.append(f"modules_to_save={raw['modules_to_save']} (full-weight copies are not an adapter)")
        if raw.get("trainable_token_indices"):
            problems.append("trainable_token_indices (embedding rows are not an adapter slot)")
        targets = raw.get("target_modules")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            problems.append(f"target_modules={targets!r} (need an explicit list of module names, e.g. "
                            "['q_proj', 'v_proj'])")
            targets = []
        bad = sorted(t for t in targets if any(u in t for u in UNSUPPORTED_TARGETS))
        if bad:
            problems.append(f"target_modules {bad} (embedding, LM head and expert adapters are not supported in "
                            "flight)")
        ranks = [raw.get("r"), *(raw.get("rank_pattern") or {}).values()]
        if not all(type(r) is int and r >= 1 for r in ranks):
            problems.append(f"r={raw.get('r')!r}, rank_pattern={raw.get('rank_pattern')!r} (ranks must be ints >= 1)")
            ranks = [1]
        if max(ranks) > VLLM_LORA_RANKS[-1]:
            problems.append(f"rank {max(ranks)} > {VLLM_LORA_RANKS[-1]}, the largest vLLM serves")
        if problems:
            raise ValueError(f"inflight: the adapter in {path} cannot be served in flight: " + "; ".join(problems))
        return cls(r=max(ranks), target_modules=tuple(sorted(targets)))

    @property
    def max_lora_rank(self) -> int:
        """The smallest ``max_lora_rank`` vLLM accepts that holds this adapter."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.r)
