"""``FusedAddRMSNormPass``: a residual add followed by an RMSNorm of the sum -> one fused op.

``h = x + residual; normed = rms_norm(h, weight, eps)``, with both ``normed`` and ``h`` used later (the
next residual), becomes ``normed, h = dynamo_once::fused_add_rms_norm(x, residual, weight, eps)``: one
kernel reads ``x`` and ``residual`` once and writes both results. Gemma's norm (``weight + 1``) becomes
``dynamo_once::gemma_fused_add_rms_norm``. The fused op normalizes the sum rounded to the input dtype,
as the separate add does, so the rewrite changes no value beyond the norm's own rounding.

The forms matched, as they appear in the post-grad graph:

- native norm: the library's convention in plain torch (upcast to fp32, ``pow(2).mean(-1) + eps``,
  ``rsqrt``, times the fp32 weight, cast back: ``prims.convert_element_type`` nodes for fp16 / bf16
  inputs, none for fp32), of
  - a plain add in the input dtype (``h = x + residual``);
  - an add of the fp32 upcasts rounded back (as ``ops.fused_add_rms_norm_ref`` and a fused-add norm
    module's native path compute it);
  - an ``addmm(residual, a, b)``: Inductor folds ``a @ b + residual`` into one, on the CPU always, on
    CUDA when a user of the sum is not pointwise (the sum leaves a piece at a splitting op). The
    replacement is ``a @ b`` and the fused op: the product is rounded to the input dtype before the add;
- custom op: ``dynamo_once::rms_norm`` / ``gemma_rms_norm`` of a plain add. Only an opaque op reaches
  the post-grad graph: AOTAutograd decomposes a ``torch.library.triton_op`` into its body when Triton
  is installed (the Triton kernel on CUDA, matched by no pattern; the native form on the CPU).

The ops are functional (no mutated argument), so the replacement is a plain call and two ``getitem``s;
no ``auto_functionalized`` node is involved. This module names ops, never models: the ops are looked
up as ``torch.ops.dynamo_once.<name>`` when the patterns are traced, and a variant whose ops are not
registered is left out (the whole pass is unavailable without ``fused_add_rms_norm``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import compat
from .pattern_pass import PatternPass

__all__ = ["EPS_STAND_IN", "FusedAddRMSNormPass", "dynamo_once_op", "llama_add_norms"]

#: Traced in place of eps; any constant there in a graph matches and reaches the replacement.
EPS_STAND_IN = 1e-6
#: (input, weight) dtypes traced: a norm's weight in the input dtype or in fp32.
_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
           (torch.float16, torch.float16), (torch.float16, torch.float32)]
#: variant -> (norm op, fused op) in the ``dynamo_once`` namespace. Gemma's first: patterns are tried in the
#: order registered, and Llama's, whose weight may be any fp32 node, also matches Gemma's norm with the
#: weight ``1 + w`` (correct, but one more op than Gemma's fused op).
_VARIANTS = {"gemma": ("gemma_rms_norm", "gemma_fused_add_rms_norm"), "llama": ("rms_norm", "fused_add_rms_norm")}


def dynamo_once_op(name: str) -> Any | None:
    """``torch.ops.dynamo_once.<name>.default``, or None when no such op is registered."""
    try:
        return getattr(torch.ops.dynamo_once, name).default
    except (AttributeError, RuntimeError):
        return None


def _native_norm(h: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    hf = h.float()
    w = 1.0 + weight.float() if gemma else weight.float()
    return (hf * torch.rsqrt(hf.pow(2).mean(dim=-1, keepdim=True) + eps) * w).to(h.dtype)


# Each form: (search, replacement) for one norm; they take exactly the pattern's arguments, whose names
# the matcher reads.
def _plain_add(norm: Callable[..., Any], fused: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def search(x, residual, weight, eps):
        h = x + residual
        return norm(h, weight, eps), h

    def replace(x, residual, weight, eps):
        out = fused(x, residual, weight, eps)
        return out[0], out[1]

    return search, replace


def _upcast_add(norm: Callable[..., Any], fused: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def search(x, residual, weight, eps):
        h = (x.float() + residual.float()).to(x.dtype)
        return norm(h, weight, eps), h

    return search, _plain_add(norm, fused)[1]


def llama_add_norms(fused: Any | None) -> list[tuple[Callable[..., Any], bool]]:
    """A residual add and Llama's norm of the sum as this pass finds them natively (the add plain, or of fp32 upcasts)
    and, where given, as its op ``fused``: ``(f, native)`` pairs, ``f(x, residual, weight, eps) -> (normed, h)``, for
    a pass that matches what reads the norm (``norm_linear``)."""
    def native(h, weight, eps):
        return _native_norm(h, weight, eps, False)

    def op(x, residual, weight, eps):
        out = fused(x, residual, weight, eps)
        return out[0], out[1]

    return [(form(native, None)[0], True) for form in (_plain_add, _upcast_add)] + \
        ([(op, False)] if fused is not None else [])


def _addmm(norm: Callable[..., Any], fused: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def search(residual, mat1, mat2, weight, eps):
        h = torch.addmm(residual, mat1, mat2)
        return norm(h, weight, eps), h

    def replace(residual, mat1, mat2, weight, eps):
        out = fused(torch.mm(mat1, mat2), residual, weight, eps)
        return out[0], out[1]

    return search, replace


def _example(form: Callable[..., Any], x_dtype: torch.dtype, w_dtype: torch.dtype) -> list[Any]:
    """Tracing inputs: ``x, residual`` (``residual, mat1, mat2`` for ``addmm``) ``[4, 8]``, the weight, eps."""
    shapes = [(4, 8), (4, 6), (6, 8)] if form is _addmm else [(4, 8), (4, 8)]
    return [torch.empty(s, dtype=x_dtype) for s in shapes] + [torch.empty(8, dtype=w_dtype), EPS_STAND_IN]


def _fusable(match: Any) -> bool:
    """The fused op adds without broadcasting or type promotion and normalizes the last dim by a 1-D weight."""
    vals = {k: v.meta.get("val") for k, v in match.kwargs.items() if hasattr(v, "meta")}
    residual, weight = vals.get("residual"), vals.get("weight")
    if not isinstance(residual, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return False
    if "x" in vals:
        x = vals["x"]
        added = isinstance(x, torch.Tensor) and x.dtype == residual.dtype and x.shape
    else:  # addmm: a bias broadcast over the rows is no residual
        added = (vals["mat1"].shape[0], vals["mat2"].shape[1])
    return (bool(added) and compat.statically_equal(added, residual.shape) and residual.dim() >= 1
            and weight.dim() == 1 and compat.statically_equal(weight.shape, residual.shape[-1:]))


class FusedAddRMSNormPass(PatternPass):
    """Residual add + RMSNorm (native or custom-op form) -> ``dynamo_once::fused_add_rms_norm`` or Gemma's."""

    name = "fused_add_rms_norm"

    def variants(self) -> dict[str, tuple[Any, Any]]:
        """The variants whose fused op is registered: name -> (norm op or None, fused op)."""
        found = {}
        for variant, (norm, fused) in _VARIANTS.items():
            fused_op = dynamo_once_op(fused)
            if fused_op is not None:
                found[variant] = (dynamo_once_op(norm), fused_op)
        return found

    def is_available(self) -> bool:
        return dynamo_once_op("fused_add_rms_norm") is not None

    def state_key(self) -> str:
        return ",".join(f"{v}:{norm is not None}" for v, (norm, _) in self.variants().items())

    def register_patterns(self, patterns: Any) -> int:
        count = 0
        scalars = {"eps": EPS_STAND_IN}
        for variant, (norm_op, fused_op) in self.variants().items():
            gemma = variant == "gemma"

            def native(h, weight, eps, gemma=gemma):
                return _native_norm(h, weight, eps, gemma)

            for x_dtype, w_dtype in _DTYPES:
                # In fp32 the upcasts are no nodes: the upcast add traces as the plain one.
                for form in [_plain_add, _addmm] + ([_upcast_add] if x_dtype != torch.float32 else []):
                    search, replace = form(native, fused_op)
                    compat.register_replacement(search, replace, _example(form, x_dtype, w_dtype), patterns,
                                                scalars, _fusable)
                    count += 1
            if norm_op is not None:  # no dtype conversion in this form: one trace serves every dtype
                search, replace = _plain_add(norm_op, fused_op)
                compat.register_replacement(search, replace, _example(_plain_add, torch.float32, torch.float32),
                                            patterns, scalars, _fusable)
                count += 1
        return count
