"""A W8A8 gate-up projection, its gated activation and the quantization of the result, fused:
``(q, scale) = act_and_mul_dynamic_quant(scaled_mm(a, w, a_scale, w_scale, out_dtype), act, quant_dtype)`` (per
token), ``q = act_and_mul_static_quant(scaled_mm(...), scale, act, quant_dtype)`` (per tensor).

In a quantized Llama MLP the gate-up GEMM writes ``[T, 2D]`` in the model's dtype, an activation kernel reads it
and writes ``[T, D]``, and the per-token quantization for the down projection reads that again to find each
row's amax before it can quantize (Inductor: a split reduction and a pointwise pass, three launches a layer).
Here the small-M GEMM (``ops.small_m_gemm``, gated form) computes SiLU(gate) * up in its epilogue, each program
holding the gate and the up rows of its output columns, and stores each row's amax over its tile; one more
kernel takes each row's amax over the tiles' and quantizes. Two launches, and the ``[T, 2D]`` output is never
written. With a per-tensor scale the epilogue quantizes too: one launch.

Values: those of the unfused ops, bit for bit where the GEMM is (int8: always; fp8: the GEMM's fp32 sums in
another order than cuBLAS's): the GEMM's output rounded to ``out_dtype``, the activation in fp32 as
``ops.silu_and_mul`` computes it, rounded to ``out_dtype``, then ``ops.act_and_mul_dynamic_quant``'s
quantization. Where the fused form does not apply (not CUDA, an M the small-M table leaves to cuBLAS, an
activation other than SiLU) the op runs the unfused ops, which compute the same values.
"""

from __future__ import annotations

from typing import Any

import torch

from .act_quant import ACTIVATIONS, act_and_mul_dynamic_quant, act_and_mul_dynamic_quant_ref, \
    act_and_mul_static_quant, act_and_mul_static_quant_ref
from .norm_quant import check_quant_dtype
from .quant_fp8 import MIN_SCALE, quantize_by_scale
from .quant_int8 import INT8_MIN_SCALE
from .scaled_mm import FP8_MM_ALIGN, INT8_MM_ALIGN, check_args, cuda_at_least, fp8_scaled_mm, fp8_scaled_mm_ref, \
    int8_scaled_mm, int8_scaled_mm_ref
from .small_m_gemm import gated_runtime_config, small_m_gated_scaled_mm
from .triton_utils import cdiv, next_power_of_2, pdl_args, tl, triton

__all__ = ["gated_scaled_mm_dynamic_quant", "gated_scaled_mm_dynamic_quant_ref", "gated_scaled_mm_static_quant",
           "gated_scaled_mm_static_quant_ref", "launch_gated_quant", "GATED_QUANT_BLOCK"]

#: Output columns a program of the quantization kernel (a row's are split over ``D / GATED_QUANT_BLOCK`` programs).
GATED_QUANT_BLOCK = 1024
# A row's tile amaxes read in one load up to this many (the 8B's gate-up at M = 1: 3584, one a GEMV program).
_MAX_BLOCK_P = 4096
#: (GEMM op, its reference, K / N alignment, least compute capability of its CUDA path) by operand dtype
_GEMMS = {torch.float8_e4m3fn: (fp8_scaled_mm, fp8_scaled_mm_ref, FP8_MM_ALIGN, (8, 9)),
          torch.int8: (int8_scaled_mm, int8_scaled_mm_ref, INT8_MM_ALIGN, (8, 0))}


@triton.jit
def _gated_quant_kernel(
    h_ptr, amax_ptr, q_ptr, scale_ptr, D, BLOCKS, MIN_S: tl.constexpr, INT8: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, PDL: tl.constexpr,
):
    # Program (row, column block): the row's amax over its tiles' (amax_ptr [M, BLOCKS]), its scale, and the
    # quantization of BLOCK_D of its D columns, in ops.act_quant's arithmetic (the correctly rounded quotient).
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the GEMM, then let the next kernel launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    amax = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for p in range(0, BLOCKS, BLOCK_P):
        offs = p + tl.arange(0, BLOCK_P)
        amax = tl.maximum(amax, tl.load(amax_ptr + row * BLOCKS + offs, mask=offs < BLOCKS, other=0.0))
    scale = tl.maximum(tl.div_rn(tl.max(amax, axis=0), 127.0 if INT8 else 448.0), MIN_S)
    if tl.program_id(1) == 0:
        tl.store(scale_ptr + row, scale)
    mask = cols < D
    y = tl.load(h_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    q = quantize_by_scale(y, scale, q_ptr.dtype.element_ty, False)
    tl.store(q_ptr + row * D + cols, q, mask=mask)


def launch_gated_quant(h: torch.Tensor, amax: torch.Tensor,
                       quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``h [M, D]`` quantized per token, each row's amax the max of its ``amax [M, blocks]`` (the
    gated GEMM's per-tile amax: ``ops.small_m_gemm.small_m_gated_scaled_mm``). An eager launcher (CUDA graphs
    too); the op calls it, and benchmarks do."""
    m, d = h.shape
    q = torch.empty((m, d), dtype=quant_dtype, device=h.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=h.device)
    if m == 0:
        return q, scale
    blocks = amax.shape[1]
    int8 = quant_dtype == torch.int8
    _gated_quant_kernel[(m, cdiv(d, GATED_QUANT_BLOCK))](
        h, amax, q, scale, d, blocks, MIN_S=INT8_MIN_SCALE if int8 else MIN_SCALE, INT8=int8,
        BLOCK_D=GATED_QUANT_BLOCK, BLOCK_P=min(_MAX_BLOCK_P, next_power_of_2(blocks)), num_warps=4,
        **pdl_args(None, h, m * d),
    )
    return q, scale


def _check(op: str, a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
           out_dtype: torch.dtype, act: str, quant_dtype: torch.dtype) -> None:
    if a.dtype not in _GEMMS:
        raise TypeError(f"{op}: a must be torch.float8_e4m3fn or torch.int8; got {a.dtype}")
    check_args(op, a.dtype, _GEMMS[a.dtype][2], a, w, a_scale, w_scale, out_dtype, None)
    if w.shape[0] % (2 * _GEMMS[a.dtype][2]) != 0:
        raise ValueError(f"{op}: w must be [gate; up], [2D, K] with D a multiple of {_GEMMS[a.dtype][2]}; got shape "
                         f"{list(w.shape)}")
    if act not in ACTIVATIONS:
        raise ValueError(f"{op}: act must be one of {tuple(ACTIVATIONS)}; got {act!r}")
    check_quant_dtype(op, quant_dtype)


def _gated_path(a: torch.Tensor, w: torch.Tensor, act: str) -> tuple[bool, Any, Any]:
    """``(on_cuda, gemm op, gated config)``: off CUDA (or below the GEMM's capability) the references; on it the
    gated form's config, or None where it does not apply (an M ``small_m_gemm.GATED_ROWS`` leaves to the unfused
    pair, an activation not SiLU): the unfused ops, which compute the same values."""
    gemm, _, _, capability = _GEMMS[a.dtype]
    if not cuda_at_least(a, capability):
        return False, gemm, None
    return True, gemm, gated_runtime_config(a, w) if act == "silu" else None


@torch.library.custom_op("dynamo_once::gated_scaled_mm_dynamic_quant", mutates_args=())
def _gated_scaled_mm_dynamic_quant_op(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                                      out_dtype: torch.dtype, act: str,
                                      quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check("gated_scaled_mm_dynamic_quant", a, w, a_scale, w_scale, out_dtype, act, quant_dtype)
    on_cuda, gemm, config = _gated_path(a, w, act)
    if not on_cuda:
        return gated_scaled_mm_dynamic_quant_ref(a, w, a_scale, w_scale, out_dtype, act, quant_dtype)
    if config is None:
        return act_and_mul_dynamic_quant(gemm(a, w, a_scale, w_scale, out_dtype), act, quant_dtype)
    h, amax = small_m_gated_scaled_mm(a, w, a_scale, w_scale, out_dtype, config)
    return launch_gated_quant(h, amax, quant_dtype)


@_gated_scaled_mm_dynamic_quant_op.register_fake
def _gated_scaled_mm_dynamic_quant_fake(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor,
                                        w_scale: torch.Tensor, out_dtype: torch.dtype, act: str,
                                        quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check("gated_scaled_mm_dynamic_quant", a, w, a_scale, w_scale, out_dtype, act, quant_dtype)
    m, d = a.shape[0], w.shape[0] // 2
    return a.new_empty((m, d), dtype=quant_dtype), a.new_empty((m, 1), dtype=torch.float32)


def _check_static(a: torch.Tensor, scale: torch.Tensor) -> None:
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"gated_scaled_mm_static_quant: scale must be fp32 with one element ([1] or 0-d); got "
                         f"{scale.dtype} of shape {list(scale.shape)}")
    if scale.device != a.device:
        raise ValueError(f"gated_scaled_mm_static_quant: scale must be on a's device {a.device}; got {scale.device}")


@torch.library.custom_op("dynamo_once::gated_scaled_mm_static_quant", mutates_args=())
def _gated_scaled_mm_static_quant_op(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                                     out_dtype: torch.dtype, act: str, scale: torch.Tensor,
                                     quant_dtype: torch.dtype) -> torch.Tensor:
    _check("gated_scaled_mm_static_quant", a, w, a_scale, w_scale, out_dtype, act, quant_dtype)
    _check_static(a, scale)
    on_cuda, gemm, config = _gated_path(a, w, act)
    if not on_cuda:
        return gated_scaled_mm_static_quant_ref(a, w, a_scale, w_scale, out_dtype, act, scale, quant_dtype)
    if config is None:
        return act_and_mul_static_quant(gemm(a, w, a_scale, w_scale, out_dtype), scale, act, quant_dtype)
    return small_m_gated_scaled_mm(a, w, a_scale, w_scale, out_dtype, config, scale, quant_dtype)[0]


@_gated_scaled_mm_static_quant_op.register_fake
def _gated_scaled_mm_static_quant_fake(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor,
                                       w_scale: torch.Tensor, out_dtype: torch.dtype, act: str, scale: torch.Tensor,
                                       quant_dtype: torch.dtype) -> torch.Tensor:
    _check("gated_scaled_mm_static_quant", a, w, a_scale, w_scale, out_dtype, act, quant_dtype)
    _check_static(a, scale)
    return a.new_empty((a.shape[0], w.shape[0] // 2), dtype=quant_dtype)


def gated_scaled_mm_static_quant(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                                 out_dtype: torch.dtype, act: str, scale: torch.Tensor,
                                 quant_dtype: torch.dtype) -> torch.Tensor:
    """``q [M, D]`` of ``act_and_mul_static_quant(scaled_mm(a, w, a_scale, w_scale, out_dtype), scale, act,
    quant_dtype)``: :func:`gated_scaled_mm_dynamic_quant` with a per-tensor ``scale`` (fp32, one element), the
    quantization in the GEMM's epilogue (one kernel)."""
    return torch.ops.dynamo_once.gated_scaled_mm_static_quant(a, w, a_scale, w_scale, out_dtype, act, scale,
                                                              quant_dtype)


def gated_scaled_mm_static_quant_ref(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                                     out_dtype: torch.dtype, act: str, scale: torch.Tensor,
                                     quant_dtype: torch.dtype) -> torch.Tensor:
    """The definition: the GEMM's reference, then ``act_and_mul_static_quant``'s."""
    return act_and_mul_static_quant_ref(_GEMMS[a.dtype][1](a, w, a_scale, w_scale, out_dtype), scale, act,
                                        quant_dtype)


def gated_scaled_mm_dynamic_quant(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                                  out_dtype: torch.dtype, act: str,
                                  quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``act_and_mul_dynamic_quant(scaled_mm(a, w, a_scale, w_scale, out_dtype), act,
    quant_dtype)``, ``scaled_mm`` being ``ops.fp8_scaled_mm`` or ``ops.int8_scaled_mm`` by ``a``'s dtype.

    Args:
        a, w, a_scale, w_scale, out_dtype: as for that GEMM op (no bias); ``w`` is ``[gate; up]``, ``[2D, K]``.
        act: ``"silu"``, ``"gelu"`` or ``"gelu_tanh"`` (fused on CUDA for ``"silu"``; the others run unfused).
        quant_dtype: ``torch.float8_e4m3fn`` or ``torch.int8``.
    Returns:
        ``q [M, D]`` in ``quant_dtype`` and ``scale [M, 1]`` fp32, one a token.
    Raises:
        TypeError / ValueError naming the argument.
    """
    return torch.ops.dynamo_once.gated_scaled_mm_dynamic_quant(a, w, a_scale, w_scale, out_dtype, act, quant_dtype)


def gated_scaled_mm_dynamic_quant_ref(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                                      out_dtype: torch.dtype, act: str,
                                      quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: the GEMM's reference, then ``act_and_mul_dynamic_quant``'s."""
    return act_and_mul_dynamic_quant_ref(_GEMMS[a.dtype][1](a, w, a_scale, w_scale, out_dtype), act, quant_dtype)
