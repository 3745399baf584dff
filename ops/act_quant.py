"""Gated activation-and-multiply fused with fp8 / int8 quantization: ``[..., 2d] -> [..., d]``, the input of
the quantized down projection, in one pass.

Definition (the references at the end of this file): the unfused sequence, ``quant(act_and_mul(x))``:

- ``act(x[..., :d]) * x[..., d:]`` as ``ops.silu_and_mul`` (``act="silu"``) or ``ops.gelu_and_mul``
  (``"gelu"``: erf, ``"gelu_tanh"``: Gemma's tanh approximation) compute it, in fp32, **rounded to
  ``x.dtype``** (the model dtype), as the unfused graph's activation output is;
- that rounded tensor quantized as ``ops.quant_fp8`` / ``ops.quant_int8`` do: static per tensor or dynamic
  per token (``scale``: fp32 of shape ``x.shape[:-1] + (1,)``).

The kernel repeats ``silu_and_mul``'s kernel's arithmetic, so it gives the unfused Triton ops' values bit for
bit. Per-token rows are held whole in one program up to ``ONE_PASS_MAX`` outputs (Llama-3-8B's and
Gemma-2-9B's 14336); wider rows (Llama-3-70B's 28672, Gemma-2-27B's 36864) run the unfused kernels, activation
then per-token quant, which compute the same values with one more round trip of the activation's output.
"""

from __future__ import annotations

import torch
from torch.library import wrap_triton

from dispatcher.passes.native_forms import register_native_form

from .norm_quant import check_quant_dtype, dynamic_quant_ref, static_quant_ref
from .quant_fp8 import MIN_SCALE, check_quant_input, launch_per_token_quant, per_token_quant_config
from .quant_int8 import INT8_MIN_SCALE
from .gelu_and_mul import gelu_and_mul_ref
from .silu_and_mul import GELU, GELU_TANH, SILU, act_and_mul_config, act_needs_int64, launch_act_and_mul, \
    silu_and_mul_ref
from .triton_utils import cdiv, known_int, pdl_args, tl, triton, triton_op, use_triton

__all__ = [
    "act_and_mul_static_quant",
    "act_and_mul_dynamic_quant",
    "act_and_mul_static_quant_ref",
    "act_and_mul_dynamic_quant_ref",
    "act_and_mul_ref",
    "ACTIVATIONS",
    "ONE_PASS_MAX",
]

#: ``act`` name -> ``ACT`` of the kernels (``ops.silu_and_mul``'s numbering).
ACTIVATIONS = {"silu": SILU, "gelu": GELU, "gelu_tanh": GELU_TANH}
#: Per token, a row of up to this many outputs stays in one program's registers between its amax and its
#: quantization (a and b: 2 x 32 fp32 a thread on 16 warps, as the per-token quant kernels' 16384).
ONE_PASS_MAX = 16384


@triton.jit
def _act_and_mul_quant_kernel(
    x_ptr, scale_ptr, q_ptr, n_rows, d, x_row_stride,
    MIN_S: tl.constexpr,
    ACT: tl.constexpr,
    INT8: tl.constexpr,
    DYNAMIC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr,
    INT64: tl.constexpr,
    PDL: tl.constexpr,
):
    # silu_and_mul's kernel statement for statement up to the activation's output (the same values), then the
    # quant kernels' arithmetic; self-contained, as they are (Inductor re-emits the source). Static: axis 1
    # walks column blocks; DYNAMIC: BLOCK_D covers the row, whose scale is stored to scale_ptr ([T, 1]).
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < d)[None, :]
    if not DYNAMIC:  # issued with the row's loads: at one token its latency would otherwise be the kernel's tail
        static_scale = tl.load(scale_ptr).to(tl.float32)
    in_offs = rows[:, None] * x_row_stride + cols[None, :]
    a = tl.load(x_ptr + in_offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + in_offs + d, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        g = a * tl.sigmoid(a)
    elif ACT == 1:
        g = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))  # 1/sqrt(2)
    else:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u), as silu_and_mul's kernel computes it.
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)  # sqrt(2/pi)
        g = a * tl.sigmoid(2.0 * u)
    # Rounded to x's dtype, as the activation's output is: the unfused graph quantizes that rounded tensor.
    y = (g * b).to(x_ptr.dtype.element_ty).to(tl.float32)
    if DYNAMIC:
        qmax = 127.0 if INT8 else 448.0
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(y), axis=1), qmax), tl.full([ROWS], MIN_S, tl.float32))
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
    y = q
    if INT8:
        y = tl.minimum(tl.maximum(y, -128.0), 127.0)
        q = ((y + 12582912.0) - 12582912.0).to(tl.int8)  # round half to even: see ops.quant_int8
    else:
        q = tl.minimum(tl.maximum(y, -448.0), 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * d + cols[None, :], q, mask=mask)


def _launch_act_and_mul_quant(
    x: torch.Tensor,
    scale: torch.Tensor | None,
    act: str,
    quant_dtype: torch.dtype,
    config: tuple[int, int, int] | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(q, scale_out)``: ``scale`` None quantizes per token (``scale_out``: ``x.shape[:-1] + (1,)``), else
    with that per-tensor scale (``scale_out`` None). ``config``: ``(BLOCK_D, ROWS, num_warps)``, default
    ``silu_and_mul``'s static tiles, per token ``per_token_quant_config``'s whole rows."""
    d = x.shape[-1] // 2
    known_d = known_int(d)
    int8 = quant_dtype == torch.int8
    if scale is None and config is None and (known_d is None or known_d > ONE_PASS_MAX):
        # Wider rows: the unfused kernels (the same values, one more round trip of the activation's output).
        return launch_per_token_quant(launch_act_and_mul(x, ACTIVATIONS[act]), quant_dtype,
                                      INT8_MIN_SCALE if int8 else MIN_SCALE)
    x2 = x if x.dim() == 2 and x.stride(-1) == 1 else x.reshape(-1, x.shape[-1]).contiguous()
    q = torch.empty((*x.shape[:-1], d), dtype=quant_dtype, device=x.device)
    scale_out = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if scale is None else None
    n_rows = x2.shape[0]
    known_rows = known_int(n_rows)
    if config is None:
        config = per_token_quant_config(known_d) if scale is None else \
            act_and_mul_config(d, x.element_size(), known_rows)
    block_d, rows, num_warps = config
    known_n = known_rows * known_d if known_rows is not None and known_d is not None else None
    wrap_triton(_act_and_mul_quant_kernel)[(cdiv(n_rows, rows), 1 if scale is None else cdiv(d, block_d))](
        x2, scale if scale_out is None else scale_out, q, n_rows, d, x2.stride(0),
        MIN_S=INT8_MIN_SCALE if int8 else MIN_SCALE,
        ACT=ACTIVATIONS[act],
        INT8=int8,
        DYNAMIC=scale is None,
        BLOCK_D=block_d,
        ROWS=rows,
        INT64=act_needs_int64(n_rows, x2.stride(0), d),
        num_warps=num_warps,
        **pdl_args(pdl, x2, known_n),
    )
    return q, scale_out


def _check(op: str, x: torch.Tensor, scale: torch.Tensor | None, act: str, quant_dtype: torch.dtype) -> None:
    """Dtypes, static sizes and devices only (no guard on a token count); errors name the argument."""
    check_quant_input(op, x, scale, per_token=scale is None)
    check_quant_dtype(op, quant_dtype)
    if act not in ACTIVATIONS:
        raise ValueError(f"{op}: act must be one of {tuple(ACTIVATIONS)}; got {act!r}")
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"{op}: x must have an even last dim (gate and up halves); got shape {list(x.shape)}")


@triton_op("dynamo_once::act_and_mul_static_quant", mutates_args=())
def _act_and_mul_static_quant_op(x: torch.Tensor, scale: torch.Tensor, act: str,
                                 quant_dtype: torch.dtype) -> torch.Tensor:
    _check("act_and_mul_static_quant", x, scale, act, quant_dtype)
    if not use_triton(x):
        return act_and_mul_static_quant_ref(x, scale, act, quant_dtype)
    return _launch_act_and_mul_quant(x, scale, act, quant_dtype)[0]


@triton_op("dynamo_once::act_and_mul_dynamic_quant", mutates_args=())
def _act_and_mul_dynamic_quant_op(x: torch.Tensor, act: str,
                                  quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    _check("act_and_mul_dynamic_quant", x, None, act, quant_dtype)
    if not use_triton(x):
        return act_and_mul_dynamic_quant_ref(x, act, quant_dtype)
    return _launch_act_and_mul_quant(x, None, act, quant_dtype)  # type: ignore[return-value]


def act_and_mul_static_quant(x: torch.Tensor, scale: torch.Tensor, act: str, quant_dtype: torch.dtype) -> torch.Tensor:
    """``quant(act(x[..., :d]) * x[..., d:])`` with a per-tensor scale: ``q: [..., d]`` in ``quant_dtype``.

    Args:
        x: fp32, fp16 or bf16, ``[..., 2d]``; the activation's output is rounded to ``x.dtype`` first.
        scale: fp32, one element (``[1]`` or 0-d), on ``x``'s device.
        act: ``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``.
        quant_dtype: ``torch.float8_e4m3fn`` or ``torch.int8``.
    Raises:
        TypeError / ValueError naming the argument.
    """
    return torch.ops.dynamo_once.act_and_mul_static_quant(x, scale, act, quant_dtype)


def act_and_mul_dynamic_quant(x: torch.Tensor, act: str, quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: :func:`act_and_mul_static_quant` with one scale a token, ``max(amax(|y[t]|) / qmax,
    min_scale)`` (qmax 448 for fp8, 127 for int8), fp32 of shape ``x.shape[:-1] + (1,)``."""
    return torch.ops.dynamo_once.act_and_mul_dynamic_quant(x, act, quant_dtype)


def act_and_mul_ref(x: torch.Tensor, act: str) -> torch.Tensor:
    """``silu_and_mul_ref`` or ``gelu_and_mul_ref`` (``"gelu"``: erf, ``"gelu_tanh"``: tanh), by ``act``."""
    if act == "silu":
        return silu_and_mul_ref(x)
    return gelu_and_mul_ref(x, "tanh" if act == "gelu_tanh" else "none")


def act_and_mul_static_quant_ref(x: torch.Tensor, scale: torch.Tensor, act: str,
                                 quant_dtype: torch.dtype) -> torch.Tensor:
    """The definition: the activation's reference (rounded to ``x.dtype``), then the static quant's."""
    return static_quant_ref(act_and_mul_ref(x, act), scale, quant_dtype)


def act_and_mul_dynamic_quant_ref(x: torch.Tensor, act: str,
                                  quant_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: the activation's reference (rounded to ``x.dtype``), then the per-token quant's."""
    return dynamic_quant_ref(act_and_mul_ref(x, act), quant_dtype)


# The fused ops' definitions in plain torch, for the passes that put them back
register_native_form("act_and_mul_static_quant", act_and_mul_static_quant_ref)
register_native_form("act_and_mul_dynamic_quant", act_and_mul_dynamic_quant_ref)
