"""Paged attention as one opaque op, ``torch.ops.dynamo_once.attention(q, k, v, layer_name)``.

The op writes the step's keys and values into its layer's KV cache and
attends, for a batch mixing decode and prefill sequences of different lengths
(layout and metadata: :mod:`models.forward_context`). Dynamo and Inductor see
only its fake implementation (``empty_like(q)``), so the token count T stays
symbolic and the op is the split point of the piecewise backend. The layer
(cache, scale, sliding window, soft-cap) and the step's metadata are looked up
by ``layer_name`` in the forward context at run time, never traced.

Implementations:

- native (every device; the reference): ``index_copy_`` into the cache, then
  per sequence, gather its pages and run SDPA (or explicit fp32 softmax when
  the logits are soft-capped, which SDPA cannot do);
- CUDA + Triton: the cache write is one Triton launch (both halves, any
  slot order); the decode sequences go through a split-KV ("flash-decoding")
  Triton kernel, the prefill ones through per-sequence SDPA (a fused kernel;
  a whole prompt reads this step's k, v directly). Decode batches of 1-256
  sequences are where per-step latency lives: one query row per sequence
  gives too little parallelism per sequence for a tile-per-sequence kernel at
  small batch, so the kernel splits each sequence's pages over
  ``num_splits`` programs (chosen from the batch size only, so a CUDA graph
  captured per batch size stays valid) and a second kernel merges the
  partial softmaxes. One program serves all query heads of a KV head (GQA:
  K and V are read once per group), with ``tl.dot`` on a 16-row tile. The
  decode path reads only device tensors (``block_table``, ``seq_lens``,
  ``slot_mapping``): no host sync, safe to capture in a CUDA graph.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from ops._triton import HAS_TRITON, cdiv, next_power_of_2, tl, triton

from .forward_context import AttentionMetadata, get_forward_context

logger = logging.getLogger(__name__)

__all__ = ["Attention", "attention", "attention_native", "write_kv_cache", "write_kv_cache_triton"]


# ----------------------------------------------------------------- native
def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``k``, ``v`` (``[T, Hkv * D]``) to the flat slots ``slot_mapping`` of ``kv_cache``."""
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    flat[0].index_copy_(0, slot_mapping, k.reshape(-1, num_kv_heads, head_size).to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.reshape(-1, num_kv_heads, head_size).to(kv_cache.dtype))


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                sliding_window: int | None, logits_soft_cap: float | None) -> torch.Tensor:
    """One sequence. q: [Lq, Hq, D] (the last Lq of L positions); k, v: [L, Hkv, D] -> [Lq, Hq, D]."""
    lq, hq, _ = q.shape
    seq_len, hkv, _ = k.shape
    # GQA: query head h reads KV head h // (Hq / Hkv), as HF's repeat_kv. Heads first: [H, L, D].
    # Repeated rather than SDPA's enable_gqa, which keeps SDPA off its fused kernels.
    q = q.transpose(0, 1)
    k = k.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    v = v.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
    if sliding_window is None and logits_soft_cap is None:
        # Causal attention with no mask tensor, so that SDPA may pick a fused kernel (a boolean mask
        # sends it to the math kernel: ~3 ms a layer for 2048 tokens on the H200, which dominated the
        # prefill step). A whole prompt is is_causal; a chunk after cached tokens (chunked prefill) is
        # causal aligned to the bottom right, which SDPA's CausalBias expresses without a mask tensor.
        # Fused kernels take 4-d inputs only (3-d ones always run the math kernel): [1, H, L, D].
        mask = None if lq == seq_len else causal_lower_right(lq, seq_len)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                             scale=scale)[0]
        return out.transpose(0, 1)
    q_pos = torch.arange(seq_len - lq, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    allowed = k_pos <= q_pos  # [Lq, L]
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    if logits_soft_cap is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
    else:
        scores = torch.matmul(q, k.transpose(1, 2)) * scale
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # fp32 softmax, as HF's eager path
        out = torch.matmul(probs, v)
    return out.transpose(0, 1)  # [Lq, Hq, D]


def _gather_seq(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Tokens ``0..seq_len-1`` of one sequence from one half of the cache ``[num_blocks, bs, Hkv, D]``."""
    block_size = cache.shape[1]
    blocks = block_table_row[: cdiv(seq_len, block_size)].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:seq_len]


def _prefill_loop(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                  first_seq: int, num_heads: int, head_size: int, scale: float,
                  sliding_window: int | None, logits_soft_cap: float | None,
                  k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> None:
    """Sequences ``first_seq..`` one by one, from the cache (host metadata: no sync).

    ``k_new``, ``v_new`` (this step's keys and values, in the cache's dtype): a whole prompt (no cached
    tokens before it) attends to them directly instead of gathering the same values back from the cache.
    """
    num_kv_heads = kv_cache.shape[-2]
    for i in range(first_seq, md.num_seqs):
        start, end = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        seq_len = md.seq_lens_cpu[i]
        if k_new is not None and seq_len == end - start:
            k = k_new[start:end].view(seq_len, num_kv_heads, head_size)
            v = v_new[start:end].view(seq_len, num_kv_heads, head_size)
        else:
            k = _gather_seq(kv_cache[0], md.block_table[i], seq_len)
            v = _gather_seq(kv_cache[1], md.block_table[i], seq_len)
        qi = q[start:end].view(end - start, num_heads, head_size)
        out[start:end] = _attend_one(qi, k, v, scale, sliding_window, logits_soft_cap).reshape(end - start, -1)


def attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     md: AttentionMetadata, num_heads: int, head_size: int, scale: float,
                     sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """The reference: write the cache, then attend sequence by sequence. Returns ``[T, Hq * D]``."""
    write_kv_cache(kv_cache, k, v, md.slot_mapping)
    out = torch.empty_like(q)
    _prefill_loop(out, q, kv_cache, md, 0, num_heads, head_size, scale, sliding_window, logits_soft_cap)
    return out


# ------------------------------------------------------------------ Triton
@triton.jit
def _write_kv_cache_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_k, stride_v, half_stride,
                           ROW: tl.constexpr, BLOCK: tl.constexpr):
    # One program per new token: its Hkv * D keys and values to its slot in each half of the cache.
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t.to(tl.int64) * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_v + offs, mask=mask)
    dst = cache_ptr + slot * ROW + offs
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half_stride, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """:func:`write_kv_cache` in one launch (instead of two ``index_copy_`` and their reshapes and casts).

    Slots must be valid (the runner sends padding tokens to a reserved block); the cache is contiguous.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    row = kv_cache.shape[-2] * kv_cache.shape[-1]
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    block = next_power_of_2(row)
    _write_kv_cache_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0), kv_cache.stride(0),
        ROW=row, BLOCK=block, num_warps=max(1, min(8, block // 256)),
    )


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    stride_q_t, stride_q_h,
    stride_c_b, stride_c_s, stride_c_h,
    stride_bt,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    scale, soft_cap, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
):
    # One program: sequence b, KV head kvh (its GROUP query heads), split s of the sequence's pages.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = 0
    if USE_WINDOW:
        start = tl.maximum(seq_len - window, 0)  # the query sits at seq_len - 1
    first_page = start // PAGE
    n_pages = (seq_len + PAGE - 1) // PAGE
    per_split = (n_pages - first_page + NUM_SPLITS - 1) // NUM_SPLITS
    p0 = first_page + s * per_split
    p1 = tl.minimum(p0 + per_split, n_pages)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_D
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for pos0 in range(p0 * PAGE, p1 * PAGE, BLOCK_N):
        k_pos = pos0 + offs_n
        n_mask = (k_pos < seq_len) & (k_pos >= start) & (k_pos < p1 * PAGE)
        block = tl.load(block_table_ptr + b * stride_bt + k_pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        off = block[:, None] * stride_c_b + (k_pos % PAGE)[:, None] * stride_c_s + kvh * stride_c_h + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = qk * scale  # [BLOCK_G, BLOCK_N]
        if USE_SOFTCAP:
            qk = soft_cap * (2.0 * tl.sigmoid(2.0 * qk / soft_cap) - 1.0)  # tanh
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        # Every chunk holds at least one valid key (pages p0..p1-1 all start inside [start, seq_len)).
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + off, mask=kv_mask, other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
    mo = mid_o_ptr + b * stride_mo_b + heads[:, None] * stride_mo_h + s * stride_mo_s + offs_d[None, :]
    tl.store(mo, out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + b * stride_ml_b + heads * stride_ml_h + s, lse, mask=g_mask)


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


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (CPU tensors, tests): small, and still more than one split
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits per sequence: about two waves of programs over the SMs, from the batch size only.

    Depends on nothing but shapes, so one CUDA graph per batch size stays valid.
    E.g. H200 (132 SMs), 8 KV heads: 1 sequence -> 32 splits, 32 -> 1 (256 programs already).
    """
    sms = _num_sms(device)
    want = cdiv(2 * sms, max(num_seqs * num_kv_heads, 1))
    return max(1, min(32, next_power_of_2(want)))


def paged_decode_triton(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        num_heads: int, head_size: int, scale: float, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Decode attention, one query token per sequence, from the paged cache.

    Args:
        q: ``[B, Hq * D]``.
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` (already holding this step's keys).
        block_table: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` int32.
    Returns:
        ``[B, Hq * D]`` in q's dtype.
    """
    num_seqs = q.shape[0]
    _, _, page, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    q3 = q.view(num_seqs, num_heads, head_size)
    if q3.stride(-1) != 1:
        q3 = q3.contiguous()
    if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
        raise ValueError(f"paged_decode_triton: num_splits must be a power of two (the merge kernel reduces over "
                         f"them in one block) or None; got {num_splits}")
    splits = num_splits or decode_num_splits(num_seqs, num_kv_heads, q.device)
    block_d = next_power_of_2(head_size)
    block_g = max(16, next_power_of_2(group))  # tl.dot needs >= 16 rows
    block_n = max(page, 64 if block_d <= 128 else 32)
    mid_o = torch.empty(num_seqs, num_heads, splits, head_size, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q3, k_cache, v_cache, block_table, seq_lens, mid_o, mid_lse,
        q3.stride(0), q3.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        scale, logits_soft_cap or 1.0, sliding_window or 0,
        GROUP=group, BLOCK_G=block_g, HEAD_D=head_size, BLOCK_D=block_d, PAGE=page, BLOCK_N=block_n,
        NUM_SPLITS=splits, USE_SOFTCAP=logits_soft_cap is not None, USE_WINDOW=sliding_window is not None,
        IEEE=q.dtype == torch.float32, num_warps=4,
    )
    out = torch.empty(num_seqs, num_heads, head_size, dtype=q.dtype, device=q.device)
    _decode_merge_kernel[(num_seqs, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_D=head_size, BLOCK_D=block_d, NUM_SPLITS=splits, num_warps=4,
    )
    return out.view(num_seqs, num_heads * head_size)


def attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   md: AttentionMetadata, num_heads: int, head_size: int, scale: float,
                   sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """Triton split-KV decode for the decode sequences, SDPA per prefill sequence."""
    if kv_cache.is_contiguous():
        write_kv_cache_triton(kv_cache, k, v, md.slot_mapping)
    else:
        write_kv_cache(kv_cache, k, v, md.slot_mapping)
    nd = md.num_decodes
    if md.is_decode_only:  # the metadata's tensors hold exactly the decodes: no slicing
        return paged_decode_triton(q, kv_cache, md.block_table, md.seq_lens, num_heads, head_size,
                                   scale, sliding_window, logits_soft_cap)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = paged_decode_triton(q[:nd], kv_cache, md.block_table[:nd], md.seq_lens[:nd], num_heads,
                                       head_size, scale, sliding_window, logits_soft_cap)
    same = k.dtype == kv_cache.dtype and v.dtype == kv_cache.dtype
    _prefill_loop(out, q, kv_cache, md, nd, num_heads, head_size, scale, sliding_window, logits_soft_cap,
                  k if same else None, v if same else None)
    return out


# ---------------------------------------------------------------- the op
def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    ctx = get_forward_context()
    try:
        layer = ctx.layers[layer_name]
    except KeyError:
        raise KeyError(f"dynamo_once::attention: no layer {layer_name!r} in the forward context; "
                       f"it has {sorted(ctx.layers)[:8]}") from None
    md = ctx.attn_metadata
    if md is None:  # profile / warm-up run: no cache yet
        return torch.zeros_like(q)
    return layer.forward_impl(q, k, v, md)


def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(q)


# Registered with torch.library.Library directly rather than torch.library.custom_op: the op runs
# eagerly between the compiled pieces (and in every eager step), and custom_op's Python dispatch
# layers cost ~5 us more per call on the CPU machine (8 vs 2.6 us for an empty op), x layers x steps.
# One kernel for every device (CompositeExplicitAutograd); inference only: no autograd formula.
_lib = torch.library.Library("dynamo_once", "FRAGMENT")  # kept alive: the registrations live as long as it
_lib.define("attention(Tensor q, Tensor k, Tensor v, str layer_name) -> Tensor")
_lib.impl("attention", _attention_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dynamo_once::attention", _attention_fake, lib=_lib)

attention = torch.ops.dynamo_once.attention
attention.__doc__ = """Write this step's k, v into layer ``layer_name``'s KV cache and attend; ``[T, Hq * D]``.

q: ``[T, Hq * D]``; k, v: ``[T, Hkv * D]``. The layer and the step's metadata
come from the forward context. The cache is not an argument (the layer owns
it), so the op declares no mutated argument and is never functionalized
(which would copy a whole cache per layer).
"""


class Attention(nn.Module):
    """One attention layer's KV cache and parameters; ``forward(q, k, v)`` calls the opaque op.

    Args:
        num_heads: query heads Hq.
        head_size: D.
        scale: softmax scale (``D ** -0.5`` for Llama, ``query_pre_attn_scalar ** -0.5`` for Gemma 2).
        num_kv_heads: Hkv (GQA: Hq a multiple of Hkv).
        layer_name: unique in the model; the op finds this layer by it.
        sliding_window: attend to the last ``sliding_window`` positions only.
        logits_soft_cap: ``cap * tanh(logits / cap)`` before the softmax.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, layer_name: str,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"Attention {layer_name}: num_heads ({num_heads}) must be a multiple of "
                             f"num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.layer_name = layer_name
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Set by KVCache; a plain attribute, not a buffer, so Dynamo never sees it.
        self.kv_cache: torch.Tensor | None = None
        self._impl = attention_cuda if torch.cuda.is_available() and HAS_TRITON else attention_native

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.dynamo_once.attention(q, k, v, self.layer_name)

    def forward_impl(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(f"Attention {self.layer_name}: no KV cache allocated (models.KVCache)")
        impl = attention_cuda if (self._impl is attention_cuda and q.is_cuda) else attention_native
        return impl(q, k, v, self.kv_cache, md, self.num_heads, self.head_size, self.scale,
                    self.sliding_window, self.logits_soft_cap)

    def extra_repr(self) -> str:
        return (f"{self.layer_name}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, soft_cap={self.logits_soft_cap}")


def default_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)
