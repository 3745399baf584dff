"""``GemmProloguePass``: a quantized GEMM's producer moved into the GEMM — norm / activation + quant + scaled mm
-> one op whose small-M kernel makes its own input.

After :mod:`dispatcher.passes.quant_fusion` a W8A8 linear layer is two ops: the producer, which writes the quantized
activation (``fused_add_rms_norm_static_quant``, ``act_and_mul_static_quant``, ``static_scaled_fp8_quant``, ...),
and the GEMM that reads it (``fp8_scaled_mm`` / ``int8_scaled_mm``, with the producer's scale). At decode sizes the
producer is a launch of 1-3 µs for a few KB; this pass replaces each such pair by the ``ops.prologue_gemm`` op that
does both (``fused_add_rms_norm_quant_mm``, ``rms_norm_quant_mm``, ``act_and_mul_quant_mm``, ``quant_mm``), whose
values are the pair's (the op runs the pair itself where its kernel does not apply).

Matched: every producer ``quant_fusion`` makes or a model calls (RMSNorm plain or fused-add, Llama's and Gemma's;
SiLU / GELU-and-mul with a static scale; the quantization alone, static or per token), fp8 and int8, into either
GEMM with the scale the producer used (the same node) and no bias, the GEMM's output in bf16, fp16 or fp32. A producer
whose quantized output or scale has another user is left alone.

Gated by size: the symbolic compile (which serves decode) and compiles of at most :attr:`max_tokens` tokens. A
larger compile keeps the pair: the fused op's kernel would not run there, and the op, opaque, would launch the
pair from Python instead of Inductor's code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .fused_add_rms_norm import dynamo_once_op
from .quant_fusion import QUANT_OPS, QuantOp, _QuantFusionPass

__all__ = ["GemmProloguePass"]

_EPS_STAND_IN = 1e-6
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GEMMS = {torch.float8_e4m3fn: "fp8_scaled_mm", torch.int8: "int8_scaled_mm"}
_ACTS = ("silu", "gelu", "gelu_tanh")


def _examples(q: QuantOp, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    """fp32 activations of ``shapes``, then a ``[16, 16]`` weight of the quant dtype and its ``[1]`` scale."""
    return [torch.empty(s) for s in shapes] + [torch.zeros(16, 16, dtype=q.quant_dtype), torch.ones(1)]


def _norm(producer: Any, mm: Any, fused: Any, q: QuantOp, out_dtype: torch.dtype, gemma: bool,
          residual: bool) -> tuple[Callable, Callable, list]:
    # search: producer -> mm; replacement: the fused op (with None for a per-token scale). Values returned: the
    # GEMM's output and, with the fused add, the new residual.
    if residual and q.static:
        def search(x, r, weight, scale, w, w_scale, eps):
            out = producer(x, r, weight, eps, scale, q.quant_dtype, gemma)
            return mm(out[0], w, scale, w_scale, out_dtype, None), out[1]

        def replace(x, r, weight, scale, w, w_scale, eps):
            out = fused(x, r, weight, eps, scale, w, w_scale, out_dtype, None, gemma)
            return out[0], out[1]

        return search, replace, _examples(q, (4, 16), (4, 16), (16,), (1,))
    if residual:
        def search(x, r, weight, w, w_scale, eps):
            out = producer(x, r, weight, eps, q.quant_dtype, gemma)
            return mm(out[0], w, out[1], w_scale, out_dtype, None), out[2]

        def replace(x, r, weight, w, w_scale, eps):
            out = fused(x, r, weight, eps, None, w, w_scale, out_dtype, None, gemma)
            return out[0], out[1]

        return search, replace, _examples(q, (4, 16), (4, 16), (16,))
    if q.static:
        def search(x, weight, scale, w, w_scale, eps):
            return mm(producer(x, weight, eps, scale, q.quant_dtype, gemma), w, scale, w_scale, out_dtype, None)

        def replace(x, weight, scale, w, w_scale, eps):
            return fused(x, weight, eps, scale, w, w_scale, out_dtype, None, gemma)

        return search, replace, _examples(q, (4, 16), (16,), (1,))

    def search(x, weight, w, w_scale, eps):
        out = producer(x, weight, eps, q.quant_dtype, gemma)
        return mm(out[0], w, out[1], w_scale, out_dtype, None)

    def replace(x, weight, w, w_scale, eps):
        return fused(x, weight, eps, None, w, w_scale, out_dtype, None, gemma)

    return search, replace, _examples(q, (4, 16), (16,))


def _act(producer: Any, mm: Any, fused: Any, q: QuantOp, out_dtype: torch.dtype,
         act: str) -> tuple[Callable, Callable, list]:
    def search(x, scale, w, w_scale):
        return mm(producer(x, scale, act, q.quant_dtype), w, scale, w_scale, out_dtype, None)

    def replace(x, scale, w, w_scale):
        return fused(x, act, scale, w, w_scale, out_dtype, None)

    return search, replace, _examples(q, (4, 32), (1,))


def _quant(producer: Any, mm: Any, fused: Any, q: QuantOp, out_dtype: torch.dtype) -> tuple[Callable, Callable, list]:
    if q.static:
        def search(x, scale, w, w_scale):
            return mm(producer(x, scale), w, scale, w_scale, out_dtype, None)

        def replace(x, scale, w, w_scale):
            return fused(x, scale, w, w_scale, out_dtype, None)

        return search, replace, _examples(q, (4, 16), (1,))

    def search(x, w, w_scale):
        out = producer(x)
        return mm(out[0], w, out[1], w_scale, out_dtype, None)

    def replace(x, w, w_scale):
        return fused(x, None, w, w_scale, out_dtype, None)

    return search, replace, _examples(q, (4, 16))


class GemmProloguePass(_QuantFusionPass):
    """Producer + quant + W8A8 GEMM -> one ``ops.prologue_gemm`` op (see the module docstring)."""

    name = "gemm_prologue"
    required = ("rms_norm_quant_mm", "fused_add_rms_norm_quant_mm", "act_and_mul_quant_mm", "quant_mm",
                "fp8_scaled_mm", "int8_scaled_mm")
    #: the largest compile size rewritten (the fused kernel's range, ``ops.prologue_gemm.PROLOGUE_MAX_M``)
    max_tokens: ClassVar[int] = 16

    def is_applicable(self, size: int | None) -> bool:
        return size is None or size <= self.max_tokens

    def pattern_functions(self) -> list[tuple[Callable, Callable, list]]:
        out = []
        op = dynamo_once_op
        for q in QUANT_OPS:
            mm, quant = op(_GEMMS[q.quant_dtype]), op(q.name)
            kind = "static" if q.static else "dynamic"
            norm, add_norm = op(f"rms_norm_{kind}_quant"), op(f"fused_add_rms_norm_{kind}_quant")
            act = op("act_and_mul_static_quant")
            for out_dtype in _OUT_DTYPES:
                for gemma in (True, False):
                    if norm is not None:
                        out.append(_norm(norm, mm, op("rms_norm_quant_mm"), q, out_dtype, gemma, residual=False))
                    if add_norm is not None:
                        out.append(_norm(add_norm, mm, op("fused_add_rms_norm_quant_mm"), q, out_dtype, gemma,
                                         residual=True))
                if q.static and act is not None:
                    out.extend(_act(act, mm, op("act_and_mul_quant_mm"), q, out_dtype, a) for a in _ACTS)
                if quant is not None:
                    out.append(_quant(quant, mm, op("quant_mm"), q, out_dtype))
        return out
