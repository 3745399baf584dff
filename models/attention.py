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
  Triton kernel, all the others (prompts, chunks after cached context) through
  one launch of a varlen flash-attention kernel over the paged cache
  (:mod:`ops.paged_prefill`). The kernels are called through their launchers
  (``write_kv_cache_triton``, ``paged_decode_launch``,
  ``paged_prefill_triton``): this op already runs
  eagerly, and another op dispatch per layer would cost host time every step.
  The decode path reads only device tensors (``block_table``, ``seq_lens``,
  ``slot_mapping``): no host sync, safe to capture in a CUDA graph.

Host time matters here: on the piecewise path (a step that mixes prefill and
decode) the op runs eagerly between CUDA-graph replays, once per layer, and a
slow op leaves the GPU idle. So the CUDA path computes nothing per layer that
is the same for every layer of a step (the metadata's decode plan: slices,
split count, grids, persistent split-KV scratch, and each kernel's
``ops.triton_utils.BoundLaunch``: the metadata's ``write_launch`` and
``prefill_launch``, the plan's ``launches``; gathered per layer configuration
for one lookup a layer), launches through ``FastLaunch`` (the compiled kernels'
launchers, not ``kernel[grid](...)``) passing only what may differ between
layers, reads the current device, stream and launch hooks once a call (not
once a launch) and each tensor's strides once, and allocates only its output.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from ops import HAS_TRITON, write_kv_cache_triton
from ops import write_kv_cache_ref as write_kv_cache  # the native write; public here as models.write_kv_cache
from dispatcher import envs, plugins
from dispatcher.cuda_graph import thread_state as graph_state
from ops.kv_quant import FP8_KV_DTYPE, UNIT_KV_SCALES, KVScales
from ops.launch_program import LaunchProgram, recording
from ops.paged_attention import DecodePlan, paged_decode_launch, write_kv_cache_launch
from ops.paged_prefill import prefill_launch
from ops.triton_utils import BoundLaunch, FastLaunch, cdiv

from .forward_context import AttentionMetadata, get_forward_context

logger = logging.getLogger(__name__)

__all__ = ["Attention", "attention", "attention_native", "eager_layouts", "write_kv_cache", "write_kv_cache_triton"]


# ----------------------------------------------------------------- native
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
                  num_heads: int, head_size: int, scale: float,
                  sliding_window: int | None, logits_soft_cap: float | None,
                  kv_scales: KVScales = UNIT_KV_SCALES) -> None:
    """Every sequence, one by one, from the cache (host metadata: no sync). An fp8 cache is read as the kernels read
    it: its keys and values in q's dtype, ``k_scale`` in the softmax scale, the output times ``v_scale``."""
    fp8 = kv_cache.dtype == FP8_KV_DTYPE
    if fp8:
        scale = scale * kv_scales.k_scale
    for i, (start, end, seq_len) in enumerate(md.seq_spans):
        k = _gather_seq(kv_cache[0], md.block_table[i], seq_len)
        v = _gather_seq(kv_cache[1], md.block_table[i], seq_len)
        if fp8:
            k, v = k.to(q.dtype), v.to(q.dtype)
        qi = q[start:end].view(end - start, num_heads, head_size)
        o = _attend_one(qi, k, v, scale, sliding_window, logits_soft_cap).reshape(end - start, -1)
        out[start:end] = o * kv_scales.v_scale if fp8 and kv_scales.v_scale != 1.0 else o


def attention_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     md: AttentionMetadata, num_heads: int, head_size: int, scale: float,
                     sliding_window: int | None = None, logits_soft_cap: float | None = None,
                     out: torch.Tensor | None = None, kv_scales: KVScales = UNIT_KV_SCALES) -> torch.Tensor:
    """The reference: write the cache, then attend sequence by sequence. Returns ``[T, Hq * D]`` (``out``,
    when given). ``kv_scales``: an fp8 cache's (``ops.kv_quant``); other caches ignore them."""
    write_kv_cache(kv_cache, k, v, md.slot_mapping, kv_scales.k_scale, kv_scales.v_scale)
    if out is None:
        out = torch.empty_like(q)
    _prefill_loop(out, q, kv_cache, md, num_heads, head_size, scale, sliding_window, logits_soft_cap, kv_scales)
    return out


# ------------------------------------------------------------------ CUDA
#: On by default: in the split form of a step with a prompt (see :func:`attention_cuda`), the prefill kernel writes the
#: prompts' new keys and values into the cache itself (``ops.paged_prefill_triton``'s ``new_kv``) instead of the
#: cache-write launch, which then takes the decodes' rows only (none where the decode kernel writes them,
#: ``fused_write``: two launches a layer then, not three). Measured on the H200 (llama-3-8b / 3.2-1b,
#: ``benchmarks.attention_host``, on and off alternately, two rounds): the GPU time a call of a 2048-token prompt
#: 125 µs against 145 alone, 155 / 207 against 182 / 230 beside 32 / 128 decodes (8B); the 1B's within 3%; a launch
#: less of host time where the host sets the pace. Read at every call; its default comes from
#: ``DYNAMO_ONCE_PREFILL_WRITES_KV`` (1/0) at import.
PREFILL_WRITES_KV = envs.prefill_writes_kv()


#: On the CUDA path, a step with a prompt attends in ONE launch a layer: the prefill kernel over every sequence of the
#: step, the decodes included (a decode is a sequence with one new token), writing every new key and value itself
#: (``ops.paged_prefill_triton``'s ``new_kv``), instead of up to three (cache write, split-KV decode, prefill). Taken
#: by a step with at most :data:`UNIFIED_MAX_DECODES` decodes, none longer than :data:`UNIFIED_DECODE_TOKENS` or its
#: longest prompt (``AttentionMetadata.decodes_fit_unified``); other steps take the split form. Read at every call;
#: its default comes from ``DYNAMO_ONCE_UNIFIED_ATTENTION`` (1/0) at import.
UNIFIED_ATTENTION = envs.unified_attention()
#: The most decodes a step takes the unified launch with. It reads each decode with one program a KV head, no split
#: (the split-KV decode kernel: several programs a sequence, several a streaming multiprocessor), ~1.4-3 µs a 64-key
#: tile on the H200: measured (results/attention_host_ab_cap32.md, attention_host_unified_past_cap.md;
#: llama-3-8b, 512-token prompt, decodes of 512
#: tokens) the unified launch's GPU time is below the split form's host time at 1 and 8 decodes, above its GPU time
#: at 32.
UNIFIED_MAX_DECODES = 8
#: Decodes up to this long always fit the unified launch; a longer one only up to the step's longest prompt (a
#: program reading the prompt's last query block then takes as long: the decode is not the launch's tail). Measured
#: as above: at decodes of 2000 tokens the unified launch's GPU time exceeds the split form's host time at 1 and 8
#: decodes (results/attention_host_ctx2000.md); at 512 it is below.
UNIFIED_DECODE_TOKENS = 1024


def eager_layouts(max_seqs: int, max_tokens: int, max_len: int) -> list[tuple[int, int, int]]:
    """Step layouts ``(decodes, decode length, prompt tokens)`` (one new prompt; 0 tokens: a decode-only step)
    that between them give :func:`attention_cuda` every launch specialization a step of at most ``max_seqs``
    sequences and ``max_tokens`` tokens, no sequence over ``max_len`` tokens, can take: what the engine launches at
    start-up so that no Triton kernel compiles in the middle of serving.

    What decides a specialization, and the layouts that cover it: the decode plan (split count, config row, fused
    forms) by the decode count, with or without a prompt beside (every count from 0 beside a 16-token prompt, and
    alone); the unified launch or the split form by the decode count and whether a decode outlasts the prompt and
    :data:`UNIFIED_DECODE_TOKENS` (decodes of one token, and past both where ``max_len`` allows); the prefill
    kernel's tile by the longest query's power of two (every power of two to ``max_tokens``, with no decode, one,
    and one past :data:`UNIFIED_MAX_DECODES`)."""
    def decode_lens(prompt: int) -> list[int]:
        longer = max(UNIFIED_DECODE_TOKENS, prompt) + 1
        return [1, longer] if longer <= max_len else [1]

    layouts = {(d, 1, 0) for d in range(1, max_seqs + 1) if d <= max_tokens}
    for d in range(min(max_seqs, max_tokens - 15)):
        layouts.update((d, n, 16) for n in (decode_lens(16) if d else [1]))
    prompt = 1
    while prompt <= max_tokens:
        for d in {0, 1, UNIFIED_MAX_DECODES + 1}:
            if d < max_seqs and d + prompt <= max_tokens:
                layouts.update((d, n, prompt) for n in (decode_lens(prompt) if d else [1]))
        prompt *= 2
    return sorted(layouts)


def attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   md: AttentionMetadata, num_heads: int, head_size: int, scale: float,
                   sliding_window: int | None = None, logits_soft_cap: float | None = None,
                   out: torch.Tensor | None = None, kv_scales: KVScales = UNIT_KV_SCALES) -> torch.Tensor:
    """Triton split-KV decode (:mod:`ops.paged_attention`) for the decode sequences, and one launch of
    :func:`ops.paged_prefill_triton` for every other sequence (prompts and chunks, from the paged cache).

    The step's decode plan (:meth:`AttentionMetadata.decode_plan`) is built by the first layer and reused by
    the others; the decode kernels write rows ``0..num_decodes-1`` of the output in place (no slices of q,
    no copy), and every launch goes through ``ops.triton_utils.FastLaunch``. Under the plan's ``fused_write`` the
    decodes' new keys and values go to the decode launch, which writes them itself (a decode-only step is then one
    launch a layer with ``fused_merge``), and the cache-write launch takes the other tokens only; else it takes
    them all, as one launch.

    Launches a layer with a prompt in the step (host time on the piecewise path is mostly these): the decode kernel,
    which in such a step always writes the decodes' new keys and values and merges its splits itself
    (``AttentionMetadata.decode_plan``: the step runs eagerly, where a launch costs host time, whatever the config's
    ``fused_write`` and ``fused_merge``, which decide for decode-only steps), and the prefill kernel, which with
    :data:`PREFILL_WRITES_KV` (on by default) writes the prompts' itself (reading its own chunk's from k and v, so no
    program reads a slot the launch writes): 2 (1 with no decode). With it off, a cache-write launch takes the
    prompts' rows before them: 3.
    Under :data:`UNIFIED_ATTENTION` a step with a prompt that fits it (see there) is one launch a layer: the prefill
    kernel, bound to every sequence of the step, writes every new key and value and attends for the decodes too.
    Padding tokens of no sequence (after the last one's rows) are then not written: their slots are the pad
    block's, which no sequence reads. ``kv_scales``: an fp8 cache's (``ops.kv_quant``); other caches ignore them.
    """
    shape = kv_cache.shape
    contiguous = kv_cache.is_contiguous()
    # Every layer of a step calls with the same key (only the tensors' addresses differ): one lookup, not one per
    # plan and bound launch. A key is everything the step call is built from, so a miss builds anew, never a stale
    # one; under CUDA-graph capture a plan without the persistent workspace is the capture's own (decode_plan).
    key = (num_heads, head_size, shape, contiguous, q.device, q.dtype, kv_cache.dtype, k.shape[0],
           sliding_window is not None,
           logits_soft_cap is not None, PREFILL_WRITES_KV, UNIFIED_ATTENTION, UNIFIED_MAX_DECODES,
           UNIFIED_DECODE_TOKENS)
    if md.workspace is None and md.num_decodes and q.device.type == "cuda":
        key += (torch.cuda.is_current_stream_capturing(),)
    call = md.layer_calls.get(key)
    if call is None:
        call = md.layer_calls[key] = _step_call(md, key, num_heads, head_size, shape, contiguous, q.device, q.dtype,
                                                k.shape[0], logits_soft_cap is not None, sliding_window is not None,
                                                kv_cache.dtype == FP8_KV_DTYPE)
    # Read once a call, not per launch: the current device (a Python call into torch.cuda) and stream, and
    # whether launch hooks are set; the same for the two or three launches below, which switch no stream.
    target = call.fast.target() if call.fast is not None else None
    # The launches' strides, one stride() a tensor (ops.paged_attention.LAYER_STRIDES); a contiguous cache's from
    # its shape, in the key (size-1 dimensions aside, where any stride addresses the same elements).
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    if qs[-1] != 1:
        q = q.contiguous()
        qs = q.stride()
    if ks[-1] != 1 or vs[-1] != 1:
        k, v = k.contiguous(), v.contiguous()
        ks, vs = k.stride(), v.stride()
    if out is None:  # empty_like: ~1 µs less host time than torch.empty(q.shape, dtype=..., device=...)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    strides = (qs[0], ks[0], vs[0], out.stride(0), *(call.cache_strides or kv_cache.stride()[:4]))
    program = call.program
    if program is not None and target is not None:  # a later layer: the first's launches, this layer's tensors
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), kv_cache.data_ptr(), out.data_ptr())
        if call.spec == _replay_spec(target[0], strides, q, k, v, kv_cache, out, scale, sliding_window,
                                     logits_soft_cap, kv_scales, addresses):
            program(target[1], addresses)
            return out
    if call.spec is None and target is not None and contiguous:  # the step's first call: record its launches
        with recording() as calls:
            _launch(call, q, k, v, kv_cache, md, out, scale, sliding_window, logits_soft_cap, target, strides,
                    kv_scales)
        call.program = LaunchProgram.build(calls, (q, k, v, kv_cache, out), constants=(call.slots,))
        addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), kv_cache.data_ptr(), out.data_ptr())
        spec = _replay_spec(target[0], strides, q, k, v, kv_cache, out, scale, sliding_window, logits_soft_cap,
                            kv_scales, addresses)
        call.spec = spec if call.program is not None and not spec[-1] else False  # False: never again this step
        return out
    _launch(call, q, k, v, kv_cache, md, out, scale, sliding_window, logits_soft_cap, target, strides, kv_scales)
    return out


def _replay_spec(device: int, strides: tuple[int, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, out: torch.Tensor, scale: float, sliding_window: int | None,
                 logits_soft_cap: float | None, kv_scales: KVScales, addresses: tuple[int, ...]) -> tuple:
    """What a call's launches are specialized on besides :func:`attention_cuda`'s key: the device, the strides and
    scalars passed, the tensors' dtypes, and (last) the addresses' offsets from a 16-byte boundary, or-ed (0: every
    one aligned; a program is kept only then, so that equal specs mean equal alignment of each address)."""
    return (device, strides, q.dtype, k.dtype, v.dtype, kv_cache.dtype, out.dtype, scale, type(scale), sliding_window,
            logits_soft_cap, type(logits_soft_cap), kv_scales,
            (addresses[0] | addresses[1] | addresses[2] | addresses[3] | addresses[4]) & 15)


def _launch(call: _StepCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
            md: AttentionMetadata, out: torch.Tensor, scale: float, sliding_window: int | None,
            logits_soft_cap: float | None, target: tuple[int, int] | None, strides: tuple[int, ...],
            kv_scales: KVScales) -> None:
    """A call's launches through their bound launches: the cache write, the split-KV decode, the prefill."""
    if call.cache_strides is None:  # a non-contiguous cache: the native write
        write_kv_cache(kv_cache, k, v, md.slot_mapping, kv_scales.k_scale, kv_scales.v_scale)
    elif call.write is not None:  # the rows of k and v its slots are (bound: k and v are passed whole)
        write_kv_cache_launch(call.write, kv_cache, k, v, target=target, strides=strides,
                              kv_inv=(kv_scales.k_inv, kv_scales.v_inv))
    if call.plan is not None:
        new_kv = (k, v, call.slots) if call.fused_write else None
        paged_decode_launch(call.plan, q, kv_cache, out, scale, sliding_window, logits_soft_cap, new_kv=new_kv,
                            target=target, strides=strides, kv_scales=kv_scales)
    if call.prefill is not None:  # the sequences after the decodes, or all (unified; paged_prefill_triton's launch)
        prefill_launch(call.prefill, q, kv_cache, out, scale, sliding_window, logits_soft_cap,
                       new_kv=(k, v) if call.prefill_writes else None, target=target, strides=strides,
                       kv_scales=kv_scales)


class _StepCall:
    """What :func:`attention_cuda` needs for one step and layer configuration besides the layer's tensors
    (:func:`_step_call`): the decode plan (None: no decode, or the unified launch attends for them), whether the
    decode kernel writes the decodes' keys and values (``fused_write``) and the prefill kernel the others'
    (``prefill_writes``; every sequence's when unified), and the cache-write and prefill kernels' bound launches
    (None: nothing to launch), as the metadata's cached ones; then the launches the first call recorded."""

    __slots__ = ("plan", "fused_write", "prefill_writes", "write", "prefill", "fast", "cache_strides", "slots",
                 "program", "spec")

    def __init__(self, plan: DecodePlan | None, fused_write: bool, prefill_writes: bool, write: BoundLaunch | None,
                 prefill: BoundLaunch | None, fast: FastLaunch | None, cache_strides: tuple[int, ...] | None,
                 slots: torch.Tensor) -> None:
        self.plan, self.fused_write, self.prefill_writes = plan, fused_write, prefill_writes
        self.write, self.prefill, self.fast = write, prefill, fast
        self.cache_strides, self.slots = cache_strides, slots
        # The step's first call records its launches (ops.launch_program); a later layer with the same spec
        # (_replay_spec) replays them with its own tensors. spec None: not recorded yet; False: no program.
        self.program: LaunchProgram | None = None
        self.spec: tuple | bool | None = None


def _step_call(md: AttentionMetadata, key: tuple, num_heads: int, head_size: int, shape: torch.Size,
               contiguous: bool, device: torch.device, dtype: torch.dtype, num_tokens: int, use_softcap: bool,
               use_window: bool, kv_fp8: bool) -> _StepCall:
    """The step's :class:`_StepCall` for a layer configuration (``key``: :func:`attention_cuda`'s), from the
    metadata's plan and bound launches; a recent step's, recorded launches included, where it was built from the
    same pieces (``md.launch_cache()``: every piece is then that step's, and so are the slots' tensor)."""
    nd = md.num_decodes
    page, num_kv_heads = shape[2], shape[3]
    unified = (UNIFIED_ATTENTION and contiguous and nd <= UNIFIED_MAX_DECODES
               and md.decodes_fit_unified(UNIFIED_DECODE_TOKENS))
    plan = md.decode_plan(num_heads, num_kv_heads, head_size, page, device, kv_fp8) if nd and not unified else None
    fused_write = plan is not None and plan.fused_write and contiguous
    prefill_writes = unified or (PREFILL_WRITES_KV and contiguous and nd < md.num_seqs)
    # write_kv_cache_triton's launch: under fused_write the decodes' rows go with the decode kernel
    # (paged_decode_launch's new_kv), under prefill_writes the others with the prefill kernel (all, unified).
    first = nd if fused_write else 0
    end = (0 if unified else nd) if prefill_writes else num_tokens
    cache_strides = _contiguous_strides(shape)[:4] if contiguous else None
    slots = md.slot_mapping if md.slot_mapping.stride(-1) == 1 else md.slot_mapping.contiguous()
    write = md.write_launch(end - first, num_kv_heads * shape[4], first) if contiguous and end > first else None
    prefill = None
    if nd < md.num_seqs:
        prefill = md.prefill_launch(num_heads, num_kv_heads, head_size, page, dtype, use_softcap, use_window,
                                    new_kv=prefill_writes, all_seqs=unified)
    launches = [write, prefill, *(plan.launches(use_softcap, use_window, dtype == torch.float32, fused_write)
                                  if plan is not None else ())]
    # Where to read the launch target from (any of the kernels': they share the driver); on CUDA only.
    fast = next((launch.fast for launch in launches if launch is not None), None) if device.type == "cuda" else None

    def build() -> _StepCall:
        return _StepCall(plan, fused_write, prefill_writes, write, prefill, fast, cache_strides, slots)

    cache = md.launch_cache() if slots is md.slot_mapping else None
    if cache is None:
        return build()
    # The pieces by identity: the cache's entries, alive while an entry holding them is (no id is reused meanwhile).
    # Not the token count (key[7]) or the slots' length: the launches take them through the pieces (the cache write's
    # rows) or not at all (the kernels index the slots and q, k, v by the sequences' rows), so a step of another
    # length over the same pieces takes this state.
    return cache.get_or_build(("call", key[:7] + key[8:], id(plan), id(write), id(prefill), fused_write,
                               prefill_writes, slots.data_ptr(), slots.stride(), slots.dtype), build)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


# ---------------------------------------------------------------- the op
def _attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    ctx = get_forward_context()
    try:
        layer = ctx.layers[layer_name]
    except KeyError:
        raise KeyError(f"dynamo_once::attention: no layer {layer_name!r} in the forward context; "
                       f"it has {sorted(ctx.layers)[:8]}") from None
    md = ctx.attn_metadata
    # In a PIECEWISE step the next piece's CUDA graph reads this output: written into the layer's persistent
    # buffer (marked static by the engine), it is read in place, with neither an allocation here nor a copy
    # into the graph's input before each replay. Decided by facts that are the same at capture and replay.
    buf = layer.piecewise_out
    if buf is not None and graph_state.step is not None and q.shape[0] <= buf.shape[0] and buf.dtype == q.dtype:
        out = layer.piecewise_rows(q.shape[0])
        if md is None:  # profile / warm-up run (or the pieces' capture): no cache yet
            return out.zero_()
        return layer.forward_impl(q, k, v, md, out=out)
    if md is None:
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

# Between the compiled pieces (levels 3-4) the split graph calls _attention_impl itself, not the op through torch's
# dispatcher: ~2-3 µs less host time a layer a step on the piecewise path.
plugins.set_splitting_op_eager_impl("dynamo_once::attention", _attention_impl)

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
        # Set by the engine's CUDA graphs (models.engine.graphs): ``[max piecewise size, Hq * D]``, where the
        # op writes its output in a PIECEWISE step (see _attention_impl); None: a new tensor each call.
        self.piecewise_out: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor | None, dict[int, torch.Tensor]] = (None, {})  # piecewise_rows' views
        self._impl = attention_cuda if torch.cuda.is_available() and HAS_TRITON else attention_native
        self.kv_scales = UNIT_KV_SCALES  # set_kv_scales

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.dynamo_once.attention(q, k, v, self.layer_name)

    def piecewise_rows(self, n: int) -> torch.Tensor:
        """``piecewise_out[:n]``, one view a row count while the buffer stays the same (a slice costs ~1 µs of host
        time, once a layer a step on the piecewise path)."""
        buf, views = self._rows
        if buf is not self.piecewise_out:
            buf, views = self._rows = (self.piecewise_out, {})
        view = views.get(n)
        if view is None:
            view = views[n] = buf[:n]
        return view

    def forward_impl(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(f"Attention {self.layer_name}: no KV cache allocated (models.KVCache)")
        impl = attention_cuda if (self._impl is attention_cuda and q.is_cuda) else attention_native
        return impl(q, k, v, self.kv_cache, md, self.num_heads, self.head_size, self.scale,
                    self.sliding_window, self.logits_soft_cap, out, self.kv_scales)

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """The scales of this layer's keys and values in an fp8 cache (``ops.kv_quant``: the cache holds ``k /
        k_scale``); a checkpoint's ``kv_cache_scheme`` sets them at load, else they are 1. Ignored by other
        caches."""
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"Attention {self.layer_name}: {name} must be a positive finite number; got "
                                 f"{value!r}")
        self.kv_scales = KVScales.of(k_scale, v_scale)

    def extra_repr(self) -> str:
        return (f"{self.layer_name}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"scale={self.scale:.4g}, sliding_window={self.sliding_window}, soft_cap={self.logits_soft_cap}"
                + (f", k_scale={self.kv_scales.k_scale:.4g}, v_scale={self.kv_scales.v_scale:.4g}"
                   if self.kv_scales != UNIT_KV_SCALES else ""))


def default_scale(head_size: int) -> float:
    return 1.0 / math.sqrt(head_size)
