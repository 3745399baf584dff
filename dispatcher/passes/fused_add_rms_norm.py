"""``FusedAddRMSNormPass``: a residual add followed by an RMSNorm of the sum -> one fused op.

``h = x + residual; normed = rms_norm(h, weight, eps)``, with both ``normed`` and ``h`` used later (the
next residual), becomes ``normed, h = dynamo_once::fused_add_rms_norm(x, residual, weight, eps)``: one
kernel reads ``x`` and ``residual`` once and writes both results. Gemma's norm (``weight + 1``) becomes
``dynamo_once::gemma_fused_add_rms_norm``. The fused op normalizes the sum rounded to the input dtype,
as the separate add does, so the rewrite changes no value beyond the norm's own rounding.

The forms matched, as they appear in the post-grad graph:

- native: the norm as the library's convention writes it in plain torch (upcast to fp32,
  ``pow(2).mean(-1) + eps``, ``rsqrt``, times the fp32 weight, cast back; ``prims.convert_element_type``
  nodes for fp16 / bf16 inputs, none for fp32), after a plain add in the input dtype or an add of
  the fp32 upcasts rounded back (as ``ops.fused_add_rms_norm_ref`` and the native path of a fused
  norm module compute it);
- custom op: ``dynamo_once::rms_norm`` / ``gemma_rms_norm`` of the add. Only an opaque op reaches
  the post-grad graph: a ``torch.library.triton_op`` is decomposed by AOTAutograd into its body
  (with Triton installed), the Triton kernel on CUDA and the native form above on the CPU.

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

__all__ = ["FusedAddRMSNormPass", "dynamo_once_op"]

#: Traced in place of eps; any constant there in a graph matches and reaches the replacement.
_EPS_STAND_IN = 1e-6
#: (input, weight) dtypes traced: a norm's weight in the input dtype or in fp32.
_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
           (torch.float16, torch.float16), (torch.float16, torch.float32)]
#: variant -> (norm op, fused op) in the ``dynamo_once`` namespace
_VARIANTS = {"llama": ("rms_norm", "fused_add_rms_norm"), "gemma": ("gemma_rms_norm", "gemma_fused_add_rms_norm")}


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


# Search and replacement functions take exactly the pattern's arguments (the matcher reads their names).
def _search_plain_add(gemma: bool) -> Callable[..., Any]:
    def search(x, residual, weight, eps):
        h = x + residual
        return _native_norm(h, weight, eps, gemma), h

    return search


def _search_upcast_add(gemma: bool) -> Callable[..., Any]:
    def search(x, residual, weight, eps):
        h = (x.float() + residual.float()).to(x.dtype)
        return _native_norm(h, weight, eps, gemma), h

    return search


def _search_op(norm_op: Any) -> Callable[..., Any]:
    def search(x, residual, weight, eps):
        h = x + residual
        return norm_op(h, weight, eps), h

    return search


def _replacement(fused_op: Any) -> Callable[..., Any]:
    def replace(x, residual, weight, eps):
        out = fused_op(x, residual, weight, eps)
        return out[0], out[1]

    return replace


def _fusable(match: Any) -> bool:
    """The fused op adds without broadcasting or type promotion and normalizes the last dim by a 1-D weight."""
    x, residual, weight = (match.kwargs[k].meta.get("val") for k in ("x", "residual", "weight"))
    if not all(isinstance(t, torch.Tensor) for t in (x, residual, weight)):
        return False
    return (x.dtype == residual.dtype and x.dim() >= 1 and weight.dim() == 1
            and compat.statically_equal(x.shape, residual.shape)
            and compat.statically_equal(weight.shape, x.shape[-1:]))


def _example(x_dtype: torch.dtype, w_dtype: torch.dtype) -> list[Any]:
    return [torch.empty(4, 8, dtype=x_dtype), torch.empty(4, 8, dtype=x_dtype), torch.empty(8, dtype=w_dtype),
            _EPS_STAND_IN]


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
        return dynamo_once_op(_VARIANTS["llama"][1]) is not None

    def state_key(self) -> str:
        return ",".join(f"{v}:{norm is not None}" for v, (norm, _) in self.variants().items())

    def register_patterns(self, patterns: Any) -> int:
        count = 0
        scalars = {"eps": _EPS_STAND_IN}
        for variant, (norm_op, fused_op) in self.variants().items():
            replace = _replacement(fused_op)
            gemma = variant == "gemma"
            for x_dtype, w_dtype in _DTYPES:
                # In fp32 the upcasts are no nodes: the two adds trace alike.
                forms = [_search_plain_add] + ([_search_upcast_add] if x_dtype != torch.float32 else [])
                for form in forms:
                    compat.register_replacement(form(gemma), replace, _example(x_dtype, w_dtype), patterns,
                                                scalars, _fusable)
                    count += 1
            if norm_op is not None:  # no dtype conversion in this form: one trace serves every dtype
                compat.register_replacement(_search_op(norm_op), replace, _example(torch.float32, torch.float32),
                                            patterns, scalars, _fusable)
                count += 1
        return count
