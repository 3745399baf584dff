"""The decode kernel's persistent form (``DecodeConfig.persistent``: the items kernel, each program attending several
(sequence, KV head) items in one loop) against the references.

In Triton's interpreter (``TRITON_INTERPRET=1``, the ``interpret`` marker) on CPU tensors, where the split rule sees
8 SMs: one to several items a program, item counts that leave some programs one item short, both grid orders,
sliding windows and soft caps, the cache write fused in, sequences of every length from one token to several chunks.
The CUDA test runs the same on the GPU, eager and in a CUDA graph, at the 8B's shapes.
"""

import dataclasses

import pytest
import torch
from test_paged_decode_fused import WINDOW_IDS, WINDOWS, check, expected, new_batch, run_fused

from ops.paged_attention import DecodePlan, paged_decode_launch, paged_decode_ref
from ops.paged_decode_config import DecodeConfig

CPU = torch.device("cpu")  # 8 SMs for the split rule off CUDA


def test_grid_and_items_per_program():
    """``persistent`` programs an SM, at most one per item; each program's item count rounded up to a power of
    two; one split whatever ``waves`` says; a fixed split count other than one refused."""
    bt = new_batch([5] * 12, kv_heads=2)  # 24 items
    for per_sm, grid, items in [(1, 8, 4), (2, 16, 2), (4, 24, 2)]:
        plan = DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 4, CPU,
                          config=DecodeConfig(persistent=per_sm, waves=4))
        assert plan.persistent and plan.num_splits == 1 and plan.split_grid == (grid, 1, 1)
        assert plan.split_constexprs["ITEMS"] == items and plan.mid_o is None
    with pytest.raises(ValueError, match="persistent"):
        DecodeConfig(persistent=1, num_splits=2)
    with pytest.raises(ValueError, match="persistent"):
        DecodeConfig(persistent=-1)
    plan = DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 4, CPU, num_splits=2,
                      config=DecodeConfig(persistent=1))  # a split count passed to the plan: the split kernel
    assert not plan.persistent and plan.num_splits == 2


def _lengths(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 40, (n,), generator=g).tolist()


@pytest.mark.interpret
@pytest.mark.parametrize("kw", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("write", [False, True], ids=["decode", "fused-write"])
@pytest.mark.parametrize("heads_first", [False, True], ids=["seqs-first", "heads-first"])
@pytest.mark.parametrize("num_seqs,per_sm", [(3, 1), (7, 1), (13, 1), (13, 2)])
def test_persistent_form_equals_the_references(num_seqs, per_sm, heads_first, write, kw):
    """6 to 26 items over 6 to 16 programs (one to four items each, some one short); chunks of two pages, sequences
    of one token (the new one alone) to ten chunks; two calls in a row (the second finds the tokens written)."""
    bt = new_batch([0, 4, *_lengths(num_seqs - 2, num_seqs)], kv_heads=2)
    cfg = DecodeConfig(persistent=per_sm, BLOCK_N=8, heads_first=heads_first, fused_write=write)
    check(bt, cfg, repeats=2, **kw)


@pytest.mark.interpret
def test_empty_sequences_get_zeros():
    """A sequence of no tokens (a padded row of a captured batch) still gets its output written, zeros, as the
    split kernel writes it; the others their attention over the cache as it is (no new tokens given)."""
    bt = new_batch([9, 3, 17, 5, 2], kv_heads=2)
    lens = bt.seq_lens.clone()
    lens[[1, 3]] = 0
    plan = DecodePlan(bt.table, lens, bt.heads, bt.kv_heads, bt.head, 4, CPU, config=DecodeConfig(persistent=1))
    out = torch.full_like(bt.q, float("nan"))
    paged_decode_launch(plan, bt.q, bt.cache, out, bt.scale)
    keep = [0, 2, 4]
    ref = paged_decode_ref(bt.q[keep], bt.cache, bt.table[keep], lens[keep], bt.heads, bt.head, bt.scale)
    torch.testing.assert_close(out[keep], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("write", [False, True], ids=["decode", "fused-write"])
@pytest.mark.parametrize("num_seqs,per_sm", [(1, 1), (32, 1), (32, 2), (77, 1), (128, 2), (256, 1)])
def test_cuda_persistent_form_equals_the_references(num_seqs, per_sm, write, dtype):
    """On the GPU at Llama-3-8B's heads (8 KV heads, D 128, 16-token pages, 64- and 128-token chunks): 8 to 2048
    items, one to eight a program; eager calls in a row, then a CUDA graph replayed several times."""
    gen = torch.Generator().manual_seed(num_seqs)
    contexts = torch.randint(0, 600, (num_seqs,), generator=gen).tolist()
    bt = new_batch(contexts, page=16, kv_heads=8, group=4, head=128, seed=num_seqs)
    bt = dataclasses.replace(bt, **{f: getattr(bt, f).to("cuda", dtype) for f in ("q", "cache", "k", "v")},
                             **{f: getattr(bt, f).cuda() for f in ("table", "seq_lens", "slots")})
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for block_n, kw in ((128, {}), (64, {"sliding_window": 37}), (128, {"logits_soft_cap": 5.0})):
        cfg = DecodeConfig(persistent=per_sm, BLOCK_N=block_n, heads_first=True, fused_write=write)
        ref, ref_cache = expected(bt, **kw)
        cache = bt.cache.clone()
        plan = DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 16, bt.q.device, config=cfg)
        assert plan.persistent
        for _ in range(5):  # without the fused write, the cache-write launch before the kernel writes the tokens
            out = run_fused(bt, cfg, cache, plan, **kw)
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
        graph, out = torch.cuda.CUDAGraph(), torch.empty_like(bt.q)
        with torch.cuda.graph(graph):
            paged_decode_launch(plan, bt.q, cache, out, bt.scale, kw.get("sliding_window"), kw.get("logits_soft_cap"),
                                new_kv=(bt.k, bt.v, bt.slots))
        for _ in range(5):
            out.zero_()
            graph.replay()
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
