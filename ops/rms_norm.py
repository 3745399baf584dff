"""RMSNorm (Llama and Gemma forms), with and without the fused residual add.

Conventions (``rms_norm_ref`` is the definition; everything is computed in fp32
and cast back to the input dtype once, at the end):

- Llama: ``y = x * rsqrt(mean(x**2) + eps) * weight``;
- Gemma: ``y = x * rsqrt(mean(x**2) + eps) * (1 + weight)``: Gemma checkpoints
  store ``weight - 1``, and ``1 + weight`` is formed in fp32 (in bf16, 1 + w
  would lose w's low bits);
- fused add: ``s = (x + residual)`` rounded to the input dtype, then
  ``(rms_norm(s), s)``. Normalizing the *rounded* sum (as vLLM's CUDA kernel
  does) makes the fused op equal the unfused ``residual = x + residual;
  norm(residual)`` that a model without the fusion computes.

The Triton kernel handles all four forms; each row is read once, normalized
in registers, written once.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from dispatcher.passes.native_forms import register_native_form

from .triton_utils import (
    SMALL_ELEMENTS,
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
    "rms_norm",
    "gemma_rms_norm",
    "fused_add_rms_norm",
    "gemma_fused_add_rms_norm",
    "RMSNorm",
    "GemmaRMSNorm",
    "rms_norm_ref",
]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_rows,
    n_cols,
    x_row_stride,
    res_row_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    INT64: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    # A [ROWS, BLOCK_N] tile: several short rows per program keep enough bytes
    # in flight per SM when the hidden size is small.
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    # The weight is loaded first, with x: issued after the reduction (which ends in a barrier) it
    # would be a second, serialized round trip to L2 (~0.3 us of a ~1.5 us call at <= 16 tokens).
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    x_offs = rows[:, None] * x_row_stride + cols[None, :]
    out_offs = rows[:, None] * n_cols + cols[None, :]
    # Activations are read once: evict_first keeps the weight (read by every program) in L2 when x
    # streams through it; a launch-latency-bound call (<= 512 KiB) has nothing to protect.
    if EVICT_FIRST:
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_offs = rows[:, None] * res_row_stride + cols[None, :]
        if EVICT_FIRST:
            r = tl.load(res_ptr + r_offs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
        # Round the sum to the input dtype before normalizing it (module docstring).
        s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + out_offs, s, mask=mask)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    # eps as fp32: Inductor, re-emitting the kernel in a compiled graph, passes a float argument as fp64, which
    # would make rstd and every product with it fp64 (slower, and not the eager launch's values)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + tl.cast(eps, tl.float32))
    if GEMMA:
        w = 1.0 + w
    y = xf * rstd[:, None] * w[None, :]
    tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_config(n_cols: int, element_size: int, n_rows: int | None = None) -> tuple[int, int, int]:
    """``(BLOCK_N, ROWS, num_warps)`` for rows of ``n_cols`` elements.

    ``n_rows`` is the token count when known without a guard (``known_int``), else None: the
    bandwidth config then depends on the hidden size only (static under torch.compile), so the
    choice adds no guard on a symbolic size.
    """
    block_n = next_power_of_2(n_cols)
    if n_rows is not None and n_rows * block_n <= SMALL_ELEMENTS:
        # Launch-latency bound (<= 16 x 8192): one row per program from 64 columns (16 tokens -> 16
        # programs, the most a row reduction allows), shorter rows stacked to 512 elements. Two 16-byte
        # vectors per thread, 1-16 warps. Swept on the H200 (bench_ops --sweep-small), 4096 bf16 at 1 and
        # 16 tokens: 8 warps 1.63 / 1.71 us, 4 warps 1.65 / 1.79, 16 warps 1.73 / 1.83, compile 1.66 / 1.88.
        rows = min(max(1, 512 // block_n), next_power_of_2(n_rows))
        num_warps = min(max(block_n * rows * element_size // (32 * 32), 1), 16)
        return block_n, rows, num_warps
    # Rows of >= 2048 columns: one per program. Measured on H200 at 4096 x 4096 bf16, 1 or 2 rows per
    # program with 8 warps both give 84-85% of the copy bandwidth (4 rows: 79%), and one row keeps 16
    # programs for 16 tokens, where launch latency rules. Shorter rows are stacked to ~4 KiB.
    rows = max(1, min(4096 // (block_n * element_size), 64))
    # 32 B (two 16-byte vectors) per thread, 4-8 warps: at 4096 bf16, 8 warps 84%, 4 warps 83%, 16 warps 76%.
    num_warps = min(max(block_n * rows * element_size // (32 * 32), 4), 8)
    return block_n, rows, num_warps


def _launch_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    gemma: bool,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``config``: ``(BLOCK_N, ROWS, num_warps)``; ``pdl``: programmatic dependent launch (default: ``pdl_launch``)."""
    n_cols = x.shape[-1]
    weight = weight.contiguous()
    # Rows may be strided (a slice of a wider tensor); the last dim must be dense.
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, n_cols).contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = None
    r2 = x2
    if residual is not None:
        r2 = residual if residual.dim() == 2 and residual.stride(-1) == 1 else residual.reshape(-1, n_cols).contiguous()
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x2.shape[0]
    known_rows = known_int(n_rows)
    block_n, rows, num_warps = config or rms_norm_config(n_cols, x.element_size(), known_rows)
    small = known_rows is not None and known_rows * block_n <= SMALL_ELEMENTS
    wrap_triton(_rms_norm_kernel)[(cdiv(n_rows, rows),)](
        x2,
        r2,
        weight,
        out,
        out if res_out is None else res_out,
        n_rows,
        n_cols,
        x2.stride(0),
        r2.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        GEMMA=gemma,
        BLOCK_N=block_n,
        ROWS=rows,
        INT64=needs_int64(n_rows * x2.stride(0), n_rows * r2.stride(0), n_rows * n_cols),
        EVICT_FIRST=not small,
        num_warps=num_warps,
        **pdl_args(pdl, x2, known_rows * block_n if known_rows is not None else None),
    )
    return out, res_out


#: The kernel holds a whole row in one program; Triton tensors hold at most 2**20 elements, and rows
#: beyond this (no model's hidden size comes near) run the reference instead.
MAX_KERNEL_COLS = 65536


def _use_kernel(x: torch.Tensor) -> bool:
    """Triton for CUDA rows of up to ``MAX_KERNEL_COLS`` (the hidden size is static: no guard on tokens)."""
    return use_triton(x) and x.shape[-1] <= MAX_KERNEL_COLS


@triton_op("dynamo_once::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _use_kernel(x):
        return rms_norm_ref(x, weight, eps)
    return _launch_rms_norm(x, None, weight, eps, gemma=False)[0]


@triton_op("dynamo_once::gemma_rms_norm", mutates_args=())
def _gemma_rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _use_kernel(x):
        return rms_norm_ref(x, weight, eps, gemma=True)
    return _launch_rms_norm(x, None, weight, eps, gemma=True)[0]


@triton_op("dynamo_once::fused_add_rms_norm", mutates_args=())
def _fused_add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_kernel(x):
        return fused_add_rms_norm_ref(x, residual, weight, eps)
    return _launch_rms_norm(x, residual, weight, eps, gemma=False)  # type: ignore[return-value]


@triton_op("dynamo_once::gemma_fused_add_rms_norm", mutates_args=())
def _gemma_fused_add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if not _use_kernel(x):
        return fused_add_rms_norm_ref(x, residual, weight, eps, gemma=True)
    return _launch_rms_norm(x, residual, weight, eps, gemma=True)  # type: ignore[return-value]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(mean(x**2, -1) + eps) * weight`` over the last dim, in fp32, cast to ``x.dtype``."""
    return torch.ops.dynamo_once.rms_norm(x, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """As :func:`rms_norm` with the Gemma weight, ``x_normed * (1 + weight)``."""
    return torch.ops.dynamo_once.gemma_rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(s), s)`` with ``s = x + residual`` rounded to ``x.dtype``. Inputs are not modified."""
    return torch.ops.dynamo_once.fused_add_rms_norm(x, residual, weight, eps)


def gemma_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`fused_add_rms_norm` with the Gemma weight."""
    return torch.ops.dynamo_once.gemma_fused_add_rms_norm(x, residual, weight, eps)


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """Llama RMSNorm; ``forward(x, residual=None)`` returns ``normed`` or ``(normed, x + residual)``.

    Args:
        hidden_size: size of the last dim.
        eps: added to the mean square.
        dtype: the weight's dtype (default: torch's default dtype).
    """

    gemma = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        # Python float: an fp64 0-dim tensor would promote the fp32 math under Inductor.
        self.variance_epsilon = float(eps)
        init = torch.zeros if self.gemma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=dtype))

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm_ref(x, self.weight, self.variance_epsilon, gemma=self.gemma)
        return fused_add_rms_norm_ref(x, residual, self.weight, self.variance_epsilon, gemma=self.gemma)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            op = gemma_rms_norm if self.gemma else rms_norm
            return op(x, self.weight, self.variance_epsilon)
        fused = gemma_fused_add_rms_norm if self.gemma else fused_add_rms_norm
        return fused(x, residual, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


@CustomOp.register("gemma_rms_norm")
class GemmaRMSNorm(RMSNorm):
    """Gemma RMSNorm, ``x_normed * (1 + weight)``; the weight starts at zero (checkpoints store ``w - 1``)."""

    gemma = True


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """The fp32 reference: see the module docstring for the Llama and Gemma conventions."""
    xf = x.float()
    w = weight.float()
    if gemma:
        w = 1.0 + w
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * w
    return y.to(x.dtype).contiguous()


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 reference of the fused add: ``s = (x + residual).to(x.dtype)``, then ``(rms_norm_ref(s), s)``."""
    s = (x.float() + residual.float()).to(x.dtype).contiguous()
    return rms_norm_ref(s, weight, eps, gemma=gemma), s


def _gemma_rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x, weight, eps, gemma=True)


def _gemma_fused_add_rms_norm_native(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm_ref(x, residual, weight, eps, gemma=True)


# What the modules' native paths compute (``RMSNorm.forward_native``), for the passes that put the native code back
register_native_form("rms_norm", rms_norm_ref)
register_native_form("gemma_rms_norm", _gemma_rms_norm_native)
register_native_form("fused_add_rms_norm", fused_add_rms_norm_ref)
register_native_form("gemma_fused_add_rms_norm", _gemma_fused_add_rms_norm_native)
