"""GELU-and-multiply, the gated activation of Gemma's MLP: ``[..., 2d] -> [..., d]``.

``gelu_and_mul_ref`` is the definition: ``gelu(x[..., :d], approximate) *
x[..., d:]`` with ``approximate`` ``"none"`` (erf) or ``"tanh"`` (Gemma's
``gelu_pytorch_tanh``), computed in fp32 and cast back once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from ._triton import cdiv, known_int, tl, triton, triton_op, use_triton
from .custom_op import CustomOp
from .silu_and_mul import _act_input_2d, act_and_mul_config, act_needs_int64, act_tiles_even

__all__ = ["gelu_and_mul", "GeluAndMul", "gelu_and_mul_ref"]

_APPROXIMATE = ("none", "tanh")


@triton.jit
def _gelu_and_mul_kernel(
    x_ptr,
    out_ptr,
    n_rows,
    d,
    x_row_stride,
    TANH: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    INT64: tl.constexpr,
    EVEN: tl.constexpr,
):
    # As _silu_and_mul_kernel (EVEN: exact tiling, no masks).
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_offs = rows[:, None] * x_row_stride + cols[None, :]
    out_offs = rows[:, None] * d + cols[None, :]
    if EVEN:
        a = tl.load(x_ptr + in_offs).to(tl.float32)
        b = tl.load(x_ptr + in_offs + d).to(tl.float32)
    else:
        mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
        a = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + in_offs + d, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation near u = 0, no tanh intrinsic needed.
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)  # sqrt(2/pi)
        g = a * tl.sigmoid(2.0 * u)
    else:
        g = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))  # 1/sqrt(2)
    y = (g * b).to(out_ptr.dtype.element_ty)
    if EVEN:
        tl.store(out_ptr + out_offs, y)
    else:
        tl.store(out_ptr + out_offs, y, mask=mask)


def _launch_gelu_and_mul(x: torch.Tensor, approximate: str, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = _act_input_2d(x)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    n_rows = x2.shape[0]
    known_rows = known_int(n_rows)
    block_d, rows, num_warps = config or act_and_mul_config(d, x.element_size(), known_rows)
    wrap_triton(_gelu_and_mul_kernel)[(cdiv(n_rows, rows), cdiv(d, block_d))](
        x2,
        out,
        n_rows,
        d,
        x2.stride(0),
        TANH=approximate == "tanh",
        BLOCK_D=block_d,
        ROWS=rows,
        INT64=act_needs_int64(n_rows, x2.stride(0), d),
        EVEN=act_tiles_even(known_rows, d, rows, block_d),
        num_warps=num_warps,
    )
    return out


@triton_op("dynamo_once::gelu_and_mul", mutates_args=())
def _gelu_and_mul_op(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"gelu_and_mul: approximate must be one of {_APPROXIMATE}; got {approximate!r}")
    if not use_triton(x):
        return gelu_and_mul_ref(x, approximate)
    return _launch_gelu_and_mul(x, approximate)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` for ``x: [..., 2d]``; ``approximate`` is ``"none"`` or ``"tanh"``."""
    return torch.ops.dynamo_once.gelu_and_mul(x, approximate)


@CustomOp.register("gelu_and_mul")
class GeluAndMul(CustomOp):
    """``forward(x: [..., 2d]) -> [..., d]``: ``gelu(gate, approximate) * up``."""

    def __init__(self, approximate: str = "none") -> None:
        if approximate not in _APPROXIMATE:
            raise ValueError(f"GeluAndMul: approximate must be one of {_APPROXIMATE}; got {approximate!r}")
        super().__init__()
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul_ref(x, self.approximate)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


def gelu_and_mul_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The fp32 reference, cast back to ``x.dtype``."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.gelu(xf[..., :d], approximate=approximate) * xf[..., d:]).to(x.dtype).contiguous()
