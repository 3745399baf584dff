"""Quantization fused into the op that produces its input: RMSNorm + quant and activation-and-mul + quant.

A W8A8 linear layer quantizes its input in an op of its own (``dynamo_once::static_scaled_fp8_quant`` and
the like) right after the op that wrote that input: the norm before QKV and gate-up, the SiLU-and-mul
before down. Each such pair writes the activation to memory and reads it back; the fused ops of
``ops.norm_quant`` / ``ops.act_quant`` quantize in the producer's kernel instead (Llama 3 8B: 96 launches
a decode step fewer, 3 a layer). Two passes:

- :class:`RMSNormQuantPass` (``rms_norm_quant``): ``quant(rms_norm(x))`` and
  ``quant(fused_add_rms_norm(x, residual)[0])`` (and Gemma's norms) -> ``rms_norm_{static,dynamic}_quant``
  / ``fused_add_rms_norm_{static,dynamic}_quant``, the new residual kept as the fused op's last output;
- :class:`ActQuantPass` (``act_quant``): ``quant(silu_and_mul(x))`` / ``quant(gelu_and_mul(x, approximate))``
  -> ``act_and_mul_{static,dynamic}_quant``.

Quantizations matched: fp8 e4m3 static per tensor and dynamic per token, int8 static per tensor and dynamic
per token (a dynamic per-tensor fp8 scale needs the whole tensor's amax first: no producer can fuse it).

The patterns are the library's ops as the model calls them, so they match only where those ops stay
opaque nodes: with these passes on, a compile keeps ``torch.library.triton_op`` ops opaque
(``GraphPass.opaque_ops``; otherwise AOTAutograd inlines each into its Triton kernel, which no pattern
can name). The values are those of the unfused ops: each fused op rounds the producer's output to its
dtype before quantizing, as the separate ops do. An intermediate used anywhere else (a norm output read
by two layers) is not matched: the pattern matcher requires the pattern's inner nodes to have no other
users. This module names ops, never models; a variant whose ops are not registered is left out.

With the custom ops off (level 3's default) there is no op to name: ``act_quant`` also matches the native form of
an activation-and-mul followed by a per-token quantization (the functions the modules' native paths call, which
``ops`` registers in ``native_forms``), where Inductor computes each row's amax in reduction kernels of its own
and reads the row again to quantize it. A static quantization's native form is left to Inductor, which fuses it
into the activation's kernel. Measured on the H200 (int8 8B decode at batch 1-128, a 2048-token prefill), the
fused op in its place made no step faster than Inductor's kernels (README "Graph passes").
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .. import compat
from .fused_add_rms_norm import dynamo_once_op
from .native_forms import native_form, native_forms_key
from .pattern_pass import PatternPass

__all__ = ["RMSNormQuantPass", "ActQuantPass", "QuantFusionPass", "QUANT_OPS"]

_EPS_STAND_IN = 1e-6


@dataclasses.dataclass(frozen=True)
class QuantOp:
    """A quantization op the passes fuse: its name in ``dynamo_once``, the dtype it produces, and whether it
    takes a per-tensor scale (static: returns ``q``) or computes one a token (dynamic: returns ``(q, scale)``)."""

    name: str
    quant_dtype: torch.dtype
    static: bool


QUANT_OPS = (
    QuantOp("static_scaled_fp8_quant", torch.float8_e4m3fn, True),
    QuantOp("dynamic_per_token_scaled_fp8_quant", torch.float8_e4m3fn, False),
    QuantOp("static_scaled_int8_quant", torch.int8, True),
    QuantOp("dynamic_scaled_int8_quant", torch.int8, False),
)


def _quant_ops() -> list[tuple[QuantOp, Any]]:
    """The registered quantization ops: ``(QuantOp, op overload)``."""
    return [(q, op) for q in QUANT_OPS if (op := dynamo_once_op(q.name)) is not None]


def _tensors(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    # fp32 (PatternPass.prepare traces under that default): scales must be fp32, and an opaque op's node
    # matches inputs of any dtype.
    return [torch.empty(s) for s in shapes]


# Each builder returns (search, replacement, example inputs). A search function returns every value the rest
# of the graph may use (the quantized tensor, a dynamic scale, a fused add's new residual), its replacement
# the same values from the fused op, in order; the argument names are the match's keys. eps comes last, where
# torch versions that take the scalar's stand-in in the example inputs and those that insert it agree.
def _norm_patterns(norm: Any, fused: Any, quant: Any, q: QuantOp, gemma: bool) -> tuple[Callable, Callable, list]:
    if q.static:
        def search(x, weight, scale, eps):
            return quant(norm(x, weight, eps), scale)

        def replace(x, weight, scale, eps):
            return fused(x, weight, eps, scale, q.quant_dtype, gemma)

        return search, replace, _tensors((4, 8), (8,), (1,)) + [_EPS_STAND_IN]

    def search(x, weight, eps):
        out = quant(norm(x, weight, eps))
        return out[0], out[1]

    def replace(x, weight, eps):
        out = fused(x, weight, eps, q.quant_dtype, gemma)
        return out[0], out[1]

    return search, replace, _tensors((4, 8), (8,)) + [_EPS_STAND_IN]


def _fused_add_patterns(norm: Any, fused: Any, quant: Any, q: QuantOp, gemma: bool) -> tuple[Callable, Callable, list]:
    if q.static:
        def search(x, residual, weight, scale, eps):
            normed = norm(x, residual, weight, eps)
            return quant(normed[0], scale), normed[1]

        def replace(x, residual, weight, scale, eps):
            out = fused(x, residual, weight, eps, scale, q.quant_dtype, gemma)
            return out[0], out[1]

        return search, replace, _tensors((4, 8), (4, 8), (8,), (1,)) + [_EPS_STAND_IN]

    def search(x, residual, weight, eps):
        normed = norm(x, residual, weight, eps)
        out = quant(normed[0])
        return out[0], out[1], normed[1]

    def replace(x, residual, weight, eps):
        out = fused(x, residual, weight, eps, q.quant_dtype, gemma)
        return out[0], out[1], out[2]

    return search, replace, _tensors((4, 8), (4, 8), (8,)) + [_EPS_STAND_IN]


def _act_patterns(act_op: Any, extra: tuple[Any, ...], act: str, fused_static: Any, fused_dynamic: Any, quant: Any,
                  q: QuantOp) -> tuple[Callable, Callable, list]:
    if q.static:
        def search(x, scale):
            return quant(act_op(x, *extra), scale)

        def replace(x, scale):
            return fused_static(x, scale, act, q.quant_dtype)

        return search, replace, _tensors((4, 16), (1,))

    return (*_dynamic_act_pair(act_op, extra, quant, fused_dynamic, act, q.quant_dtype), _tensors((4, 16)))


def _dynamic_act_pair(act_fn: Callable, extra: tuple[Any, ...], quant_fn: Callable, fused_dynamic: Any, act: str,
                      quant_dtype: torch.dtype) -> tuple[Callable, Callable]:
    """``quant_fn(act_fn(x, *extra))`` (a per-token quantization: ``(q, scale)``) and the fused op in its place."""
    def search(x):
        out = quant_fn(act_fn(x, *extra))
        return out[0], out[1]

    def replace(x):
        out = fused_dynamic(x, act, quant_dtype)
        return out[0], out[1]

    return search, replace


def _native_act_patterns(act_form: Callable, extra: tuple[Any, ...], act: str, fused_dynamic: Any, quant_form: Callable,
                         q: QuantOp, dtype: torch.dtype) -> tuple[Callable, Callable, list, Callable]:
    """The native forms (custom ops off) of an activation-and-mul then a per-token quantization, traced on ``dtype``
    inputs (bf16 / fp16 round the activation's output and upcast it again; fp32 has no conversion): Inductor
    computes the row's amax in reduction kernels of their own and reads the row again to quantize it, where the
    fused op holds each row once."""
    search, replace = _dynamic_act_pair(act_form, extra, quant_form, fused_dynamic, act, q.quant_dtype)
    return search, replace, [torch.empty((4, 16), dtype=dtype)], functools.partial(_is_act_quant, q.quant_dtype)


def _is_act_quant(quant_dtype: torch.dtype, match: Any) -> bool:
    """A native match is what the fused op takes and computes. The matcher retraces the search function on the
    matched inputs, so the split point, the dims and the constants are the library's; a pattern's dtypes match
    any, so they are checked here: a float input (an fp64 graph would otherwise get an op that refuses it) and a
    ``quant_dtype`` output (fp8 patterns would otherwise take another fp8 format)."""
    x = getattr(match.kwargs["x"], "meta", {}).get("val")
    q = compat.match_output_values(match)[0]
    return x is not None and q is not None and x.dtype in _FLOAT_INPUTS and q.dtype == quant_dtype


_FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)


class QuantFusionPass(PatternPass):
    """Shared by the quantization passes (``rms_norm_quant``, ``act_quant``, ``gemm_act_quant``): they match opaque
    library ops, traced as such (and native forms: ``act_quant``, ``gemm_act_quant``)."""

    opaque_ops: ClassVar[bool] = True
    #: ops that must be registered for the pass to run at all
    required: ClassVar[tuple[str, ...]] = ()

    def is_available(self) -> bool:
        return all(dynamo_once_op(name) is not None for name in self.required) and bool(_quant_ops())

    def state_key(self) -> str:
        return ",".join(q.name for q, _ in _quant_ops())

    def register_patterns(self, patterns: Any) -> int:
        count = 0
        # Traced as the compiles see them: the ops opaque, not inlined into their Triton kernels.
        with compat.triton_ops_decomposed(False):
            for search, replace, example, *check in self.pattern_functions():
                scalars = {"eps": _EPS_STAND_IN} if "eps" in inspect.signature(search).parameters else {}
                compat.register_replacement(search, replace, example, patterns, scalars, *check)
                count += 1
        return count

    def pattern_functions(self) -> list[tuple[Callable, Callable, list]]:
        raise NotImplementedError


#: (norm op, fused-add norm op, gemma) -> the fused ops' names are fixed; ``gemma`` is their flag.
_NORMS = (("rms_norm", "fused_add_rms_norm", False), ("gemma_rms_norm", "gemma_fused_add_rms_norm", True))


class RMSNormQuantPass(QuantFusionPass):
    """RMSNorm (plain or with the residual add, Llama's or Gemma's) + fp8 / int8 quantization -> one fused op."""

    name = "rms_norm_quant"
    required = ("rms_norm_static_quant", "rms_norm_dynamic_quant", "fused_add_rms_norm_static_quant",
                "fused_add_rms_norm_dynamic_quant")

    def pattern_functions(self) -> list[tuple[Callable, Callable, list]]:
        out = []
        for norm_name, fused_add_name, gemma in _NORMS:
            norm, fused_add = dynamo_once_op(norm_name), dynamo_once_op(fused_add_name)
            for q, quant in _quant_ops():
                kind = "static" if q.static else "dynamic"
                if norm is not None:
                    out.append(_norm_patterns(norm, dynamo_once_op(f"rms_norm_{kind}_quant"), quant, q, gemma))
                if fused_add is not None:
                    out.append(_fused_add_patterns(fused_add, dynamo_once_op(f"fused_add_rms_norm_{kind}_quant"),
                                                   quant, q, gemma))
        return out


#: act name of the fused ops -> (op name, its extra arguments as the model passes them)
_ACTS = {"silu": ("silu_and_mul", ()), "gelu": ("gelu_and_mul", ("none",)), "gelu_tanh": ("gelu_and_mul", ("tanh",))}


class ActQuantPass(QuantFusionPass):
    """SiLU-and-mul / GELU-and-mul (erf or tanh) + fp8 / int8 quantization -> ``act_and_mul_*_quant``: the ops
    as called (custom ops on), and the native forms of a per-token quantization (``native_forms``: custom ops
    off, as at level 3 by default). A static quantization's native form is left to Inductor, which fuses it
    into the activation's pointwise kernel itself."""

    name = "act_quant"
    required = ("act_and_mul_static_quant", "act_and_mul_dynamic_quant")

    def state_key(self) -> str:
        return super().state_key() + "|" + native_forms_key(self._native_names())

    @staticmethod
    def _native_names() -> list[str]:
        return sorted({op for op, _ in _ACTS.values()} | {q.name for q in QUANT_OPS if not q.static})

    def pattern_functions(self) -> list[tuple[Callable, ...]]:
        fused_static, fused_dynamic = dynamo_once_op("act_and_mul_static_quant"), dynamo_once_op("act_and_mul_dynamic_quant")
        out: list[tuple[Callable, ...]] = []
        for act, (op_name, extra) in _ACTS.items():
            act_op, act_form = dynamo_once_op(op_name), native_form(op_name)
            for q, quant in _quant_ops():
                if act_op is not None:
                    out.append(_act_patterns(act_op, extra, act, fused_static, fused_dynamic, quant, q))
                quant_form = native_form(q.name)
                if act_form is None or quant_form is None or q.static:
                    continue
                for dtype in (torch.bfloat16, torch.float32):
                    out.append(_native_act_patterns(act_form, extra, act, fused_dynamic, quant_form, q, dtype))
        return out
