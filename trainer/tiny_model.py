"""Tiny causal LMs and a locally trained tokenizer, written to a directory vLLM can load.

Nothing here touches a hub: the tokenizer is a byte-level BPE trained with ``tokenizers``
on a corpus given by the caller, and the model is randomly initialised from a config: Qwen2,
Llama, Qwen3, a Qwen3 mixture-of-experts, or one whose KV cache vLLM splits into several groups
(Gemma-2's sliding-window and full layers; Llama-4's chunked local and full layers; LFM2's short
convolutions, whose state vLLM keeps as Mamba state, beside full attention; Granite-4's Mamba2
layers beside full attention).
``head_dim`` must be 32 or more because vLLM's CPU attention backend refuses 16.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from inflight.settings import check_choices

SPECIAL_TOKENS = ("<unk>", "<|endoftext|>", "<|pad|>")
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
               "<think>", "</think>")
"""A chat model's added tokens (``TinyModelConfig.chat``): ChatML's and Hermes tool calls'."""


@dataclass(frozen=True, kw_only=True)
class TinyModelConfig:
    """Shape of a tiny test/demo model."""

    arch: Literal["qwen2", "llama", "qwen3", "qwen3_moe", "gemma2", "llama4", "lfm2", "granitemoehybrid"] = "qwen2"
    """Architecture: qwen2 (qkv bias), llama (no bias), qwen3 (q/k norms, no bias), qwen3_moe
    (qwen3 with every MLP a sparse MoE), gemma2 (sliding-window and full attention layers in
    turn), llama4 (chunked local attention, every fourth and the last layer full attention, the
    last layer's MLP a sparse MoE), lfm2 (short-convolution and full attention layers in turn) or
    granitemoehybrid (Mamba2 and full attention layers in turn)."""
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads; hidden_size / num_heads must be 32 or 64."""
    num_kv_heads: int = 2
    """Key/value heads (GQA)."""
    intermediate_size: int = 256
    """MLP width."""
    tie_word_embeddings: bool = True
    """Share the input embedding with the LM head."""
    max_position_embeddings: int = 1024
    """Longest sequence the model accepts."""
    seed: int = 0
    """Initialisation seed."""
    num_experts: int = 4
    """qwen3_moe only: routed experts per MoE layer."""
    experts_per_token: int = 2
    """qwen3_moe only: experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 128
    """qwen3_moe only: width of each expert's MLP."""
    sliding_window: int = 128
    """gemma2 only: the tokens a sliding-window layer attends to (vLLM CPU's KV block is 128)."""
    attention_chunk_size: int = 128
    """llama4 only: the chunk a chunked local attention layer attends within."""
    chat: bool = False
    """A chat model: ChatML's and Hermes tool calls' special tokens (``CHAT_TOKENS``) in the
    tokenizer, and the ChatML tool template (``trainer/tasks/data/chatml_tools.jinja``) as its
    chat template."""

    def __post_init__(self) -> None:
        check_choices(self, "model.tiny")
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                    "max_position_embeddings", "num_experts"):
            if type(value := getattr(self, key)) is not int or value < 1:
                raise ValueError(f"model.tiny.{key}={value!r} must be a whole number >= 1")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"model.tiny.experts_per_token={self.experts_per_token} must be in "
                             f"1..num_experts={self.num_experts}")
        for key in ("sliding_window", "attention_chunk_size"):
            if type(value := getattr(self, key)) is not int or value < 1:
                raise ValueError(f"model.tiny.{key}={value!r} must be a whole number >= 1")
        if self.arch in ("gemma2", "lfm2") and not self.tie_word_embeddings:
            raise ValueError(f"model.tiny.tie_word_embeddings=False: vLLM 0.32's {self.arch} always ties its LM head "
                             "to the embedding")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"model.tiny.moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.tiny.hidden_size={self.hidden_size} not divisible by num_heads={self.num_heads}")
        if self.hidden_size // self.num_heads not in (32, 64, 128):
            raise ValueError(f"model.tiny: head_dim={self.hidden_size // self.num_heads} (hidden_size / num_heads): "
                             "vLLM's CPU attention needs 32, 64 or 128")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.tiny.num_heads={self.num_heads} not divisible by num_kv_heads={self.num_kv_heads}")



def train_tokenizer(corpus: Iterable[str], out_dir: str | Path, vocab_size: int = 300, *, chat: bool = False) -> int:
    """Train a byte-level BPE on ``corpus``, save it as a HF fast tokenizer; return its size.
    ``chat``: with ``CHAT_TOKENS`` and the ChatML tool template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS + (CHAT_TOKENS if chat else ())),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                   pad_token="<|pad|>")
    if chat:
        fast.chat_template = (Path(__file__).parent / "tasks" / "data" / "chatml_tools.jinja").read_text()
    fast.save_pretrained(str(out_dir))
    return len(fast)


def build_tiny_model(
    out_dir: str | Path,
    corpus: Iterable[str],
    config: TinyModelConfig = TinyModelConfig(),
    *,
    vocab_size: int = 300,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write tokenizer + randomly initialised model to ``out_dir``; return the path."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(corpus, out, vocab_size, chat=config.chat)
    tok = AutoTokenizer.from_pretrained(str(out))
    common = dict(
        vocab_size=len(tok), hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(config.seed)
    if config.arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif config.arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    elif config.arch == "qwen3_moe":  # norm_topk_prob: the gate weights of the k experts sum to 1, as in Qwen3-30B-A3B
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
            **common, num_experts=config.num_experts, num_experts_per_tok=config.experts_per_token,
            moe_intermediate_size=config.moe_intermediate_size, decoder_sparse_step=1, norm_topk_prob=True))
    elif config.arch in _HYBRIDS:
        model = _HYBRIDS[config.arch](config, common)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.to(dtype).save_pretrained(str(out), safe_serialization=True)
    if config.arch == "lfm2":  # vLLM 0.32 reads these, as LiquidAI's released configs carry them
        _add_to_config(out, conv_dim=config.hidden_size, conv_dim_out=config.hidden_size,
                       block_dim=config.hidden_size)
    if config.chat:  # a chat turn ends at <|im_end|>: the generation config names it, as chat models' do
        from transformers import GenerationConfig

        GenerationConfig(eos_token_id=[tok.convert_tokens_to_ids("<|im_end|>"),
                                       tok.eos_token_id]).save_pretrained(str(out))
    return out


def _alternating(n: int, first: str, second: str) -> list[str]:
    return [first if i % 2 == 0 else second for i in range(n)]


def _gemma2(config: TinyModelConfig, common: dict) -> torch.nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**common, sliding_window=config.sliding_window, layer_types=_alternating(
        config.num_layers, "sliding_attention", "full_attention")))


def _lfm2(config: TinyModelConfig, common: dict) -> torch.nn.Module:
    from transformers import Lfm2Config, Lfm2ForCausalLM

    kept = {k: v for k, v in common.items() if k != "head_dim"}
    return Lfm2ForCausalLM(Lfm2Config(**kept, layer_types=_alternating(config.num_layers, "conv", "full_attention"),
                                      conv_L_cache=4, block_auto_adjust_ff_dim=False))


def _granitemoehybrid(config: TinyModelConfig, common: dict) -> torch.nn.Module:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    kept = {k: v for k, v in common.items() if k != "head_dim"}
    return GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(
        **kept, shared_intermediate_size=config.intermediate_size, num_local_experts=0, num_experts_per_tok=0,
        layer_types=_alternating(config.num_layers, "mamba", "attention"), position_embedding_type="rope",
        mamba_n_heads=4, mamba_d_head=config.hidden_size // 2, mamba_d_state=16, mamba_n_groups=1,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64))


def _llama4(config: TinyModelConfig, common: dict) -> torch.nn.Module:
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    n = config.num_layers
    full = [i for i in range(n) if (i + 1) % 4 == 0 or i == n - 1]
    return Llama4ForCausalLM(Llama4TextConfig(
        **common, intermediate_size_mlp=config.intermediate_size, num_local_experts=config.num_experts,
        # one MoE layer, the last: vLLM reads the step, transformers the list
        num_experts_per_tok=1, moe_layers=[n - 1], interleave_moe_layer_step=n,
        no_rope_layers=[0 if i in full else 1 for i in range(n)], attention_chunk_size=config.attention_chunk_size,
        use_qk_norm=False, attn_temperature_tuning=False))


_HYBRIDS = {"gemma2": _gemma2, "llama4": _llama4, "lfm2": _lfm2, "granitemoehybrid": _granitemoehybrid}
"""Builders of the architectures whose KV cache vLLM splits into more than one group."""


def _add_to_config(out: Path, **fields: int) -> None:
    import json

    path = out / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}, indent=2))


def default_corpus() -> list[str]:
    """A small corpus of digits, arithmetic and words: enough merges for the demo task."""
    lines = [f"{a}+{b}={a + b}" for a in range(40) for b in range(40)]
    lines += [f"count {' '.join(str(i) for i in range(s, s + 6))}" for s in range(30)]
    lines += ["the quick brown fox jumps over the lazy dog"] * 5
    return lines
