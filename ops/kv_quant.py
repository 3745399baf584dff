"""An fp8 paged KV cache: per-tensor scales, the write's rounding, the reads' dequantization.

A cache of dtype ``float8_e4m3fn`` holds ``k / k_scale`` and ``v / v_scale``
(one scale a layer and half, the compressed-tensors ``kv_cache_scheme``:
static, per tensor, symmetric), rounded to nearest even after clamping to
+-448. The kernels read a key tile as q's dtype and fold ``k_scale`` into the
softmax scale, and multiply each output by ``v_scale`` (a bf16 q and the tiles in
fp16 for the dots: :func:`dot_operand`); so a step reads one
byte an element, half of a bf16 cache. A cache of any other dtype stores the
values as they are and ignores the scales (their product with the stored
value would round to the same number).

The write multiplies by the scale's fp32 reciprocal (``inverse_scale``), in the
kernels and in :func:`quantize_kv_ref` alike, so both hold the same bits.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import torch

from .quant_fp8 import FP8_DTYPE, FP8_MAX
from .triton_utils import tl, triton

__all__ = ["FP8_KV_DTYPE", "KV_CACHE_DTYPES", "KVScales", "UNIT_KV_SCALES", "cache_dtype", "inverse_scale",
           "quantize_kv_ref"]

#: The cache dtype of ``kv_cache_dtype="fp8"``: the activations' fp8 (e4m3).
FP8_KV_DTYPE = FP8_DTYPE
#: What ``kv_cache_dtype`` accepts (vLLM's names): "auto" is the model's dtype (or the checkpoint's
#: ``kv_cache_scheme``); "fp8" and "fp8_e4m3" are :data:`FP8_KV_DTYPE`.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, checkpoint_fp8: bool = False) -> torch.dtype:
    """The cache tensors' dtype for ``kv_cache_dtype`` (see :data:`KV_CACHE_DTYPES`); ``checkpoint_fp8``: the
    checkpoint carries an fp8 ``kv_cache_scheme`` (scales calibrated for it), which "auto" follows."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return FP8_KV_DTYPE if checkpoint_fp8 else model_dtype
    return FP8_KV_DTYPE


def inverse_scale(scale: float) -> float:
    """``1 / scale`` rounded to fp32, as the kernels receive it (a Python float passed to an fp32 argument)."""
    if not 0 < scale < float("inf"):
        raise ValueError(f"a KV-cache scale must be positive and finite; got {scale}")
    return struct.unpack("f", struct.pack("f", 1.0 / scale))[0]


class KVScales(NamedTuple):
    """A layer's cache scales and their fp32 reciprocals, computed once (:meth:`of`), passed to every launch."""

    k_scale: float
    v_scale: float
    k_inv: float
    v_inv: float

    @classmethod
    def of(cls, k_scale: float = 1.0, v_scale: float = 1.0) -> KVScales:
        return cls(float(k_scale), float(v_scale), inverse_scale(k_scale), inverse_scale(v_scale))


#: Scales of a cache that stores values as they are (and of an fp8 cache without calibrated scales).
UNIT_KV_SCALES = KVScales(1.0, 1.0, 1.0, 1.0)


def quantize_kv_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``dtype`` stores it: ``clamp(x * inverse_scale(scale), +-448)`` rounded to fp8 for
    :data:`FP8_KV_DTYPE`, a plain cast for any other dtype."""
    if dtype != FP8_KV_DTYPE:
        return x.to(dtype)
    inv = torch.tensor(inverse_scale(scale), dtype=torch.float32, device=x.device)
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(dtype)


@triton.jit
def to_cache(x, inv_scale, cache_ptr):
    """``x`` in ``cache_ptr``'s element dtype, as :func:`quantize_kv_ref` rounds it (``inv_scale``: fp32)."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        y = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0).to(tl.float8e4nv)
    else:
        y = x.to(cache_ptr.dtype.element_ty)
    return y


@triton.jit
def f16_from_e4m3(x):
    """fp8 e4m3 ``x`` as fp16, four elements (one 32-bit word) a ``cvt`` pair: the instruction Triton's own
    conversion emits, but opaque (``is_pure=False``), so Triton cannot move it past a layout change: a value tile
    converted this way goes through shared memory (for the MMA's transposed operand) as fp16, where Triton's own
    conversion is moved after that round trip and the fp8 tile is gathered a byte at a time
    (``benchmarks.attention_instructions``). Not in Triton's interpreter (no inline assembly there)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def dot_operand(q, cache_ptr):
    """q as the attention's dot operand over ``cache_ptr``'s cache: fp16 where a bf16 q meets an fp8 cache (an fp8
    tile converts to fp16 in one instruction a pair, to bf16 only through fp32; fp16 holds every bf16 value of q's
    range to within its 10-bit mantissa, and the softmax's p in [0, 1] more finely than bf16), else unchanged."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:
        q = q.to(tl.float16)
    return q

