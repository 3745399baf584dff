"""dynamo_once::paged_prefill: the reference against the attention layer's native path
(``models.attention.attention_native``), the Triton kernel against the reference in Triton's interpreter on CPU
tensors (``-m interpret``, with ``TRITON_INTERPRET=1``: ``make test`` runs them) and on CUDA, the op through
opcheck and torch.compile.

Batches mix what one step holds: decode rows (one new token, one at the first position), whole prompts, chunks
after cached context (chunked prefill), sequences over several 16-token blocks with a partial last one, and
blocks interleaved across sequences so that a wrong block table cannot pass.
"""

import pytest
import torch

import ops
from models.attention import attention_native
from models.forward_context import AttentionMetadata
from ops.paged_prefill import PrefillConfig

BLOCK = 16
# (context already cached, new tokens) per sequence.
SPECS = [(0, 1), (20, 1), (0, 19), (37, 12), (5, 40), (16, 16)]
HEADS = [(8, 2), (2, 2)]  # (Hq, Hkv): GQA 4:1 (Llama 3 8B: 32, 8) and 1:1
HEAD_IDS = ["gqa4", "mha"]
# Gemma 2 soft-caps every layer (50) and slides a window (4096) on every other: both together, shrunk.
KWS = [{}, {"sliding_window": 7}, {"logits_soft_cap": 5.0}, {"sliding_window": 21, "logits_soft_cap": 5.0}]
KW_IDS = ["plain", "window", "softcap", "window+softcap"]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
# fp32: the kernel and the reference are the same sums reordered (and exp2 for exp): 1e-5, as paged_decode's.
FP32_TOL = 1e-5
# bf16: the unit roundoff of one rounding to bf16: the GPU rounds to nearest (2**-8); Triton 3.6's interpreter
# truncates (< 1 ulp, 2**-7).
BF16_UNIT = {"cuda": 2.0**-8, "interpret": 2.0**-7}
# The tile configs the interpreter runs besides the default: 16 rows (4 tokens of a 4:1 group, 16 of 1:1) and one
# page a key tile, so that sequences span several query blocks and key tiles, unmasked and diagonal ones.
SMALL = PrefillConfig(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=2)


def prefill_batch(specs, num_heads, num_kv_heads, head_size, dtype=torch.float32, device="cpu", seed=0):
    """``(q, k, v, kv_cache, md)``: random context in the cache, the new tokens' k, v already written to it."""
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(specs)
    blocks_per_seq = max((c + n + BLOCK - 1) // BLOCK for c, n in specs)
    table = torch.tensor([[j * num_seqs + s for j in range(blocks_per_seq)] for s in range(num_seqs)],
                         dtype=torch.int32)
    cache = torch.randn(2, num_seqs * blocks_per_seq, BLOCK, num_kv_heads, head_size, generator=g).to(dtype)
    slots, starts, lens = [], [0], []
    for s, (ctx, new) in enumerate(specs):
        slots += [int(table[s, p // BLOCK]) * BLOCK + p % BLOCK for p in range(ctx, ctx + new)]
        starts.append(starts[-1] + new)
        lens.append(ctx + new)
    num_tokens = starts[-1]
    q = torch.randn(num_tokens, num_heads * head_size, generator=g).to(dtype).to(device)
    k = torch.randn(num_tokens, num_kv_heads * head_size, generator=g).to(dtype).to(device)
    v = torch.randn(num_tokens, num_kv_heads * head_size, generator=g).to(dtype).to(device)
    cache = cache.to(device)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_table=table.to(device),
        num_decodes=next((i for i, (_, n) in enumerate(specs) if n != 1), num_seqs),
        query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens))
    ops.write_kv_cache_ref(cache, k, v, md.slot_mapping)
    return q, k, v, cache, md


def op_args(q, cache, md, num_heads, head_size, max_query_len=None):
    """The positional arguments of paged_prefill(_triton, _ref) for the whole batch."""
    max_query_len = max_query_len or max(b - a for a, b in zip(md.query_start_loc_cpu, md.query_start_loc_cpu[1:]))
    return (q, cache, md.block_table, md.seq_lens, md.query_start_loc, max_query_len, num_heads, head_size,
            head_size**-0.5)


def abs_attention(args, kw):
    """``S = sum_j p_j |v_j|`` per output element, in fp32: the reference's attention of |v|."""
    q, cache = args[0].float(), args[1].float().clone()
    cache[1] = cache[1].abs()
    return ops.paged_prefill_ref(q, cache, *args[2:], **kw)


def bf16_bound(args, kw, unit):
    """Elementwise bound on |kernel - reference| in bf16, from S (:func:`abs_attention`).

    Both compute the logits in fp32 from bf16 q, k (exact products: error ~D 2**-24, negligible). The reference
    rounds its fp32 result e once (<= 2**-8 |e|); the kernel rounds each probability to bf16 for P @ V (<= unit
    S) and its output once (<= unit |e|, to first order). |e| <= S, so the sum is <= 3 unit S; one more unit S
    covers the second-order terms and fp32's (exp2, sums in another order).
    """
    return 4 * unit * abs_attention(args, kw) + 1e-6


def assert_matches_reference(out, ref, args, kw, device_kind):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=FP32_TOL, atol=FP32_TOL)
        return
    err = (out.float() - ref.float()).abs()
    tol = bf16_bound(args, kw, BF16_UNIT[device_kind])
    assert (err <= tol).all(), f"max err / bound = {(err / tol).max().item():.3g}"


# ----------------------------------------------------------------------- reference
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kw", KWS, ids=KW_IDS)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_reference_is_the_attention_layers_semantics(heads, head_size, kw, dtype):
    """paged_prefill_ref against attention_native (gather per sequence, SDPA or fp32 soft-capped softmax)."""
    num_heads, num_kv_heads = heads
    q, k, v, cache, md = prefill_batch(SPECS, num_heads, num_kv_heads, head_size, dtype)
    args = op_args(q, cache, md, num_heads, head_size)
    ref = ops.paged_prefill_ref(*args, **kw)
    native = attention_native(q, k, v, cache.clone(), md, num_heads, head_size, head_size**-0.5, **kw)
    if dtype == torch.float32:
        torch.testing.assert_close(ref, native, rtol=FP32_TOL, atol=FP32_TOL)
    else:
        # attention_native runs in bf16: its logits and probabilities are rounded to bf16 (2**-8 relative, one
        # 1e-2 at a logit of 3, moving a probability by as much), P @ V and the output too: within
        # 8 * 2**-8 sum_j p_j |v_j| of the fp32 reference, and that is what they differ by.
        err = (ref.float() - native.float()).abs()
        tol = 8 * 2.0**-8 * abs_attention(args, kw) + 1e-6
        assert (err <= tol).all(), f"max err / bound = {(err / tol).max().item():.3g}"


def test_op_off_cuda_is_the_reference_and_out_gets_only_the_sequences_rows():
    q, _, _, cache, md = prefill_batch(SPECS, 8, 2, 64)
    args = op_args(q, cache, md, 8, 64)
    ref = ops.paged_prefill_ref(*args, sliding_window=7)
    assert torch.equal(ops.paged_prefill(*args, sliding_window=7), ref)
    # Sequences 2.. only, q's rows indexed absolutely (query_start_loc need not start at 0): the rest of out kept.
    out = torch.full_like(q, 7.0)
    first = md.query_start_loc_cpu[2]
    part = (q, cache, md.block_table[2:], md.seq_lens[2:], md.query_start_loc[2:], *args[5:])
    assert ops.paged_prefill_ref(*part, sliding_window=7, out=out) is out
    assert torch.equal(out[first:], ref[first:]) and (out[:first] == 7.0).all()


def test_rejects_heads_that_do_not_fit_the_cache():
    q, _, _, cache, md = prefill_batch(SPECS[:2], 6, 4, 64)
    with pytest.raises(ValueError, match="does not fit kv_cache"):
        ops.paged_prefill_ref(*op_args(q, cache, md, 6, 64))


def test_config_by_head_size_dtype_and_query_length():
    """Long queries: the head size's tile; decode-length ones: 16 rows; a group wider than the tile: one token."""
    assert ops.prefill_config(128, 4, 4096) == PrefillConfig(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    assert ops.prefill_config(80, 4, 4096).BLOCK_M == 128 and ops.prefill_config(256, 2, 4096).BLOCK_M == 64
    assert ops.prefill_config(128, 4, 1).BLOCK_M == 16 and ops.prefill_config(128, 1, 5).BLOCK_M == 16
    assert ops.prefill_config(128, 4, 9).BLOCK_M == 64
    assert ops.prefill_config(128, 256, 4096).BLOCK_M == 256
    assert ops.prefill_config(128, 4, 4096, torch.float32).BLOCK_N == 16


def _opcheck_args(device):
    q, _, _, cache, md = prefill_batch(SPECS, 8, 2, 64, torch.bfloat16, device)
    return (*op_args(q, cache, md, 8, 64), 21, 50.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_opcheck(device):
    torch.library.opcheck(torch.ops.dynamo_once.paged_prefill.default, _opcheck_args(device),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_under_torch_compile(device):
    """fullgraph, dynamic T: the opaque op in the graph, its result the eager one."""
    args = _opcheck_args(device)
    compiled = torch.compile(ops.paged_prefill, fullgraph=True, dynamic=True, backend="aot_eager")
    assert torch.equal(compiled(*args), ops.paged_prefill(*args))


# ------------------------------------------------------------------- interpreter
@pytest.mark.interpret
@pytest.mark.usefixtures("bf16_dot_in_the_interpreter")
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kw", KWS, ids=KW_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_interpreted_kernel_matches_reference(heads, kw, dtype, config):
    num_heads, num_kv_heads = heads
    q, _, _, cache, md = prefill_batch(SPECS, num_heads, num_kv_heads, 64, dtype)
    args = op_args(q, cache, md, num_heads, 64)
    out = ops.paged_prefill_triton(*args, **kw, config=config)
    assert_matches_reference(out, ops.paged_prefill_ref(*args, **kw), args, kw, "interpret")


@pytest.mark.interpret
@pytest.mark.usefixtures("bf16_dot_in_the_interpreter")
@pytest.mark.parametrize("new_kv", [False, True], ids=["cached", "new_kv"])
@pytest.mark.parametrize("kw", KWS, ids=KW_IDS)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 2)], ids=["mha", "gqa4", "gqa3"])
def test_interpreted_decode_rows_match_reference(heads, kw, new_kv):
    """``decode_rows`` (the unified launch's): sequences of one new token (first, at position 0, after context, after
    a whole block) on their own tile, beside prompts and a chunk, with and without the kernel writing the new keys
    and values: the reference's output, and its cache."""
    num_heads, num_kv_heads = heads
    specs = [(9, 1), (0, 1), (BLOCK * 4, 1), (BLOCK * 2 + 3, 1)] + SPECS[1:4]
    q, k, v, cache, md = prefill_batch(specs, num_heads, num_kv_heads, 64, seed=2)
    args = op_args(q, cache, md, num_heads, 64)
    ref = ops.paged_prefill_ref(*args, **kw)
    start = cache.clone()
    if new_kv:  # the step's slots NaN: a read before the kernel's write shows
        cache.view(2, -1, *cache.shape[-2:])[:, md.slot_mapping] = float("nan")
    out = ops.paged_prefill_triton(*args, **kw, new_kv=(k, v) if new_kv else None, decode_rows=True)
    assert_matches_reference(out, ref, args, kw, "interpret")
    assert torch.equal(cache, start)


@pytest.mark.interpret
@pytest.mark.usefixtures("bf16_dot_in_the_interpreter")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("head_size", [128, 256])
def test_interpreted_large_heads(head_size, heads, dtype):
    """The default configs of D = 128 (Llama) and 256 (Gemma 2)."""
    num_heads, num_kv_heads = heads
    q, _, _, cache, md = prefill_batch(SPECS[2:5], num_heads, num_kv_heads, head_size, dtype)
    args = op_args(q, cache, md, num_heads, head_size)
    kw = {"sliding_window": 21}
    assert_matches_reference(ops.paged_prefill_triton(*args, **kw), ops.paged_prefill_ref(*args, **kw), args, kw,
                             "interpret")


@pytest.mark.interpret
def test_interpreted_awkward_shapes_strided_q_and_out_rows():
    """A group of 3 (padded to 4 rows a token), D = 80 (a 128-wide tile, masked), q a column slice of a qkv
    tensor, a loose max_query_len, and sequences 1.. only into a preset ``out`` (rows indexed absolutely)."""
    num_heads, num_kv_heads, head_size = 6, 2, 80
    q, _, _, cache, md = prefill_batch(SPECS, num_heads, num_kv_heads, head_size, seed=1)
    qkv = torch.cat([q, torch.randn(q.shape[0], 2 * num_kv_heads * head_size)], 1)
    q_strided = qkv[:, : num_heads * head_size]
    ref = ops.paged_prefill_ref(*op_args(q, cache, md, num_heads, head_size), logits_soft_cap=5.0)
    for config in (None, SMALL):
        out = torch.full_like(q, 7.0)
        part = (q_strided, cache, md.block_table[1:], md.seq_lens[1:], md.query_start_loc[1:], 64, num_heads,
                head_size, head_size**-0.5)
        assert ops.paged_prefill_triton(*part, logits_soft_cap=5.0, out=out, config=config) is out
        assert (out[:1] == 7.0).all()
        torch.testing.assert_close(out[1:], ref[1:], rtol=FP32_TOL, atol=FP32_TOL)


# -------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kw", KWS, ids=KW_IDS)
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_cuda_op_matches_reference(heads, head_size, kw, dtype):
    """The op (the kernel, default configs per head size) and the launcher with the small tiles."""
    num_heads, num_kv_heads = heads
    q, _, _, cache, md = prefill_batch(SPECS, num_heads, num_kv_heads, head_size, dtype, "cuda")
    args = op_args(q, cache, md, num_heads, head_size)
    ref = ops.paged_prefill_ref(*args, **kw)
    assert_matches_reference(ops.paged_prefill(*args, **kw), ref, args, kw, "cuda")
    assert_matches_reference(ops.paged_prefill_triton(*args, **kw, config=SMALL), ref, args, kw, "cuda")


# Llama 3 8B's attention (32 query heads, 8 KV heads of 128) on a step of three sequences with prior context:
# a long prompt chunk, a middle one, a short one; plain, and Gemma 2's window + soft cap, shrunk to the lengths.
LARGE_SPECS = [(100, 2048), (1500, 512), (3000, 64)]


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 1024, "logits_soft_cap": 50.0}], ids=["plain", "gemma2"])
def test_cuda_llama3_8b_step(kw):
    q, _, _, cache, md = prefill_batch(LARGE_SPECS, 32, 8, 128, torch.bfloat16, "cuda")
    args = op_args(q, cache, md, 32, 128)
    assert_matches_reference(ops.paged_prefill(*args, **kw), ops.paged_prefill_ref(*args, **kw), args, kw, "cuda")


@pytest.mark.cuda
def test_cuda_sequence_slice_into_out_and_cuda_graph():
    """How the attention layer calls it: the prefill sequences of a mixed step (query_start_loc from the first
    prefill's row) into the step's ``out``; captured in a CUDA graph (no host sync) and replayed on new values."""
    q, _, _, cache, md = prefill_batch(SPECS, 8, 2, 128, torch.bfloat16, "cuda")
    nd = md.num_decodes
    part = (q, cache, md.block_table[nd:], md.seq_lens[nd:], md.query_start_loc[nd:], 64, 8, 128, 128**-0.5)
    out = torch.zeros_like(q)
    ops.paged_prefill_triton(*part, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_prefill_triton(*part, out=out)
    q.copy_(torch.randn_like(q))
    cache.copy_(torch.randn_like(cache))
    out.zero_()
    graph.replay()
    first = md.query_start_loc_cpu[nd]
    ref = ops.paged_prefill_ref(*op_args(q, cache, md, 8, 128))
    assert (out[:first] == 0).all()
    args = (q[first:], cache, md.block_table[nd:], md.seq_lens[nd:], md.query_start_loc[nd:] - first, 64, 8, 128,
            128**-0.5)
    assert_matches_reference(out[first:], ref[first:], args, {}, "cuda")


# ------------------------------------------------------- the form that writes the cache (new_kv)
def poisoned(cache, md):
    """``cache`` with the new tokens' slots of both halves NaN: what the new_kv form must write and never read."""
    c = cache.clone()
    c.view(2, -1, *c.shape[-2:])[:, md.slot_mapping] = float("nan")
    return c


def write_then_plain(q, k, v, cache, md, args, kw, config=None):
    """What the new_kv form stands for: the cache-write kernel, then the plain form (``cache`` is written)."""
    ops.write_kv_cache_triton(cache, k, v, md.slot_mapping)
    return ops.paged_prefill_triton(q, cache, *args[2:], **kw, config=config)


@pytest.mark.interpret
@pytest.mark.usefixtures("bf16_dot_in_the_interpreter")
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kw", KWS, ids=KW_IDS)
@pytest.mark.parametrize("heads", HEADS + [(16, 1)], ids=HEAD_IDS + ["gqa16"])
def test_interpreted_new_kv_form_equals_the_write_then_the_plain_form(heads, kw, dtype, config):
    """Bit for bit, output and cache, on SPECS (decode rows, whole prompts, chunks after cached context over
    several blocks). The cache starts with NaN in the new slots: a read of one before its write would show.
    gqa16 with the small tiles: one token a query block (BLOCK_Q = 1)."""
    num_heads, num_kv_heads = heads
    q, k, v, cache, md = prefill_batch(SPECS, num_heads, num_kv_heads, 64, dtype)
    args = op_args(q, cache, md, num_heads, 64)
    start = poisoned(cache, md)
    expected_cache = start.clone()
    expected = write_then_plain(q, k, v, expected_cache, md, args, kw, config)
    assert torch.equal(expected_cache, cache)  # the write kernel is the reference's write
    got_cache = start.clone()
    out = ops.paged_prefill_triton(q, got_cache, *args[2:], **kw, config=config, new_kv=(k, v))
    assert torch.equal(out, expected)
    assert torch.equal(got_cache, expected_cache)


@pytest.mark.interpret
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
def test_interpreted_new_kv_form_as_the_attention_op_calls_it(config):
    """The sequences after the decodes only (their rows indexed absolutely, into a preset ``out``), k and v column
    slices of a qkv tensor (row strides), and a cache of another dtype (bf16 for fp32 k, v: the kernel casts as
    the write does): the same output and cache as the write of those rows, then the plain form."""
    num_heads, num_kv_heads, head_size = 6, 2, 80
    q, k, v, cache, md = prefill_batch(SPECS, num_heads, num_kv_heads, head_size, seed=2)
    qkv = torch.cat([q, k, v], 1)
    k_s, v_s = qkv[:, q.shape[1]: q.shape[1] + k.shape[1]], qkv[:, q.shape[1] + k.shape[1]:]
    nd = md.num_decodes
    first = md.query_start_loc_cpu[nd]
    part = (md.block_table[nd:], md.seq_lens[nd:], md.query_start_loc[nd:], 64, num_heads, head_size,
            head_size**-0.5)
    kw = {"sliding_window": 21, "logits_soft_cap": 5.0}
    start = poisoned(cache.to(torch.bfloat16), md)
    expected_cache, expected = start.clone(), torch.full_like(q, 7.0)
    ops.write_kv_cache_triton(expected_cache, k[first:], v[first:], md.slot_mapping[first:])
    ops.paged_prefill_triton(q, expected_cache, *part, **kw, out=expected, config=config)
    got_cache, out = start.clone(), torch.full_like(q, 7.0)
    ops.paged_prefill_triton(q, got_cache, *part, **kw, out=out, config=config, new_kv=(k_s, v_s))
    assert torch.equal(out, expected) and (out[:first] == 7.0).all()
    assert torch.equal(got_cache.view(torch.int16), expected_cache.view(torch.int16))  # bits: NaN left in both
    assert got_cache.view(2, -1, num_kv_heads, head_size)[:, md.slot_mapping[:first]].isnan().all()  # decodes': not


def test_new_kv_form_binds_k_v_and_their_strides_in_the_kernels_order():
    """bind_prefill's argument list against the kernel's parameters: with new_kv, k, v and their row strides from
    the call; without, q and zero strides in their places (unused), and NEW_KV off; the fp8 cache's inverse scales
    and value scale after the window."""
    from ops.paged_prefill import _prefill_kernel, bind_prefill

    q, k, v, cache, md = prefill_batch(SPECS, 8, 2, 64)
    out = torch.empty_like(q)
    names = [p.name for p in _prefill_kernel.params if not p.is_constexpr]
    scalars = tuple(range(100, 114))
    for new_kv in (False, True):
        launch = bind_prefill(md.block_table, md.seq_lens, md.query_start_loc, 40, 8, 2, 64, BLOCK, q.dtype, False,
                              False, new_kv=new_kv)
        assert launch.kwargs["NEW_KV"] is new_kv
        bound = dict(zip(names, launch.full_args((q, cache, out, k, v), scalars), strict=True))
        assert bound["q_ptr"] is q and bound["kv_cache_ptr"] is cache and bound["out_ptr"] is out
        assert (bound["stride_q_t"], bound["stride_o_t"], bound["window"]) == (100, 101, 108)
        assert (bound["k_inv"], bound["v_inv"], bound["v_scale"]) == (109, 110, 111)
        if new_kv:
            assert bound["k_ptr"] is k and bound["v_ptr"] is v
            assert (bound["stride_k_t"], bound["stride_v_t"]) == (112, 113)
        else:
            assert bound["k_ptr"] is q and bound["v_ptr"] is q and bound["stride_k_t"] == bound["stride_v_t"] == 0


def test_new_kv_must_be_rows_of_the_caches_width():
    q, k, v, cache, md = prefill_batch(SPECS, 8, 2, 64)
    with pytest.raises(ValueError, match="new_kv's v must be"):
        ops.paged_prefill_triton(*op_args(q, cache, md, 8, 64), new_kv=(k, v[:, :64]))


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 1024, "logits_soft_cap": 50.0}], ids=["plain", "gemma2"])
def test_cuda_new_kv_form_equals_the_write_then_the_plain_form_llama3_8b(kw):
    """The opt-in form (``models.attention.PREFILL_WRITES_KV``) on the GPU, Llama 3 8B's heads in bf16, prompt chunks
    after cached context: output and cache bit for bit those of the cache write, then the plain form (the same tiles
    and values: only where the chunk's own keys are read from changes). The new slots start NaN."""
    q, k, v, cache, md = prefill_batch(LARGE_SPECS, 32, 8, 128, torch.bfloat16, "cuda")
    args = op_args(q, cache, md, 32, 128)
    start = poisoned(cache, md)
    expected_cache = start.clone()
    expected = write_then_plain(q, k, v, expected_cache, md, args, kw)
    got_cache = start.clone()
    out = ops.paged_prefill_triton(q, got_cache, *args[2:], **kw, new_kv=(k, v))
    assert torch.equal(out, expected)
    assert torch.equal(got_cache, expected_cache)
