"""An adapter engine (LoRA, one policy slot) with its pusher, and transformers + PEFT holding
the same adapter as the reference it is checked against."""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from inflight.adapter import AdapterSpec
from inflight.engine.client import coordinator_of, policy_lora, start_inflight, tagged
from inflight.engine.engine_config import InflightConfig, engine_kwargs
from inflight.engine.rpc import WorkerStatus, as_result
from inflight.trainer.lora_policy import LoRAOptions, adapter_weights, load_adapter_weights
from inflight.transport.group_config import GroupConfig
from inflight.transport.pusher import PushConfig, WeightPusher

PROMPTS = ["1+2=", "count 3 4", "the quick brown", "17+5="]
OPTIONS = LoRAOptions(rank=8, alpha=16.0)


def write_adapter(base: Path, out: Path, seed: int, options: LoRAOptions = OPTIONS, scale: float = 0.05) -> dict:
    """A PEFT adapter on ``base`` with random A and B (B nonzero: the adapter changes outputs)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32), options.peft_config())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(out))
    return {k: v.clone() for k, v in adapter_weights(model).items()}


class PeftReference:
    """transformers + PEFT: the base model holding any adapter version."""

    def __init__(self, base: Path, adapter_dir: Path) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        self.model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
                                               str(adapter_dir)).eval()

    def load(self, weights: dict) -> PeftReference:
        load_adapter_weights(self.model, weights)
        return self

    @torch.no_grad()
    def logprobs(self, prompt: list[int], completion: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].double()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


class LoRAEngine:
    """An in-process ``LLM`` serving the adapter of ``adapter_dir`` (``v0``: its tensors) on ``base``."""

    def __init__(self, base: Path, adapter_dir: Path, v0: dict, port: int, tp: int = 1, prompts: list | None = None,
                 listener_cpus: tuple[int, ...] = ()) -> None:
        from vllm import LLM

        self.base, self.adapter_dir, self.v0 = base, adapter_dir, v0
        self.spec = AdapterSpec(path=str(adapter_dir))
        extra = dict(tensor_parallel_size=2, distributed_executor_backend="mp") if tp == 2 else {}
        self.llm = LLM(str(base), enforce_eager=True, dtype="float32", max_model_len=512, seed=0, **extra,
                       **engine_kwargs(adapter=self.spec))
        self.group = GroupConfig(port=port, world_size=1 + tp, timeout_s=120)
        self.config = InflightConfig(group=self.group, adapter=self.spec, listener_cpus=listener_cpus)
        self.report = start_inflight(self.llm, self.config)
        self.lora = policy_lora(self.config)
        self.pusher = WeightPusher(self.group, PushConfig(dtype="float32", bucket_mb=0.25))
        self.coordinator = coordinator_of(self.llm)
        self.reference = PeftReference(base, adapter_dir)
        self.version = 0
        self.live = v0
        self.prompts = prompts or PROMPTS

    def push(self, weights: dict):
        result = self.pusher.push(self.version + 1, weights)
        self.version += 1
        self.live = weights
        return result

    def greedy(self, max_tokens: int = 12):
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        outs = self.llm.generate(self.prompts, sp, lora_request=self.lora, use_tqdm=False)
        return [(list(o.prompt_token_ids), tagged(o.outputs[0])) for o in outs]

    def statuses(self) -> list[WorkerStatus]:
        return [as_result(s, WorkerStatus) for s in self.llm.collective_rpc("inflight_status")]

    def close(self) -> None:
        self.pusher.close()
        self.llm.collective_rpc("inflight_stop")
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


def assert_matches_peft(engine: LoRAEngine, weights: dict, version: int, atol: float = 1e-5) -> list:
    ref = engine.reference.load(weights)
    outs = engine.greedy()
    for prompt, out in outs:
        assert out.versions == [version] * len(out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), ref.logprobs(prompt, out.token_ids),
                                   atol=atol, rtol=0)
    return outs


def slot_equals_vllm_load(worker, path: str) -> bool:
    """Inside a worker: the live slot holds, bit for bit, what vLLM's own disk path (the worker
    manager's ``_load_adapter`` of the class, not the engine's guard, then ``activate_adapter``'s
    ``set_lora``) writes for the adapter in ``path``."""
    import copy

    from vllm.lora.request import LoRARequest

    wm = worker.model_runner.lora_manager
    manager = wm._adapter_manager
    model = type(wm)._load_adapter(wm, LoRARequest("reference", 99, path))
    manager._create_merged_loras_inplace(model)
    for name, module in manager.modules.items():
        shadow = copy.copy(module)
        shadow.lora_a_stacked = tuple(torch.zeros_like(t[:1]) for t in module.lora_a_stacked)
        shadow.lora_b_stacked = tuple(torch.zeros_like(t[:1]) for t in module.lora_b_stacked)
        weights = model.get_lora(name)
        if weights is not None:
            shadow.set_lora(0, weights.lora_a, weights.lora_b)
        for live, want in zip((*module.lora_a_stacked, *module.lora_b_stacked),
                              (*shadow.lora_a_stacked, *shadow.lora_b_stacked)):
            if not torch.equal(live[0], want[0]):
                return False
    return True


def copy_plan_of(worker) -> tuple[int, int] | None:
    """Inside a worker: the lora commit's copy plan, (runs, indexed images), or None when
    prepare takes vLLM's path (``inflight.engine.commit.lora_plan``)."""
    plan = worker._inflight_target.strategy._plan
    return None if plan is None else plan.counts()


def index_bytes_counted(worker) -> tuple[int, int]:
    """Inside a worker: the lora commit's index bytes as the KV cache's budget counts them, before
    ``attach`` records the copy plan (a fresh strategy's bound), and as ``attach`` recorded them."""
    from inflight.engine.adapter_engine import adapter_schema
    from inflight.engine.commit.lora_slot import LoRASlotStrategy

    live = worker._inflight_target.strategy
    fresh = LoRASlotStrategy(worker.model_runner, live._spec, adapter_schema(worker.model_runner, live._spec))
    return fresh.index_bytes(), live.index_bytes()


def listener_affinity(worker) -> list[int]:
    """Inside a worker: the CPUs its listener thread may run on."""
    import os

    return sorted(os.sched_getaffinity(worker._inflight_thread.native_id))
