"""The gate-up GEMM fused with the activation and per-token quantization after it (``gemm_act_quant``).

In a W8A8 MLP the gate-up projection's output (``[T, 2D]`` in the model's dtype) is read once, by the activation
and its per-token quantization, which ``act_quant`` has made one op by the time this pass runs:
``act_and_mul_dynamic_quant(scaled_mm(a, w, a_scale, w_scale, out_dtype), "silu", quant_dtype)`` with the GEMM
an ``int8_scaled_mm`` or ``fp8_scaled_mm`` without bias. This pass puts ``dynamo_once::gated_scaled_mm_dynamic_quant``
in its place: the small-M GEMM computes SiLU(gate) * up and each row's partial amax in its epilogue, and one
kernel quantizes (``ops.gated_quant``); at an M the small-M table leaves to cuBLAS the op runs the pair it
replaced. The values are the pair's.

It matches what ``act_quant`` produces (with the custom ops on or off), so it does nothing unless ``act_quant``
runs too. The GEMM's output must have no other user (the pattern matcher requires it of a pattern's inner nodes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .fused_add_rms_norm import dynamo_once_op
from .quant_fusion import QuantFusionPass

__all__ = ["GemmActQuantPass"]

_GEMMS = (("int8_scaled_mm", torch.int8), ("fp8_scaled_mm", torch.float8_e4m3fn))
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def _patterns(gemm: Any, act_quant: Any, fused: Any, operand: torch.dtype, out_dtype: torch.dtype,
              quant_dtype: torch.dtype) -> tuple[Callable, Callable, list]:
    def search(a, w, a_scale, w_scale):
        out = act_quant(gemm(a, w, a_scale, w_scale, out_dtype, None), "silu", quant_dtype)
        return out[0], out[1]

    def replace(a, w, a_scale, w_scale):
        out = fused(a, w, a_scale, w_scale, out_dtype, "silu", quant_dtype)
        return out[0], out[1]

    # per-token activation scales, per-channel weight scales: an opaque op's node matches any layout
    example = [torch.zeros(4, 32).to(operand), torch.zeros(64, 32).to(operand), torch.ones(4, 1), torch.ones(64)]
    return search, replace, example


class GemmActQuantPass(QuantFusionPass):
    """W8A8 gate-up GEMM + ``act_and_mul_dynamic_quant`` (SiLU) -> ``gated_scaled_mm_dynamic_quant``."""

    name = "gemm_act_quant"
    required = ("act_and_mul_dynamic_quant", "gated_scaled_mm_dynamic_quant")

    def pattern_functions(self) -> list[tuple[Callable, Callable, list]]:
        act_quant, fused = dynamo_once_op("act_and_mul_dynamic_quant"), dynamo_once_op("gated_scaled_mm_dynamic_quant")
        out = []
        for gemm_name, operand in _GEMMS:
            gemm = dynamo_once_op(gemm_name)
            if gemm is None:
                continue
            for out_dtype in _OUT_DTYPES:
                for quant_dtype in _QUANT_DTYPES:
                    out.append(_patterns(gemm, act_quant, fused, operand, out_dtype, quant_dtype))
        return out
