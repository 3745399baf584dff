"""Llama 2/3: GQA, SwiGLU, RMSNorm, RoPE (with Llama-3 frequency scaling), optional tied embeddings.

Tokens are flattened: ``input_ids`` and ``positions`` are ``[T]``, the new
tokens of every sequence in the batch (T is the one dynamic dim). The decoder
(:class:`LlamaModel`) is compiled once by ``@support_torch_compile``;
attention metadata reaches ``torch.ops.dynamo_once.attention`` through the
forward context, not through the graph.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from dispatcher import support_torch_compile
from ops import RMSNorm, RotaryEmbedding, SiluAndMul

from .attention import Attention
from .kv_scales import apply_kv_scales, register_kv_scales
from .layers import ConfigError, config_field, rope_from_hf
from .parallel.linear import column_parallel_linear, row_parallel_linear
from .parallel.state import divide
from .parallel.vocab import parallel_lm_head, vocab_parallel_embedding
from .quantization import QuantizationConfig, parse_quantization_config

__all__ = ["LlamaConfig", "LlamaModel", "LlamaForCausalLM"]


@dataclasses.dataclass
class LlamaConfig:
    """The fields of an HF Llama ``config.json`` that the model uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str | None = None
    quantization: QuantizationConfig | None = None
    """W8A8 linear layers from ``quantization_config`` (:mod:`models.quantization`); None: floating point."""

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """A Llama config; what this model would silently ignore (a Mistral checkpoint relabelled
        ``LlamaForCausalLM``: a ``sliding_window``, an ``hidden_act`` other than silu) is refused.

        Raises:
            ConfigError: naming the field: missing, ill-typed or not supported.
        """
        act = config_field(hf, "hidden_act", str, "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act: {act!r} is not supported by LlamaForCausalLM (supported: 'silu')")
        config = cls.common_from_hf(hf)
        window = hf.get("sliding_window")
        if window is not None and hf.get("use_sliding_window") is not False:
            window = config_field(hf, "sliding_window", int)
            if window < config.max_position_embeddings:
                raise ConfigError(f"sliding_window: {window} (sliding-window attention, e.g. Mistral) is not "
                                  f"supported by LlamaForCausalLM (supported: null, or at least "
                                  f"max_position_embeddings={config.max_position_embeddings})")
        return config

    @classmethod
    def common_from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        """The fields Llama shares with its relatives (Gemma 2), each checked for presence and type."""
        heads = config_field(hf, "num_attention_heads", int, positive=True)
        hidden = config_field(hf, "hidden_size", int, positive=True)
        for name in ("rope_scaling", "rope_parameters"):
            config_field(hf, name, dict, None)
        config_field(hf, "rope_theta", float, None)
        theta, scaling = rope_from_hf(hf)
        return cls(
            vocab_size=config_field(hf, "vocab_size", int, positive=True),
            hidden_size=hidden,
            intermediate_size=config_field(hf, "intermediate_size", int, positive=True),
            num_hidden_layers=config_field(hf, "num_hidden_layers", int, positive=True),
            num_attention_heads=heads,
            num_key_value_heads=config_field(hf, "num_key_value_heads", int, heads, positive=True),
            head_dim=config_field(hf, "head_dim", int, hidden // heads, positive=True),
            rms_norm_eps=config_field(hf, "rms_norm_eps", float, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config_field(hf, "max_position_embeddings", int, 2048, positive=True),
            tie_word_embeddings=config_field(hf, "tie_word_embeddings", bool, False),
            attention_bias=config_field(hf, "attention_bias", bool, False),
            mlp_bias=config_field(hf, "mlp_bias", bool, False),
            torch_dtype=config_field(hf, "torch_dtype", str, None) or config_field(hf, "dtype", str, None),
            quantization=parse_quantization_config(hf),
        )


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig, prefix: str) -> None:
        super().__init__()
        # This rank's slice of the intermediate size (all of it without tensor parallelism).
        inter, quant = divide(config.intermediate_size, "intermediate_size"), config.quantization
        self.gate_up_proj = column_parallel_linear(config.hidden_size, [inter, inter], ["gate_proj", "up_proj"],
                                                   config.mlp_bias, quant, prefix)
        self.act_fn = SiluAndMul()
        self.down_proj = row_parallel_linear(inter, config.hidden_size, config.mlp_bias, quant,
                                             f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [T, 2 * inter] -> [T, inter] -> [T, hidden]


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        d = config.head_dim
        # This rank's heads (tensor parallel: query and KV heads are both split, GQA groups stay whole).
        heads = divide(config.num_attention_heads, "num_attention_heads")
        kv_heads = divide(config.num_key_value_heads, "num_key_value_heads")
        self.q_size = heads * d
        self.kv_size = kv_heads * d
        bias, quant = config.attention_bias, config.quantization
        self.qkv_proj = column_parallel_linear(config.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                               ["q_proj", "k_proj", "v_proj"], bias, quant, prefix)
        self.o_proj = row_parallel_linear(self.q_size, config.hidden_size, bias, quant, f"{prefix}.o_proj")
        self.rotary_emb = rotary
        self.attn = Attention(heads, d, d**-0.5, kv_heads, layer_name=f"{prefix}.attn")
        register_kv_scales(self, quant)  # an fp8 KV cache's k_scale / v_scale, from the checkpoint

    def process_weights_after_loading(self) -> None:
        apply_kv_scales(self, self.attn)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))  # [T, Hq * D] -> [T, hidden]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding, prefix: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary, prefix=f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add is fused into the next norm: (normed, hidden + residual).
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


@support_torch_compile
class LlamaModel(nn.Module):
    """The decoder: embeddings, layers, final norm. Compiled once; T (dim 0 of each input) is dynamic."""

    def __init__(self, config: LlamaConfig, prefix: str = "model") -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = vocab_parallel_embedding(config.vocab_size, config.hidden_size)
        # One cos/sin cache for all layers: Llama 3.2's 131072 positions x 64 dims are 32 MiB in fp32.
        rotary = RotaryEmbedding(config.head_dim, config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, is_neox_style=True, rope_scaling=config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary, prefix=f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns hidden states ``[T, hidden]``; ``compute_logits`` the logits
    of the rows the runner samples from (the last token of each sequence)."""

    config_class = LlamaConfig
    model_class = LlamaModel
    #: builds W8A8 linear layers from a checkpoint's ``quantization_config``
    supports_quantization = True
    #: checkpoint tensors with no parameter here, skipped by the loader
    ignored_checkpoint_names = (r"\.rotary_emb\.inv_freq$",)
    #: shards over a tensor-parallel group (:mod:`models.parallel`)
    supports_tensor_parallel = True

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_class(config, prefix="model")
        #: the checkpoint's KV cache is fp8 (its kv_cache_scheme): ``LLM(kv_cache_dtype="auto")`` follows it
        self.fp8_kv_cache = config.quantization is not None and config.quantization.kv_cache
        # A tied head is the embedding, stored in floating point, whatever the quantization config targets.
        quant = None if config.tie_word_embeddings else config.quantization
        self.lm_head = parallel_lm_head(config.hidden_size, config.vocab_size, quant)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [B, vocab]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def checkpoint_name(self, name: str) -> str:
        """The HF tensor name of our parameter ``name`` (after merged projections are split)."""
        return name
