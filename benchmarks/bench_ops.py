"""The custom ops against native eager and torch.compile of their references, on a bandwidth ceiling.

For each op and tokens x hidden (bf16): correctness first (against the fp32
reference: tolerance, fp8 bit-exact), then µs per call of

- ours: ``torch.ops.dynamo_once.<op>`` (the Triton kernel);
- eager: the native reference (``forward_native``) run eagerly;
- compile: ``torch.compile(dynamic=False)`` of that reference, one compile per
  tokens x hidden (Inductor specializes its kernels to the shape: the fair
  baseline, as a model captured per size in CUDA graphs gets);
- compile_dyn: ``torch.compile`` of the reference with the token dim dynamic
  (one compile per op and hidden size, ``backed_size_oblivious`` so size 1 is
  not specialized), the code a symbolic-size compile runs (skip: ``--no-dynamic``);

all three timed the same way: 32 calls captured in one CUDA graph, replays
timed with CUDA events, inputs rotated through copies totalling >= 256 MiB so
that reads come from DRAM rather than the 50 MiB L2. GB/s counts the bytes
each op must move at least (inputs read once, outputs written once), and % of
copy is against the device-to-device copy bandwidth measured in the same run.

Usage: ``python benchmarks/bench_ops.py [--out DIR] [--quick | --targets-only] [--no-dynamic] [--sweep | --sweep-small]``;
``--targets-only`` runs the sizes of the targets only (tokens 1, 16, 4096, 32768
x hidden 4096, every op; ~2-3 minutes on an H200, mostly Inductor compiles).
On a machine without CUDA it runs ``--quick`` on the CPU as a smoke test.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ops  # noqa: E402
from benchmarks import common  # noqa: E402

TOKENS = [1, 16, 256, 4096, 32768]
HIDDEN = [2048, 4096, 8192]
TARGET_TOKENS = [1, 16, 4096, 32768]
TARGET_HIDDEN = [4096]
HEAD_SIZE = 128
EPS = 1e-6
GRAPH_ITERS = 32
# Targets from the issue.
BANDWIDTH_TARGET = 0.85  # of the copy bandwidth, at >= 4096 tokens x 4096 hidden
BANDWIDTH_TARGET_OPS = ("rms_norm", "fused_add_rms_norm", "silu_and_mul")
LATENCY_TOKENS = 16  # at <= this many tokens: no slower than torch.compile, under CUDA-graph replay
# Latency cells: every column's graph of this many calls replayed in turn, median over the rounds.
LATENCY_GRAPH_ITERS = 128
LATENCY_ROUNDS = 60
TOL = {torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2), torch.float32: dict(atol=1e-5, rtol=1e-5)}


@dataclass
class OpSpec:
    name: str
    make_args: Callable[[int, int, torch.dtype, str], tuple]
    ours: Callable
    ref: Callable
    nbytes: Callable[[int, int, int], int]  # (tokens, hidden, element size) -> bytes moved at least
    exact: bool = False


def _rand(*shape, dtype, device):
    return torch.randn(*shape, device=device).to(dtype)


def _rope_heads(hidden):
    n_q = hidden // HEAD_SIZE
    return n_q, max(1, n_q // 4)  # GQA 4:1 as Llama 3


def _rope_args(t, h, dt, dev):
    n_q, n_kv = _rope_heads(h)
    cache = ops.compute_cos_sin_cache(HEAD_SIZE, 32768, 500000.0, dtype=dt, device=dev)
    positions = torch.randint(0, 32768, (t,), device=dev)
    return positions, _rand(t, n_q * HEAD_SIZE, dtype=dt, device=dev), _rand(t, n_kv * HEAD_SIZE, dtype=dt, device=dev), cache


def _rope_bytes(t, h, s):
    n_q, n_kv = _rope_heads(h)
    return 2 * t * (n_q + n_kv) * HEAD_SIZE * s + t * 8 + t * HEAD_SIZE * s  # q, k in+out; positions; cache rows


SPECS = [
    OpSpec(
        "rms_norm",
        lambda t, h, dt, dev: (_rand(t, h, dtype=dt, device=dev), _rand(h, dtype=dt, device=dev)),
        lambda x, w: ops.rms_norm(x, w, EPS),
        lambda x, w: ops.rms_norm_ref(x, w, EPS),
        lambda t, h, s: 2 * t * h * s + h * s,
    ),
    OpSpec(
        "gemma_rms_norm",
        lambda t, h, dt, dev: (_rand(t, h, dtype=dt, device=dev), _rand(h, dtype=dt, device=dev)),
        lambda x, w: ops.gemma_rms_norm(x, w, EPS),
        lambda x, w: ops.rms_norm_ref(x, w, EPS, gemma=True),
        lambda t, h, s: 2 * t * h * s + h * s,
    ),
    OpSpec(
        "fused_add_rms_norm",
        lambda t, h, dt, dev: (
            _rand(t, h, dtype=dt, device=dev),
            _rand(t, h, dtype=dt, device=dev),
            _rand(h, dtype=dt, device=dev),
        ),
        lambda x, r, w: ops.fused_add_rms_norm(x, r, w, EPS),
        lambda x, r, w: ops.fused_add_rms_norm_ref(x, r, w, EPS),
        lambda t, h, s: 4 * t * h * s + h * s,
    ),
    OpSpec(
        "silu_and_mul",
        lambda t, h, dt, dev: (_rand(t, 2 * h, dtype=dt, device=dev),),
        ops.silu_and_mul,
        ops.silu_and_mul_ref,
        lambda t, h, s: 3 * t * h * s,
    ),
    OpSpec(
        "gelu_and_mul",
        lambda t, h, dt, dev: (_rand(t, 2 * h, dtype=dt, device=dev),),
        lambda x: ops.gelu_and_mul(x, "tanh"),
        lambda x: ops.gelu_and_mul_ref(x, "tanh"),
        lambda t, h, s: 3 * t * h * s,
    ),
    OpSpec(
        "rotary_embedding",
        _rope_args,
        lambda p, q, k, c: ops.rotary_embedding(p, q, k, c, HEAD_SIZE, True),
        lambda p, q, k, c: ops.rotary_embedding_ref(p, q, k, c, HEAD_SIZE, True),
        _rope_bytes,
    ),
    OpSpec(
        "static_scaled_fp8_quant",
        lambda t, h, dt, dev: (_rand(t, h, dtype=dt, device=dev), torch.tensor([0.02], device=dev)),
        ops.static_scaled_fp8_quant,
        ops.static_scaled_fp8_quant_ref,
        lambda t, h, s: t * h * (s + 1),
        exact=True,
    ),
    OpSpec(
        "dynamic_scaled_fp8_quant",
        lambda t, h, dt, dev: (_rand(t, h, dtype=dt, device=dev),),
        ops.dynamic_scaled_fp8_quant,
        ops.dynamic_scaled_fp8_quant_ref,
        lambda t, h, s: t * h * (s + 1),  # the kernel reads x twice (amax, then quantize); counted once
        exact=True,
    ),
]


def _check(spec: OpSpec, out, expected) -> bool:
    outs = out if isinstance(out, tuple) else (out,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    for o, e in zip(outs, exps):
        if spec.exact or o.dtype == ops.FP8_DTYPE:
            a, b = (o.view(torch.uint8), e.view(torch.uint8)) if o.dtype == ops.FP8_DTYPE else (o, e)
            if not torch.equal(a, b):
                return False
        elif not torch.allclose(o.float(), e.float(), **TOL.get(e.dtype, TOL[torch.bfloat16])):
            return False
    return True


def division_rounding_option() -> dict[str, bool]:
    """The Inductor option that makes its fp32 division correctly rounded (``div_rn``), as eager's.

    By default Inductor's Triton code divides with the approximate ``div.full.f32``; this option is the
    fair comparator for ops that must be bit-exact. Spelled ``emulate_divison_rounding`` up to torch
    2.12 and ``eager_numerics.division_rounding`` from 2.13; empty where neither exists.
    """
    cfg = torch._inductor.config
    if hasattr(cfg, "emulate_divison_rounding"):
        return {"emulate_divison_rounding": True}
    if hasattr(getattr(cfg, "eager_numerics", None), "division_rounding"):
        return {"eager_numerics.division_rounding": True}
    return {}


def _mark_tokens_dynamic(args: tuple, t: int) -> None:
    """Dim 0 of the token-indexed inputs: 2-d activations and 1-d integer positions (not a weight of size t)."""
    for a in args:
        if isinstance(a, torch.Tensor) and a.shape[:1] == (t,) and (a.dim() >= 2 or not a.is_floating_point()):
            torch._dynamo.mark_dynamic(a, 0)


def _arg_sets(args: tuple, nbytes: int) -> list[tuple]:
    """``args`` and copies of it, together over the L2 (``common.copies_to_exceed_cache``), to rotate over."""
    return [args] + [tuple(a.clone() for a in args) for _ in range(common.copies_to_exceed_cache(nbytes) - 1)]


def _time(fn: Callable, args: tuple, nbytes: int, device: str) -> float:
    """µs per call of ``fn`` under CUDA-graph replay, rotating over copies of ``args`` that exceed the L2."""
    arg_sets = _arg_sets(args, nbytes) if device == "cuda" else [args]
    # Latency-bound sizes differ from compile by tenths of a microsecond: 100 replays for their median.
    iters = 100 * GRAPH_ITERS if nbytes < (8 << 20) else 200
    return common.bench(common.rotating(fn, arg_sets), device, cuda_graph=True, graph_iters=GRAPH_ITERS, iters=iters)


def _without_pdl(fn: Callable) -> Callable:
    """``fn`` with ``DYNAMO_ONCE_PDL=0`` while it runs (the launchers read it at each call, so also while a
    CUDA graph captures it)."""
    def call(*args):
        with mock.patch.dict(os.environ, {"DYNAMO_ONCE_PDL": "0"}):
            return fn(*args)

    return call


def _time_interleaved(fns: dict[str, Callable], args: tuple, nbytes: int) -> dict[str, float]:
    """µs per call of each of ``fns`` (CUDA), their graphs replayed in turn (``common.bench_gpu_interleaved``)."""
    arg_sets = _arg_sets(args, nbytes)
    return common.bench_gpu_interleaved({k: common.rotating(fn, arg_sets) for k, fn in fns.items()},
                                        graph_iters=LATENCY_GRAPH_ITERS, rounds=LATENCY_ROUNDS)


def run(
    tokens: list[int],
    hidden: list[int],
    names: list[str],
    device: str,
    dtype: torch.dtype,
    on_op_done: Callable[[list, float], None] = lambda rows, copy_gbps: None,
    dynamic_column: bool = True,
) -> tuple[list, float]:
    copy_gbps = common.measure_copy_bandwidth(device=device) if device == "cuda" else common.measure_copy_bandwidth(
        256 << 20, device=device
    )
    print(f"copy bandwidth: {copy_gbps:.0f} GB/s", flush=True)
    # One static compile per tokens x hidden of the same function: more than Dynamo's default 8 entries.
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
    elt = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for spec in sorted((s for s in SPECS if s.name in names), key=lambda s: s.name not in BANDWIDTH_TARGET_OPS):
        for h in hidden:
            # compile_dyn first, for every token count, from one compile; then a reset, so that no
            # static-shape call below can be served by that symbolic entry (guards do not tell them apart).
            dyn_times: dict[int, float] = {}
            if dynamic_column:
                torch._dynamo.reset()
                compiled_dyn = torch.compile(spec.ref, fullgraph=True)
                for t in tokens:
                    torch.manual_seed(0)
                    args = spec.make_args(t, h, dtype, device)
                    _mark_tokens_dynamic(args, t)
                    compiled_dyn(*args)
                    dyn_times[t] = _time(compiled_dyn, args, spec.nbytes(t, h, elt), device)
                    del args
            torch._dynamo.reset()
            for t in tokens:
                torch.manual_seed(0)
                args = spec.make_args(t, h, dtype, device)
                # Ours against the reference (fp8 bit-exact). Inductor's own division is approximate, so the
                # compiled reference is not held to that.
                ok = _check(spec, spec.ours(*args), spec.ref(*args))
                # A fresh static-shape compile for this size: Inductor's best case, specialized kernels.
                compiled_ref = torch.compile(spec.ref, fullgraph=True, dynamic=False)
                # Bit-exact ops: is the compiled reference itself exact? (Triton's fp32 `/` is div.full.f32,
                # approximate; ours pays for the correctly rounded division.)
                compile_exact = _check(dataclasses.replace(spec, exact=True), compiled_ref(*args), spec.ref(*args)) \
                    if spec.exact else ""
                nbytes = spec.nbytes(t, h, elt)
                timed = [("ours", spec.ours), ("eager", spec.ref), ("compile", compiled_ref)]
                compile_rn_exact = ""
                if spec.exact and division_rounding_option():
                    # The bit-exact comparator: Inductor with correctly rounded division, as ours.
                    compiled_rn = torch.compile(spec.ref, fullgraph=True, dynamic=False,
                                                options=division_rounding_option())
                    compile_rn_exact = _check(spec, compiled_rn(*args), spec.ref(*args))
                    timed.append(("compile_rn", compiled_rn))
                if device == "cuda" and t <= LATENCY_TOKENS:
                    # The latency target compares ~1.2 us calls to tens of nanoseconds: time them together,
                    # with ours also without programmatic dependent launch (what it is worth).
                    timed.append(("ours_no_pdl", _without_pdl(spec.ours)))
                    times = _time_interleaved(dict(timed), args, nbytes)
                else:
                    times = {label: _time(fn, args, nbytes, device) for label, fn in timed}
                del args
                gbps = nbytes / (times["ours"] * 1e-6) / 1e9
                row = {
                    "op": spec.name,
                    "tokens": t,
                    "hidden": h,
                    "MB": round(nbytes / 1e6, 3),
                    "ours_us": round(times["ours"], 3),
                    "ours_no_pdl_us": round(times["ours_no_pdl"], 3) if "ours_no_pdl" in times else "",
                    "ours_GBps": round(gbps),
                    "pct_copy": round(100 * gbps / copy_gbps, 1),
                    "eager_us": round(times["eager"], 3),
                    "compile_us": round(times["compile"], 3),
                    "compile_pct_copy": round(100 * nbytes / (times["compile"] * 1e-6) / 1e9 / copy_gbps, 1),
                    "compile_dyn_us": round(dyn_times[t], 2) if t in dyn_times else "",
                    "x_vs_eager": round(times["eager"] / times["ours"], 2),
                    "x_vs_compile": round(times["compile"] / times["ours"], 2),
                    "correct": ok,
                    "compile_exact": compile_exact,
                    "compile_rn_us": round(times["compile_rn"], 3) if "compile_rn" in times else "",
                    "compile_rn_exact": compile_rn_exact,
                }
                rows.append(row)
                print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            torch._dynamo.reset()
        on_op_done(rows, copy_gbps)
    return rows, copy_gbps


def targets(rows: list, copy_gbps: float) -> list[str]:
    """One line per target of the issue, with PASS/MISS and the figure."""
    lines = []
    for r in rows:
        if r["op"] in BANDWIDTH_TARGET_OPS and r["tokens"] >= 4096 and r["hidden"] >= 4096:
            verdict = "PASS" if r["pct_copy"] >= 100 * BANDWIDTH_TARGET else "MISS"
            lines.append(
                f"{verdict} bandwidth {r['op']} {r['tokens']}x{r['hidden']}: {r['ours_GBps']} GB/s = "
                f"{r['pct_copy']}% of copy (target >= {100 * BANDWIDTH_TARGET:.0f}%)"
            )
    for r in rows:
        if r["tokens"] <= LATENCY_TOKENS:
            verdict = "PASS" if r["ours_us"] <= r["compile_us"] else "MISS"
            exact = ""
            if r.get("compile_rn_us") not in ("", None):
                exact = (f"; vs compile with correctly rounded division {r['compile_rn_us']} us "
                         f"({'PASS' if r['ours_us'] <= r['compile_rn_us'] else 'MISS'})")
            no_pdl = f" (without PDL {r['ours_no_pdl_us']} us)" if r.get("ours_no_pdl_us") not in ("", None) else ""
            lines.append(
                f"{verdict} latency {r['op']} {r['tokens']}x{r['hidden']}: ours {r['ours_us']} us{no_pdl} vs compile "
                f"{r['compile_us']} us{exact}"
            )
    bad = [f"{r['op']} {r['tokens']}x{r['hidden']}" for r in rows if not r["correct"]]
    lines.append("PASS correctness: all" if not bad else f"FAIL correctness: {', '.join(bad)}")
    return lines


def sweep(device: str, out_dir: str) -> None:
    """Time the row kernels over (ROWS, num_warps) at the bandwidth-target sizes, to choose the heuristics."""
    rms = importlib.import_module("ops.rms_norm")
    act = importlib.import_module("ops.silu_and_mul")
    copy_gbps = common.measure_copy_bandwidth(device=device)
    rows = []
    for t, h in ((4096, 4096), (32768, 4096)):
        x, r = torch.randn(t, h, device=device, dtype=torch.bfloat16), torch.randn(t, h, device=device, dtype=torch.bfloat16)
        w = torch.randn(h, device=device, dtype=torch.bfloat16)
        x2 = torch.randn(t, 2 * h, device=device, dtype=torch.bfloat16)
        block = triton_next_pow2(h)
        kernels = {
            "rms_norm": (lambda cfg, a: rms._launch_rms_norm(a[0], None, a[2], EPS, False, cfg), (x, r, w), 2 * t * h * 2),
            "fused_add_rms_norm": (lambda cfg, a: rms._launch_rms_norm(a[0], a[1], a[2], EPS, False, cfg), (x, r, w), 4 * t * h * 2),
            "silu_and_mul": (lambda cfg, a: act._launch_silu_and_mul(a[0], cfg), (x2,), 3 * t * h * 2),
        }
        for name, (launch, args, nbytes) in kernels.items():
            arg_sets = _arg_sets(args, nbytes)
            default = rms.rms_norm_config(h, 2) if name != "silu_and_mul" else act.act_and_mul_config(h, 2)
            for rows_per in (1, 2, 4):
                for warps in (4, 8, 16):
                    blk = block if name != "silu_and_mul" else min(block, 8192 // rows_per)
                    if name == "silu_and_mul" and blk * rows_per > 16384:
                        continue
                    cfg = (blk, rows_per, warps)
                    try:
                        us = common.bench_gpu(
                            common.rotating(lambda *a, cfg=cfg: launch(cfg, a), arg_sets), cuda_graph=True,
                            graph_iters=GRAPH_ITERS, iters=200,
                        )
                    except Exception as e:  # a config Triton cannot build (too many registers)
                        print(f"sweep {name} {t}x{h} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    gbps = nbytes / (us * 1e-6) / 1e9
                    rows.append({"op": name, "tokens": t, "hidden": h, "BLOCK": blk, "ROWS": rows_per, "warps": warps,
                                 "us": round(us, 2), "pct_copy": round(100 * gbps / copy_gbps, 1),
                                 "default": cfg == default})
                    print(rows[-1], flush=True)
    common.write_results("bench_ops_sweep", rows, title="Row-kernel configs (bf16, CUDA-graph replay)",
                         notes=[f"copy bandwidth {copy_gbps:.0f} GB/s"], out_dir=out_dir)


def _latency_configs(t: int, h: int) -> dict[str, list[tuple]]:
    """Candidate launch configs per op at ``t`` tokens x ``h`` hidden.

    Elementwise ops: 1-8 elements per thread in 128-2048-wide blocks (earlier sweeps: more per thread
    was never the fastest at these sizes; Inductor's pointwise autotuning picks 128- or 256-wide blocks,
    1-2 elements a thread, up to 32768 elements). Row kernels: one row per program, the warps swept.
    """
    def per_thread_ok(elems: int, warps: int, least: int = 4) -> bool:
        return least <= elems // (32 * warps) <= 32

    act = [(b, r, w) for b in (128, 256, 512, 1024) if b <= h for r in sorted({1, 2} & set(range(1, t + 1)))
           for w in (1, 2, 4, 8) if 1 <= b * r // (32 * w) <= 8]
    rms = [(triton_next_pow2(h), 1, w) for w in (1, 2, 4, 8, 16)]
    n = t * h
    static = [(b, w) for b in (128, 256, 512, 1024, 2048) if b <= n for w in (1, 2, 4, 8) if 1 <= b // (32 * w) <= 8]
    single = [(b, -(-n // b), w) for b in (1024, 2048, 4096, 8192) if b <= triton_next_pow2(n)
              for w in (1, 2, 4, 8, 16) if per_thread_ok(b, w)] if n <= 8192 else []
    return {"rms_norm": rms, "fused_add_rms_norm": rms, "silu_and_mul": act, "gelu_and_mul": act,
            "static_scaled_fp8_quant": static, "dynamic_scaled_fp8_quant": single}


def sweep_small(device: str, out_dir: str | None, ops_filter: list[str] | None = None) -> None:
    """At <= 16 tokens, time each op's launch configs and torch.compile of its reference (CUDA-graph replay).

    The latency target is "no slower than torch.compile": this shows by how much each candidate
    config wins or loses, and which one the launcher picks (``default``).
    """
    rms = importlib.import_module("ops.rms_norm")
    act = importlib.import_module("ops.silu_and_mul")
    gelu = importlib.import_module("ops.gelu_and_mul")
    fp8 = importlib.import_module("ops.quant_fp8")
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
    by_name = {s.name: s for s in SPECS}
    rows = []

    def save() -> None:  # after every cell, so that a run cut short keeps what it measured
        common.write_results("bench_ops_sweep_small", rows, title="Launch configs at <= 16 tokens (bf16, CUDA-graph replay)",
                             notes=["config: rms (BLOCK_N, ROWS, warps); act (BLOCK_D, ROWS, warps); static fp8 (BLOCK, "
                                    "warps); dynamic fp8 single program (BLOCK, NUM_BLOCKS, warps), else the launcher's path",
                                    "vs_compile: torch.compile(ref) us / this config's us (> 1: faster than compile)",
                                    "default: the config the launcher picks for this known size",
                                    "every config launched with programmatic dependent launch (ops.triton_utils.pdl_launch) "
                                    "but '<default> no PDL'",
                                    f"each cell's candidates and compile timed together: {LATENCY_GRAPH_ITERS} calls per "
                                    f"CUDA graph, the graphs replayed in turn, median of {LATENCY_ROUNDS} rounds"],
                             out_dir=out_dir)

    for t, h in ((t, h) for t in (1, LATENCY_TOKENS) for h in HIDDEN):
        launchers = {
            "rms_norm": (lambda cfg, a, pdl=None: rms._launch_rms_norm(a[0], None, a[1], EPS, False, cfg, pdl),
                         rms.rms_norm_config(h, 2, t)),
            "fused_add_rms_norm": (lambda cfg, a, pdl=None: rms._launch_rms_norm(a[0], a[1], a[2], EPS, False, cfg,
                                                                                 pdl),
                                   rms.rms_norm_config(h, 2, t)),
            "silu_and_mul": (lambda cfg, a, pdl=None: act._launch_silu_and_mul(a[0], cfg, pdl),
                             act.act_and_mul_config(h, 2, t)),
            "gelu_and_mul": (lambda cfg, a, pdl=None: gelu._launch_gelu_and_mul(a[0], "tanh", cfg, pdl),
                             act.act_and_mul_config(h, 2, t)),
            "static_scaled_fp8_quant": (lambda cfg, a, pdl=None: fp8._launch_static_fp8_quant(a[0], a[1], cfg, pdl),
                                        fp8.static_fp8_quant_config(t * h, 2)),
            "dynamic_scaled_fp8_quant": (lambda cfg, a: fp8._launch_dynamic_fp8_quant(a[0], cfg),
                                         fp8.dynamic_fp8_quant_single_config(t * h, 2) if t * h <= 8192 else None),
        }
        configs = _latency_configs(t, h)
        for name, (launch, default) in launchers.items():
            if ops_filter and name not in ops_filter:
                continue
            spec = by_name[name]
            args = spec.make_args(t, h, torch.bfloat16, device)
            torch._dynamo.reset()
            compiled = torch.compile(spec.ref, dynamic=False)
            expected = spec.ref(*args)
            compiled(*args)
            fns, correct = {"torch.compile(ref)": compiled}, {"torch.compile(ref)": True}
            if spec.exact and division_rounding_option():  # the bit-exact comparator (see the main table)
                compiled_rn = torch.compile(spec.ref, dynamic=False, options=division_rounding_option())
                correct["torch.compile(ref, div_rn)"] = _check(spec, compiled_rn(*args), expected)
                fns["torch.compile(ref, div_rn)"] = compiled_rn
            for cfg in [None] + list(dict.fromkeys(c for c in configs[name] if c != default)):
                label = str(default if cfg is None else cfg)
                try:
                    correct[label] = _check(spec, launch(cfg, args), expected)
                except Exception as e:  # a config Triton cannot build
                    print(f"sweep-small {name} {t}x{h} {cfg}: {type(e).__name__}: {e}", flush=True)
                    continue
                fns[label] = lambda *a, cfg=cfg, launch=launch: launch(cfg, a)
            if name != "dynamic_scaled_fp8_quant":  # the launcher's config without programmatic dependent launch
                label = f"{default} no PDL"
                correct[label] = _check(spec, launch(None, args, False), expected)
                fns[label] = lambda *a, launch=launch: launch(None, a, False)
            # All candidates and compile in one interleaved measurement: their differences are tens of ns.
            times = _time_interleaved(fns, args, spec.nbytes(t, h, 2))
            compile_us = times["torch.compile(ref)"]
            for label, us in times.items():
                rows.append({"op": name, "tokens": t, "hidden": h, "config": label, "us": round(us, 3),
                             "vs_compile": round(compile_us / us, 3), "default": label == str(default),
                             "correct": correct[label]})
                print(rows[-1], flush=True)
            save()


def save(name: str, rows: list, copy_gbps: float, device: str, out_dir: str | None, header: str | None = None,
         extra_notes: list[str] = ()) -> None:
    """The table (targets in its notes), CSV and plot of ``rows``; ``header``: the environment line of
    rows measured elsewhere (``merge``)."""
    notes = [
        f"device copy bandwidth (1 GiB copy, read + write): {copy_gbps:.0f} GB/s; pct_copy = ours GB/s / that",
        "bf16; MB = bytes the op must move at least (inputs once, outputs once)",
        f"all columns timed under CUDA-graph replay ({GRAPH_ITERS} calls per graph), inputs rotated over >= 256 MiB"
        if device == "cuda" else "CPU smoke run: wall clock, ours = the reference through torch.ops",
        *([f"at <= {LATENCY_TOKENS} tokens (the latency target) the columns are timed together instead: "
           f"{LATENCY_GRAPH_ITERS} calls per graph, one graph per column replayed in turn, median of "
           f"{LATENCY_ROUNDS} rounds; ours_no_pdl: ours with DYNAMO_ONCE_PDL=0 (no programmatic dependent "
           "launch; the launches are back to back, so PDL hides part of each one's latency)"]
         if device == "cuda" else []),
        "eager = the fp32 native reference; compile = torch.compile(reference, dynamic=False), one Inductor "
        "compile per tokens x hidden; compile_dyn = one compile per op and hidden with the token dim dynamic",
        f"rotary_embedding: hidden = n_q_heads x {HEAD_SIZE}, n_kv_heads = n_q_heads / 4, NeoX",
        "compile_exact (fp8 ops): torch.compile's output equals the reference bit for bit (ours must: "
        "correct); Triton's fp32 `/` is the approximate div.full.f32, ours the correctly rounded div_rn",
        "compile_rn (fp8 ops): torch.compile with Inductor's correctly rounded division option "
        f"({', '.join(division_rounding_option()) or 'not in this torch'}), the bit-exact comparator",
        *extra_notes,
        *targets(rows, copy_gbps),
    ]
    # Saved after every op, so a run cut short still leaves its results.
    common.write_results(name, rows, title="dynamo-once custom ops (bf16)", notes=notes, device=device,
                         out_dir=out_dir, header=header)
    common.plot_panels(name, rows, x="tokens", y="pct_copy", series="op", panel="hidden",
                       title=f"ours: % of copy bandwidth ({copy_gbps:.0f} GB/s), bf16, {header or common.env_header(device)}",
                       ylabel="% of copy bandwidth", logx=True, hlines={"85%": 85.0}, out_dir=out_dir)

def merge(dirs: list[str], out_dir: str | None) -> None:
    """One ``bench_ops`` table from the ``bench_ops.csv`` of each of ``dirs`` (parts of one CUDA run)."""
    rows, headers, part_copies = [], [], []
    for d in dirs:
        header, part = common.read_results(os.path.join(d, "bench_ops.csv"))
        headers.append(header)
        rows.extend(part)
        # pct_copy is against the part's own copy bandwidth: recover it from the rows (the largest ones
        # round least).
        big = max((r for r in part if r["pct_copy"]), key=lambda r: r["MB"])
        part_copies.append(big["ours_GBps"] / (big["pct_copy"] / 100))
    order = {s.name: i for i, s in enumerate(SPECS)}
    rows.sort(key=lambda r: (r["op"] not in BANDWIDTH_TARGET_OPS, order[r["op"]], r["hidden"], r["tokens"]))
    header = headers[0] + f" ({len(dirs)} parts on one machine, merged)"
    save("bench_ops", rows, sum(part_copies) / len(part_copies), "cuda", out_dir, header=header,
         extra_notes=[f"merged from {len(dirs)} parts ({', '.join(os.path.basename(d.rstrip('/')) for d in dirs)}), "
                      f"each with its own copy-bandwidth measurement ({', '.join(f'{c:.0f}' for c in part_copies)} "
                      "GB/s), against which its pct_copy is computed"])


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--quick", action="store_true", help="small sizes (default when there is no CUDA)")
    p.add_argument("--targets-only", action="store_true",
                   help=f"only the target sizes: tokens {TARGET_TOKENS} x hidden {TARGET_HIDDEN}, every op (~2-3 min)")
    p.add_argument("--no-dynamic", action="store_true", help="skip the compile_dyn column (one compile per op less)")
    p.add_argument("--sweep", action="store_true", help="only sweep the row kernels' (ROWS, num_warps) (CUDA)")
    p.add_argument("--sweep-small", action="store_true",
                   help="only time the latency configs at 1 and 16 tokens x every hidden size (CUDA, ~3 min): bench_ops_sweep_small.md")
    p.add_argument("--ops", default=",".join(s.name for s in SPECS))
    p.add_argument("--merge", nargs="+", metavar="DIR",
                   help="only merge the bench_ops.csv of parts run at the same time (e.g. --ops subsets on two "
                        "GPUs of one machine) into one table and plot in --out")
    args = p.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quick = args.quick or device == "cpu"
    if quick:
        tokens, hidden = [1, 16, 256], [2048]
    elif args.targets_only:
        tokens, hidden = TARGET_TOKENS, TARGET_HIDDEN
    else:
        tokens, hidden = TOKENS, HIDDEN
    names = [n.strip() for n in args.ops.split(",") if n.strip()]
    # compile_dyn: one compile per op and hidden size for every token count, 1 included (Dynamo would
    # specialize size 1). No effect on the static-shape compiles.
    import torch.fx.experimental._config as fx_config

    if hasattr(fx_config, "backed_size_oblivious"):
        fx_config.backed_size_oblivious = True
    name = "bench_ops" if not quick else f"bench_ops_quick_{device}"
    print(common.env_header(device), flush=True)
    if args.sweep:
        sweep(device, args.out)
        return
    if args.sweep_small:
        sweep_small(device, args.out, [n.strip() for n in args.ops.split(",") if n.strip()])
        return

    run(tokens, hidden, names, device, torch.bfloat16,
        lambda rows, copy_gbps: save(name, rows, copy_gbps, device, args.out), dynamic_column=not args.no_dynamic)


if __name__ == "__main__":
    main()
