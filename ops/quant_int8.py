"""Symmetric INT8 quantization: static per tensor (given scale) and dynamic per token (one scale a row).

Definition (the references at the end of this file, which the kernels match bit for bit):

- ``q = clamp(round_half_to_even(x / scale), -128, 127)`` as int8: the fp32 division correctly rounded
  (``tl.div_rn``, not Triton's default approximate ``/``), then rounded to the nearest integer with ties to
  even (``torch.round``'s convention), then saturated;
- dynamic, per token (a row of the last dim): ``scale[t] = max(amax(|x[t]|) / 127, INT8_MIN_SCALE)``, fp32
  of shape ``x.shape[:-1] + (1,)`` (``[T, 1]`` for ``x: [T, H]``), so that ``x / scale`` broadcasts. Its
  quotients lie in [-127, 127]: -128 is reached only by a static scale.
- ``INT8_MIN_SCALE = 1 / (127 * 512)``, chosen as quant_fp8's ``MIN_SCALE = 1 / (448 * 512)`` (vLLM's
  per-token floor): an all-zero row gets a finite, positive scale, so it quantizes to zeros and dequantizes
  to zeros (no 0/0, no infinite reciprocal in a GEMM epilogue). A row whose amax is below
  ``127 * INT8_MIN_SCALE = 1/512`` is quantized on that floor's grid, coarser than its own amax would give;
  activations after a norm have amax of order 1, far above it.

NaN inputs give unspecified values. Outputs: ``q`` with ``x``'s shape (contiguous); ``scale`` fp32.

With the op switched off (``QuantInt8``'s native forward), the references' torch code runs, and Inductor
fuses it with its neighbours; its generated division is Triton's ``/`` (within 2 ulp), so a quotient within
an ulp of a .5 tie may round the other way there, as for quant_fp8's native code.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from dispatcher.passes.native_forms import register_native_form

from .triton_utils import cdiv, known_int, needs_int64, pdl_args, tl, triton, triton_op, use_triton
from .custom_op import CustomOp
from .quant_fp8 import check_quant_input, launch_per_token_quant, static_fp8_quant_config

__all__ = [
    "static_scaled_int8_quant",
    "dynamic_scaled_int8_quant",
    "QuantInt8",
    "static_scaled_int8_quant_ref",
    "dynamic_scaled_int8_quant_ref",
    "INT8_MAX",
    "INT8_MIN_SCALE",
]

INT8_MAX = 127.0
INT8_MIN = -128.0
# Rounded to fp32 here so the kernels' fp32 argument and the reference's clamp agree exactly.
INT8_MIN_SCALE = float(torch.tensor(1.0 / (INT8_MAX * 512.0), dtype=torch.float32))

# Rounding in the kernels: Triton has no round-half-even the interpreter also runs (libdevice's rint is an
# extern call it refuses), so they add and subtract 1.5 * 2**23: for |y| <= 2**22, y + 1.5 * 2**23 lies in
# [2**23, 2**24), where fp32 values are the integers, so that addition rounds y to an integer, ties to even
# (the constant is even), and the subtraction is exact. y is clamped to [-128, 127] first (clamping to integer
# bounds commutes with rounding). Without fast-math flags (Triton sets none on add/sub) nothing folds the pair.
# The constant is written out in the kernels: Triton reads no plain Python global.


@triton.jit
def _static_int8_quant_kernel(x_ptr, scale_ptr, q_ptr, n, BLOCK: tl.constexpr, INT64: tl.constexpr,
                              EVEN: tl.constexpr, PDL: tl.constexpr):
    # Self-contained (no helper @triton.jit call): Inductor re-emits a user kernel's source and fails
    # to compile one that calls another jitted function (seen with torch 2.11 + Triton 3.6).
    # EVEN: n is a known multiple of BLOCK, so no masks.
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        x = tl.load(x_ptr + offs).to(tl.float32)
    else:
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr).to(tl.float32)
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -128.0), 127.0)
    q = ((y + 12582912.0) - 12582912.0).to(tl.int8)  # round half to even: see the comment above
    if EVEN:
        tl.store(q_ptr + offs, q)
    else:
        tl.store(q_ptr + offs, q, mask=mask)


def _launch_static_int8_quant(x: torch.Tensor, scale: torch.Tensor, config: tuple[int, int] | None = None
                              ) -> torch.Tensor:
    """``config``: ``(BLOCK, num_warps)``, default the static fp8 quant's (the same bytes read and written)."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    n = x.numel()
    known_n = known_int(n)
    block, num_warps = config or static_fp8_quant_config(known_n, x.element_size())
    wrap_triton(_static_int8_quant_kernel)[(cdiv(n, block),)](
        x, scale, q, n, BLOCK=block, INT64=needs_int64(n, block),
        EVEN=known_n is not None and known_n % block == 0, num_warps=num_warps,
        **pdl_args(None, x, known_n),
    )
    return q


def _launch_dynamic_int8_quant(x: torch.Tensor, config: tuple[int, int, int] | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``config``: ``(BLOCK, ROWS, num_warps)`` (default: ``quant_fp8.per_token_quant_config``)."""
    return launch_per_token_quant(x, torch.int8, INT8_MIN_SCALE, config)


@triton_op("dynamo_once::static_scaled_int8_quant", mutates_args=())
def _static_scaled_int8_quant_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    check_quant_input("static_scaled_int8_quant", x, scale)
    if not use_triton(x):
        return static_scaled_int8_quant_ref(x, scale)
    return _launch_static_int8_quant(x, scale)


@triton_op("dynamo_once::dynamic_scaled_int8_quant", mutates_args=())
def _dynamic_scaled_int8_quant_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_quant_input("dynamic_scaled_int8_quant", x, per_token=True)
    if not use_triton(x):
        return dynamic_scaled_int8_quant_ref(x)
    return _launch_dynamic_int8_quant(x)


def static_scaled_int8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``clamp(round_half_to_even(x / scale), -128, 127)`` as int8, ``x``'s shape.

    Args:
        x: fp32, fp16 or bf16, any shape.
        scale: the per-tensor scale, fp32 of shape ``[1]`` (or 0-d), on ``x``'s device.
    Raises:
        TypeError: a dtype other than these. ValueError: ``scale`` not one element, or on another device.
    """
    return torch.ops.dynamo_once.static_scaled_int8_quant(x, scale)


def dynamic_scaled_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``, one scale a token (a row of the last dim): ``scale = max(amax(|x[t]|) / 127,
    INT8_MIN_SCALE)``, fp32 of shape ``x.shape[:-1] + (1,)``; ``q`` int8 as :func:`static_scaled_int8_quant`.

    Raises:
        TypeError: ``x`` is not fp32, fp16 or bf16. ValueError: ``x`` has no rows (0-d, or an empty last dim).
    """
    return torch.ops.dynamo_once.dynamic_scaled_int8_quant(x)


@CustomOp.register("quant_int8")
class QuantInt8(CustomOp):
    """Symmetric INT8 quantization; ``forward(x, scale=None) -> (q, scale)``.

    Args:
        static: quantize with the per-tensor ``scale`` passed to ``forward`` (True; it is returned as is),
            or per token with scales computed from ``x`` (False; ``scale: x.shape[:-1] + (1,)``).
    """

    def __init__(self, static: bool = False) -> None:
        super().__init__()
        self.static = static

    def _check(self, scale: torch.Tensor | None) -> None:
        if self.static and scale is None:
            raise ValueError("QuantInt8(static=True): forward needs a scale")

    def forward_native(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(scale)
        if self.static:
            return static_scaled_int8_quant_ref(x, scale), scale  # type: ignore[arg-type,return-value]
        return dynamic_scaled_int8_quant_ref(x)

    def forward_cuda(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(scale)
        if self.static:
            return static_scaled_int8_quant(x, scale), scale  # type: ignore[arg-type,return-value]
        return dynamic_scaled_int8_quant(x)

    def extra_repr(self) -> str:
        return f"static={self.static}"


def static_scaled_int8_quant_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: fp32 ``x / scale`` (a true IEEE division: ``scale`` stays a tensor on x's device),
    rounded half to even, clamped to [-128, 127]."""
    q = torch.round(x.float() / scale.float().reshape(())).clamp(INT8_MIN, INT8_MAX)
    return q.to(torch.int8).contiguous()


def dynamic_scaled_int8_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: one scale a row of the last dim, from its ``amax(|x|)`` (see the module docstring)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # A tensor divisor: CUDA computes `tensor / python_scalar` as a multiplication by the rounded reciprocal.
    scale = (amax / torch.full_like(amax, INT8_MAX)).clamp(min=INT8_MIN_SCALE)
    q = torch.round(x.float() / scale).clamp(INT8_MIN, INT8_MAX)
    return q.to(torch.int8).contiguous(), scale


register_native_form("static_scaled_int8_quant", static_scaled_int8_quant_ref)
register_native_form("dynamic_scaled_int8_quant", dynamic_scaled_int8_quant_ref)
