"""FP8 (``float8_e4m3fn``) quantization: per tensor, static (given scale) or dynamic (scale from the data), and
dynamic per token (one scale a row).

Definition (the references at the end of this file, which the kernels match
bit for bit):

- ``q = saturate(x / scale)``: fp32 division correctly rounded (``tl.div_rn``,
  not Triton's default approximate ``/``), clamped to +-448, converted with
  round-to-nearest-even;
- dynamic: ``scale = max(amax(|x|) / 448, MIN_SCALE)``, so an all-zero input
  still gets a finite, positive scale. ``MIN_SCALE = 1 / (448 * 512)``, as
  vLLM uses, keeps ``x / scale`` finite for tiny inputs.

- dynamic per token (a row of the last dim): ``scale[t] = max(amax(|x[t]|) / 448, MIN_SCALE)``, then
  ``q[t] = saturate(x[t] / scale[t])`` as above (the per-token input of a row-wise scaled GEMM).

The quotient: ``div_rn`` is a sequence of some twenty instructions, which at a few tokens (one row on a few
SMs) and at large batches (the activation-and-quant kernel, compute-bound there) is most of a kernel's time. The
static and fused kernels get the same correctly rounded quotient from the rounded reciprocal ``inv = 1 / scale``
(one ``div_rn`` a program or a row) by Markstein's correction: ``q0 = y * inv``, ``r = fma(-q0, scale, y)``
(exact), ``q = fma(r, inv, q0)``, which is ``RN(y / scale)`` whenever ``inv`` is a normal number and the quotient
does not underflow (Markstein, IBM J. Res. Dev. 34(1), 1990; checked against exact rational division on 80,000
pairs, scales with all-ones significands among them). Where it would not hold the result is the same anyway or
the plain division runs: ``|q0| > 65536`` saturates either way (``q0`` is kept, never an fma of an infinity); a
``q0`` below the smallest normal fp32 (zero included: the correction would turn ``-0`` into ``+0``) is kept, as
the quotient is then far below fp8's and int8's smallest step and quantizes to a zero of its sign either way; a
static scale outside [1e-27, 1e27] (where ``r`` could underflow) takes ``div_rn``; a per-token scale needs no
check (at least ``MIN_SCALE``: no underflow; at most fp32's maximum / 127: ``inv`` normal). Triton's interpreter
rounds an ``fma`` twice (NumPy); the tests' interpreter computes it in float64 (tests/conftest.py).

Outputs: ``q`` with ``x``'s shape (contiguous); ``scale`` fp32 of shape ``[1]``, per token
``x.shape[:-1] + (1,)`` (``[T, 1]`` for ``x: [T, H]``), so that ``x / scale`` broadcasts.
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
    "static_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "dynamic_per_token_scaled_fp8_quant",
    "QuantFP8",
    "static_scaled_fp8_quant_ref",
    "dynamic_scaled_fp8_quant_ref",
    "dynamic_per_token_scaled_fp8_quant_ref",
    "check_quant_input",
    "per_token_quant_config",
    "launch_per_token_quant",
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_SCALE",
    "quantize_by_scale",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Rounded to fp32 here so the kernels' fp32 argument and the reference's clamp agree exactly.
MIN_SCALE = float(torch.tensor(1.0 / (FP8_MAX * 512.0), dtype=torch.float32))

@triton.jit
def quantize_by_scale(y, scale, Q: tl.constexpr, STATIC: tl.constexpr):
    """``y / scale`` (fp32) correctly rounded (the module docstring: the quotient), saturated and converted to ``Q``
    (fp8 e4m3, or int8 rounded half to even, see ``ops.quant_int8``). ``STATIC``: one scale for the tensor, which may
    be tiny or huge (then the quotient's other path, ``div_rn``); a dynamic scale is at least the minimum scale.
    For kernels launched directly only: a kernel launched through ``wrap_triton`` is re-emitted by Inductor, which
    fails to compile one that calls another jitted function (``ops.norm_quant``'s kernel), so those repeat these
    lines."""
    inv = tl.div_rn(1.0, scale)
    q0 = y * inv
    q = tl.where((tl.abs(q0) <= 65536.0) & (tl.abs(q0) >= 1.1754944e-38), tl.fma(tl.fma(-q0, scale, y), inv, q0), q0)
    if STATIC:
        if (inv > 1.0e27) | (inv < 1.0e-27):
            q = tl.div_rn(y, scale)
    if Q == tl.int8:
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
        out = ((q + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        out = tl.minimum(tl.maximum(q, -448.0), 448.0).to(Q)
    return out


# Large inputs: 4096 elements per program and per block of the amax loop, 8 warps: 8 KiB of bf16 in
# flight per program; 88-103% of the copy bandwidth for the static quant from 4096 x 4096 (H200).
_BLOCK = 4096
# The amax kernel folds this many blocks before its one atomic: 32768 x 8192 tokens -> 16384 atomics, not 65536.
_AMAX_BLOCKS = 4
# Dynamic quant of at most this many elements runs as ONE program (amax, scale, quantize; no memset)
# instead of memset + amax + quantize (three CUDA-graph nodes, 4.7-6.6 us on the H200 at 1 token against
# 1.8-2.7 us for compile), but only while one SM's bandwidth suffices. Seen on the H200: 1 x 4096 bf16
# in 2.5 us, but 16 x 4096 took 13 us (one SM reading 128 KiB twice).
_SINGLE_PROGRAM_MAX = 8192
# Up to here: per-block amax into a partials buffer, then a quantization kernel whose every program
# reduces the (<= 256) partials itself. Two launches, as Inductor's reduction + pointwise, no atomics.
_PARTIALS_MAX = 1 << 20
_PARTIALS_BLOCK = 4096
# Per-token quant: a row up to this width is read once and kept in registers between its amax and its
# quantization (16384 fp32 on 16 warps: 32 a thread); wider rows, or a width unknown without a guard, loop
# twice over blocks of _PER_TOKEN_LOOP_BLOCK (the second read mostly from L2).
_PER_TOKEN_BLOCK_MAX = 16384
_PER_TOKEN_LOOP_BLOCK = 4096
# Narrow rows are stacked, several a program, up to tiles of this many elements (and this many rows).
_PER_TOKEN_TILE = 2048
_PER_TOKEN_ROWS_MAX = 64


@triton.jit
def _static_fp8_quant_kernel(x_ptr, scale_ptr, q_ptr, n, BLOCK: tl.constexpr, INT64: tl.constexpr,
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
    # x / scale correctly rounded in three operations (the module docstring: the quotient)
    inv = tl.div_rn(1.0, scale)
    q0 = x * inv
    y = tl.where((tl.abs(q0) <= 65536.0) & (tl.abs(q0) >= 1.1754944e-38), tl.fma(tl.fma(-q0, scale, x), inv, q0), q0)
    if (inv > 1.0e27) | (inv < 1.0e-27):
        y = tl.div_rn(x, scale)
    q = tl.minimum(tl.maximum(y, -448.0), 448.0).to(q_ptr.dtype.element_ty)
    if EVEN:
        tl.store(q_ptr + offs, q)
    else:
        tl.store(q_ptr + offs, q, mask=mask)


@triton.jit
def _dynamic_fp8_quant_single_kernel(
    x_ptr, q_ptr, scale_ptr, n, MIN_S: tl.constexpr, BLOCK: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    EVEN: tl.constexpr, PDL: tl.constexpr,
):
    # One program: amax over the whole tensor, the scale, then the quantization; no atomics, no memset.
    # n < 2**31 here (small inputs only): int32 offsets.
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if NUM_BLOCKS == 1:
        # The tensor fits one block: read once, kept in registers between the amax and the quantization.
        # EVEN: n == BLOCK, no masks.
        offs = tl.arange(0, BLOCK)
        if EVEN:
            x = tl.load(x_ptr + offs).to(tl.float32)
        else:
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=0), 448.0), tl.full([], MIN_S, tl.float32))
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0).to(q_ptr.dtype.element_ty)
        if EVEN:
            tl.store(q_ptr + offs, q)
        else:
            tl.store(q_ptr + offs, q, mask=mask)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in tl.static_range(NUM_BLOCKS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x))
        scale = tl.maximum(tl.div_rn(tl.max(acc, axis=0), 448.0), tl.full([], MIN_S, tl.float32))
        for i in tl.static_range(NUM_BLOCKS):
            offs = i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
            tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def _block_absmax_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # n < 2**20 here: int32 offsets.
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.max(tl.abs(x), axis=0))


@triton.jit
def _dynamic_fp8_quant_partials_kernel(x_ptr, partial_ptr, q_ptr, scale_ptr, n, num_partials,
                                       MIN_S: tl.constexpr, BLOCK: tl.constexpr, P_BLOCK: tl.constexpr,
                                       PDL: tl.constexpr):
    # Every program reduces all partials (<= 256 floats, from L2) to the scale: no grid-wide sync needed.
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    p_offs = tl.arange(0, P_BLOCK)
    partials = tl.load(partial_ptr + p_offs, mask=p_offs < num_partials, other=0.0)
    scale = tl.maximum(tl.div_rn(tl.max(partials, axis=0), 448.0), tl.full([], MIN_S, tl.float32))
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(scale_ptr, scale)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _absmax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr, BLOCKS: tl.constexpr, INT64: tl.constexpr):
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    start = pid * (BLOCK * BLOCKS)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(BLOCKS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    # |x| >= 0 and amax starts at 0.0, so the float atomic max needs no sign handling.
    tl.atomic_max(amax_ptr, tl.max(acc, axis=0))


@triton.jit
def _dynamic_fp8_quant_kernel(x_ptr, amax_ptr, q_ptr, scale_ptr, n, MIN_S: tl.constexpr, BLOCK: tl.constexpr,
                              INT64: tl.constexpr):
    scale = tl.maximum(tl.div_rn(tl.load(amax_ptr), 448.0), tl.full([], MIN_S, tl.float32))
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(scale_ptr, scale)
    if INT64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, scale_ptr, n_rows, n_cols, x_row_stride, MIN_S: tl.constexpr,
                            BLOCK: tl.constexpr, ROWS: tl.constexpr, ONE_PASS: tl.constexpr, INT8: tl.constexpr,
                            INT64: tl.constexpr, PDL: tl.constexpr):
    # ROWS rows a program, one scale each; fp8 e4m3, or with INT8 int8 (quant_int8). ONE_PASS: a row fits one
    # BLOCK and stays in registers between its amax and its quantization; else two loops over its blocks.
    # Self-contained, as the kernels above.
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK)
    x_rows = x_ptr + rows[:, None] * x_row_stride
    q_rows = q_ptr + rows[:, None] * n_cols
    if ONE_PASS:
        mask = row_ok[:, None] & (cols[None, :] < n_cols)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
    else:
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = row_ok[:, None] & (start + cols[None, :] < n_cols)
            xb = tl.load(x_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(xb))
        amax = tl.max(acc, axis=1)
    if INT8:
        scale = tl.maximum(tl.div_rn(amax, 127.0), tl.full([ROWS], MIN_S, tl.float32))
    else:
        scale = tl.maximum(tl.div_rn(amax, 448.0), tl.full([ROWS], MIN_S, tl.float32))
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    if ONE_PASS:
        y = tl.div_rn(x, scale[:, None])
        if INT8:
            y = tl.minimum(tl.maximum(y, -128.0), 127.0)
            q = ((y + 12582912.0) - 12582912.0).to(tl.int8)  # round half to even: see ops.quant_int8
        else:
            q = tl.minimum(tl.maximum(y, -448.0), 448.0).to(q_ptr.dtype.element_ty)
        tl.store(q_rows + cols[None, :], q, mask=mask)
    else:
        for start in range(0, n_cols, BLOCK):
            mask = row_ok[:, None] & (start + cols[None, :] < n_cols)
            xb = tl.load(x_rows + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = tl.div_rn(xb, scale[:, None])
            if INT8:
                y = tl.minimum(tl.maximum(y, -128.0), 127.0)
                q = ((y + 12582912.0) - 12582912.0).to(tl.int8)
            else:
                q = tl.minimum(tl.maximum(y, -448.0), 448.0).to(q_ptr.dtype.element_ty)
            tl.store(q_rows + start + cols[None, :], q, mask=mask)


def static_fp8_quant_config(n: int | None, element_size: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for ``n`` elements (None: a symbolic size, which gets the large-input config)."""
    if n is not None and n <= SMALL_ELEMENTS:
        # Launch-latency bound: many small programs on 8 warps, 1 element a thread up to 8192 elements
        # (one token), 2 beyond. Swept on the H200 (bench_ops --sweep-small, interleaved timing, 1 and 16
        # tokens x hidden 2048 / 4096 / 8192), without PDL: (256, 8) at 1 token 1.002x compile's time on
        # average, (512, 8) at 16 tokens 1.000x, the former 4-element (1024, 8) 1.06x / 1.02x; with PDL
        # (the default) 0.69-0.90 us, the best or within 0.002 us of it in each cell.
        block = min(256 if n <= 8192 else 512, max(32, next_power_of_2(n)))
        return block, max(1, min(8, block // 32))
    if n is None:
        # A symbolic size (a compiled graph): 1024-element blocks on 4 warps, 4 programs a 4096-wide token. Swept on
        # the H200 without PDL (benchmarks.fused_quant_configs, hidden 4096): 1.16 / 1.23 / 1.38 / 8.07 us at 1 / 8
        # / 32 / 2048 tokens, against 1.38 / 1.45 / 1.48 / 7.95 for (4096, 8) and Inductor's 1.14 / 1.22 / 1.38 / 8.31.
        return 1024, 4
    return _BLOCK, 8


def dynamic_fp8_quant_single_config(n: int, element_size: int) -> tuple[int, int, int]:
    """``(BLOCK, NUM_BLOCKS, num_warps)`` of the single-program kernel for ``n`` elements (the launcher uses it
    up to ``_SINGLE_PROGRAM_MAX``; larger ``n`` loop over ``NUM_BLOCKS`` blocks)."""
    # One 16-byte vector per thread (8 bf16), up to 16 warps: a 1 x 4096 bf16 tensor is one block held in
    # registers by 16 warps. Swept on the H200 (bench_ops --sweep-small): 16 warps 1.91 us, 8 warps 2.10,
    # 4 warps (32 elements per thread) 2.46, against 1.87 for compile.
    per_thread = max(1, 16 // element_size)
    block = min(next_power_of_2(n), 16 * 32 * per_thread)
    num_warps = min(max(block // (32 * per_thread), 1), 16)
    return block, cdiv(n, block), num_warps


def _launch_static_fp8_quant(x: torch.Tensor, scale: torch.Tensor, config: tuple[int, int] | None = None,
                             pdl: bool | None = None) -> torch.Tensor:
    """``config``: ``(BLOCK, num_warps)``; ``pdl``: programmatic dependent launch (default: ``pdl_launch``)."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    n = x.numel()
    known_n = known_int(n)
    block, num_warps = config or static_fp8_quant_config(known_n, x.element_size())
    wrap_triton(_static_fp8_quant_kernel)[(cdiv(n, block),)](
        x, scale, q, n, BLOCK=block, INT64=needs_int64(n, block),
        EVEN=known_n is not None and known_n % block == 0, num_warps=num_warps,
        **pdl_args(pdl, x, known_n),
    )
    return q


def _launch_dynamic_fp8_quant(x: torch.Tensor, single_config: tuple[int, int, int] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``single_config``: force the single-program kernel with this ``(BLOCK, NUM_BLOCKS, num_warps)``."""
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    n = x.numel()
    known_n = known_int(n)
    pdl = pdl_args(None, x, known_n)
    if single_config is not None or (known_n is not None and known_n <= _SINGLE_PROGRAM_MAX):
        block, num_blocks, num_warps = single_config or dynamic_fp8_quant_single_config(known_n, x.element_size())
        wrap_triton(_dynamic_fp8_quant_single_kernel)[(1,)](
            x, q, scale, n, MIN_S=MIN_SCALE, BLOCK=block, NUM_BLOCKS=num_blocks, EVEN=known_n == block,
            num_warps=num_warps, **pdl,
        )
        return q, scale
    if known_n is not None and known_n <= _PARTIALS_MAX:
        num_partials = cdiv(known_n, _PARTIALS_BLOCK)
        partials = torch.empty(num_partials, dtype=torch.float32, device=x.device)
        wrap_triton(_block_absmax_kernel)[(num_partials,)](x, partials, n, BLOCK=_PARTIALS_BLOCK, num_warps=4,
                                                           **pdl)
        wrap_triton(_dynamic_fp8_quant_partials_kernel)[(num_partials,)](
            x, partials, q, scale, n, num_partials, MIN_S=MIN_SCALE, BLOCK=_PARTIALS_BLOCK,
            P_BLOCK=max(16, next_power_of_2(num_partials)), num_warps=4, **pdl,
        )
        return q, scale
    # Large or symbolic sizes: per-block amax with one float atomic max per program into a zeroed fp32
    # scalar, then the quantization (which also writes the scale).
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    int64 = needs_int64(n, _BLOCK * _AMAX_BLOCKS)
    wrap_triton(_absmax_kernel)[(cdiv(n, _BLOCK * _AMAX_BLOCKS),)](
        x, amax, n, BLOCK=_BLOCK, BLOCKS=_AMAX_BLOCKS, INT64=int64, num_warps=8
    )
    wrap_triton(_dynamic_fp8_quant_kernel)[(cdiv(n, _BLOCK),)](
        x, amax, q, scale, n, MIN_S=MIN_SCALE, BLOCK=_BLOCK, INT64=int64, num_warps=8
    )
    return q, scale


def per_token_quant_config(n_cols: int | None) -> tuple[int, int, int]:
    """``(BLOCK, ROWS, num_warps)`` of the per-token quant kernels (fp8 here, int8 in ``quant_int8``) for rows
    of ``n_cols`` elements (None: a width unknown without a guard). A row is read once when it fits BLOCK."""
    if n_cols is None:
        return _PER_TOKEN_LOOP_BLOCK, 1, 8
    block = next_power_of_2(n_cols)
    if block > _PER_TOKEN_BLOCK_MAX:
        block = _PER_TOKEN_LOOP_BLOCK
    rows = max(1, min(_PER_TOKEN_ROWS_MAX, _PER_TOKEN_TILE // block))
    # 8 elements a thread (one 16-byte vector of bf16) up to 16 warps.
    return block, rows, max(1, min(16, block * rows // 256))


def launch_per_token_quant(x: torch.Tensor, q_dtype: torch.dtype, min_scale: float,
                           config: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``x``'s last dim per token to ``q_dtype`` (fp8 e4m3 or int8, scales at least
    ``min_scale``); returns ``(q, scale)``, ``q`` of ``x``'s shape, ``scale`` fp32 of shape ``x.shape[:-1] + (1,)``.

    Shared by the fp8 and int8 ops (``_per_token_quant_kernel``). Rows may be strided
    (a 2-D ``x`` with unit column stride is read in place). ``config``: ``(BLOCK, ROWS, num_warps)``
    (default: :func:`per_token_quant_config`).
    """
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    q = torch.empty(x.shape, dtype=q_dtype, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    known_cols, known_rows = known_int(n_cols), known_int(n_rows)
    block, rows, num_warps = config or per_token_quant_config(known_cols)
    known_n = known_rows * known_cols if known_rows is not None and known_cols is not None else None
    wrap_triton(_per_token_quant_kernel)[(cdiv(n_rows, rows),)](
        x2, q, scale, n_rows, n_cols, x2.stride(0), MIN_S=min_scale, BLOCK=block, ROWS=rows,
        ONE_PASS=known_cols is not None and known_cols <= block, INT8=q_dtype == torch.int8,
        INT64=needs_int64(n_rows * x2.stride(0), n_rows * n_cols), num_warps=num_warps,
        **pdl_args(None, x, known_n),
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


@triton_op("dynamo_once::dynamic_per_token_scaled_fp8_quant", mutates_args=())
def _dynamic_per_token_scaled_fp8_quant_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_quant_input("dynamic_per_token_scaled_fp8_quant", x, per_token=True)
    if not use_triton(x):
        return dynamic_per_token_scaled_fp8_quant_ref(x)
    return launch_per_token_quant(x, FP8_DTYPE, MIN_SCALE)


def static_scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``saturate(x / scale)`` as ``float8_e4m3fn``; ``scale`` is a one-element fp32 tensor."""
    return torch.ops.dynamo_once.static_scaled_fp8_quant(x, scale)


def dynamic_scaled_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``scale = max(amax(|x|) / 448, MIN_SCALE)`` (fp32, shape ``[1]``)."""
    return torch.ops.dynamo_once.dynamic_scaled_fp8_quant(x)


def dynamic_per_token_scaled_fp8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``, one scale a row of the last dim: ``scale = max(amax(|x[t]|) / 448, MIN_SCALE)``, fp32 of
    shape ``x.shape[:-1] + (1,)``; ``q = saturate(x / scale)`` as ``float8_e4m3fn``.

    Raises:
        TypeError: ``x`` is not fp32, fp16 or bf16. ValueError: ``x`` has no rows (0-d, or an empty last dim).
    """
    return torch.ops.dynamo_once.dynamic_per_token_scaled_fp8_quant(x)


@CustomOp.register("quant_fp8")
class QuantFP8(CustomOp):
    """FP8 quantization; ``forward(x, scale=None) -> (q, scale)``.

    Args:
        static: use the per-tensor ``scale`` passed to ``forward`` (True) or compute it from ``x`` (False).
        per_token: dynamic only: one scale a row of the last dim (``scale: x.shape[:-1] + (1,)``) instead
            of one for the tensor (``[1]``).
    """

    def __init__(self, static: bool = False, per_token: bool = False) -> None:
        if static and per_token:
            raise ValueError("QuantFP8: per_token scales are computed from x; static=True takes a per-tensor scale")
        super().__init__()
        self.static = static
        self.per_token = per_token

    def _check(self, scale: torch.Tensor | None) -> None:
        if self.static and scale is None:
            raise ValueError("QuantFP8(static=True): forward needs a scale")

    def forward_native(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(scale)
        if self.static:
            return static_scaled_fp8_quant_ref(x, scale), scale  # type: ignore[arg-type,return-value]
        if self.per_token:
            return dynamic_per_token_scaled_fp8_quant_ref(x)
        return dynamic_scaled_fp8_quant_ref(x)

    def forward_cuda(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(scale)
        if self.static:
            return static_scaled_fp8_quant(x, scale), scale  # type: ignore[arg-type,return-value]
        if self.per_token:
            return dynamic_per_token_scaled_fp8_quant(x)
        return dynamic_scaled_fp8_quant(x)

    def extra_repr(self) -> str:
        return f"static={self.static}, per_token={self.per_token}"


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


def dynamic_per_token_scaled_fp8_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: one scale a row of the last dim, from its ``amax(|x|)``, then the fp32 quotient saturated
    to +-448 and rounded to nearest even (see the module docstring)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    # A tensor divisor, for the IEEE quotient (see dynamic_scaled_fp8_quant_ref).
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE).contiguous(), scale


register_native_form("static_scaled_fp8_quant", static_scaled_fp8_quant_ref)
register_native_form("dynamic_scaled_fp8_quant", dynamic_scaled_fp8_quant_ref)
register_native_form("dynamic_per_token_scaled_fp8_quant", dynamic_per_token_scaled_fp8_quant_ref)


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_quant_input(op: str, x: torch.Tensor, scale: torch.Tensor | None = None, per_token: bool = False) -> None:
    """Raise TypeError / ValueError, naming ``op``, the argument, what it expects and what it got, for an input
    the quant ops (fp8 here, int8 in ``quant_int8``) do not take: ``x`` not fp32/fp16/bf16; per token, ``x``
    without rows (0-d, or an empty last dim); ``scale`` (when given) not a one-element fp32 tensor (shape
    ``[1]`` or 0-d) on ``x``'s device. Only dtypes, ranks, static sizes and devices: no guard on a token count.
    """
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: x must be float32, float16 or bfloat16; got {x.dtype}")
    if per_token and (x.dim() == 0 or x.shape[-1] == 0):
        raise ValueError(f"{op}: x must have rows to scale (a non-empty last dim); got shape {list(x.shape)}")
    if scale is None:
        return
    if scale.dtype != torch.float32:
        raise TypeError(f"{op}: scale must be float32; got {scale.dtype}")
    if scale.dim() > 1 or scale.numel() != 1:
        raise ValueError(f"{op}: scale must be one per-tensor value of shape [1]; got shape {list(scale.shape)}")
    if scale.device != x.device:
        raise ValueError(f"{op}: scale must be on x's device {x.device}; got {scale.device}")
