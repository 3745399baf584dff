"""RMSNorm fused with fp8 / int8 quantization: the norm (optionally after the residual add) and the
quantization of its output in one pass over the row, for the quantized linear layer that follows a norm.

Definition (the references at the end of this file): the unfused sequence, ``quant(rms_norm(x))``:

- the norm is ``ops.rms_norm``'s (Llama, or Gemma's ``x_normed * (1 + weight)``; with the fused add,
  ``s = x + residual`` rounded to ``x.dtype`` is normalized and returned), computed in fp32 and **rounded
  to ``x.dtype``** (the model dtype), as the unfused graph's ``rms_norm`` output is;
- that rounded tensor is quantized as ``ops.quant_fp8`` / ``ops.quant_int8`` do: static per tensor
  (``saturate(y / scale)``) or dynamic per token (``scale[t] = max(amax(|y[t]|) / qmax, min_scale)``, fp32
  of shape ``x.shape[:-1] + (1,)``); fp32 division correctly rounded, round to nearest even, saturation.

The kernel computes the normed row with ``ops.rms_norm``'s kernel's arithmetic (at a known few tokens its launch
config too; elsewhere more warps a row, ``norm_quant_config``), so it gives the unfused Triton ops' values bit for
bit whenever the sum of squares is exact, which the tests use; otherwise the two kernels' reduction orders may
differ in the last bit, as ``rms_norm``'s differs from the reference's. The fused-add ops follow
``fused_add_rms_norm``: functional, inputs untouched, the new residual returned last.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from dispatcher.passes.native_forms import register_native_form

from .quant_fp8 import (
    FP8_DTYPE,
    MIN_SCALE,
    check_quant_input,
    dynamic_per_token_scaled_fp8_quant_ref,
    static_scaled_fp8_quant_ref,
)
from .quant_int8 import INT8_MIN_SCALE, dynamic_scaled_int8_quant_ref, static_scaled_int8_quant_ref
from .rms_norm import MAX_KERNEL_COLS, fused_add_rms_norm_ref, rms_norm_config, rms_norm_ref
from .triton_utils import SMALL_ELEMENTS, cdiv, known_int, needs_int64, pdl_args, tl, triton, triton_op, \
    use_triton

__all__ = [
    "rms_norm_static_quant",
    "rms_norm_dynamic_quant",
    "fused_add_rms_norm_static_quant",
    "fused_add_rms_norm_dynamic_quant",
    "rms_norm_static_quant_ref",
    "rms_norm_dynamic_quant_ref",
    "fused_add_rms_norm_static_quant_ref",
    "fused_add_rms_norm_dynamic_quant_ref",
    "static_quant_ref",
    "dynamic_quant_ref",
    "check_quant_dtype",
    "QUANT_DTYPES",
]

#: ``norm_quant_col_split``'s split of a few tokens' rows of >= 2048 columns (a known count).
NORM_QUANT_COL_SPLIT = 4
#: The most warps of one program a row (``norm_quant_config``) at a symbolic or large token count.
#: On the H100 (fused add + norm + static fp8 quant of 4096 bf16 columns, no PDL;
#: results/fused_quant_configs_whole_row_h100.md), µs at 1 / 8 / 32 / 64 / 128 / 256 / 2048 tokens: 16 warps 1.91 /
#: 2.02 / 2.11 / 2.80 / 2.94 / 3.94 / 20.96, 8 warps 2.19 / 2.26 / 2.37 / 3.18 / 3.15 / 4.18 / 20.80, Inductor's native
#: kernel 2.02 / 2.11 / 2.24 / 3.04 / 2.98 / 3.86 / 19.64. Per token (fused add, int8;
#: results/fused_quant_configs_wide_norm_h100.md) at 1 / 8 / 32 / 128 / 2048 tokens: 16 warps 2.316 / 2.43 / 2.505 /
#: 3.624 / 22.396, 8 warps 2.531 / 2.594 / 2.68 / 3.976 / 21.284, Inductor 2.699 / 2.687 / 2.757 / 3.944 / 22.34. A
#: row's divisions (correctly rounded) are the kernel's longest stretch, and more warps share them.
NORM_QUANT_WIDE_WARPS = 16
#: The ``quant_dtype`` the fused ops take.
QUANT_DTYPES = (FP8_DTYPE, torch.int8)


@triton.jit
def _rms_norm_quant_kernel(
    x_ptr, res_ptr, w_ptr, scale_ptr, q_ptr, res_out_ptr, n_rows, n_cols, x_row_stride, res_row_stride, eps,
    MIN_S: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, INT8: tl.constexpr, DYNAMIC: tl.constexpr,
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, COL_SPLIT: tl.constexpr, INT64: tl.constexpr, EVICT_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    # ops.rms_norm's kernel statement for statement up to the normed row (the same values), then the quant
    # kernels' arithmetic. Self-contained: Inductor re-emits a user kernel's source and fails to compile one
    # that calls another jitted function (torch 2.11 + Triton 3.6). DYNAMIC: scale_ptr is the [T, 1] output.
    # COL_SPLIT > 1 (static scale only, norm_quant_col_split): COL_SPLIT programs a row block each sum the rows'
    # squares and write their share of the columns.
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    rows = (pid // COL_SPLIT) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    if not DYNAMIC:  # with the row's loads, not after the residual's store: at one token, the kernel's tail
        static_scale = tl.load(scale_ptr).to(tl.float32)
    cols = tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    if COL_SPLIT == 1:  # the weight with the row: its latency hidden behind the reduction
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0, eviction_policy="evict_last").to(tl.float32)
    # EVICT_FIRST: activations are read once: keep the weight (read by every program) in L2
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first" if EVICT_FIRST else "")
    xf, s = x.to(tl.float32), x
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * res_row_stride + cols[None, :], mask=mask, other=0.0)
        s = (xf + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        xf = s.to(tl.float32)
    # eps as fp32: Inductor, re-emitting the kernel in a compiled graph, passes a float argument as fp64, which
    # would make rstd and every product with it fp64 (slower, and not the eager launch's values)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / n_cols + tl.cast(eps, tl.float32))
    if COL_SPLIT == 1:  # the whole rows, from the values summed
        pcols, pmask, ws, xs, ss = cols, mask, w, xf, s
    else:  # this share's columns, loaded again: its values bit for bit the whole rows' there
        pcols = (pid % COL_SPLIT) * (BLOCK_N // COL_SPLIT) + tl.arange(0, BLOCK_N // COL_SPLIT)
        pmask = row_ok[:, None] & (pcols < n_cols)[None, :]
        ws = tl.load(w_ptr + pcols, mask=pcols < n_cols, other=0.0, eviction_policy="evict_last").to(tl.float32)
        xs = tl.load(x_ptr + rows[:, None] * x_row_stride + pcols[None, :], mask=pmask, other=0.0)
        xs, ss = xs.to(tl.float32), xs
        if HAS_RESIDUAL:
            rs = tl.load(res_ptr + rows[:, None] * res_row_stride + pcols[None, :], mask=pmask, other=0.0)
            ss = (xs + rs.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            xs = ss.to(tl.float32)
    out_offs = rows[:, None] * n_cols + pcols[None, :]
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + out_offs, ss, mask=pmask)
    ws = 1.0 + ws if GEMMA else ws
    # Rounded to x's dtype, as rms_norm's output is: the unfused graph quantizes that rounded tensor.
    y = (xs * rstd[:, None] * ws[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
    if DYNAMIC:
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), axis=1), 127.0 if INT8 else 448.0),
                           tl.full([ROWS], MIN_S, tl.float32))
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        scale = scale[:, None]
    else:
        scale = static_scale
    # y / scale correctly rounded in three operations (ops.quant_fp8's docstring: the quotient)
    inv = tl.div_rn(1.0, scale)
    q0 = y * inv
    q = tl.where((tl.abs(q0) <= 65536.0) & (tl.abs(q0) >= 1.1754944e-38), tl.fma(tl.fma(-q0, scale, y), inv, q0), q0)
    if not DYNAMIC:
        if (inv > 1.0e27) | (inv < 1.0e-27):
            q = tl.div_rn(y, scale)
    if INT8:
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
        q = ((q + 12582912.0) - 12582912.0).to(tl.int8)  # round half to even: see ops.quant_int8
    else:
        q = tl.minimum(tl.maximum(q, -448.0), 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + out_offs, q, mask=pmask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, H]`` with a dense last dim; a 2-D tensor with strided rows is read in place."""
    return t if t.dim() == 2 and t.stride(-1) == 1 else t.reshape(-1, t.shape[-1]).contiguous()


def _few_tokens(known_rows: int | None, block_n: int) -> bool:
    """A known token count whose row blocks fit ``SMALL_ELEMENTS``: a launch-latency bound call."""
    return known_rows is not None and known_rows * block_n <= SMALL_ELEMENTS


def norm_quant_col_split(block_n: int, known_rows: int | None, dynamic: bool) -> int:
    """Programs a row block of the static-scale kernel (``COL_SPLIT``) for ``BLOCK_N``-wide rows and a token count
    (None: symbolic, as in a compiled graph that serves decode and prefill alike); per token: 1.

    A quantized row's divisions (``div_rn``, correctly rounded as the reference's) are the kernel's longest
    stretch at a few tokens, where one program a row leaves all but a few SMs idle: a known few tokens' rows
    (up to ``SMALL_ELEMENTS``) are split. A symbolic count takes one program a row on ``norm_quant_config``'s wide
    warps: on the H100 the split (4 programs, 8 warps) was 0.15 µs faster at one token and slower from 8 tokens on
    (fused add + norm + static fp8 quant: 2.29 against 2.11 µs at 32 tokens, 3.76 against 2.94 at 128), and past a
    run-time check that let the first program of a row block write its rows, 1.9x slower at 2048 tokens
    (results/fused_quant_configs_whole_row_h100.md)."""
    if dynamic or block_n < 2048 or not _few_tokens(known_rows, block_n):
        return 1
    return NORM_QUANT_COL_SPLIT


def norm_quant_config(n_cols: int, element_size: int, known_rows: int | None) -> tuple[int, int, int]:
    """``(BLOCK_N, ROWS, num_warps)``: ``rms_norm``'s, but for one row a program at a symbolic or large count one
    16-byte vector a thread (up to ``NORM_QUANT_WIDE_WARPS``): the quantization's divisions, not the row's bytes,
    set the pace. Measured at 4096 bf16 columns (16 warps); other widths take the same rule unmeasured."""
    block_n, rows, num_warps = rms_norm_config(n_cols, element_size, known_rows)
    if rows == 1 and not _few_tokens(known_rows, block_n):
        num_warps = min(NORM_QUANT_WIDE_WARPS, max(num_warps, block_n * element_size // (16 * 32)))
    return block_n, rows, num_warps


def _launch_rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    quant_dtype: torch.dtype,
    gemma: bool,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
    col_split: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(q, scale_out, residual_out)``: ``scale`` None quantizes per token (``scale_out``: ``x.shape[:-1] +
    (1,)``), else with that per-tensor scale (``scale_out`` None); ``residual_out`` None without a residual.
    ``config``: ``(BLOCK_N, ROWS, num_warps)``, default ``norm_quant_config``'s; ``pdl``: default ``pdl_launch``;
    ``col_split``: programs a row block (static scale only), default ``norm_quant_col_split``'s."""
    n_cols = x.shape[-1]
    weight = weight.contiguous()
    x2 = _rows(x)
    r2 = x2 if residual is None else _rows(residual)
    q = torch.empty(x.shape, dtype=quant_dtype, device=x.device)
    scale_out = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if scale is None else None
    res_out = None if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows = x2.shape[0]
    known_rows = known_int(n_rows)
    block_n, rows, num_warps = config or norm_quant_config(n_cols, x.element_size(), known_rows)
    small = _few_tokens(known_rows, block_n)
    int8 = quant_dtype == torch.int8
    if col_split is None:
        col_split = norm_quant_col_split(block_n, known_rows, dynamic=scale is None)
    if col_split < 1 or block_n % col_split or (col_split > 1 and scale is None):
        raise ValueError(f"col_split must divide BLOCK_N {block_n} (and be 1 per token); got {col_split}")
    wrap_triton(_rms_norm_quant_kernel)[(cdiv(n_rows, rows) * col_split,)](
        x2, r2, weight, scale if scale_out is None else scale_out, q, q if res_out is None else res_out,
        n_rows, n_cols, x2.stride(0), r2.stride(0), eps,
        MIN_S=INT8_MIN_SCALE if int8 else MIN_SCALE,
        HAS_RESIDUAL=residual is not None,
        GEMMA=gemma,
        INT8=int8,
        DYNAMIC=scale is None,
        BLOCK_N=block_n,
        ROWS=rows,
        COL_SPLIT=col_split,
        INT64=needs_int64(n_rows * x2.stride(0), n_rows * r2.stride(0), n_rows * n_cols),
        EVICT_FIRST=not small and col_split == 1,
        num_warps=num_warps,
        **pdl_args(pdl, x2, known_rows * block_n if known_rows is not None else None),
    )
    return q, scale_out, res_out


def check_quant_dtype(op: str, quant_dtype: torch.dtype) -> None:
    """Raise ValueError, naming ``op`` and the argument, unless ``quant_dtype`` is fp8 (e4m3fn) or int8."""
    if quant_dtype not in QUANT_DTYPES:
        raise ValueError(f"{op}: quant_dtype must be torch.float8_e4m3fn or torch.int8; got {quant_dtype}")


def _check(op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
           scale: torch.Tensor | None, quant_dtype: torch.dtype) -> None:
    """The arguments' dtypes, static sizes and devices (no guard on a token count); errors name the argument."""
    check_quant_input(op, x, scale, per_token=scale is None)
    check_quant_dtype(op, quant_dtype)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have rows to normalize (a last dim); got shape []")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{op}: weight must have shape [{x.shape[-1]}] (x's last dim); got {list(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"{op}: weight must be on x's device {x.device}; got {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.device != x.device):
        raise ValueError(f"{op}: residual must have x's shape {list(x.shape)} and device {x.device}; "
                         f"got {list(residual.shape)} on {residual.device}")


def _use_kernel(x: torch.Tensor) -> bool:
    """As ``rms_norm``: Triton for CUDA rows of up to ``MAX_KERNEL_COLS`` (a whole row a program)."""
    return use_triton(x) and x.shape[-1] <= MAX_KERNEL_COLS


@triton_op("dynamo_once::rms_norm_static_quant", mutates_args=())
def _rms_norm_static_quant_op(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor,
                              quant_dtype: torch.dtype, gemma: bool = False) -> torch.Tensor:
    _check("rms_norm_static_quant", x, None, weight, scale, quant_dtype)
    if not _use_kernel(x):
        return rms_norm_static_quant_ref(x, weight, eps, scale, quant_dtype, gemma)
    return _launch_rms_norm_quant(x, None, weight, eps, scale, quant_dtype, gemma)[0]


@triton_op("dynamo_once::rms_norm_dynamic_quant", mutates_args=())
def _rms_norm_dynamic_quant_op(x: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype,
                               gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _check("rms_norm_dynamic_quant", x, None, weight, None, quant_dtype)
    if not _use_kernel(x):
        return rms_norm_dynamic_quant_ref(x, weight, eps, quant_dtype, gemma)
    q, scale, _ = _launch_rms_norm_quant(x, None, weight, eps, None, quant_dtype, gemma)
    return q, scale  # type: ignore[return-value]


@triton_op("dynamo_once::fused_add_rms_norm_static_quant", mutates_args=())
def _fused_add_rms_norm_static_quant_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor,
    quant_dtype: torch.dtype, gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check("fused_add_rms_norm_static_quant", x, residual, weight, scale, quant_dtype)
    if not _use_kernel(x):
        return fused_add_rms_norm_static_quant_ref(x, residual, weight, eps, scale, quant_dtype, gemma)
    q, _, res = _launch_rms_norm_quant(x, residual, weight, eps, scale, quant_dtype, gemma)
    return q, res  # type: ignore[return-value]


@triton_op("dynamo_once::fused_add_rms_norm_dynamic_quant", mutates_args=())
def _fused_add_rms_norm_dynamic_quant_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check("fused_add_rms_norm_dynamic_quant", x, residual, weight, None, quant_dtype)
    if not _use_kernel(x):
        return fused_add_rms_norm_dynamic_quant_ref(x, residual, weight, eps, quant_dtype, gemma)
    return _launch_rms_norm_quant(x, residual, weight, eps, None, quant_dtype, gemma)  # type: ignore[return-value]


def rms_norm_static_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor,
                          quant_dtype: torch.dtype, gemma: bool = False) -> torch.Tensor:
    """``quant(rms_norm(x, weight, eps))`` with a per-tensor scale: ``q`` of ``x``'s shape in ``quant_dtype``.

    Args:
        x: fp32, fp16 or bf16, ``[..., H]``; the normed row is rounded to ``x.dtype`` before quantizing.
        weight: ``[H]``; ``gemma``: use ``1 + weight`` (Gemma's RMSNorm).
        scale: fp32, one element (``[1]`` or 0-d), on ``x``'s device.
        quant_dtype: ``torch.float8_e4m3fn`` or ``torch.int8``.
    Raises:
        TypeError / ValueError naming the argument (dtype, shape, device).
    """
    return torch.ops.dynamo_once.rms_norm_static_quant(x, weight, eps, scale, quant_dtype, gemma)


def rms_norm_dynamic_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype,
                           gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: :func:`rms_norm_static_quant` with one scale a token, ``max(amax(|y[t]|) / qmax,
    min_scale)`` (qmax 448 for fp8, 127 for int8), fp32 of shape ``x.shape[:-1] + (1,)``."""
    return torch.ops.dynamo_once.rms_norm_dynamic_quant(x, weight, eps, quant_dtype, gemma)


def fused_add_rms_norm_static_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor,
    quant_dtype: torch.dtype, gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: ``s = x + residual`` rounded to ``x.dtype`` (``fused_add_rms_norm``'s new residual), ``q``
    :func:`rms_norm_static_quant` of ``s``. Inputs are not modified; ``residual`` has ``x``'s shape."""
    return torch.ops.dynamo_once.fused_add_rms_norm_static_quant(x, residual, weight, eps, scale, quant_dtype, gemma)


def fused_add_rms_norm_dynamic_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, scale, s)``: as :func:`fused_add_rms_norm_static_quant`, quantized per token."""
    return torch.ops.dynamo_once.fused_add_rms_norm_dynamic_quant(x, residual, weight, eps, quant_dtype, gemma)


def static_quant_ref(y: torch.Tensor, scale: torch.Tensor, quant_dtype: torch.dtype) -> torch.Tensor:
    """``static_scaled_fp8_quant_ref`` or ``static_scaled_int8_quant_ref``, by ``quant_dtype``."""
    if quant_dtype == torch.int8:
        return static_scaled_int8_quant_ref(y, scale)
    return static_scaled_fp8_quant_ref(y, scale)


def dynamic_quant_ref(y: torch.Tensor, quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``dynamic_per_token_scaled_fp8_quant_ref`` or ``dynamic_scaled_int8_quant_ref``, by ``quant_dtype``."""
    if quant_dtype == torch.int8:
        return dynamic_scaled_int8_quant_ref(y)
    return dynamic_per_token_scaled_fp8_quant_ref(y)


def rms_norm_static_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor,
                              quant_dtype: torch.dtype, gemma: bool = False) -> torch.Tensor:
    """The definition: ``rms_norm_ref`` (rounded to ``x.dtype``), then the static quant's reference."""
    return static_quant_ref(rms_norm_ref(x, weight, eps, gemma=gemma), scale, quant_dtype)


def rms_norm_dynamic_quant_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype,
                               gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: ``rms_norm_ref`` (rounded to ``x.dtype``), then the per-token quant's reference."""
    return dynamic_quant_ref(rms_norm_ref(x, weight, eps, gemma=gemma), quant_dtype)


def fused_add_rms_norm_static_quant_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor,
    quant_dtype: torch.dtype, gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: ``fused_add_rms_norm_ref``, then the static quant's reference of the normed tensor."""
    normed, s = fused_add_rms_norm_ref(x, residual, weight, eps, gemma=gemma)
    return static_quant_ref(normed, scale, quant_dtype), s


def fused_add_rms_norm_dynamic_quant_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype,
    gemma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition: ``fused_add_rms_norm_ref``, then the per-token quant's reference of the normed tensor."""
    normed, s = fused_add_rms_norm_ref(x, residual, weight, eps, gemma=gemma)
    q, scale = dynamic_quant_ref(normed, quant_dtype)
    return q, scale, s


# The fused ops' definitions in plain torch: the unfused native forms composed, for the passes that put them back
register_native_form("rms_norm_static_quant", rms_norm_static_quant_ref)
register_native_form("rms_norm_dynamic_quant", rms_norm_dynamic_quant_ref)
register_native_form("fused_add_rms_norm_static_quant", fused_add_rms_norm_static_quant_ref)
register_native_form("fused_add_rms_norm_dynamic_quant", fused_add_rms_norm_dynamic_quant_ref)
