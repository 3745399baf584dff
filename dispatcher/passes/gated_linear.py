"""``GatedLinearPass``: a bf16 / fp16 gate-up GEMM and the SiLU-and-mul of its output -> ``dynamo_once::gated_linear``,
which at decode sizes runs both in one small-M kernel (the activation in the GEMM's epilogue) and elsewhere the
unfused pair.

A Llama MLP's gate-up projection writes ``[T, 2D]`` that one activation kernel reads back. At a decode step's
token count the GEMM is a read of its weight and the activation one more launch a layer; the op decides at run
time, on the concrete M, where its gated form runs (``ops.small_m_gemm.GATED_ROWS``), so one compile serves every
size. The values are the unfused ops': the GEMM's output rounded to the model's dtype, then SiLU(gate) * up in fp32.

Matched, ``F.linear`` without bias as it appears in the post-grad graph (``mm(x, permute(w, [1, 0]))``, the
weight in nn.Linear's ``[2D, K]`` layout), whose output nothing else reads (the pattern matcher requires it of a
pattern's inner nodes), for bf16 and fp16 operands:

- then the native form of ``silu_and_mul`` (``native_forms``: the custom ops off, level 3's default);
- then ``dynamo_once::silu_and_mul`` as the model calls it (custom ops on; the pass keeps the Triton ops opaque).

It runs before ``small_m_linear``, which would otherwise take the GEMM first. Compiles for a size above
``small_m_linear.MAX_TOKENS`` are left alone: the op would only add a call. This module names ops, never models.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .. import compat
from .fused_add_rms_norm import dynamo_once_op
from .native_forms import native_form, native_forms_key
from .pattern_pass import PatternPass
from .small_m_linear import MAX_TOKENS

__all__ = ["GatedLinearPass"]

_DTYPES = (torch.bfloat16, torch.float16)


def _gemm(x, w):
    return torch.mm(x, w.permute(1, 0))


def _patterns(act: Any, op: Any, dtype: torch.dtype) -> tuple[Any, Any, list[torch.Tensor]]:
    """``act(mm(x, w.T))`` -> ``gated_linear(x, w)``, traced on ``dtype`` operands (the native form's upcast and
    rounding are in its trace: an fp32 graph has neither, and no match)."""
    def search(x, w):
        return act(_gemm(x, w))

    def replace(x, w):
        return op(x, w)

    return search, replace, [torch.zeros(4, 16, dtype=dtype), torch.zeros(32, 16, dtype=dtype)]


def _rewritable(match: Any) -> bool:
    """bf16 / fp16 operands of one dtype, the output ``[M, D]`` in it: a pattern's dtypes match any, and the
    matcher retraces the search function on the matched inputs (so the split point is the library's)."""
    x, w = (getattr(match.kwargs.get(name), "meta", {}).get("val") for name in ("x", "w"))
    out = compat.match_output_values(match)[0]
    if not all(isinstance(t, torch.Tensor) for t in (x, w, out)):
        return False
    return x.dtype in _DTYPES and w.dtype == x.dtype == out.dtype and x.dim() == w.dim() == 2


class GatedLinearPass(PatternPass):
    """bf16 / fp16 ``silu_and_mul(mm(x, w.T))`` -> ``dynamo_once::gated_linear`` (gate-up GEMM + SiLU-and-mul in one
    small-M kernel at decode sizes), in compiles for the symbolic size and for sizes up to ``MAX_TOKENS``."""

    name = "gated_linear"
    opaque_ops: ClassVar[bool] = True

    def is_available(self) -> bool:
        return dynamo_once_op("gated_linear") is not None

    def is_applicable(self, size: int | None) -> bool:
        return size is None or size <= MAX_TOKENS

    def state_key(self) -> str:
        return native_forms_key(["silu_and_mul"]) + f"|{dynamo_once_op('silu_and_mul') is not None}"

    def anchor_ops(self) -> frozenset:
        """``aten.mm``: a graph without a GEMM traces no pattern."""
        return frozenset({torch.ops.aten.mm.default})

    def register_patterns(self, patterns: Any) -> int:
        op = dynamo_once_op("gated_linear")
        acts = [form for form in (native_form("silu_and_mul"), dynamo_once_op("silu_and_mul")) if form is not None]
        # Traced as the compiles see them: the library's ops opaque, not inlined into their Triton kernels. On bf16
        # operands: a pattern's dtypes match any (fp16's trace would be a duplicate), _rewritable checks them.
        with compat.triton_ops_decomposed(False):
            for act in acts:
                search, replace, example = _patterns(act, op, torch.bfloat16)
                compat.register_replacement(search, replace, example, patterns, None, _rewritable)
        return len(acts)
