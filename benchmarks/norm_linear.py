"""A residual add, its RMSNorm and the linear layer after it: fused (``ops.norm_linear``) against the unfused ops, at
decode sizes.

For each M of ``--ms`` on the QKV (plain) and gate-up (gated) shapes of ``--model`` (Llama-3-8B: K 4096, QKV 6144,
gate-up 28672; Llama-3.2-1B: K 2048, 3072, 16384), bf16:

- ``unfused``: ``ops.fused_add_rms_norm`` (its Triton kernel), then ``ops.linear`` / ``ops.gated_linear`` (the small-M
  GEMV at one token; in a level-3 step Inductor's own add + norm kernel stands for the first);
- ``fused``: ``ops.norm_linear`` as it runs (the fused GEMV at one token, else the unfused ops);
- ``fused rows R``: the fused GEMV (``norm_small_m_mm`` with the table's M = 1 tile) on at least R weight rows a
  program, for each R of ``--rows`` (the op's: ``NORM_MIN_ROWS``), at one token.

Each variant is a CUDA graph of calls over rotating weight copies (every call reads its weight from HBM), the graphs
replayed in turn (``common.bench_gpu_interleaved``); µs a call and % of the copy bandwidth for the weight's bytes.

Usage: ``python -m benchmarks.norm_linear [--ms 1,8] [--rows 2,4,8,16] [--model llama-3-8b|llama-3.2-1b] [--out DIR]``
(GPU only).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

import ops
from benchmarks import common
from ops.norm_linear import NORM_MIN_ROWS, norm_small_m_mm
from ops.small_m_gemm import gated_runtime_config, runtime_config

SHAPES = {"llama-3-8b": (4096, 6144, 28672), "llama-3.2-1b": (2048, 3072, 16384)}  # K, QKV rows, gate-up rows
EPS = 1e-5


def _operands(m: int, copies: int, k: int, n: int) -> list[tuple]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(m, k, generator=g, device="cuda").bfloat16() for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, generator=g, device="cuda")).bfloat16()
    return [(x, r, nw, (torch.randn(n, k, generator=g, device="cuda") / k**0.5).bfloat16()) for _ in range(copies)]


def _variants(gated: bool, m: int, rows: list[int]) -> dict[str, Callable[..., Any]]:
    def unfused(x, r, nw, w):
        normed, h = ops.fused_add_rms_norm(x, r, nw, EPS)
        return (ops.gated_linear(normed, w) if gated else ops.linear(normed, w)), h

    def fused_rows(min_rows: int) -> Callable[..., Any]:
        def run(x, r, nw, w):
            config = gated_runtime_config(x, w) if gated else runtime_config(x, w, max_m=1)
            return norm_small_m_mm(x, r, nw, w, EPS, config, gated, min_rows)
        return run

    variants = {"unfused": unfused, "fused": lambda x, r, nw, w: ops.norm_linear(x, r, nw, w, EPS, gated)}
    return variants | ({f"fused rows {n}": fused_rows(n) for n in rows} if m == 1 else {})


def measure(model: str, gated: bool, m: int, rows: list[int], copy_gbps: float) -> list[dict]:
    k, n_qkv, n_gate_up = SHAPES[model]
    n = n_gate_up if gated else n_qkv
    weight_bytes = n * k * 2
    arg_sets = _operands(m, common.copies_to_exceed_cache(weight_bytes, limit=8), k, n)
    fns = {name: common.rotating(fn, arg_sets) for name, fn in _variants(gated, m, rows).items()}
    times = common.bench_gpu_interleaved(fns, graph_iters=4 * len(arg_sets), rounds=30)
    return [{"model": model, "layer": "gate-up" if gated else "qkv", "M": m, "variant": name, "us": round(us, 2),
             "pct_of_copy_bw": round(100 * weight_bytes / (us * 1e-6) / (copy_gbps * 1e9), 1),
             "vs_unfused": round(times["unfused"] / us, 3)} for name, us in times.items()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="1,8", help="M (tokens), comma-separated")
    p.add_argument("--rows", default=f"2,4,{NORM_MIN_ROWS},16",
                   help="weight rows a program of the fused GEMV's variants at one token (powers of 2)")
    p.add_argument("--model", default="llama-3.2-1b", choices=tuple(SHAPES), help="whose shapes (default the 1B)")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    ms, rows = common.int_list(p, "--ms", a.ms), common.int_list(p, "--rows", a.rows)
    if any(r & (r - 1) for r in rows):
        p.error(f"--rows: powers of 2; got {a.rows!r}")
    if not torch.cuda.is_available():
        p.error("the norm_linear benchmark needs a CUDA GPU")
    copy_gbps = common.measure_copy_bandwidth()
    out = [r for gated in (False, True) for m in ms for r in measure(a.model, gated, m, rows, copy_gbps)]
    name = "norm_linear" + ("" if a.model == "llama-3-8b" else "_1b")
    k, n_qkv, n_gate_up = SHAPES[a.model]
    common.write_results(name, out, title="Residual add + RMSNorm + linear: fused and unfused", device="cuda",
                         out_dir=a.out,
                         notes=[f"copy bandwidth {copy_gbps:.0f} GB/s; {a.model} QKV ({k} -> {n_qkv}) and gate-up "
                                f"({k} -> {n_gate_up}, SiLU-and-mul after it), bf16",
                                "us: µs a call, CUDA graphs over rotating weight copies replayed in turn; "
                                "pct_of_copy_bw: the weight's bytes; vs_unfused: unfused µs / this µs"])
    common.plot_panels(name, out, x="M", y="us", series="variant", panel="layer", out_dir=a.out, logx=True,
                       title=f"add + RMSNorm + linear ({a.model})", xlabel="M (tokens)", ylabel="µs a call")


if __name__ == "__main__":
    main(sys.argv[1:])
