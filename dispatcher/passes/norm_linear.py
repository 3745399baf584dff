"""``NormLinearPass``: a residual add, the RMSNorm of the sum and the bf16 / fp16 linear layer reading the norm ->
``dynamo_once::norm_linear``, one GEMV at one token (its residual add and norm in the GEMV's programs), the fused-add
norm op and the linear op elsewhere.

``h = x + residual; n = rms_norm(h, g, eps); out = linear(n, w)`` (or ``gated_linear(n, w)``), with ``h`` used
later (the next residual), becomes ``out, h = norm_linear(x, residual, g, w, eps, gated)``. The linear layer is the
library's op, which ``small_m_linear`` and ``gated_linear`` put in place of the GEMM earlier in the same compile:
this pass runs after them, and only matches what they made. The forms of the add and the norm, as they appear in the
post-grad graph:

- native: the norm in the library's convention (``dispatcher.passes.fused_add_rms_norm``'s, its weight in the
  operands' dtype or fp32) of a plain add in the operands' dtype, or of the add of their fp32 upcasts rounded back
  (the Llama norm module's native path);
- ``dynamo_once::fused_add_rms_norm``: the norm module's op with the custom ops on (kept opaque while this pass is on,
  ``opaque_ops``), or what the ``fused_add_rms_norm`` pass made of the native forms earlier in the same compile.

Compiles for the symbolic size and for one token (a larger size's compile would only run the unfused ops).
Gemma's norm (``weight + 1``) is not matched. This module names ops, never models.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .. import compat
from .fused_add_rms_norm import EPS_STAND_IN, dynamo_once_op, llama_add_norms
from .pattern_pass import PatternPass

__all__ = ["NormLinearPass"]

_DTYPES = (torch.bfloat16, torch.float16)


def _forms(linear_op: Any, op: Any, fused_op: Any | None, gated: bool) -> list[tuple[Any, Any, bool]]:
    """(search, replacement, native) per form of the add and norm (``fused_add_rms_norm.llama_add_norms``) before
    ``linear_op`` (the linear or gated op)."""
    def chained(add_norm):
        def search(x, residual, weight, w, eps):
            n, h = add_norm(x, residual, weight, eps)
            return (linear_op(n, w) if gated else linear_op(n, w, None)), h
        return search

    def replace(x, residual, weight, w, eps):
        out = op(x, residual, weight, w, eps, gated)
        return out[0], out[1]

    return [(chained(f), replace, native) for f, native in llama_add_norms(fused_op)]


def _rewritable(match: Any) -> bool:
    """bf16 / fp16 ``x`` and ``residual`` of one shape ``[M, K]``, ``w [N, K]`` in their dtype, a 1-d norm weight of
    ``K``: a pattern's dtypes match any, and the op's contract is narrower than the search's."""
    vals = {k: v.meta.get("val") for k, v in match.kwargs.items() if hasattr(v, "meta")}
    x, residual, weight, w = (vals.get(name) for name in ("x", "residual", "weight", "w"))
    if not all(isinstance(t, torch.Tensor) for t in (x, residual, weight, w)):
        return False
    if x.dtype not in _DTYPES or residual.dtype != x.dtype or w.dtype != x.dtype or x.dim() != 2 or w.dim() != 2:
        return False
    return (compat.statically_equal(residual.shape, x.shape) and weight.dim() == 1
            and compat.statically_equal(weight.shape, x.shape[1:]) and compat.statically_equal(w.shape[1:], x.shape[1:]))


class NormLinearPass(PatternPass):
    """Residual add + RMSNorm + ``dynamo_once::linear`` / ``gated_linear`` -> ``dynamo_once::norm_linear`` (one GEMV
    at one token), in compiles for the symbolic size and for one token."""

    name = "norm_linear"
    opaque_ops: ClassVar[bool] = True

    def is_available(self) -> bool:
        return dynamo_once_op("norm_linear") is not None

    def is_applicable(self, size: int | None) -> bool:
        return size is None or size == 1

    def state_key(self) -> str:
        return ",".join(f"{name}:{dynamo_once_op(name) is not None}"
                        for name in ("linear", "gated_linear", "fused_add_rms_norm"))

    def anchor_ops(self) -> frozenset:
        """The linear ops: a graph without them (no ``small_m_linear`` or ``gated_linear`` rewrite) traces nothing."""
        return frozenset(op for op in (dynamo_once_op("linear"), dynamo_once_op("gated_linear")) if op is not None)

    def register_patterns(self, patterns: Any) -> int:
        op, fused_op = dynamo_once_op("norm_linear"), dynamo_once_op("fused_add_rms_norm")
        scalars = {"eps": EPS_STAND_IN}
        count = 0
        with compat.triton_ops_decomposed(False):  # the library's ops as the compiles see them: opaque
            for gated, linear_op in ((False, dynamo_once_op("linear")), (True, dynamo_once_op("gated_linear"))):
                if linear_op is None:
                    continue
                for search, replace, native in _forms(linear_op, op, fused_op, gated):
                    for dtype in _DTYPES if native else _DTYPES[:1]:
                        # the norm's weight in the operands' dtype or fp32 (the native form's trace differs)
                        for w_dtype in (dtype, torch.float32) if native else (dtype,):
                            compat.register_replacement(search, replace, _example(dtype, w_dtype), patterns, scalars,
                                                        _rewritable)
                            count += 1
        return count


def _example(dtype: torch.dtype, w_dtype: torch.dtype) -> list[Any]:
    """Tracing inputs: ``x, residual [4, 8]``, the norm weight ``[8]``, ``w [12, 8]`` (an even row count: the gated
    op's too), eps."""
    return [torch.empty(4, 8, dtype=dtype), torch.empty(4, 8, dtype=dtype), torch.empty(8, dtype=w_dtype),
            torch.empty(12, 8, dtype=dtype), EPS_STAND_IN]
