"""Built-in model names: HF-style configs built with random weights (fixed seed), no download.

``tiny-*`` are for tests and the demo (hidden 64, 2 layers, vocab 128); the
others have real shapes, for benchmarks.

``*-fp8`` / ``*-int8`` are the same models W8A8-quantized, with a compressed-tensors
``quantization_config`` as a checkpoint would carry (the same weights drawn, then quantized;
the LM head stays in floating point):

- fp8: per-tensor weight scales and static per-tensor activations, the layout expected to be
  fastest: the GEMM takes two scalar scales (Llama 3 8B on the H200 at M=1: per-tensor 2.43 ms,
  row-wise 4.02 ms, bf16 4.12 ms) and the activation quantization is one elementwise pass with
  no reduction. Random weights have no calibration: every ``input_scale`` is
  :data:`models.quant_linear.BUILTIN_INPUT_SCALE` (8 / 448: |x| up to 8 unclipped).
- int8: per-channel weight scales, dynamic per-token activations (the RedHatAI ``w8a8`` layout;
  int8 has too few levels for one static scale over every token).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BUILTIN_MODELS", "QUANTIZATIONS"]

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
             torch_dtype="float32")


def _w8a8(kind: str, weights: str, acts: str, dynamic: bool) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config``: every linear but the LM head quantized."""
    typ = "float" if kind == "fp8" else "int"
    scheme = dict(targets=["Linear"], weights=dict(num_bits=8, type=typ, symmetric=True, strategy=weights,
                                                   dynamic=False),
                  input_activations=dict(num_bits=8, type=typ, symmetric=True, strategy=acts, dynamic=dynamic))
    return dict(quant_method="compressed-tensors", format=f"{typ}-quantized", config_groups=dict(group_0=scheme),
                ignore=["lm_head"], quantization_status="compressed")


QUANTIZATIONS = {"fp8": _w8a8("fp8", "tensor", "tensor", dynamic=False),
                 "int8": _w8a8("int8", "channel", "token", dynamic=True)}

BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(_TINY, architectures=["LlamaForCausalLM"], rope_theta=10000.0),
    "tiny-gemma2": dict(_TINY, architectures=["Gemma2ForCausalLM"], hidden_activation="gelu_pytorch_tanh",
                        query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=50.0,
                        final_logit_softcapping=30.0, tie_word_embeddings=True, rope_theta=10000.0),
    # Llava 1.5 shrunk: 28-pixel images in 14-pixel patches are 4 image tokens (576 in Llava 1.5).
    "tiny-llava": dict(
        architectures=["LlavaForConditionalGeneration"], image_token_index=159, torch_dtype="float32",
        text_config=dict(_TINY, model_type="llama", vocab_size=160, rope_theta=10000.0),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=28, patch_size=14)),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        torch_dtype="bfloat16"),
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16"),
    "gemma-2-2b": dict(
        architectures=["Gemma2ForCausalLM"], vocab_size=256000, hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, query_pre_attn_scalar=256,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, torch_dtype="bfloat16"),
}
BUILTIN_MODELS.update({
    f"{base}-{kind}": dict(BUILTIN_MODELS[base], quantization_config=config)
    for base in ("tiny-llama", "llama-3-8b") for kind, config in QUANTIZATIONS.items()
})
