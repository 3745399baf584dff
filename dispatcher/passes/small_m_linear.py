"""``SmallMLinearPass``: a bf16 / fp16 linear layer's GEMM -> ``dynamo_once::linear``, which runs the library's
small-M Triton GEMM at decode sizes where it is faster than cuBLAS, and cuBLAS elsewhere.

A compiled graph calls cuBLAS for ``F.linear`` whatever the token count: Inductor lowers ``mm`` with a
symbolic M to an extern call. At decode sizes (M <= 128) the GEMM is a weight read, and the library's kernel
reads some of Llama's shapes faster (``ops.small_m_gemm.SMALL_M_TABLE`` says which: a shape without a config
there stays on cuBLAS). The op decides at run time, on the concrete M, so one compile serves every size.

The forms matched, as ``F.linear`` appears in the post-grad graph (the weight ``w`` in nn.Linear's
``[N, K]`` layout, transposed by a ``permute``):

- ``mm(x, permute(w, [1, 0]))`` -> ``linear(x, w)``;
- ``addmm(bias, x, permute(w, [1, 0]))`` with a 1-d ``bias [N]`` -> ``linear(x, w, bias)``.

An ``addmm`` whose first operand is ``[M, N]`` (Inductor folds a residual add into the GEMM) is no linear
layer's bias and is left to cuBLAS. Only bf16 / fp16 operands of one dtype are rewritten. Compiles for a size
above :data:`MAX_TOKENS` are left as they are: the op would only add a call. This module names ops, never models.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import compat
from .fused_add_rms_norm import dynamo_once_op
from .pattern_pass import PatternPass

__all__ = ["MAX_TOKENS", "SmallMLinearPass"]

#: The largest compile size the pass rewrites (bf16 / fp16's ``ops.small_m_gemm.F16_TRITON_MAX_M``: the op takes
#: cuBLAS above it anyway).
MAX_TOKENS = 128
_DTYPES = (torch.bfloat16, torch.float16)


def _mm(x, w):
    return torch.mm(x, w.permute(1, 0))


def _addmm(bias, x, w):
    return torch.addmm(bias, x, w.permute(1, 0))


def _replacements(op: Any) -> list[tuple[Any, Any, list[torch.Tensor]]]:
    """(search, replacement, tracing inputs) per form; fp32 CPU examples (no dtype conversion in either)."""
    def mm_linear(x, w):
        return op(x, w, None)

    def addmm_linear(bias, x, w):
        return op(x, w, bias)

    x, w = torch.empty(4, 8), torch.empty(6, 8)
    return [(_mm, mm_linear, [x, w]), (_addmm, addmm_linear, [torch.empty(6), x, w])]


def _rewritable(match: Any) -> bool:
    """2-d operands of one float dtype the op takes, ``w [N, K]`` against ``x [M, K]``, a bias ``[N]``."""
    vals = {k: v.meta.get("val") for k, v in match.kwargs.items() if hasattr(v, "meta")}
    x, w, bias = vals.get("x"), vals.get("w"), vals.get("bias", False)
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return False
    if x.dtype not in _DTYPES or w.dtype != x.dtype or x.dim() != 2 or w.dim() != 2:
        return False
    if bias is not False and (not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.dtype != x.dtype
                              or not compat.statically_equal(bias.shape, w.shape[:1])):
        return False
    return compat.statically_equal(x.shape[1:], w.shape[1:])


class SmallMLinearPass(PatternPass):
    """bf16 / fp16 ``mm`` / ``addmm`` of a transposed weight -> ``dynamo_once::linear`` (small-M Triton GEMM at
    decode sizes), in compiles for the symbolic size and for sizes up to :data:`MAX_TOKENS`."""

    name = "small_m_linear"

    def is_available(self) -> bool:
        return dynamo_once_op("linear") is not None

    def is_applicable(self, size: int | None) -> bool:
        return size is None or size <= MAX_TOKENS

    def register_patterns(self, patterns: Any) -> int:
        op = dynamo_once_op("linear")
        forms = _replacements(op)
        for search, replace, example in forms:
            compat.register_replacement(search, replace, example, patterns, None, _rewritable)
        return len(forms)
