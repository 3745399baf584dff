"""A W8A8 GEMM that quantizes its activation itself: ``static_quant_scaled_mm(x, w, scale, w_scale, out_dtype, bias)``
= ``scaled_mm(static_scaled_quant(x, scale), w, scale, w_scale, out_dtype, bias)``, with a per-tensor ``scale``.

A quantized Llama's o projection reads the attention's output, which nothing before it can quantize: the attention
op is opaque, and in a level-3 graph it ends the piece before, so the quantization is a kernel of its own in the
next piece (Inductor's, or ``ops.static_scaled_fp8_quant``'s), 32 launches a decode step of the 8B. At one token,
with fp8 weights, the small-M GEMV (``ops.small_m_gemm``, its QUANT_A form) quantizes each element of ``x`` as it
loads it instead: one kernel. The ``quant_gemm`` graph pass puts this op in place of such a pair (fp8).

Values: those of the two ops, bit for bit where the GEMM's kernel is the same: the quantization is
``ops.static_scaled_{fp8,int8}_quant``'s arithmetic, and the GEMV sums the same products in the same order as on the
quantized tensor. Where the fused form does not apply (not CUDA, int8 weights, more than one token, a shape the
small-M table leaves to cuBLAS, ``DYNAMO_ONCE_SMALL_M_GEMM=0``) the op runs the quantization op, then the GEMM op.

Arguments: ``x`` bf16 / fp16 / fp32 ``[M, K]``; ``w`` ``float8_e4m3fn`` or ``int8`` ``[N, K]`` (nn.Linear's layout);
``scale`` fp32, one element (``[1]`` or 0-d), the activation's and the epilogue's; ``w_scale`` fp32 ``[1]`` or ``[N]``;
``out_dtype`` bf16, fp16 or fp32; ``bias`` None or ``[N]`` in ``out_dtype``. K and N as the GEMM ops require.
"""

from __future__ import annotations

import torch

from dispatcher import envs

from .quant_fp8 import static_scaled_fp8_quant, static_scaled_fp8_quant_ref
from .quant_int8 import static_scaled_int8_quant, static_scaled_int8_quant_ref
from .scaled_mm import (FP8_MM_ALIGN, INT8_MM_ALIGN, cuda_at_least, fp8_scaled_mm, fp8_scaled_mm_ref, int8_scaled_mm,
                        int8_scaled_mm_ref)
from .small_m_gemm import small_m_config, small_m_operands, small_m_quant_scaled_mm
from .triton_utils import HAS_TRITON

__all__ = ["static_quant_scaled_mm", "static_quant_scaled_mm_ref", "QUANT_GEMM_X_DTYPES"]

#: The activation dtypes the op quantizes.
QUANT_GEMM_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# w's dtype -> (quantization op, its reference, GEMM op, its reference, K / N alignment, compute capability)
_GEMMS = {
    torch.float8_e4m3fn: (static_scaled_fp8_quant, static_scaled_fp8_quant_ref, fp8_scaled_mm, fp8_scaled_mm_ref,
                          FP8_MM_ALIGN, (8, 9)),
    torch.int8: (static_scaled_int8_quant, static_scaled_int8_quant_ref, int8_scaled_mm, int8_scaled_mm_ref,
                 INT8_MM_ALIGN, (8, 0)),
}
_OP = "static_quant_scaled_mm"


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
           bias: torch.Tensor | None) -> None:
    """TypeError / ValueError naming the argument, what it expects and what it got; dtypes, ranks and static sizes
    only (no guard on a symbolic M)."""
    if w.dtype not in _GEMMS:
        raise TypeError(f"{_OP}: w must be torch.float8_e4m3fn or torch.int8; got {w.dtype}")
    if x.dtype not in QUANT_GEMM_X_DTYPES:
        raise TypeError(f"{_OP}: x must be one of {QUANT_GEMM_X_DTYPES}; got {x.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{_OP}: x must be [M, K] and w [N, K] with the same K; got {list(x.shape)} and "
                         f"{list(w.shape)}")
    align = _GEMMS[w.dtype][4]
    for name, size in (("K (x.shape[1], w.shape[1])", w.shape[1]), ("N (w.shape[0])", w.shape[0])):
        if size % align:
            raise ValueError(f"{_OP}: {name} must be a multiple of {align}; got {size}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"{_OP}: scale must be fp32 with one element ([1] or 0-d); got {scale.dtype} of shape "
                         f"{list(scale.shape)}")
    if w_scale.dtype != torch.float32 or w_scale.dim() != 1 or w_scale.shape[0] not in (1, w.shape[0]):
        raise ValueError(f"{_OP}: w_scale must be fp32 [1] or [N] = [{w.shape[0]}]; got {w_scale.dtype} of shape "
                         f"{list(w_scale.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{_OP}: out_dtype must be torch.bfloat16, torch.float16 or torch.float32; got {out_dtype}")
    if bias is not None and (bias.dtype != out_dtype or bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        raise ValueError(f"{_OP}: bias must be [N] = [{w.shape[0]}] in out_dtype {out_dtype}; got {bias.dtype} of "
                         f"shape {list(bias.shape)}")
    for name, t in (("w", w), ("scale", scale), ("w_scale", w_scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{_OP}: {name} must be on x's device {x.device}; got {t.device}")


def _fused_config(x: torch.Tensor, w: torch.Tensor):
    """The unrolled GEMV's config where the fused form runs (fp8 weights, one token, a table row for the shape, on
    CUDA with Triton, ``DYNAMO_ONCE_SMALL_M_GEMM`` on), else None.

    Not for int8: its GEMV takes 0.81 SASS instructions a weight element on the 8B's o_proj tile (dp4a, four products
    an instruction), 8.16 quantizing as it loads (``results/gemv_instructions_quant.md``): more than the quantization
    kernel it saves would cost. fp8's goes from 3.97 to 7.31 there, about what an SM can issue at HBM speed."""
    if not (HAS_TRITON and w.dtype == torch.float8_e4m3fn and small_m_operands(x, w, max_m=1) and envs.small_m_gemm()):
        return None
    config = small_m_config(1, w.shape[0], w.shape[1], w.dtype, max_m=1)
    return config if config is not None and config.UNROLL else None


@torch.library.custom_op("dynamo_once::static_quant_scaled_mm", mutates_args=())
def _static_quant_scaled_mm_op(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, w, scale, w_scale, out_dtype, bias)
    quant, _, gemm, _, _, capability = _GEMMS[w.dtype]
    if not cuda_at_least(x, capability):
        return static_quant_scaled_mm_ref(x, w, scale, w_scale, out_dtype, bias)
    scale = scale.reshape(1)
    config = _fused_config(x, w)
    if config is not None:
        return small_m_quant_scaled_mm(x, w, scale, w_scale, out_dtype, bias, config)
    return gemm(quant(x, scale), w, scale, w_scale, out_dtype, bias)


@_static_quant_scaled_mm_op.register_fake
def _static_quant_scaled_mm_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                                 out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, w, scale, w_scale, out_dtype, bias)
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


def static_quant_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                           out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype``: ``x`` quantized to ``w``'s dtype with the per-tensor ``scale``, then the W8A8 GEMM
    with ``scale`` and ``w_scale``; at one token on CUDA one kernel (see the module docstring)."""
    return torch.ops.dynamo_once.static_quant_scaled_mm(x, w, scale, w_scale, out_dtype, bias)


def static_quant_scaled_mm_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                               out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: the static quantization's reference, then the GEMM's."""
    _, quant_ref, _, gemm_ref, _, _ = _GEMMS[w.dtype]
    scale = scale.reshape(1)
    return gemm_ref(quant_ref(x, scale), w, scale, w_scale, out_dtype, bias)
