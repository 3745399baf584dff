"""The small-M GEMM: ``out[m, n] = epilogue(sum_k a[m, k] * w[n, k])`` for decode-sized M, read at HBM speed.

At M <= 16 a linear layer's GEMM is a weight read: Llama-3-8B's 32-layer linear stack + lm_head moves ~8 GB of
fp8 / int8 weights a decode step (~1.88 ms at the H200's 4.28 TB/s copy bandwidth) and does next to no math.
cuBLAS is not built for that shape (``torch._int_mm`` refuses M <= 16 altogether), so this kernel is: many
programs over N, each streaming its ``[BLOCK_N, K]`` slab of ``w`` once (``evict_first``: a weight is read once a
step), with the scale epilogue fused.

Operands and result (the references of :mod:`ops.scaled_mm` define the scaled forms):

- ``a [M, K]`` row-major, ``w [N, K]`` in nn.Linear's layout, used in place (never copied or transposed);
- int8 x int8: int32 accumulation (exact), fp8 e4m3 x e4m3: fp32 (the products are exact in fp32, the sums
  round), bf16 / fp16 x the same: fp32;
- epilogue, in fp32, as ``ops.scaled_mm._scale_epilogue``: ``acc * a_scale * w_scale`` in that order (``a_scale``
  ``[1]`` or ``[M, 1]``, ``w_scale`` ``[1]`` or ``[N]``), ``+ bias.float()``, one cast to ``out_dtype``. The int32
  sum is converted to fp32 once (round to nearest), as the reference's float64 sum is, so int8 results are bit
  for bit ``ops.int8_scaled_mm_ref``'s. The kernels compile with ``enable_fp_fusion=False``: Triton's default
  would contract ``acc * w_scale + bias`` into one FMA (one rounding where the reference has two);
- ``small_m_mm`` (bf16 / fp16): ``a @ w.T (+ bias)`` in ``a``'s dtype, no scales.

Kernel forms (``SmallMConfig.DOT``): ``tl.dot`` on a ``BLOCK_M >= 16`` tile (rows past M masked to zero; the
tensor cores' waste at M = 1 costs nothing next to the weight read), or, for ``BLOCK_M`` of 1-8 rows, a GEMV
form (broadcast multiply, ``tl.sum`` over K) that keeps the weights in registers with no shared-memory staging.
Split-K (``SPLIT_K > 1``, more programs for narrow N and long K, e.g. ``down_proj``'s 4096 x 14336): each
split writes its partial sums (int32 / fp32) to a workspace ``[SPLIT_K, M, N]`` and a second kernel adds them
in split order and applies the epilogue. A workspace, not atomics: int32 atomics would also be exact, but need a
zeroed buffer (a memset launch) and leave the epilogue to a second kernel anyway, and fp32 atomics would make
fp8 / bf16 results vary from run to run; the workspace is ``SPLIT_K * M * N * 4`` bytes, < 1% of the weight
bytes at M = 1.

Gated form (``small_m_gated_scaled_mm``, for ``ops.gated_quant``): ``w`` is a gate-up weight ``[gate; up]``
(``[2D, K]``) and a program takes ``BLOCK_N / 2`` output columns, streaming their gate rows and their up rows into two
accumulators; the epilogue rounds both to the activation's dtype (as the plain GEMM's output is), computes
SiLU(gate) * up as ``ops.silu_and_mul``'s kernel does, and stores either that ``[M, D]`` with each row's amax over
the tile (a per-token quantization follows) or its quantization with a per-tensor scale. One split only. The same
form for bf16 / fp16 operands (``small_m_gated_mm``, for ``ops.gated_linear``): ``[M, D]`` alone.

Launchers run eagerly on CUDA tensors, inside CUDA-graph capture (no host sync; memory from torch's allocator),
and on CPU tensors under ``TRITON_INTERPRET=1``. The public W8A8 ops (:func:`ops.int8_scaled_mm`,
:func:`ops.fp8_scaled_mm`) call them for M up to ``SMALL_M_MAX`` on CUDA (``DYNAMO_ONCE_SMALL_M_GEMM=0``: cuBLAS).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dispatcher import envs

from .quant_fp8 import quantize_by_scale
from .triton_utils import HAS_TRITON, cdiv, needs_int64, next_power_of_2, pdl_args, tl, tma_descriptor, triton

__all__ = [
    "SmallMConfig",
    "SmallMRule",
    "SMALL_M_MAX",
    "UNROLL_MAX_ROWS",
    "INT8_TRITON_MAX_M",
    "F16_TRITON_MAX_M",
    "TRITON_MAX_M",
    "SMALL_M_TABLE",
    "small_m_config",
    "small_m_operands",
    "triton_max_m",
    "small_m_scaled_mm",
    "small_m_quant_scaled_mm",
    "small_m_mm",
    "small_m_gated_scaled_mm",
    "small_m_gated_mm",
    "gated_config",
    "gated_column_blocks",
    "table_row",
    "gated_runtime_config",
    "GATED_ROWS",
    "gated_row",
    "preload_steps",
    "tma_operands",
]

_SCALED_DTYPES = (torch.int8, torch.float8_e4m3fn)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Split-K epilogue: output elements a program.
_REDUCE_BLOCK = 1024
# An L2 cache line: the weight prefetch (SmallMConfig.PREFETCH) issues one address a line.
_LINE_BYTES = 128


# M unspecialized: one compile a config serves every M (Triton would compile apart for M == 1, M % 16 == 0 and the
# rest: three compiles, at capture time, for decode's batch sizes 1-16); M only enters masks and the program split.
@triton.jit(do_not_specialize=["M"])
def _small_m_gemm_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, ws_ptr, out_ptr, lock_ptr, amax_ptr, M, N, K, K_SPLIT,
    stride_am, stride_wn, a_desc, w_desc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT: tl.constexpr, INTEGER: tl.constexpr, SCALED: tl.constexpr,
    A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
    INT64: tl.constexpr, PDL: tl.constexpr, PF_LINES: tl.constexpr, LINE: tl.constexpr, SERIAL: tl.constexpr,
    SWAP: tl.constexpr, GATED: tl.constexpr, H: tl.constexpr, TMA: tl.constexpr = False,
):
    # Launched eagerly only (the public ops are opaque custom ops), so it may call other jitted functions.
    # Program (pid % m blocks, pid // m blocks) covers rows of a BLOCK_M block and BLOCK_N output columns,
    # the m blocks of one column block adjacent (they share its weights in L2); axis 1 is the K split.
    # SPLIT_K > 1: each split stores its partial sums to the [SPLIT_K, M, N] workspace ws_ptr; SERIAL: the last
    # split of a tile to arrive (a counter a tile in lock_ptr) sums them and writes out_ptr, else the next kernel.
    # EVEN: N (GATED: N // 2) % BLOCK_N == 0 and K % (BLOCK_K * SPLIT_K) == 0, so the weight loads need no mask.
    # GATED (SPLIT_K = 1): w is a gate-up weight [N = 2D, K] and BLOCK_N output columns take BLOCK_N gate rows and
    # the BLOCK_N up rows D further, two accumulators; _store_gated's epilogue, H the activation's dtype (else None).
    # TMA (not GATED): a and w read through their tensor descriptors a_desc, w_desc (Hopper's bulk tensor copies,
    # rows and columns past the tensors zero-filled) instead of a pointer a element; else those are None.
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    n_ok = offs_n < (N // 2 if GATED else N)
    if PDL:  # launched early (ops.triton_utils.pdl_launch)
        if PF_LINES > 0:  # the weights do not depend on the kernel before: start their read into L2 while it runs
            pf_k = tl.minimum(pid_k * K_SPLIT + tl.arange(0, PF_LINES) * LINE, K - 1)  # clamped: valid addresses
            pf = w_ptr + tl.minimum(offs_n, N - 1)[:, None] * stride_wn + pf_k[None, :]  # one address a 128 B line
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [pf], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.extra.cuda.gdc_wait()  # then wait for the kernel before, and let the next launch
        tl.extra.cuda.gdc_launch_dependents()
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = w_ptr + (offs_n + N // 2)[:, None] * stride_wn + offs_k[None, :]  # GATED only
    if TMA:
        acc = _k_loop_tma(a_desc, w_desc, (pid % num_m) * BLOCK_M, (pid // num_m) * BLOCK_N, pid_k * K_SPLIT, K_SPLIT,
                          BLOCK_M, BLOCK_N, BLOCK_K, INTEGER, SWAP)
        acc_up = acc  # unused: TMA launches are never GATED
    else:
        acc, acc_up = _k_loop(a_ptrs, w_ptrs, up_ptrs, m_ok, n_ok, offs_k, K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K,
                              EVEN, DOT, INTEGER, SWAP, GATED)
    out_offs = offs_m[:, None] * N + offs_n[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        ws_offs = (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]  # int64 with offs_m when INT64
        tl.store(ws_ptr + ws_offs, acc, mask=out_mask)
        if SERIAL:
            # CUTLASS's semaphore: every thread's partials stored (barrier), then one release-acquire arrival
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:  # the tile's last split: the others' partials are visible (L2 loads)
                acc = tl.load(ws_ptr + out_offs, mask=out_mask, other=0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):  # in split order, as the epilogue kernel sums
                    acc += tl.load(ws_ptr + s * M * N + out_offs, mask=out_mask, other=0, cache_modifier=".cg")
                y = _epilogue(acc.to(tl.float32), offs_m, offs_n, m_ok, n_ok, a_scale_ptr, w_scale_ptr, bias_ptr,
                              SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
                tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)
                tl.store(lock_ptr + pid, 0)  # reset for the next launch (which waits for this one to end)
    else:
        y = _epilogue(acc.to(tl.float32), offs_m, offs_n, m_ok, n_ok, a_scale_ptr, w_scale_ptr, bias_ptr, SCALED,
                      A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)  # int32 -> fp32: one rounding, as the reference's
        if GATED:
            y_up = _epilogue(acc_up.to(tl.float32), offs_m, offs_n + N // 2, m_ok, n_ok, a_scale_ptr, w_scale_ptr,
                             bias_ptr, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
            _store_gated(y, y_up, out_ptr, amax_ptr, offs_m, m_ok, offs_n, n_ok, pid // num_m, N, BLOCK_N, H)
        else:
            tl.store(out_ptr + out_offs, y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _accumulate(acc, a, w, DOT: tl.constexpr, INTEGER: tl.constexpr, SWAP: tl.constexpr):
    """``acc + a @ w.T`` (``acc`` ``[BLOCK_N, BLOCK_M]`` and ``w @ a.T`` with ``SWAP``): int32 for int8, else fp32."""
    acc_type = tl.int32 if INTEGER else tl.float32
    if DOT and SWAP:
        acc = tl.dot(w, tl.trans(a), acc, out_dtype=acc_type)
    elif DOT:
        acc = tl.dot(a, tl.trans(w), acc, out_dtype=acc_type)
    else:  # int8 widened first (int8 * int8 overflows int8; the int32 sum is exact); fp8 / bf16 products exact in fp32
        acc += tl.sum(a.to(acc_type)[:, None, :] * w.to(acc_type)[None, :, :], axis=2)
    return acc


@triton.jit
def _k_loop(a_ptrs, w_ptrs, up_ptrs, m_ok, n_ok, offs_k, K, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, EVEN: tl.constexpr, DOT: tl.constexpr, INTEGER: tl.constexpr, SWAP: tl.constexpr,
            GATED: tl.constexpr):
    """A program's sums over its K split, ``[BLOCK_M, BLOCK_N]``: ``a`` times the ``w`` rows, and, GATED, times the
    up rows (``up_ptrs``) too (else the second is an unused scalar)."""
    # SWAP: the product as w @ a.T, [BLOCK_N, BLOCK_M] (the weights the MMA's M side: Hopper's wgmma wants >= 64
    # rows there, which a decode batch's rows are not), transposed back after the loop.
    acc_type = tl.int32 if INTEGER else tl.float32
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=acc_type)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_type)
    acc_up = tl.zeros_like(acc) if GATED else tl.zeros((1,), dtype=acc_type)
    for k in range(0, K_SPLIT, BLOCK_K):
        # a: a few rows every program reads (kept in L2); w: streamed once
        if EVEN:
            a = tl.load(a_ptrs + k, mask=m_ok[:, None], other=0.0, eviction_policy="evict_last")
            w = tl.load(w_ptrs + k, eviction_policy="evict_first")
            if GATED:
                w_up = tl.load(up_ptrs + k, eviction_policy="evict_first")
        else:
            k_ok = (offs_k + k < K)[None, :]
            a = tl.load(a_ptrs + k, mask=m_ok[:, None] & k_ok, other=0.0, eviction_policy="evict_last")
            w = tl.load(w_ptrs + k, mask=n_ok[:, None] & k_ok, other=0.0, eviction_policy="evict_first")
            if GATED:
                w_up = tl.load(up_ptrs + k, mask=n_ok[:, None] & k_ok, other=0.0, eviction_policy="evict_first")
        acc = _accumulate(acc, a, w, DOT, INTEGER, SWAP)
        if GATED:
            acc_up = _accumulate(acc_up, a, w_up, DOT, INTEGER, SWAP)
    if SWAP:
        acc = tl.trans(acc)
        if GATED:
            acc_up = tl.trans(acc_up)
    return acc, acc_up


@triton.jit
def _k_loop_tma(a_desc, w_desc, m0, n0, k0, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, INTEGER: tl.constexpr, SWAP: tl.constexpr):
    """``_k_loop``'s sums for the tile at rows ``m0`` and weight rows ``n0`` over K ``k0 ... k0 + K_SPLIT``, each
    step's ``a`` and ``w`` tiles read by a tensor descriptor's load (a bulk copy into shared memory; what lies past a
    tensor's rows or K reads as zero, so no masks)."""
    acc_type = tl.int32 if INTEGER else tl.float32
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=acc_type)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=acc_type)
    for k in range(k0, k0 + K_SPLIT, BLOCK_K):
        a = a_desc.load([m0, k])
        w = w_desc.load([n0, k])
        acc = _accumulate(acc, a, w, True, INTEGER, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _store_gated(y, y_up, out_ptr, amax_ptr, offs_m, m_ok, offs_n, n_ok, pid_n, N, BLOCK_N: tl.constexpr,
                 H: tl.constexpr):
    """A gated tile's output. The GEMM's fp32 epilogue of the gate (``y``) and up (``y_up``) rows, each rounded to
    ``H`` (the activation's dtype) as the unfused GEMM's output is, then SiLU(gate) * up as ``ops.silu_and_mul``'s
    kernel computes it (fp32, rounded to ``H``); ``[M, N // 2]`` to ``out_ptr``. An ``out_ptr`` of dtype ``H``
    takes it as it is, and ``amax_ptr[row, pid_n]`` (``[M, column blocks]`` fp32) each row's amax of it over the
    tile, for a per-token quantization after it (``ops.gated_quant``; an ``amax_ptr`` of None: none); an 8-bit
    ``out_ptr`` takes it quantized with the per-tensor scale at ``amax_ptr``, as the static quant ops do."""
    g = y.to(H).to(tl.float32)
    u = y_up.to(H).to(tl.float32)
    h = (g * tl.sigmoid(g) * u).to(H)
    out_ptrs = out_ptr + offs_m[:, None] * (N // 2) + offs_n[None, :]
    if out_ptr.dtype.element_ty == H:
        tl.store(out_ptrs, h, mask=m_ok[:, None] & n_ok[None, :])
        if amax_ptr is not None:  # None: no quantization follows (small_m_gated_mm)
            blocks = tl.cdiv(N // 2, BLOCK_N)
            tl.store(amax_ptr + offs_m * blocks + pid_n, tl.max(tl.abs(h.to(tl.float32)), axis=1), mask=m_ok)
    else:
        q = quantize_by_scale(h.to(tl.float32), tl.load(amax_ptr), out_ptr.dtype.element_ty, True)
        tl.store(out_ptrs, q, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _epilogue(y, offs_m, offs_n, m_ok, n_ok, a_scale_ptr, w_scale_ptr, bias_ptr, SCALED: tl.constexpr,
              A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``y * a_scale * w_scale (+ bias)`` in fp32, in that order, for a [BLOCK_M, BLOCK_N] tile."""
    if SCALED:
        if A_PER_TOKEN:
            y = y * tl.load(a_scale_ptr + offs_m, mask=m_ok, other=1.0)[:, None]
        else:
            y = y * tl.load(a_scale_ptr)
        if W_PER_CHANNEL:
            y = y * tl.load(w_scale_ptr + offs_n, mask=n_ok, other=1.0)[None, :]
        else:
            y = y * tl.load(w_scale_ptr)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return y


# The unrolled GEMV form (SmallMConfig.UNROLL): K a compile-time constant, so every loop step is unrolled and its
# loads can all be issued before the first multiply; one [BLOCK_N, BLOCK_K] accumulator, reduced once at the end.
# One row of a a program (program (row, column block): the rows of one column block adjacent, sharing its weights
# in L2). On the H200 at M = 1 it read bf16 weights faster than cuBLAS (benchmarks.l2_prefetch, results/
# l2_prefetch_gemv.md: the 1B's o_proj 4.3 against 6.0 µs, the 8B's 10.8 against 13.6).
# At M = 1 a weight element is one multiply-add, so the instructions an element costs bound an 8-bit GEMV (the H200
# must retire ~18 weight bytes a clock an SM to keep up with HBM; ptxas made 5.0-6.6 an element of the fp8 form with
# a multiply, an add, two conversions and a shared-memory broadcast of a, 3.6-5.6 of the int8 form). So for 8-bit
# weights (BYTES): fp8 products are one fma (exact products: the same sum as a multiply then an add, which
# enable_fp_fusion=False keeps apart otherwise), int8 takes dp4a (DP4A: four products and their sum into an
# accumulator, one instruction), and a is read in w's layout: 3.7-5.1 and 0.8-1.3 instructions an element
# (benchmarks.gemv_instructions, results/gemv_instructions.md). bf16 / fp16 keep the multiply, the add and the
# broadcast a: with the fma and a read in w's layout their K = 2048 shapes were up to 14% slower on the H200 (the
# 1B's gate-up 19.7 against 17.3 µs, results/gemv_forms_ab.md).
@triton.jit(do_not_specialize=["M"])
def _small_m_gemv_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, amax_ptr, M, N, stride_am, stride_wn,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTEGER: tl.constexpr, SCALED: tl.constexpr,
    A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
    INT64: tl.constexpr, PDL: tl.constexpr, BYTES: tl.constexpr, DP4A: tl.constexpr, GATED: tl.constexpr,
    H: tl.constexpr, QUANT_A: tl.constexpr = False, PRELOAD: tl.constexpr = 0,
):
    # GATED: as _small_m_gemm_kernel's, BLOCK_N gate rows and their up rows (two accumulators).
    # PRELOAD: the first PRELOAD loop steps' weight tiles loaded into registers before the wait for the kernel
    # before (the weights do not depend on it; SmallMConfig.PRELOAD), the rest after it (without PDL: first).
    # QUANT_A (8-bit w): a is in a float dtype, quantized to w's dtype as loaded with the static per-tensor scale
    # a_scale_ptr[0] (quantize_by_scale: ops.static_scaled_{fp8,int8}_quant's values), once an element (a's row
    # read and quantized flat, then broadcast over the tile's rows); the epilogue then scales by that scale.
    pid = tl.program_id(0)
    row, offs_n, n_ok, pre, pre_up = _gemv_program(pid, w_ptr, M, N, stride_wn, K, BLOCK_N, BLOCK_K, EVEN, INT64, PDL,
                                                   GATED, PRELOAD)
    acc_type = tl.int32 if INTEGER else tl.float32
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=acc_type)
    acc_up = tl.zeros_like(acc)  # GATED only
    for k in tl.static_range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        # BYTES (8-bit weights): a's row read in w's layout (each row of the tile the same addresses, from L1), no
        # shared-memory broadcast and barrier a step; else read once and broadcast
        if BYTES and not QUANT_A:
            a_ptrs = a_ptr + row * stride_am + (offs_k[None, :] + 0 * offs_n[:, None])
        else:
            a_ptrs = a_ptr + row * stride_am + offs_k
        w, w_up = _step_tiles(pre, pre_up, w_ptr, offs_n, n_ok, N, stride_wn, k, K, BLOCK_K, EVEN, GATED, PRELOAD)
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0
            a = tl.load(a_ptrs, eviction_policy="evict_last")
        else:
            k_ok = offs_k < K
            a = tl.load(a_ptrs, mask=k_ok[None, :] if BYTES and not QUANT_A else k_ok, other=0.0,
                        eviction_policy="evict_last")
        if QUANT_A:  # products exact in the accumulator (8-bit x 8-bit), summed as the fma of the BYTES form
            a = quantize_by_scale(a.to(tl.float32), tl.load(a_scale_ptr), w_ptr.dtype.element_ty, True)
            acc += w.to(acc_type) * a.to(acc_type)[None, :]
        else:
            acc = _gemv_step(acc, w, a, INTEGER, BYTES, DP4A)
        if GATED:
            acc_up = _gemv_step(acc_up, w_up, a, INTEGER, BYTES, DP4A)
    y = tl.sum(acc, axis=1).to(tl.float32)[None, :]
    offs_m = tl.zeros((1,), dtype=offs_n.dtype) + row
    y = _epilogue(y, offs_m, offs_n, offs_m < M, n_ok, a_scale_ptr, w_scale_ptr, bias_ptr, SCALED, A_PER_TOKEN,
                  W_PER_CHANNEL, HAS_BIAS)
    if GATED:
        y_up = _epilogue(tl.sum(acc_up, axis=1).to(tl.float32)[None, :], offs_m, offs_n + N // 2, offs_m < M, n_ok,
                         a_scale_ptr, w_scale_ptr, bias_ptr, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
        _store_gated(y, y_up, out_ptr, amax_ptr, offs_m, offs_m < M, offs_n, n_ok, pid // M, N, BLOCK_N, H)
    else:
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=n_ok[None, :])


@triton.jit
def _gemv_program(pid, w_ptr, M, N, stride_wn, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN: tl.constexpr, INT64: tl.constexpr, PDL: tl.constexpr, GATED: tl.constexpr,
                  PRELOAD: tl.constexpr):
    """The unrolled GEMV program ``pid``'s ``(row, offs_n, n_ok, pre, pre_up)``: its row of a, its weight rows (GATED:
    its gate rows, the up rows ``N // 2`` after them) and which exist, and its first ``PRELOAD`` steps' weight tiles,
    read before the wait for the kernel before (with PDL; in registers, not prefetched into L2: SmallMConfig.PREFETCH's
    form made the 1B's step slower); then that wait, and the next launch let go."""
    row = pid % M
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
        row = row.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    n_ok = offs_n < (N // 2 if GATED else N)
    pre, pre_up = _preloaded_tiles(w_ptr, offs_n, n_ok, N, stride_wn, K, BLOCK_K, EVEN, GATED, PRELOAD)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    return row, offs_n, n_ok, pre, pre_up


@triton.jit
def _preloaded_tiles(w_ptr, offs_n, n_ok, N, stride_wn, K: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                     GATED: tl.constexpr, PRELOAD: tl.constexpr):
    """``(pre, pre_up)``: the unrolled GEMV's first ``PRELOAD`` loop steps' weight tiles (``GATED``: and their up rows',
    ``N // 2`` rows on), loaded into registers (SmallMConfig.PRELOAD: before the program's PDL wait)."""
    pre, pre_up = (), ()
    for i in tl.static_range(PRELOAD):
        pre = pre + (_w_tile(w_ptr, offs_n, n_ok, stride_wn, i * BLOCK_K, K, BLOCK_K, EVEN),)
        if GATED:
            pre_up = pre_up + (_w_tile(w_ptr, offs_n + N // 2, n_ok, stride_wn, i * BLOCK_K, K, BLOCK_K, EVEN),)
    return pre, pre_up


@triton.jit
def _step_tiles(pre, pre_up, w_ptr, offs_n, n_ok, N, stride_wn, k: tl.constexpr, K: tl.constexpr,
                BLOCK_K: tl.constexpr, EVEN: tl.constexpr, GATED: tl.constexpr, PRELOAD: tl.constexpr):
    """Loop step ``k``'s weight tile and (``GATED``) its up rows' (else the tile again, unused): from
    :func:`_preloaded_tiles`' registers, or loaded now."""
    if k // BLOCK_K < PRELOAD:
        w = pre[k // BLOCK_K]
        w_up = w
        if GATED:
            w_up = pre_up[k // BLOCK_K]
    else:
        w = _w_tile(w_ptr, offs_n, n_ok, stride_wn, k, K, BLOCK_K, EVEN)
        w_up = w
        if GATED:
            w_up = _w_tile(w_ptr, offs_n + N // 2, n_ok, stride_wn, k, K, BLOCK_K, EVEN)
    return w, w_up


@triton.jit
def _w_tile(w_ptr, offs_n, n_ok, stride_wn, k, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """The GEMV's weight tile of rows ``offs_n`` (``n_ok``: those that exist) and K columns ``k ... k + BLOCK_K``
    (streamed once: ``evict_first``); EVEN: no mask (every row and column exists)."""
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k + tl.arange(0, BLOCK_K))[None, :]
    if EVEN:
        return tl.load(w_ptrs, eviction_policy="evict_first")
    k_ok = (k + tl.arange(0, BLOCK_K)) < K
    return tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")


# The unrolled GEMV over ROWS (2, 4 or 8) rows of a a program (SmallMConfig.UNROLL with BLOCK_M > 1): each weight tile
# is loaded and converted once and multiplied into ROWS accumulators, each [BLOCK_N, BLOCK_K] in the tile's layout,
# where one row a program reads each weight once from HBM and ROWS - 1 times from L2, each read with its own load
# and conversion instructions. A product is one instruction: dp4a for four int8 ones (BYTES: a read in w's layout,
# as the one-row form does), an fma for fp8 and bf16 / fp16 (their products are exact in fp32), with a's row
# converted to fp32 once and broadcast over the tile's rows through shared memory (read in w's layout, each thread
# converted its own copy of a row: more instructions). In the sm_90 SASS (results/gemv_instructions_rows.md) the 8B's
# 8 x 512 fp8 tile takes 6.69 instructions a weight element at 2 rows and 11.28 at 4, bf16's 2 x 1024 tile 9.5 and
# 15.62, int8's 8 x 512 2.0 and 3.44: what an SM can issue at the H200's HBM speed is ~7 an element for 8-bit
# weights, ~14 for 16-bit, so the form pays at few rows (the table takes it at M = 2).
# Explicit accumulators, not one [ROWS, BLOCK_N, BLOCK_K] tensor: with the 3D form Triton converted the weights
# once a row and moved the tile through shared memory (its sm_90 SASS: 2x-4x the instructions an element).
@triton.jit(do_not_specialize=["M"])
def _small_m_gemv_rows_kernel(
    a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, M, N, stride_am, stride_wn, K: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTEGER: tl.constexpr, SCALED: tl.constexpr,
    A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
    INT64: tl.constexpr, PDL: tl.constexpr, BYTES: tl.constexpr, DP4A: tl.constexpr, PRELOAD: tl.constexpr = 0,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, ROWS)
    row = (pid % num_m) * ROWS
    offs_n = (pid // num_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
        row = row.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    n_ok = offs_n < N
    pre = ()
    for i in tl.static_range(PRELOAD):  # as the one-row kernel's
        pre = pre + (_w_tile(w_ptr, offs_n, n_ok, stride_wn, i * BLOCK_K, K, BLOCK_K, EVEN),)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32 if INTEGER else tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    for k in tl.static_range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        if k // BLOCK_K < PRELOAD:
            w = pre[k // BLOCK_K]
        else:
            w = _w_tile(w_ptr, offs_n, n_ok, stride_wn, k, K, BLOCK_K, EVEN)  # EVEN: N % BLOCK_N == K % BLOCK_K == 0
        if not DP4A:
            w = w.to(tl.int32 if INTEGER else tl.float32)  # once for every row
        a_ptrs = a_ptr + row * stride_am + offs_k
        if BYTES:  # a's rows in w's layout (each tile row the same addresses, from L1)
            a_ptrs = a_ptrs[None, :] + 0 * offs_n[:, None]
        acc0 = _gemv_row(acc0, w, a_ptrs, row < M, offs_k < K, BYTES, DP4A)
        if ROWS > 1:
            acc1 = _gemv_row(acc1, w, a_ptrs + stride_am, row + 1 < M, offs_k < K, BYTES, DP4A)
        if ROWS > 2:
            acc2 = _gemv_row(acc2, w, a_ptrs + 2 * stride_am, row + 2 < M, offs_k < K, BYTES, DP4A)
            acc3 = _gemv_row(acc3, w, a_ptrs + 3 * stride_am, row + 3 < M, offs_k < K, BYTES, DP4A)
        if ROWS > 4:
            acc4 = _gemv_row(acc4, w, a_ptrs + 4 * stride_am, row + 4 < M, offs_k < K, BYTES, DP4A)
            acc5 = _gemv_row(acc5, w, a_ptrs + 5 * stride_am, row + 5 < M, offs_k < K, BYTES, DP4A)
            acc6 = _gemv_row(acc6, w, a_ptrs + 6 * stride_am, row + 6 < M, offs_k < K, BYTES, DP4A)
            acc7 = _gemv_row(acc7, w, a_ptrs + 7 * stride_am, row + 7 < M, offs_k < K, BYTES, DP4A)
    pointers = (a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr)
    _store_row(acc0, row, M, N, offs_n, n_ok, pointers, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
    if ROWS > 1:
        _store_row(acc1, row + 1, M, N, offs_n, n_ok, pointers, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
    if ROWS > 2:
        _store_row(acc2, row + 2, M, N, offs_n, n_ok, pointers, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
        _store_row(acc3, row + 3, M, N, offs_n, n_ok, pointers, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
    if ROWS > 4:
        _store_row(acc4, row + 4, M, N, offs_n, n_ok, pointers, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
        _store_row(acc5, row + 5, M, N, offs_n, n_ok, pointers, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
        _store_row(acc6, row + 6, M, N, offs_n, n_ok, pointers, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
        _store_row(acc7, row + 7, M, N, offs_n, n_ok, pointers, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)


@triton.jit
def _gemv_row(acc, w, a_ptrs, row_ok, k_ok, BYTES: tl.constexpr, DP4A: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_K]`` plus one row of a (at ``a_ptrs``: ``[BLOCK_N, BLOCK_K]`` in ``w``'s layout with
    BYTES, int8's form, else ``[BLOCK_K]``, fp8's and bf16's) times the tile ``w``, already in the accumulator's type
    (int8 as loaded with DP4A)."""
    if BYTES:
        a = tl.load(a_ptrs, mask=row_ok & k_ok[None, :], other=0.0, eviction_policy="evict_last")
    else:
        a = tl.load(a_ptrs, mask=row_ok & k_ok, other=0.0, eviction_policy="evict_last")
    if DP4A:
        acc = _dp4a(w, a, acc)
    elif BYTES:  # int8 where dp4a does not fit (unaligned rows, masked tiles): widened products, exact
        acc += w * a.to(tl.int32)
    else:  # the products of 8- and 16-bit floats are exact in fp32: an fma sums as a multiply and an add would
        acc = tl.fma(w, tl.broadcast_to(a.to(acc.dtype)[None, :], acc.shape), acc)
    return acc


@triton.jit
def _store_row(acc, row, M, N, offs_n, n_ok, pointers, SCALED: tl.constexpr, A_PER_TOKEN: tl.constexpr,
               W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Row ``row``'s outputs of a program: ``acc``'s sum over K, the epilogue, the store (none past ``M``);
    ``pointers``: the kernel's a_scale, w_scale, bias (None where it has none) and out pointers."""
    a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr = pointers
    offs_m = tl.zeros((1,), dtype=offs_n.dtype) + row
    y = _epilogue(tl.sum(acc, axis=1).to(tl.float32)[None, :], offs_m, offs_n, offs_m < M, n_ok, a_scale_ptr,
                  w_scale_ptr, bias_ptr, SCALED, A_PER_TOKEN, W_PER_CHANNEL, HAS_BIAS)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & n_ok[None, :])


@triton.jit
def _gemv_step(acc, w, a, INTEGER: tl.constexpr, BYTES: tl.constexpr, DP4A: tl.constexpr):
    """``acc [BLOCK_N, BLOCK_K]`` plus ``w * a`` (``a`` in ``w``'s layout with BYTES, else one row broadcast)."""
    acc_type = tl.int32 if INTEGER else tl.float32
    if DP4A:
        acc = _dp4a(w, a, acc)
    elif INTEGER:  # widened first: int8 * int8 overflows int8; the int32 sum is exact
        acc += w.to(acc_type) * a.to(acc_type)
    elif BYTES:
        acc = tl.fma(w.to(acc_type), a.to(acc_type), acc)
    else:
        acc += w.to(acc_type) * a.to(acc_type)[None, :]
    return acc


@triton.jit
def _dp4a(w, a, acc):
    """``acc`` plus ``w * a`` (int8, one layout), four elements an instruction: the four products' sum goes to the
    first of the four accumulators, the other three pass through. The four must be one row's adjacent K (the launcher
    takes this form only where each thread holds 16 of them: ``_dp4a_fits``); the final sum over K is the same."""
    return tl.inline_asm_elementwise(
        "{ dp4a.s32.s32 $0, $4, $5, $6; mov.b32 $1, $7; mov.b32 $2, $8; mov.b32 $3, $9; }",
        "=r,=r,=r,=r,r,r,r,r,r,r", [w, a, acc], dtype=tl.int32, is_pure=True, pack=4)


@triton.jit(do_not_specialize=["MN"])
def _small_m_split_k_epilogue_kernel(
    ws_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, out_ptr, MN, N, BLOCK: tl.constexpr, SPLIT_K: tl.constexpr,
    SCALED: tl.constexpr, A_PER_TOKEN: tl.constexpr, W_PER_CHANNEL: tl.constexpr, HAS_BIAS: tl.constexpr,
    INT64: tl.constexpr, PDL: tl.constexpr,
):
    # The split-K partials [SPLIT_K, M, N] summed in split order (int32: exact; fp32: the same order every
    # run), then _small_m_gemm_kernel's epilogue. One flat block of the MN = M * N outputs a program.
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    ws_offs = offs  # int64 with offs when INT64: the sums below stay int64
    acc = tl.load(ws_ptr + ws_offs, mask=mask, other=0)
    for _ in tl.static_range(1, SPLIT_K):
        ws_offs += MN
        acc += tl.load(ws_ptr + ws_offs, mask=mask, other=0)
    y = acc.to(tl.float32)
    if SCALED:
        if A_PER_TOKEN:
            y = y * tl.load(a_scale_ptr + offs // N, mask=mask, other=1.0)
        else:
            y = y * tl.load(a_scale_ptr)
        if W_PER_CHANNEL:
            y = y * tl.load(w_scale_ptr + offs % N, mask=mask, other=1.0)
        else:
            y = y * tl.load(w_scale_ptr)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


#: The most rows of a a program of the unrolled GEMV takes (``SmallMConfig.UNROLL``): its accumulators are
#: ``BLOCK_M x BLOCK_N x BLOCK_K`` registers over the program's threads.
UNROLL_MAX_ROWS = 8


@dataclasses.dataclass(frozen=True)
class SmallMConfig:
    """One launch configuration of the small-M GEMM.

    Attributes:
        BLOCK_M: rows a program (a power of 2; >= 16 with ``DOT``, whose tile rows past M are masked to zero;
            M beyond it takes more programs, each reading the same weights, mostly from L2).
        BLOCK_N: output columns a program (weight rows it streams).
        BLOCK_K: K a loop step.
        SPLIT_K: programs along K, their partials summed by a second kernel.
        DOT: ``tl.dot`` (tensor cores) rather than the broadcast-multiply + ``tl.sum`` GEMV form.
        num_warps, num_stages: Triton's launch options.
        PREFETCH: loop steps (``BLOCK_K`` columns) of each program's weights prefetched into L2 before the
            program waits for the kernel before it: with programmatic dependent launch (``pdl_launch``) the
            weight read of this GEMM then starts while the previous kernel finishes. 0: none. Default 1: on the
            H200 the 8B stack at M = 1 took 4076 / 2301 µs (bf16 / fp8) with 1, 4156 / 2318 with 0, 4204 / 2322
            with 4 (``benchmarks.gemm --prefetch``); after a kernel that does not signal early it costs nothing.
            The dot-tile forms only: given to the unrolled GEMV too, it made the 1B's level-3 step at batch 1
            7% slower on an H100 (1140.7 / 1132.1 µs with 1, 1261.8-1267.2 with 8, 1061.3 / 1061.9 without:
            results/gemm_step_ab_gemv_prefetch_1b_h100.md).
        SWAP: ``tl.dot(w, a.T)`` instead of ``tl.dot(a, w.T)`` (``DOT`` only): the weight tile is the MMA's tall
            side, so that ``BLOCK_N >= 64`` tiles can take Hopper's wgmma at a decode batch's few rows. The table's
            bf16 / fp16 rows at 2-32 tokens and fp8's down and qkv at 2-16 take it (their comments say what was
            measured); int8 keeps the unswapped tiles: at M = 32 the sweep timed it fastest alone on 7 of the 8 fp8 /
            int8 shapes (results/gemm_sweep_swap_m32_best.md), but inside the int8 step at batch 32 it was no faster
            (results/int8_table_step_ab_swap.md: 3928 / 3897 against 3876 / 3891 µs; that run's gate-up took qkv's
            swapped tile, ``benchmarks.gemm_step_ab`` then reversing rules of one ``max_m``).
        SERIAL: split K reduced in the kernel: each tile's last split to arrive (an arrival counter a tile) sums
            the partials, instead of a second kernel. Off by default: on the H200 it made the int8 8B stack at
            M = 1 6% slower with the table's split-K rows then (2765 against 2602 µs); the int8 down_proj rows at
            M = 32 and 128 take it (0.3-0.7% off those decode steps).
        UNROLL: the unrolled GEMV form (``DOT=False``, ``SPLIT_K=1``): one compile a K, every loop step unrolled
            so that all of a program's weight loads are in flight at once, and one reduction a program instead of
            one a loop step (the rolled GEMV form's). ``num_stages`` does not apply. ``BLOCK_M`` rows of a a
            program (at most ``UNROLL_MAX_ROWS``): 1 (a row a program: the only form the gated, quantizing and
            rotary GEMVs have) or more, each weight tile loaded once for all of them.
        PRELOAD: ``UNROLL`` only: loop steps of each program's weights loaded into registers before the program
            waits for the kernel before it (programmatic dependent launch): the read of this GEMV's first weights
            overlaps the previous kernel's tail, with no instruction added (``PREFETCH``'s L2 prefetch, the dot
            tiles' form, adds one a cache line). 0 (the dataclass's default): every load after the wait; the
            table's one-token rows take 2, of which the launcher gives at most half a program's steps
            (:func:`preload_steps`, which says what was measured). The same results.
        TMA: ``DOT`` only: each loop step's ``a`` and ``w`` tiles read by Hopper's tensor memory accelerator (a
            tensor descriptor's bulk copy into shared memory, one instruction a tile, rows and K past the operands
            zero-filled) instead of a masked load a pointer. Where the operands cannot take a descriptor (a base or
            row stride not 16-byte aligned, a GPU before Hopper) and in the gated form the same tile runs with
            pointer loads (:func:`tma_operands`). The same results.
    """

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    DOT: bool = True
    num_warps: int = 4
    num_stages: int = 3
    PREFETCH: int = 1
    SERIAL: bool = False
    SWAP: bool = False
    UNROLL: bool = False
    PRELOAD: int = 0
    TMA: bool = False

    def __post_init__(self) -> None:
        for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"SmallMConfig: {name} must be a power of 2; got {v}")
        if self.DOT and min(self.BLOCK_M, self.BLOCK_N, self.BLOCK_K) < 16:
            raise ValueError(f"SmallMConfig: tl.dot (DOT=True) needs BLOCK_M, BLOCK_N, BLOCK_K >= 16; got {self}")
        if self.SWAP and not self.DOT:
            raise ValueError(f"SmallMConfig: SWAP (w @ a.T) is a tl.dot form: it needs DOT=True; got {self}")
        if self.UNROLL and (self.DOT or self.BLOCK_M > UNROLL_MAX_ROWS or self.SPLIT_K != 1):
            raise ValueError(f"SmallMConfig: UNROLL (the unrolled GEMV) needs DOT=False, BLOCK_M <= {UNROLL_MAX_ROWS} "
                             f"and SPLIT_K=1; got {self}")
        if self.SPLIT_K < 1 or self.num_stages < 1 or self.PREFETCH < 0 or self.PRELOAD < 0:
            raise ValueError(f"SmallMConfig: SPLIT_K and num_stages must be >= 1, PREFETCH and PRELOAD >= 0; "
                             f"got {self}")
        if self.TMA and not self.DOT:
            raise ValueError(f"SmallMConfig: TMA (tensor-descriptor loads) is a tl.dot form: it needs DOT=True; got "
                             f"{self}")
        if self.PRELOAD and not self.UNROLL:
            raise ValueError(f"SmallMConfig: PRELOAD (weights loaded before the wait) is the unrolled GEMV's "
                             f"(UNROLL=True); got {self}")


#: M at most this takes the Triton kernel in the public ops (``small_m_config``'s default); above, cuBLAS.
SMALL_M_MAX = 16
#: int8 takes it up to this M (decode batches): cuBLASLt's int8 GEMM behind ``torch._int_mm`` was 2.3-2.9x slower
#: than the kernel at every 8B shape at M <= 16 (padded to 24 rows), far from its bf16 and fp8 GEMMs.
INT8_TRITON_MAX_M = 128
#: bf16 / fp16 (``ops.linear`` and the linear ops built on it) take it up to this M: the swapped dot tiles beat
#: cuBLAS on the 8B's shapes at M <= 32, and on its down_proj and lm_head at 33-128 and its o_proj at 33-64 (the
#: table's rows say by how much).
F16_TRITON_MAX_M = 128
#: Per operand dtype, the largest M the public ops take the kernel for (a dtype not here: ``SMALL_M_MAX``); the
#: table's rows above it are for ``benchmarks.gemm``'s crossover (``benchmarks.gemm_step_ab`` raises an entry to A/B
#: such a row inside a decode step).
TRITON_MAX_M: dict[torch.dtype, int] = {torch.int8: INT8_TRITON_MAX_M, torch.bfloat16: F16_TRITON_MAX_M,
                                         torch.float16: F16_TRITON_MAX_M}


@dataclasses.dataclass(frozen=True)
class SmallMRule:
    """One row of :data:`SMALL_M_TABLE`: GEMMs of at most ``max_m`` rows with operands of a dtype in ``dtypes``,
    ``k >= min_ratio * n`` and ``n >= min_n`` take ``config``; None: cuBLAS is as fast or faster there."""

    max_m: int
    dtypes: tuple[torch.dtype, ...]
    min_ratio: float
    min_n: int
    config: SmallMConfig | None


_C, _R = SmallMConfig, SmallMRule
_I8, _F8, _F16 = (torch.int8,), (torch.float8_e4m3fn,), (torch.bfloat16, torch.float16)
#: The first rule that fits wins. Measured on the H200 (torch 2.11, Triton 3.6; ``benchmarks.gemm --sweep``,
#: results/gemm_sweep*.csv) on Llama-3-8B's shapes at M = 1, 4, 16, µs ours / cuBLAS at M = 1; a config's time
#: hardly moves with M up to 16 (the weight read is the cost). From M = 2 ``tl.dot`` on 16-row tiles won every
#: shape; the rolled GEMV form never did, the unrolled one does at M = 1. Rows past ``SMALL_M_MAX`` exist for
#: ``benchmarks.gemm`` to find the crossover with cuBLAS.
SMALL_M_TABLE: tuple[SmallMRule, ...] = (
    # M = 1, 8-bit weights: the unrolled GEMV with one fma (fp8) or dp4a (int8) a weight element, from the separated
    # sweep of it beside cuBLAS and swapped 16-row dot tiles (results/gemm_sweep_separated_m1.csv), µs ours / cuBLAS
    # (int8: / the M <= 16 dot row below). Every 8B shape faster than both. Each with two loop steps' weights read
    # before its PDL wait (PRELOAD, at most half a program's steps: preload_steps): the fp8 8B's step at batch 1 3.7%
    # faster on an H100 (results/gemm_step_ab_preload_8b_fp8_h100.md), the bf16 8B's 1.3% (..._preload_8b_h100.md).
    _R(1, _I8, 2.0, 0, _C(1, 4, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),  # down 16.1 / 19.0
    # gate-up 28.7 / 31.7
    _R(1, _I8, 0.0, 16384, _C(1, 8, 256, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),
    # qkv 8.0 / 10.3, o 6.3 / 8.4
    _R(1, _I8, 0.0, 0, _C(1, 8, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),
    _R(1, _F8, 2.0, 0, _C(1, 4, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),  # down 16.6 / 20.1
    # gate-up 29.3 / 30.6
    _R(1, _F8, 0.0, 16384, _C(1, 16, 256, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),
    # qkv 8.5 / 10.2
    _R(1, _F8, 0.0, 6144, _C(1, 8, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),
    _R(1, _F8, 0.0, 0, _C(1, 16, 1024, DOT=False, num_warps=8, num_stages=1, UNROLL=True, PRELOAD=2)),  # o 6.5 / 7.5
    # M = 2, Llama-3-8B's shapes (N >= 4096): the unrolled GEMV, a row a program, or over both rows for qkv, from the
    # sweep of it on an H100 (results/gemm_sweep_separated_rows_int8_h100.md, µs ours / the M <= 16 row below) and the
    # 8B int8 step at batch 2 (results/gemm_step_ab_rows{,_r1}_int8_h100.md, four alternating runs: 3628.3-3672.2 µs
    # against 3685.5-3696.6; qkv on a row a program too: 3660.2 / 3667.3). At batch 3 and 4 the sweep's picks on 2 and
    # 4 rows a program were no faster in the step than the dot tiles; at 8 the GEMV over 8 rows was 26% slower
    # (results/gemm_step_ab_rows_first_int8_h100.md). Each with two loop steps preloaded (PRELOAD, as at M = 1): the
    # int8 8B step at batch 2 3429.5 / 3423.6 µs against 3540.0 / 3531.7 (H100, results/
    # gemm_step_ab_preload_m2_8b_int8_h100.md); bf16's M = 2 rows stay without: its 8B step was 0.8% slower with
    # (5800.6 / 5776.8 against 5757.2 / 5733.5, gemm_step_ab_preload_m2_8b_h100.md).
    # down 22.2 / 23.8
    _R(2, _I8, 2.0, 4096, _C(1, 4, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),
    # gate-up 40.4 / 42.5: the int8 model's gate-up runs the gated form (GATED_ROWS) where gemm_act_quant is on
    _R(2, _I8, 0.0, 16384, _C(1, 8, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),
    # qkv 10.5 / 11.7
    _R(2, _I8, 0.0, 6144, _C(2, 4, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),
    _R(2, _I8, 0.0, 4096, _C(1, 8, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),  # o 7.6 / 9.2
    # int8: torch._int_mm (M padded to 24) is 2.3-2.9x slower at every shape.
    # down at M <= 16 with its two splits summed in the kernel (SERIAL): the 8B int8 step at batch 8 / 16 3818.4 /
    # 4066.7 and 3816.6 / 4065.0 µs against 3838.2 / 4090.1 and 3838.1 / 4089.3 (H100,
    # results/gemm_step_ab_serial_int8_h100.md).
    _R(16, _I8, 2.0, 0, _C(16, 32, 256, SPLIT_K=2, num_warps=4, num_stages=4, SERIAL=True)),  # down 14336->4096:
    # 18.1 / 42.2
    _R(16, _I8, 0.0, 16384, _C(16, 64, 128, num_warps=4, num_stages=4)),  # gate-up 4096->28672: 29.9 / 45.4
    _R(16, _I8, 0.0, 0, _C(16, 32, 512, num_warps=4, num_stages=3)),  # qkv 9.2 / 21.8, o 7.5 / 21.5
    # M = 1, bf16 / fp16: the unrolled GEMV (UNROLL) in its plain form, from the separated sweeps of it (results/
    # gemm_sweep_separated_unroll.csv, gemm_sweep_llama-3.2-1b_separated_unroll.csv), µs ours / cuBLAS, 8B then 1B:
    # faster on every shape.
    # down 30.5 / 32.6, 10.1 / 13.5
    _R(1, _F16, 2.0, 0, _C(1, 2, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),
    # qkv 14.6 / 16.0, 5.1 / 6.7; o 10.7 / 13.5, 4.1 / 6.1; gate-up 55.3 / 62.3, 17.5 / 18.6; lm_head 231.3 / 252.4,
    # 117.9 / 129.4
    _R(1, _F16, 0.0, 0, _C(1, 2, 1024, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)),
    # M = 2, bf16 / fp16, Llama-3-8B's shapes (N >= 4096), as int8's above: µs ours / the M <= 16 row (cuBLAS for qkv)
    # in the H100 sweep (results/gemm_sweep_separated_rows_bf16_h100.md); the 8B step at batch 2 5777.8 / 5780.5 µs
    # against 5930.9 / 5891.1 (results/gemm_step_ab_rows_bf16_h100.md; this table against the one before on another
    # machine: 5850.2 against 5929.6, gemm_step_ab_rows_bf16_final_h100.md). On the 1B's shapes the same rows made its
    # batch-2 step slower (1258.0 / 1281.2 against 1252.9 / 1254.3, gemm_step_ab_rows_bf16_1b_h100.md), hence
    # N >= 4096. Gate-up and the lm_head (N >= 16384) take the M <= 16 row's swapped 16-row tile: 79.69 / 82.09 µs
    # (cuBLAS) and 338.74 / 344.14 (the unswapped tile before) in the H100 sweep
    # (results/gemm_sweep_best_bf16_swap_m2_16_h100.md); the 8B step at batch 2 5614.8 / 5612.0 µs against 5743.0 /
    # 5715.6, the 1B's 1243.6 / 1233.3 against 1231.7 / 1234.4 (results/gemm_step_ab_bf16_swap_m2_{8b,1b}_h100.md).
    _R(2, _F16, 2.0, 4096, _C(1, 4, 1024, DOT=False, num_warps=4, num_stages=1, UNROLL=True)),  # down 41.7 / 42.3
    _R(2, _F16, 0.0, 16384, _C(16, 64, 128, num_warps=4, num_stages=6, SWAP=True)),  # gate-up, lm_head
    _R(2, _F16, 0.0, 6144, _C(2, 8, 256, DOT=False, num_warps=4, num_stages=1, UNROLL=True)),  # qkv 19.0 / 20.9
    _R(2, _F16, 0.0, 4096, _C(1, 8, 256, DOT=False, num_warps=4, num_stages=1, UNROLL=True)),  # o 13.4 / 14.9
    # fp8: the product swapped on 16-row tiles for the long-K down_proj (two splits summed in the kernel, SERIAL) and
    # qkv; cuBLAS's per-tensor GEMM for gate-up and o. From the separated sweep of the swapped tiles at 8 and 16 rows
    # on an H100 (results/gemm_sweep_best_8bit_swap_m8_16_h100.md), µs at M = 8 ours / cuBLAS or the row before
    # (four unswapped splits): down 23.56 / 24.87 (the sweep's tile summed by a second kernel), qkv 11.44 / 12.06
    # (M = 16: this row's tile 11.54 / 12.00), gate-up 41.81 / 41.59, o 9.08 / 8.56. The fp8 8B step at batch 4 / 8 /
    # 16 3486.8 / 3581.0 / 3846.3 and 3492.1 / 3588.7 / 3847.9 µs against 3697.5 / 3833.9 / 4104.8 and 3703.4 /
    # 3846.6 / 4101.1 with the rows before; qkv's row alone 3673.8 / 3803.7 / 4050.0 and 3654.6 / 3776.1 / 4053.4
    # (H100, results/gemm_step_ab_fp8_swap16_h100.md).
    _R(16, _F8, 2.0, 0, _C(16, 64, 256, SPLIT_K=2, num_warps=4, num_stages=4, SERIAL=True, SWAP=True)),  # down
    _R(16, _F8, 0.0, 16384, None),  # gate-up
    _R(16, _F8, 0.0, 6144, _C(16, 64, 128, num_warps=4, num_stages=6, SWAP=True)),  # qkv
    _R(16, _F8, 0.0, 0, None),  # o
    # bf16 / fp16 (ops.linear, which the small_m_linear graph pass puts in place of a compiled linear's GEMM) at
    # M = 3-16 on shapes of N >= 4096 (all the 8B's; the 1B's gate-up and lm_head): the product swapped on 16-row
    # tiles, the weight rows the wgmma's tall side, from the separated sweep of those tiles at 2-16 rows on an H100
    # (results/gemm_sweep_best_bf16_swap_m2_16_h100.md), µs ours / the rows below or cuBLAS at M = 8: qkv 20.18 /
    # 21.41 (cuBLAS), o 14.29 / 15.41, gate-up 80.51 / 82.75 (cuBLAS; the sweep's best 80.42 on 128 columns), down
    # 43.37 / 43.89, lm_head 342.84 / 347.97. The 8B step at batch 4 / 8 / 16 5658.6 / 5764.6 / 6022.3 and 5661.8 /
    # 5743.9 / 6011.9 µs against 5943.7 / 5949.4 / 6226.6 and 5943.2 / 5940.6 / 6196.6 with the rows below (H100,
    # results/gemm_step_ab_bf16_swap16_8b_h100.md); the 1B's 1261.3 / 1283.8 / 1342.2 and 1263.5 / 1281.1 / 1334.7
    # against 1279.4 / 1296.7 / 1343.3 and 1264.7 / 1291.1 / 1340.4 (..._1b_h100.md).
    _R(16, _F16, 0.0, 4096, _C(16, 64, 128, num_warps=4, num_stages=6, SWAP=True)),
    # The narrower shapes (the 1B's), from the separated sweeps (results/gemm_sweep_separated.csv,
    # gemm_sweep_llama-3.2-1b_separated.csv: each call after a small kernel, as in a decode step; back to back, the
    # kernel's PDL overlap flattered it by up to 1.3 µs), µs ours / cuBLAS at M = 1, 8B then 1B.
    # The two splits summed in the kernel (SERIAL), not by a second kernel: 1.5-2.0% off the 8B's and the 1B's steps at
    # batch 8 and 16 (H100, two alternating runs each: 8B 6182.3 / 6181.3 against 6309.4 / 6311.1 µs at batch 8;
    # results/gemm_step_ab_serial_bf16_{8b,1b}_h100.md).
    _R(16, _F16, 1.0, 0, _C(16, 32, 256, SPLIT_K=2, num_warps=4, num_stages=4, SERIAL=True)),  # down 31.5 / 32.7,
    # 12.4 / 13.5;
    # o 11.9 / 13.5, 6.0 / 6.2
    _R(16, _F16, 0.0, 0, None),  # qkv 16.3 / 15.6, 7.1 / 6.8 (best configs)
    # bf16 / fp16 at M = 17-32 (up to F16_TRITON_MAX_M), Llama-3-8B's shapes: the product swapped (w @ a.T: the
    # weight rows the wgmma's tall side), from the separated sweep at M = 32 on an H100
    # (results/gemm_sweep_best_bf16_m32_separated_h100.md), µs ours / cuBLAS. The 8B step with these rows
    # (results/gemm_step_ab_bf16_m32_final_8b_h100.md, two alternating runs) at batch 24 6295.3 / 6292.7 µs against
    # 6499.8 / 6602.6 with cuBLAS at 17-32, at 32 6488.1 / 6461.2 against 6734.5 / 6824.6 (the first A/B,
    # gemm_step_ab_bf16_m32_h100.md, ran every shape on the last rule's tile: gemm_step_ab then reversed rules of one
    # max_m). Above 32: the rows below (the first A/B of the M = 64 sweep's picks,
    # results/gemm_step_ab_bf16_m64_h100.md, ran cuBLAS in both variants for that reason).
    _R(32, _F16, 2.0, 4096, _C(32, 64, 128, num_warps=4, num_stages=6, SWAP=True)),  # down 42.6 / 44.7
    _R(32, _F16, 0.0, 65536, _C(32, 256, 128, num_warps=8, num_stages=3, SWAP=True)),  # lm_head 342.3 / 366.2
    _R(32, _F16, 0.0, 16384, _C(32, 128, 128, num_warps=8, num_stages=4, SWAP=True)),  # gate-up 80.0 / 80.6
    _R(32, _F16, 0.0, 4096, _C(32, 64, 128, num_warps=4, num_stages=6, SWAP=True)),  # qkv 20.4 / 21.9, o 14.3 / 14.3
    # The narrower shapes (Llama-3.2-1B's) at M = 17-32: its down_proj (K 8192 -> 2048) on swapped 32-row tiles over
    # two splits summed in the kernel, its qkv (2048 -> 3072) on one split, both read by tensor descriptors; its
    # o_proj (2048 -> 2048) stays on cuBLAS (1.015x). From the separated sweep at M = 32 on an H100
    # (results/gemm_sweep_best_llama-3.2-1b_separated_narrow_h100.md, µs ours / cuBLAS: down 15.65 / 16.93, qkv 7.32 /
    # 7.47); the 1B step at batch 32 1393.5 / 1389.2 µs against 1430.0 / 1439.5 with cuBLAS there (H100, two
    # alternating runs, results/gemm_step_ab_1b_narrow_attn_h100.md, variant gemm). At M = 128 cuBLAS won all three
    # (0.74-0.93x).
    _R(32, _F16, 4.0, 2048, _C(32, 64, 256, SPLIT_K=2, num_warps=4, num_stages=4, SERIAL=True, SWAP=True, TMA=True)),
    _R(32, _F16, 0.0, 3072, _C(32, 64, 256, num_warps=4, num_stages=4, SWAP=True, TMA=True)),
    _R(32, _F16, 0.0, 0, None),  # narrower still (the 1B's o_proj): cuBLAS
    # bf16 / fp16 at M = 33-128 (up to F16_TRITON_MAX_M): the 8B's down_proj and the lm_head (and o_proj at 33-64:
    # below); qkv, o and gate-up stayed on cuBLAS (as fast or faster alone there), as do the 1B's narrower shapes.
    # The sweeps' picks, µs ours / cuBLAS:
    # at M = 64 results/gemm_sweep_best_bf16_m64_separated_h100.md, at 128 the swapped down of
    # gemm_sweep_best_bf16_swap_m64_128_h100.md and the lm_head of gemm_sweep_best_bf16_m128_separated_h100.md. The 8B
    # step (H100, two alternating runs, results/gemm_step_ab_bf16_m64_128_h100.md, variant g against table, which had
    # cuBLAS above 32) at batch 64 7653.9 / 7672.1 µs against 7749.4 / 7761.2, at 128 9421.5 / 9479.5 against 9566.0
    # / 9604.0; the 1B's (gemm_step_ab_bf16_m64_128_1b_h100.md: its lm_head, K 2048, on these rows) 1.0% faster at
    # batch 64 and 0.3% slower at 128, hence the 128 row's lm_head only from K >= 0.03 N (the 8B's K 4096; the 1B's
    # 2048 is 0.016 N).
    # Then the tiles read by tensor descriptors (TMA): in the separated sweep of the wide and swapped tiles with each
    # load side by side (results/gemm_sweep_bf16_tma_m64_128_separated_h100.md, µs TMA / pointers / cuBLAS) faster
    # on every tile of the narrow shapes, and the 8B step with these rows (variant sweep) at batch 64 7358.7 / 7333.0
    # µs against 7449.6 / 7392.3, at 128 9157.0 / 9080.7 against 9210.3 / 9188.4 (H100, two alternating runs,
    # results/gemm_step_ab_bf16_tma_h100.md); qkv and gate-up stay on cuBLAS (as fast: 21.01 / 20.82 and 81.87 /
    # 83.08 at 64).
    _R(64, _F16, 3.5, 4096, _C(64, 64, 128, num_warps=4, num_stages=6, SWAP=True, TMA=True)),  # down 43.38 / 46.51
    # / 46.15
    _R(64, _F16, 1.0, 4096, _C(64, 64, 128, num_warps=4, num_stages=6, TMA=True)),  # o 14.64 / 16.03 / 14.97
    _R(64, _F16, 0.0, 65536, _C(64, 128, 128, num_warps=4, num_stages=4, SWAP=True)),  # lm_head 350.49 / 373.02
    _R(64, _F16, 0.0, 0, None),
    _R(128, _F16, 3.5, 4096, _C(64, 64, 128, num_warps=4, num_stages=6, TMA=True)),  # down 44.08 / 47.17 / 51.29
    # lm_head 363.9 / 376.18 (the pointer form; the row before) / 375.24
    _R(128, _F16, 0.03, 65536, _C(128, 128, 128, num_warps=8, num_stages=3, TMA=True)),
    _R(128, _F16, 0.0, 0, None),
    # int8 up to INT8_TRITON_MAX_M, from the sweeps at M = 32 and 128 (results/gemm_sweep_int8_m32_128*.csv, then
    # gemm_sweep_wide*.csv with 128-row, 128-column and deeper tiles), µs ours / cuBLAS's torch._int_mm.
    # down at M <= 32 and <= 128: the two splits summed in the kernel (SERIAL), not by a second kernel: in the int8
    # 8B step (results/int8_serial_split_k_ab.md, two alternating runs) batch 32 3811.4 / 3812.7 µs against
    # 3825.4 / 3822.3, batch 128 6037.6 / 6035.5 against 6063.5 / 6090.1; one split instead was 3-4% slower.
    _R(32, _I8, 2.0, 0, _C(32, 32, 256, SPLIT_K=2, num_warps=4, num_stages=4, SERIAL=True)),  # down: 19.4 / 41.6
    _R(32, _I8, 0.0, 16384, _C(32, 64, 128, num_warps=4, num_stages=4)),  # gate-up: 33.7 / 52.1; in the step too
    # (results/int8_table_step_ab.md: faster there than the wide sweep's 32x64x256 and the qkv/o row)
    _R(32, _I8, 0.0, 0, _C(32, 32, 256, num_warps=4, num_stages=4)),  # qkv 10.2 / 21.0, o 7.9 / 20.7
    _R(128, _I8, 2.0, 0, _C(64, 64, 128, SPLIT_K=2, num_warps=4, num_stages=5, SERIAL=True)),  # down: 25.7 / 44.8
    _R(128, _I8, 0.0, 16384, _C(128, 128, 128, num_warps=8, num_stages=3)),  # gate-up: 37.0 / 92.8 (was 64x64: 48.4)
    _R(128, _I8, 0.0, 6144, _C(64, 64, 128, num_warps=4, num_stages=5)),  # qkv: 12.2 / 33.8 (was 64x32: 14.8)
    _R(128, _I8, 0.0, 0, _C(64, 32, 256, num_warps=4, num_stages=4)),  # o: 9.7 / 23.4
    # Past the ops' range: untuned, for the benchmark's crossover.
    _R(32, _F8, 0.0, 0, _C(32, 64, 128, num_warps=4, num_stages=4)),
    _R(64, _F8, 0.0, 0, _C(64, 64, 128, num_warps=4, num_stages=4)),
)
del _C, _R, _I8, _F8, _F16


def small_m_config(m: int, n: int, k: int, dtype: torch.dtype, max_m: int = SMALL_M_MAX) -> SmallMConfig | None:
    """The table's config for an ``[m, k] x [n, k]`` GEMM with ``dtype`` operands, or None: use cuBLAS.

    Args:
        m, n, k: the GEMM's sizes (concrete ints: the ops call this at run time).
        dtype: the operands' dtype: int8, float8_e4m3fn, bfloat16 or float16.
        max_m: None above this M (default ``SMALL_M_MAX``, where the public ops switch to cuBLAS; the
            benchmark passes the table's largest M).
    """
    if m < 1 or m > max_m:
        return None
    for rule in SMALL_M_TABLE:
        if m <= rule.max_m and dtype in rule.dtypes and k >= rule.min_ratio * n and n >= rule.min_n:
            return rule.config
    return None


def small_m_operands(x: torch.Tensor, weight: torch.Tensor, max_m: int = SMALL_M_MAX) -> bool:
    """Whether the small-M kernels can take ``[M, K] x [N, K]`` operands: M at most ``max_m`` (tested first: a
    prefill pays one test), CUDA, ``x`` with unit column stride, ``weight`` contiguous. The eager ops' first test."""
    return x.shape[0] <= max_m and x.is_cuda and x.stride(1) == 1 and weight.is_contiguous()


def triton_max_m(dtype: torch.dtype) -> int:
    """The largest M the public ops take the kernel for with ``dtype`` operands: ``TRITON_MAX_M``'s entry, else
    ``SMALL_M_MAX``."""
    return TRITON_MAX_M.get(dtype, SMALL_M_MAX)


def runtime_config(a: torch.Tensor, w: torch.Tensor, max_m: int | None = None) -> SmallMConfig | None:
    """The kernel's config for these CUDA operands at an op's call, or None: the cuBLAS path (no Triton,
    ``DYNAMO_ONCE_SMALL_M_GEMM=0``, or M above :func:`triton_max_m`). Sizes are concrete here: the ops that call it
    (``ops.scaled_mm``, ``ops.linear``) run eagerly. ``max_m``: that range when the caller has it already."""
    if not HAS_TRITON:
        return None
    config = small_m_config(a.shape[0], w.shape[0], w.shape[1], a.dtype,
                            max_m=triton_max_m(a.dtype) if max_m is None else max_m)
    return config if config is not None and envs.small_m_gemm() else None


#: Per operand dtype, where ``ops.gated_quant``'s ops (8-bit) and ``ops.gated_linear`` (bf16 / fp16) run the gated form (gate-up GEMM, SiLU-and-mul and the
#: quantization's amax, or the quantization itself, in one kernel): ``(max_m, config)`` rows, ascending M; a config
#: of None, and every M past the last row, run the unfused pair (the GEMM op, then the activation's fused quant op).
#: Measured on the H200 on Llama-3-8B's gate-up (K 4096, 2D 28672), µs gated / unfused. int8 per token
#: (results/gated_gemm_int8_dynamic_before_rows.md; gated_gemm_int8_dynamic.md repeats it with these rows): M 1: 34.3
#: / 31.4 (the GEMV's gated form on half the warps loses), 8: 31.5 / 33.5, 16: 33.7 / 36.2, 32: 34.9 / 37.6 and 64:
#: 35.9 / 41.4 with 64 x 128 tiles (the table's 32 x 64: 39.5 at 32), 128: 42.4 / 43.5 (the first form was 7.3%
#: slower in the step there). fp8 static, per-tensor scales (cuBLAS's fast path; results/gated_gemm_fp8_static.md): M
#: 1: 32.8 / 29.5, 8: 31.0 / 32.8, 32: 34.1 / 34.0 (and the 8B step at batch 32 2.2% slower gated: the unfused pair
#: at 17-32), 64: 34.6 / 37.6, 128: 44.7 / 40.9; M 1 again with the fp8 GEMV's full warps (``gated_config``; results/
#: gated_gemm_fp8_static_m1_full_warps.md): 28.64 / 29.14 µs, 1.7% faster: fp8's M = 1 row is the table's gate-up
#: GEMV (``_GATED_GEMV_FP8``), which passes the CUDA tests (tests/ops/test_gated_quant.py) in that form.
#: bf16 / fp16 (``ops.gated_linear``, the ``gated_linear`` pass's op, on by default): M = 1 only, the plain table's
#: gate-up GEMV row (the gated form streams the same weight rows, half gate and half up). Measured on an H100
#: (results/gated_gemm_bf16{,_1b}_h100.md, µs gated / unfused): Llama-3.2-1B's gate-up at M 1 22.47 / 23.89,
#: Llama-3-8B's 75.80 / 76.62; at M 2-16 the gated form on the plain table's tile lost or tied ("gated table":
#: 27.59-27.98 / 27.27-28.00 and 86.09-86.80 / 84.46-85.52; the unfused pair there is cuBLAS then the activation), so
#: M 2-16 run the unfused pair; the gated form on the swapped 16-row tile was slower in the 8B's step than that pair
#: (the pair's GEMM now on those tiles too): 5807.2 / 5809.8 µs against 5749.2 / 5732.7 at batch 8, 6045.5 / 6053.7
#: against 5998.8 / 5948.6 at 16 (H100, results/gemm_step_ab_bf16_gated_swap16_h100.md).
#: fp8 at M 2-8: the gated form on swapped 16-row tiles of 128 weight rows (the 8-bit sweep's gate-up pick,
#: results/gemm_sweep_best_8bit_swap_m8_16_h100.md): the fp8 8B step at batch 8 3570.2 / 3561.2 µs against 3616.0 /
#: 3600.5 with ``_GATED_16``, at 16 slower (3897.1 / 3889.0 against 3872.2 / 3860.1; H100,
#: results/gemm_step_ab_fp8_gated_swap16_h100.md), hence 2-8; 2-7 not timed.
_GATED_16 = SmallMConfig(16, 64, 128, num_warps=4, num_stages=4)
_GATED_SWAP_FP8 = SmallMConfig(16, 128, 256, num_warps=8, num_stages=3, SWAP=True)
_GATED_64 = SmallMConfig(64, 128, 128, num_warps=4, num_stages=4)
_GATED_GEMV_F16 = SmallMConfig(1, 2, 1024, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)
_GATED_GEMV_FP8 = SmallMConfig(1, 16, 256, DOT=False, num_warps=4, num_stages=1, UNROLL=True, PRELOAD=2)
GATED_ROWS: dict[torch.dtype, tuple[tuple[int, SmallMConfig | None], ...]] = {
    torch.int8: ((1, None), (16, _GATED_16), (64, _GATED_64)),
    torch.float8_e4m3fn: ((1, _GATED_GEMV_FP8), (8, _GATED_SWAP_FP8), (16, _GATED_16), (32, None), (64, _GATED_64)),
    torch.bfloat16: ((1, _GATED_GEMV_F16),),
    torch.float16: ((1, _GATED_GEMV_F16),),
}


def gated_row(m: int, dtype: torch.dtype) -> SmallMConfig | None:
    """``GATED_ROWS``' config for ``m`` rows of ``dtype`` operands (before :func:`gated_config`), or None: the
    unfused ops."""
    return next((config for max_m, config in GATED_ROWS.get(dtype, ()) if m <= max_m), None)


def table_row(m: int, n: int, k: int, dtype: torch.dtype) -> SmallMConfig:
    """The table's row for an ``[m, k] x [n, k]`` GEMM whatever ``m`` (beyond the table: its largest-M row, over
    several programs); fp8 shapes the table leaves to cuBLAS take int8's config (same bytes a weight; the sweep's
    runner-up for fp8)."""
    largest = max(rule.max_m for rule in SMALL_M_TABLE if dtype in rule.dtypes)
    m = max(min(m, largest), 1)
    config = small_m_config(m, n, k, dtype, max_m=largest) or small_m_config(m, n, k, torch.int8, max_m=largest)
    assert config is not None, "SMALL_M_TABLE covers every supported dtype up to its largest M"
    return config


def gated_runtime_config(a: torch.Tensor, w: torch.Tensor) -> SmallMConfig | None:
    """The gated form's config for these CUDA operands at an op's call, or None: an M ``GATED_ROWS`` leaves to the
    unfused ops, no Triton, or ``DYNAMO_ONCE_SMALL_M_GEMM=0``."""
    config = gated_row(a.shape[0], a.dtype) if HAS_TRITON and envs.small_m_gemm() else None
    return None if config is None else gated_config(config, a.dtype)


def _check(fn: str, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
           dtypes: tuple[torch.dtype, ...]) -> None:
    """What the kernel relies on; the public ops check their full contract first."""
    if a.dtype not in dtypes or w.dtype != a.dtype:
        raise TypeError(f"{fn}: a and w must both be one of {dtypes}; got {a.dtype} and {w.dtype}")
    if a.dim() != 2 or w.dim() != 2 or a.shape[1] != w.shape[1]:
        raise ValueError(f"{fn}: a must be [M, K] and w [N, K]; got {list(a.shape)} and {list(w.shape)}")
    if w.device != a.device:
        raise ValueError(f"{fn}: w must be on a's device {a.device}; got {w.device}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        raise ValueError(f"{fn}: bias must be [N] = [{w.shape[0]}]; got {list(bias.shape)}")


#: The gated form's activation dtype, as its kernels' GATED constexpr
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32} if HAS_TRITON else {}
#: Tiles a split-K launch may have for the in-kernel reduction: int32 arrival counters, 256 KiB a device.
_MAX_LOCKS = 1 << 16
_LOCKS: dict[torch.device, torch.Tensor] = {}


def split_k_locks(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The zeroed arrival counters a split-K launch of ``tiles`` tiles reduces with in the kernel (SERIAL), or None:
    more tiles than counters, or first needed inside a CUDA-graph capture (the counters must outlive any graph,
    so they are allocated outside one), and the second kernel then sums the splits.

    One buffer a device, shared by every launch: a tile's last split resets its counter before the launch ends,
    and the next launch on the stream starts after that (under PDL too: it waits first). Split-K GEMMs run on two
    streams of one device at the same time would share counters; the library runs a device's steps on one.
    """
    if tiles > _MAX_LOCKS:
        return None
    locks = _LOCKS.get(device)
    if locks is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        locks = _LOCKS[device] = torch.zeros(_MAX_LOCKS, dtype=torch.int32, device=device)
    return locks


def _dp4a_tile(c: SmallMConfig) -> bool:
    """Whether a GEMV tile gives each thread at least 16 bytes of a row (one 128-bit load): dp4a's tiles."""
    return c.BLOCK_K >= 16 and c.BLOCK_N * c.BLOCK_K // (32 * c.num_warps) >= 16


def _dp4a_fits(c: SmallMConfig, a: torch.Tensor, w: torch.Tensor, even: bool) -> bool:
    """Whether the GEMV may take dp4a for int8: on CUDA (not in Triton's interpreter), unmasked, and with each
    thread's bytes of ``w`` and of ``a`` 16 adjacent ones of one row (both loads' 128-bit vectors, one layout: 16-byte
    aligned operands and row strides, and a ``_dp4a_tile``), so that every four the instruction sums are one row's."""
    return (w.dtype == torch.int8 and w.device.type == "cuda" and even and _dp4a_tile(c)
            and all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (a, w)))


def preload_steps(config: SmallMConfig, k: int) -> int:
    """The unrolled GEMV's loop steps loaded before the PDL wait (``config.PRELOAD``) at this K: at most half of a
    program's steps, none where it has fewer than four. On an H100 (results/gemm_step_ab_preload*_h100.md, level-3
    decode steps at batch 1) two of four or more steps took 1.3% off the 8B's and 3.7% off the fp8 8B's step, all of
    a program's steps made the 1B's 3% slower (and the 8B's bf16 stack 2.4%, results/gemm_preload_h100.md), and one
    of two was level with none on the 1B (1050.8 / 1052.4 µs against 1046.5 / 1050.4)."""
    steps = cdiv(k, config.BLOCK_K)
    return min(config.PRELOAD, steps // 2) if steps >= 4 else 0


def _launch(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
            out_dtype: torch.dtype, bias: torch.Tensor | None, config: SmallMConfig,
            gated: tuple[torch.dtype, torch.Tensor | None] | None = None) -> torch.Tensor:
    """``[M, N]``, or with ``gated = (h_dtype, amax)`` the gated form ``[M, N // 2]`` (``_store_gated``: SiLU(gate) *
    up of the GEMM's output rounded to ``h_dtype``; an ``out_dtype`` of ``h_dtype``: each tile's row amax to ``amax``
    ``[M, column blocks]`` fp32 (:func:`gated_column_blocks`), or none with ``amax`` None; an 8-bit one: quantized
    with the scale ``amax``). A float ``a`` with an 8-bit ``w`` (``config.UNROLL`` only): quantized as loaded with
    the per-tensor ``a_scale`` (the GEMV's QUANT_A form)."""
    if not HAS_TRITON:
        raise RuntimeError("the small-M GEMM needs Triton, which does not import here")
    # K must be dense (unit stride); rows may be strided. A w that is not is copied: the layout the ops promise
    # not to copy (nn.Linear's row-major [N, K]) always is.
    a = a if a.stride(1) == 1 else a.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    bias = bias.contiguous() if bias is not None else None
    (m, k), n = a.shape, w.shape[0]
    h_dtype, amax = gated or (None, None)
    out = torch.empty((m, n // 2 if gated else n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    # gated: a program's BLOCK_N weight rows are half gate, half up, for BLOCK_N // 2 output columns
    c = dataclasses.replace(config, BLOCK_N=config.BLOCK_N // 2) if gated else config
    cols = n // 2 if gated else n
    k_split = cdiv(cdiv(k, c.SPLIT_K), c.BLOCK_K) * c.BLOCK_K  # K a split covers: whole loop steps
    scaled = a_scale is not None
    # PDL at every size: the next kernel launches once every program of this one has started (signalled), so
    # its programs only take the slots this one's last wave frees.
    pdl_flags = pdl_args(None, a, any_size=True)
    pdl = pdl_flags["PDL"]
    flags = dict(
        SCALED=scaled, A_PER_TOKEN=scaled and a_scale.dim() == 2, W_PER_CHANNEL=scaled and w_scale.shape[0] != 1,
        HAS_BIAS=bias is not None, INT64=needs_int64(m * a.stride(0), n * w.stride(0), c.SPLIT_K * m * n),
        **pdl_flags,
    )
    line = max(1, _LINE_BYTES // w.element_size())  # weight elements a 128-byte line
    pf_lines = next_power_of_2(min(cdiv(c.PREFETCH * c.BLOCK_K, line), cdiv(k_split, line))) \
        if pdl and c.PREFETCH else 0
    a_scale = a_scale.reshape(-1) if scaled else None  # [M, 1] -> [M]: a view of a contiguous scale
    quant_a = a.element_size() != w.element_size()
    preload = preload_steps(c, k)
    if c.UNROLL and c.BLOCK_M > 1:
        assert not gated and not quant_a, "the gated and quantizing GEMVs take a row a program (BLOCK_M = 1)"
        even = n % c.BLOCK_N == 0 and k % c.BLOCK_K == 0
        _small_m_gemv_rows_kernel[(cdiv(m, c.BLOCK_M) * cdiv(n, c.BLOCK_N),)](
            a, w, a_scale, w_scale, bias, out, m, n, a.stride(0), w.stride(0), K=k, ROWS=c.BLOCK_M, BLOCK_N=c.BLOCK_N,
            BLOCK_K=c.BLOCK_K, INTEGER=w.dtype == torch.int8, EVEN=even, BYTES=w.dtype == torch.int8,
            DP4A=_dp4a_fits(c, a, w, even), PRELOAD=preload, num_warps=c.num_warps, enable_fp_fusion=False, **flags,
        )
        return out
    if c.UNROLL:
        even = cols % c.BLOCK_N == 0 and k % c.BLOCK_K == 0
        _small_m_gemv_kernel[(m * cdiv(cols, c.BLOCK_N),)](
            a, w, a_scale, w_scale, bias, out, amax, m, n, a.stride(0), w.stride(0), K=k, BLOCK_N=c.BLOCK_N,
            BLOCK_K=c.BLOCK_K, INTEGER=w.dtype == torch.int8, EVEN=even, BYTES=w.element_size() == 1,
            DP4A=not quant_a and _dp4a_fits(c, a, w, even), GATED=gated is not None, H=_TL_DTYPES.get(h_dtype),
            num_warps=c.num_warps, enable_fp_fusion=False, QUANT_A=quant_a, PRELOAD=preload, **flags,
        )
        return out
    assert not quant_a, "a float a with 8-bit weights: the unrolled GEMV's form only"
    _launch_tiles(a, w, a_scale, w_scale, bias, out, c, gated, k_split, flags, (pf_lines, line))
    return out


def tma_operands(a: torch.Tensor, w: torch.Tensor, config: SmallMConfig, gated: bool = False) -> tuple[Any, Any]:
    """The tensor descriptors a ``TMA`` config's dot tiles read ``a`` and ``w`` through (``[BLOCK_M, BLOCK_K]`` and
    ``[BLOCK_N, BLOCK_K]`` tiles), or ``(None, None)``: the pointer loads (not ``TMA``, the gated form, or operands
    no descriptor can take: :func:`ops.triton_utils.tma_descriptor`)."""
    if not config.TMA or gated:
        return None, None
    a_desc = tma_descriptor(a, [config.BLOCK_M, config.BLOCK_K])
    w_desc = tma_descriptor(w, [config.BLOCK_N, config.BLOCK_K]) if a_desc is not None else None
    return (a_desc, w_desc) if w_desc is not None else (None, None)


def _launch_tiles(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None,
                  bias: torch.Tensor | None, out: torch.Tensor, c: SmallMConfig,
                  gated: tuple[torch.dtype, torch.Tensor | None] | None, k_split: int, flags: dict[str, Any],
                  prefetch: tuple[int, int]) -> None:
    """The dot-tile (and rolled GEMV) forms' launch into ``out``, with split K's second kernel where it needs one;
    ``c`` as the gated form runs it, ``flags`` the constexprs both kernels take and ``prefetch`` the weight
    prefetch's ``(PF_LINES, LINE)``, as :func:`_launch` decided them."""
    (m, k), n = a.shape, w.shape[0]
    h_dtype, amax = gated or (None, None)
    cols = n // 2 if gated else n
    ws = None if c.SPLIT_K == 1 else torch.empty((c.SPLIT_K, m, n), device=a.device,
                                                 dtype=torch.int32 if a.dtype == torch.int8 else torch.float32)
    grid = (cdiv(m, c.BLOCK_M) * cdiv(cols, c.BLOCK_N), c.SPLIT_K)
    locks = split_k_locks(a.device, grid[0]) if c.SPLIT_K > 1 and c.SERIAL else None
    a_desc, w_desc = tma_operands(a, w, c, gated is not None)
    # Launched directly, not through torch.library.wrap_triton: the callers are eager (the public ops are opaque
    # custom ops), where wrap_triton would dispatch through its higher-order op on every call.
    _small_m_gemm_kernel[grid](
        a, w, a_scale, w_scale, bias, ws, out, locks, amax, m, n, k, k_split, a.stride(0), w.stride(0), a_desc, w_desc,
        BLOCK_M=c.BLOCK_M, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K, SPLIT_K=c.SPLIT_K, DOT=c.DOT,
        INTEGER=a.dtype == torch.int8, EVEN=cols % c.BLOCK_N == 0 and k % (c.BLOCK_K * c.SPLIT_K) == 0,
        SERIAL=locks is not None, SWAP=c.SWAP, GATED=gated is not None, H=_TL_DTYPES.get(h_dtype),
        TMA=a_desc is not None, PF_LINES=prefetch[0], LINE=prefetch[1], num_warps=c.num_warps,
        num_stages=c.num_stages, enable_fp_fusion=False, **flags,
    )
    if c.SPLIT_K > 1 and locks is None:
        _small_m_split_k_epilogue_kernel[(cdiv(m * n, _REDUCE_BLOCK),)](
            ws, a_scale, w_scale, bias, out, m * n, n, BLOCK=_REDUCE_BLOCK, SPLIT_K=c.SPLIT_K, num_warps=4,
            enable_fp_fusion=False, **flags,
        )


def small_m_scaled_mm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                      config: SmallMConfig | None = None) -> torch.Tensor:
    """``(a @ w.T) * a_scale * w_scale (+ bias)`` in ``out_dtype``, ``[M, N]``, by the small-M Triton kernel.

    The result of :func:`ops.int8_scaled_mm_ref` (int8: bit for bit) or :func:`ops.fp8_scaled_mm_ref` (fp8: fp32
    sums in another order). An eager launcher (CUDA-graph capture included) for CUDA tensors, and CPU tensors
    under ``TRITON_INTERPRET=1``; under torch.compile use :func:`ops.int8_scaled_mm` / :func:`ops.fp8_scaled_mm`,
    opaque ops that call it for small M.

    Args:
        a: ``int8`` or ``float8_e4m3fn [M, K]``; w: the same dtype, ``[N, K]`` (nn.Linear's layout).
        a_scale: fp32 ``[1]`` or ``[M, 1]``; w_scale: fp32 ``[1]`` or ``[N]``.
        out_dtype: bf16, fp16 or fp32; bias: None or ``[N]`` (any float dtype; added in fp32).
        config: the launch configuration (default: :func:`table_row`'s).
    """
    _check("small_m_scaled_mm", a, w, bias, _SCALED_DTYPES)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"small_m_scaled_mm: out_dtype must be one of {_OUT_DTYPES}; got {out_dtype}")
    if a_scale.dtype != torch.float32 or w_scale.dtype != torch.float32:
        raise TypeError(f"small_m_scaled_mm: scales must be float32; got {a_scale.dtype} and {w_scale.dtype}")
    m, n = a.shape[0], w.shape[0]
    if list(a_scale.shape) not in ([1], [m, 1]) or list(w_scale.shape) not in ([1], [n]):
        raise ValueError(f"small_m_scaled_mm: a_scale must be [1] or [M, 1] = [{m}, 1] and w_scale [1] or [N] = "
                         f"[{n}]; got {list(a_scale.shape)} and {list(w_scale.shape)}")
    config = config or table_row(a.shape[0], w.shape[0], w.shape[1], a.dtype)
    return _launch(a, w, a_scale.contiguous(), w_scale.contiguous(), out_dtype, bias, config)


def small_m_quant_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype, bias: torch.Tensor | None, config: SmallMConfig) -> torch.Tensor:
    """``small_m_scaled_mm(q, w, scale, w_scale, ...)`` of ``q = static_scaled_{fp8,int8}_quant(x, scale)`` in one
    kernel: the unrolled GEMV (``config.UNROLL``, the table's M = 1 rows) quantizes each element of ``x`` as it loads
    it, with ``ops.static_scaled_*_quant``'s arithmetic, so the values are those of the quantization op followed by
    the GEMM's kernel on the same config (the sums in the same order).

    Args:
        x: ``bfloat16``, ``float16`` or ``float32 [M, K]``; w: ``float8_e4m3fn`` or ``int8 [N, K]``.
        scale: the per-tensor activation scale, fp32 ``[1]``; w_scale: fp32 ``[1]`` or ``[N]``.
        out_dtype, bias: as for :func:`small_m_scaled_mm`; config: an unrolled GEMV's.
    """
    if x.dtype not in _FLOAT_DTYPES + (torch.float32,) or w.dtype not in _SCALED_DTYPES:
        raise TypeError(f"small_m_quant_scaled_mm: x must be bf16, fp16 or fp32 and w int8 or float8_e4m3fn; got "
                        f"{x.dtype} and {w.dtype}")
    if not config.UNROLL or config.BLOCK_M != 1:
        raise ValueError(f"small_m_quant_scaled_mm: the quantizing form is the unrolled GEMV's on a row a program "
                         f"(UNROLL, BLOCK_M=1); got {config}")
    if scale.dtype != torch.float32 or scale.numel() != 1 or w_scale.dtype != torch.float32:
        raise ValueError(f"small_m_quant_scaled_mm: scale must be one fp32 element and w_scale fp32; got "
                         f"{scale.dtype} {list(scale.shape)} and {w_scale.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.device != x.device:
        raise ValueError(f"small_m_quant_scaled_mm: x must be [M, K] and w [N, K] on x's device; got {list(x.shape)} "
                         f"and {list(w.shape)} on {x.device} and {w.device}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"small_m_quant_scaled_mm: out_dtype must be one of {_OUT_DTYPES}; got {out_dtype}")
    return _launch(x, w, scale.reshape(1).contiguous(), w_scale.contiguous(), out_dtype, bias, config)


def small_m_mm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               config: SmallMConfig | None = None) -> torch.Tensor:
    """``a @ w.T (+ bias)`` in ``a``'s dtype, ``[M, N]``: products exact in fp32, fp32 sums, one rounding.

    Args:
        a: ``bfloat16`` or ``float16 [M, K]``; w: the same dtype, ``[N, K]``; bias: None or ``[N]``.
        config: as for :func:`small_m_scaled_mm`.
    """
    _check("small_m_mm", a, w, bias, _FLOAT_DTYPES)
    return _launch(a, w, None, None, a.dtype, bias, config or table_row(a.shape[0], w.shape[0], w.shape[1], a.dtype))




def gated_config(config: SmallMConfig, dtype: torch.dtype) -> SmallMConfig:
    """``config`` as the gated form runs it for ``dtype`` operands: one split (the epilogue needs the whole sum), at
    least one gate-up pair of weight rows a program, and for int8's unrolled GEMV half the warps: each of its two
    tiles has half the rows, so a thread keeps the row bytes it has in the plain form (the 16 adjacent bytes dp4a
    takes: ``_dp4a_tile``). fp8's GEMV keeps its warps (no dp4a): with half of them a thread held twice the
    elements, 128 registers against 72 (``benchmarks.gemv_instructions --gated``), and the gated GEMV ran 11%
    slower than the plain one and the activation kernel (``results/gated_gemm_fp8_static.md``, M = 1)."""
    if config.UNROLL and config.BLOCK_M != 1:
        raise ValueError(f"the gated form's unrolled GEMV takes a row of a a program (BLOCK_M=1); got {config}")
    c = dataclasses.replace(config, SPLIT_K=1, SERIAL=False, BLOCK_N=max(config.BLOCK_N, 2))
    halve = c.UNROLL and c.num_warps > 1 and dtype == torch.int8
    return dataclasses.replace(c, num_warps=c.num_warps // 2) if halve else c


def gated_column_blocks(n: int, config: SmallMConfig) -> int:
    """Column blocks of the gated form of an ``N = 2D``-row weight: the rows of its per-tile amax buffer."""
    return cdiv(n // 2, config.BLOCK_N // 2)


def small_m_gated_scaled_mm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                            out_dtype: torch.dtype, config: SmallMConfig, scale: torch.Tensor | None = None,
                            quant_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(h, amax)``: ``h = silu_and_mul(small_m_scaled_mm(a, w, ...))`` ``[M, N // 2]`` in ``out_dtype``, the
    GEMM's output rounded to ``out_dtype`` first as the unfused pair's is (``w = [gate; up]``, ``[N, K]``), in one
    kernel; ``amax [M, column blocks]`` fp32: each program's row amax of ``|h|`` (their max over axis 1 is the
    row's). With a per-tensor ``scale`` (fp32, one element) and ``quant_dtype``: ``(q, None)``, ``h`` quantized as
    ``ops.static_scaled_{fp8,int8}_quant`` would, in the same kernel. Same arguments as :func:`small_m_scaled_mm`,
    no bias; ``config`` runs as :func:`gated_config` gives it for ``a``'s dtype."""
    _check("small_m_gated_scaled_mm", a, w, None, _SCALED_DTYPES)
    if w.shape[0] % 2:
        raise ValueError(f"small_m_gated_scaled_mm: w must be [gate; up], an even number of rows; got "
                         f"{list(w.shape)}")
    config = gated_config(config, a.dtype)
    if scale is not None:
        if quant_dtype not in _SCALED_DTYPES or scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(f"small_m_gated_scaled_mm: a static quantization takes an fp32 scale of one element and "
                             f"quant_dtype int8 or float8_e4m3fn; got {scale.dtype} {list(scale.shape)} and "
                             f"{quant_dtype}")
        q = _launch(a, w, a_scale.contiguous(), w_scale.contiguous(), quant_dtype, None, config,
                    (out_dtype, scale.reshape(1)))
        return q, None
    amax = torch.empty((a.shape[0], gated_column_blocks(w.shape[0], config)), dtype=torch.float32, device=a.device)
    return _launch(a, w, a_scale.contiguous(), w_scale.contiguous(), out_dtype, None, config, (out_dtype, amax)), amax


def small_m_gated_mm(a: torch.Tensor, w: torch.Tensor, config: SmallMConfig) -> torch.Tensor:
    """``h = silu_and_mul(small_m_mm(a, w))`` ``[M, N // 2]`` in ``a``'s dtype for a gate-up weight ``w = [gate; up]``
    ``[N, K]``, in one kernel: the GEMM's output rounded to ``a``'s dtype first, as the unfused pair's is, then
    SiLU(gate) * up in fp32, rounded once (``ops.silu_and_mul``'s arithmetic). ``config`` runs as
    :func:`gated_config` gives it.

    Args:
        a: ``bfloat16`` or ``float16 [M, K]``; w: the same dtype, ``[N, K]``, N even.
        config: the launch configuration (e.g. :func:`gated_runtime_config`'s).
    """
    _check("small_m_gated_mm", a, w, None, _FLOAT_DTYPES)
    if w.shape[0] % 2:
        raise ValueError(f"small_m_gated_mm: w must be [gate; up], an even number of rows; got {list(w.shape)}")
    return _launch(a, w, None, None, a.dtype, None, gated_config(config, a.dtype), (a.dtype, None))
