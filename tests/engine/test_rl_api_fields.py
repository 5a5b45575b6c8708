"""The ``inflight`` backend's init info carries the project's update kinds: sparse updates
(``push=PushConfig(encoding="sparse")`` starts the engines with ``keep_base``) and a LoRA
policy (``engine_options={"adapter": spec}``), each through ``LLM``'s offline methods and
checked against transformers (and PEFT)."""

from __future__ import annotations

import contextlib
import gc

import torch
from safetensors.torch import load_file

from inflight.adapter import AdapterSpec
from inflight.engine.adapter_engine import policy_request
from inflight.engine.client import tagged
from inflight.engine.engine_config import engine_kwargs
from inflight.trainer.transfer_trainer import InflightTrainerInitInfo
from inflight.transport.pusher import PushConfig
from tests.engine_harness import Reference
from tests.lora_harness import PROMPTS, PeftReference, write_adapter


def _close(llm, trainer) -> None:
    trainer.shutdown()
    with contextlib.suppress(Exception):
        llm.collective_rpc("inflight_stop")
    llm.llm_engine.engine_core.shutdown()


def _greedy(llm, lora_request=None) -> list[tuple[list[int], object]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, sp, lora_request=lora_request, use_tqdm=False)
    return [(list(o.prompt_token_ids), tagged(o.outputs[0])) for o in outs]


def _few_changed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` with 1% of each tensor's elements moved: an RL step's sparse change."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        mask = torch.rand(v.shape, generator=g) < 0.01
        out[k] = v + mask * 0.05 * torch.randn(v.shape, generator=g)
    return out


def test_sparse_encoding_is_a_field_of_the_init_info(tiny_qwen, port) -> None:
    from vllm import LLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    llm = LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=512, seed=0,
              **engine_kwargs(rl_api=True))
    base = load_file(str(tiny_qwen / "model.safetensors"))
    info = InflightTrainerInitInfo(rank=0, port=port,
                                   push=PushConfig(dtype="float32", bucket_mb=0.25, encoding="sparse"), timeout_s=60.0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=base)
    try:
        ref = Reference(tiny_qwen, "float32")
        dense = sum(t.numel() * 4 for t in base.values())
        state, sent = base, []
        for v in (1, 2, 3):
            state = trainer.source = _few_changed(state, seed=v)
            sent.append(trainer.send_weights().send.nbytes)
            ref.load(state)
            for prompt, out in _greedy(llm):
                assert out.versions == [v] * 8
                torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64),
                                           ref.logprobs(prompt, out.token_ids), atol=1e-5, rtol=0)
        # the first update has no base on the trainer's side and goes dense; the later ones carry the changes
        assert sent[0] >= dense and max(sent[1:]) < 0.2 * dense, (sent, dense)
    finally:
        _close(llm, trainer)
        del llm
        gc.collect()


def test_a_lora_policy_is_a_field_of_the_init_info(tiny_qwen, tmp_path, port) -> None:
    from vllm import LLM
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    v0 = write_adapter(tiny_qwen, tmp_path / "adapter", seed=1)
    spec = AdapterSpec(path=str(tmp_path / "adapter"))
    llm = LLM(str(tiny_qwen), enforce_eager=True, dtype="float32", max_model_len=512, seed=0,
              **engine_kwargs(adapter=spec, rl_api=True))
    info = InflightTrainerInitInfo(rank=0, port=port, push=PushConfig(dtype="float32", bucket_mb=0.25),
                                   engine_options={"adapter": spec}, timeout_s=60.0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=llm, source=v0)
    try:
        ref = PeftReference(tiny_qwen, tmp_path / "adapter")
        g = torch.Generator().manual_seed(7)
        for v in (1, 2):
            weights = trainer.source = {k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in v0.items()}
            result = trainer.send_weights()
            assert result.version == v
            assert result.send.nbytes < sum(t.numel() * 4 for t in v0.values()) * 2  # the adapter alone travels
            ref.load(weights)
            for prompt, out in _greedy(llm, policy_request(spec)):
                assert out.versions == [v] * 8
                torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64),
                                           ref.logprobs(prompt, out.token_ids), atol=1e-5, rtol=0)
    finally:
        _close(llm, trainer)
        del llm
        gc.collect()
