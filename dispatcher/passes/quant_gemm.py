"""A static activation quantization fused into the W8A8 GEMM that reads it (``quant_gemm``).

``scaled_mm(static_quant(x, scale), w, scale, w_scale, out_dtype)`` becomes
``dynamo_once::static_quant_scaled_mm(x, w, scale, w_scale, out_dtype)``: at one token its GEMV quantizes ``x`` as
it loads it (``ops.quant_gemm``), one kernel where there were two.

Only where ``x`` is a graph input (through views): in a level-3 piece, the attention's output, which the o projection
quantizes first. Elsewhere a kernel of the graph produces ``x`` (a norm, an activation), and Inductor already writes
the quantized tensor from that kernel (or ``rms_norm_quant`` / ``act_quant`` / ``gemm_act_quant`` do): taking the
quantization into the GEMM there would save no launch, and above one token the op runs the quantization apart.

Matched: an ``fp8_scaled_mm`` without bias of a static fp8 quantization, the same scale
for the quantization and the GEMM's activation scale (as a W8A8 linear layer with a static input scale calls them),
the quantization in its native form (custom ops off: ``native_forms``) or as the library's op (custom ops on, kept
opaque). The values are the pair's (see ``ops.quant_gemm``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .. import compat
from .fused_add_rms_norm import dynamo_once_op
from .native_forms import native_form, native_forms_key
from .pattern_pass import PatternPass

__all__ = ["QuantGemmPass"]

# (GEMM op, its quantization op, the operand dtype). fp8 only: int8's GEMV quantizing as it loads takes ten times the
# instructions of its dp4a form, so ``static_quant_scaled_mm`` runs int8 unfused (see ``ops.quant_gemm``).
_PAIRS = (("fp8_scaled_mm", "static_scaled_fp8_quant", torch.float8_e4m3fn),)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_VIEWS = frozenset((torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
                    torch.ops.aten.alias.default))


def _patterns(gemm: Any, quant: Callable, fused: Any, operand: torch.dtype, out_dtype: torch.dtype,
              x_dtype: torch.dtype) -> tuple[Callable, Callable, list, Callable]:
    def search(x, w, scale, w_scale):
        return gemm(quant(x, scale), w, scale, w_scale, out_dtype, None)

    def replace(x, w, scale, w_scale):
        return fused(x, w, scale, w_scale, out_dtype, None)

    example = [torch.zeros(4, 32, dtype=x_dtype), torch.zeros(64, 32).to(operand), torch.ones(1), torch.ones(64)]
    return search, replace, example, _input_quantized_for(operand)


def _graph_input(node: Any) -> bool:
    """Whether ``node`` is a placeholder, or views of one."""
    while getattr(node, "op", None) == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return getattr(node, "op", None) == "placeholder"


def _input_quantized_for(operand: torch.dtype) -> Callable[[Any], bool]:
    def check(match: Any) -> bool:
        """A float graph input quantized to the GEMM's operand dtype (a pattern's dtypes match any)."""
        x = match.kwargs["x"]
        val, w = getattr(x, "meta", {}).get("val"), getattr(match.kwargs["w"], "meta", {}).get("val")
        return (_graph_input(x) and val is not None and val.dtype in _X_DTYPES and w is not None
                and w.dtype == operand)

    return check


class QuantGemmPass(PatternPass):
    """Static fp8 quantization of a graph input + the W8A8 GEMM reading it -> ``static_quant_scaled_mm``."""

    name = "quant_gemm"
    opaque_ops: ClassVar[bool] = True

    def is_available(self) -> bool:
        return dynamo_once_op("static_quant_scaled_mm") is not None and any(
            dynamo_once_op(g) is not None for g, _, _ in _PAIRS)

    def state_key(self) -> str:
        return ",".join(g for g, _, _ in _PAIRS if dynamo_once_op(g) is not None) + "|" + native_forms_key(
            [q for _, q, _ in _PAIRS])

    def anchor_ops(self) -> frozenset:
        """The W8A8 GEMMs: a graph without one (a bf16 model's) traces no pattern."""
        return frozenset(op for op in (dynamo_once_op(g) for g, _, _ in _PAIRS) if op is not None)

    def register_patterns(self, patterns: Any) -> int:
        fused, count = dynamo_once_op("static_quant_scaled_mm"), 0
        with compat.triton_ops_decomposed(False):  # traced as compiles see the ops: opaque
            for gemm_name, quant_name, operand in _PAIRS:
                gemm = dynamo_once_op(gemm_name)
                if gemm is None:
                    continue
                # the native form traced on bf16 (an upcast first) and fp32 inputs (an fp16 input has the same aten
                # ops as bf16's: the conversion names its target dtype only); the opaque op once, whatever x's dtype
                forms = [(native_form(quant_name), (torch.bfloat16, torch.float32)),
                         (dynamo_once_op(quant_name), (torch.float32,))]
                for quant, x_dtypes in forms:
                    if quant is None:
                        continue
                    for x_dtype in x_dtypes:
                        for out_dtype in _OUT_DTYPES:
                            search, replace, example, check = _patterns(gemm, quant, fused, operand, out_dtype,
                                                                        x_dtype)
                            compat.register_replacement(search, replace, example, patterns, {}, check)
                            count += 1
        return count
