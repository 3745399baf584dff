"""An attention layer's QKV GEMM and the rotary embedding of its q and k: fused (``ops.rope_linear``) against the
unfused ops, at decode sizes.

For each M of ``--ms`` on the QKV shape of ``--model`` (Llama-3-8B: K 4096, 32 + 2 x 8 heads of 128; Llama-3.2-1B:
K 2048, 32 + 2 x 8 heads of 64), bf16:

- ``unfused``: ``ops.linear`` (the small-M kernel where its table has a config, else cuBLAS), then
  ``ops.rotary_embedding`` on its q and k (what the custom ops on run; with them off Inductor fuses the rotation
  into one kernel of its own);
- ``fused``: ``ops.rope_linear`` as it runs (the fused GEMV at one token, else the GEMM and the rotary kernel in
  place);
- ``fused gemv``: the fused GEMV (``rope_small_m_mm`` with the table's M = 1 tile) at every M: a program a row, each
  reading the weights again (from L2);
- ``fused dot``: the fused dot tile (``DOT_CANDIDATE``: 16 rows, 32 column pairs) at every M, for the 2-16 tokens
  the op leaves to the unfused pair (measured faster than ``unfused`` alone on the H100, but slower in the step than
  cuBLAS then Inductor's rotary: see ``ops.rope_linear``).

Each variant is a CUDA graph of calls over rotating weight copies (every call reads its weight from HBM), the graphs
replayed in turn (``common.bench_gpu_interleaved``); µs a call and % of the copy bandwidth for the weight's bytes.

Usage: ``python -m benchmarks.rope_linear [--ms 1,2,4,8,16] [--model llama-3-8b|llama-3.2-1b] [--out DIR]`` (GPU
only).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch

import ops
from benchmarks import common
from ops.rope_linear import rope_small_m_mm
from ops.small_m_gemm import SmallMConfig

SHAPES = {"llama-3-8b": (4096, 128, 32, 8), "llama-3.2-1b": (2048, 64, 32, 8)}  # K, head size, q heads, kv heads
#: The dot tile timed at every M: 16 rows, 32 column pairs (a divisor of both models' half heads), the small-M table's
#: 16-row tile depth and stages.
DOT_CANDIDATE = SmallMConfig(16, 64, 128, num_warps=4, num_stages=4)


def _operands(m: int, copies: int, k: int, d: int, heads: int) -> list[tuple]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    pos = torch.randint(0, 8192, (m,), generator=g, device="cuda")
    cache = ops.compute_cos_sin_cache(d, 8192, dtype=torch.bfloat16, device="cuda")
    return [(x, (torch.randn(heads * d, k, generator=g, device="cuda") / k**0.5).bfloat16(), pos, cache)
            for _ in range(copies)]


def _variants(d: int, hq: int, hk: int) -> dict[str, Callable[..., Any]]:
    q_cols, k_cols = hq * d, hk * d

    def unfused(x, w, pos, cache):
        out = ops.linear(x, w)
        return ops.rotary_embedding(pos, out[:, :q_cols], out[:, q_cols:q_cols + k_cols], cache, d)

    def gemv(x, w, pos, cache):
        config = ops.small_m_config(1, w.shape[0], w.shape[1], x.dtype)
        return rope_small_m_mm(x, w, pos, cache, d, hq + hk, config)

    def dot(x, w, pos, cache):
        return rope_small_m_mm(x, w, pos, cache, d, hq + hk, DOT_CANDIDATE)

    return {"unfused": unfused, "fused": lambda x, w, pos, cache: ops.rope_linear(x, w, pos, cache, d, hq + hk),
            "fused gemv": gemv, "fused dot": dot}


def measure(model: str, m: int, copy_gbps: float) -> list[dict]:
    k, d, hq, hk = SHAPES[model]
    weight_bytes = (hq + 2 * hk) * d * k * 2
    arg_sets = _operands(m, common.copies_to_exceed_cache(weight_bytes, limit=8), k, d, hq + 2 * hk)
    fns = {name: common.rotating(fn, arg_sets) for name, fn in _variants(d, hq, hk).items()}
    times = common.bench_gpu_interleaved(fns, graph_iters=4 * len(arg_sets), rounds=30)
    return [{"model": model, "M": m, "variant": name, "us": round(us, 2),
             "pct_of_copy_bw": round(100 * weight_bytes / (us * 1e-6) / (copy_gbps * 1e9), 1),
             "vs_unfused": round(times["unfused"] / us, 3)} for name, us in times.items()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="1,2,4,8,16", help="M (tokens), comma-separated")
    p.add_argument("--model", default="llama-3-8b", choices=tuple(SHAPES), help="whose QKV shape (default the 8B)")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    ms = common.int_list(p, "--ms", a.ms)
    if not torch.cuda.is_available():
        p.error("the rope_linear benchmark needs a CUDA GPU")
    k, d, hq, hk = SHAPES[a.model]
    if ops.small_m_config(1, (hq + 2 * hk) * d, k, torch.bfloat16) is None:
        p.error(f"--model {a.model}: the small-M table has no bf16 GEMV row for its QKV shape: nothing to fuse")
    copy_gbps = common.measure_copy_bandwidth()
    rows = [r for m in ms for r in measure(a.model, m, copy_gbps)]
    name = "rope_linear" + ("" if a.model == "llama-3-8b" else "_1b")
    common.write_results(name, rows, title="QKV GEMM + rotary embedding of q and k: fused and unfused",
                         device="cuda", out_dir=a.out,
                         notes=[f"copy bandwidth {copy_gbps:.0f} GB/s; {a.model} QKV (K {k}, {hq} + 2 x {hk} heads of "
                                f"{d}), bf16, positions drawn from 0-8191",
                                "us: µs a call, CUDA graphs over rotating weight copies replayed in turn; "
                                "pct_of_copy_bw: the weight's bytes; vs_unfused: unfused µs / this µs"])
    common.plot_panels(name, rows, x="M", y="us", series="variant", panel=None, out_dir=a.out, logx=True,
                       title=f"QKV + rotary ({a.model})", xlabel="M (tokens)", ylabel="µs a call")


if __name__ == "__main__":
    main(sys.argv[1:])
