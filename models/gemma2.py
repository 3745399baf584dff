"""Gemma 2: GeGLU (tanh), ``(1 + w)`` RMSNorms before and after attention and MLP, embeddings scaled by
sqrt(hidden), attention-logit and final-logit soft-capping, sliding window on alternate layers,
``query_pre_attn_scalar`` as the softmax scale.

Same flat interface as :mod:`models.llama`: ``forward(input_ids [T], positions [T], inputs_embeds=None)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from dispatcher import support_torch_compile
from ops import GeluAndMul, GemmaRMSNorm, RotaryEmbedding

from .attention import Attention
from .kv_scales import apply_kv_scales, register_kv_scales
from .layers import ConfigError, config_field
from .parallel.linear import column_parallel_linear, row_parallel_linear
from .parallel.state import divide
from .parallel.vocab import vocab_parallel_embedding
from .llama import LlamaConfig, LlamaForCausalLM

__all__ = ["Gemma2Config", "Gemma2Model", "Gemma2ForCausalLM"]


@dataclasses.dataclass
class Gemma2Config(LlamaConfig):
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = 4096
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    sliding_layers: tuple[bool, ...] = ()
    """Per layer: sliding-window attention. HF: ``layer_types``, else even layers (transformers 4)."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Gemma2Config:
        llama = LlamaConfig.common_from_hf({"tie_word_embeddings": True, **hf})
        base = {f.name: getattr(llama, f.name) for f in dataclasses.fields(llama)}  # not asdict: keeps quantization
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ConfigError(f"hidden_activation: {act!r} is not supported by Gemma2ForCausalLM "
                              "(supported: 'gelu_pytorch_tanh')")
        n = llama.num_hidden_layers
        types = hf.get("layer_types")
        sliding = tuple(t == "sliding_attention" for t in types) if types else tuple(i % 2 == 0 for i in range(n))
        window = config_field(hf, "sliding_window", int, None, positive=True) if "sliding_window" in hf else 4096
        return cls(**base, query_pre_attn_scalar=config_field(hf, "query_pre_attn_scalar", float, 256.0),
                   sliding_window=window,
                   attn_logit_softcapping=config_field(hf, "attn_logit_softcapping", float, None),
                   final_logit_softcapping=config_field(hf, "final_logit_softcapping", float, None),
                   sliding_layers=sliding)


class Gemma2MLP(nn.Module):
    def __init__(self, config: Gemma2Config, prefix: str) -> None:
        super().__init__()
        inter, quant = divide(config.intermediate_size, "intermediate_size"), config.quantization  # this rank's
        self.gate_up_proj = column_parallel_linear(config.hidden_size, [inter, inter], ["gate_proj", "up_proj"],
                                                   False, quant, prefix)
        self.act_fn = GeluAndMul(approximate="tanh")
        self.down_proj = row_parallel_linear(inter, config.hidden_size, False, quant, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2Attention(nn.Module):
    def __init__(self, config: Gemma2Config, rotary: RotaryEmbedding, sliding: bool, prefix: str) -> None:
        super().__init__()
        d = config.head_dim
        heads = divide(config.num_attention_heads, "num_attention_heads")  # this rank's (see LlamaAttention)
        kv_heads = divide(config.num_key_value_heads, "num_key_value_heads")
        self.q_size = heads * d
        self.kv_size = kv_heads * d
        bias, quant = config.attention_bias, config.quantization
        self.qkv_proj = column_parallel_linear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                               ["q_proj", "k_proj", "v_proj"], bias, quant, prefix)
        self.o_proj = row_parallel_linear(self.q_size, config.hidden_size, bias, quant, f"{prefix}.o_proj")
        self.rotary_emb = rotary
        self.attn = Attention(heads, d, config.query_pre_attn_scalar**-0.5,
                              kv_heads, layer_name=f"{prefix}.attn",
                              sliding_window=config.sliding_window if sliding else None,
                              logits_soft_cap=config.attn_logit_softcapping)
        register_kv_scales(self, quant)  # an fp8 KV cache's k_scale / v_scale, from the checkpoint

    def process_weights_after_loading(self) -> None:
        apply_kv_scales(self, self.attn)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: Gemma2Config, rotary: RotaryEmbedding, sliding: bool, prefix: str) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma2Attention(config, rotary, sliding, prefix=f"{prefix}.self_attn")
        self.mlp = Gemma2MLP(config, prefix=f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # HF: h = r + post_attn(attn(in(r))); h = h + post_ff(mlp(pre_ff(h))). The adds fuse into the next norms.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


@support_torch_compile
class Gemma2Model(nn.Module):
    def __init__(self, config: Gemma2Config, prefix: str = "model") -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = vocab_parallel_embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, is_neox_style=True, rope_scaling=config.rope_scaling)
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, rotary, config.sliding_layers[i], prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.normalizer = float(config.hidden_size) ** 0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if inputs_embeds is None:
            hidden = self.embed_tokens(input_ids)
            # HF multiplies by sqrt(hidden) rounded to the activation dtype (e.g. 48.0 in bf16 for 2304).
            hidden = hidden * torch.tensor(self.normalizer, dtype=hidden.dtype)
        else:
            hidden = inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Llama's head over the Gemma 2 decoder; logits are soft-capped, embeddings scaled by sqrt(hidden)."""

    config_class = Gemma2Config
    model_class = Gemma2Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids) * self.model.normalizer
