"""ops.paged_decode_config: the decode kernel's config table, and every config path of the kernel.

The table's lookup and the split rule run anywhere; the kernel under each config (every table row's, and one
of each kind the sweep of ``benchmarks.attention`` tries) runs on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``, the ``interpret`` marker), against the fp32 reference. The interpreter ignores
num_warps and num_stages: those are the CUDA tests' and the sweep's business.
"""

import dataclasses
import importlib

import pytest
import torch
from test_paged_attention import HEAD, HEADS, KV_HEADS, SCALE, TOLERANCES, decode_batch

import ops
from ops.paged_attention import DecodePlan, decode_num_splits, decode_workspace_numel
from ops.paged_decode_config import DECODE_TABLE, DecodeConfig, decode_config
from ops.triton_utils import BoundLaunch

CPU = torch.device("cpu")  # 8 SMs for the split rule off CUDA (ops.paged_attention._num_sms)


def test_table_covers_every_batch_and_head_size():
    assert DECODE_TABLE[-1].max_seqs >= 1 << 20 and DECODE_TABLE[-1].max_head_size >= 1 << 20
    for b in (1, 7, 8, 32, 128, 256, 4096):
        for d in (64, 128, 256):
            cfg = decode_config(b, d)
            rule = next(r for r in DECODE_TABLE if b <= r.max_seqs and d <= r.max_head_size)
            assert cfg is rule.config


def test_measured_rows_pick_splits_by_batch():
    """Head sizes <= 128 (Llama's 8 KV heads, an H200's 132 SMs): 16 splits at batch 1, 8 up to batch 8, then one
    wave of programs (2 splits at 9-16 sequences, 1 from 17); larger heads keep the two-wave rule before the table;
    the fused forms (one launch a layer) up to 8 sequences, the fused write up to 32."""
    for b, want in [(1, 16), (2, 8), (8, 8), (9, 2), (16, 2), (17, 1), (32, 1), (128, 1), (256, 1)]:
        assert decode_config(b, 128).splits(b, 8, 132) == want, b
    for b, want in [(1, 32), (32, 2), (128, 1)]:
        assert decode_config(b, 256).splits(b, 8, 132) == want
    assert decode_config(1, 256).BLOCK_N == 32 and decode_config(32, 128).BLOCK_N == 128
    # one launch a layer up to 8 sequences (fused merge and write), the write fused up to 32, unfused above
    for b, merge, write in [(1, True, True), (8, True, True), (9, False, True), (32, False, True),
                            (33, False, False), (128, False, False)]:
        cfg = decode_config(b, 128)
        assert (cfg.fused_merge, cfg.fused_write) == (merge, write), b
    assert not decode_config(1, 256).fused_merge
    # Llama-3.2-1B's 64-size heads: the 128-size rows but at 2-8 sequences and 65-128 (one split, 32-token steps on 2
    # warps, the write fused); 33-64 and past 128 the 128-size row
    for b in (33, 64, 129, 512):
        assert decode_config(b, 64) == decode_config(b, 128), b
    for b in (65, 128):
        cfg = decode_config(b, 64)
        assert (cfg.splits(b, 8, 132), cfg.BLOCK_N, cfg.num_warps, cfg.fused_write) == (1, 32, 2, True), b


def test_config_validation_and_fixed_splits():
    assert DecodeConfig(num_splits=4).splits(128, 8, 132) == 4
    for bad in (dict(num_splits=3), dict(BLOCK_N=48), dict(num_warps=3), dict(num_stages=0), dict(waves=0),
                dict(max_splits=6), dict(merge_warps=0)):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)


def test_plan_takes_the_config():
    table = torch.zeros(3, 4, dtype=torch.int32)
    lens = torch.ones(3, dtype=torch.int32)
    cfg = DecodeConfig(num_splits=4, BLOCK_N=16, num_warps=8, num_stages=2, merge_warps=2)
    plan = DecodePlan(table, lens, HEADS, KV_HEADS, HEAD, 32, CPU, config=cfg)
    assert plan.num_splits == 4 and plan.split_grid == (3, KV_HEADS, 4)
    c = plan.split_constexprs
    assert (c["BLOCK_N"], c["num_warps"], c["num_stages"], c["SPLIT"]) == (32, 8, 2, True)  # BLOCK_N >= page
    assert plan.merge_constexprs["num_warps"] == 2 and plan.merge_constexprs["NUM_SPLITS"] == 4
    plan = DecodePlan(table, lens, HEADS, KV_HEADS, HEAD, 32, CPU, config=dataclasses.replace(cfg, heads_first=True))
    assert plan.split_grid == (KV_HEADS, 3, 4) and plan.heads_first == 1
    plan = DecodePlan(table, lens, HEADS, KV_HEADS, HEAD, 4, CPU, num_splits=1, config=cfg)  # the argument wins
    assert plan.num_splits == 1 and not plan.split_constexprs["SPLIT"] and plan.mid_o is None


def test_workspace_covers_the_table_splits():
    n = decode_workspace_numel(16, HEADS, KV_HEADS, HEAD, CPU)
    most = max(b * decode_num_splits(b, KV_HEADS, CPU, HEAD) for b in range(1, 17)
               if decode_num_splits(b, KV_HEADS, CPU, HEAD) > 1)
    assert n == most * HEADS * (HEAD + 1)


# One of each kind: the table's rows, and BLOCK_N from one page to several, fixed split counts, another wave count.
KERNEL_CONFIGS = [r.config for r in DECODE_TABLE] + [
    DecodeConfig(num_splits=1, BLOCK_N=16), DecodeConfig(num_splits=2, BLOCK_N=32, num_warps=8, num_stages=4),
    DecodeConfig(num_splits=8, BLOCK_N=128, num_warps=2, num_stages=1), DecodeConfig(waves=4, BLOCK_N=16),
    DecodeConfig(num_splits=1, heads_first=True), DecodeConfig(num_splits=4, BLOCK_N=16, heads_first=True),
]


@pytest.mark.interpret
@pytest.mark.parametrize("config", KERNEL_CONFIGS, ids=str)
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 7}], ids=["plain", "window"])
def test_every_config_matches_the_reference(config, kw):
    q, cache, table, seq_lens = decode_batch([0, 5, 38, 70, 3])
    out = ops.paged_decode_triton(q, cache, table, seq_lens, HEADS, HEAD, SCALE, config=config, **kw)
    ref = ops.paged_decode_ref(q, cache, table, seq_lens, HEADS, HEAD, SCALE, **kw)
    tol = TOLERANCES[torch.float32]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.interpret
@pytest.mark.parametrize("block_n", [16, 32])
def test_library_page_size(block_n):
    """16-token pages (the engine's default), a chunk of one page or two, a head size that is no power of two."""
    g = torch.Generator().manual_seed(block_n)
    page, hkv, group, d, lens = 16, 2, 4, 24, [1, 16, 17, 47, 80]
    blocks = (max(lens) + page - 1) // page
    cache = torch.randn(2, len(lens) * blocks, page, hkv, d, generator=g)
    table = torch.randperm(len(lens) * blocks, generator=g).view(len(lens), blocks).to(torch.int32)
    q = torch.randn(len(lens), hkv * group * d, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    for splits in (1, 4):
        cfg = DecodeConfig(num_splits=splits, BLOCK_N=block_n)
        out = ops.paged_decode_triton(q, cache, table, seq_lens, hkv * group, d, d**-0.5, config=cfg)
        ref = ops.paged_decode_ref(q, cache, table, seq_lens, hkv * group, d, d**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_compile_only_passes_the_launch_arguments_to_warmup(monkeypatch):
    """``compile_only`` gives Triton's ``warmup`` exactly what the launchers get (so the compiled kernels are the
    ones the launches then look up), and launches nothing."""
    pa = importlib.import_module("ops.paged_attention")
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        _usable = False  # a FastLaunch whose bound launches (the plan's) go through __call__ whole

        def __call__(self, grid, *args, **kwargs):  # a FastLaunch
            calls.append(("launch", self.name, grid, args, kwargs))

        def bind(self, grid, args, **kwargs):
            return BoundLaunch(self, grid, tuple(args), kwargs)

        def warmup(self, *args, grid, **kwargs):  # a JITFunction's warmup
            calls.append(("warmup", self.name, grid, args, kwargs))

    for name in ("split", "merge"):
        monkeypatch.setattr(pa, f"_decode_{name}_launch", Recorder(name))
        monkeypatch.setattr(pa, f"_decode_{name}_kernel", Recorder(name))
    q, cache, table, seq_lens = decode_batch([5, 38])
    plan = DecodePlan(table, seq_lens, HEADS, KV_HEADS, HEAD, cache.shape[2], CPU,
                      config=DecodeConfig(num_splits=4, fused_merge=False))
    out = torch.empty_like(q)
    pa.paged_decode_launch(plan, q, cache, out, SCALE, 7, None)
    pa.paged_decode_launch(plan, q, cache, out, SCALE, 7, None, compile_only=True)
    assert [c[:2] for c in calls] == [("launch", "split"), ("launch", "merge"), ("warmup", "split"), ("warmup", "merge")]
    for launched, warmed in zip(calls[:2], calls[2:]):
        assert launched[2:] == warmed[2:]
    calls.clear()  # the fused merge: the split kernel alone
    plan = DecodePlan(table, seq_lens, HEADS, KV_HEADS, HEAD, cache.shape[2], CPU,
                      config=DecodeConfig(num_splits=4, fused_merge=True))
    pa.paged_decode_launch(plan, q, cache, out, SCALE, 7, None)
    pa.paged_decode_launch(plan, q, cache, out, SCALE, 7, None, compile_only=True)
    assert [c[:2] for c in calls] == [("launch", "split"), ("warmup", "split")] and calls[0][2:] == calls[1][2:]


def test_config_fields_from_text():
    """A benchmark's ``FIELD=VALUE,...`` as DecodeConfig's fields, each of its type; a bad item named."""
    from ops.paged_decode_config import config_fields

    fields = config_fields("num_stages=4,BLOCK_N=64,heads_first=0,num_splits=none")
    assert fields == {"num_stages": 4, "BLOCK_N": 64, "heads_first": False, "num_splits": None}
    assert dataclasses.replace(decode_config(32, 128), **fields).num_stages == 4
    for bad, says in [("num_stages", "FIELD=VALUE"), ("", "FIELD=VALUE"), ("waves=none", "non-negative integer"),
                      ("pdl=2", "0 or 1"), ("splits=4", "must be one of num_splits")]:
        with pytest.raises(ValueError, match=says):
            config_fields(bad)
