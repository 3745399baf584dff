"""Paged attention's kernels: the KV-cache write, and split-KV ("flash-decoding") decode attention.

The cache of one layer is ``[2, num_blocks, block_size, Hkv, D]`` (keys, then
values). Sequence ``b``'s block ``j`` holds its tokens ``j * block_size ...
(j + 1) * block_size - 1`` and ``block_table[b, j]`` names it; a new token
``t`` goes to the flat slot ``slot_mapping[t] = block * block_size + offset``.

- ``write_kv_cache``: one launch writes both halves, slots in any order
  (instead of two ``index_copy_`` and their reshapes and casts).
- ``paged_decode``: one query token per sequence. Decode batches of 1-256
  sequences are where per-step latency lives: one query row per sequence
  gives too little parallelism per sequence for a tile-per-sequence kernel at
  small batch, so the kernel splits each sequence's pages over
  ``num_splits`` programs (chosen from the batch size only, so a CUDA graph
  captured per batch size stays valid) and the partial softmaxes are merged:
  by the last split of each (sequence, KV head) to finish, inside the same
  launch (``DecodeConfig.fused_merge``: an arrival counter per sequence and KV
  head in the persistent :class:`DecodeWorkspace`, reset by that program), or
  by a second kernel. The decode kernel may also write the decode tokens' new
  keys and values to the cache itself (``DecodeConfig.fused_write``): the
  program whose split holds the new position writes them and takes that
  position from registers, so no program reads a slot the launch writes. A
  decode-only step's attention is then one launch a layer, instead of three. The split count, tile and launch options come from a
  rule table, ``ops.paged_decode_config.DECODE_TABLE``
  (``benchmarks.attention --sweep`` measures candidates for it). One program serves all query heads of a KV head (GQA:
  K and V are read once per group), with ``tl.dot`` on a 16-row tile. Both
  kernels read only device tensors (``block_table``, ``seq_lens``,
  ``slot_mapping``): no host sync, safe to capture in a CUDA graph.

The references define the ops: ``write_kv_cache_ref`` is ``index_copy_`` into
each half (cast to the cache's dtype); ``paged_decode_ref`` attends in fp32
over each sequence's gathered keys, with the optional sliding window (the last
``sliding_window`` positions) and logit soft cap (``cap * tanh(logits /
cap)``, Gemma 2), and casts back to q's dtype once.

Each kernel is reachable two ways: the ``torch.ops.dynamo_once`` ops (Triton
on CUDA, the reference elsewhere; opaque custom ops under torch.compile, see
below), and the launchers ``write_kv_cache_triton`` / ``paged_decode_triton``.
The attention layer (``models.attention``) calls the launchers directly: it
runs eagerly inside its own opaque op, once per layer and step, where a second
op dispatch would add host time to every decode step. For the same reason the
decode launcher comes in two halves: :class:`DecodePlan` (split count, grids,
slices, split-KV scratch from a persistent :class:`DecodeWorkspace`), built once
per step, and :func:`paged_decode_launch`, per layer; and every kernel launches
through ``ops.triton_utils.FastLaunch``.
"""

from __future__ import annotations

import functools

import torch

from .kv_quant import FP8_KV_DTYPE, UNIT_KV_SCALES, KVScales, dot_operand, f16_from_e4m3, inverse_scale, \
    quantize_kv_ref, to_cache
from .launch_cache import LaunchCache
from .paged_decode_config import DecodeConfig, decode_config
from .triton_utils import BoundLaunch, FastLaunch, Slot, next_power_of_2, pdl_args, pdl_available, tl, triton, \
    use_triton

__all__ = [
    "write_kv_cache",
    "paged_decode",
    "write_kv_cache_triton",
    "bind_write_kv_cache",
    "write_kv_cache_launch",
    "paged_decode_triton",
    "decode_num_splits",
    "decode_workspace_numel",
    "DecodePlan",
    "DecodeWorkspace",
    "paged_decode_launch",
    "LAYER_STRIDES",
    "write_kv_cache_ref",
    "paged_decode_ref",
]


# ``first`` (the first token's row) not specialized: a mixed step's decode count, 1 or any, compiles no kernel apart.
@triton.jit(do_not_specialize=["first"])
def _write_kv_cache_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_k, stride_v, half_stride, first, k_inv, v_inv,
                           ROW: tl.constexpr, BLOCK: tl.constexpr):
    # One program per new token, row first + program id: its Hkv * D keys and values to its slot in each half of
    # the cache (an fp8 cache: times the inverse scales k_inv, v_inv, ops.kv_quant).
    t = (tl.program_id(0) + first).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    dst = cache_ptr + slot * ROW + offs
    tl.store(dst, to_cache(k, k_inv, cache_ptr), mask=mask)
    tl.store(dst + half_stride, to_cache(v, v_inv, cache_ptr), mask=mask)


_write_kv_cache_launch = FastLaunch(_write_kv_cache_kernel)


def write_kv_cache_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """:func:`write_kv_cache` in one launch (instead of two ``index_copy_`` and their reshapes and casts).

    Slots must be valid (the runner sends padding tokens to a reserved block); the cache is contiguous.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _write_kv_cache_launch((num_tokens,), k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), kv_cache.stride(0),
                           0, inverse_scale(k_scale), inverse_scale(v_scale),
                           **_write_constexprs(kv_cache.shape[-2] * kv_cache.shape[-1]))


def _write_constexprs(row: int) -> dict[str, int]:
    block = next_power_of_2(row)
    return dict(ROW=row, BLOCK=block, num_warps=max(1, min(8, block // 256)))


def bind_write_kv_cache(slot_mapping: torch.Tensor, num_tokens: int, row: int, first: int = 0) -> BoundLaunch | None:
    """The cache-write kernel bound to ``num_tokens`` tokens from row ``first`` on (of ``slot_mapping`` and of the
    launches' k and v) and cache rows of ``row`` (Hkv * D) elements (None: no token): :func:`write_kv_cache_triton`'s
    launch, less what may differ between layers (see :func:`write_kv_cache_launch`). The attention op binds it once
    a step (``models.AttentionMetadata``); ``first`` spares it slicing k and v per layer (~0.8 µs a slice)."""
    if num_tokens == 0:
        return None
    t, s = Slot.tensor, Slot.scalar  # the arguments as write_kv_cache_triton passes them
    return _write_kv_cache_launch.bind((num_tokens,), (t(0), t(1), t(2), slot_mapping, s(0), s(1), s(2), first,
                                                       s(3), s(4)), **_write_constexprs(row))


#: What the attention op passes its launch helpers (:func:`write_kv_cache_launch`, :func:`paged_decode_launch`,
#: ``ops.paged_prefill.prefill_launch``) as ``strides``, read once a call (one ``stride()`` a tensor, not one per
#: launch): ``(q, k, v, out)``'s row strides and the cache's four leading strides, in this order, every tensor's
#: last dimension contiguous (the caller's to ensure). None: each helper reads its own.
LAYER_STRIDES = ("q_row", "k_row", "v_row", "out_row", "cache_half", "cache_block", "cache_slot", "cache_head")


def write_kv_cache_launch(launch: BoundLaunch, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          target: tuple[int, int] | None = None, strides: tuple[int, ...] | None = None,
                          kv_inv: tuple[float, float] = (1.0, 1.0)) -> None:
    """One launch of a :func:`bind_write_kv_cache`: rows ``first..first + num_tokens - 1`` of ``k``, ``v`` (``[T,
    Hkv * D]``, as its slots) into the contiguous ``kv_cache``. ``target``: see :class:`~ops.triton_utils.BoundLaunch`;
    ``strides``: see :data:`LAYER_STRIDES`; ``kv_inv``: the inverse scales of an fp8 cache (``ops.kv_quant``)."""
    if strides is not None:
        launch((k, v, kv_cache), (strides[1], strides[2], strides[4], *kv_inv), target)
        return
    ks, vs = k.stride(), v.stride()
    if ks[-1] != 1:
        k = k.contiguous()
        ks = k.stride()
    if vs[-1] != 1:
        v = v.contiguous()
        vs = v.stride()
    launch((k, v, kv_cache), (ks[0], vs[0], kv_cache.stride(0), *kv_inv), target)


# The split count is a runtime argument, not specialized (one compile serves every count > 1: the sweep of
# ``benchmarks.attention`` times many), with SPLIT (count > 1) the constexpr that drops the partial results; so is
# the partial LSE's head stride (the split count, whose divisibility by 16 would otherwise compile apart).
@triton.jit(do_not_specialize=["num_splits", "stride_ml_h", "heads_first"])
def _decode_split_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    out_ptr, counter_ptr, k_new_ptr, v_new_ptr, slot_ptr,
    stride_q_t, stride_q_h,
    stride_c_half, stride_c_b, stride_c_s, stride_c_h,
    stride_bt,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_o_t, stride_kn, stride_vn,
    scale, soft_cap, window, k_inv, v_inv, v_scale, num_splits, heads_first,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, EVEN_D: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
    FUSED_WRITE: tl.constexpr, FUSED_MERGE: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr,
    CONVERT_V: tl.constexpr = False, PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False,
):
    # One program: sequence b, KV head kvh (its GROUP query heads), split s of the sequence's pages.
    # SPLIT False (one split): mid_o_ptr is the output itself (q's dtype), no merge follows, mid_lse is not written.
    # heads_first (runtime 0 / 1): the grid is (KV heads, sequences, splits) (DecodeConfig.heads_first says why).
    # FUSED_WRITE: this step's key and value of the sequence (k_new / v_new row b, to flat slot slot_ptr[b], its
    # position seq_len - 1) are written here by the one program whose range holds that position, which adds
    # them to its softmax from registers (after its loop, which skips the position): no program of the launch
    # reads a slot one of them writes.
    # FUSED_MERGE: the last of the sequence's splits to arrive (counter_ptr, see _arrive_and_merge) merges.
    # An fp8 cache (ops.kv_quant): scale holds k_scale, each split's output is times v_scale, and the new key and
    # value are written times k_inv, v_inv.
    # PDL (DecodePlan.pdl): launched early behind the kernel before (q's rotary, a GEMM): wait for its end before
    # any load of what it writes, then let the kernel after this one (the o projection) launch in turn.
    # PRELOAD (FUSED_WRITE only; DecodeConfig.preload): the split's first K / V chunk, its length and table entries
    # read before that wait (nothing a kernel of the step writes: the new slot is this launch's, masked in the loop).
    b = tl.where(heads_first != 0, tl.program_id(1), tl.program_id(0))
    kvh = tl.where(heads_first != 0, tl.program_id(0), tl.program_id(1))
    s = tl.program_id(2)
    if PDL and not PRELOAD:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq_len = tl.load(seq_lens_ptr + b)
    start, p0, end = _split_range(seq_len, s, num_splits, window, PAGE, SPLIT, USE_WINDOW)
    last = seq_len - 1  # the new token's position
    table_ptr = block_table_ptr + b * stride_bt
    first = (0, 0, 0)  # PRELOAD: the first chunk's (K, V, mask)
    if PRELOAD:
        first = _load_chunk(cache_ptr, table_ptr, kvh, p0 * PAGE, start, end, last, stride_c_half, stride_c_b,
                            stride_c_s, stride_c_h, HEAD_D, BLOCK_D, PAGE, BLOCK_N, EVEN_D, FUSED_WRITE)
    if PDL and PRELOAD:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_D
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    q = dot_operand(q, cache_ptr)
    k_new = tl.zeros([BLOCK_D], cache_ptr.dtype.element_ty)
    v_new = tl.zeros([BLOCK_D], cache_ptr.dtype.element_ty)
    if FUSED_WRITE:
        k_new, v_new = _write_new_kv(k_new_ptr, v_new_ptr, slot_ptr, cache_ptr, b, kvh, stride_kn, stride_vn,
                                     stride_c_half, stride_c_b, stride_c_s, stride_c_h,
                                     (p0 * PAGE <= last) & (last < end), k_inv, v_inv, HEAD_D, BLOCK_D, PAGE)
    m_i, l_i, acc = _attend_range(q, k_new, v_new, cache_ptr, table_ptr, kvh, start, p0, end,
                                  last, stride_c_half, stride_c_b, stride_c_s, stride_c_h, scale, soft_cap, first,
                                  BLOCK_G, HEAD_D, BLOCK_D, PAGE, BLOCK_N, EVEN_D, USE_SOFTCAP, IEEE, FUSED_WRITE,
                                  CONVERT_V, PRELOAD)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        out = out * v_scale
    mo = mid_o_ptr + b * stride_mo_b + heads[:, None] * stride_mo_h + s * stride_mo_s + offs_d[None, :]
    tl.store(mo, out.to(mid_o_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
        tl.store(mid_lse_ptr + b * stride_ml_b + heads * stride_ml_h + s, lse, mask=g_mask)
        if FUSED_MERGE:
            n_kvh = tl.where(heads_first != 0, tl.num_programs(0), tl.num_programs(1))
            _arrive_and_merge(counter_ptr + b * n_kvh + kvh, mid_o_ptr, mid_lse_ptr, out_ptr, b, kvh, num_splits,
                              stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_o_t,
                              GROUP, HEAD_D, BLOCK_D, MERGE_G, MERGE_S)


@triton.jit
def _split_range(seq_len, s, num_splits, window, PAGE: tl.constexpr, SPLIT: tl.constexpr, USE_WINDOW: tl.constexpr):
    """``(start, p0, end)``: the first attended position (the window's), split s's first page and its end."""
    start = seq_len * 0
    if USE_WINDOW:
        start = tl.maximum(seq_len - window, 0)  # the query sits at seq_len - 1
    first_page = start // PAGE
    p0 = first_page
    end = seq_len
    if SPLIT:
        n_pages = (seq_len + PAGE - 1) // PAGE
        per_split = (n_pages - first_page + num_splits - 1) // num_splits
        p0 = first_page + s * per_split
        end = tl.minimum((p0 + per_split) * PAGE, seq_len)
    return start, p0, end


@triton.jit
def _write_new_kv(k_new_ptr, v_new_ptr, slot_ptr, cache_ptr, b, kvh, stride_kn, stride_vn,
                  stride_c_half, stride_c_b, stride_c_s, stride_c_h, writes, k_inv, v_inv,
                  HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr):
    """Head kvh of sequence b's new key and value, in the cache's dtype (ops.kv_quant.to_cache); stored to its slot
    where ``writes``."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_D
    k_new = tl.load(k_new_ptr + b.to(tl.int64) * stride_kn + kvh * HEAD_D + offs_d, mask=d_mask, other=0.0)
    v_new = tl.load(v_new_ptr + b.to(tl.int64) * stride_vn + kvh * HEAD_D + offs_d, mask=d_mask, other=0.0)
    k_new = to_cache(k_new, k_inv, cache_ptr)
    v_new = to_cache(v_new, v_inv, cache_ptr)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    dst = cache_ptr + (slot // PAGE) * stride_c_b + (slot % PAGE) * stride_c_s + kvh * stride_c_h + offs_d
    tl.store(dst, k_new, mask=d_mask & writes)
    tl.store(dst + stride_c_half, v_new, mask=d_mask & writes)
    return k_new, v_new


@triton.jit
def _attend_range(q, k_new, v_new, cache_ptr, table_ptr, kvh, start, p0, end, last,
                  stride_c_half, stride_c_b, stride_c_s, stride_c_h, scale, soft_cap, first,
                  BLOCK_G: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                  FUSED_WRITE: tl.constexpr, CONVERT_V: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    """The online softmax of q over positions ``[max(start, p0 * PAGE), end)``: ``(m, l, acc)``. FUSED_WRITE: the
    position ``last`` from k_new / v_new (registers), not the cache (whose slot this launch writes). CONVERT_V (an
    fp8 cache, on a GPU): each value tile converted to fp16 as loaded (``DecodeConfig.convert_v``). PRELOAD: the
    first chunk's ``(K, V, mask)`` are ``first``, already loaded; the loop starts at the second."""
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    pos = p0 * PAGE
    if PRELOAD:  # the split's first chunk, read before the kernel's PDL wait (it may hold nothing: masked)
        k, v, n_mask = first
        p, alpha, m_i, l_i = _chunk_scores(q, k, n_mask, m_i, l_i, scale, soft_cap, USE_SOFTCAP, IEEE, FUSED_WRITE)
        acc = _chunk_values(acc, alpha, p, v, q.dtype, IEEE, CONVERT_V)
        pos += BLOCK_N
    # Chunks to the split's end (its last page's or the sequence's): each holds a valid key (BLOCK_N >= PAGE).
    for pos0 in range(pos, end, BLOCK_N):
        n_mask, off, kv_mask = _chunk_addresses(table_ptr, kvh, pos0, start, end, last, stride_c_b, stride_c_s,
                                                stride_c_h, HEAD_D, BLOCK_D, PAGE, BLOCK_N, EVEN_D, FUSED_WRITE)
        k = tl.load(cache_ptr + off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        p, alpha, m_new, l_i = _chunk_scores(q, k, n_mask, m_i, l_i, scale, soft_cap, USE_SOFTCAP, IEEE, FUSED_WRITE)
        v = tl.load(cache_ptr + stride_c_half + off, mask=kv_mask, other=0.0)
        acc = _chunk_values(acc, alpha, p, v, q.dtype, IEEE, CONVERT_V)
        m_i = m_new
    if FUSED_WRITE:
        m_i, l_i, acc = _add_new_token(q, k_new, v_new, m_i, l_i, acc, (p0 * PAGE <= last) & (last < end), scale,
                                       soft_cap, USE_SOFTCAP)
    return m_i, l_i, acc


@triton.jit
def _chunk_addresses(table_ptr, kvh, pos0, start, end, last, stride_c_b, stride_c_s, stride_c_h,
                     HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                     EVEN_D: tl.constexpr, FUSED_WRITE: tl.constexpr):
    """Positions ``pos0 ... pos0 + BLOCK_N`` of KV head kvh: which are attended (``n_mask``: in ``[start, end)``, and
    with FUSED_WRITE not ``last``), their K offsets in the cache's first half and the loads' mask."""
    offs_d = tl.arange(0, BLOCK_D)
    k_pos = pos0 + tl.arange(0, BLOCK_N)
    n_mask = (k_pos < end) & (k_pos >= start)
    if FUSED_WRITE:  # the new token's position is added after the loop, from registers
        n_mask = n_mask & (k_pos != last)
    block = tl.load(table_ptr + k_pos // PAGE, mask=n_mask, other=0).to(tl.int64)
    off = block[:, None] * stride_c_b + (k_pos % PAGE)[:, None] * stride_c_s + kvh * stride_c_h + offs_d[None, :]
    if EVEN_D:  # a mask constant along each row: 16-byte vector loads of K and V
        kv_mask = n_mask[:, None]
    else:
        kv_mask = n_mask[:, None] & (offs_d < HEAD_D)[None, :]
    return n_mask, off, kv_mask


@triton.jit
def _load_chunk(cache_ptr, table_ptr, kvh, pos0, start, end, last, stride_c_half, stride_c_b, stride_c_s, stride_c_h,
                HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                EVEN_D: tl.constexpr, FUSED_WRITE: tl.constexpr):
    """The chunk at ``pos0``'s ``(K, V, n_mask)`` (:func:`_chunk_addresses`' positions), in the cache's dtype."""
    n_mask, off, kv_mask = _chunk_addresses(table_ptr, kvh, pos0, start, end, last, stride_c_b, stride_c_s,
                                            stride_c_h, HEAD_D, BLOCK_D, PAGE, BLOCK_N, EVEN_D, FUSED_WRITE)
    return (tl.load(cache_ptr + off, mask=kv_mask, other=0.0),
            tl.load(cache_ptr + stride_c_half + off, mask=kv_mask, other=0.0), n_mask)


@triton.jit
def _chunk_scores(q, k, n_mask, m_i, l_i, scale, soft_cap, USE_SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                  FUSED_WRITE: tl.constexpr):
    """One chunk's softmax step from its keys ``k`` (the cache's dtype; fp8 converted to q's): ``(p, alpha, m, l)``,
    the probabilities, the rescale of the running sums, the new running max and sum."""
    k = k.to(q.dtype)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * scale  # [BLOCK_G, BLOCK_N]
    if USE_SOFTCAP:
        qk = soft_cap * (2.0 * tl.sigmoid(2.0 * qk / soft_cap) - 1.0)  # tanh
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if FUSED_WRITE:  # a chunk may hold no key but the new token's: all -inf, which must add nothing
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(qk - m_ref[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _chunk_values(acc, alpha, p, v, dtype: tl.constexpr, IEEE: tl.constexpr, CONVERT_V: tl.constexpr):
    """``acc`` rescaled by ``alpha`` plus ``p @ v`` (``v`` in the cache's dtype: fp8 converted to ``dtype``, q's)."""
    v = (f16_from_e4m3(v) if CONVERT_V else v).to(dtype)
    if IEEE:
        return acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _add_new_token(q, k_new, v_new, m_i, l_i, acc, covers, scale, soft_cap, USE_SOFTCAP: tl.constexpr):
    """The online softmax state after one more key, the new token's (registers), where this split ``covers`` its
    position; unchanged elsewhere. Off the loop, whose K and V loads then go to ``tl.dot`` untouched."""
    qk = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale  # [BLOCK_G]
    if USE_SOFTCAP:
        qk = soft_cap * (2.0 * tl.sigmoid(2.0 * qk / soft_cap) - 1.0)
    qk = tl.where(covers, qk, float("-inf"))
    m_new = tl.maximum(m_i, qk)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(qk - m_ref)
    acc = acc * alpha[:, None] + p[:, None] * v_new.to(tl.float32)[None, :]
    return m_new, l_i * alpha + p, acc


@triton.jit
def _arrive_and_merge(counter, mid_o_ptr, mid_lse_ptr, out_ptr, b, kvh, num_splits,
                      stride_mo_b, stride_mo_h, stride_mo_s, stride_ml_b, stride_ml_h, stride_o_t,
                      GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, MERGE_G: tl.constexpr,
                      MERGE_S: tl.constexpr):
    """After a split's partial results are stored: count its arrival at the (sequence, KV head)'s counter; the
    last of the ``num_splits`` to arrive merges them all and resets the counter to 0 for the next launch.

    Memory order: the barrier puts every thread's stores of this program's partial results before the counter's
    update (one thread's atomic, then broadcast); the update is a gpu-scope release (those stores are visible
    device-wide before the count is) and an acquire (the merging program, whose count says every other split's
    release came before, then sees their stores). The partials are read past L1 (``.cg``) besides.
    """
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == num_splits - 1:
        # Every split of the GROUP heads at once, [MERGE_G, MERGE_S, BLOCK_D]: one round of loads, no dependent
        # ones; the sums in one fixed order (the same at every launch).
        offs_g = tl.arange(0, MERGE_G)[:, None]
        offs_s = tl.arange(0, MERGE_S)[None, :]
        offs_d = tl.arange(0, BLOCK_D)[None, None, :]
        gs_mask = (offs_g < GROUP) & (offs_s < num_splits)  # [G, S]
        heads = kvh * GROUP + offs_g
        lse = tl.load(mid_lse_ptr + b * stride_ml_b + heads * stride_ml_h + offs_s, mask=gs_mask,
                      other=float("-inf"), cache_modifier=".cg")  # split 0 is never empty
        o = tl.load(mid_o_ptr + b * stride_mo_b + (heads * stride_mo_h + offs_s * stride_mo_s)[:, :, None] + offs_d,
                    mask=gs_mask[:, :, None] & (offs_d < HEAD_D), other=0.0, cache_modifier=".cg")
        w = tl.exp(lse - tl.max(lse, 1)[:, None])
        w = tl.where(lse == float("-inf"), 0.0, w)
        res = tl.sum(o * w[:, :, None], 1) / tl.sum(w, 1)[:, None]  # [G, BLOCK_D]
        d_row = tl.arange(0, BLOCK_D)[None, :]
        tl.store(out_ptr + b * stride_o_t + heads * HEAD_D + d_row, res.to(out_ptr.dtype.element_ty),
                 mask=(offs_g < GROUP) & (d_row < HEAD_D))
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # every split has arrived: none counts after this


@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_o_t, stride_o_h,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_D
    lse = tl.load(mid_lse_ptr + b * stride_ml_b + h * stride_ml_h + offs_s)  # [S]; split 0 is never empty
    o = tl.load(mid_o_ptr + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_d[None, :],
                mask=d_mask[None, :], other=0.0)
    w = tl.exp(lse - tl.max(lse, 0))
    w = tl.where(lse == float("-inf"), 0.0, w)
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_o_t + h * stride_o_h + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


# Launched through FastLaunch: the attention op calls them eagerly once per layer and step (the piecewise
# path), where Triton's own launch costs tens of µs of host time each.
_decode_split_launch = FastLaunch(_decode_split_kernel)
_decode_merge_launch = FastLaunch(_decode_merge_kernel)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (CPU tensors, tests): small, and still more than one split
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device, head_size: int = 128) -> int:
    """Splits per sequence, from the batch size only: :func:`ops.paged_decode_config.decode_config`'s rule.

    Depends on nothing but shapes, so one CUDA graph per batch size stays valid. With the table's default rows
    (two waves of programs over the SMs), H200 (132 SMs), 8 KV heads: 1 sequence -> 32 splits, 32 -> 2, 128 -> 1
    (no merge kernel).
    """
    return decode_config(num_seqs, head_size).splits(num_seqs, num_kv_heads, _num_sms(device))


def decode_workspace_numel(max_num_seqs: int, num_heads: int, num_kv_heads: int, head_size: int,
                           device: torch.device) -> int:
    """fp32 elements of the split-KV partial results (``[B, Hq, splits, D + 1]``) of the largest of the decode
    batches of 1 to ``max_num_seqs`` sequences (at :func:`decode_num_splits`; a batch of one split needs none)."""
    most = 0
    for n in range(1, max_num_seqs + 1):
        splits = decode_num_splits(n, num_kv_heads, device, head_size)
        if splits > 1:
            most = max(most, n * splits)
    return most * num_heads * (head_size + 1)


class DecodeWorkspace:
    """Persistent split-KV scratch for decode batches of up to ``max_num_seqs``: one fp32 buffer per layer shape,
    and the fused merge's arrival counters (int32, one per sequence and KV head) per KV-head count.

    Owned by whatever builds a step's metadata (``models.engine.InputBatch``), so that every step's
    :class:`DecodePlan` is views of the same memory: no allocation per step, and a CUDA graph captured on
    a plan reads buffers that outlive it. Layers of one step share it: their split and merge launches are
    stream-ordered (and each launch leaves the counters at 0). A buffer is allocated at the first :meth:`get` of
    its shape and device, and never moves; the counters likewise, zeroed, never inside a CUDA-graph capture
    (which would record the zeroing, not run it): there :meth:`counters` has none to give.
    """

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self._buffers: dict[tuple, torch.Tensor] = {}
        #: The plans and bound launches of recent steps' metadata (``models.AttentionMetadata``), by what each was
        #: built from: a step takes those it shares with a recent one instead of building them.
        self.launches = LaunchCache()

    def get(self, num_heads: int, num_kv_heads: int, head_size: int, device: torch.device) -> torch.Tensor:
        """The flat fp32 buffer of this layer shape (:func:`decode_workspace_numel` elements) on ``device``."""
        key = (num_heads, num_kv_heads, head_size, device)
        buf = self._buffers.get(key)
        if buf is None:
            numel = decode_workspace_numel(self.max_num_seqs, num_heads, num_kv_heads, head_size, device)
            buf = self._buffers[key] = torch.empty(max(numel, 1), dtype=torch.float32, device=device)
            self.counters(num_kv_heads, device)  # allocated with the buffer, before any capture if it is
        return buf

    def counters(self, num_kv_heads: int, device: torch.device) -> torch.Tensor | None:
        """``max_num_seqs * num_kv_heads`` int32 zeros on ``device`` (left at zero by every launch that uses
        them); None when they do not exist yet and the current stream is capturing a CUDA graph."""
        key = ("counters", num_kv_heads, device)
        buf = self._buffers.get(key)
        if buf is None:
            buf = _new_counters(self.max_num_seqs * num_kv_heads, device)
            if buf is not None:
                self._buffers[key] = buf
        return buf


def _new_counters(numel: int, device: torch.device) -> torch.Tensor | None:
    """Zeroed int32 arrival counters, or None under CUDA-graph capture (the zeroing would only be recorded)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    return torch.zeros(max(numel, 1), dtype=torch.int32, device=device)


class DecodePlan:
    """What :func:`paged_decode_launch` needs that is the same for every layer of one decode batch.

    Built once per step (``models.AttentionMetadata.decode_plan`` caches it per layer shape), so that a layer
    pays none of it: the number of splits, the grids, the block sizes, the sliced block table and
    sequence lengths, and the split-KV partial results (views of a :class:`DecodeWorkspace`, or allocated
    here without one). Holds only shapes and views, no values: a CUDA graph captured on a plan stays valid.

    Args:
        block_table: ``[B, max_blocks]`` int32, rows of the B decode sequences; seq_lens: ``[B]`` int32.
        num_heads, num_kv_heads, head_size: Hq, Hkv, D; page: tokens per cache block.
        device: of the batch; num_splits: a power of two, or None (the config's).
        workspace: a flat fp32 buffer to take the partial results from; too small or None: allocated here.
        config: the launch configuration; None: :func:`ops.paged_decode_config.decode_config`'s (the table's).
        counters: the fused merge's arrival counters (int32 zeros, at least ``B * Hkv``: a
            :meth:`DecodeWorkspace.counters`); too small or None: allocated here, except under CUDA-graph capture,
            where the plan then merges with the merge kernel (``fused_merge`` False).
        kv_fp8: the cache is fp8 (``ops.kv_quant``): with ``config`` None, the fp8 table's config
            (:data:`~ops.paged_decode_config.DECODE_TABLE_FP8`).
        fused_write: whether the decode kernel writes the new keys and values :func:`paged_decode_launch` is given
            (else a cache-write launch before it); None: the config's ``fused_write``.
        fused_merge: whether, with more than one split, the decode kernel merges them itself (else a merge launch
            after it); None: the config's ``fused_merge``.
    """

    def __init__(self, block_table: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_size: int, page: int, device: torch.device, num_splits: int | None = None,
                 workspace: torch.Tensor | None = None, config: DecodeConfig | None = None,
                 counters: torch.Tensor | None = None, kv_fp8: bool = False, fused_write: bool | None = None,
                 fused_merge: bool | None = None) -> None:
        if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
            raise ValueError(f"paged_decode_triton: num_splits must be a power of two (the merge kernel reduces over "
                             f"them in one block) or None; got {num_splits}")
        b = self.num_seqs = block_table.shape[0]
        self.num_heads, self.head_size = num_heads, head_size
        self.block_table, self.seq_lens = block_table, seq_lens
        cfg = self.config = config or decode_config(b, head_size, kv_fp8)
        splits = self.num_splits = num_splits or cfg.splits(b, num_kv_heads, _num_sms(device))
        group = num_heads // num_kv_heads
        block_d = next_power_of_2(head_size)
        self.heads_first = int(cfg.heads_first)
        self.split_grid = (num_kv_heads, b, splits) if cfg.heads_first else (b, num_kv_heads, splits)
        self.merge_grid = (b, num_heads)
        self.split_constexprs = dict(GROUP=group, BLOCK_G=max(16, next_power_of_2(group)),  # tl.dot: >= 16 rows
                                     HEAD_D=head_size, BLOCK_D=block_d, PAGE=page, BLOCK_N=max(page, cfg.BLOCK_N),
                                     SPLIT=splits > 1, EVEN_D=block_d == head_size, num_warps=cfg.num_warps,
                                     num_stages=cfg.num_stages,
                                     CONVERT_V=cfg.convert_v and kv_fp8 and device.type == "cuda")
        self.merge_constexprs = dict(HEAD_D=head_size, BLOCK_D=block_d, NUM_SPLITS=splits, num_warps=cfg.merge_warps)
        self.counters: torch.Tensor | None = None
        if (cfg.fused_merge if fused_merge is None else fused_merge) and splits > 1:
            if counters is None or counters.numel() < b * num_kv_heads:
                counters = _new_counters(b * num_kv_heads, device)
            self.counters = counters
        self.fused_merge = self.counters is not None  # one launch: no merge kernel
        # paged_decode_launch's new_kv are written by the decode kernel
        self.fused_write = cfg.fused_write if fused_write is None else fused_write
        # PDL only where every program is resident at once: the next kernel's early programs then take no SM slot
        # one of this launch's still waits for.
        self.pdl = cfg.pdl and pdl_available(seq_lens) and b * num_kv_heads * splits <= 2 * _num_sms(device)
        self.split_constexprs.update(FUSED_MERGE=self.fused_merge, MERGE_G=next_power_of_2(group),
                                     MERGE_S=splits if self.fused_merge else 1, **pdl_args(self.pdl, seq_lens))
        self.mid_o: torch.Tensor | None = None
        self.mid_lse: torch.Tensor | None = None
        if splits > 1:  # one split: the split kernel writes the output, no partial results
            n_o, n_lse = b * num_heads * splits * head_size, b * num_heads * splits
            if workspace is None or workspace.numel() < n_o + n_lse:
                workspace = torch.empty(n_o + n_lse, dtype=torch.float32, device=device)
            self.mid_o = workspace[:n_o].view(b, num_heads, splits, head_size)
            self.mid_lse = workspace[n_o:n_o + n_lse].view(b, num_heads, splits)
        self._launches: dict[tuple[bool, bool, bool, bool], tuple[BoundLaunch, BoundLaunch | None]] = {}

    def launches(self, use_softcap: bool, use_window: bool, ieee: bool,
                 fused_write: bool) -> tuple[BoundLaunch, BoundLaunch | None]:
        """The split kernel's and (None when it merges itself or there is one split) the merge kernel's
        :class:`~ops.triton_utils.BoundLaunch` for these constexprs, bound at their first call: what is the same
        for every layer of the step (grids, constexprs, table, scratch) is not re-read per layer."""
        key = (use_softcap, use_window, ieee, fused_write)
        found = self._launches.get(key)
        if found is None:
            merge = _bind_merge(self) if self.num_splits > 1 and not self.fused_merge else None
            found = self._launches[key] = (_bind_split(self, *key), merge)
        return found


def _warmup(kernel: object) -> object:
    """``kernel.warmup`` called as a launcher is: compile for these arguments, launch nothing."""
    return lambda grid, *args, **kwargs: kernel.warmup(*args, grid=grid, **kwargs)


def paged_decode_launch(plan: DecodePlan, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None,
                        compile_only: bool = False,
                        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        target: tuple[int, int] | None = None, strides: tuple[int, ...] | None = None,
                        kv_scales: KVScales = UNIT_KV_SCALES) -> None:
    """Decode attention of ``plan``'s sequences into ``out`` (rows ``0..B-1`` of ``[>= B, Hq * D]``, any row
    stride): one launch (one split, or ``plan.fused_merge``), else two; nothing allocated.

    ``q`` (rows ``0..B-1``) and ``out`` may hold more rows (a mixed batch's prefill tokens): the grid covers
    the first B only, so no slicing is needed. q's and out's last dimension must be contiguous.
    ``new_kv``: ``(k, v, slot_mapping)`` whose rows ``0..B-1`` are the B sequences' new tokens (at position
    ``seq_lens[b] - 1``; more rows are ignored): written to the cache first, by the decode kernel itself when
    ``plan.fused_write`` (else by :func:`write_kv_cache_triton` before it). None: the cache already holds them.
    ``compile_only`` (CUDA only): compile the kernels for these arguments (Triton's ``warmup``), launch
    nothing; under Triton's ``AsyncCompileMode`` the compiles run on its executor (``benchmarks.attention``
    compiles its sweep's configs so, in parallel).

    The launches are the plan's bound ones (:meth:`DecodePlan.launches`): per layer, only the tensors and the
    scalars that may differ between layers are passed. ``target``: see :class:`~ops.triton_utils.BoundLaunch`;
    ``strides``: see :data:`LAYER_STRIDES` (new_kv's slot mapping then contiguous too). ``kv_scales``: an fp8
    cache's (``ops.kv_quant``; other caches ignore them).
    """
    b = plan.num_seqs
    if new_kv is not None and not plan.fused_write:
        k, v, slots = new_kv
        if not compile_only:
            write_kv_cache_triton(kv_cache, k[:b] if k.shape[0] > b else k, v[:b] if v.shape[0] > b else v, slots,
                                  kv_scales.k_scale, kv_scales.v_scale)
        new_kv = None
    quant = (kv_scales.k_inv, kv_scales.v_inv, kv_scales.v_scale)
    if kv_scales.k_scale != 1.0:
        scale = scale * kv_scales.k_scale
    split, merge = plan.launches(logits_soft_cap is not None, sliding_window is not None, q.dtype == torch.float32,
                                 new_kv is not None)
    tensors = (q, kv_cache, out)
    if strides is not None and not compile_only:
        q_rows, k_rows, v_rows, out_rows, c0, c1, c2, c3 = strides
        scalars = (q_rows, c0, c1, c2, c3, out_rows, scale, logits_soft_cap or 1.0, sliding_window or 0, *quant)
        if new_kv is not None:
            tensors += new_kv
            scalars += (k_rows, v_rows)
    else:
        sc = kv_cache.stride()
        out_rows = out.stride(0)
        scalars = (q.stride(0), sc[0], sc[1], sc[2], sc[3], out_rows, scale, logits_soft_cap or 1.0,
                   sliding_window or 0, *quant)
        if new_kv is not None:
            k, v, slots = (t if t.stride(-1) == 1 else t.contiguous() for t in new_kv)
            tensors += (k, v, slots)
            scalars += (k.stride(0), v.stride(0))
        if compile_only:
            _warmup(_decode_split_kernel)(split.grid, *split.full_args(tensors, scalars), **split.kwargs)
            if merge is not None:
                _warmup(_decode_merge_kernel)(merge.grid, *merge.full_args((out,), (out_rows,)), **merge.kwargs)
            return
    split(tensors, scalars, target)
    if merge is not None:
        merge((out,), (out_rows,), target)


def _bind_split(plan: DecodePlan, use_softcap: bool, use_window: bool, ieee: bool, fused_write: bool) -> BoundLaunch:
    """The split kernel bound to ``plan`` (:func:`paged_decode_launch`'s arguments, in the kernel's order).

    Per call: tensors ``(q, kv_cache, out[, k_new, v_new, slots])``; scalars ``(q.stride(0), the cache's four
    leading strides, out.stride(0), scale, soft cap, window, k_inv, v_inv, v_scale[, k_new.stride(0),
    v_new.stride(0)])``."""
    t, s = Slot.tensor, Slot.scalar
    d, bt = plan.head_size, plan.block_table
    out = t(2)
    if plan.num_splits == 1:  # the split kernel writes the output: no partial results
        mid_o, mid_lse, mo_strides, ml_strides = out, out, (s(5), d, 0), (0, 0)
    else:
        mid_o, mid_lse = plan.mid_o, plan.mid_lse
        mo_strides, ml_strides = plan.mid_o.stride()[:3], plan.mid_lse.stride()[:2]
    counters = plan.counters if plan.fused_merge else out
    if fused_write:
        k, v, slots, kv_strides = t(3), t(4), t(5), (s(12), s(13))
    else:  # unused by the kernel: any tensor of the right kind
        k, v, slots, kv_strides = t(0), t(0), bt, (0, 0)
    args = (t(0), t(1), bt, plan.seq_lens, mid_o, mid_lse, out, counters, k, v, slots,
            s(0), d, s(1), s(2), s(3), s(4), bt.stride(0), *mo_strides, *ml_strides, s(5),
            *kv_strides, s(6), s(7), s(8), s(9), s(10), s(11), plan.num_splits, plan.heads_first)
    return _decode_split_launch.bind(plan.split_grid, args, **plan.split_constexprs, USE_SOFTCAP=use_softcap,
                                     USE_WINDOW=use_window, IEEE=ieee, FUSED_WRITE=fused_write,
                                     PRELOAD=plan.config.preload and fused_write)


def _bind_merge(plan: DecodePlan) -> BoundLaunch:
    """The merge kernel bound to ``plan``; per call: tensors ``(out,)``, scalars ``(out.stride(0),)``."""
    mid_o, mid_lse = plan.mid_o, plan.mid_lse
    args = (mid_o, mid_lse, Slot.tensor(0), *mid_o.stride()[:3], *mid_lse.stride()[:2], Slot.scalar(0),
            plan.head_size)
    return _decode_merge_launch.bind(plan.merge_grid, args, **plan.merge_constexprs)


def paged_decode_triton(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        num_heads: int, head_size: int, scale: float, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None, num_splits: int | None = None,
                        config: DecodeConfig | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    """Decode attention, one query token per sequence, from the paged cache.

    Args:
        q: ``[B, Hq * D]``.
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` (already holding this step's keys).
        block_table: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32.
        num_splits, config: see :class:`DecodePlan` (None: the config table's).
        k_scale, v_scale: an fp8 cache's scales (``ops.kv_quant``); other caches ignore them.
    Returns:
        ``[B, Hq * D]`` in q's dtype.
    """
    _, _, page, num_kv_heads, _ = kv_cache.shape
    plan = DecodePlan(block_table, seq_lens, num_heads, num_kv_heads, head_size, page, q.device, num_splits,
                      config=config, kv_fp8=kv_cache.dtype == FP8_KV_DTYPE)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape[0], num_heads * head_size, dtype=q.dtype, device=q.device)
    paged_decode_launch(plan, q, kv_cache, out, scale, sliding_window, logits_soft_cap,
                        kv_scales=KVScales.of(k_scale, v_scale))
    return out


# Opaque custom ops, not triton_op as in the other op files: Inductor would gain nothing from seeing these
# kernels (it fuses nothing into a user kernel), and re-emitting the split kernel it passes the float
# arguments (scale, soft cap) as fp64, which the fp32 softmax state carried through the kernel's loop
# refuses ("Loop-carried variable m_i ... fp64", torch 2.11 + Triton 3.6 on the H200). Opaque, the ops run
# the launchers as in eager mode, under torch.compile too.
@torch.library.custom_op("dynamo_once::write_kv_cache", mutates_args=("kv_cache",))
def _write_kv_cache_op(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    if use_triton(kv_cache) and kv_cache.is_contiguous():
        write_kv_cache_triton(kv_cache, k, v, slot_mapping, k_scale, v_scale)
    else:
        write_kv_cache_ref(kv_cache, k, v, slot_mapping, k_scale, v_scale)


@_write_kv_cache_op.register_fake
def _write_kv_cache_fake(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                         k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    return None


@torch.library.custom_op("dynamo_once::paged_decode", mutates_args=())
def _paged_decode_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     num_heads: int, head_size: int, scale: float, sliding_window: int | None = None,
                     logits_soft_cap: float | None = None, num_splits: int | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    if not use_triton(q):
        return paged_decode_ref(q, kv_cache, block_table, seq_lens, num_heads, head_size, scale, sliding_window,
                                logits_soft_cap, k_scale, v_scale)
    return paged_decode_triton(q, kv_cache, block_table, seq_lens, num_heads, head_size, scale, sliding_window,
                               logits_soft_cap, num_splits, k_scale=k_scale, v_scale=v_scale)


@_paged_decode_op.register_fake
def _paged_decode_fake(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       num_heads: int, head_size: int, scale: float, sliding_window: int | None = None,
                       logits_soft_cap: float | None = None, num_splits: int | None = None, k_scale: float = 1.0,
                       v_scale: float = 1.0) -> torch.Tensor:
    return q.new_empty(q.shape)  # [B, Hq * D], contiguous, as both implementations return


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write ``k``, ``v`` (``[T, Hkv * D]``) to the flat slots ``slot_mapping`` of ``kv_cache``, in place; an fp8
    cache holds ``k / k_scale`` and ``v / v_scale`` (``ops.kv_quant``), any other the values as they are.

    One Triton launch for a contiguous CUDA cache, else :func:`write_kv_cache_ref`. Under torch.compile the
    declared mutation is functionalized, which may copy the cache (the attention layer's op declares none).
    """
    torch.ops.dynamo_once.write_kv_cache(kv_cache, k, v, slot_mapping, k_scale, v_scale)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 num_heads: int, head_size: int, scale: float, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None, num_splits: int | None = None, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> torch.Tensor:
    """Attention of each sequence's one new token over its ``seq_lens[b]`` tokens in the paged cache.

    Args:
        q: ``[B, Hq * D]``.
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, already holding this step's keys and values.
        block_table: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32.
        num_heads, head_size, scale: Hq, D and the softmax scale.
        sliding_window, logits_soft_cap: see the module docstring (None: off).
        num_splits: the CUDA kernel's programs per sequence and KV head, a power of two (default:
            :func:`decode_num_splits`, from the batch size).
        k_scale, v_scale: an fp8 cache's scales (its keys and values times them, ``ops.kv_quant``); other
            caches ignore them.
    Returns:
        ``[B, Hq * D]`` in q's dtype.
    """
    return torch.ops.dynamo_once.paged_decode(q, kv_cache, block_table, seq_lens, num_heads, head_size, scale,
                                              sliding_window, logits_soft_cap, num_splits, k_scale, v_scale)


def write_kv_cache_ref(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """The reference write: ``index_copy_`` of ``k``, ``v`` (``[T, Hkv * D]``, in the cache's dtype as
    ``ops.kv_quant.quantize_kv_ref`` rounds them) into the flat slots ``slot_mapping`` of each half of ``kv_cache``."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    for half, x, scale in ((0, k, k_scale), (1, v, v_scale)):
        rows = quantize_kv_ref(x.reshape(-1, num_kv_heads, head_size), scale, kv_cache.dtype)
        if kv_cache.dtype == FP8_KV_DTYPE:  # as bytes: the CPU's index_copy_ takes no fp8
            flat[half].view(torch.uint8).index_copy_(0, slot_mapping, rows.view(torch.uint8))
        else:
            flat[half].index_copy_(0, slot_mapping, rows)


def paged_decode_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     num_heads: int, head_size: int, scale: float, sliding_window: int | None = None,
                     logits_soft_cap: float | None = None, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """The fp32 reference of :func:`paged_decode` (conventions: the module docstring), all sequences at once.

    Each sequence's whole block-table row is gathered (``[B, max_blocks * block_size, Hkv, D]``) and the
    positions outside ``[seq_len - sliding_window, seq_len)`` masked, so no host sync is needed.
    """
    num_seqs = q.shape[0]
    num_kv_heads = kv_cache.shape[-2]
    blocks = block_table.long()
    k = kv_cache[0][blocks].flatten(1, 2).float()  # [B, L, Hkv, D]
    v = kv_cache[1][blocks].flatten(1, 2).float()
    if kv_cache.dtype == FP8_KV_DTYPE:  # the values an fp8 cache stands for
        k, v = k * k_scale, v * v_scale
    # GQA: query head h reads KV head h // (Hq / Hkv): [B, Hkv, group, D].
    qf = q.float().reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_size)
    logits = torch.einsum("bhgd,blhd->bhgl", qf, k) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    pos = torch.arange(k.shape[1], device=q.device)
    end = seq_lens.long()[:, None]
    valid = pos < end  # [B, L]
    if sliding_window is not None:
        valid = valid & (pos >= end - sliding_window)
    probs = logits.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)
    return out.reshape(num_seqs, num_heads * head_size).to(q.dtype)
