"""``ops.norm_linear``: a residual add, the RMSNorm of the sum and the linear layer after it (in a Llama layer, the
norms before the QKV and the gate-up projections), for bf16 / fp16.

In a decode step at one token each of these norms is a kernel of its own (1.62-1.68 µs in an H100's CUDA graph)
between two GEMVs: ``h = x + residual``, ``n = rms_norm(h, g)``, then ``n @ weight.T``. This op is what the
``norm_linear`` graph pass (``dispatcher.passes``) puts in place of that chain, deciding at run time on the concrete M:

- CUDA, one token, a GEMV row for the GEMM (``ops.small_m_gemm.SMALL_M_TABLE``'s unrolled GEMV at M = 1, or with
  ``gated`` ``GATED_ROWS``' gated GEMV), ``x`` and ``residual`` with unit column stride, ``weight`` contiguous,
  ``DYNAMO_ONCE_SMALL_M_GEMM`` not 0: one kernel (:func:`norm_small_m_mm`). Each program sums its row's residual add
  and its mean square over the whole K (the row is a few KB, read from L2 and L1), normalizes each loop step's
  activation as the norm does, and streams its weight rows as the plain GEMV does; the first column block's
  programs write the sum ``h``. Without a separate norm kernel the GEMV waits for the GEMM before it directly;
- anything else: ``ops.fused_add_rms_norm`` (its Triton kernel on CUDA), then ``ops.linear`` or, ``gated``,
  ``ops.gated_linear``.

``gated``: ``weight`` is a merged gate-up projection ``[2D, K]`` and the output ``silu(gate) * up``
(``ops.gated_linear``). Returns ``(out, h)``: the layer's output and the sum, the next residual.

Values: the sum rounded to ``x``'s dtype as the add does, the norm in fp32 (``ops.rms_norm_ref``'s arithmetic:
``h * rsqrt(mean(h^2) + eps) * g``), rounded to ``x``'s dtype, then the GEMM's fp32 sums in the GEMV's order; the
fused kernel's mean square is summed in its own order (the norm kernel's result up to that rounding).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .gated_linear import gated_linear, gated_linear_ref
from .linear import linear
from .rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref
from .small_m_gemm import (SmallMConfig, _gemv_program, _gemv_step, _step_tiles, _store_gated, _TL_DTYPES,
                           gated_runtime_config, preload_steps, runtime_config, small_m_operands)
from .triton_utils import HAS_TRITON, cdiv, needs_int64, pdl_args, tl, triton

__all__ = ["NORM_LINEAR_DTYPES", "NORM_MIN_ROWS", "norm_linear", "norm_linear_ref", "norm_linear_uses_small_m",
           "norm_small_m_mm"]

#: The dtypes ``ops.norm_linear`` takes.
NORM_LINEAR_DTYPES = (torch.bfloat16, torch.float16)
#: Weight rows a program of the fused kernel streams at least: each program reads its activation and residual rows
#: over the whole K and squares their sum, work spread over more weight rows than the table's GEMV rows have (2: its
#: gated row, one gate and one up row a program, takes 4 of each). Not tuned: no GPU was lent when this kernel was
#: written (``benchmarks.norm_linear --rows`` times 2-16).
NORM_MIN_ROWS = 8


@triton.jit(do_not_specialize=["M"])
def _norm_gemv_kernel(
    x_ptr, r_ptr, g_ptr, w_ptr, out_ptr, h_ptr, M, N, stride_xm, stride_rm, stride_wn, eps, K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, INT64: tl.constexpr, PDL: tl.constexpr,
    GATED: tl.constexpr, H: tl.constexpr, PRELOAD: tl.constexpr = 0,
):
    # Program (row, column block): ops.small_m_gemm's unrolled GEMV (_small_m_gemv_kernel, bf16 / fp16, no bias)
    # with the residual add and RMSNorm of its activation row first. GATED: BLOCK_N gate rows and their up rows.
    pid = tl.program_id(0)
    row, offs_n, n_ok, pre, pre_up = _gemv_program(pid, w_ptr, M, N, stride_wn, K, BLOCK_N, BLOCK_K, EVEN, INT64, PDL,
                                                   GATED, PRELOAD)
    hs, inv = _row_sum_and_scale(x_ptr + row * stride_xm, r_ptr + row * stride_rm, h_ptr + row * K, pid < M, eps, K,
                                 BLOCK_K, EVEN)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros_like(acc)  # GATED only
    for k in tl.static_range(0, K, BLOCK_K):
        w, w_up = _step_tiles(pre, pre_up, w_ptr, offs_n, n_ok, N, stride_wn, k, K, BLOCK_K, EVEN, GATED, PRELOAD)
        a = _normed(hs[k // BLOCK_K], g_ptr, inv, k, K, BLOCK_K, EVEN)
        acc = _gemv_step(acc, w, a, False, False, False)
        if GATED:
            acc_up = _gemv_step(acc_up, w_up, a, False, False, False)
    y = tl.sum(acc, axis=1)[None, :]
    offs_m = tl.zeros((1,), dtype=offs_n.dtype) + row
    if GATED:
        _store_gated(y, tl.sum(acc_up, axis=1)[None, :], out_ptr, None, offs_m, offs_m < M, offs_n, n_ok, pid // M, N,
                     BLOCK_N, H)
    else:
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _row_sum_and_scale(x_row, r_row, h_row, writes, eps, K: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN: tl.constexpr):
    """``(hs, inv)``: the row's sum ``x + residual`` rounded to x's dtype, a loop step's chunk a tuple entry (kept in
    registers for the GEMV's steps), stored to ``h_row`` where ``writes``; and ``rsqrt(mean(h^2) + eps)`` in fp32."""
    hs = ()
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in tl.static_range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_row + offs_k, eviction_policy="evict_last")
            r = tl.load(r_row + offs_k, eviction_policy="evict_last")
        else:
            x = tl.load(x_row + offs_k, mask=offs_k < K, other=0.0, eviction_policy="evict_last")
            r = tl.load(r_row + offs_k, mask=offs_k < K, other=0.0, eviction_policy="evict_last")
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(h_row + offs_k, h, mask=(offs_k < K) & writes)
        hf = h.to(tl.float32)
        ss += hf * hf
        hs = hs + (h,)
    # eps as fp32, as ops.rms_norm's kernel takes it
    return hs, tl.rsqrt(tl.sum(ss, axis=0) / K + tl.cast(eps, tl.float32))


@triton.jit
def _normed(h, g_ptr, inv, k, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """A loop step's activation chunk: ``h * inv * g`` in fp32 (the norm's order), rounded to h's dtype."""
    offs_k = k + tl.arange(0, BLOCK_K)
    if EVEN:
        g = tl.load(g_ptr + offs_k, eviction_policy="evict_last")
    else:
        g = tl.load(g_ptr + offs_k, mask=offs_k < K, other=0.0, eviction_policy="evict_last")
    return (h.to(tl.float32) * inv * g.to(tl.float32)).to(h.dtype)


def norm_small_m_mm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                    eps: float, config: SmallMConfig, gated: bool = False,
                    min_rows: int = NORM_MIN_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`norm_linear`'s fused kernel: ``(out, h)``. ``config`` an unrolled GEMV of a row a program (``UNROLL``,
    ``BLOCK_M = 1``), run with at least ``min_rows`` weight rows a program (a power of 2; the op's:
    :data:`NORM_MIN_ROWS`). An eager launcher for CUDA tensors, and CPU tensors under ``TRITON_INTERPRET=1``; ``x``
    and ``residual`` with unit column stride."""
    if not HAS_TRITON:
        raise RuntimeError("norm_small_m_mm needs Triton, which does not import here")
    if not config.UNROLL or config.BLOCK_M != 1:
        raise ValueError(f"norm_small_m_mm: config must be an unrolled GEMV of a row a program (UNROLL=True, "
                         f"BLOCK_M=1); got {config}")
    (m, k), n = x.shape, weight.shape[0]
    norm_weight = norm_weight.contiguous()
    c = dataclasses.replace(config, BLOCK_N=max(config.BLOCK_N, min_rows))
    rows = c.BLOCK_N // 2 if gated else c.BLOCK_N  # a program's output columns
    cols = n // 2 if gated else n
    out = torch.empty((m, cols), dtype=x.dtype, device=x.device)
    h = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return out, h
    _norm_gemv_kernel[(m * cdiv(cols, rows),)](
        x, residual, norm_weight, weight, out, h, m, n, x.stride(0), residual.stride(0), weight.stride(0), eps, K=k,
        BLOCK_N=rows, BLOCK_K=c.BLOCK_K, EVEN=cols % rows == 0 and k % c.BLOCK_K == 0, GATED=gated,
        INT64=needs_int64(m * max(x.stride(0), residual.stride(0), k), n * weight.stride(0)), H=_TL_DTYPES[x.dtype],
        PRELOAD=preload_steps(c, k), num_warps=c.num_warps, enable_fp_fusion=False, **pdl_args(None, x, any_size=True),
    )
    return out, h


def _config(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, gated: bool) -> SmallMConfig | None:
    """The fused kernel's config for these operands, or None: the unfused ops. M first: a prefill pays one test."""
    if x.shape[0] != 1 or not (HAS_TRITON and small_m_operands(x, weight, max_m=1)) or residual.stride(1) != 1:
        return None
    config = gated_runtime_config(x, weight) if gated else runtime_config(x, weight, max_m=1)
    return config if config is not None and config.UNROLL and config.BLOCK_M == 1 else None


def norm_linear_uses_small_m(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             gated: bool = False) -> bool:
    """Whether :func:`norm_linear` runs these operands as one fused kernel (else the norm op, then the linear op)."""
    return _config(x, residual, weight, gated) is not None


def _check(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
           gated: bool) -> None:
    if x.dtype not in NORM_LINEAR_DTYPES or weight.dtype != x.dtype or residual.dtype != x.dtype:
        raise TypeError(f"norm_linear: x, residual and weight must all be bfloat16 or float16; got {x.dtype}, "
                        f"{residual.dtype} and {weight.dtype}")
    if x.dim() != 2 or residual.shape != x.shape or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"norm_linear: x and residual must be [M, K] and weight [N, K]; got {list(x.shape)}, "
                         f"{list(residual.shape)} and {list(weight.shape)}")
    if norm_weight.dim() != 1 or norm_weight.shape[0] != x.shape[1]:
        raise ValueError(f"norm_linear: norm_weight must be [K] = [{x.shape[1]}]; got {list(norm_weight.shape)}")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"norm_linear: a gated weight must be [gate; up], [2D, K] with an even number of rows; got "
                         f"{list(weight.shape)}")


def _norm_linear_impl(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                      eps: float, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # Checked when the graph was traced (the fake kernel) or by norm_linear().
    config = _config(x, residual, weight, gated)
    if config is not None:
        return norm_small_m_mm(x, residual, norm_weight, weight, eps, config, gated)
    normed, h = fused_add_rms_norm(x, residual, norm_weight, eps)
    return (gated_linear(normed, weight) if gated else linear(normed, weight)), h


def _norm_linear_fake(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                      eps: float, gated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, residual, norm_weight, weight, gated)
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    return x.new_empty((x.shape[0], n)), torch.empty_like(x, memory_format=torch.contiguous_format)


# Registered with torch.library.Library directly, as ops.linear: a compiled graph calls it eagerly every step.
# One kernel for every device (CompositeExplicitAutograd); inference only.
_lib = torch.library.Library("dynamo_once", "FRAGMENT")  # kept alive: the registrations live as long as it
_lib.define("norm_linear(Tensor x, Tensor residual, Tensor norm_weight, Tensor weight, float eps, bool gated) "
            "-> (Tensor, Tensor)")
_lib.impl("norm_linear", _norm_linear_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dynamo_once::norm_linear", _norm_linear_fake, lib=_lib)


def norm_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                eps: float = 1e-6, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, h)``: ``h = x + residual`` (rounded to ``x``'s dtype), ``out = rms_norm(h, norm_weight, eps) @
    weight.T`` (``gated``: ``silu(gate) * up`` of it), in ``x``'s dtype: one kernel at one token where the small-M
    table has a GEMV row (see the module docstring), else the fused-add norm op, then the linear op.

    Args:
        x, residual: ``bfloat16`` or ``float16 [M, K]``; norm_weight: ``[K]`` (the norm's weight, any float dtype);
        weight: ``x``'s dtype, ``[N, K]`` (nn.Linear's layout; ``gated``: ``[2D, K]``, the gate rows then the up rows).
        eps: added to the mean square.
        gated: ``weight`` is a merged gate-up projection, followed by SiLU-and-mul.
    Raises:
        TypeError: another dtype. ValueError: another shape, or a gated weight of an odd number of rows.
    """
    _check(x, residual, norm_weight, weight, gated)
    return torch.ops.dynamo_once.norm_linear(x, residual, norm_weight, weight, float(eps), bool(gated))


def norm_linear_ref(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                    eps: float = 1e-6, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: ``ops.fused_add_rms_norm_ref``, then ``F.linear`` (``gated``: ``ops.gated_linear_ref``)."""
    normed, h = fused_add_rms_norm_ref(x, residual, norm_weight, eps)
    return (gated_linear_ref(normed, weight) if gated else F.linear(normed, weight)), h
