"""Varlen paged prefill attention: one Triton launch for every sequence of a step, reading the paged KV cache.

Layout as :mod:`ops.paged_attention`: the cache of one layer is ``[2, num_blocks, block_size, Hkv, D]`` (keys,
then values) and ``block_table[s, j]`` names sequence ``s``'s block ``j``. Sequence ``s`` owns q's rows
``query_start_loc[s]:query_start_loc[s + 1]``: its ``query_len`` new tokens, the LAST ``query_len`` of its
``seq_lens[s]`` tokens, whose keys and values are already in the cache. Whole prompts (no context), chunks of
a prompt after cached context (chunked prefill) and decode rows (``query_len`` 1) are all the same case.

Semantics (``paged_prefill_ref`` is the definition): a query token at absolute position ``p`` attends to the
positions ``<= p`` and, with a sliding window, ``> p - sliding_window``; logits are ``scale * q.k``, soft-capped
as ``cap * tanh(logits / cap)`` when ``logits_soft_cap`` is given (Gemma 2), softmax in fp32, one cast back to
q's dtype. GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``.

The kernel (flash attention over pages): a program takes ``BLOCK_Q`` query tokens of one sequence and ALL the
query heads of one KV head, as one tile of ``BLOCK_M = BLOCK_Q * group`` rows (row ``r``: token ``r // group``,
head ``r % group``), so each key and value tile is read once per group and ``tl.dot`` gets a full M. It walks
the sequence's keys ``BLOCK_N`` at a time (several pages: every key's page is looked up in the block table),
first the tiles every row sees whole (no mask), then the diagonal ones (masked), with the online softmax in
fp32. The grid is ``(cdiv(max_query_len, BLOCK_Q), S, Hkv)``, from host ints only: no ``.item()``, so a CUDA
graph can hold it. Programs past their sequence's query length return at once; the query blocks are taken
longest-context first, so the heavy programs do not form the tail. All tile sizes come from
``prefill_config``, the one place to tune them. The launcher goes through ``FastLaunch`` and passes the cache
whole (no per-half views): the attention layer calls it eagerly once per layer and step.

Decode rows (``decode_rows``, the kernel's ``DECODE_ROWS``; the attention op's unified launch, where the decodes of a
step go in the same launch as its prompts): a sequence with one new token takes a tile of its own, its query heads on
``max(16, group)`` rows, instead of a block of ``BLOCK_M`` rows of which it would fill ``group``. Same key tiles,
same order of the sums as a one-token block. Measured on the H200 it helps little: a decode's program still takes
~3 µs a 64-key tile with many decodes (the prompts' launch options, one program a streaming multiprocessor; 128
decodes of 512 tokens: 201.5 µs a call against 222.9 with the 128-row tile, results/attention_host_decode_rows_uncapped.md
and attention_host_unified_past_cap.md).

The form that writes the cache (``new_kv=(k, v)``, the kernel's ``NEW_KV``; opt-in, off by default): the new
tokens' keys and values are not yet in the cache but in k and v (rows as q's). Each program stores ITS query
block's tokens for ITS KV head to their slots, and takes every position ``>= ctx_len = seq_len - query_len``
from k and v (cast to the cache's dtype, the bits the cache would hold) and only the earlier ones from the cache:
no program reads a slot that another writes, and the separate cache-write launch before this one goes (one launch
fewer a layer on the piecewise path, where host time is the launches'). Same tiles, same order of the sums: the
output is bit for bit that of the write then the plain form.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .kv_quant import FP8_KV_DTYPE, UNIT_KV_SCALES, KVScales, dot_operand, to_cache
from .triton_utils import BoundLaunch, FastLaunch, Slot, cdiv, next_power_of_2, tl, triton, use_triton

__all__ = [
    "PrefillConfig",
    "prefill_config",
    "paged_prefill",
    "paged_prefill_triton",
    "bind_prefill",
    "prefill_launch",
    "paged_prefill_ref",
]

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)): the softmax runs on exp2, folded into the scale


@triton.jit
def _load_kv(cache_ptr, off, kv_mask, new_ptr, stride_new, k_pos, ctx_len, offs_d, inv, SRC: tl.constexpr):
    """One half's tile at positions ``k_pos``. SRC 0: from the cache (every position ``< ctx_len``, or the plain
    form). 1: every position ``>= ctx_len``: this step's, which this launch writes, from the input rows
    ``new_ptr + (pos - ctx_len) * stride_new``. 2: each position from its source (a tile across ctx_len). The
    input is cast to the cache's dtype as the write does (``ops.kv_quant.to_cache``, ``inv`` the half's inverse
    scale), so that the tile holds the bits the cache would."""
    if SRC == 0:
        x = tl.load(cache_ptr + off, mask=kv_mask, other=0.0)
    elif SRC == 1:
        rows = (k_pos - ctx_len).to(tl.int64)
        x = tl.load(new_ptr + rows[:, None] * stride_new + offs_d[None, :], mask=kv_mask, other=0.0)
        x = to_cache(x, inv, cache_ptr)
    else:
        in_cache = k_pos < ctx_len
        old = tl.load(cache_ptr + off, mask=kv_mask & in_cache[:, None], other=0.0)
        rows = tl.maximum(k_pos - ctx_len, 0).to(tl.int64)  # clamped: the cache's lanes load nothing here
        new = tl.load(new_ptr + rows[:, None] * stride_new + offs_d[None, :], mask=kv_mask & ~in_cache[:, None],
                      other=0.0)
        x = tl.where(in_cache[:, None], old, to_cache(new, inv, cache_ptr))
    return x


@triton.jit
def _prefill_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row_ptr, start_n, kv_end, q_pos, kv_off,
                  stride_c_b, stride_c_s, qk_scale, soft_cap, window, offs_n, offs_d, d_mask,
                  k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, ctx_len, k_inv, v_inv,
                  PAGE: tl.constexpr, MASKED: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                  USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, SRC: tl.constexpr):
    # One tile of BLOCK_N keys at positions start_n...; MASKED: past some row's diagonal or the sequence's end.
    # SRC: where its keys and values come from, the cache or (positions >= ctx_len) k_new / v_new (see _load_kv).
    k_pos = start_n + offs_n
    if MASKED:
        n_mask = k_pos < kv_end
        block = tl.load(bt_row_ptr + k_pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        block = tl.load(bt_row_ptr + k_pos // PAGE).to(tl.int64)
        kv_mask = d_mask[None, :]
    off = block[:, None] * stride_c_b + (k_pos % PAGE)[:, None] * stride_c_s + kv_off + offs_d[None, :]
    k = _load_kv(k_cache_ptr, off, kv_mask, k_new_ptr, stride_k_t, k_pos, ctx_len, offs_d, k_inv, SRC)
    k = k.to(q.dtype)  # [BLOCK_N, BLOCK_D]
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = qk * qk_scale  # [BLOCK_M, BLOCK_N], in log2 units unless soft-capped
    if USE_SOFTCAP:
        # tanh, then log2 units (LOG2E as a literal: a FastLaunch kernel reads no non-constexpr global)
        qk = soft_cap * (2.0 * tl.sigmoid(2.0 * qk / soft_cap) - 1.0) * 1.4426950408889634
    if MASKED:
        qk = tl.where(k_pos[None, :] <= q_pos[:, None], qk, float("-inf"))
    if USE_WINDOW:
        qk = tl.where(k_pos[None, :] > q_pos[:, None] - window, qk, float("-inf"))
    # A window can hide a whole tile from a row: keep its state at m = -inf without exp(-inf - -inf) = NaN.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv(v_cache_ptr, off, kv_mask, v_new_ptr, stride_v_t, k_pos, ctx_len, offs_d, v_inv, SRC).to(q.dtype)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _write_block_kv(k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, k_cache_ptr, v_cache_ptr, bt_row_ptr, kv_off,
                    stride_c_b, stride_c_s, t0, q_len, ctx_len, offs_d, d_mask, k_inv, v_inv,
                    BLOCK_Q: tl.constexpr, PAGE: tl.constexpr):
    """This program's tokens ``t0..t0 + BLOCK_Q - 1`` (those ``< q_len``), its KV head only, from the input rows
    to their slots (``block_table[s, pos // PAGE] * PAGE + pos % PAGE``, at ``pos = ctx_len + t``) in the cache's
    dtype: each (token, KV head) is one program's, so written once; no program reads a position >= ctx_len
    from the cache, so the order of the writes and the reads does not matter."""
    t = t0 + tl.arange(0, BLOCK_Q)
    t_mask = t < q_len
    mask = t_mask[:, None] & d_mask[None, :]
    pos = ctx_len + t
    block = tl.load(bt_row_ptr + pos // PAGE, mask=t_mask, other=0).to(tl.int64)
    dst = block[:, None] * stride_c_b + (pos % PAGE)[:, None] * stride_c_s + kv_off + offs_d[None, :]
    rows = t.to(tl.int64)
    k = tl.load(k_new_ptr + rows[:, None] * stride_k_t + offs_d[None, :], mask=mask, other=0.0)
    tl.store(k_cache_ptr + dst, to_cache(k, k_inv, k_cache_ptr), mask=mask)
    v = tl.load(v_new_ptr + rows[:, None] * stride_v_t + offs_d[None, :], mask=mask, other=0.0)
    tl.store(v_cache_ptr + dst, to_cache(v, v_inv, v_cache_ptr), mask=mask)


@triton.jit
def _attend_block(q, q_pos, q_lo, seq_len, ctx_len, k_cache_ptr, v_cache_ptr, bt_row, kv_off,
                  k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, stride_c_b, stride_c_s,
                  qk_scale, soft_cap, window, k_inv, v_inv, v_scale, offs_n, offs_d, d_mask, BLOCK_M: tl.constexpr,
                  BLOCK_D: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                  USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, NEW_KV: tl.constexpr):
    """The block's attention output (fp32, normalized): the keys' tiles from the first one a row may see, first
    those every row sees whole (no mask), then the diagonal ones (masked). NEW_KV: the unmasked tiles read the
    cache below ctx_len (the context), k and v from it on (this step's tokens; a whole prompt's are all there),
    each position from its source in the one tile across it and in the masked ones (_load_kv's SRC 0, 1, 2); the
    tiles, and so the order of the sums, are the same as the plain form's."""
    kv_end = tl.minimum(seq_len, q_lo + BLOCK_Q)  # keys past the block's last token are no row's
    k_lo = 0
    if USE_WINDOW:
        k_lo = tl.maximum(q_lo - window + 1, 0)
    full_end = k_lo + (q_lo + 1 - k_lo) // BLOCK_N * BLOCK_N  # keys <= q_lo: every row sees them
    cache_end = full_end
    new_start = full_end
    if NEW_KV:  # the unmasked tiles wholly before ctx_len, and from the first wholly at or after it
        ctx_tiles = tl.maximum(ctx_len - k_lo, 0)
        cache_end = tl.minimum(full_end, k_lo + ctx_tiles // BLOCK_N * BLOCK_N)
        new_start = tl.minimum(full_end, k_lo + (ctx_tiles + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(k_lo, cache_end, BLOCK_N):
        acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, start_n, kv_end, q_pos,
                                      kv_off, stride_c_b, stride_c_s, qk_scale, soft_cap, window, offs_n, offs_d,
                                      d_mask, k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, ctx_len, k_inv, v_inv,
                                      PAGE, False, USE_SOFTCAP, USE_WINDOW, IEEE, 0)
    if NEW_KV:
        for start_n in range(cache_end, new_start, BLOCK_N):  # at most one tile
            acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, start_n, kv_end,
                                          q_pos, kv_off, stride_c_b, stride_c_s, qk_scale, soft_cap, window, offs_n,
                                          offs_d, d_mask, k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, ctx_len,
                                          k_inv, v_inv, PAGE, False, USE_SOFTCAP, USE_WINDOW, IEEE, 2)
        for start_n in range(new_start, full_end, BLOCK_N):
            acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, start_n, kv_end,
                                          q_pos, kv_off, stride_c_b, stride_c_s, qk_scale, soft_cap, window, offs_n,
                                          offs_d, d_mask, k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, ctx_len,
                                          k_inv, v_inv, PAGE, False, USE_SOFTCAP, USE_WINDOW, IEEE, 1)
    for start_n in range(full_end, kv_end, BLOCK_N):
        acc, l_i, m_i = _prefill_tile(acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, bt_row, start_n, kv_end, q_pos,
                                      kv_off, stride_c_b, stride_c_s, qk_scale, soft_cap, window, offs_n, offs_d,
                                      d_mask, k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, ctx_len, k_inv, v_inv,
                                      PAGE, True, USE_SOFTCAP, USE_WINDOW, IEEE, 2 if NEW_KV else 0)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l > 0 on every real row: it sees its own key
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:  # the values' scale (the keys' is in qk_scale)
        out = out * v_scale
    return out


@triton.jit
def _decode_row(q_ptr, out_ptr, stride_q_t, stride_o_t, q_start, seq_len, ctx_len, kvh, k_cache_ptr, v_cache_ptr,
                bt_row, kv_off, k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, stride_c_b, stride_c_s, qk_scale,
                soft_cap, window, k_inv, v_inv, v_scale, offs_d, d_mask, GROUP: tl.constexpr, ROWS: tl.constexpr,
                HEAD_D: tl.constexpr,
                BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, NEW_KV: tl.constexpr):
    """A sequence with one new token (a decode): its GROUP query heads as the first rows of a ROWS-row tile (tl.dot's
    smallest M, not the prompts' BLOCK_Q x GROUP rows), the same key tiles and order of the sums as a block of one
    token; NEW_KV: its key and value written first (_write_block_kv), read from k and v."""
    offs_m = tl.arange(0, ROWS)
    head = kvh * GROUP + offs_m
    io_mask = (offs_m < GROUP)[:, None] & d_mask[None, :]
    row = q_start.to(tl.int64)
    q = dot_operand(tl.load(q_ptr + row * stride_q_t + head[:, None] * HEAD_D + offs_d[None, :], mask=io_mask,
                            other=0.0), k_cache_ptr)
    if NEW_KV:
        _write_block_kv(k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, k_cache_ptr, v_cache_ptr, bt_row, kv_off,
                        stride_c_b, stride_c_s, 0, 1, ctx_len, offs_d, d_mask, k_inv, v_inv, 2, PAGE)
    q_pos = ctx_len + offs_m * 0  # every row at the token's position
    out = _attend_block(q, q_pos, ctx_len, seq_len, ctx_len, k_cache_ptr, v_cache_ptr, bt_row, kv_off,
                        k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, stride_c_b, stride_c_s,
                        qk_scale, soft_cap, window, k_inv, v_inv, v_scale, tl.arange(0, BLOCK_N), offs_d, d_mask,
                        ROWS, BLOCK_D, PAGE,
                        1, BLOCK_N, USE_SOFTCAP, USE_WINDOW, IEEE, NEW_KV)
    tl.store(out_ptr + row * stride_o_t + head[:, None] * HEAD_D + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=io_mask)


# The metadata pointers not specialized on 16-byte alignment: a mixed step binds them from its first prompt's row
# (block_table[nd:], ...), aligned or not with the decode count; each of the 8 combinations would compile a kernel
# of its own at serving time (~1 s each on a fresh machine), for loads of one int a program.
@triton.jit(do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "qsl_ptr"])
def _prefill_kernel(
    q_ptr, kv_cache_ptr, block_table_ptr, seq_lens_ptr, qsl_ptr, out_ptr, k_ptr, v_ptr,
    stride_q_t, stride_o_t, stride_k_t, stride_v_t, stride_c_kv, stride_c_b, stride_c_s, stride_c_h, stride_bt,
    qk_scale, soft_cap, window, k_inv, v_inv, v_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, NEW_KV: tl.constexpr,
    DECODE_ROWS: tl.constexpr,
):
    # One program: query block mb of sequence s, KV head kvh with its GROUP query heads.
    # NEW_KV: the sequences' new keys and values are k / v's rows (as q's), not yet in the cache: the program writes
    # its own tokens' (_write_block_kv) and reads positions >= ctx_len from k / v, the cache below (written by
    # earlier steps): no program reads a slot of this launch's. Off: k_ptr, v_ptr and their strides are unused.
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # the last blocks (most keys) first
    s = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if mb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx_len = seq_len - q_len  # positions before this step's tokens
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_D
    bt_row = block_table_ptr + s.to(tl.int64) * stride_bt
    kv_off = kvh * stride_c_h
    k_cache_ptr = kv_cache_ptr
    v_cache_ptr = kv_cache_ptr + stride_c_kv  # the values' half (an int64 argument past 2**31 elements)
    # The sequence's first new row, head kvh, of k and v (used under NEW_KV only)
    k_new_ptr = k_ptr + q_start.to(tl.int64) * stride_k_t + kvh * HEAD_D
    v_new_ptr = v_ptr + q_start.to(tl.int64) * stride_v_t + kvh * HEAD_D
    if DECODE_ROWS > 0 and q_len == 1:  # the unified launch's decodes: a tile of their own
        _decode_row(q_ptr, out_ptr, stride_q_t, stride_o_t, q_start, seq_len, ctx_len, kvh, k_cache_ptr, v_cache_ptr,
                    bt_row, kv_off, k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, stride_c_b, stride_c_s, qk_scale,
                    soft_cap, window, k_inv, v_inv, v_scale, offs_d, d_mask, GROUP, DECODE_ROWS, HEAD_D, BLOCK_D,
                    PAGE, BLOCK_N,
                    USE_SOFTCAP, USE_WINDOW, IEEE, NEW_KV)
    else:
        q_lo = ctx_len + mb * BLOCK_Q  # position of the block's first token
        offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)
        t = mb * BLOCK_Q + offs_m // GROUP_PAD  # token within the sequence's new ones
        head = kvh * GROUP + offs_m % GROUP_PAD
        row_mask = (t < q_len) & (offs_m % GROUP_PAD < GROUP)
        q_pos = q_lo + offs_m // GROUP_PAD
        io_mask = row_mask[:, None] & d_mask[None, :]
        rows = (q_start + t).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_q_t + head[:, None] * HEAD_D + offs_d[None, :], mask=io_mask,
                    other=0.0)  # [BLOCK_M, BLOCK_D]
        q = dot_operand(q, k_cache_ptr)
        if NEW_KV:
            _write_block_kv(k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, k_cache_ptr, v_cache_ptr, bt_row, kv_off,
                            stride_c_b, stride_c_s, mb * BLOCK_Q, q_len, ctx_len, offs_d, d_mask, k_inv, v_inv,
                            BLOCK_Q, PAGE)
        out = _attend_block(q, q_pos, q_lo, seq_len, ctx_len, k_cache_ptr, v_cache_ptr, bt_row, kv_off,
                            k_new_ptr, v_new_ptr, stride_k_t, stride_v_t, stride_c_b, stride_c_s,
                            qk_scale, soft_cap, window, k_inv, v_inv, v_scale, tl.arange(0, BLOCK_N), offs_d, d_mask,
                            BLOCK_Q * GROUP_PAD,
                            BLOCK_D, PAGE, BLOCK_Q, BLOCK_N, USE_SOFTCAP, USE_WINDOW, IEEE, NEW_KV)
        tl.store(out_ptr + rows[:, None] * stride_o_t + head[:, None] * HEAD_D + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


# Launched through FastLaunch, as the decode kernels: the attention op calls it eagerly once per layer and step.
_prefill_launch = FastLaunch(_prefill_kernel)


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tile sizes of the prefill kernel.

    Args:
        BLOCK_M: query rows per program, ``BLOCK_Q`` tokens x the group's heads (group padded to a power of
            two); at least 16 (``tl.dot``'s smallest M).
        BLOCK_N: keys per tile, a multiple of the cache's block size (raised to it if smaller).
    """

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int


# By head size, for long bf16/fp16 prompts: the flash-attention forward configs of Triton's tutorial on Hopper
# (128 x 64, 8 warps, 3 stages at D = 128). Compiled ahead for sm_90 here (Triton 3.6, 16-divisible strides as at
# run time: K and V tiles by cp.async in 3 stages, QK and PV on wgmma), none spills: D = 128 174 registers a
# thread and 96 KiB of shared memory (one program an SM); D = 64 122 registers at 8 warps (248 at 4) and 48 KiB;
# D = 256 (Gemma 2) a 64-row tile, 185 registers, 96 KiB. fp32 (tests, references): small tiles, its exact (IEEE)
# dot runs on the FMA units; at 4 warps D = 256 spilled 1 KiB a thread (at 8: 118 registers, none). Not yet timed
# on the H200 (benchmarks): every choice is here.
_CONFIGS = {
    64: PrefillConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    128: PrefillConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    256: PrefillConfig(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2),
}
_FP32_CONFIG = PrefillConfig(BLOCK_M=32, BLOCK_N=16, num_warps=8, num_stages=2)


@functools.cache
def prefill_config(head_size: int, group: int, max_query_len: int,
                   dtype: torch.dtype = torch.bfloat16) -> PrefillConfig:
    """The config for a head size (rounded up to a power of two, 64..256), query heads per KV head, the
    longest query and q's dtype: a batch of short queries (``max_query_len`` < the tile's tokens) gets a shorter
    tile, down to 16 rows, instead of programs mostly masked."""
    cfg = _FP32_CONFIG if dtype == torch.float32 else _CONFIGS[min(max(next_power_of_2(head_size), 64), 256)]
    group_pad = next_power_of_2(group)
    rows = min(cfg.BLOCK_M, max(16, group_pad * next_power_of_2(max(max_query_len, 1))))
    rows = max(rows, group_pad)
    if rows == cfg.BLOCK_M:
        return cfg
    return PrefillConfig(BLOCK_M=rows, BLOCK_N=cfg.BLOCK_N, num_warps=4, num_stages=cfg.num_stages)


def _check_args(q: torch.Tensor, kv_cache: torch.Tensor, num_heads: int, head_size: int,
                out: torch.Tensor | None) -> None:
    num_kv_heads = kv_cache.shape[-2]
    if num_heads % num_kv_heads or kv_cache.shape[-1] != head_size or q.shape[-1] != num_heads * head_size:
        raise ValueError(f"paged_prefill: q {tuple(q.shape)} with {num_heads} heads of {head_size} does not fit "
                         f"kv_cache {tuple(kv_cache.shape)} ([2, num_blocks, block_size, Hkv, D], Hq % Hkv == 0)")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"paged_prefill: out must be like q ({tuple(q.shape)}, {q.dtype}, unit stride last), "
                         f"got {tuple(out.shape)}, {out.dtype}, strides {out.stride()}")


def paged_prefill_triton(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         query_start_loc: torch.Tensor, max_query_len: int, num_heads: int, head_size: int,
                         scale: float, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                         out: torch.Tensor | None = None, config: PrefillConfig | None = None,
                         new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                         decode_rows: bool = False, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """:func:`paged_prefill` in one Triton launch; writes ``out`` (rows of the sequences only) when given.

    ``max_query_len`` bounds every sequence's query length (a larger bound only adds programs that return at
    once); ``config`` overrides :func:`prefill_config`. The cache must have unit stride in its last dimension.
    ``new_kv``: ``(k, v)``, ``[T, Hkv * D]`` rows as q's, the sequences' new keys and values, NOT yet in the cache:
    the launch writes them to their slots (from the block table, as ``write_kv_cache`` would) and attends to them
    from k and v, so that no separate cache-write launch is needed (the module's ``PREFILL_WRITES_KV``).
    ``decode_rows``: sequences with one new token take a tile of their own (see :func:`bind_prefill`).
    ``k_scale``, ``v_scale``: an fp8 cache's scales (``ops.kv_quant``); other caches ignore them.
    """
    _check_args(q, kv_cache, num_heads, head_size, out)
    if kv_cache.stride(-1) != 1:
        raise ValueError(f"paged_prefill_triton: the cache needs unit stride in D, got strides {kv_cache.stride()}")
    if new_kv is not None:
        _check_new_kv(q, kv_cache, new_kv)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0:
        return out
    _, _, page, num_kv_heads, _ = kv_cache.shape
    launch = bind_prefill(block_table, seq_lens, query_start_loc, max_query_len, num_heads, num_kv_heads, head_size,
                          page, q.dtype, logits_soft_cap is not None, sliding_window is not None, config,
                          new_kv=new_kv is not None, decode_rows=decode_rows)
    if launch is not None:
        prefill_launch(launch, q, kv_cache, out, scale, sliding_window, logits_soft_cap, new_kv=new_kv,
                       kv_scales=KVScales.of(k_scale, v_scale))
    return out


def _check_new_kv(q: torch.Tensor, kv_cache: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    """k and v must be rows of ``Hkv * D`` as the cache's, at least as many as q's (the kernel indexes them as q)."""
    row = kv_cache.shape[-2] * kv_cache.shape[-1]
    for name, x in zip("kv", new_kv):
        if x.dim() != 2 or x.shape[1] != row or x.shape[0] < q.shape[0]:
            raise ValueError(f"paged_prefill_triton: new_kv's {name} must be [>= {q.shape[0]}, {row}] (q's rows, "
                             f"Hkv * D), got {tuple(x.shape)}")


def bind_prefill(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
                 num_heads: int, num_kv_heads: int, head_size: int, page: int, dtype: torch.dtype, use_softcap: bool,
                 use_window: bool, config: PrefillConfig | None = None, new_kv: bool = False,
                 decode_rows: bool = False) -> BoundLaunch | None:
    """The prefill kernel bound to a batch's sequences and a layer shape (None: nothing to launch): what
    :func:`paged_prefill_triton` launches, less what may differ between layers (see :func:`prefill_launch`).
    The attention op binds it once a step (``models.AttentionMetadata.prefill_launch``). ``new_kv``: the form that
    writes the new keys and values itself (``NEW_KV``); its launches take k and v (:func:`prefill_launch`).
    ``decode_rows``: a sequence with one new token (a decode, in the attention op's unified launch) takes a tile of
    its own, its query heads on ``max(16, group)`` rows, instead of the prompts' ``BLOCK_M`` (``DECODE_ROWS``)."""
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len <= 0:
        return None
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    cfg = config or prefill_config(head_size, group, max_query_len, dtype)
    block_q = max(cfg.BLOCK_M // group_pad, 1)
    block_n = max(cfg.BLOCK_N, page)
    t, s = Slot.tensor, Slot.scalar
    # Off, k and v are unused by the kernel: q stands for them, with zero strides (one specialization).
    k, v, kv_strides = (t(3), t(4), (s(12), s(13))) if new_kv else (t(0), t(0), (0, 0))
    args = (t(0), t(1), block_table, seq_lens, query_start_loc, t(2), k, v, s(0), s(1), *kv_strides,
            s(2), s(3), s(4), s(5), block_table.stride(0), s(6), s(7), s(8), s(9), s(10), s(11))
    return _prefill_launch.bind(
        (cdiv(max_query_len, block_q), num_seqs, num_kv_heads), args,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, HEAD_D=head_size,
        BLOCK_D=max(16, next_power_of_2(head_size)), PAGE=page, BLOCK_N=block_n,
        USE_SOFTCAP=use_softcap, USE_WINDOW=use_window,
        IEEE=dtype == torch.float32, NEW_KV=new_kv, DECODE_ROWS=max(16, group_pad) if decode_rows else 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def prefill_launch(launch: BoundLaunch, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float,
                   sliding_window: int | None, logits_soft_cap: float | None,
                   new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                   target: tuple[int, int] | None = None, strides: tuple[int, ...] | None = None,
                   kv_scales: KVScales = UNIT_KV_SCALES) -> None:
    """One launch of a :func:`bind_prefill` (bound for q's dtype and this soft cap's and window's presence): q's
    and out's rows ``query_start_loc[0]..`` (unit stride last, out like q), the cache's four leading strides, the
    scale and the options are per call. ``new_kv`` ``(k, v)`` (rows as q's, any row stride) exactly when the launch
    was bound with ``new_kv=True``. ``target``: see :class:`~ops.triton_utils.BoundLaunch`; ``strides``: see
    ``ops.paged_attention.LAYER_STRIDES``; ``kv_scales``: an fp8 cache's (``ops.kv_quant``; others ignore them)."""
    if kv_scales.k_scale != 1.0:
        scale = scale * kv_scales.k_scale
    # Scale in log2 units for exp2, unless the soft cap (tanh of natural logits) comes first.
    qk_scale = scale if logits_soft_cap is not None else scale * LOG2E
    quant = (kv_scales.k_inv, kv_scales.v_inv, kv_scales.v_scale)
    if strides is not None:
        q_rows, k_rows, v_rows, out_rows, c0, c1, c2, c3 = strides
        scalars = (q_rows, out_rows, c0, c1, c2, c3, qk_scale, logits_soft_cap or 1.0, sliding_window or 0, *quant)
        if new_kv is None:
            launch((q, kv_cache, out), scalars, target)
        else:
            launch((q, kv_cache, out, *new_kv), scalars + (k_rows, v_rows), target)
        return
    qs = q.stride()
    if qs[-1] != 1:
        q = q.contiguous()
        qs = q.stride()
    sc = kv_cache.stride()
    scalars = (qs[0], out.stride(0), sc[0], sc[1], sc[2], sc[3], qk_scale, logits_soft_cap or 1.0,
               sliding_window or 0, *quant)
    if new_kv is None:
        launch((q, kv_cache, out), scalars, target)
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in new_kv)
    launch((q, kv_cache, out, k, v), scalars + (k.stride(0), v.stride(0)), target)


# An opaque custom op, as paged_decode (ops/paged_attention.py says why not triton_op): Triton on CUDA, the
# reference elsewhere. No ``out`` argument: an op may not return an alias of its input.
@torch.library.custom_op("dynamo_once::paged_prefill", mutates_args=())
def _paged_prefill_op(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, max_query_len: int, num_heads: int, head_size: int,
                      scale: float, sliding_window: int | None = None,
                      logits_soft_cap: float | None = None, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    impl = paged_prefill_triton if use_triton(q) else paged_prefill_ref
    return impl(q, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, num_heads, head_size, scale,
                sliding_window, logits_soft_cap, k_scale=k_scale, v_scale=v_scale)


@_paged_prefill_op.register_fake
def _paged_prefill_fake(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, max_query_len: int, num_heads: int, head_size: int,
                        scale: float, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)  # [T, Hq * D], as both implementations


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                  query_start_loc: torch.Tensor, max_query_len: int, num_heads: int, head_size: int, scale: float,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its tokens in the paged cache.

    Args:
        q: ``[T, Hq * D]``, exactly the sequences' new tokens (``query_start_loc`` covers every row).
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]``, already holding the new tokens' keys and values.
        block_table: ``[S, max_blocks]`` int32; seq_lens: ``[S]`` int32, tokens including the new ones.
        query_start_loc: ``[S + 1]`` int32, sequence ``s``'s rows of q are ``[s]:[s + 1]``.
        max_query_len: a host int >= every sequence's query length (sets the CUDA grid; no device sync).
        num_heads, head_size, scale: Hq, D and the softmax scale.
        sliding_window, logits_soft_cap: see the module docstring (None: off).
        k_scale, v_scale: an fp8 cache's scales (its keys and values times them, ``ops.kv_quant``); other
            caches ignore them.
    Returns:
        ``[T, Hq * D]`` in q's dtype.
    """
    return torch.ops.dynamo_once.paged_prefill(q, kv_cache, block_table, seq_lens, query_start_loc, max_query_len,
                                               num_heads, head_size, scale, sliding_window, logits_soft_cap,
                                               k_scale, v_scale)


def _attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None,
                logits_soft_cap: float | None) -> torch.Tensor:
    """One sequence in fp32: q ``[Lq, Hkv, group, D]`` (its last Lq positions), k, v ``[L, Hkv, D]``."""
    lq, seq_len = q.shape[0], k.shape[0]
    logits = torch.einsum("qhgd,lhd->hgql", q, k) * scale
    if logits_soft_cap is not None:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    q_pos = torch.arange(seq_len - lq, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    allowed = k_pos <= q_pos  # [Lq, L]
    if sliding_window is not None:
        allowed = allowed & (k_pos > q_pos - sliding_window)
    probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hgql,lhd->qhgd", probs, v)


def paged_prefill_ref(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, max_query_len: int, num_heads: int, head_size: int,
                      scale: float, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                      out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The fp32 reference of :func:`paged_prefill` (conventions: the module docstring), sequence by sequence.

    Reads ``query_start_loc`` and ``seq_lens`` on the host (a sync on CUDA: a reference, not a kernel path);
    ``max_query_len`` is unused. Gathers each sequence's pages, attends in fp32, casts back to q's dtype once.
    """
    _check_args(q, kv_cache, num_heads, head_size, out)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    page, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[s], starts[s + 1]
        if end == start:
            continue
        blocks = block_table[s, : cdiv(seq_len, page)].long()
        k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len].float()  # [L, Hkv, D]
        v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len].float()
        if kv_cache.dtype == FP8_KV_DTYPE:  # the values an fp8 cache stands for
            k, v = k * k_scale, v * v_scale
        qs = q[start:end].float().reshape(end - start, num_kv_heads, num_heads // num_kv_heads, head_size)
        o = _attend_ref(qs, k, v, scale, sliding_window, logits_soft_cap)
        out[start:end] = o.reshape(end - start, num_heads * head_size).to(q.dtype)
    return out
