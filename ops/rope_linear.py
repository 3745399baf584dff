"""``ops.rope_linear``: an attention layer's merged QKV projection and the rotary embedding of its q and k heads,
``x @ weight.T`` with the first ``rot_heads`` heads of each row rotated (NeoX: the two halves of a head), for bf16 /
fp16.

In a Llama attention layer the QKV GEMM writes ``[T, (Hq + 2 Hkv) D]`` that one rotary kernel reads back to rotate
q's and k's heads. At one token the GEMM is a read of its weight and the rotary one more launch a layer. This op is
what the ``rope_linear`` graph pass (``dispatcher.passes``) puts in place of that pair, deciding at run time on the
concrete M:

- CUDA, one token, a GEMV row of ``ops.small_m_gemm.SMALL_M_TABLE`` for the shape, ``x`` with unit column stride
  and ``weight`` contiguous, ``DYNAMO_ONCE_SMALL_M_GEMM`` not 0: one kernel (:func:`rope_small_m_mm`), each program
  streaming the weight rows of column pairs ``(c, c + D / 2)`` of a head into two accumulators and rotating them in
  its epilogue (value heads stored as they are);
- anything else: ``ops.linear`` (cuBLAS above the small-M sizes), then the rotary kernel in place on its output
  (:func:`ops.rotary_embedding.rotate_heads_in_place`; on the CPU the reference).

Values: the GEMM's output rounded to ``x``'s dtype, then each pair ``(x1 cos - x2 sin, x2 cos + x1 sin)`` in fp32,
rounded once (``rotary_embedding_ref``'s arithmetic); the fused kernel's fp32 sums in its own order, as
``ops.linear``'s small-M kernel's are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dispatcher import envs

from .linear import linear
from .rotary_embedding import rotary_embedding_ref, rotate_heads_in_place
from .small_m_gemm import SmallMConfig, _gemv_step, _k_loop, small_m_config, small_m_operands, triton_max_m
from .triton_utils import HAS_TRITON, cdiv, needs_int64, pdl_args, tl, triton

__all__ = ["ROPE_LINEAR_DTYPES", "rope_linear", "rope_linear_ref", "rope_linear_uses_small_m", "rope_small_m_mm"]

#: The dtypes ``ops.rope_linear`` takes.
ROPE_LINEAR_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["M", "rot_cols"])
def _rope_gemv_kernel(
    a_ptr, w_ptr, out_ptr, pos_ptr, cs_ptr, M, N, rot_cols, stride_am, stride_wn, stride_cs, K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALF: tl.constexpr, EVEN: tl.constexpr, INT64: tl.constexpr,
    PDL: tl.constexpr,
):
    # Program (row, pair block): BLOCK_N column pairs (c, c + HALF), c in the first half of a head of 2 * HALF
    # columns; the pairs of a block adjacent in one half (HALF % BLOCK_N == 0). The unrolled GEMV's loop
    # (ops.small_m_gemm), two accumulators; the rotation in the epilogue for the columns below rot_cols.
    pid = tl.program_id(0)
    row = pid % M
    if INT64:
        row = row.to(tl.int64)
    pairs, cols, n_ok = _pair_columns(pid // M, N, BLOCK_N, HALF, INT64, PDL)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros_like(acc1)
    for k in tl.static_range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + cols[:, None] * stride_wn + offs_k[None, :]
        if EVEN:  # N // 2 % BLOCK_N == 0 and K % BLOCK_K == 0
            w1 = tl.load(w_ptrs, eviction_policy="evict_first")
            w2 = tl.load(w_ptrs + HALF * stride_wn, eviction_policy="evict_first")
            a = tl.load(a_ptr + row * stride_am + offs_k, eviction_policy="evict_last")
        else:
            mask = n_ok[:, None] & (offs_k < K)[None, :]
            w1 = tl.load(w_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
            w2 = tl.load(w_ptrs + HALF * stride_wn, mask=mask, other=0.0, eviction_policy="evict_first")
            a = tl.load(a_ptr + row * stride_am + offs_k, mask=offs_k < K, other=0.0, eviction_policy="evict_last")
        acc1 = _gemv_step(acc1, w1, a, False, False, False)
        acc2 = _gemv_step(acc2, w2, a, False, False, False)
    rows = tl.zeros((1,), dtype=row.dtype) + row
    _store_rotated(tl.sum(acc1, axis=1)[None, :], tl.sum(acc2, axis=1)[None, :], out_ptr, pos_ptr, cs_ptr, rows,
                   rows < M, pairs, cols, n_ok, N, rot_cols, stride_cs, HALF)


@triton.jit(do_not_specialize=["M", "K", "rot_cols"])
def _rope_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pos_ptr, cs_ptr, M, N, K, rot_cols, stride_am, stride_wn, stride_cs, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALF: tl.constexpr, EVEN: tl.constexpr, SWAP: tl.constexpr,
    INT64: tl.constexpr, PDL: tl.constexpr,
):
    # The dot-tile form (2-16 tokens): program (m block, pair block) takes BLOCK_M rows and BLOCK_N column pairs,
    # the small-M GEMM's loop with its gate-up form's two accumulators (ops.small_m_gemm._k_loop), the second on the
    # rows HALF after the first's; the same epilogue as the GEMV form.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    if INT64:
        offs_m = offs_m.to(tl.int64)
    pairs, cols, n_ok = _pair_columns(pid // num_m, N, BLOCK_N, HALF, INT64, PDL)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    w_ptrs = w_ptr + cols[:, None] * stride_wn + offs_k[None, :]
    acc1, acc2 = _k_loop(a_ptr + offs_m[:, None] * stride_am + offs_k[None, :], w_ptrs, w_ptrs + HALF * stride_wn, m_ok,
                         n_ok, offs_k, K, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, True, False, SWAP, True)
    _store_rotated(acc1, acc2, out_ptr, pos_ptr, cs_ptr, offs_m, m_ok, pairs, cols, n_ok, N, rot_cols, stride_cs, HALF)


@triton.jit
def _pair_columns(block, N, BLOCK_N: tl.constexpr, HALF: tl.constexpr, INT64: tl.constexpr, PDL: tl.constexpr):
    """Pair block ``block``'s ``(pairs, cols, n_ok)``: its ``BLOCK_N`` pairs of the ``N // 2``, their first columns
    ``cols`` (a head's first half; ``cols + HALF`` the second), which exist; then, with PDL, the wait for the kernel
    before (nothing above reads memory) and the next launch let go."""
    pairs = block * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
        pairs = pairs.to(tl.int64)
    if PDL:  # launched early (ops.triton_utils.pdl_launch)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    return pairs, (pairs // HALF) * (2 * HALF) + pairs % HALF, pairs < N // 2


@triton.jit
def _store_rotated(y1, y2, out_ptr, pos_ptr, cs_ptr, offs_m, m_ok, pairs, cols, n_ok, N, rot_cols, stride_cs,
                   HALF: tl.constexpr):
    """A ``[rows, pairs]`` tile's fp32 sums of the columns ``cols`` (``y1``) and ``cols + HALF`` (``y2``): each rounded
    to the output's dtype (the GEMM's output, as the unfused op rounds it), then rotated by its row's position where
    ``cols < rot_cols`` (fp32, ``rotary_embedding_ref``'s arithmetic), rounded again and stored."""
    out_ty = out_ptr.dtype.element_ty
    x1 = y1.to(out_ty).to(tl.float32)
    x2 = y2.to(out_ty).to(tl.float32)
    pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    cs = cs_ptr + pos[:, None] * stride_cs + (pairs % HALF)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    cos = tl.load(cs, mask=mask, other=1.0).to(tl.float32)
    sin = tl.load(cs + HALF, mask=mask, other=0.0).to(tl.float32)
    rot = (cols < rot_cols)[None, :]
    out = out_ptr + offs_m[:, None] * N + cols[None, :]
    tl.store(out, tl.where(rot, x1 * cos - x2 * sin, x1).to(out_ty), mask=mask)
    tl.store(out + HALF, tl.where(rot, x2 * cos + x1 * sin, x2).to(out_ty), mask=mask)


def rope_small_m_mm(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    head_size: int, rot_heads: int, config: SmallMConfig) -> torch.Tensor:
    """:func:`rope_linear`'s fused kernel, ``[M, N]``: ``config`` a small-M table config, its ``BLOCK_N`` weight rows a
    program ``BLOCK_N / 2`` column pairs, which must divide ``head_size / 2``. An unrolled GEMV (``UNROLL``: a row a
    program), or a dot tile of one split (``BLOCK_N / 2 >= 16`` for ``tl.dot``). An eager launcher for CUDA tensors,
    and CPU tensors under ``TRITON_INTERPRET=1``."""
    if not HAS_TRITON:
        raise RuntimeError("rope_small_m_mm needs Triton, which does not import here")
    pairs = config.BLOCK_N // 2
    if pairs < 1 or (head_size // 2) % pairs or not (config.UNROLL or (config.DOT and config.SPLIT_K == 1 and pairs >= 16)):
        raise ValueError(f"rope_small_m_mm: config must be an unrolled GEMV, or a dot tile of one split with BLOCK_N >= "
                         f"32, of BLOCK_N = 2 x a divisor of head_size / 2 = {head_size // 2}; got {config}")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    args = (x, weight, out, positions.reshape(-1), cache)
    flags = dict(HALF=head_size // 2, EVEN=(n // 2) % pairs == 0 and k % config.BLOCK_K == 0, num_warps=config.num_warps,
                 INT64=needs_int64(m * x.stride(0), n * weight.stride(0)), enable_fp_fusion=False,
                 **pdl_args(None, x, any_size=True))
    strides = (x.stride(0), weight.stride(0), cache.stride(0))
    if config.UNROLL:
        _rope_gemv_kernel[(m * cdiv(n // 2, pairs),)](*args, m, n, rot_heads * head_size, *strides, K=k, BLOCK_N=pairs,
                                                      BLOCK_K=config.BLOCK_K, **flags)
    else:
        _rope_gemm_kernel[(cdiv(m, config.BLOCK_M) * cdiv(n // 2, pairs),)](
            *args, m, n, k, rot_heads * head_size, *strides, BLOCK_M=config.BLOCK_M, BLOCK_N=pairs,
            BLOCK_K=config.BLOCK_K, SWAP=config.SWAP, num_stages=config.num_stages, **flags)
    return out


def _config(x: torch.Tensor, weight: torch.Tensor, head_size: int) -> SmallMConfig | None:
    """The fused kernel's config for these operands, or None: the unfused pair. M first: a prefill pays one test.

    One token only. The dot-tile form at 2-16 tokens (16 rows, 32 column pairs) beat ``ops.linear`` then the rotary
    kernel alone on the H100 (results/rope_linear_h100.md, "fused dot": 20.35 against 22.74 µs on Llama-3-8B's QKV
    at 2 tokens), but not cuBLAS then Inductor's rotary in the step: Llama-3.2-1B's batch-8 step ran it at 9.15 µs a
    layer against 7.13 + 1.55 (results/gatedlin_kernel_profile_1b_h100.md), and the step was 2.2% slower."""
    if x.shape[0] != 1 or not (HAS_TRITON and small_m_operands(x, weight, max_m=1)):
        return None
    config = small_m_config(1, weight.shape[0], weight.shape[1], x.dtype)
    # the table's GEMV row, its BLOCK_N rows a program whole pairs within half a head (rope_small_m_mm's condition)
    fits = config is not None and config.UNROLL and config.BLOCK_N >= 2 and (head_size // 2) % (config.BLOCK_N // 2) == 0
    return config if fits and envs.small_m_gemm() else None


def rope_linear_uses_small_m(x: torch.Tensor, weight: torch.Tensor, head_size: int) -> bool:
    """Whether :func:`rope_linear` runs these operands as one fused kernel (else the unfused pair)."""
    return _config(x, weight, head_size) is not None


def _check(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
           head_size: int, rot_heads: int) -> None:
    if x.dtype not in ROPE_LINEAR_DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"rope_linear: x and weight must both be bfloat16 or float16; got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"rope_linear: x must be [M, K] and weight [N, K]; got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    if head_size < 2 or head_size % 2 or weight.shape[0] % head_size or not 0 <= rot_heads * head_size <= weight.shape[0]:
        raise ValueError(f"rope_linear: head_size must be even and divide N = {weight.shape[0]}, rot_heads * head_size "
                         f"at most N; got head_size {head_size}, rot_heads {rot_heads}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_size:
        raise ValueError(f"rope_linear: cos_sin_cache must be [max_position, head_size = {head_size}] (full rotary); "
                         f"got {list(cos_sin_cache.shape)}")
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rope_linear: positions must be 1-d int32 / int64, a token each; got {positions.dtype} of "
                         f"shape {list(positions.shape)}")
    # A constant message: traced, the sizes may be symbolic, which a message's closure must not hold.
    torch._check(positions.shape[0] == x.shape[0], lambda: "rope_linear: positions must have one entry a row of x")


def _rope_linear_impl(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      head_size: int, rot_heads: int) -> torch.Tensor:
    config = _config(x, weight, head_size)
    if config is not None:
        return rope_small_m_mm(x, weight, positions, cos_sin_cache, head_size, rot_heads, config)
    out = linear(x, weight) if x.shape[0] <= triton_max_m(x.dtype) else F.linear(x, weight)
    rotate_heads_in_place(positions, out, cos_sin_cache, head_size, rot_heads)
    return out


def _rope_linear_fake(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      head_size: int, rot_heads: int) -> torch.Tensor:
    _check(x, weight, positions, cos_sin_cache, head_size, rot_heads)
    return x.new_empty((x.shape[0], weight.shape[0]))


# Registered with torch.library.Library directly, as ops.linear: a compiled graph calls it eagerly every step.
_lib = torch.library.Library("dynamo_once", "FRAGMENT")  # kept alive: the registrations live as long as it
_lib.define("rope_linear(Tensor x, Tensor weight, Tensor positions, Tensor cos_sin_cache, int head_size, "
            "int rot_heads) -> Tensor")
_lib.impl("rope_linear", _rope_linear_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dynamo_once::rope_linear", _rope_linear_fake, lib=_lib)


def rope_linear(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                head_size: int, rot_heads: int) -> torch.Tensor:
    """``x @ weight.T`` ``[M, N]`` in ``x``'s dtype, the first ``rot_heads`` heads of ``head_size`` columns of each
    row rotated by the angles of its position (NeoX halves, full rotary): one fused kernel at one token (see the
    module docstring), else ``ops.linear`` and the rotary kernel.

    Args:
        x: ``bfloat16`` or ``float16 [M, K]``; weight: the same dtype, ``[N, K]`` (a merged QKV projection's, the
            q heads then the k heads first).
        positions: ``[M]`` int32 / int64, rows of ``cos_sin_cache``.
        cos_sin_cache: ``[max_position, head_size]``, cos then sin of each frequency (``ops.compute_cos_sin_cache``).
        head_size: columns a head (even); rot_heads: the leading heads that rotate (q's and k's).
    Raises:
        TypeError: another dtype. ValueError: another shape.
    """
    _check(x, weight, positions, cos_sin_cache, head_size, rot_heads)
    return torch.ops.dynamo_once.rope_linear(x, weight, positions, cos_sin_cache, head_size, rot_heads)


def rope_linear_ref(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                    head_size: int, rot_heads: int) -> torch.Tensor:
    """The reference: ``F.linear`` in ``x``'s dtype, then :func:`ops.rotary_embedding_ref` on the rotated heads."""
    out = F.linear(x, weight)
    cols = rot_heads * head_size
    rotated, _ = rotary_embedding_ref(positions, out[:, :cols], out[:, :0], cos_sin_cache, head_size, True)
    return torch.cat((rotated, out[:, cols:]), dim=1)
