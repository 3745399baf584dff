"""The decode kernel's fused forms (``DecodeConfig.fused_merge``, ``fused_write``) against the references.

In Triton's interpreter (``TRITON_INTERPRET=1``, the ``interpret`` marker) on CPU tensors: the decode launch given
the new tokens' keys and values (``paged_decode_launch``'s ``new_kv``) must equal ``write_kv_cache_ref`` followed by
``paged_decode_ref``, the output and the whole cache after it; the arrival counters must be back at 0 after every
launch (so a CUDA graph's replays, and the next layer sharing them, start from 0). The interpreter runs a launch's
programs one after another, so the last split to arrive is always the grid's last: the memory ordering on a GPU is
the CUDA tests' (``-m cuda``) business. The fused forms' launches are counted too: one kernel, no merge or write.
"""

import dataclasses
import importlib

import pytest
import torch

from ops.paged_attention import (DecodePlan, DecodeWorkspace, paged_decode_launch, paged_decode_ref,
                                 write_kv_cache_ref)
from ops.paged_decode_config import DecodeConfig

pa = importlib.import_module("ops.paged_attention")
CPU = torch.device("cpu")
FORMS = [(True, True), (True, False), (False, True)]
FORM_IDS = ["merge+write", "merge", "write"]
WINDOWS = [{}, {"sliding_window": 7}, {"logits_soft_cap": 5.0}]
WINDOW_IDS = ["plain", "window", "softcap"]
FUSED = {"fused_merge": True, "fused_write": True}  # both off by default (the table's rows): asked for here


@dataclasses.dataclass
class Batch:
    q: torch.Tensor
    cache: torch.Tensor
    table: torch.Tensor
    seq_lens: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    heads: int
    kv_heads: int
    head: int

    @property
    def scale(self) -> float:
        return self.head**-0.5


def new_batch(contexts, page=4, kv_heads=2, group=2, head=16, seed=0) -> Batch:
    """Decode sequences with ``contexts[b]`` cached tokens and one new one each (position ``contexts[b]``), the
    blocks of the sequences interleaved over a cache of random values (the new tokens' slots included)."""
    g = torch.Generator().manual_seed(seed)
    n = len(contexts)
    per_seq = max(c // page + 1 for c in contexts)
    table = torch.tensor([[j * n + b for j in range(per_seq)] for b in range(n)], dtype=torch.int32)
    cache = torch.randn(2, n * per_seq, page, kv_heads, head, generator=g)
    heads = kv_heads * group
    q = torch.randn(n, heads * head, generator=g)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head, generator=g)  # k, v: strided column slices, as the model's
    k, v = qkv[:, heads * head:(heads + kv_heads) * head], qkv[:, (heads + kv_heads) * head:]
    seq_lens = torch.tensor([c + 1 for c in contexts], dtype=torch.int32)
    last = seq_lens.long() - 1
    slots = table.long()[torch.arange(n), last // page] * page + last % page
    return Batch(q, cache, table, seq_lens, k, v, slots, heads, kv_heads, head)


def expected(bt: Batch, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    cache = bt.cache.clone()
    write_kv_cache_ref(cache, bt.k, bt.v, bt.slots)
    return paged_decode_ref(bt.q, cache, bt.table, bt.seq_lens, bt.heads, bt.head, bt.scale, **kw), cache


def run_fused(bt: Batch, config: DecodeConfig, cache: torch.Tensor, plan: DecodePlan | None = None,
              **kw) -> torch.Tensor:
    plan = plan or DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, cache.shape[2], CPU,
                              config=config)
    out = torch.full_like(bt.q, float("nan"))
    paged_decode_launch(plan, bt.q, cache, out, bt.scale, kw.get("sliding_window"), kw.get("logits_soft_cap"),
                        new_kv=(bt.k, bt.v, bt.slots))
    if plan.counters is not None:
        assert not plan.counters.any(), "arrival counters not reset"
    return out


def check(bt: Batch, config: DecodeConfig, repeats: int = 1, **kw) -> None:
    ref, ref_cache = expected(bt, **kw)
    cache = bt.cache.clone()
    for _ in range(repeats):  # a second call: the counters start from 0 again, the slots already hold the tokens
        out = run_fused(bt, config, cache, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)


@pytest.mark.interpret
@pytest.mark.parametrize("form", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("kw", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_fused_forms_equal_the_references(splits, kw, form):
    """Contexts from none (the new token alone) to several splits' worth, a new token opening a block (context 4:
    with 2 or more splits, the last split's range is the new token alone), one at a block's end; repeated calls."""
    bt = new_batch([0, 5, 38, 7, 3, 4])
    check(bt, DecodeConfig(num_splits=splits, BLOCK_N=16, fused_merge=form[0], fused_write=form[1]), repeats=2, **kw)


@pytest.mark.interpret
@pytest.mark.parametrize("merge", [True, False], ids=["merge+write", "write"])
@pytest.mark.parametrize("kw", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("splits", [1, 2, 8])
def test_preloaded_first_chunk_equals_the_references(splits, kw, merge):
    """``DecodeConfig.preload`` (the split's first chunk read before the kernel's PDL wait, then the loop from the
    second): splits whose first chunk is their only one, holds only the new token, or nothing (empty splits)."""
    bt = new_batch([0, 5, 38, 7, 3, 4, 16])
    check(bt, DecodeConfig(num_splits=splits, BLOCK_N=8, fused_merge=merge, fused_write=True, preload=True),
          repeats=2, **kw)


def test_preload_takes_effect_with_the_fused_write_only():
    """Without the fused write a cache-write launch precedes the kernel and writes a slot its first chunk may hold:
    no preload there, whatever the config says."""
    bt = new_batch([5, 9])
    plan = DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 4, CPU,
                      config=DecodeConfig(num_splits=2, preload=True, **FUSED))
    assert plan.launches(False, False, False, True)[0].kwargs["PRELOAD"] is True
    assert plan.launches(False, False, False, False)[0].kwargs["PRELOAD"] is False


@pytest.mark.interpret
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("splits", [1, 4])
def test_page_16_gqa_and_a_head_size_no_power_of_two(splits, group):
    bt = new_batch([0, 15, 16, 46, 79], page=16, kv_heads=2, group=group, head=24, seed=group)
    for kw in ({}, {"sliding_window": 20}):
        check(bt, DecodeConfig(num_splits=splits, BLOCK_N=32, **FUSED), **kw)


@pytest.mark.interpret
@pytest.mark.parametrize("contexts", [[33], [3, 70, 12], [9, 0, 1, 2, 17, 64, 5, 40, 31]], ids=["b1", "b3", "b9"])
def test_several_batches_at_the_table_rule(contexts):
    """The table's own split count (None: the two-wave rule on the interpreter's 8 'SMs')."""
    bt = new_batch(contexts, seed=len(contexts))
    check(bt, DecodeConfig(BLOCK_N=16, **FUSED), repeats=2)
    check(bt, DecodeConfig(num_splits=8, BLOCK_N=16, **FUSED), **{"sliding_window": 9})


@pytest.mark.interpret
def test_layers_share_the_workspace_counters():
    """Two layers of one step (two caches, one workspace's counters and partials), twice, as the engine runs
    them; each call's results equal the references."""
    ws = DecodeWorkspace(8)
    bts = [new_batch([5, 38, 70], seed=s) for s in (1, 2)]
    cfg = DecodeConfig(num_splits=4, BLOCK_N=16, **FUSED)
    plans = [DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 4, CPU, config=cfg,
                        workspace=ws.get(bt.heads, bt.kv_heads, bt.head, CPU), counters=ws.counters(bt.kv_heads, CPU))
             for bt in bts]
    assert plans[0].counters is plans[1].counters and plans[0].fused_merge
    caches = [bt.cache.clone() for bt in bts]
    for _ in range(2):
        for bt, cache, plan in zip(bts, caches, plans):
            ref, ref_cache = expected(bt)
            torch.testing.assert_close(run_fused(bt, cfg, cache, plan), ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)


class _Counted:
    """A stand-in for a kernel's FastLaunch whose bound launches (the plan's) record their calls by name."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def bind(self, grid, args, **kwargs):
        return lambda *a, **k: self.calls.append(self.name)


def _count_launches(monkeypatch):
    calls = []
    for name in ("_decode_split_launch", "_decode_merge_launch"):
        monkeypatch.setattr(pa, name, _Counted(name, calls))
    monkeypatch.setattr(pa, "write_kv_cache_triton", lambda *a, **k: calls.append("write_kv_cache_triton"))
    return calls


@pytest.mark.parametrize("form", FORMS + [(False, False)], ids=FORM_IDS + ["three launches"])
def test_launches_of_each_form(form, monkeypatch):
    calls = _count_launches(monkeypatch)
    bt = new_batch([5, 38])
    cfg = DecodeConfig(num_splits=4, fused_merge=form[0], fused_write=form[1])
    plan = DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 4, CPU, config=cfg)
    paged_decode_launch(plan, bt.q, bt.cache, torch.empty_like(bt.q), bt.scale, new_kv=(bt.k, bt.v, bt.slots))
    want = ([] if form[1] else ["write_kv_cache_triton"]) + ["_decode_split_launch"] \
        + ([] if form[0] else ["_decode_merge_launch"])
    assert calls == want
    calls.clear()  # no new_kv: the cache already holds them, nothing written
    paged_decode_launch(plan, bt.q, bt.cache, torch.empty_like(bt.q), bt.scale)
    assert "write_kv_cache_triton" not in calls


def test_counters_are_never_allocated_under_capture(monkeypatch):
    """Inside a CUDA-graph capture (faked) a plan finds no counters and merges with the merge kernel; the
    workspace allocates none there (the zeroing would only be recorded), and does outside."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cuda = torch.device("cuda")
    assert pa._new_counters(16, cuda) is None
    ws = DecodeWorkspace(4)
    assert ws.counters(2, cuda) is None and not ws._buffers
    bt = new_batch([5, 38])
    scratch = torch.empty(1 << 16)
    cfg = DecodeConfig(num_splits=4, **FUSED)
    plan = DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 4, cuda, 4, workspace=scratch, config=cfg)
    assert plan.counters is None and not plan.fused_merge and plan.split_constexprs["FUSED_MERGE"] is False
    ok = torch.zeros(2 * bt.kv_heads, dtype=torch.int32)  # counters given (the workspace's): fused under capture
    plan = DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 4, cuda, 4, workspace=scratch, config=cfg,
                      counters=ok)
    assert plan.counters is ok and plan.fused_merge
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert ws.counters(2, CPU).tolist() == [0] * 8


def test_one_split_has_no_merge_and_no_counters():
    bt = new_batch([5])
    plan = DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 4, CPU, num_splits=1,
                      config=DecodeConfig(**FUSED))
    assert plan.counters is None and not plan.fused_merge and plan.fused_write


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", FORMS + [(False, False), (True, True, True)],
                         ids=FORM_IDS + ["three launches", "merge+write+preload"])
@pytest.mark.parametrize("num_seqs", [1, 3, 8, 32, 128])
def test_cuda_fused_forms_equal_the_references(num_seqs, form, dtype):
    """On the GPU, where splits really race: every table split count (1 to 32 at 1 to 128 sequences), many
    launches in a row (each must find the counters at 0), eager and in a CUDA graph replayed several times; with
    the first chunk preloaded (``DecodeConfig.preload``) too."""
    gen = torch.Generator().manual_seed(num_seqs)
    contexts = torch.randint(0, 600, (num_seqs,), generator=gen).tolist()
    bt = new_batch(contexts, page=16, kv_heads=8, group=4, head=128, seed=num_seqs)
    bt = dataclasses.replace(bt, **{f: getattr(bt, f).to("cuda", dtype) for f in ("q", "cache", "k", "v")},
                             **{f: getattr(bt, f).cuda() for f in ("table", "seq_lens", "slots")})
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    cfg = DecodeConfig(fused_merge=form[0], fused_write=form[1], preload=form[2:] == (True,))
    for kw in ({}, {"sliding_window": 37}, {"logits_soft_cap": 5.0}):
        ref, ref_cache = expected(bt, **kw)
        cache = bt.cache.clone()
        plan = DecodePlan(bt.table, bt.seq_lens, bt.heads, bt.kv_heads, bt.head, 16, bt.q.device, config=cfg)
        for _ in range(20):
            out = run_fused(bt, cfg, cache, plan, **kw)
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
        graph, out = torch.cuda.CUDAGraph(), torch.empty_like(bt.q)
        with torch.cuda.graph(graph):
            paged_decode_launch(plan, bt.q, cache, out, bt.scale, kw.get("sliding_window"), kw.get("logits_soft_cap"),
                                new_kv=(bt.k, bt.v, bt.slots))
        for _ in range(10):
            out.zero_()
            graph.replay()
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
        assert plan.counters is None or not plan.counters.any()
