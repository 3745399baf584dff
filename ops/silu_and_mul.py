"""SiLU-and-multiply, the gated activation of Llama's MLP: ``[..., 2d] -> [..., d]``.

``silu_and_mul_ref`` is the definition: ``silu(x[..., :d]) * x[..., d:]``,
computed in fp32 and cast back to the input dtype once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from ._triton import cdiv, next_power_of_2, tl, triton, triton_op, use_triton
from .custom_op import CustomOp

__all__ = ["silu_and_mul", "SiluAndMul", "silu_and_mul_ref", "act_and_mul_config"]


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    n_rows,
    d,
    x_row_stride,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
):
    # Axis 0 walks rows (up to 2**31 programs), axis 1 the column blocks of one row.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
    in_offs = rows[:, None] * x_row_stride + cols[None, :]
    a = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + in_offs + d, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(out_ptr + rows[:, None] * d + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul_config(d: int, element_size: int) -> tuple[int, int, int]:
    """``(BLOCK_D, ROWS, num_warps)`` for an output row of ``d`` elements (hidden size only: no guard on tokens)."""
    # Measured on H200, 4096 x 4096 bf16: one 4096-wide row per program with 16 warps reaches 95% of the
    # copy bandwidth, 2048-wide blocks x 4 rows 87%. Short rows are stacked up to 1024 outputs per program;
    # no more, so that 16 tokens still make 16 programs (launch-latency regime).
    block_d = min(next_power_of_2(d), 4096)
    rows = max(1, min(1024 // block_d, 64))
    num_warps = min(max(block_d * rows * element_size // 512, 4), 16)
    return block_d, rows, num_warps


def _act_input_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    return x.reshape(-1, x.shape[-1]).contiguous()


def _launch_silu_and_mul(x: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = _act_input_2d(x)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    n_rows = x2.shape[0]
    block_d, rows, num_warps = config or act_and_mul_config(d, x.element_size())
    wrap_triton(_silu_and_mul_kernel)[(cdiv(n_rows, rows), cdiv(d, block_d))](
        x2, out, n_rows, d, x2.stride(0), BLOCK_D=block_d, ROWS=rows, num_warps=num_warps
    )
    return out


@triton_op("dynamo_once::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    if not use_triton(x):
        return silu_and_mul_ref(x)
    return _launch_silu_and_mul(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x: [..., 2d]``; returns ``[..., d]`` in ``x.dtype``."""
    return torch.ops.dynamo_once.silu_and_mul(x)


@CustomOp.register("silu_and_mul")
class SiluAndMul(CustomOp):
    """``forward(x: [..., 2d]) -> [..., d]``: ``silu(gate) * up`` with ``x = cat([gate, up], -1)``."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_ref(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The fp32 reference, cast back to ``x.dtype``."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype).contiguous()
