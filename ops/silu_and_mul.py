"""SiLU-and-multiply, the gated activation of Llama's MLP: ``[..., 2d] -> [..., d]``.

``silu_and_mul_ref`` is the definition: ``silu(x[..., :d]) * x[..., d:]``,
computed in fp32 and cast back to the input dtype once.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.library import wrap_triton

from dispatcher.passes.native_forms import register_native_form

from .triton_utils import (
    SMALL_ELEMENTS,
    FastLaunch,
    cdiv,
    known_int,
    needs_int64,
    next_power_of_2,
    pdl_args,
    tl,
    triton,
    triton_op,
    use_triton,
)
from .custom_op import CustomOp

__all__ = [
    "silu_and_mul", "SiluAndMul", "silu_and_mul_ref", "act_and_mul_config", "act_needs_int64", "act_tiles_even",
    "launch_act_and_mul", "SILU", "GELU", "GELU_TANH",
]


#: ``ACT`` of :func:`_act_and_mul_kernel`.
SILU, GELU, GELU_TANH = 0, 1, 2


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    n_rows,
    d,
    x_row_stride,
    ACT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    INT64: tl.constexpr,
    EVEN: tl.constexpr,
    PDL: tl.constexpr,
):
    # act(x[:, :d]) * x[:, d:] for SiLU and both GELUs (ACT): one kernel, the activation a constexpr branch.
    # Axis 0 walks rows (up to 2**31 programs), axis 1 the column blocks of one row.
    # EVEN: the tiles cover the tensor exactly (known sizes only), so no masks.
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_offs = rows[:, None] * x_row_stride + cols[None, :]
    out_offs = rows[:, None] * d + cols[None, :]
    if EVEN:  # a constexpr branch: only one side is compiled
        a = tl.load(x_ptr + in_offs).to(tl.float32)
        b = tl.load(x_ptr + in_offs + d).to(tl.float32)
    else:
        mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
        a = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + in_offs + d, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        g = a * tl.sigmoid(a)
    elif ACT == 1:
        g = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))  # 1/sqrt(2)
    else:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u): no cancellation near u = 0, no tanh intrinsic needed.
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)  # sqrt(2/pi)
        g = a * tl.sigmoid(2.0 * u)
    y = (g * b).to(out_ptr.dtype.element_ty)
    if EVEN:
        tl.store(out_ptr + out_offs, y)
    else:
        tl.store(out_ptr + out_offs, y, mask=mask)


_act_and_mul_launch = FastLaunch(_act_and_mul_kernel)  # launch_act_and_mul's direct launches


def act_and_mul_config(d: int, element_size: int, n_rows: int | None = None) -> tuple[int, int, int]:
    """``(BLOCK_D, ROWS, num_warps)`` for output rows of ``d`` elements.

    ``n_rows`` is the token count when known without a guard (``known_int``), else None: the
    bandwidth config then depends on the hidden size only, adding no guard on a symbolic size.
    """
    if n_rows is not None and n_rows * d <= SMALL_ELEMENTS:
        # Launch-latency bound (<= 16 x 8192 outputs): 512-element tiles on 8 warps, 2 elements a thread:
        # one row of 512 columns below 8 tokens, 2 rows of 256 from 8; shorter rows stacked to the tile.
        # Swept on the H200 (bench_ops --sweep-small, interleaved timing, hidden 2048 / 4096 / 8192):
        # without PDL the best mean over the hidden sizes at 1 token ((512, 1, 8): 1.005x compile's time)
        # and at 16 ((256, 2, 8): 1.001x), the ten best within ~0.02 us of ~1.2 us; with PDL (the
        # default, ops.triton_utils.pdl_launch) 0.73-0.86 us, the best or within 0.015 us of it in each cell.
        block_d = min(next_power_of_2(d), 256 if n_rows >= 8 else 512)
        rows = min(max(1, 512 // block_d), next_power_of_2(n_rows))
        return block_d, rows, max(1, min(8, block_d * rows // 64))
    if n_rows is None:
        # A symbolic count (a compiled graph serving decode and prefill): 1024-wide tiles on 4 warps, which at one
        # token spread a 14336-wide row over 14 programs. Swept on the H200 without PDL (benchmarks.
        # fused_quant_configs, SiLU-and-mul + static fp8 quant at 4096 x 14336): 1.35 / 1.49 / 2.12 / 41.0 us at
        # 1 / 8 / 32 / 2048 tokens, against 1.78 / 1.92 / 2.27 / 46.0 for the bandwidth tiles below and 1.22 /
        # 1.57 / 2.21 / 46.4 for Inductor's code.
        block_d = min(next_power_of_2(d), 1024)
        return block_d, max(1, 1024 // block_d), 4
    # Measured on H200, 4096 x 4096 bf16: one 4096-wide row per program with 16 warps reaches 95% of the
    # copy bandwidth, 2048-wide blocks x 4 rows 87%. Short rows are stacked up to 1024 outputs per program.
    block_d = min(next_power_of_2(d), 4096)
    rows = max(1, min(1024 // block_d, 64))
    num_warps = min(max(block_d * rows * element_size // 512, 4), 16)
    return block_d, rows, num_warps


def act_tiles_even(n_rows: int | None, d: int, rows: int, block_d: int) -> bool:
    """Whether ``[rows, block_d]`` tiles cover ``[n_rows, d]`` exactly (a symbolic ``n_rows``: no)."""
    return n_rows is not None and n_rows % rows == 0 and known_int(d) is not None and d % block_d == 0


def act_needs_int64(n_rows: int, row_stride: int, d: int) -> bool:
    """Whether the kernels' input offsets (up to ``n_rows * row_stride + 2d``) may overflow int32."""
    return needs_int64(n_rows * row_stride, 2 * d)


def _act_input_2d(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 2 and x.stride(-1) == 1:
        return x
    return x.reshape(-1, x.shape[-1]).contiguous()


def launch_act_and_mul(x: torch.Tensor, act: int, config: tuple[int, int, int] | None = None,
                       pdl: bool | None = None, direct: bool = False) -> torch.Tensor:
    """``act(x[..., :d]) * x[..., d:]`` with the Triton kernel; ``act`` one of SILU, GELU, GELU_TANH.

    ``config``: ``(BLOCK_D, ROWS, num_warps)`` (default :func:`act_and_mul_config`); ``pdl``: launch with
    programmatic dependent launch (default :func:`ops.triton_utils.pdl_launch`; True needs a CUDA device of
    compute capability >= 9.0). ``direct``: the caller runs eagerly on real tensors, never traced (an opaque op's
    own implementation, which a compiled graph calls every step): the kernel is launched through
    :class:`~ops.triton_utils.FastLaunch`, not ``wrap_triton``, whose eager call goes through torch's Triton
    higher-order op (~0.3-0.9 ms of host time a call, measured on the H200's host).
    """
    d = x.shape[-1] // 2
    x2 = _act_input_2d(x)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    n_rows = x2.shape[0]
    known_rows = known_int(n_rows)
    block_d, rows, num_warps = config or act_and_mul_config(d, x.element_size(), known_rows)
    known_d = known_int(d)
    known_n = known_rows * known_d if known_rows is not None and known_d is not None else None
    grid = (cdiv(n_rows, rows), cdiv(d, block_d))
    launch = functools.partial(_act_and_mul_launch, grid) if direct else wrap_triton(_act_and_mul_kernel)[grid]
    launch(
        x2,
        out,
        n_rows,
        d,
        x2.stride(0),
        ACT=act,
        BLOCK_D=block_d,
        ROWS=rows,
        INT64=act_needs_int64(n_rows, x2.stride(0), d),
        EVEN=act_tiles_even(known_rows, d, rows, block_d),
        num_warps=num_warps,
        **pdl_args(pdl, x2, known_n),
    )
    return out


def _launch_silu_and_mul(x: torch.Tensor, config: tuple[int, int, int] | None = None,
                         pdl: bool | None = None) -> torch.Tensor:
    return launch_act_and_mul(x, SILU, config, pdl)


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


register_native_form("silu_and_mul", silu_and_mul_ref)
