"""The gate-up GEMM fused with the activation and the quantization after it (``gemm_act_quant``).

In a W8A8 MLP the gate-up projection's output (``[T, 2D]`` in the model's dtype) is read once, by SiLU-and-mul,
whose output is quantized for the down projection. This pass puts one op in place of the three:
``dynamo_once::gated_scaled_mm_{static,dynamic}_quant``, whose small-M GEMM computes SiLU(gate) * up in its
epilogue and, per tensor, quantizes it there too (one kernel), or, per token, stores each row's partial amax for
one quantization kernel after it (``ops.gated_quant``). At an M past the gated form's range the op runs the
GEMM op and the activation's fused quant op. The values are the unfused sequence's.

Matched, with the GEMM an ``int8_scaled_mm`` or ``fp8_scaled_mm`` without bias whose output nothing else reads
(the pattern matcher requires it of a pattern's inner nodes), for bf16, fp16 and fp32 models:

- native code (the custom ops off, level 3's default): the GEMM, then the native forms of ``silu_and_mul`` and of a
  static or per-token quantization (``native_forms``: the functions the modules' native paths call);
- the library's ops (custom ops on): the GEMM, then ``act_and_mul_{static,dynamic}_quant``, what ``act_quant`` makes
  of SiLU-and-mul + quant (so with the custom ops on it needs ``act_quant`` too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .fused_add_rms_norm import dynamo_once_op
from .native_forms import native_form, native_forms_key
from .quant_fusion import QUANT_OPS, QuantFusionPass, QuantOp

__all__ = ["GemmActQuantPass"]

_GEMMS = (("int8_scaled_mm", torch.int8), ("fp8_scaled_mm", torch.float8_e4m3fn))
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _example(operand: torch.dtype, static: bool) -> list[torch.Tensor]:
    # per-token activation scales, per-channel weight scales: an opaque op's node matches any layout
    example = [torch.zeros(4, 32).to(operand), torch.zeros(64, 32).to(operand), torch.ones(4, 1), torch.ones(64)]
    return example + [torch.ones(1)] if static else example


def _patterns(gemm: Any, act_quant: Callable, fused: Any, operand: torch.dtype, out_dtype: torch.dtype,
              q: QuantOp) -> tuple[Callable, Callable, list]:
    """``act_quant(gemm output[, scale])`` (returning ``q``, or ``(q, scale)`` per token) -> the fused op."""
    if q.static:
        def search(a, w, a_scale, w_scale, scale):
            return act_quant(gemm(a, w, a_scale, w_scale, out_dtype, None), scale)

        def replace(a, w, a_scale, w_scale, scale):
            return fused(a, w, a_scale, w_scale, out_dtype, "silu", scale, q.quant_dtype)

        return search, replace, _example(operand, True)

    def search(a, w, a_scale, w_scale):
        out = act_quant(gemm(a, w, a_scale, w_scale, out_dtype, None))
        return out[0], out[1]

    def replace(a, w, a_scale, w_scale):
        out = fused(a, w, a_scale, w_scale, out_dtype, "silu", q.quant_dtype)
        return out[0], out[1]

    return search, replace, _example(operand, False)


def _act_quant_forms(q: QuantOp) -> list[Callable]:
    """What follows the GEMM: the native SiLU-and-mul then quantization, and ``act_quant``'s fused op (registered
    ones only), each called as the GEMM's output (and a per-tensor scale) -> the quantization's results."""
    forms = []
    silu, quant = native_form("silu_and_mul"), native_form(q.name)
    if silu is not None and quant is not None:
        forms.append(lambda x, *scale: quant(silu(x), *scale))
    op = dynamo_once_op(f"act_and_mul_{'static' if q.static else 'dynamic'}_quant")
    if op is not None:
        forms.append(lambda x, *scale: op(x, *scale, "silu", q.quant_dtype))
    return forms


class GemmActQuantPass(QuantFusionPass):
    """W8A8 gate-up GEMM + SiLU-and-mul + static / per-token quantization -> ``gated_scaled_mm_*_quant``."""

    name = "gemm_act_quant"
    required = ("gated_scaled_mm_static_quant", "gated_scaled_mm_dynamic_quant")

    def state_key(self) -> str:
        return super().state_key() + "|" + native_forms_key(["silu_and_mul"] + [q.name for q in QUANT_OPS])

    def anchor_ops(self) -> frozenset:
        """The W8A8 GEMMs: a graph without one (a bf16 model's) traces no pattern."""
        return frozenset(op for op in (dynamo_once_op(name) for name, _ in _GEMMS) if op is not None)

    def pattern_functions(self) -> list[tuple[Callable, Callable, list]]:
        out = []
        for gemm_name, operand in _GEMMS:
            gemm = dynamo_once_op(gemm_name)
            if gemm is None:
                continue
            for q in QUANT_OPS:
                fused = dynamo_once_op(f"gated_scaled_mm_{'static' if q.static else 'dynamic'}_quant")
                for form in _act_quant_forms(q):
                    out += [_patterns(gemm, form, fused, operand, dt, q) for dt in _OUT_DTYPES]
        return out
