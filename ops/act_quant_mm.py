"""A W8A8 linear layer's input quantization fused into its GEMM: ``scaled_mm(quant(act(x)), w)`` in one op.

Definition (:func:`act_quant_scaled_mm_ref`): the unfused sequence a W8A8 model runs with a static per-tensor
input scale,

- ``act="none"``: ``ops.static_scaled_fp8_quant`` / ``ops.static_scaled_int8_quant`` of ``x``, then
  ``ops.fp8_scaled_mm`` / ``ops.int8_scaled_mm`` with that scale as ``a_scale``;
- ``act="silu"``: the same of ``ops.act_and_mul_static_quant(x, scale, "silu", ...)`` (SiLU-and-mul rounded to
  ``x.dtype``, then quantized): the input of a gated MLP's down projection.

On CUDA, where the small-M GEMM takes the shape (``ops.small_m_gemm.small_m_config``: fp8 down_proj at M <= 16,
int8 up to M = 128), each program quantizes the rows it reads as it streams its weights
(``small_m_act_quant_scaled_mm``): the quantized activation never goes through memory and its kernel launch is
gone. The arithmetic is the unfused Triton kernels', statement for statement, so the values are theirs. Elsewhere
(cuBLAS's shapes, larger M) the op runs the unfused ops. The graph pass ``act_quant_gemm``
(``dispatcher.passes``) puts it in place of the unfused pair.
"""

from __future__ import annotations

import torch

from .act_quant import act_and_mul_static_quant, act_and_mul_static_quant_ref
from .quant_fp8 import static_scaled_fp8_quant, static_scaled_fp8_quant_ref
from .quant_int8 import static_scaled_int8_quant, static_scaled_int8_quant_ref
from .scaled_mm import (fp8_scaled_mm, fp8_scaled_mm_ref, int8_scaled_mm, int8_scaled_mm_ref, small_m_path)
from .small_m_gemm import A_PROLOGUES, small_m_act_quant_scaled_mm

__all__ = ["act_quant_scaled_mm", "act_quant_scaled_mm_ref", "ACT_QUANT_ACTS"]

#: The activations the op applies before the quantization.
ACT_QUANT_ACTS = tuple(A_PROLOGUES)
_W_DTYPES = (torch.float8_e4m3fn, torch.int8)


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, act: str) -> None:
    """The op's own arguments (the GEMM's are checked by the scaled_mm op it calls or mirrors)."""
    op = "act_quant_scaled_mm"
    if act not in ACT_QUANT_ACTS:
        raise ValueError(f"{op}: act must be one of {ACT_QUANT_ACTS}; got {act!r}")
    if w.dtype not in _W_DTYPES:
        raise TypeError(f"{op}: w must be float8_e4m3fn or int8; got {w.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{op}: x must be bf16, fp16 or fp32; got {x.dtype}")
    if scale.dtype != torch.float32 or scale.numel() != 1:
        raise ValueError(f"{op}: scale must be one fp32 element (a static per-tensor scale); got {scale.dtype} "
                         f"{list(scale.shape)}")
    k = w.shape[-1] * (2 if act == "silu" else 1)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{op}: x must be [M, {k}] for w [N, K] = {list(w.shape)} and act {act!r}; "
                         f"got {list(x.shape)}")


def _quantize(x: torch.Tensor, scale: torch.Tensor, act: str, quant_dtype: torch.dtype, ref: bool) -> torch.Tensor:
    """The unfused quantization: the library's Triton ops, or (``ref``) their references."""
    if act == "silu":
        fn = act_and_mul_static_quant_ref if ref else act_and_mul_static_quant
        return fn(x, scale, "silu", quant_dtype)
    if quant_dtype == torch.int8:
        return (static_scaled_int8_quant_ref if ref else static_scaled_int8_quant)(x, scale)
    return (static_scaled_fp8_quant_ref if ref else static_scaled_fp8_quant)(x, scale)


def act_quant_scaled_mm_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype, bias: torch.Tensor | None = None, act: str = "none") -> torch.Tensor:
    """The reference: the unfused references (see the module docstring)."""
    q = _quantize(x, scale, act, w.dtype, ref=True)
    mm = int8_scaled_mm_ref if w.dtype == torch.int8 else fp8_scaled_mm_ref
    return mm(q, w, scale.reshape(1), w_scale, out_dtype, bias)


@torch.library.custom_op("dynamo_once::act_quant_scaled_mm", mutates_args=())
def _act_quant_scaled_mm_op(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    _check(x, w, scale, act)
    if x.device.type != "cuda":
        return act_quant_scaled_mm_ref(x, w, scale, w_scale, out_dtype, bias, act)
    k = w.shape[1]
    if x.dtype != torch.float32 and small_m_path(x.shape[0], w.shape[0], k, w.dtype, x.device) is not None:
        return small_m_act_quant_scaled_mm(x, w, scale, w_scale, out_dtype, bias, act)
    q = _quantize(x, scale, act, w.dtype, ref=False)
    mm = int8_scaled_mm if w.dtype == torch.int8 else fp8_scaled_mm
    return mm(q, w, scale.reshape(1), w_scale, out_dtype, bias)


@_act_quant_scaled_mm_op.register_fake
def _act_quant_scaled_mm_fake(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                              out_dtype: torch.dtype, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    _check(x, w, scale, act)
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


def act_quant_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                        out_dtype: torch.dtype, bias: torch.Tensor | None = None, act: str = "none") -> torch.Tensor:
    """``scaled_mm(quant(act(x), scale), w, scale, w_scale)``: ``[M, N]`` in ``out_dtype``.

    Args:
        x: the model-dtype activation, ``[M, K]`` (``act="none"``) or ``[M, 2K]`` (``"silu"``: gate, then up).
        w: ``float8_e4m3fn`` or ``int8 [N, K]``; its dtype is the quantization's.
        scale: fp32, one element: the static per-tensor input scale (quantization and GEMM epilogue).
        w_scale: fp32 ``[1]`` or ``[N]``; out_dtype, bias: as for ``ops.fp8_scaled_mm``.
        act: one of :data:`ACT_QUANT_ACTS`.
    Raises:
        TypeError / ValueError naming the argument.
    """
    return torch.ops.dynamo_once.act_quant_scaled_mm(x, w, scale, w_scale, out_dtype, bias, act)
