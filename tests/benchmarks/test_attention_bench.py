"""benchmarks.attention without a GPU: the sweep's candidates are valid and bounded, its summaries pick what they
say, and (in Triton's interpreter) a case's plans run every candidate kind to the reference's result."""

import pytest
import torch

from benchmarks import attention as A
from ops.paged_decode_config import DecodeConfig

H200_SMS = 132


def test_candidates_are_valid_and_bounded():
    total = 0
    for b in (1, 8, 32, 128):
        cands = A.sweep_candidates(b, H200_SMS)
        splits = sorted({c.num_splits for c in cands})
        assert splits and all(1 <= s <= 32 for s in splits)
        assert DecodeConfig(waves=2).splits(b, A.KV_HEADS, H200_SMS) in splits  # the table's own count
        assert len(set(cands)) == len(cands)
        total += len(cands)
    assert total <= 450  # a shape's candidates x 4 contexts must fit the sweep's deadline
    assert A.sweep_splits(128, H200_SMS) == [1, 2, 4] and A.sweep_splits(32, H200_SMS) == [1, 2, 4, 8]


def _row(b, ctx, us, splits=2, bn=64, table=False, correct=True):
    cfg = DecodeConfig(num_splits=splits, BLOCK_N=bn)
    return {"batch": b, "context": ctx, **cfg.__dict__, "us": us, "pct_of_copy_bw": 0.0, "correct": correct,
            "table": table}


def test_best_and_suggested_rows():
    rows = [_row(32, 512, 10.0, table=True), _row(32, 512, 8.0, bn=32), _row(32, 512, 5.0, bn=16, correct=False),
            _row(32, 4096, 50.0, table=True), _row(32, 4096, 60.0, bn=32)]
    best = A.best_rows(rows)
    assert [(r["context"], r["BLOCK_N"], r["us"], r["table_us"]) for r in best] == [(512, 32, 8.0, 10.0),
                                                                                   (4096, 64, 50.0, 50.0)]
    assert best[0]["gain_vs_table"] == 1.25
    (line,) = A.suggested_rows(rows)
    # BLOCK_N 64: losses 1.25 and 1.0 (geomean 1.118) against BLOCK_N 32: 1.0 and 1.2 (1.095): 32 wins
    assert "_R(32, 128, _C(num_splits=2, BLOCK_N=32" in line and "1.200x at worst" in line


def test_byte_counts():
    assert A.kv_bytes(128, 512) == 128 * 512 * 8 * 128 * 2 * 2  # 268 MB a layer; 8.6 GB over 32 layers
    assert A.io_bytes(1, 512) == A.kv_bytes(1, 512) + 2 * 32 * 128 * 2


@pytest.mark.interpret
def test_case_runs_every_candidate_kind_in_the_interpreter(monkeypatch):
    """A shrunk case (2 KV heads of 16, 2 copies) through the benchmark's plans, one config of each split count
    and BLOCK_N, against the reference as the benchmark checks it."""
    monkeypatch.setattr(A, "HEADS", 4)
    monkeypatch.setattr(A, "KV_HEADS", 2)
    monkeypatch.setattr(A, "HEAD", 16)
    monkeypatch.setattr(A, "DTYPE", torch.float32)
    monkeypatch.setattr(A, "MAX_COPIES", 2)
    case = A.make_case(3, 48, "cpu")
    assert case.copies == 2 and len(case.tables) == 2
    ref = A.reference(case)
    for cfg in {DecodeConfig(num_splits=c.num_splits, BLOCK_N=c.BLOCK_N) for c in A.sweep_candidates(8, 8)}:
        for plan in A.plans(case, cfg):
            A.paged_decode_launch(plan, case.q, case.cache, case.out, A.SCALE)
        tables_ref = A.paged_decode_ref(case.q, case.cache, case.tables[1], case.seq_lens, 4, 16, A.SCALE)
        torch.testing.assert_close(case.out, tables_ref, rtol=1e-5, atol=1e-5)
    A.paged_decode_launch(A.plans(case, None)[0], case.q, case.cache, case.out, A.SCALE)
    torch.testing.assert_close(case.out, ref, rtol=1e-5, atol=1e-5)
    # As the benchmark times a call: the new tokens written too (copy 0's cache left as it was), in every form.
    before = case.cache.clone()
    for form in ({}, *A.FORMS):
        case.out.fill_(float("nan"))
        A.call(case, A.plans(case, DecodeConfig(num_splits=4, BLOCK_N=16, **form))[0], case.slots[0])
        torch.testing.assert_close(case.out, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(case.cache, before) and not case.counters.any()


def test_sweep_flow_writes_its_files(monkeypatch, tmp_path, capsys):
    """The whole ``--sweep`` flow on CPU with the GPU parts faked (no compile, a made-up time per config): every
    candidate of every shape is measured, the fastest again heads first, and the files and table rows come out."""
    import types

    monkeypatch.setattr(A, "HEADS", 4)
    monkeypatch.setattr(A, "KV_HEADS", 2)
    monkeypatch.setattr(A, "HEAD", 16)
    monkeypatch.setattr(A, "DTYPE", torch.float32)
    monkeypatch.setattr(A, "MAX_COPIES", 2)
    monkeypatch.setattr(A.torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=8))
    monkeypatch.setattr(A, "paged_decode_launch", lambda *a, **k: None)

    def fake_time(case, cfg, replays, ref):  # BLOCK_N 32, heads first, fewest splits: fastest
        return 10.0 + abs(cfg.BLOCK_N - 32) / 16 + cfg.num_splits / 8 - cfg.heads_first + cfg.num_warps / 100, True, 1

    monkeypatch.setattr(A, "time_config", fake_time)
    A.sweep([1, 4], [32, 64], "cpu", 1000.0, 2, 60.0, str(tmp_path), 1)
    rows = read_rows(tmp_path / "attention_sweep.csv")
    per_shape = {(b, c): len(A.sweep_candidates(b, 8)) + A.TOP_FLIPPED * len(A.FORMS) for b in (1, 4) for c in (32, 64)}
    assert len(rows) == sum(per_shape.values())
    best = read_rows(tmp_path / "attention_sweep_best.csv")
    assert len(best) == 4 and all(r["BLOCK_N"] == "32" and r["heads_first"] == "True" for r in best)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("best _R(")]
    assert len(lines) == 2 and "BLOCK_N=32" in lines[0] and "heads_first=True" in lines[0]


def test_splits_flag_sets_the_sweeps_split_counts(monkeypatch, capsys):
    """``--splits 1,2,4``: every batch's candidates take those counts (the table's batch-1 row has 16; the rule's
    candidates start at 8); a count outside 1-32 is a one-line parser error naming the flag."""
    monkeypatch.setattr(A, "SWEEP_SPLITS", None)
    assert min(A.sweep_splits(1, H200_SMS)) == 8
    with pytest.raises(SystemExit):  # past the flags, the CPU machine stops at the CUDA check
        A.main(["--splits", "1,2,4", "--sweep"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert A.sweep_splits(1, H200_SMS) == A.sweep_splits(128, H200_SMS) == [1, 2, 4]
    assert {c.num_splits for c in A.sweep_candidates(8, H200_SMS)} == {1, 2, 4}
    for bad in ("0,2", "40"):
        with pytest.raises(SystemExit) as e:
            A.main(["--splits", bad])
        assert e.value.code == 2 and "--splits" in capsys.readouterr().err


def read_rows(path):
    import csv

    with open(path) as f:
        return list(csv.DictReader(ln for ln in f if not ln.startswith("#")))


@pytest.mark.interpret
@pytest.mark.parametrize("form", [0, 1, 2])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn], ids=["fp32", "fp8"])
def test_operand_orders_compute_the_reference_attention(form, cache_dtype):
    """benchmarks.attention_operands' kernel, each of its dot orders, against ops.paged_decode_ref (fp32 q: the
    interpreter's half-precision dots are wrong), sequences shorter and longer than a key tile, pages scattered."""
    from benchmarks import attention_operands as O
    from ops.paged_attention import paged_decode_ref

    g = torch.Generator().manual_seed(form)
    seq_lens = torch.tensor([5, 70], dtype=torch.int32)
    per_seq = 5
    cache = torch.randn(2, 2 * per_seq, O.PAGE, O.KV_HEADS, O.D, generator=g).to(cache_dtype)
    table = torch.randperm(2 * per_seq, generator=g).to(torch.int32).view(2, per_seq)
    q = torch.randn(2, O.HEADS * O.D, generator=g)
    out = torch.full_like(q, float("nan"))
    O.run(form, q, cache, table, seq_lens, out, 64, 4, 2)
    ref = paged_decode_ref(q, cache, table, seq_lens, O.HEADS, O.D, O.D**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_table_rows_carry_the_same_bytes_copy_beside_the_kernel(tmp_path):
    """On a GPU: each shape's row has the table's kernel and a copy moving the same bytes, both timed in the one
    harness, as % of the large copy's bandwidth; the files are written."""
    A.main(["--batches", "1,8", "--contexts", "512", "--replays", "3", "--out", str(tmp_path)])
    rows = read_rows(tmp_path / "attention.csv")
    assert [(r["batch"], r["context"]) for r in rows] == [("1", "512"), ("8", "512")]
    for r in rows:
        assert r["correct"] == "True" and float(r["us"]) > 0 and float(r["copy_us"]) > 0
        assert 0 < float(r["copy_pct_of_copy_bw"]) < 120  # from HBM (copies past the L2), near or below the copy's
    # the larger call moves 8x the bytes: its copy takes longer, at a larger share of the bandwidth
    assert float(rows[1]["copy_us"]) > float(rows[0]["copy_us"])
    assert float(rows[1]["copy_pct_of_copy_bw"]) > float(rows[0]["copy_pct_of_copy_bw"])
