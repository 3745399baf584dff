"""``ActQuantGemmPass`` (``act_quant_gemm``): a static input quantization fused into the W8A8 GEMM that reads it.

A W8A8 linear layer with a static per-tensor input scale quantizes its input in an op of its own and passes the
same scale to its GEMM. Where nothing fused the quantization into the op before it (o_proj's input is the
attention's output), or where that fusion still writes the quantized tensor for the GEMM to read back (the down
projection's ``act_and_mul_static_quant``, from pass ``act_quant``), this pass gives the pair to one op,
``dynamo_once::act_quant_scaled_mm``, whose small-M kernel quantizes the rows as it streams the weights:

- ``fp8_scaled_mm(static_scaled_fp8_quant(x, s), w, s, ws, dtype, bias)`` (and int8's) -> ``act="none"``;
- ``fp8_scaled_mm(act_and_mul_static_quant(x, s, "silu", fp8), w, s, ws, dtype, bias)`` (and int8's) ->
  ``act="silu"``.

The quantization must use the scale the GEMM's epilogue multiplies by (the same graph node) and have no other
user. The op keeps the unfused ops' values and runs them itself where its kernel does not take the shape, so
the rewrite is valid at every size. Like the other quantization passes it matches the library's ops as called:
with it on, a compile keeps the Triton ops opaque (``GraphPass.opaque_ops``). Per-token (dynamic) scales are
not matched: a row's scale needs its amax first, which no GEMM program that reads a K slice has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .fused_add_rms_norm import dynamo_once_op
from .quant_fusion import _QuantFusionPass

__all__ = ["ActQuantGemmPass"]

#: (GEMM op, its quantized dtype, the static quantization op)
_GEMMS = (("fp8_scaled_mm", torch.float8_e4m3fn, "static_scaled_fp8_quant"),
          ("int8_scaled_mm", torch.int8, "static_scaled_int8_quant"))
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the model dtype: x's and the output's


def _examples(act: str, qdtype: torch.dtype, out_dtype: torch.dtype, bias: bool) -> list[torch.Tensor]:
    """Inputs the ops accept (they check dtypes while the pattern is traced): x, scale, w, w_scale[, bias]."""
    x = torch.zeros(4, 32 if act == "silu" else 16, dtype=out_dtype)
    w = torch.zeros(16, 16).to(qdtype)
    out = [x, torch.ones(1), w, torch.ones(1)]
    return out + [torch.zeros(16, dtype=out_dtype)] if bias else out


def _pattern(mm: Any, quant: Callable, fused: Any, act: str, out_dtype: torch.dtype,
             bias: bool) -> tuple[Callable, Callable]:
    if bias:
        def search(x, scale, w, w_scale, b):
            return mm(quant(x, scale), w, scale, w_scale, out_dtype, b)

        def replace(x, scale, w, w_scale, b):
            return fused(x, w, scale, w_scale, out_dtype, b, act)

        return search, replace

    def search(x, scale, w, w_scale):
        return mm(quant(x, scale), w, scale, w_scale, out_dtype, None)

    def replace(x, scale, w, w_scale):
        return fused(x, w, scale, w_scale, out_dtype, None, act)

    return search, replace


class ActQuantGemmPass(_QuantFusionPass):
    """Static quantization (alone, or SiLU-and-mul + quantization) + W8A8 GEMM -> ``act_quant_scaled_mm``."""

    name = "act_quant_gemm"
    required = ("act_quant_scaled_mm",)

    def pattern_functions(self) -> list[tuple[Callable, Callable, list]]:
        fused, act_quant = dynamo_once_op("act_quant_scaled_mm"), dynamo_once_op("act_and_mul_static_quant")
        out = []
        for mm_name, qdtype, quant_name in _GEMMS:
            mm, quant = dynamo_once_op(mm_name), dynamo_once_op(quant_name)
            if mm is None:
                continue
            quants = {"none": quant}
            if act_quant is not None:
                quants["silu"] = lambda x, scale, qd=qdtype: act_quant(x, scale, "silu", qd)
            for act, q in quants.items():
                if q is None:
                    continue
                for out_dtype in _OUT_DTYPES:
                    for bias in (False, True):
                        search, replace = _pattern(mm, q, fused, act, out_dtype, bias)
                        out.append((search, replace, _examples(act, qdtype, out_dtype, bias)))
        return out
