"""Per-tensor FP8 (``float8_e4m3fn``) quantization, static (given scale) and dynamic (scale from the data).

Definition (the references at the end of this file, which the kernels match
bit for bit):

- ``q = saturate(x / scale)``: fp32 division correctly rounded (``tl.div_rn``,
  not Triton's default approximate ``/``), clamped to +-448, converted with
  round-to-nearest-even;
- dynamic: ``scale = max(amax(|x|) / 448, MIN_SCALE)``, so an all-zero input
  still gets a finite, positive scale. ``MIN_SCALE = 1 / (448 * 512)``, as
  vLLM uses, keeps ``x / scale`` finite for tiny inputs.

Outputs: ``q`` with ``x``'s shape (contiguous); ``scale`` fp32 of shape ``[1]``.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from ._triton import cdiv, tl, triton, triton_op, use_triton
from .custom_op import CustomOp

__all__ = [
    "static_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "QuantFP8",
    "static_scaled_fp8_quant_ref",
    "dynamic_scaled_fp8_quant_ref",
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_SCALE",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Rounded to fp32 here so the kernels' fp32 argument and the reference's clamp agree exactly.
MIN_SCALE = float(torch.tensor(1.0 / (FP8_MAX * 512.0), dtype=torch.float32))

# 4096 elements per program and per block of the amax loop: 8 KiB of bf16 in flight per program.
_BLOCK = 4096
# The amax kernel folds this many blocks before its one atomic: 32768 x 8192 tokens -> 16384 atomics, not 65536.
_AMAX_BLOCKS = 4


@triton.jit
def _static_fp8_quant_kernel(x_ptr, scale_ptr, q_ptr, n, BLOCK: tl.constexpr):
    # Self-contained (no helper @triton.jit call): Inductor re-emits a user kernel's source and fails
    # to compile one that calls another jitted function (seen with torch 2.11 + Triton 3.6).
    scale = tl.load(scale_ptr).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _absmax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (BLOCK * BLOCKS)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(BLOCKS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    # |x| >= 0 and amax starts at 0.0, so the float atomic max needs no sign handling.
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _dynamic_fp8_quant_kernel(x_ptr, amax_ptr, q_ptr, scale_ptr, n, min_scale, BLOCK: tl.constexpr):
    scale = tl.maximum(tl.div_rn(tl.load(amax_ptr), 448.0), min_scale)
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def _launch_static_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    n = x.numel()
    wrap_triton(_static_fp8_quant_kernel)[(cdiv(n, _BLOCK),)](x, scale, q, n, BLOCK=_BLOCK, num_warps=8)
    return q


def _launch_dynamic_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    n = x.numel()
    wrap_triton(_absmax_kernel)[(cdiv(n, _BLOCK * _AMAX_BLOCKS),)](
        x, amax, n, BLOCK=_BLOCK, BLOCKS=_AMAX_BLOCKS, num_warps=8
    )
    wrap_triton(_dynamic_fp8_quant_kernel)[(cdiv(n, _BLOCK),)](
        x, amax, q, scale, n, MIN_SCALE, BLOCK=_BLOCK, num_warps=8
    )
    return q, scale


@triton_op("dynamo_once::static_scaled_fp8_quant", mutates_args=())
def _static_scaled_fp8_quant_op(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if not use_triton(x):
        return static_scaled_fp8_quant_ref(x, scale)
    return _launch_static_fp8_quant(x, scale)


@triton_op("dynamo_once::dynamic_scaled_fp8_quant", mutates_args=())
def _dynamic_scaled_fp8_quant_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not use_triton(x):
        return dynamic_scaled_fp8_quant_ref(x)
    return _launch_dynamic_fp8_quant(x)


def static_scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``saturate(x / scale)`` as ``float8_e4m3fn``; ``scale`` is a one-element fp32 tensor."""
    return torch.ops.dynamo_once.static_scaled_fp8_quant(x, scale)


def dynamic_scaled_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``scale = max(amax(|x|) / 448, MIN_SCALE)`` (fp32, shape ``[1]``)."""
    return torch.ops.dynamo_once.dynamic_scaled_fp8_quant(x)


@CustomOp.register("quant_fp8")
class QuantFP8(CustomOp):
    """Per-tensor FP8 quantization; ``forward(x, scale=None) -> (q, scale)``.

    Args:
        static: use the ``scale`` passed to ``forward`` (True) or compute it from ``x`` (False).
    """

    def __init__(self, static: bool = False) -> None:
        super().__init__()
        self.static = static

    def _check(self, scale: torch.Tensor | None) -> None:
        if self.static and scale is None:
            raise ValueError("QuantFP8(static=True): forward needs a scale")

    def forward_native(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(scale)
        if self.static:
            return static_scaled_fp8_quant_ref(x, scale), scale  # type: ignore[arg-type,return-value]
        return dynamic_scaled_fp8_quant_ref(x)

    def forward_cuda(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(scale)
        if self.static:
            return static_scaled_fp8_quant(x, scale), scale  # type: ignore[arg-type,return-value]
        return dynamic_scaled_fp8_quant(x)

    def extra_repr(self) -> str:
        return f"static={self.static}"


def static_scaled_fp8_quant_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The reference: fp32 ``x / scale``, clamped to +-448, rounded to nearest even."""
    # scale stays a device tensor (not a Python scalar): a true IEEE division, see below.
    q = (x.float() / scale.float().reshape(())).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE).contiguous()


def dynamic_scaled_fp8_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the scale from ``amax(|x|)`` (see the module docstring), then the static quant."""
    amax = x.abs().amax().float().reshape(1)
    # Divide by a tensor on x's device: CUDA computes `tensor / python_scalar` as a multiplication by the
    # rounded reciprocal, which is 1 ulp off the IEEE quotient for some amax (found on the H200).
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    return static_scaled_fp8_quant_ref(x, scale), scale
