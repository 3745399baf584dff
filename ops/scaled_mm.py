"""W8A8 GEMMs: ``out = (a @ w.T) * a_scale * w_scale (+ bias)`` with fp8 (e4m3) or int8 activations and weights.

Arguments (both ops; checked in Python, also on fake tensors, with errors naming the argument):

- ``a``: ``[M, K]`` activations, quantized per tensor or per token (``quant_fp8`` / ``quant_int8``);
- ``w``: ``[N, K]``, nn.Linear's row-major layout, used as it is (never copied or transposed in memory);
- ``a_scale``: fp32 ``[1]`` (per tensor) or ``[M, 1]`` (per token);
- ``w_scale``: fp32 ``[1]`` (per tensor) or ``[N]`` (per output channel);
- ``out_dtype``: bf16, fp16 or fp32; ``bias``: None or ``[N]`` in ``out_dtype``. Output: ``[M, N]``, contiguous.
- Shapes: K and N multiples of 16 (fp8: ``torch._scaled_mm``'s rule) or of 8 (int8: ``torch._int_mm``'s), on
  every device, so that a shape the CPU takes the GPU takes too; M any (symbolic under torch.compile).

Definition (the references at the end of this file, the path of the CPU and of GPUs without support):
the product accumulated in fp32 (fp8: a product of two e4m3 values is exact in fp32, so the sum's order is
the only rounding) or exactly (int8: int32 on the GPU; the reference sums in float64, exact since
``|acc| <= K * 128 * 128 < 2**31`` for the ``K < 2**17`` the op requires), then, in fp32, ``acc * a_scale``,
``* w_scale``, ``+ bias``, and one cast to ``out_dtype``.

CUDA paths (the ops are opaque to Inductor: at level 3 they sit in Inductor's graphs as extern calls):

- small M, both ops (fp8 at compute capability >= 8.9, int8 at >= 8.0), where Triton imports and
  ``ops.small_m_gemm.small_m_config`` has a config (M <= ``SMALL_M_MAX`` = 16; int8 up to ``INT8_TRITON_MAX_M`` =
  128, where ``torch._int_mm`` measured 2.3-2.9x slower at M <= 16): the Triton small-M GEMM
  (``ops/small_m_gemm.py``), which streams ``w`` in place and fuses the epilogue above, op for op, into the GEMM
  (int8: int32 sums, bit-exact with the reference at every M, no padding; fp8: fp32 sums in another order).
  Every scale layout takes it, per tensor or not. ``DYNAMO_ONCE_SMALL_M_GEMM=0`` (read at each call) turns it
  off: then, and for larger M, the cuBLAS paths below.
- fp8, compute capability >= 8.9: ``torch._scaled_mm(a, w.t(), ...)``; ``w.t()`` of a row-major ``[N, K]`` is
  the column-major ``[K, N]`` it wants. Both scales per tensor (a per-token ``[1, 1]`` at M = 1 counts): one
  cuBLASLt call with the scales and bias fused (fp32 output: bias added after, as ``_scaled_mm`` takes none
  there). This is the fast layout: on the H200 an 8B linear stack + lm_head at M = 1 took 2.43 ms with
  per-tensor scales, 4.02 ms row-wise, 4.12 ms in bf16. Otherwise, with bf16 output: row-wise,
  ``scale_a [M, 1]``, ``scale_b [1, N]`` (a per-tensor side expanded), bias fused. Otherwise (fp16 / fp32
  output with a per-token or per-channel scale: bf16 is the one row-wise output every torch from 2.11 on
  takes): unit scales with fp32 output, then the reference's epilogue. Accumulation: ``use_fast_accum=False``
  (sums promoted to fp32 as they go), unless ``DYNAMO_ONCE_FP8_FAST_ACCUM=1`` (read at each call): then the tensor
  cores' own accumulator, as vLLM's CUTLASS fp8 kernels (``...FP8FastAccum`` schedules) run. It did not pay on the
  H200 for the 8B's shapes (its fp8 linear stack: 2822.5 against 2670.5 µs at M = 128, within 1.5% at M = 1-32;
  ``benchmarks/results/gemm_fp8_fast_accum.md``), hence off; and it is less precise: its sums keep
  about 14 bits (DeepSeek-V3's report on Hopper), rounded once an MMA (32 products), so the result is within
  ``K / 32 * 2**-14`` of the sum of the products' magnitudes rather than fp32's rounding
  (``tests/ops/test_scaled_mm.py``). The small-M Triton GEMM is not affected (fp32 sums).
- int8, compute capability >= 8.0: ``torch._int_mm(a, w.t())`` (int32, exact), then the reference's epilogue
  in the same torch ops, so the result is bit-exact with the reference. ``_int_mm`` refuses M <= 16: such
  ``a`` is padded with zero rows to 24 and the result sliced. It takes ``w.t()`` as a view: cuBLASLt's int8
  GEMM supports row-major ``a`` times column-major ``b`` (torch's ``test__int_mm``; a column-major ``a`` is
  CUBLAS_STATUS_NOT_SUPPORTED), so ``a`` is made contiguous and ``w`` is not copied.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dispatcher import envs

from .small_m_gemm import runtime_config, small_m_scaled_mm

__all__ = [
    "fp8_scaled_mm",
    "int8_scaled_mm",
    "fp8_scaled_mm_ref",
    "int8_scaled_mm_ref",
    "FP8_MM_ALIGN",
    "INT8_MM_ALIGN",
    "INT8_MM_MAX_K",
]

FP8 = torch.float8_e4m3fn
#: K and N of fp8_scaled_mm must be multiples of this (torch._scaled_mm: 16-byte aligned fp8 rows).
FP8_MM_ALIGN = 16
#: K and N of int8_scaled_mm must be multiples of this (torch._int_mm).
INT8_MM_ALIGN = 8
#: int8_scaled_mm's K is below this: K * 128 * 128 < 2**31, so no int32 accumulator can overflow.
INT8_MM_MAX_K = 2**17
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# torch._int_mm wants M > 16: smaller M is padded to 24 rows (the next multiple of 8).
_INT_MM_MIN_M = 17
_INT_MM_PADDED_M = 24


def _check_operands(op: str, in_dtype: torch.dtype, align: int, a: torch.Tensor, w: torch.Tensor) -> None:
    for name, t, layout in (("a", a, "[M, K]"), ("w", w, "[N, K] (nn.Linear's layout)")):
        if t.dtype != in_dtype:
            raise TypeError(f"{op}: {name} must be {in_dtype}; got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D {layout}; got shape {list(t.shape)}")
    k = a.shape[1]
    if w.shape[1] != k:
        raise ValueError(f"{op}: w must be [N, K] with a's K = {k}; got w of shape {list(w.shape)}")
    for name, size in (("K (a.shape[1], w.shape[1])", k), ("N (w.shape[0])", w.shape[0])):
        if size % align != 0:
            raise ValueError(f"{op}: {name} must be a multiple of {align}; got {size}")


def _check_scales(op: str, a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor) -> None:
    m, n = a.shape[0], w.shape[0]
    for name, s in (("a_scale", a_scale), ("w_scale", w_scale)):
        if s.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be float32; got {s.dtype}")
    # Ranks first, so a symbolic M is only ever compared with M.
    if not ((a_scale.dim() == 1 and a_scale.shape[0] == 1)
            or (a_scale.dim() == 2 and a_scale.shape[1] == 1 and a_scale.shape[0] == m)):
        raise ValueError(f"{op}: a_scale must be [1] (per tensor) or [M, 1] = [{m}, 1] (per token); "
                         f"got shape {list(a_scale.shape)}")
    if not (w_scale.dim() == 1 and w_scale.shape[0] in (1, n)):
        raise ValueError(f"{op}: w_scale must be [1] (per tensor) or [N] = [{n}] (per channel); "
                         f"got shape {list(w_scale.shape)}")


def check_args(op: str, in_dtype: torch.dtype, align: int, a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor,
               w_scale: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None) -> None:
    """A W8A8 GEMM's arguments (``ops.gated_quant``'s ops check theirs with it too): TypeError / ValueError naming
    ``op``, the argument, what it expects and what it got. Only dtypes, ranks, static sizes and M against M: no
    guard pins a symbolic M."""
    _check_operands(op, in_dtype, align, a, w)
    _check_scales(op, a, w, a_scale, w_scale)
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be torch.bfloat16, torch.float16 or torch.float32; got {out_dtype}")
    n = w.shape[0]
    if bias is not None:
        if bias.dtype != out_dtype:
            raise TypeError(f"{op}: bias must be in out_dtype {out_dtype}; got {bias.dtype}")
        if bias.dim() != 1 or bias.shape[0] != n:
            raise ValueError(f"{op}: bias must be [N] = [{n}]; got shape {list(bias.shape)}")
    for name, t in (("w", w), ("a_scale", a_scale), ("w_scale", w_scale), ("bias", bias)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{op}: {name} must be on a's device {a.device}; got {t.device}")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_at_least(t: torch.Tensor, capability: tuple[int, int]) -> bool:
    """Whether ``t`` is on a CUDA device of at least this compute capability (the GEMMs' CUDA paths)."""
    if t.device.type != "cuda":
        return False
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= capability


def _scale_epilogue(acc: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``acc [M, N] * a_scale * w_scale (+ bias)``, in that order, cast once to ``out_dtype``."""
    out = acc * a_scale * w_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _fp8_scaled_mm_cuda(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                        out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    a, w = a.contiguous(), w.contiguous()  # cuBLASLt: row-major a, column-major w.t(); no copy when contiguous
    m, n = a.shape[0], w.shape[0]
    fast = envs.fp8_fast_accum()
    if a_scale.numel() == 1 and w_scale.numel() == 1:
        # _scaled_mm takes no bias with an fp32 output: there it is added after, in fp32, as the reference does.
        fused_bias = bias if out_dtype != torch.float32 else None
        out = torch._scaled_mm(a, w.t(), scale_a=a_scale, scale_b=w_scale, bias=fused_bias, out_dtype=out_dtype,
                               use_fast_accum=fast)
        return out if bias is None or fused_bias is not None else out + bias
    if out_dtype == torch.bfloat16:
        scale_a = a_scale.expand(m, 1).contiguous()
        scale_b = w_scale.reshape(1, -1).expand(1, n).contiguous()
        return torch._scaled_mm(a, w.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=fast)
    one = torch.ones((), dtype=torch.float32, device=a.device)
    acc = torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)
    return _scale_epilogue(acc, a_scale, w_scale, bias, out_dtype)


def _int8_scaled_mm_cuda(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                         out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.Tensor:
    m = a.shape[0]
    a = a.contiguous()
    if m < _INT_MM_MIN_M:
        a = F.pad(a, (0, 0, 0, _INT_MM_PADDED_M - m))  # zero rows, sliced off below
    acc = torch._int_mm(a, w.contiguous().t())[:m]
    return _scale_epilogue(acc.float(), a_scale, w_scale, bias, out_dtype)


@torch.library.custom_op("dynamo_once::fp8_scaled_mm", mutates_args=())
def _fp8_scaled_mm_op(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_args("fp8_scaled_mm", FP8, FP8_MM_ALIGN, a, w, a_scale, w_scale, out_dtype, bias)
    if cuda_at_least(a, (8, 9)):
        config = runtime_config(a, w)
        if config is not None:
            return small_m_scaled_mm(a, w, a_scale, w_scale, out_dtype, bias, config)
        return _fp8_scaled_mm_cuda(a, w, a_scale, w_scale, out_dtype, bias)
    return fp8_scaled_mm_ref(a, w, a_scale, w_scale, out_dtype, bias)


@_fp8_scaled_mm_op.register_fake
def _fp8_scaled_mm_fake(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                        out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_args("fp8_scaled_mm", FP8, FP8_MM_ALIGN, a, w, a_scale, w_scale, out_dtype, bias)
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


@torch.library.custom_op("dynamo_once::int8_scaled_mm", mutates_args=())
def _int8_scaled_mm_op(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_int8_args(a, w, a_scale, w_scale, out_dtype, bias)
    if cuda_at_least(a, (8, 0)):
        config = runtime_config(a, w)
        if config is not None:
            return small_m_scaled_mm(a, w, a_scale, w_scale, out_dtype, bias, config)
        return _int8_scaled_mm_cuda(a, w, a_scale, w_scale, out_dtype, bias)
    return int8_scaled_mm_ref(a, w, a_scale, w_scale, out_dtype, bias)


@_int8_scaled_mm_op.register_fake
def _int8_scaled_mm_fake(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                         out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_int8_args(a, w, a_scale, w_scale, out_dtype, bias)
    return a.new_empty((a.shape[0], w.shape[0]), dtype=out_dtype)


def _check_int8_args(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype, bias: torch.Tensor | None) -> None:
    check_args("int8_scaled_mm", torch.int8, INT8_MM_ALIGN, a, w, a_scale, w_scale, out_dtype, bias)
    if a.shape[1] >= INT8_MM_MAX_K:
        raise ValueError(f"int8_scaled_mm: K (a.shape[1]) must be below {INT8_MM_MAX_K}, so that the int32 "
                         f"accumulator cannot overflow; got {a.shape[1]}")


def fp8_scaled_mm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a @ w.T) * a_scale * w_scale (+ bias)`` in ``out_dtype``, ``[M, N]``.

    Args:
        a: ``float8_e4m3fn [M, K]``; w: ``float8_e4m3fn [N, K]`` (K, N multiples of 16).
        a_scale: fp32 ``[1]`` (per tensor) or ``[M, 1]`` (per token); w_scale: fp32 ``[1]`` or ``[N]``.
            Per-tensor scales on both sides are the fast layout on CUDA (see the module docstring).
        out_dtype: bf16, fp16 or fp32; bias: None or ``[N]`` in ``out_dtype``.
    Raises:
        TypeError: a dtype other than these. ValueError: a shape, alignment or device other than these.
    """
    return torch.ops.dynamo_once.fp8_scaled_mm(a, w, a_scale, w_scale, out_dtype, bias)


def int8_scaled_mm(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(a @ w.T) * a_scale * w_scale (+ bias)`` in ``out_dtype``, ``[M, N]``; the product exact (int32).

    Args:
        a: ``int8 [M, K]``; w: ``int8 [N, K]`` (K, N multiples of 8, K < 2**17).
        a_scale: fp32 ``[1]`` (per tensor) or ``[M, 1]`` (per token); w_scale: fp32 ``[1]`` or ``[N]``.
        out_dtype: bf16, fp16 or fp32; bias: None or ``[N]`` in ``out_dtype``.
    Raises:
        TypeError: a dtype other than these. ValueError: a shape, alignment or device other than these.
    """
    return torch.ops.dynamo_once.int8_scaled_mm(a, w, a_scale, w_scale, out_dtype, bias)


def fp8_scaled_mm_ref(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: fp32 ``a @ w.T`` (exact products, fp32 sums), then the fp32 epilogue, cast once."""
    return _scale_epilogue(a.float() @ w.float().t(), a_scale, w_scale, bias, out_dtype)


def int8_scaled_mm_ref(a: torch.Tensor, w: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                       out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: the exact integer ``a @ w.T`` (float64 holds every partial sum: ``|acc| < 2**31``),
    rounded once to fp32 as the GPU's int32 -> fp32 conversion does, then the fp32 epilogue, cast once."""
    acc = (a.double() @ w.double().t()).float()
    return _scale_epilogue(acc, a_scale, w_scale, bias, out_dtype)
