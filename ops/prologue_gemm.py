"""A W8A8 GEMM that makes its own input: the norm, activation or quantization before a quantized linear layer
run in the small-M GEMM's prologue, so the quantized activation never goes through memory.

At decode sizes a quantized linear layer is a weight read (``ops.small_m_gemm``), and the op that makes its input
(RMSNorm with the residual add before QKV and gate-up, SiLU-and-mul before down, the attention output's
quantization before o_proj) is a kernel of its own of 1-3 µs that reads a few KB: Llama-3-8B-fp8 at batch 1
spends ~260 µs a step in them (results/kernel_profile_fp8_variant_base_top.md), 9% of the step. Here every GEMM
program recomputes the input it needs from the producer's inputs (a row of 4096 values, from L2), quantizes it
and multiplies; the producer's launch is gone.

Definition (the references at the end of this file): the unfused sequence, exactly as the ops compute it —
``ops.norm_quant`` / ``ops.act_quant`` / ``ops.quant_fp8`` / ``ops.quant_int8`` (the producer's output rounded
to ``x.dtype``, then quantized: static per tensor with ``a_scale``, or per token when ``a_scale`` is None), then
``ops.fp8_scaled_mm`` / ``ops.int8_scaled_mm`` with the same scales. The quantization dtype is the weight's.

- ``rms_norm_quant_mm(x, weight, eps, a_scale, w, w_scale, out_dtype, bias, gemma)``;
- ``fused_add_rms_norm_quant_mm(x, residual, ...) -> (out, s)``: ``s = x + residual``, the new residual;
- ``act_and_mul_quant_mm(x, act, a_scale, w, ...)``: ``act`` "silu", "gelu" or "gelu_tanh"; static only (a
  per-token scale would need every program to evaluate the whole row's activation first);
- ``quant_mm(x, a_scale, w, ...)``: the quantization alone.

Where the fused kernel runs: CUDA tensors (fp8 at compute capability >= 8.9, int8 >= 8.0), M up to
``PROLOGUE_MAX_M``, rows up to ``PROLOGUE_MAX_K`` wide for the ops that need a row's statistics, and the small-M
GEMM on (``DYNAMO_ONCE_SMALL_M_GEMM``). Elsewhere the ops run the unfused ops, which give the definition's
values. The fused kernel's quantized operand is the unfused ops' bit for bit whenever its sum of squares is
(the same arithmetic, one reduction order of its own); the GEMM sums in fp32 (fp8) or exactly (int8) as the
small-M GEMM does, in another order than cuBLAS's.

These are the ops the ``gemm_prologue`` pass (``dispatcher/passes/gemm_prologue.py``) rewrites a norm / activation
+ quant + scaled-mm chain into; a model does not call them itself.
"""

from __future__ import annotations

import dataclasses

import torch

from dispatcher import envs

from .act_quant import ACTIVATIONS, act_and_mul_static_quant, act_and_mul_static_quant_ref
from .norm_quant import (
    dynamic_quant_ref,
    fused_add_rms_norm_dynamic_quant,
    fused_add_rms_norm_dynamic_quant_ref,
    fused_add_rms_norm_static_quant,
    fused_add_rms_norm_static_quant_ref,
    rms_norm_dynamic_quant,
    rms_norm_dynamic_quant_ref,
    rms_norm_static_quant,
    rms_norm_static_quant_ref,
    static_quant_ref,
)
from .quant_fp8 import FP8_DTYPE, MIN_SCALE, dynamic_per_token_scaled_fp8_quant, static_scaled_fp8_quant
from .quant_int8 import INT8_MIN_SCALE, dynamic_scaled_int8_quant, static_scaled_int8_quant
from .scaled_mm import (
    fp8_scaled_mm,
    fp8_scaled_mm_ref,
    int8_scaled_mm,
    int8_scaled_mm_ref,
    scaled_mm_capable,
)
from .small_m_gemm import SmallMConfig, default_small_m_config, prefetch_lines, split_k_epilogue_launch
from .triton_utils import HAS_TRITON, cdiv, needs_int64, next_power_of_2, pdl_args, pdl_available, tl, triton

__all__ = [
    "rms_norm_quant_mm",
    "fused_add_rms_norm_quant_mm",
    "act_and_mul_quant_mm",
    "quant_mm",
    "rms_norm_quant_mm_ref",
    "fused_add_rms_norm_quant_mm_ref",
    "act_and_mul_quant_mm_ref",
    "quant_mm_ref",
    "prologue_scaled_mm",
    "PROLOGUE_MAX_M",
    "PROLOGUE_MAX_K",
]

#: The fused kernel's largest M: its first stage makes one row at a time (results/prologue_gemm*.md).
PROLOGUE_MAX_M = 1
#: The widest row whose statistics (sum of squares, amax) a program holds at once.
PROLOGUE_MAX_K = 8192
#: Loop steps (``BLOCK_K`` columns) of its weights a program prefetches into L2 before its first stage (on CUDA).
STAGE_PREFETCH = 8

# PRO, the kernel's prologue: what the GEMM's operand is made of.
_QUANT, _NORM, _ADD_NORM, _ACT = 0, 1, 2, 3
_LINE_BYTES = 128


@triton.jit
def _quantize(y, scale, inv, INTEGER: tl.constexpr, STATIC: tl.constexpr):
    """``saturate(y / scale)`` in the quant kernels' arithmetic (``ops.norm_quant``): the quotient correctly
    rounded from the rounded reciprocal, then round to nearest even into int8 or e4m3."""
    q0 = y * inv
    q = tl.where((tl.abs(q0) <= 65536.0) & (tl.abs(q0) >= 1.1754944e-38), tl.fma(tl.fma(-q0, scale, y), inv, q0), q0)
    if STATIC:
        if (inv > 1.0e27) | (inv < 1.0e-27):
            q = tl.div_rn(y, scale)
    if INTEGER:
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
        out = ((q + 12582912.0) - 12582912.0).to(tl.int8)  # round half to even: see ops.quant_int8
    else:
        out = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)
    return out


@triton.jit
def _producer(x_ptr, r_ptr, g_ptr, x_offs, r_offs, cols, mask, K, rstd, PRO: tl.constexpr, ACT: tl.constexpr,
              GEMMA: tl.constexpr):
    """The producer's output at ``x_offs`` (columns ``cols``, the last dim), fp32 holding ``x.dtype`` values (the
    unfused op's rounding). Any shape: one row's ``[BLOCK_K]`` or a ``[BLOCK_M, BLOCK_K]`` tile (``rstd``
    broadcast to it)."""
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    dtype = x_ptr.dtype.element_ty
    if PRO == 3:  # act(x[:, :K]) * x[:, K:] as ops.silu_and_mul's kernel
        a = x.to(tl.float32)
        b = tl.load(x_ptr + x_offs + K, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:
            g = a * tl.sigmoid(a)
        elif ACT == 1:
            g = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))
        else:
            u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
            g = a * tl.sigmoid(2.0 * u)
        y = (g * b).to(dtype).to(tl.float32)
    elif PRO == 0:
        y = x.to(tl.float32)
    else:
        if PRO == 2:
            r = tl.load(r_ptr + r_offs, mask=mask, other=0.0)
            xf = (x.to(tl.float32) + r.to(tl.float32)).to(dtype).to(tl.float32)
        else:
            xf = x.to(tl.float32)
        w = tl.load(g_ptr + cols, mask=cols < K, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if GEMMA:
            w = 1.0 + w
        y = (xf * rstd * w).to(dtype).to(tl.float32)  # as ops.norm_quant's kernel
    return y


@triton.jit
def _row_stat(x_ptr, r_ptr, g_ptr, res_out_ptr, scale_out_ptr, row, K, stride_xm, stride_rm, eps, lead,
              ROW_BLOCK: tl.constexpr, PRO: tl.constexpr, GEMMA: tl.constexpr, DYNAMIC: tl.constexpr,
              INTEGER: tl.constexpr, MIN_S: tl.constexpr):
    """``(rstd, scale)`` of one row: its norm's factor (1 without a norm) and per-token scale (1 if static), from
    the whole row; the lead program stores the fused add's new residual and the scale."""
    cols = tl.arange(0, ROW_BLOCK)
    c_ok = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=c_ok, other=0.0)
    rstd = 1.0
    if PRO == 2:
        r = tl.load(r_ptr + row * stride_rm + cols, mask=c_ok, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if lead:
            tl.store(res_out_ptr + row * K + cols, s, mask=c_ok)
        xf = s.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    if (PRO == 1) | (PRO == 2):
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    scale = 1.0
    if DYNAMIC:
        y = _producer(x_ptr, r_ptr, g_ptr, row * stride_xm + cols, row * stride_rm + cols, cols, c_ok, K, rstd, PRO,
                      0, GEMMA)
        qmax = 127.0 if INTEGER else 448.0
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), axis=0), qmax), MIN_S)
        if lead:
            tl.store(scale_out_ptr + row, scale)
    return rstd, scale


@triton.jit
def _prefetch_l2(w_ptr, offs_n, N, stride_wn, k0, K, LINES: tl.constexpr, LINE: tl.constexpr):
    """Start the read of ``LINES`` 128-byte lines of each of the program's weight rows, from column ``k0``, into L2."""
    pf_k = tl.minimum(k0 + tl.arange(0, LINES) * LINE, K - 1)  # clamped: valid addresses
    pf = w_ptr + tl.minimum(offs_n, N - 1)[:, None] * stride_wn + pf_k[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [pf], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _make_operand(x_ptr, r_ptr, g_ptr, res_out_ptr, scale_out_ptr, a_ptr, slot, m0, M, K, K_SPLIT, pid_k, stride_xm,
                  stride_rm, eps, lead, static_scale, PRO: tl.constexpr, ACT: tl.constexpr, GEMMA: tl.constexpr,
                  DYNAMIC: tl.constexpr, INTEGER: tl.constexpr, MIN_S: tl.constexpr, ROW_BLOCK: tl.constexpr,
                  KS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, INT64: tl.constexpr):
    """Stage 1 of the kernel: the block's rows made and quantized into ``a_ptr``'s slot; their per-token scales
    ``[BLOCK_M]`` (1 where static or unused)."""
    idx = tl.arange(0, BLOCK_M)
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    kc = tl.arange(0, KS_BLOCK)
    kc_ok = (kc < K_SPLIT) & (pid_k * K_SPLIT + kc < K)
    cols = pid_k * K_SPLIT + kc
    for i in range(0, tl.minimum(BLOCK_M, M - m0)):
        row = (m0 + i).to(tl.int64) if INT64 else m0 + i
        rstd, scale = _row_stat(x_ptr, r_ptr, g_ptr, res_out_ptr, scale_out_ptr, row, K, stride_xm, stride_rm, eps,
                                lead, ROW_BLOCK, PRO, GEMMA, DYNAMIC, INTEGER, MIN_S)
        if DYNAMIC:
            row_scale = tl.where(idx == i, scale, row_scale)
        else:
            scale = static_scale
        y = _producer(x_ptr, r_ptr, g_ptr, row * stride_xm + cols, row * stride_rm + cols, cols, kc_ok, K, rstd,
                      PRO, ACT, GEMMA)
        q = _quantize(y, scale, tl.div_rn(1.0, scale), INTEGER, not DYNAMIC)
        tl.store(a_ptr + (slot + i) * KS_BLOCK + kc, q, mask=kc < K_SPLIT)
    return row_scale


@triton.jit(do_not_specialize=["M"])
def _prologue_gemm_kernel(
    x_ptr, r_ptr, g_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, ws_ptr, out_ptr, res_out_ptr, scale_out_ptr,
    a_ptr, M, N, K, K_SPLIT, A_ROWS, stride_xm, stride_rm, stride_wn, eps,
    PRO: tl.constexpr, ACT: tl.constexpr, GEMMA: tl.constexpr, DYNAMIC: tl.constexpr, INTEGER: tl.constexpr,
    MIN_S: tl.constexpr, ROW_BLOCK: tl.constexpr, KS_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, W_PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, INT64: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr,
    LINE: tl.constexpr, PF_STAGE: tl.constexpr,
):
    # Two stages a program. 1: each row of its block made, quantized and stored to its own slice of the scratch
    # a_ptr ([programs, A_ROWS, KS_BLOCK]: its K split's columns), one row a step, the whole split at once (one
    # round trip to L2 a row, not one a GEMM step). 2: ops.small_m_gemm's loop (program layout, split K, weight
    # prefetch, epilogue) over that slice, a plain tl.dot operand the loop's pipeline loads ahead.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    m0 = (pid % num_m) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    if PDL:
        if PF_LINES > 0:  # the weights do not depend on the kernel before: start their read into L2 first
            _prefetch_l2(w_ptr, offs_n, N, stride_wn, pid_k * K_SPLIT, K, PF_LINES, LINE)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if PF_STAGE > 0:  # more of the weights into L2 while stage 1 waits on its round trips (HBM idle otherwise)
        _prefetch_l2(w_ptr, offs_n, N, stride_wn, pid_k * K_SPLIT, K, PF_STAGE, LINE)
    m_ok = offs_m < M
    n_ok = offs_n < N
    lead = (pid // num_m == 0) & (pid_k == 0)  # the one program a row block that stores what is not the GEMM's
    idx = tl.arange(0, BLOCK_M)
    if not DYNAMIC:
        static_scale = tl.load(a_scale_ptr)
    else:
        static_scale = 1.0
    slot = (pid * SPLIT_K + pid_k) * A_ROWS
    if INT64:
        slot = slot.to(tl.int64)
    row_scale = _make_operand(x_ptr, r_ptr, g_ptr, res_out_ptr, scale_out_ptr, a_ptr, slot, m0, M, K, K_SPLIT, pid_k,
                              stride_xm, stride_rm, eps, lead, static_scale, PRO, ACT, GEMMA, DYNAMIC, INTEGER, MIN_S,
                              ROW_BLOCK, KS_BLOCK, BLOCK_M, INT64)
    tl.debug_barrier()  # the slice's stores visible to every thread of the program
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slot + idx)[:, None] * KS_BLOCK + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (pid_k * K_SPLIT + offs_k)[None, :]
    if INTEGER:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K_SPLIT, BLOCK_K):
        k_ok = (offs_k + k < K_SPLIT) & (pid_k * K_SPLIT + offs_k + k < K)
        a = tl.load(a_ptrs + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if EVEN:
            w = tl.load(w_ptrs + k, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        if INTEGER:
            acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:  # partial sums; the split-K epilogue kernel scales them (per-token scales: scale_out_ptr)
        tl.store(ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=out_mask)
    else:
        if DYNAMIC:
            y = acc.to(tl.float32) * row_scale[:, None]  # ops.scaled_mm's epilogue, in its order
        else:
            y = acc.to(tl.float32) * static_scale
        if W_PER_CHANNEL:
            y = y * tl.load(w_scale_ptr + offs_n, mask=n_ok, other=1.0)[None, :]
        else:
            y = y * tl.load(w_scale_ptr)
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


def prologue_scaled_mm(
    x: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor | None, w_scale: torch.Tensor, out_dtype: torch.dtype,
    bias: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    eps: float = 1e-6, gemma: bool = False, act: str | None = None, config: SmallMConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused kernel's launcher: ``(out, new residual or None)``. The producer: ``act`` given, act-and-mul of
    ``x [M, 2K]``; ``norm_weight`` given, the RMSNorm (after ``x + residual`` when ``residual`` is given) of ``x
    [M, K]``; neither, ``x`` itself. ``a_scale`` None: per-token scales. Arguments as the ops check them (those
    call this); an eager launcher for CUDA tensors and, under ``TRITON_INTERPRET=1``, CPU tensors."""
    if not HAS_TRITON:
        raise RuntimeError("the prologue GEMM needs Triton, which does not import here")
    pro = _ACT if act is not None else _QUANT if norm_weight is None else _NORM if residual is None else _ADD_NORM
    x = x if x.stride(-1) == 1 else x.contiguous()
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    residual = None if residual is None else (residual if residual.stride(-1) == 1 else residual.contiguous())
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    res_out = torch.empty((m, k), dtype=x.dtype, device=x.device) if pro == _ADD_NORM else None
    scale_out = torch.empty((m, 1), dtype=torch.float32, device=x.device) if a_scale is None else None
    if m == 0 or n == 0:
        return out, res_out
    c = config or default_small_m_config(m, n, k, w.dtype)
    k_split = cdiv(cdiv(k, c.SPLIT_K), c.BLOCK_K) * c.BLOCK_K
    pdl = pdl_available(x)
    integer = w.dtype == torch.int8
    line = max(1, _LINE_BYTES // w.element_size())
    ws = None if c.SPLIT_K == 1 else torch.empty((c.SPLIT_K, m, n), device=x.device,
                                                 dtype=torch.int32 if integer else torch.float32)
    flags = dict(W_PER_CHANNEL=w_scale.shape[0] != 1, HAS_BIAS=bias is not None,
                 INT64=needs_int64(m * x.stride(0), n * w.stride(0), c.SPLIT_K * m * n), **pdl_args(pdl))
    grid = (cdiv(m, c.BLOCK_M) * cdiv(n, c.BLOCK_N), c.SPLIT_K)
    a_rows, ks_block = min(m, c.BLOCK_M), next_power_of_2(k_split)
    scratch = torch.empty(grid[0] * grid[1] * a_rows * ks_block, dtype=w.dtype, device=x.device)
    _prologue_gemm_kernel[grid](
        x, x if residual is None else residual, x if norm_weight is None else norm_weight, w, a_scale,
        w_scale, bias, ws, out, res_out, scale_out, scratch, m, n, k, k_split, a_rows, x.stride(0),
        0 if residual is None else residual.stride(0), w.stride(0), eps,
        PRO=pro, ACT=ACTIVATIONS[act] if act is not None else 0, GEMMA=gemma, DYNAMIC=a_scale is None,
        INTEGER=integer, MIN_S=INT8_MIN_SCALE if integer else MIN_SCALE,
        ROW_BLOCK=next_power_of_2(k) if pro in (_NORM, _ADD_NORM) or a_scale is None else 16, KS_BLOCK=ks_block,
        BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K, SPLIT_K=c.SPLIT_K,
        EVEN=n % c.BLOCK_N == 0 and k % (c.BLOCK_K * c.SPLIT_K) == 0,
        PF_LINES=prefetch_lines(c, k_split, line) if pdl else 0, LINE=line,
        PF_STAGE=prefetch_lines(dataclasses.replace(c, PREFETCH=STAGE_PREFETCH), k_split, line) if x.is_cuda else 0,
        num_warps=c.num_warps, num_stages=c.num_stages, enable_fp_fusion=False, **flags,
    )
    if c.SPLIT_K > 1:
        split_k_epilogue_launch(ws, a_scale if a_scale is not None else scale_out, w_scale, bias, out, c.SPLIT_K,
                                pdl=pdl)
    return out, res_out


def _fused(x: torch.Tensor, w: torch.Tensor, stats: bool) -> bool:
    """Whether the ops run the fused kernel for these operands (else the unfused ops)."""
    if not HAS_TRITON or x.device.type != "cuda" or not envs.small_m_gemm():
        return False
    if not scaled_mm_capable(w):
        return False
    m, k = x.shape[0], w.shape[1]
    return 1 <= m <= PROLOGUE_MAX_M and (not stats or k <= PROLOGUE_MAX_K)


def _gemm(q: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
          bias: torch.Tensor | None) -> torch.Tensor:
    mm = fp8_scaled_mm if w.dtype == FP8_DTYPE else int8_scaled_mm
    return mm(q, w, a_scale, w_scale, out_dtype, bias)


def _gemm_ref(q: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
              bias: torch.Tensor | None) -> torch.Tensor:
    mm = fp8_scaled_mm_ref if w.dtype == FP8_DTYPE else int8_scaled_mm_ref
    return mm(q, w, a_scale, w_scale, out_dtype, bias)


def _check(op: str, x: torch.Tensor, w: torch.Tensor, k: int) -> None:
    """What the fusion adds to the unfused ops' checks (which the unfused path runs, and the fake kernels too):
    2-D ``x`` of ``k`` columns, a weight of a quantized dtype."""
    if w.dtype not in (FP8_DTYPE, torch.int8):
        raise TypeError(f"{op}: w must be torch.float8_e4m3fn or torch.int8; got {w.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{op}: x must be [M, {k}] for w of shape {list(w.shape)}; got {list(x.shape)}")


def _mm_fake(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]), dtype=out_dtype)


@torch.library.custom_op("dynamo_once::rms_norm_quant_mm", mutates_args=())
def _rms_norm_quant_mm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, a_scale: torch.Tensor | None,
                          w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
                          bias: torch.Tensor | None = None, gemma: bool = False) -> torch.Tensor:
    _check("rms_norm_quant_mm", x, w, w.shape[1])
    if _fused(x, w, stats=True):
        return prologue_scaled_mm(x, w, a_scale, w_scale, out_dtype, bias, norm_weight=weight, eps=eps,
                                  gemma=gemma)[0]
    if a_scale is None:
        q, scale = rms_norm_dynamic_quant(x, weight, eps, w.dtype, gemma)
        return _gemm(q, w, scale, w_scale, out_dtype, bias)
    return _gemm(rms_norm_static_quant(x, weight, eps, a_scale, w.dtype, gemma), w, a_scale, w_scale, out_dtype, bias)


@_rms_norm_quant_mm_op.register_fake
def _(x, weight, eps, a_scale, w, w_scale, out_dtype, bias=None, gemma=False):
    _check("rms_norm_quant_mm", x, w, w.shape[1])
    return _mm_fake(x, w, out_dtype)


@torch.library.custom_op("dynamo_once::fused_add_rms_norm_quant_mm", mutates_args=())
def _fused_add_rms_norm_quant_mm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, a_scale: torch.Tensor | None,
    w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check("fused_add_rms_norm_quant_mm", x, w, w.shape[1])
    if _fused(x, w, stats=True) and residual.shape == x.shape:
        return prologue_scaled_mm(x, w, a_scale, w_scale, out_dtype, bias, norm_weight=weight, residual=residual,
                                  eps=eps, gemma=gemma)  # type: ignore[return-value]
    if a_scale is None:
        q, scale, s = fused_add_rms_norm_dynamic_quant(x, residual, weight, eps, w.dtype, gemma)
        return _gemm(q, w, scale, w_scale, out_dtype, bias), s
    q, s = fused_add_rms_norm_static_quant(x, residual, weight, eps, a_scale, w.dtype, gemma)
    return _gemm(q, w, a_scale, w_scale, out_dtype, bias), s


@_fused_add_rms_norm_quant_mm_op.register_fake
def _(x, residual, weight, eps, a_scale, w, w_scale, out_dtype, bias=None, gemma=False):
    _check("fused_add_rms_norm_quant_mm", x, w, w.shape[1])
    return _mm_fake(x, w, out_dtype), torch.empty_like(x)


@torch.library.custom_op("dynamo_once::act_and_mul_quant_mm", mutates_args=())
def _act_and_mul_quant_mm_op(x: torch.Tensor, act: str, a_scale: torch.Tensor, w: torch.Tensor,
                             w_scale: torch.Tensor, out_dtype: torch.dtype,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_act("act_and_mul_quant_mm", x, act, w)
    if _fused(x, w, stats=False):
        return prologue_scaled_mm(x, w, a_scale, w_scale, out_dtype, bias, act=act)[0]
    return _gemm(act_and_mul_static_quant(x, a_scale, act, w.dtype), w, a_scale, w_scale, out_dtype, bias)


@_act_and_mul_quant_mm_op.register_fake
def _(x, act, a_scale, w, w_scale, out_dtype, bias=None):
    _check_act("act_and_mul_quant_mm", x, act, w)
    return _mm_fake(x, w, out_dtype)


@torch.library.custom_op("dynamo_once::quant_mm", mutates_args=())
def _quant_mm_op(x: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check("quant_mm", x, w, w.shape[1])
    if _fused(x, w, stats=a_scale is None):
        return prologue_scaled_mm(x, w, a_scale, w_scale, out_dtype, bias)[0]
    q, scale = _quant(x, a_scale, w.dtype)
    return _gemm(q, w, scale, w_scale, out_dtype, bias)


@_quant_mm_op.register_fake
def _(x, a_scale, w, w_scale, out_dtype, bias=None):
    _check("quant_mm", x, w, w.shape[1])
    return _mm_fake(x, w, out_dtype)


def _check_act(op: str, x: torch.Tensor, act: str, w: torch.Tensor) -> None:
    if act not in ACTIVATIONS:
        raise ValueError(f"{op}: act must be one of {sorted(ACTIVATIONS)}; got {act!r}")
    _check(op, x, w, 2 * w.shape[1])


def _quant(x: torch.Tensor, a_scale: torch.Tensor | None, quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The quant ops' ``(q, scale)`` of ``x``: static with ``a_scale``, else per token."""
    if quant_dtype == torch.int8:
        if a_scale is None:
            return dynamic_scaled_int8_quant(x)
        return static_scaled_int8_quant(x, a_scale), a_scale
    if a_scale is None:
        return dynamic_per_token_scaled_fp8_quant(x)
    return static_scaled_fp8_quant(x, a_scale), a_scale


def rms_norm_quant_mm(x: torch.Tensor, weight: torch.Tensor, eps: float, a_scale: torch.Tensor | None,
                      w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype,
                      bias: torch.Tensor | None = None, gemma: bool = False) -> torch.Tensor:
    """``scaled_mm(quant(rms_norm(x, weight, eps)), w)``: ``[M, N]`` in ``out_dtype``.

    Args:
        x: ``[M, K]`` in the model dtype; weight: the norm's ``[K]`` (``gemma``: ``1 + weight``).
        a_scale: fp32 ``[1]``, the static activation scale, or None: quantized per token.
        w: ``float8_e4m3fn`` or ``int8 [N, K]``, the quantization's dtype too; w_scale: fp32 ``[1]`` or ``[N]``.
        out_dtype, bias: as ``ops.fp8_scaled_mm``'s.
    Raises:
        TypeError / ValueError naming the argument, as the unfused ops do.
    """
    return torch.ops.dynamo_once.rms_norm_quant_mm(x, weight, eps, a_scale, w, w_scale, out_dtype, bias, gemma)


def fused_add_rms_norm_quant_mm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, a_scale: torch.Tensor | None,
    w: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, s)``: ``s = x + residual`` rounded to ``x.dtype``, ``out`` :func:`rms_norm_quant_mm` of ``s``.
    Inputs are not modified."""
    return torch.ops.dynamo_once.fused_add_rms_norm_quant_mm(x, residual, weight, eps, a_scale, w, w_scale,
                                                             out_dtype, bias, gemma)


def act_and_mul_quant_mm(x: torch.Tensor, act: str, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_mm(quant(act_and_mul(x)), w)`` for ``x [M, 2K]``, ``act`` "silu", "gelu" or "gelu_tanh", with
    the static scale ``a_scale``."""
    return torch.ops.dynamo_once.act_and_mul_quant_mm(x, act, a_scale, w, w_scale, out_dtype, bias)


def quant_mm(x: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``scaled_mm(quant(x), w)``: static with ``a_scale``, per token when it is None."""
    return torch.ops.dynamo_once.quant_mm(x, a_scale, w, w_scale, out_dtype, bias)


def rms_norm_quant_mm_ref(x, weight, eps, a_scale, w, w_scale, out_dtype, bias=None, gemma=False):
    """The definition: ``ops.norm_quant``'s reference, then the scaled-mm reference."""
    if a_scale is None:
        q, scale = rms_norm_dynamic_quant_ref(x, weight, eps, w.dtype, gemma)
        return _gemm_ref(q, w, scale, w_scale, out_dtype, bias)
    return _gemm_ref(rms_norm_static_quant_ref(x, weight, eps, a_scale, w.dtype, gemma), w, a_scale, w_scale,
                     out_dtype, bias)


def fused_add_rms_norm_quant_mm_ref(x, residual, weight, eps, a_scale, w, w_scale, out_dtype, bias=None, gemma=False):
    """The definition: ``(out, s)`` from ``ops.norm_quant``'s fused-add reference and the scaled-mm reference."""
    if a_scale is None:
        q, scale, s = fused_add_rms_norm_dynamic_quant_ref(x, residual, weight, eps, w.dtype, gemma)
        return _gemm_ref(q, w, scale, w_scale, out_dtype, bias), s
    q, s = fused_add_rms_norm_static_quant_ref(x, residual, weight, eps, a_scale, w.dtype, gemma)
    return _gemm_ref(q, w, a_scale, w_scale, out_dtype, bias), s


def act_and_mul_quant_mm_ref(x, act, a_scale, w, w_scale, out_dtype, bias=None):
    """The definition: ``ops.act_quant``'s static reference, then the scaled-mm reference."""
    return _gemm_ref(act_and_mul_static_quant_ref(x, a_scale, act, w.dtype), w, a_scale, w_scale, out_dtype, bias)


def quant_mm_ref(x, a_scale, w, w_scale, out_dtype, bias=None):
    """The definition: the quant reference (static, or per token), then the scaled-mm reference."""
    if a_scale is None:
        q, scale = dynamic_quant_ref(x, w.dtype)
        return _gemm_ref(q, w, scale, w_scale, out_dtype, bias)
    return _gemm_ref(static_quant_ref(x, a_scale, w.dtype), w, a_scale, w_scale, out_dtype, bias)
