"""dynamo_once::paged_decode and dynamo_once::write_kv_cache: the references against plain attention and
per-slot writes, the ops (the Triton kernels on CUDA) against the references. The kernels on CPU tensors
in Triton's interpreter: test_kernels_interpreted.py; the attention layer that calls them: tests/models."""

import pytest
import torch

import ops

HEADS, KV_HEADS, HEAD = 4, 2, 16  # Llama 3 8B: 32, 8, 128
BLOCK = 4  # small blocks: sequences span several, with a partial last one
SCALE = HEAD**-0.5
# fp32: a softmax-weighted sum reordered over splits; bf16: the output's rounding (2**-7 ~ 7.8e-3) and
# bf16 probabilities in the P @ V product.
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
WINDOWS = [{}, {"sliding_window": 7}, {"logits_soft_cap": 5.0}]
WINDOW_IDS = ["plain", "window", "softcap"]
# Contexts from the first token to several blocks, a partial last block, one longer than a split.
CONTEXTS = [0, 5, BLOCK * 9 + 2, 70, BLOCK - 1]


def decode_batch(contexts, dtype=torch.float32, device="cpu", seed=0):
    """One new token per sequence after ``contexts[b]`` cached ones: ``(q, kv_cache, block_table, seq_lens)``.

    The cache holds random keys and values everywhere, this step's included; the sequences' blocks are
    interleaved, so that a wrong block table cannot pass.
    """
    g = torch.Generator().manual_seed(seed)
    num_seqs = len(contexts)
    blocks_per_seq = max((c + 1 + BLOCK - 1) // BLOCK for c in contexts)
    table = torch.tensor([[j * num_seqs + b for j in range(blocks_per_seq)] for b in range(num_seqs)],
                         dtype=torch.int32)
    cache = torch.randn(2, num_seqs * blocks_per_seq, BLOCK, KV_HEADS, HEAD, generator=g).to(dtype)
    q = torch.randn(num_seqs, HEADS * HEAD, generator=g).to(dtype)
    seq_lens = torch.tensor([c + 1 for c in contexts], dtype=torch.int32)
    return q.to(device), cache.to(device), table.to(device), seq_lens.to(device)


def dense_reference(q, kv_cache, block_table, seq_lens, window=None, cap=None):
    """Plain fp64 attention of each sequence's query over its tokens, gathered one by one: ``[B, Hq * D]``."""
    out = []
    flat = kv_cache.double().flatten(1, 2)  # [2, num_blocks * BLOCK, Hkv, D]
    for b, seq_len in enumerate(seq_lens.tolist()):
        slots = [int(block_table[b, p // BLOCK]) * BLOCK + p % BLOCK for p in range(seq_len)]
        k = flat[0, slots].repeat_interleave(HEADS // KV_HEADS, 1)  # [L, Hq, D]
        v = flat[1, slots].repeat_interleave(HEADS // KV_HEADS, 1)
        s = torch.einsum("hd,lhd->hl", q[b].double().view(HEADS, HEAD), k) * SCALE
        if cap:
            s = cap * torch.tanh(s / cap)
        if window:
            s[:, : max(seq_len - window, 0)] = float("-inf")
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("kw", WINDOWS, ids=WINDOW_IDS)
def test_decode_reference_matches_dense_attention(kw):
    q, cache, table, seq_lens = decode_batch(CONTEXTS)
    ref = ops.paged_decode_ref(q, cache, table, seq_lens, HEADS, HEAD, SCALE, **kw)
    expected = dense_reference(q, cache, table, seq_lens, kw.get("sliding_window"), kw.get("logits_soft_cap"))
    torch.testing.assert_close(ref.double(), expected, rtol=1e-5, atol=1e-5)
    # The op off CUDA is the reference.
    out = ops.paged_decode(q, cache, table, seq_lens, HEADS, HEAD, SCALE, **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_reference_puts_each_token_in_its_slot(dtype):
    """k and v as column slices of one fp32 qkv tensor (strided rows), cast to the cache's dtype."""
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, 8, BLOCK, KV_HEADS, HEAD, dtype=dtype)
    qkv = torch.randn(5, (HEADS + 2 * KV_HEADS) * HEAD, generator=g)
    k, v = qkv[:, HEADS * HEAD:(HEADS + KV_HEADS) * HEAD], qkv[:, (HEADS + KV_HEADS) * HEAD:]
    slots = torch.tensor([17, 3, 30, 4, 0])
    ops.write_kv_cache(cache, k, v, slots)
    flat = cache.view(2, -1, KV_HEADS, HEAD)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(flat[0, slot], k[t].view(KV_HEADS, HEAD).to(dtype))
        assert torch.equal(flat[1, slot], v[t].view(KV_HEADS, HEAD).to(dtype))
    assert flat.abs().sum(dim=(0, 2, 3)).count_nonzero() == len(slots)  # nothing else written


def test_decode_splits_must_be_a_power_of_two():
    q, cache, table, seq_lens = decode_batch([5])
    with pytest.raises(ValueError, match="num_splits must be a power of two .* got 3"):
        ops.paged_decode_triton(q, cache, table, seq_lens, HEADS, HEAD, SCALE, num_splits=3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 37}, {"logits_soft_cap": 5.0}], ids=WINDOW_IDS)
@pytest.mark.parametrize("num_seqs", [1, 7, 64, 256])
def test_cuda_decode_op_matches_reference(num_seqs, kw, dtype):
    """The op's kernels, 1 to 256 sequences (1 to 32 splits each), and the launcher the attention layer calls."""
    gen = torch.Generator().manual_seed(num_seqs)
    contexts = torch.randint(0, 300, (num_seqs,), generator=gen).tolist()
    q, cache, table, seq_lens = decode_batch(contexts, dtype, "cuda")
    out = ops.paged_decode(q, cache, table, seq_lens, HEADS, HEAD, SCALE, **kw)
    ref = ops.paged_decode_ref(q, cache, table, seq_lens, HEADS, HEAD, SCALE, **kw)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(ops.paged_decode_triton(q, cache, table, seq_lens, HEADS, HEAD, SCALE, **kw), out)


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [1, 5, 300])
def test_cuda_cache_write_kernel_equals_index_copy(num_tokens):
    """The one-launch cache write (the op, and the launcher the attention layer calls): k and v as column
    slices of one qkv tensor, slots in any order."""
    g = torch.Generator().manual_seed(num_tokens)
    cache = torch.randn(2, 128, BLOCK, KV_HEADS, HEAD, generator=g).to(torch.bfloat16).cuda()
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD, generator=g).to(torch.bfloat16).cuda()
    k = qkv[:, HEADS * HEAD:(HEADS + KV_HEADS) * HEAD]
    v = qkv[:, (HEADS + KV_HEADS) * HEAD:]
    slots = torch.randperm(128 * BLOCK, generator=g)[:num_tokens].cuda()
    expected, by_op = cache.clone(), cache.clone()
    ops.write_kv_cache_ref(expected, k, v, slots)
    ops.write_kv_cache(by_op, k, v, slots)
    ops.write_kv_cache_triton(cache, k, v, slots)
    torch.testing.assert_close(by_op, expected, rtol=0, atol=0)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
