"""dynamo-once's custom ops: Triton kernels registered as ``torch.ops.dynamo_once.*``, their
``CustomOp`` modules (switched per op by ``CompilationConfig.custom_ops``) and fp32 references.

Triton is optional: without it every op runs its reference on any device. The paged-attention
ops (``paged_attention``, ``paged_prefill``) have no module: the attention layer of ``models`` calls their
launchers. The W8A8 GEMMs (``scaled_mm``) have none either: opaque ops a quantized linear layer calls. Nor have the fused
norm + quant and activation + quant ops (``norm_quant``, ``act_quant``): the graph passes put them in place of
the unfused sequences, nor the gate-up GEMM fused with its activation and per-token quant (``gated_quant``:
the ``gemm_act_quant`` pass puts it in place of a W8A8 GEMM and ``act_and_mul_dynamic_quant``). The small-M GEMM (``small_m_gemm``) is no op either: launchers the W8A8 GEMMs call at
small M on CUDA, public for benchmarks; ``linear`` (bf16 / fp16) is the opaque op that runs it at decode sizes,
put in place of a compiled graph's GEMMs by the ``small_m_linear`` graph pass, and ``gated_linear`` the one that
runs its gated form (gate-up GEMM + SiLU-and-mul), put in place of that pair by the ``gated_linear`` pass;
``rope_linear`` the QKV GEMM with the rotary embedding of q and k in its epilogue (the ``rope_linear`` pass);
``norm_linear`` a residual add, its RMSNorm and the linear layer after it in one GEMV at one token (the
``norm_linear`` pass);
``quant_gemm``'s ``static_quant_scaled_mm`` a W8A8 GEMM that quantizes its activation as it loads it (the
``quant_gemm`` pass).
"""

from .triton_utils import HAS_TRITON
from .custom_op import CustomOp, OpStatus, enabled_custom_ops, parse_custom_ops, uses_inductor
from .act_quant import (
    act_and_mul_dynamic_quant,
    act_and_mul_dynamic_quant_ref,
    act_and_mul_static_quant,
    act_and_mul_static_quant_ref,
)
from .gelu_and_mul import GeluAndMul, gelu_and_mul, gelu_and_mul_ref
from .gated_quant import (gated_scaled_mm_dynamic_quant, gated_scaled_mm_dynamic_quant_ref, gated_scaled_mm_static_quant,
                          gated_scaled_mm_static_quant_ref)
from .norm_quant import (
    QUANT_DTYPES,
    fused_add_rms_norm_dynamic_quant,
    fused_add_rms_norm_dynamic_quant_ref,
    fused_add_rms_norm_static_quant,
    fused_add_rms_norm_static_quant_ref,
    rms_norm_dynamic_quant,
    rms_norm_dynamic_quant_ref,
    rms_norm_static_quant,
    rms_norm_static_quant_ref,
)
from .kv_quant import FP8_KV_DTYPE, KV_CACHE_DTYPES, KVScales, cache_dtype, quantize_kv_ref
from .paged_attention import (
    decode_num_splits,
    paged_decode,
    paged_decode_ref,
    paged_decode_triton,
    write_kv_cache,
    write_kv_cache_ref,
    write_kv_cache_triton,
)
from .paged_prefill import PrefillConfig, paged_prefill, paged_prefill_ref, paged_prefill_triton, prefill_config
from .quant_fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    QuantFP8,
    dynamic_per_token_scaled_fp8_quant,
    dynamic_per_token_scaled_fp8_quant_ref,
    dynamic_scaled_fp8_quant,
    dynamic_scaled_fp8_quant_ref,
    static_scaled_fp8_quant,
    static_scaled_fp8_quant_ref,
)
from .quant_int8 import (
    INT8_MAX,
    INT8_MIN_SCALE,
    QuantInt8,
    dynamic_scaled_int8_quant,
    dynamic_scaled_int8_quant_ref,
    static_scaled_int8_quant,
    static_scaled_int8_quant_ref,
)
from .rms_norm import (
    GemmaRMSNorm,
    RMSNorm,
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    gemma_fused_add_rms_norm,
    gemma_rms_norm,
    rms_norm,
    rms_norm_ref,
)
from .rotary_embedding import (RotaryEmbedding, compute_cos_sin_cache, rotary_embedding, rotary_embedding_native,
                               rotary_embedding_ref)
from .scaled_mm import (
    FP8_MM_ALIGN,
    INT8_MM_ALIGN,
    INT8_MM_MAX_K,
    fp8_scaled_mm,
    fp8_scaled_mm_ref,
    int8_scaled_mm,
    int8_scaled_mm_ref,
)
from .linear import LINEAR_DTYPES, linear, linear_uses_small_m
from .gated_linear import GATED_LINEAR_DTYPES, gated_linear, gated_linear_ref, gated_linear_uses_small_m
from .rope_linear import ROPE_LINEAR_DTYPES, rope_linear, rope_linear_ref, rope_linear_uses_small_m
from .norm_linear import NORM_LINEAR_DTYPES, norm_linear, norm_linear_ref, norm_linear_uses_small_m
from .quant_gemm import QUANT_GEMM_X_DTYPES, static_quant_scaled_mm, static_quant_scaled_mm_ref
from .silu_and_mul import SiluAndMul, silu_and_mul, silu_and_mul_ref
from .small_m_gemm import SMALL_M_MAX, SmallMConfig, small_m_config, small_m_mm, small_m_scaled_mm

#: every op registered under ``torch.ops.dynamo_once``
TORCH_OP_NAMES = (
    "rms_norm",
    "gemma_rms_norm",
    "fused_add_rms_norm",
    "gemma_fused_add_rms_norm",
    "silu_and_mul",
    "gelu_and_mul",
    "rotary_embedding",
    "static_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "dynamic_per_token_scaled_fp8_quant",
    "static_scaled_int8_quant",
    "dynamic_scaled_int8_quant",
    "fp8_scaled_mm",
    "int8_scaled_mm",
    "linear",
    "gated_linear",
    "rope_linear",
    "norm_linear",
    "write_kv_cache",
    "paged_decode",
    "paged_prefill",
    "rms_norm_static_quant",
    "rms_norm_dynamic_quant",
    "fused_add_rms_norm_static_quant",
    "fused_add_rms_norm_dynamic_quant",
    "act_and_mul_static_quant",
    "act_and_mul_dynamic_quant",
    "gated_scaled_mm_static_quant",
    "gated_scaled_mm_dynamic_quant",
    "static_quant_scaled_mm",
)

__all__ = [
    "HAS_TRITON",
    "TORCH_OP_NAMES",
    "CustomOp",
    "OpStatus",
    "enabled_custom_ops",
    "parse_custom_ops",
    "uses_inductor",
    "rms_norm",
    "gemma_rms_norm",
    "fused_add_rms_norm",
    "gemma_fused_add_rms_norm",
    "silu_and_mul",
    "gelu_and_mul",
    "rotary_embedding",
    "compute_cos_sin_cache",
    "static_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "dynamic_per_token_scaled_fp8_quant",
    "static_scaled_int8_quant",
    "dynamic_scaled_int8_quant",
    "fp8_scaled_mm",
    "int8_scaled_mm",
    "linear",
    "linear_uses_small_m",
    "LINEAR_DTYPES",
    "gated_linear",
    "gated_linear_uses_small_m",
    "GATED_LINEAR_DTYPES",
    "rope_linear",
    "rope_linear_uses_small_m",
    "ROPE_LINEAR_DTYPES",
    "norm_linear",
    "norm_linear_uses_small_m",
    "NORM_LINEAR_DTYPES",
    "small_m_scaled_mm",
    "small_m_mm",
    "small_m_config",
    "SmallMConfig",
    "SMALL_M_MAX",
    "write_kv_cache",
    "paged_decode",
    "write_kv_cache_triton",
    "paged_decode_triton",
    "decode_num_splits",
    "paged_prefill",
    "paged_prefill_triton",
    "prefill_config",
    "PrefillConfig",
    "rms_norm_static_quant",
    "rms_norm_dynamic_quant",
    "fused_add_rms_norm_static_quant",
    "fused_add_rms_norm_dynamic_quant",
    "act_and_mul_static_quant",
    "act_and_mul_dynamic_quant",
    "gated_scaled_mm_static_quant",
    "gated_scaled_mm_dynamic_quant",
    "static_quant_scaled_mm",
    "QUANT_GEMM_X_DTYPES",
    "RMSNorm",
    "GemmaRMSNorm",
    "SiluAndMul",
    "GeluAndMul",
    "RotaryEmbedding",
    "QuantFP8",
    "QuantInt8",
    "rms_norm_ref",
    "fused_add_rms_norm_ref",
    "silu_and_mul_ref",
    "gelu_and_mul_ref",
    "rotary_embedding_native",
    "rotary_embedding_ref",
    "static_scaled_fp8_quant_ref",
    "dynamic_scaled_fp8_quant_ref",
    "dynamic_per_token_scaled_fp8_quant_ref",
    "static_scaled_int8_quant_ref",
    "dynamic_scaled_int8_quant_ref",
    "fp8_scaled_mm_ref",
    "int8_scaled_mm_ref",
    "write_kv_cache_ref",
    "paged_decode_ref",
    "paged_prefill_ref",
    "rms_norm_static_quant_ref",
    "rms_norm_dynamic_quant_ref",
    "fused_add_rms_norm_static_quant_ref",
    "fused_add_rms_norm_dynamic_quant_ref",
    "act_and_mul_static_quant_ref",
    "act_and_mul_dynamic_quant_ref",
    "gated_scaled_mm_static_quant_ref",
    "gated_linear_ref",
    "rope_linear_ref",
    "norm_linear_ref",
    "gated_scaled_mm_dynamic_quant_ref",
    "static_quant_scaled_mm_ref",
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_KV_DTYPE",
    "KV_CACHE_DTYPES",
    "KVScales",
    "cache_dtype",
    "quantize_kv_ref",
    "MIN_SCALE",
    "INT8_MAX",
    "INT8_MIN_SCALE",
    "FP8_MM_ALIGN",
    "INT8_MM_ALIGN",
    "INT8_MM_MAX_K",
    "QUANT_DTYPES",
]
