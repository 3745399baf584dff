"""The benchmark harnesses run end to end on the CPU and leave the table, CSV and plot they promise.

Timings on 2 shared CPU cores say nothing, so nothing here compares them; what is checked is that each
script measures every mode it names, checks its results where it claims to, and writes its files.
"""

import csv
import dataclasses
import os

import pytest
import torch

from benchmarks import common, decode, guard_overhead, runner_host, serve, tp_decode


def read_csv(path):
    with open(path) as f:
        lines = [ln for ln in f if not ln.startswith("#")]
    return list(csv.DictReader(lines))


def assert_png(path):
    """``path`` is a PNG written, unless matplotlib is missing (then the benchmark writes none)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert os.path.getsize(path) > 0


def test_results_state_device_torch_and_date(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_FP8_FAST_ACCUM", "1")
    monkeypatch.setenv("DYNAMO_ONCE_API_KEY", "secret")
    md = common.write_results("t", [{"a": 1, "b": 2.5}], title="T", out_dir=str(tmp_path))
    header = md.splitlines()[2]
    assert f"torch {torch.__version__}" in header and "UTC" in header
    # the library's switches set for the run, so that a figure says which paths it measured; never the API key
    assert ", DYNAMO_ONCE_FP8_FAST_ACCUM=1" in header and "API_KEY" not in md and "secret" not in md
    with open(tmp_path / "t.csv") as f:
        assert f.readline().startswith("# ") and f.readline().strip() == "a,b"


def test_results_read_back_with_their_types(tmp_path):
    """``read_results``: a saved CSV's environment line and rows, each cell as the type it was written from."""
    rows = [{"a": 1, "b": 2.5, "c": True, "d": "x", "e": ""}, {"a": 2, "b": 0.1, "c": False, "d": "y z", "e": 3}]
    common.write_results("t", rows, title="T", out_dir=str(tmp_path))
    header, back = common.read_results(str(tmp_path / "t.csv"))
    assert f"torch {torch.__version__}" in header and back == rows


@pytest.mark.slow
def test_guard_overhead_measures_every_mechanism(tmp_path):
    rows = guard_overhead.run("cpu", [1], calls=20, repeats=2, out_dir=str(tmp_path))
    assert {r["mechanism"] for r in rows} == set(guard_overhead.MECHANISMS)
    floor = next(r for r in rows if r["mechanism"] == "floor")
    assert floor["overhead_over_floor_us"] == 0.0
    assert all(r["us_per_call"] > 0 for r in rows)
    for ext in ("csv", "md", "png"):
        assert (tmp_path / f"guard_overhead_cpu.{ext}").stat().st_size > 0


@pytest.mark.slow
def test_decode_quick_writes_every_mode_and_the_end_to_end_step(tmp_path):
    decode.main(["--quick", "--generate", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "decode_quick_tiny-llama.csv")
    modes = {r["mode"] for r in rows}
    assert {"eager", "level 1", "level 3", "LLM.generate, level 3", "LLM.generate, level 3, async"} <= modes
    assert {int(r["batch"]) for r in rows} == {2, 4}
    assert all(float(r["us_per_step"]) > 0 for r in rows)
    prefill = read_csv(tmp_path / "prefill_quick_tiny-llama.csv")
    assert {r["mode"] for r in prefill} == {"eager", "level 1", "level 3"}
    assert os.path.getsize(tmp_path / "decode_quick_tiny-llama.png") > 0


@pytest.mark.slow
def test_decode_rounds_times_every_mode_in_every_round(tmp_path):
    """--rounds: each mode's row at each batch size has one time a round, its us_per_step their median."""
    decode.main(["--quick", "--modes", "eager,level 3", "--rounds", "3", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "decode_quick_tiny-llama_interleaved.csv")
    assert {(r["mode"], int(r["batch"])) for r in rows} == {(m, b) for m in ("eager", "level 3") for b in (2, 4)}
    for r in rows:
        rounds = sorted(float(u) for u in r["rounds_us"].split("/"))
        assert len(rounds) == 3 and float(r["us_per_step"]) == pytest.approx(rounds[1], abs=0.051)
        first = next(f for f in rows if f["mode"] == "eager" and f["batch"] == r["batch"])
        paired = sorted(float(u) / float(f) for u, f in zip(r["rounds_us"].split("/"), first["rounds_us"].split("/")))
        assert float(r["vs_first_mode"]) == pytest.approx(paired[1], abs=0.002)
        assert r["mode"] != "eager" or float(r["vs_first_mode"]) == 1.0
    prefill = read_csv(tmp_path / "prefill_quick_tiny-llama_interleaved.csv")
    assert {r["mode"] for r in prefill} == {"eager", "level 3"}
    assert all(len(r["rounds_ms"].split("/")) == 3 for r in prefill)


@pytest.mark.parametrize("args, words", [
    (["--modes", "level 3,reduce-overhead", "--rounds", "2"], ["--rounds", "reduce-overhead"]),
    (["--modes", "level 3", "--rounds", "0"], ["rounds", ">= 1", "0"]),
    (["--modes", "level 3", "--clocks"], ["--clocks", "--rounds", "got no --rounds"]),
    (["--modes", "level 3", "--rounds", "2", "--clocks"], ["--clocks", "NVML", "got --quick"]),
])
def test_decode_rounds_rejects_what_it_cannot_interleave_in_one_line(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        decode.main(["--quick", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert all(w in err for w in words), err


@pytest.mark.slow
def test_tp_decode_quick_measures_both_sizes_and_writes_its_files(tmp_path):
    """TP 1 and 2 (gloo on the CPU): a decode step per batch size and the prefill, each size its own LLM."""
    rows = tp_decode.main(["--quick", "--out", str(tmp_path)])
    assert [(r["tp"], r["what"].split()[0], r["batch"]) for r in rows] == [
        (tp, what, b) for tp in (1, 2) for what, b in (("decode", 1), ("decode", 4), ("prefill", 1))]
    assert all(r["us"] > 0 for r in rows)
    assert len(read_csv(tmp_path / "tp_decode_quick.csv")) == 6
    assert_png(tmp_path / "tp_decode_quick.png")


@pytest.mark.slow
def test_tp_decode_sp_measures_the_prefill_with_and_without_the_rewrite(tmp_path, monkeypatch):
    """``--sp``: TP=2's prefill alone, plain and rewritten, split at attention or one graph; the rewrite ran.
    (Three of the five variants: the other two differ from these by an environment variable only.)"""
    from dispatcher import compat
    from dispatcher.passes import pass_counter

    variants = ["plain", "sp", "sp, one graph"]
    for name in ("DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS", "DYNAMO_ONCE_ASYNC_TP"):  # restored after the test
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", "1")  # every compile runs its passes
    with compat.fresh_inductor_cache(), pass_counter.record() as counts:  # every compile runs its passes
        rows = tp_decode.main(["--quick", "--sp", "--tp", "2", "--variants", ";".join(variants),
                               "--out", str(tmp_path)])
    assert [(r["tp"], r["variant"], r["what"].split()[0]) for r in rows] == [
        (2, v, "prefill") for v in variants]
    assert all(r["us"] > 0 for r in rows)
    assert counts.matches["sequence_parallel"] == 2 * 4  # tiny-llama: 4 sites in each rewritten 64-token compile
    assert [r["sp_rewrites"] for r in rows] == [0, 4, 4]
    assert len(read_csv(tmp_path / "tp_decode_sp_quick.csv")) == 3
    assert_png(tmp_path / "tp_decode_sp_quick.png")
    with pytest.raises(SystemExit):
        tp_decode.main(["--quick", "--sp", "--variants", "fast"])


def test_tp_decode_refuses_bad_sizes():
    with pytest.raises(SystemExit):
        tp_decode.main(["--tp", "1,x"])


def test_serve_quick_compares_served_with_offline_and_writes_its_files(tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    rows = serve.main(["--quick", "--out", str(tmp_path)])
    assert [(r["concurrency"], r["metric"]) for r in rows] == [(1, "ms/token"), (4, "tokens/s")]
    assert all(r["served"] > 0 and r["offline"] > 0 for r in rows)
    assert len(read_csv(tmp_path / "serve_quick.csv")) == 2
    assert os.path.getsize(tmp_path / "serve_quick.png") > 0


def test_serve_step_profile_writes_each_side_and_phase(tmp_path):
    """--step-profile: per concurrency > 1, served and offline rows for arrival, middle, end and all; the phases'
    steps add up to all's, and the served batch's loop CPU a request is there (its event loop parsed them)."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    serve.main(["--quick", "--step-profile", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "serve_steps_quick.csv")
    assert [(r["concurrency"], r["side"], r["phase"]) for r in rows] == [
        ("4", side, phase) for side in ("offline", "served") for phase in ("arrival", "middle", "end", "all")]
    for side in (rows[:4], rows[4:]):
        assert sum(int(r["steps"]) for r in side[:3]) == int(side[3]["steps"]) > 0
        assert float(side[3]["cpu_ms"]) > 0 and float(side[3]["wall_ms"]) >= float(side[3]["median_step_ms"])
    assert rows[0]["steps"] == "0"  # offline: every request in before the first step
    assert float(rows[-1]["loop_us_per_req"]) > 0
    assert (tmp_path / "serve_steps_quick.md").read_text().startswith("# Engine steps served against offline")
    assert_png(tmp_path / "serve_steps_quick.png")


def test_serve_steps_phases_and_sums():
    """Phases by time: arrival before the last arrival, end after the first step that ended a request; the gap
    and the loop's CPU in it go to the step before it."""
    from benchmarks.serve_steps import Step, summary

    steps = [Step(0.0, 0.001, 0.0005, 0.0, 0.0002, 0), Step(0.002, 0.001, 0.001, 0.0003, 0.0003, 0),
             Step(0.004, 0.001, 0.001, 0.0003, 0.0003, 2), Step(0.006, 0.002, 0.001, 0.0004, 0.0010, 2)]
    rows = {r["phase"]: r for r in summary(steps, 0.001, side="served")}
    assert [rows[p]["steps"] for p in ("arrival", "middle", "end", "all")] == [1, 2, 1, 4]
    assert rows["arrival"]["wait_ms"] == 0.5 and rows["arrival"]["gap_ms"] == 1.0
    assert rows["arrival"]["loop_step_ms"] == 0.2 and rows["arrival"]["loop_gap_ms"] == 0.1
    assert rows["end"]["gap_ms"] == 0.0 and rows["end"]["loop_step_ms"] == 0.6
    assert rows["all"]["wall_ms"] == 5.0 and rows["all"]["side"] == "served"
    assert [r["steps"] for r in summary(steps, None)] == [0, 3, 1, 4]


@pytest.mark.slow
def test_bench_ops_checks_ours_against_the_reference(tmp_path):
    from benchmarks import bench_ops

    rows, _ = bench_ops.run([1, 16], [256], ["rms_norm", "static_scaled_fp8_quant"], "cpu", torch.bfloat16,
                            dynamic_column=False)
    assert len(rows) == 4 and all(r["correct"] for r in rows)
    fp8 = [r for r in rows if r["op"] == "static_scaled_fp8_quant"]
    assert all(r["compile_exact"] is True for r in fp8)  # Inductor's C++ division on the CPU is exact
    assert all(r["compile_exact"] == "" for r in rows if r["op"] == "rms_norm")
    if bench_ops.division_rounding_option():  # the exact comparator, timed and checked
        assert all(r["compile_rn_exact"] is True and r["compile_rn_us"] > 0 for r in fp8)
    lines = bench_ops.targets(rows, copy_gbps=1.0)
    assert sum(ln.startswith(("PASS latency", "MISS latency")) for ln in lines) == 4
    assert lines[-1] == "PASS correctness: all"


@pytest.mark.slow
def test_runner_host_measures_every_batch_and_writes_its_files(tmp_path):
    rows = runner_host.run([1, 4], new_tokens=6, repeats=1, out_dir=str(tmp_path))
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["host_us_per_decode_step"] > 0 and r["runner"] == "this checkout" for r in rows)
    for ext in ("csv", "md", "png"):
        assert (tmp_path / f"runner_host.{ext}").stat().st_size > 0


def test_results_are_written_only_where_asked(tmp_path, monkeypatch, capsys):
    """Without out_dir a table is printed and no file is written (no results in an installed tree)."""
    monkeypatch.chdir(tmp_path)
    md = common.write_results("nowhere", [{"a": 1}], title="T")
    assert "| a |" in capsys.readouterr().out and md.startswith("# T")
    assert common.plot_lines("nowhere", [{"x": 1, "y": 2, "s": "a"}], x="x", y="y", series="s") is None
    assert list(tmp_path.iterdir()) == []


def test_startup_plot_stacks_the_phases(tmp_path):
    """A start-up's bar is its phases stacked, the rest to the first token as ``other_s``; a PNG only when asked."""
    from benchmarks.decode import plot_startup

    row = dict(model="m", caches="warm", import_s=1.0, load_s=0.5, trace_s=0.25, compile_s=2.0, capture_s=1.0,
               first_token_s=5.0)
    assert plot_startup("s", [row], None) is None
    path = plot_startup("s", [row], str(tmp_path))
    if path is None:
        pytest.skip("matplotlib is not installed")
    assert path == str(tmp_path / "s.png") and (tmp_path / "s.png").stat().st_size > 0


def test_all_reduce_plot_draws_each_algorithm_against_tokens(tmp_path):
    """The two-GPU benchmark's plot, on made-up rows (strings too, as read back from its CSV); only when asked."""
    from benchmarks import all_reduce

    rows = [dict(tokens=t, hidden=4096, kib=t * 8, nccl_us=8.0 + t / 64, one_shot_us=7.0 + t / 16,
                 two_shot_us="10.5", best="one_shot") for t in (1, 64, 512)]
    assert all_reduce.plot(rows, None) is None
    path = all_reduce.plot(rows, str(tmp_path))
    if path is None:
        pytest.skip("matplotlib is not installed")
    assert path == str(tmp_path / "all_reduce.png") and os.path.getsize(path) > 0


def test_tp_decode_plots_decode_steps_and_sp_variants(tmp_path):
    """tp_decode's plots on made-up rows: decode steps against the batch per TP size, and --sp's bars."""
    rows = [dict(model="m", tp=tp, what="decode step", batch=b, us=100.0 * b / tp, start_s=1.0)
            for tp in (1, 2) for b in (1, 8)]
    rows.append(dict(model="m", tp=1, what="prefill 64 (generate, 1 token)", batch=1, us=5000.0, start_s=1.0))
    sp_rows = [dict(model="m", tp=2, variant=v, sp_rewrites=4, what="prefill 64 (generate, 1 token)", batch=1,
                    us=us, start_s=1.0) for v, us in (("plain", 3000.0), ("sp", 2500.0))]
    assert tp_decode.plot("t", rows, False, None) is None
    paths = [tp_decode.plot("t", rows, False, str(tmp_path)), tp_decode.plot("t_sp", sp_rows, True, str(tmp_path))]
    if paths[0] is None:
        pytest.skip("matplotlib is not installed")
    assert all(os.path.getsize(p) > 0 for p in paths)


def test_serve_steps_plot_draws_each_side_by_phase(tmp_path):
    from benchmarks import serve_steps

    rows = [dict(model="m", concurrency=4, side=side, phase=phase, wait_ms=1.5, loop_step_ms=0.5, loop_gap_ms=0.2)
            for side in ("offline", "served") for phase in serve_steps.PHASES]
    assert serve_steps.plot("steps", rows, None) is None
    path = serve_steps.plot("steps", rows, str(tmp_path))
    if path is None:
        pytest.skip("matplotlib is not installed")
    assert os.path.getsize(path) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_piecewise_step_refuses_without_a_gpu(capsys):
    from benchmarks import piecewise_step

    with pytest.raises(SystemExit) as e:
        piecewise_step.main(["--batches", "1"])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_decode_floor_counts_weights_and_every_cached_token():
    """The floor of a decode step reads every weight once plus K and V of every cached token of every layer."""
    from models import KVCache, attention_layers, load_model

    model = load_model("tiny-llama", dtype=torch.bfloat16)
    cache = KVCache(attention_layers(model), 256, 16, dtype=torch.bfloat16)
    cfg = model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    assert decode._kv_bytes_per_token(cache) == per_token
    table = cfg.vocab_size * cfg.hidden_size * 2  # the input embedding: a lookup reads a row a sequence
    weights = sum(p.numel() * 2 for p in model.parameters()) - table
    row = cfg.hidden_size * 2
    floor = decode.Floor(decode._weight_bytes(model), decode._kv_bytes_per_token(cache), 1.0, decode._row_bytes(model))
    assert floor.us(1, 0) == pytest.approx((weights + per_token + row) / 1e3)  # 1 GB/s: bytes / 1000 = µs
    assert floor.us(8, 511) - floor.us(1, 511) == pytest.approx(7 * (512 * per_token + row) / 1e3)


def test_decode_floor_reads_a_tied_embedding_whole():
    """An input embedding tied to the LM head (Llama 3.2 1B's) is read whole by the head: the floor counts it once."""
    from models import load_model

    model = load_model("tiny-llama", dtype=torch.bfloat16)
    untied = decode._weight_bytes(model)
    model.lm_head.weight = model.model.embed_tokens.weight
    cfg = model.config
    assert decode._weight_bytes(model) == untied  # the head's own table gone, the embedding's counted instead
    assert decode._row_bytes(model) == 0 and decode._weight_bytes(model) > cfg.vocab_size * cfg.hidden_size * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gemm_refuses_without_a_gpu_and_quick_says_it_skipped(capsys):
    from benchmarks import gemm

    with pytest.raises(SystemExit) as e:
        gemm.main(["--ms", "1"])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
    gemm.main(["--quick"])
    assert "skipped, no CUDA GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        gemm.main(["--ms", "1,x"])
    assert e.value.code == 2 and "--ms: expected comma-separated positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        gemm.main(["--dtypes", "fp8,fp4", "--fast-accum"])
    assert e.value.code == 2 and "--dtypes: expected comma-separated names of bf16, fp8, int8; got 'fp8,fp4'" in \
        capsys.readouterr().err


def test_gemm_counts_the_8b_weights_and_keeps_its_sweep_small():
    """The floor the stack rows are measured against: 6.98e9 linear weights + the bf16 lm_head (1.05 GB); the
    sweep's grid stays near 30 configs a dtype (Triton compiles dominate its time)."""
    from benchmarks import gemm

    linear = 32 * (4096 * 6144 + 4096 * 4096 + 4096 * 28672 + 14336 * 4096)
    head = 4096 * 128256 * 2
    assert gemm.LLAMA_3_8B.weight_bytes(torch.float8_e4m3fn) == linear + head
    assert gemm.LLAMA_3_8B.weight_bytes(torch.bfloat16) == 2 * linear + head
    assert round((linear + head) / 4.28e12 * 1e3, 2) == 1.88  # ms at the H200's copy bandwidth, as the issue says
    configs = {c for m in (1, 4, 16) for c in gemm.sweep_grid(m)}
    assert len(configs) <= 32
    assert all(c.BLOCK_M >= m for m in (1, 4, 16) for c in gemm.sweep_grid(m))
    for m, rows in ((2, 16), (8, 16), (16, 16), (17, 32), (32, 32), (64, 64), (100, 128)):  # swap: as tall as M
        swapped = gemm.sweep_grid(m, "swap")
        assert swapped and len(swapped) <= 20 and all(c.SWAP and c.DOT and c.BLOCK_M == rows for c in swapped)
        split = {dataclasses.replace(c, SERIAL=False) for c in swapped if c.SPLIT_K > 1}
        serial = {dataclasses.replace(c, SERIAL=True) for c in split}
        assert split and {c for c in swapped if c.SPLIT_K > 1} == split | serial  # each split also summed in-kernel
    for m, rows in ((17, 32), (32, 32), (64, 64), (128, 128)):  # narrow: swapped, 1-4 splits summed in-kernel
        narrow = gemm.sweep_grid(m, "narrow")
        assert len(narrow) <= 24 and {c.SPLIT_K for c in narrow} == {1, 2, 4}
        assert all(c.SWAP and c.BLOCK_M == rows and c.SERIAL == (c.SPLIT_K > 1) for c in narrow)
        assert {dataclasses.replace(c, TMA=True) for c in narrow} == {c for c in narrow if c.TMA}  # both loads
        assert all(c.num_stages >= 2 and c.BLOCK_K * (c.BLOCK_N + rows) * 2 * c.num_stages <= max(
            200 << 10, c.BLOCK_K * (c.BLOCK_N + rows) * 4) for c in narrow)  # shared memory: ~200 KB or 2 stages


def test_gemm_sweep_shapes_names_the_models_shapes(capsys, monkeypatch):
    """``--sweep-shapes`` sweeps those of the model's shapes in the order given (default: every shape and the
    lm_head); a name the model lacks is a one-line usage error."""
    from benchmarks import gemm

    swept = []
    monkeypatch.setattr(gemm, "sweep_shape", lambda dtype, n, k, *a, **kw: swept.append((n, k)) or [])
    monkeypatch.setattr(gemm.common, "write_results", lambda *a, **kw: "")
    gemm.sweep(gemm.LLAMA_3_2_1B, [32], "cpu", 1000.0, None, ["bf16"], shapes=["down", "qkv"])
    assert swept == [(2048, 8192), (3072, 2048)]
    swept.clear()
    gemm.sweep(gemm.LLAMA_3_2_1B, [32], "cpu", 1000.0, None, ["bf16"])
    assert swept == [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)]

    with pytest.raises(SystemExit) as e:
        gemm.main(["--sweep", "--sweep-shapes", "qkv,gate"])
    assert e.value.code == 2 and ("--sweep-shapes: expected comma-separated names of qkv, o, gate_up, down, "
                                  "lm_head; got 'qkv,gate'") in capsys.readouterr().err


def test_attention_host_quick_times_every_step_and_writes_its_files(tmp_path):
    from benchmarks import attention_host

    rows = attention_host.main(["--quick", "--out", str(tmp_path)])
    # with a prompt, both forms (the A/B of models.attention.UNIFIED_ATTENTION); decode-only steps once; each with
    # the plans built, taken from the cache of recent steps', and inherited from the last step's
    shapes = [(1, 0, ""), (1, 32, "split"), (1, 32, "unified"), (4, 0, ""), (4, 32, "split"), (4, 32, "unified")]
    assert sorted((r["decodes"], r["prefill"], r["form"], r["plan"]) for r in rows) == [
        (*shape, plan) for shape in shapes for plan in ("built", "cached", "inherited")]
    assert all(r["host_us"] > 0 and r["gpu_us"] is None for r in rows)
    # the step's first call (with the step's setup) and the later ones timed apart
    assert all(r["first_call_us"] > 0 and r["later_call_us"] > 0 for r in rows)
    assert len(read_csv(tmp_path / "attention_host_quick.csv")) == 18
    assert_png(tmp_path / "attention_host_quick.png")  # host lines only: no GPU on the CPU


def test_chunked_prefill_quick_counts_the_mixed_steps_and_writes_its_files(tmp_path):
    from benchmarks import chunked_prefill

    (r,) = chunked_prefill.main(["--quick", "--out", str(tmp_path)])
    # 6 prompts of 40 tokens, 32 tokens a step, 4 in flight: prompts go in chunks beside running decodes
    assert r["decode_steps"] + r["prefill_steps"] + r["mixed_steps"] == r["steps"]
    assert r["mixed_steps"] > 0 and r["median_mixed_ms"] > 0 and r["median_decode_ms"] > 0
    assert r["tokens_per_s"] > 0
    # on the CPU every step runs its 2 layers' attention eagerly (no CUDA graph), natively: no launch state built,
    # a step's (empty) state taken over from the last step or a recent one of its layout
    assert r["attention_calls"] == 2 * r["steps"] and r["attention_host_us_mean"] > 0
    assert r["attention_first_us_p50"] > 0 and r["attention_later_us_p50"] > 0  # a step's first call, its second
    p50, p90, p99, top = (r[f"attention_host_us_{k}"] for k in ("p50", "p90", "p99", "max"))
    assert 0 < p50 <= p90 <= p99 <= top
    assert 0 <= r["attention_slow_calls"] <= r["attention_calls"]
    assert r["attention_slow_ms"] >= r["attention_slow_calls"] * chunked_prefill.SLOW_CALL_S * 1e3
    assert (r["attention_slow_calls"] > 0) == (top > chunked_prefill.SLOW_CALL_S * 1e6)
    assert r["jit_compiles"] == 0  # the CPU's attention is native code: no Triton kernel
    assert r["largest_graph"] == 0  # no CUDA graphs on the CPU
    assert r["eager_steps"] == r["steps"] == r["steps_inherited"] + r["steps_from_cache"]
    assert r["steps_from_cache"] > 0
    assert r["steps_built"] == r["pieces_built"] == r["pieces_from_cache"] == 0
    assert len(read_csv(tmp_path / "chunked_prefill_quick.csv")) == 1
    assert_png(tmp_path / "chunked_prefill_quick.png")


def test_chunked_prefill_cprofile_writes_the_timed_runs_profile(tmp_path):
    from benchmarks import chunked_prefill

    chunked_prefill.main(["--quick", "--cprofile", "--out", str(tmp_path)])
    text = (tmp_path / "chunked_prefill_cprofile_tiny-llama.txt").read_text()
    assert text.count("function calls") == 2 and "generate" in text  # by own time, then cumulative


def test_chunked_prefill_capture_to_cuts_the_default_sizes_and_refuses_a_small_one(capsys):
    from benchmarks import chunked_prefill
    from dispatcher import CompilationConfig

    default = CompilationConfig().cudagraph_capture_sizes
    assert chunked_prefill.capture_sizes(0) is None
    assert chunked_prefill.capture_sizes(512) == default
    assert chunked_prefill.capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))  # the default before 2026-12-06
    assert chunked_prefill.capture_sizes(300) == [1, 2, 4] + list(range(8, 257, 8)) + [272, 288]
    with pytest.raises(SystemExit):
        chunked_prefill.main(["--quick", "--capture-to", "4"])
    assert "--capture-to: expected 0 (the default sizes) or an integer >= 8, got 4" in capsys.readouterr().err


def test_prefix_caching_quick_computes_the_shared_prefix_once_and_writes_its_files(tmp_path):
    from benchmarks import prefix_caching

    off, on = prefix_caching.main(["--quick", "--out", str(tmp_path)])
    # 6 prompts of 48 shared + 8 own tokens (3 whole blocks shared), 32 tokens a step, 4 in flight
    assert (off["prefix_caching"], off["cached_tokens"], off["computed_prompt_tokens"]) == ("off", 0, 6 * 56)
    assert on["cached_tokens"] >= 4 * 48 and on["computed_prompt_tokens"] == 6 * 56 - on["cached_tokens"]
    assert on["same_tokens"] == "6/6" and on["tokens_per_s"] > 0
    assert len(read_csv(tmp_path / "prefix_caching_quick.csv")) == 2
    assert_png(tmp_path / "prefix_caching_quick.png")


def test_attention_host_split_config_form_restores_the_switches(tmp_path):
    """--forms split_config: the split form with the decode kernel's write and merge as its config says
    (models.forward_context.MIXED_DECODE_FUSED off while timed, on again after); a bad form is refused by name."""
    from benchmarks import attention_host
    import models.attention as attention_module
    import models.forward_context as forward_context

    rows = attention_host.main(["--quick", "--forms", "split_config", "--plans", "inherited"])
    assert sorted((r["decodes"], r["prefill"], r["form"]) for r in rows) == [
        (1, 0, ""), (1, 32, "split_config"), (4, 0, ""), (4, 32, "split_config")]
    assert forward_context.MIXED_DECODE_FUSED is True and attention_module.UNIFIED_ATTENTION is True
    with pytest.raises(SystemExit):
        attention_host.main(["--quick", "--forms", "fused"])


def test_attention_host_cprofile_writes_where_the_calls_time_goes(tmp_path):
    from benchmarks import attention_host

    assert attention_host.main(["--quick", "--cprofile", "--out", str(tmp_path)]) == []
    text = (tmp_path / "attention_host_profile.txt").read_text()
    assert "3 steps x 2 calls" in text and "attention" in text


def test_attention_host_shapes_are_the_models():
    from benchmarks import attention_host

    assert attention_host.attention_shape("llama-3-8b") == (32, 8, 128, 32)
    assert attention_host.attention_shape("llama-3.2-1b") == (32, 8, 64, 16)


@pytest.mark.slow
def test_mixed_step_quick_matches_its_parts_and_writes_its_files(tmp_path):
    from benchmarks import mixed_step

    rows = mixed_step.main(["--quick", "--out", str(tmp_path)])
    assert [(r["prefill"], r["decodes"]) for r in rows] == [(8, 1), (8, 3)]
    # fp32 on the CPU: the mixed step's logits are its parts' (the same sequences, split differently)
    assert all(r["mixed_us"] > 0 and r["logits_max_diff"] < 1e-3 for r in rows)
    # the ratio is the mixed step's time over its parts' (not a timing claim: CPU timings under load vary widely)
    for r in rows:
        assert r["ratio"] == pytest.approx(r["mixed_us"] / (r["prefill_us"] + r["decode_us"]), abs=6e-4, rel=0.01)
    assert len(read_csv(tmp_path / "mixed_step_quick.csv")) == 2
    assert_png(tmp_path / "mixed_step_quick.png")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("script", ["attention_host", "mixed_step"])
def test_mixed_step_benchmarks_refuse_without_a_gpu(script, capsys):
    import importlib

    mod = importlib.import_module(f"benchmarks.{script}")
    with pytest.raises(SystemExit) as e:
        mod.main([])
    assert e.value.code == 2 and "needs a" in capsys.readouterr().err


def test_kernel_profile_counts_busy_time_once_and_idle_between_kernels():
    from benchmarks import kernel_profile as kp

    # two replays: a GEMM overlapping (PDL) the Inductor kernel before it, then a gap of 2 us
    events = [("triton_poi_fused_0", 0.0, 4.0), ("nvjet_tst_128x8", 3.0, 10.0), ("_decode_split_kernel", 12.0, 15.0)]
    events += [(n, s + 20.0, e + 20.0) for n, s, e in events]
    kinds, top = kp.summarize("g", events, replays=2)
    total = kinds[0]
    assert total == {"graph": "g", "kind": "total", "kernels": 3.0, "us": 14.0, "own_us": 13.0, "span_us": 17.5,
                     "idle_us": 4.5, "early": 1.0}
    assert {r["kind"]: r["us"] for r in kinds[1:]} == {"gemm": 7.0, "inductor": 4.0, "attention": 3.0}
    # own time: the GEMM's first µs ran beside the Inductor kernel, so it owns 6 of its 7; own + idle = span
    assert {r["kind"]: r["own_us"] for r in kinds[1:]} == {"gemm": 6.0, "inductor": 4.0, "attention": 3.0}
    # started before the kernel before it ended: the GEMM of each replay
    assert {r["kind"]: r["early"] for r in kinds[1:]} == {"gemm": 1.0, "inductor": 0.0, "attention": 0.0}
    # a kind's idle: the gaps right before its kernels (2 before each attention, 5 before the second replay's first)
    assert {r["kind"]: r["idle_us"] for r in kinds[1:]} == {"gemm": 0.0, "inductor": 2.5, "attention": 2.0}
    assert top[0]["kernel"] == "nvjet_tst_128x8" and top[0]["count"] == 1.0 and top[0]["mean_us"] == 7.0
    assert top[0]["own_us"] == 6.0
    # a kernel launched early that ends before the one before it owns nothing of the span
    inner, _ = kp.summarize("h", [("nvjet_a", 0.0, 10.0), ("triton_red_0", 2.0, 9.0)], replays=1)
    assert {r["kind"]: r["own_us"] for r in inner} == {"total": 10.0, "gemm": 10.0, "inductor": 0.0}


@pytest.mark.parametrize("script, argv, says", [
    ("kernel_profile", ["--models", "tiny-llama"], "CUDA"),
    ("kernel_profile", ["--mode", "level 3 piecewise"], "CUDA"),
    ("kernel_profile", ["--mode", "level 1"], "--mode: expected a level-3 mode"),
    ("kernel_profile", ["--variant", "a=attn_rule=9:128:num_splits=4"], "--variant: no decode table has a row"),
    ("gemm_step_ab", ["--variant", "table="], "CUDA only"),
    ("attention", ["--variant", "n64=BLOCK_N=64"], "needs a CUDA GPU"),
    ("attention", ["--variant", "n64=BLOCK_N=x"], "--variant: DecodeConfig's BLOCK_N must be a non-negative"),
    ("attention", ["--variant", "s4=splits=4"], "--variant: a DecodeConfig field must be one of num_splits"),
    ("attention", ["--variant", "table=BLOCK_N=64"], "--variant: NAME=FIELD=VALUE,... with a NAME other than"),
    ("attention", ["--variant", "n64=BLOCK_N=64", "--rounds", "0"], "--rounds: at least 1"),
    ("attention_operands", [], "needs a CUDA GPU"),
    ("l2_prefetch", [], "needs a CUDA GPU"),
    ("l2_prefetch", ["--shapes", "8b-fp8 o,70b"], "--shapes: expected names of"),
    ("l2_prefetch", ["--waits", "2,x"], "--waits: expected comma-separated non-negative"),
    ("gated_gemm", [], "needs a CUDA GPU"),
    ("gated_gemm", ["--dtype", "bf16", "--model", "llama-3.2-1b"], "needs a CUDA GPU"),
    ("rope_linear", [], "needs a CUDA GPU"),
    ("rope_linear", ["--model", "llama-3"], "--model: invalid choice"),
    ("rope_linear", ["--ms", "1,x"], "--ms"),
    ("norm_linear", [], "needs a CUDA GPU"),
    ("norm_linear", ["--model", "llama-3"], "--model: invalid choice"),
    ("norm_linear", ["--rows", "3"], "--rows: powers of 2"),
    ("norm_linear", ["--ms", "1,x"], "--ms"),
    ("gated_gemm", ["--configs", "64x64"], "--configs: a rule's config must be"),
    ("gated_gemm", ["--configs", "cublas"], "--configs: 'cublas' is no gated config"),
    ("gated_gemm", ["--ms", "1,x"], "--ms"),
])
def test_gpu_only_benchmarks_refuse_without_a_gpu(script, argv, says, capsys):
    import importlib

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit) as e:
        importlib.import_module(f"benchmarks.{script}").main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_kernel_profile_variants_patch_the_gemm_table_and_restore_it():
    import ops
    from benchmarks import kernel_profile as kp

    fp8 = torch.float8_e4m3fn
    before = ops.small_m_config(1, 6144, 4096, fp8)
    with kp.gemm_table(fp8_ours=True, prefetch=2):
        inside = ops.small_m_config(1, 6144, 4096, fp8)
        assert inside is not None and inside.PREFETCH == 2
        assert inside == ops.small_m_config(1, 6144, 4096, torch.int8)  # int8's row, the same bytes a weight
    assert ops.small_m_config(1, 6144, 4096, fp8) == before


def test_kernel_profile_inductor_pdl_sets_the_inductor_option_a_level_3_compile_takes():
    """``--inductor-pdl 0`` reaches the options of a level-3 compile (as a plugin's Inductor option); without it the
    library's default stands. The plugin options are restored after."""
    import argparse

    from benchmarks import kernel_profile as kp
    from dispatcher import CompilationConfig, CompilationLevel, compat, plugins
    from dispatcher.backends import inductor_options

    key = compat.inductor_pdl_option()
    if key is None:
        pytest.skip("this torch's Inductor has no PDL option")
    p = argparse.ArgumentParser()
    try:
        assert kp._inductor_pdl(p, None) == "as the library sets it"
        assert inductor_options(CompilationConfig(), CompilationLevel.INDUCTOR)[key] is True
        assert kp._inductor_pdl(p, 0) == "off"
        assert inductor_options(CompilationConfig(), CompilationLevel.INDUCTOR)[key] is False
    finally:
        plugins.set_inductor_additional_configs({})


@pytest.mark.slow
def test_startup_phases_warm_start_loads_the_aot_forward_and_writes_its_files(tmp_path):
    from benchmarks import startup_phases

    startup_phases.main(["--layers", "2", "--warm-runs", "1", "--out", str(tmp_path)])
    rows = read_csv(tmp_path / "startup_phases_cpu.csv") if not torch.cuda.is_available() else \
        read_csv(tmp_path / "startup_phases_cuda.csv")
    assert [(r["caches"], r["trace"], r["compile_cache"]) for r in rows] == [("cold", "dynamo", "miss"),
                                                                              ("warm", "aot", "hit")]
    assert all(float(r["first_token_s"]) > 0 for r in rows)
    assert_png(tmp_path / ("startup_phases_cuda.png" if torch.cuda.is_available() else "startup_phases_cpu.png"))


def test_serve_runs_one_client_a_process_by_default(monkeypatch):
    """Each client builds its request in a process of its own (8 a process: the eighth's request, and the
    first's body, waited on seven other clients' ~3 ms builds, a delay no user sees)."""
    seen = []
    monkeypatch.setattr(serve, "bench_model", lambda name, a, device, dtype, step_rows: seen.append(a.clients_per_proc) or [])
    monkeypatch.setattr(serve, "save", lambda *args: None)
    serve.main(["--quick"])
    assert seen == [1]


def test_gemm_step_ab_parses_variants_into_table_rules():
    from unittest import mock

    from benchmarks import gemm_step_ab as ab
    from ops import small_m_gemm
    from ops.small_m_gemm import SMALL_M_TABLE, SmallMConfig, small_m_config

    name, rules = ab.parse_variant("gu32=int8:32:0:16384:32x64x128,w4,s4;fp8:16:2:0:cublas")
    assert name == "gu32" and len(rules) == 2
    assert rules[0].dtypes == (torch.int8,) and (rules[0].max_m, rules[0].min_ratio, rules[0].min_n) == (32, 0.0, 16384)
    assert rules[0].config == SmallMConfig(32, 64, 128, num_warps=4, num_stages=4)
    assert rules[1].config is None  # cublas
    assert ab.parse_config("64x64x128/2,s5") == SmallMConfig(64, 64, 128, SPLIT_K=2, num_warps=4, num_stages=5)
    assert ab.parse_config("32x64x128,w4,s6,x") == SmallMConfig(32, 64, 128, num_warps=4, num_stages=6, SWAP=True)
    assert ab.parse_config("4x8x512,w4,u") == SmallMConfig(4, 8, 512, DOT=False, num_warps=4, num_stages=1, UNROLL=True)
    assert ab.parse_config("16x32x256/2,w4,s4,r") == SmallMConfig(16, 32, 256, SPLIT_K=2, num_stages=4, SERIAL=True)
    assert ab.parse_config("64x64x128/2,w4,s5,x,r,t") == SmallMConfig(64, 64, 128, SPLIT_K=2, num_stages=5, SWAP=True,
                                                                      SERIAL=True, TMA=True)
    assert ab.config_text(SmallMConfig(128, 128, 64, num_warps=8, num_stages=5, TMA=True)) == "128x128x64,w8,s5,t"
    assert ab.parse_variant("table=") == ("table", [])
    # The rule takes over M in (16, 32] for int8 gate-up (N >= 16384); M <= 16 keeps the table's row.
    at_16 = small_m_config(16, 28672, 4096, torch.int8)
    table = ab.patched_table(rules[:1])
    assert len(table) == len(SMALL_M_TABLE) + 1
    with mock.patch.object(small_m_gemm, "SMALL_M_TABLE", table):  # the table the step's GEMMs then read
        assert small_m_config(32, 28672, 4096, torch.int8, max_m=128) == rules[0].config
        assert small_m_config(17, 28672, 4096, torch.int8, max_m=128) == rules[0].config
        assert small_m_config(16, 28672, 4096, torch.int8) == at_16 != rules[0].config
        assert small_m_config(32, 4096, 4096, torch.int8, max_m=128) != rules[0].config  # o_proj: N too small


def test_gemm_step_ab_rules_of_one_max_m_keep_their_order():
    """A shape's own rule given before a catch-all of the same M wins for that shape (they were once reversed)."""
    from benchmarks import gemm_step_ab as ab
    from ops import small_m_gemm

    down = ab.parse_config("64x64x128,w4,s6,x")
    with ab.applied("d128=bf16:64:0:0:cublas;bf16:128:2.0:4096:64x64x128,w4,s6,x;bf16:128:0:0:cublas"):
        assert small_m_gemm.small_m_config(128, 4096, 14336, torch.bfloat16, max_m=128) == down
        assert small_m_gemm.small_m_config(128, 4096, 4096, torch.bfloat16, max_m=128) is None  # the catch-all
        assert small_m_gemm.small_m_config(64, 4096, 14336, torch.bfloat16, max_m=128) is None
    _, rules = ab.parse_variant("v=bf16:128:0:0:cublas;bf16:64:2.0:0:64x64x128,w4,s6,x")
    table = ab.patched_table(rules)  # one place (no bf16 row of max_m >= 64 ... 128): the smaller max_m first
    assert table.index(rules[1]) < table.index(rules[0])


def test_gemm_step_ab_sweep_variant_takes_each_shapes_pick_over_cublas(tmp_path, capsys):
    """--sweep-variant: the sweep files' fastest correct config per shape where it beats cuBLAS by the margin."""
    from benchmarks import gemm, gemm_step_ab as ab
    from ops import small_m_gemm
    from ops.small_m_gemm import SmallMConfig

    swap, wide = SmallMConfig(128, 64, 128, num_warps=4, num_stages=6, SWAP=True), SmallMConfig(128, 128, 64, num_warps=8)
    split = SmallMConfig(64, 64, 128, SPLIT_K=2, num_stages=5, SERIAL=True)
    rows = [  # (N, K, config or None for cuBLAS, us, correct)
        (4096, 14336, None, 50.0, ""), (4096, 14336, split, 45.0, True), (4096, 14336, swap, 44.0, False),
        (4096, 4096, None, 15.0, ""), (4096, 4096, swap, 14.9, True),  # not 2% faster: cuBLAS
        (6144, 4096, None, 21.0, ""), (6144, 4096, wide, 19.0, True),
        (28672, 4096, None, 85.0, ""), (28672, 4096, wide, 80.0, True),
        (28672, 4096, SmallMConfig(4, 16, 128, DOT=False, num_warps=4), 70.0, True)]  # a rule cannot name it
    paths = []
    for i, part in enumerate((rows[:5], rows[5:])):
        paths.append(str(tmp_path / f"gemm_sweep_{i}.csv"))
        with open(paths[-1], "w", newline="") as f:
            f.write("# a GPU, torch, date\n")
            w = csv.DictWriter(f, gemm.SWEEP_COLUMNS)
            w.writeheader()
            for n, k, cfg, us, ok in part:
                base = {"dtype": "bf16", "M": 128, "N": n, "K": k, "us": us, "correct": ok}
                w.writerow({**base, "impl": "cuBLAS"} if cfg is None else
                           {**base, "impl": "ours", **dataclasses.asdict(cfg), "table": False})
    rules = ab.sweep_rules(paths)
    assert rules[-1] == "bf16:128:0:0:cublas" and len(rules) == 5
    with ab.applied("s=" + ";".join(rules)):
        pick = lambda n, k: small_m_gemm.small_m_config(128, n, k, torch.bfloat16, max_m=128)  # noqa: E731
        assert (pick(4096, 14336), pick(4096, 4096), pick(6144, 4096), pick(28672, 4096)) == (split, None, wide, wide)
        assert pick(128256, 4096) is None and pick(2048, 2048) is None  # shapes the sweep did not have: cuBLAS
    kept = ab.sweep_rules(paths, others="table")  # the shapes the sweep did not have keep the table's rows
    assert kept == rules[:-1]
    head = small_m_gemm.small_m_config(128, 128256, 4096, torch.bfloat16, max_m=128)
    with ab.applied("s=" + ";".join(kept)):
        pick = lambda n, k: small_m_gemm.small_m_config(128, n, k, torch.bfloat16, max_m=128)  # noqa: E731
        assert head is not None and pick(128256, 4096) == head and pick(4096, 14336) == split
    assert all(ab.parse_config(ab.config_text(c)) == c for c in (swap, wide, split))
    assert ab.config_text(SmallMConfig(4, 16, 128, DOT=False, num_warps=4)) is None  # the rolled GEMV
    with pytest.raises(SystemExit):
        ab.main(["--sweep-variant", f"s={tmp_path / 'missing.csv'}"])
    assert "--sweep-variant: FileNotFoundError" in capsys.readouterr().err


def test_gemm_step_ab_prefetch_item_sets_every_configs_prefetch():
    """``prefetch=N`` in a variant is no rule: it sets ``PREFETCH`` in every config of the patched table (cuBLAS rows
    stay None), which the step's GEMMs then read; without it the table keeps its own."""
    from benchmarks import gemm_step_ab as ab
    from ops.small_m_gemm import SMALL_M_TABLE

    text = "pf0=int8:32:0:16384:32x64x128,w4,s4;prefetch=0"
    name, rules = ab.parse_variant(text)
    assert name == "pf0" and len(rules) == 1 and ab.variant_option(text, "prefetch") == 0
    assert ab.variant_option("base=", "prefetch") is None
    assert ab.variant_option("pf=prefetch=2;inductor_pdl=1;prefetch=8", "prefetch") == 8
    assert ab.variant_option("pf=prefetch=2;inductor_pdl=1", "inductor_pdl") == 1
    table = ab.with_prefetch(ab.patched_table(rules), 0)
    assert len(table) == len(SMALL_M_TABLE) + 1
    assert all(r.config is None or r.config.PREFETCH == 0 for r in table)
    assert [r.config is None for r in table] == [r.config is None for r in ab.patched_table(rules)]
    assert any(r.config is not None and r.config.PREFETCH != 0 for r in SMALL_M_TABLE)  # the table's own


def test_gemm_step_ab_tma_item_sets_every_dot_tiles_tma():
    """``tma=1`` in a variant: every dot tile of the patched table (its rules' too) read by tensor descriptors, the
    GEMV and cuBLAS rows as they are; the step's GEMMs read that table."""
    from benchmarks import gemm_step_ab as ab
    from ops import small_m_gemm

    before = small_m_gemm.SMALL_M_TABLE
    with ab.applied("t=bf16:128:0:0:128x128x64,w8,s5;tma=1"):
        table = small_m_gemm.SMALL_M_TABLE
        assert small_m_gemm.small_m_config(128, 6144, 4096, torch.bfloat16, max_m=128).TMA
        assert all(r.config.TMA == r.config.DOT for r in table if r.config is not None)
        assert small_m_gemm.small_m_config(1, 4096, 4096, torch.bfloat16).UNROLL
    assert small_m_gemm.SMALL_M_TABLE == before  # undone
    with pytest.raises(ValueError, match="a rule's config must be"):
        ab.parse_variant("t=bf16:128:0:0:128x128x64,t,w8")


def test_gemm_step_ab_raises_the_ops_range_to_its_rules():
    """A variant's fp8 rule at M <= 128 runs in the step: the public ops' range for fp8 (16) is raised to it for
    the run, so the op takes the rule's config at M = 64 where it otherwise takes cuBLAS."""
    from unittest import mock

    from benchmarks import gemm_step_ab as ab
    from ops import small_m_gemm
    from ops.small_m_gemm import SMALL_M_MAX, runtime_config

    _, rules = ab.parse_variant("o128=fp8:128:0:0:64x64x128,w4,s4;int8:64:0:0:cublas")
    ranges = ab.raised_ranges(rules)
    assert ranges == {torch.float8_e4m3fn: 128}  # cuBLAS rules raise nothing; int8's own range is 128 already
    a = torch.zeros(64, 4096, dtype=torch.float8_e4m3fn)
    w = torch.zeros(4096, 4096, dtype=torch.float8_e4m3fn)
    with mock.patch.object(small_m_gemm, "SMALL_M_TABLE", ab.patched_table(rules)):
        assert runtime_config(a, w) is None  # M = 64 > SMALL_M_MAX: cuBLAS
        with mock.patch.dict(small_m_gemm.TRITON_MAX_M, ranges):
            assert runtime_config(a, w) == rules[0].config
    assert torch.float8_e4m3fn not in small_m_gemm.TRITON_MAX_M and SMALL_M_MAX == 16


def test_gemm_step_ab_attn_rule_sets_fields_of_the_decode_tables_row():
    """``attn_rule=8:128:num_splits=4,pdl=0`` changes those fields of the batch-8 row (head size 128) of the bf16 and
    fp8 cache tables, and nothing else; later items apply after it (attn_preload sets every row's preload)."""
    from benchmarks import gemm_step_ab as ab
    from ops import paged_decode_config as pdc

    text = "s4=attn_rule=8:128:num_splits=4,pdl=0;bf16:32:0:0:cublas"
    name, rules = ab.parse_variant(text)
    assert name == "s4" and len(rules) == 1 and rules[0].config is None
    tables = ab.attention_tables(text)
    assert set(tables) == {"DECODE_TABLE", "DECODE_TABLE_FP8"}
    for key, table in tables.items():
        before = getattr(pdc, key)
        changed = [i for i, (a, b) in enumerate(zip(before, table)) if a != b]
        assert len(table) == len(before) and len(changed) == 1
        row = table[changed[0]]
        assert (row.max_seqs, row.max_head_size) == (8, 128)
        assert row.config.num_splits == 4 and row.config.pdl is False
        assert row.config.BLOCK_N == before[changed[0]].config.BLOCK_N
    assert ab.attention_tables("base=") == {}
    preloaded = ab.attention_tables("p=attn_rule=1:128:num_splits=8;attn_preload=1")
    assert all(r.config.preload for t in preloaded.values() for r in t)
    assert preloaded["DECODE_TABLE"][0].config.num_splits == 8
    assert ab.attention_tables("w=attn_rule=32:128:num_splits=none")["DECODE_TABLE"][3].config.num_splits is None


def test_gemm_step_ab_attn_row_gives_a_head_size_its_own_row(tmp_path, capsys):
    """``attn_row=32:64:...`` puts a row before the bf16 table's first of at least 32 sequences and head size 64:
    the 1B's heads at 9-32 sequences take it, the 8B's and other batches keep theirs. ``--attn-sweep-variant``
    builds such rows from an attention sweep's file, each batch's least-loss config."""
    from benchmarks import gemm_step_ab as ab
    from ops import paged_decode_config as pdc

    text = "r=attn_row=32:64:num_splits=2,BLOCK_N=64,heads_first=1;attn_row=128:64:num_splits=1,num_warps=8"
    assert ab.parse_variant(text) == ("r", [])
    tables = ab.attention_tables(text)
    assert set(tables) == {"DECODE_TABLE"}
    own = pdc.decode_config(32, 128), pdc.decode_config(8, 64)
    with ab.applied(text):
        one, big, wide = pdc.decode_config(32, 64), pdc.decode_config(100, 64), pdc.decode_config(32, 128)
        assert (one.num_splits, one.BLOCK_N, one.heads_first) == (2, 64, True)
        assert (big.num_splits, big.num_warps) == (1, 8)
        assert (wide, pdc.decode_config(8, 64)) == own
    with pytest.raises(ValueError, match="must be a power of two"):
        ab.attention_tables("r=attn_row=32:64:BLOCK_N=48")
    path = tmp_path / "attention_sweep_d64.csv"
    rows = [(32, 512, 2, 64, 10.0), (32, 1024, 2, 64, 20.0), (32, 512, 1, 32, 9.0), (32, 1024, 1, 32, 30.0),
            (128, 512, 1, 64, 40.0)]  # at 32: 2 splits lose 1.11x at 512, 1 split 1.5x at 1024
    path.write_text("# a GPU\nbatch,context,num_splits,BLOCK_N,us,correct\n"
                    + "".join(f"{b},{c},{s},{n},{us},True\n" for b, c, s, n, us in rows))
    items = ab.attention_sweep_items(64, [str(path)])
    assert [i.split(",")[:2] for i in items] == [["attn_row=32:64:num_splits=2", "BLOCK_N=64"],
                                                ["attn_row=128:64:num_splits=1", "BLOCK_N=64"]]
    assert "heads_first=0" in items[0] and ab.attention_tables("v=" + ";".join(items))
    with pytest.raises(SystemExit):
        ab.main(["--attn-sweep-variant", f"v=64:{tmp_path / 'missing.csv'}"])
    assert "--attn-sweep-variant: FileNotFoundError" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ab.main(["--attn-sweep-variant", f"v={path}"])
    assert "expected NAME=HEAD_SIZE:CSV" in capsys.readouterr().err


def test_gemm_step_ab_applied_puts_a_variant_in_place_for_a_block():
    """What the step A/B and the kernel profile run under: the variant's GEMM rule (over the table as it is, the ops'
    range raised to it) and attention row inside the block, the library's own tables after it."""
    from benchmarks import gemm_step_ab as ab
    from ops import paged_decode_config as pdc
    from ops import small_m_gemm as smg

    variant = "v=bf16:64:0:0:64x64x128,w4,s4,x;attn_rule=8:128:num_splits=4"
    before = (smg.SMALL_M_TABLE, dict(smg.TRITON_MAX_M), pdc.DECODE_TABLE, pdc.DECODE_TABLE_FP8)
    assert smg.small_m_config(48, 6144, 4096, torch.bfloat16, max_m=smg.triton_max_m(torch.bfloat16)) is None
    with ab.applied(variant):
        config = smg.small_m_config(48, 6144, 4096, torch.bfloat16, max_m=smg.triton_max_m(torch.bfloat16))
        assert config is not None and config.SWAP and config.BLOCK_M == 64
        assert pdc.decode_config(8, 128).num_splits == 4 and pdc.decode_config(8, 128, kv_fp8=True).num_splits == 4
        assert pdc.decode_config(32, 128) == before[2][3].config
    assert (smg.SMALL_M_TABLE, dict(smg.TRITON_MAX_M), pdc.DECODE_TABLE, pdc.DECODE_TABLE_FP8) == before
    assert pdc.decode_config(8, 128).num_splits == 8


def test_gemm_step_ab_summary_gives_each_variants_mean_and_change():
    """The summary a reader compares: per batch, each variant's mean over its rounds and its change in % against the
    first variant's (this session's batch-8 pair of the 8B: the swapped tiles 3.21% faster)."""
    from benchmarks import gemm_step_ab as ab

    runs = [("default", 1, 8, 5949.4), ("default", 1, 16, 6226.6), ("x16", 1, 8, 5764.6), ("x16", 1, 16, 6022.3),
            ("default", 2, 8, 5940.6), ("default", 2, 16, 6196.6), ("x16", 2, 8, 5743.9), ("x16", 2, 16, 6011.9)]
    rows = [dict(variant=v, round=r, batch=b, us_per_step=us) for v, r, b, us in runs]
    got = {(s["batch"], s["variant"]): (s["rounds"], s["mean_us"], s["change_pct"]) for s in ab.summary(rows)}
    assert got[(8, "default")] == (2, 5945.0, 0.0) and got[(8, "x16")][:2] == (2, 5754.2)
    assert got[(8, "x16")][2] == -3.21 and got[(16, "x16")][2] == -3.13
    assert [s["batch"] for s in ab.summary(rows)] == [8, 8, 16, 16]


def test_gemm_step_ab_gated_row_runs_the_gated_form_where_it_says():
    """``gated_row=bf16:16:...`` gates bf16's gate-up at 2-16 tokens on that config inside the block (M = 1 keeps its
    GEMV row, 17 and up the unfused ops); ``cublas`` there: the unfused ops; the library's rows after the block."""
    from benchmarks import gemm_step_ab as ab
    from ops import small_m_gemm as smg

    before = dict(smg.GATED_ROWS)
    assert smg.gated_row(8, torch.bfloat16) is None
    with ab.applied("g=gated_row=bf16:16:16x64x128,w4,s6,x"):
        config = smg.gated_row(8, torch.bfloat16)
        assert config is not None and config.SWAP and (config.BLOCK_M, config.num_stages) == (16, 6)
        assert smg.gated_row(1, torch.bfloat16) == before[torch.bfloat16][0][1]
        assert smg.gated_row(17, torch.bfloat16) is None
    assert dict(smg.GATED_ROWS) == before
    off = ab.gated_rows("o=gated_row=int8:16:cublas")[torch.int8]
    assert off[1] == (16, None) and off[2] == before[torch.int8][1]


@pytest.mark.parametrize("text, says", [
    ("gu32", "NAME=RULES"), ("a=int8:32:0", "5 fields"), ("a=int4:32:0:0:cublas", "dtype must be one of"),
    ("a=int8:x:0:0:cublas", "must be integers"), ("a=int8:32:0:0:64by64", "config must be 'cublas'"),
    ("a=int8:32:0:0:48x64x128", "power of 2"), ("a=attn_rule=8:128", "attn_rule=MAX_SEQS:MAX_HEAD_SIZE"),
    ("a=attn_rule=8:128:splits=4", "field must be one of num_splits"), ("a=attn_rule=8:128:pdl=2", "0 or 1"),
    ("a=attn_rule=8:128:num_splits=x", "non-negative integer"), ("a=attn_rule=8:128:num_splits", "FIELD=VALUE"),
    ("a=attn_rule=9:128:num_splits=4", "no decode table has a row of max_seqs 9"),
    ("a=attn_rule=8:128:num_splits=3", "num_splits must be a power of two"),
    ("a=gated_row=bf16:16", "gated_row=DTYPE:MAX_M:CONFIG"), ("a=gated_row=int4:16:cublas", "gated_row=DTYPE"),
    ("a=gated_row=bf16:16:64by64", "config must be 'cublas'"),
])
def test_gemm_step_ab_names_a_bad_variant(text, says, capsys):
    from benchmarks import gemm_step_ab as ab

    with pytest.raises(SystemExit) as e:
        ab.main(["--variant", text])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--variant" in err and says in err


def test_attention_instructions_count_the_fp8_value_tiles_conversion():
    """Compiled for Hopper without a GPU: over an fp8 cache the decode loop (attention_operands' form 0) gathers the
    transposed value tile from shared memory a byte at a time; converted before that round trip (form 3) it does
    not, and costs about bf16's instructions a cache element, far fewer than form 0's."""
    pytest.importorskip("triton")
    from benchmarks import attention_instructions as ai

    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    form0, form3, plain = (ai.loop_counts(ai.compile_sass(dtype, form, 128, 4))
                           for dtype, form in ((fp8, 0), (fp8, 3), (bf16, 0)))
    assert form0["LDS.U8"] > 0 and form3["LDS.U8"] == 0 and plain["LDS.U8"] == 0
    mma = [sum(v for k, v in c.items() if k.startswith("HMMA")) for c in (form0, form3, plain)]
    assert mma[0] == mma[1] == mma[2] > 0  # the same two dots a tile
    total = [sum(c.values()) for c in (form0, form3, plain)]
    assert total[1] < 0.75 * total[0] and total[1] < 1.1 * total[2]


def test_gemv_instructions_counts_the_sm90_code_of_each_form(tmp_path):
    """Compiled for Hopper without a GPU: int8's 8-bit form sums with dp4a and the plain one never does; fp8's 8-bit
    form multiplies and adds in one fma; both take fewer instructions an element than the plain form; the gated
    (gate-up) form keeps dp4a on half the warps."""
    pytest.importorskip("triton")
    from benchmarks import gemv_instructions as gi

    counts = {}
    for dtype in (torch.int8, torch.float8_e4m3fn):
        for bytes_form in (True, False):
            counts[dtype, bytes_form] = gi.count(gi.compile_sass(dtype, 8, 512, 4, 1024, bytes_form))
    elements = 1024 * 8 // 128  # a thread's: K x BLOCK_N over 4 warps' threads
    assert counts[torch.int8, True]["IDP.4A.S8.S8"] == elements // 4 and "IDP.4A.S8.S8" not in counts[torch.int8, False]
    fp8 = counts[torch.float8_e4m3fn, True]
    assert fp8["FFMA"] == elements and fp8["FMUL"] <= 4  # the epilogue's scales multiply, no product does
    assert counts[torch.float8_e4m3fn, False]["FMUL"] >= elements
    for dtype in (torch.int8, torch.float8_e4m3fn):
        assert sum(counts[dtype, True].values()) < sum(counts[dtype, False].values())
    # the gated form of the same 8 rows (4 gate, 4 up) on 2 warps: each thread twice the elements, dp4a kept
    assert gi.count(gi.compile_sass(torch.int8, 4, 512, 2, 1024, True, gated=True))["IDP.4A.S8.S8"] == 2 * elements // 4
    assert 0 < gi.registers(gi.compile_cubin(torch.int8, 4, 512, 2, 1024, True, gated=True)) <= 255
    # the quantizing form (--quant: a bf16 row quantized as loaded): no dp4a, and more instructions than either
    quant = gi.count(gi.compile_sass(torch.int8, 8, 512, 4, 1024, True, quant_a=True))
    assert "IDP.4A.S8.S8" not in quant and sum(quant.values()) > sum(counts[torch.int8, False].values())
    # over 2 rows a program: each weight tile converted once, so fp8's two rows take fewer than twice one row's
    # conversions; int8 still sums with dp4a, two rows' worth
    two = {d: gi.count(gi.read_cubin(gi.compile_rows_cubin(d, 2, 8, 512, 4, 1024), "-sass"))
           for d in (torch.int8, torch.float8_e4m3fn)}
    assert two[torch.int8]["IDP.4A.S8.S8"] == 2 * elements // 4
    assert two[torch.float8_e4m3fn]["FFMA"] == 2 * elements
    assert two[torch.float8_e4m3fn]["F2FP.F16.E4M3.UNPACK_B"] < 2 * fp8["F2FP.F16.E4M3.UNPACK_B"]
    for argv in (["--k", "1000"], ["--rows", "3"]):
        with pytest.raises(SystemExit) as e:
            gi.main(argv)
        assert e.value.code == 2


def test_gemv_instructions_norm_form_is_the_same_tile_plus_the_norm():
    """``--norm``: ops.norm_linear's GEMV on a bf16 tile runs ``NORM_MIN_ROWS`` rows a program; its code is the
    plain GEMV's on those rows plus the norm's (more instructions, not half again as many), and its rows say so."""
    pytest.importorskip("triton")
    from benchmarks import gemv_instructions as gi
    from ops.norm_linear import NORM_MIN_ROWS

    rows = {r["form"]: r for r in (gi._row(torch.bfloat16, 2, 1024, 4, 2048, f)
                                   for f in ("plain", "plain (norm rows)", "norm"))}
    assert rows["plain"]["tile"] == "2x1024 w4"
    assert rows["norm"]["tile"] == rows["plain (norm rows)"]["tile"] == f"{NORM_MIN_ROWS}x1024 w4"
    assert rows["norm"]["elements_a_thread"] == 2048 * NORM_MIN_ROWS // 128
    assert rows["plain (norm rows)"]["instructions"] < rows["norm"]["instructions"] \
        < 1.5 * rows["plain (norm rows)"]["instructions"]


def test_decode_mode_words_set_ops_passes_and_compile_sizes():
    """A level-3 mode's words: custom ops (``+ops``, ``native``, ``-op:NAME``), passes (``+passes``, ``+NAME``,
    ``-NAME``) and per-size compiles (``size:N``), each into the config field it names and no other."""
    from benchmarks.decode import mode_config

    cfg = mode_config("level 3 +ops -op:rotary_embedding +native_ops size:128 size:64", cuda=False,
                      capture_sizes=[1])
    assert cfg.custom_ops == ["all", "-rotary_embedding"]
    assert cfg.compile_sizes == [64, 128]
    assert cfg.pass_config.switch("native_ops") is True and cfg.pass_config.switch("act_quant") is None
    native = mode_config("level 3 native", cuda=False, capture_sizes=[1])
    assert native.custom_ops == ["none"] and native.compile_sizes == []


def test_clock_sampler_gives_the_median_clock_and_power_of_its_samples():
    from benchmarks.gpu_clocks import ClockSampler

    readings = iter([(1980.0, 690.1), (1755.0, 700.0), (1830.0, 695.5)])
    sampler = ClockSampler(torch.device("cpu"), read=lambda device: next(readings))
    assert sampler.medians() == {}
    for _ in range(3):
        sampler.sample()
    assert sampler.medians() == {"sm_mhz": 1830, "power_w": 695.5}


def test_clock_sampler_stops_after_a_failed_reading_without_raising():
    from benchmarks.gpu_clocks import ClockSampler

    def read(device):
        raise RuntimeError("NVML: not supported")

    sampler = ClockSampler(torch.device("cpu"), read=read)
    sampler.sample()
    sampler.sample()
    assert sampler.medians() == {}
