"""The ``lora`` commit: an adapter version written into the engine's one LoRA slot.

vLLM 0.32 keeps an active adapter in per-layer wrappers (``lora_a_stacked`` / ``lora_b_stacked``, alpha/r
folded into B), and the worker's adapter manager keeps the registered ``LoRAModel``, copied into the slot
again whenever it re-activates the adapter (docs/design.md). Phases (``inflight.engine.commit.base``):
- ``prepare`` (listener thread, while the engine decodes): vLLM's own loader code turns the staged PEFT tensors
  into a ``LoRAModel`` (names mapped, q/k/v and gate/up packed, alpha/r folded into B, in the LoRA dtype,
  exactly as a load from disk), and each wrapper's own ``set_lora``, run on a shallow copy of the wrapper with
  scratch buffers, writes the slot's image (zero padding, this rank's tensor-parallel slice), through a copy
  plan recorded from that same path at start (``inflight.engine.commit.lora_plan``). Nothing live is touched.
- ``apply`` (execution thread, between two steps): one ``_foreach_copy_`` of the images into the live slot, in
  place (GPU kernels and CUDA graphs hold the slot's addresses), and the registered ``LoRAModel`` now holds the
  new version, so a re-activation replays it, never an older one.
- ``restore`` / ``undo``: the previous images and adapter back, the same way. They are the live version's own
  (kept from its commit, or read from the slot at start): nothing is copied inside the stall to make a
  rollback possible.

Ordering invariant: the slot, the registered adapter and ``_live`` change only in
``apply``, ``restore`` and ``undo``; ``prepare`` reads none of them.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from inflight.adapter import AdapterSpec
from inflight.engine.commit.lora_plan import SlotPlan
from inflight.memory import update_bytes
from inflight.protocol import ShardPlan
from inflight.transport.schema import TensorSchema

log = logging.getLogger("inflight")


class LoRASlotStrategy:
    """One worker's adapter slot: prepared images of the next version, and the live one's."""

    name = "lora"
    needs_rollback_copy = False  # the previous version's images are kept from its own commit

    def __init__(self, model_runner: Any, spec: AdapterSpec, schema: TensorSchema) -> None:
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
        from vllm.lora.peft_helper import PEFTHelper

        worker_manager = getattr(model_runner, "lora_manager", None)
        if worker_manager is None:
            raise RuntimeError("inflight: InflightConfig.adapter needs an engine with LoRA enabled "
                               "(engine_kwargs(adapter=...) sets enable_lora, max_loras=1 and the adapter's rank)")
        self._manager = worker_manager._adapter_manager
        self._config = model_runner.lora_config
        self._device = torch.device(model_runner.device)
        self._spec = spec
        self._helper = PEFTHelper.from_local_dir(spec.path, worker_manager.max_position_embeddings)
        self._helper.validate_legal(self._config)
        self._vocab = worker_manager.vocab_size
        model = self._manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        self._mapper = mapper.get_rename_mapper() if mapper is not None else None
        self._skip = getattr(model, "lora_skip_prefixes", None)
        other = sorted(n for n, m in self._manager.modules.items() if not isinstance(m, BaseLinearLayerWithLoRA))
        if other:
            raise RuntimeError(f"inflight: LoRA wrappers of other layouts on {other[:4]} (embeddings, LM head, "
                               "experts); start the engine with engine_kwargs(adapter=...), which wraps only the "
                               "adapter's targets")
        self._modules = sorted(self._manager.modules.items())
        self._adapter_bytes = update_bytes(schema)  # the prepared adapter: a clone of the staged tensors
        self._adapter_elements = sum(math.prod(shape) for shape, _ in schema.tensors.values())
        self._views = [t[0] for _, m in self._modules for t in _stacked(m)]  # slot 0: the one slot
        self._prepared: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self._live: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self._previous: tuple[dict[str, Any], list[torch.Tensor]] | None = None
        self._plan: SlotPlan | None = None

    # -- start ---------------------------------------------------------------------------

    def attach(self) -> None:
        """Execution thread, at start: the first version in the slot, pinned, and its images
        kept as the live version's (what a failed first commit restores). It is read by the
        same code as every update, so an update of the same tensors writes the same bytes."""
        manager, sid = self._manager, self._spec.int_id
        tensors = _read_dir(self._spec.path)
        first = self._from_tensors({n: t.clone() for n, t in tensors.items()})  # it scales B in place
        unplaced = sorted(set(first.loras) - {n for n, _ in self._modules})
        if unplaced:
            raise RuntimeError(f"inflight: the adapter in {self._spec.path} covers {unplaced[:4]}, which have no LoRA "
                               "slot in this engine (start it with engine_kwargs(adapter=...))")
        manager.add_adapter(first)
        manager.activate_adapter(sid)
        manager.pin_adapter(sid)
        if list(manager.lora_index_to_id) != [sid]:
            raise RuntimeError(f"inflight: adapter slots {list(manager.lora_index_to_id)} after pinning id {sid}; "
                               "an adapter engine has one slot (max_loras=1)")
        self._live = (manager.get_adapter(sid).loras, [v.clone() for v in self._views])
        self._plan = self._record_plan({n: t.to(self._config.lora_dtype) for n, t in tensors.items()})

    def _record_plan(self, tensors: dict[str, torch.Tensor]) -> SlotPlan | None:
        """The copy plan of vLLM's path (``lora_plan``), if it writes from the first version
        exactly what vLLM's own load wrote into the live slot; else None: vLLM's path."""
        def run_vllm(probe: dict[str, torch.Tensor]) -> list[torch.Tensor]:
            host = torch.device("cpu")
            return self._slot_images(self._from_tensors(probe, torch.float64, host).loras, torch.float64, host)

        try:
            plan = SlotPlan.record(tensors, run_vllm, self._views[0].dtype, self._views[0].device)
        except ValueError as e:
            log.warning("inflight: LoRA updates take vLLM's loader in prepare: no copy plan (%s)", e)
            return None
        images = plan.images({n: t.to(plan.device) for n, t in tensors.items()})
        if len(images) != len(self._views) or not all(torch.equal(a, b) for a, b in zip(images, self._views)):
            log.warning("inflight: LoRA updates take vLLM's loader in prepare: the copy plan does not write "
                        "vLLM's slot")
            return None
        return plan

    def live_adapter(self, adapter_id: int) -> Any:
        """The live version as a fresh ``LoRAModel`` (sharing its tensors): what the worker's
        manager gets whenever it would load the policy adapter from disk again."""
        from vllm.lora.lora_model import LoRAModel

        if self._live is None:
            raise RuntimeError("inflight: the policy adapter was asked for before the slot was attached")
        return LoRAModel(adapter_id, self._helper.r, dict(self._live[0]))

    # -- listener thread -----------------------------------------------------------------

    def feed(self, weights: Mapping[str, torch.Tensor]) -> None:
        pass  # an adapter is small: everything is built once it has all arrived

    @torch.no_grad()
    def prepare(self, weights: Mapping[str, torch.Tensor]) -> None:
        # clone: vLLM's loader aliases tensors already in its dtype, and folds alpha/r into B in place
        loras = self._from_tensors({n: w.clone() for n, w in weights.items()}).loras
        if self._live is not None and set(loras) != set(self._live[0]):
            raise ValueError(f"inflight: the update covers modules {sorted(set(loras) ^ set(self._live[0]))[:4]} "
                             "other than the live adapter's")
        images = self._plan.images(weights) if self._plan is not None else self._slot_images(loras)
        self._prepared = (loras, images)

    def _slot_images(self, loras: dict[str, Any], dtype: torch.dtype | None = None,
                     device: torch.device | None = None) -> list[torch.Tensor]:
        """vLLM's path: each wrapper's ``set_lora`` on a shadow with scratch slots."""
        images: list[torch.Tensor] = []
        for name, module in self._modules:
            shadow = copy.copy(module)  # shallow: set_lora writes into the shadow's scratch, never the live slot
            shadow.lora_a_stacked = _scratch(module.lora_a_stacked, dtype, device)
            shadow.lora_b_stacked = _scratch(module.lora_b_stacked, dtype, device)
            weights_of = loras.get(name)
            if weights_of is not None:
                shadow.set_lora(0, weights_of.lora_a, weights_of.lora_b)
            images.extend(t[0] for t in _stacked(shadow))
        return images

    def _from_tensors(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                      device: torch.device | None = None) -> Any:
        from vllm.lora.lora_model import LoRAModel

        model = LoRAModel.from_lora_tensors(self._spec.int_id, tensors, self._helper,
                                            device=str(device or self._device),
                                            dtype=dtype or self._config.lora_dtype, model_vocab_size=self._vocab,
                                            weights_mapper=self._mapper, skip_prefixes=self._skip)
        self._manager._create_merged_loras_inplace(model)  # packs q/k/v and gate/up; folds alpha/r into B
        return model

    def discard(self) -> None:
        self._prepared = None

    # -- execution thread ----------------------------------------------------------------

    def apply(self) -> None:
        if self._prepared is None or self._live is None:
            raise RuntimeError("inflight: lora commit without a prepared adapter")
        self._previous, self._live = self._live, self._prepared
        self._prepared = None
        self._write(self._live)

    def restore(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        if self._previous is not None:  # None: apply failed before it changed anything
            self.undo(previous)

    def undo(self, previous: Mapping[str, torch.Tensor] | None) -> None:
        if self._previous is None:
            raise RuntimeError("inflight: no previous adapter to take back")
        self._live, self._previous = self._previous, None
        self._write(self._live)

    def release_rollback(self) -> None:
        self._previous = None

    def _write(self, version: tuple[dict[str, Any], list[torch.Tensor]]) -> None:
        loras, images = version
        torch._foreach_copy_(self._views, images)
        registered = self._manager.get_adapter(self._spec.int_id)
        if registered is not None:  # evicted or reset: the manager reloads it through live_adapter
            registered.loras = dict(loras)

    # -- bookkeeping ---------------------------------------------------------------------

    def shard_plan(self) -> ShardPlan | None:
        return None  # each rank stages the whole adapter; its own set_lora takes the rank's slice

    def slot_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self._views)

    def held_bytes(self) -> int:
        # the live and the prepared images, the prepared adapter (the staged tensors' clone), and
        # the copy plan's indexes (recorded by attach, which runs before the reservation)
        return 2 * self.slot_bytes() + self._adapter_bytes + self.index_bytes()

    def index_bytes(self) -> int:
        """The copy plan's indexes (one int32 per element of the images it gathers, int64 past
        2**31 source elements). Before ``attach`` records the plan (the KV cache's budget is
        set then), their bound: every slot element gathered through an index."""
        if self._plan is not None:
            return self._plan.index_bytes()
        elements = sum(v.numel() for v in self._views)
        return elements * (4 if self._adapter_elements < 2**31 else 8)

    def close(self) -> None:
        pass


def _stacked(module: Any) -> list[torch.Tensor]:
    out = []
    for stacked in (module.lora_a_stacked, module.lora_b_stacked):
        out.extend(stacked if isinstance(stacked, (tuple, list)) else (stacked,))
    return out


def _scratch(stacked: Any, dtype: torch.dtype | None, device: torch.device | None) -> Any:
    def zeros(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(t[:1].shape, dtype=dtype or t.dtype, device=device or t.device)

    if isinstance(stacked, (tuple, list)):
        return type(stacked)(zeros(t) for t in stacked)
    return zeros(stacked)


def _read_dir(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from inflight.adapter import ADAPTER_WEIGHTS

    return load_file(f"{path}/{ADAPTER_WEIGHTS}")
