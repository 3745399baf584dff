"""A W8A8 MLP's gate-up GEMM, SiLU-and-mul and per-token quantization: fused (``ops.gated_scaled_mm_dynamic_quant``)
against the unfused ops, at decode sizes; or (``--dtype bf16``) a bf16 MLP's gate-up GEMM and SiLU-and-mul
(``ops.gated_linear``).

For each M of ``--ms`` on Llama-3-8B's gate-up shape (K = 4096, 2D = 28672), int8 (or ``--dtype fp8``) operands,
per-token activation and per-channel weight scales (``--quant static``: per-tensor scales, the static checkpoints'
layout), bf16 GEMM output, the activation quantized per token (or per tensor with ``--quant static``) to the
operands' dtype:

- ``unfused``: ``int8_scaled_mm`` then ``act_and_mul_dynamic_quant`` (what ``act_quant`` leaves in a graph);
  ``--quant static``: ``act_and_mul_static_quant`` with a per-tensor scale;
- ``gated``: the fused op as it runs (the gated form where ``ops.small_m_gemm.GATED_ROWS`` has a config, else the
  unfused ops);
- ``gated table``: the gated form with the small-M table's config for the shape, at every M;
- ``gated CONFIG``: the gated GEMM with each config of ``--configs`` (``BMxBNxBK[,wW][,sS]`` as
  ``benchmarks.gemm_step_ab``'s rules), then the quantization kernel.

``--dtype bf16`` (no quantization; ``--quant`` does not apply): ``unfused`` is ``ops.linear`` (the small-M kernel
where its table has a config, else cuBLAS) then ``ops.silu_and_mul``, ``unfused cublas`` ``F.linear`` then
``ops.silu_and_mul`` (Inductor's pair without the ``small_m_linear`` pass), ``gated`` ``ops.gated_linear`` (the gated
form where ``GATED_ROWS`` has a bf16 config, else ``unfused``), ``gated table`` / ``gated CONFIG`` the gated GEMM
alone. ``--model llama-3.2-1b`` takes the 1B's gate-up (K 2048, 2D 16384) instead of the 8B's.

Each variant is a CUDA graph of calls over rotating weight copies (every call reads its weight from HBM), the graphs
replayed in turn (``common.bench_gpu_interleaved``); µs a call and % of the copy bandwidth for the weight's bytes.

Usage: ``python -m benchmarks.gated_gemm [--ms 1,8,32,128] [--dtype int8|fp8|bf16] [--quant dynamic|static]
[--model llama-3-8b|llama-3.2-1b] [--configs "64x64x128,s5;128x64x128,w8,s3"] [--out DIR]`` (GPU only).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

import ops
from benchmarks import common
from benchmarks.gemm_step_ab import parse_config
from ops.gated_quant import launch_gated_quant
from ops.small_m_gemm import SmallMConfig, gated_config, small_m_gated_mm, small_m_gated_scaled_mm, table_row

SHAPES = {"llama-3-8b": (4096, 14336), "llama-3.2-1b": (2048, 8192)}  # (hidden K, intermediate D)
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def _operands(dtype: torch.dtype, m: int, copies: int, static: bool, k: int, d: int) -> list[tuple]:
    """``copies`` weights and one activation; 8-bit: per-token / per-channel scales, or with ``static`` per-tensor
    ones (the static checkpoints' layout: cuBLAS's fp8 GEMM takes another, faster path for it); bf16: none."""
    g = torch.Generator(device="cuda").manual_seed(0)
    if dtype == torch.bfloat16:
        a = torch.randn(m, k, generator=g, device="cuda").to(dtype)
        return [(a, (torch.randn(2 * d, k, generator=g, device="cuda") / k**0.5).to(dtype)) for _ in range(copies)]
    if dtype == torch.int8:
        a = torch.randint(-128, 128, (m, k), generator=g, device="cuda").to(dtype)
        ws = [torch.randint(-128, 128, (2 * d, k), generator=g, device="cuda").to(dtype) for _ in range(copies)]
    else:
        a = torch.randn(m, k, generator=g, device="cuda").to(dtype)
        ws = [torch.randn(2 * d, k, generator=g, device="cuda").to(dtype) for _ in range(copies)]
    a_scale = 1e-3 * (0.5 + torch.rand(1 if static else m, 1, generator=g, device="cuda"))
    w_scale = 1e-3 * (0.5 + torch.rand(1 if static else 2 * d, generator=g, device="cuda"))
    if static:
        a_scale = a_scale.reshape(1)
    return [(a, w, a_scale, w_scale) for w in ws]


def _bf16_variants(configs: list[tuple[str, SmallMConfig]]) -> dict[str, Callable]:
    def with_config(config: SmallMConfig | None) -> Callable[..., Any]:
        def run(a, w):
            return small_m_gated_mm(a, w, config or table_row(a.shape[0], w.shape[0], w.shape[1], a.dtype))
        return run

    return {"unfused": lambda a, w: ops.silu_and_mul(ops.linear(a, w)),
            "unfused cublas": lambda a, w: ops.silu_and_mul(F.linear(a, w)),
            "gated": ops.gated_linear, "gated table": with_config(None),
            **{f"gated {text}": with_config(c) for text, c in configs}}


def _variants(dtype: torch.dtype, static: bool, configs: list[tuple[str, SmallMConfig]]) -> dict[str, Callable]:
    if dtype == torch.bfloat16:
        return _bf16_variants(configs)
    gemm = ops.int8_scaled_mm if dtype == torch.int8 else ops.fp8_scaled_mm
    scale = torch.full((1,), 0.01, device="cuda")
    q = dtype  # the down projection's operands: the same dtype as gate-up's

    def unfused(a, w, a_scale, w_scale):
        out = gemm(a, w, a_scale, w_scale, torch.bfloat16)
        if static:
            return ops.act_and_mul_static_quant(out, scale, "silu", q)
        return ops.act_and_mul_dynamic_quant(out, "silu", q)

    def gated(a, w, a_scale, w_scale):
        if static:
            return ops.gated_scaled_mm_static_quant(a, w, a_scale, w_scale, torch.bfloat16, "silu", scale, q)
        return ops.gated_scaled_mm_dynamic_quant(a, w, a_scale, w_scale, torch.bfloat16, "silu", q)

    def with_config(config: SmallMConfig | None) -> Callable[..., Any]:
        def run(a, w, a_scale, w_scale):
            c = config or gated_config(table_row(a.shape[0], w.shape[0], w.shape[1], a.dtype), a.dtype)
            if static:
                return small_m_gated_scaled_mm(a, w, a_scale, w_scale, torch.bfloat16, c, scale, q)[0]
            return launch_gated_quant(*small_m_gated_scaled_mm(a, w, a_scale, w_scale, torch.bfloat16, c), q)
        return run

    return {"unfused": unfused, "gated": gated, "gated table": with_config(None),
            **{f"gated {text}": with_config(c) for text, c in configs}}


def measure(dtype: torch.dtype, static: bool, m: int, configs: list[tuple[str, SmallMConfig]], copy_gbps: float,
            shape: tuple[int, int]) -> list[dict]:
    k, d = shape
    weight_bytes = 2 * d * k * dtype.itemsize
    arg_sets = _operands(dtype, m, common.copies_to_exceed_cache(weight_bytes, limit=4), static, k, d)
    fns = {name: common.rotating(fn, arg_sets) for name, fn in _variants(dtype, static, configs).items()}
    times = common.bench_gpu_interleaved(fns, graph_iters=4 * len(arg_sets), rounds=30)
    quant = "none" if dtype == torch.bfloat16 else "static" if static else "dynamic"
    return [{"dtype": str(dtype).removeprefix("torch."), "quant": quant, "K": k, "N": 2 * d, "M": m,
             "variant": name, "us": round(us, 2),
             "pct_of_copy_bw": round(100 * weight_bytes / (us * 1e-6) / (copy_gbps * 1e9), 1),
             "vs_unfused": round(times["unfused"] / us, 3)} for name, us in times.items()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="1,8,32,128", help="M (tokens), comma-separated")
    p.add_argument("--dtype", default="int8", choices=tuple(DTYPES), help="the GEMM's operands (default int8)")
    p.add_argument("--quant", default="dynamic", choices=("dynamic", "static"),
                   help="the activation's quantization (per token, or per tensor with a fixed scale)")
    p.add_argument("--model", default="llama-3-8b", choices=tuple(SHAPES), help="whose gate-up shape (default 8B)")
    p.add_argument("--configs", default="", help="gated GEMM configs to time besides the table's, ';'-separated")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    ms = common.int_list(p, "--ms", a.ms)
    try:
        configs = [(text, parse_config(text)) for text in filter(None, a.configs.split(";"))]
    except ValueError as e:
        p.error(f"--configs: {e}")
    if any(c is None for _, c in configs):
        p.error("--configs: 'cublas' is no gated config")
    if not torch.cuda.is_available():
        p.error("the gated GEMM benchmark needs a CUDA GPU")
    copy_gbps, (k, d), bf16 = common.measure_copy_bandwidth(), SHAPES[a.model], a.dtype == "bf16"
    rows = [r for m in ms for r in measure(DTYPES[a.dtype], a.quant == "static", m, configs, copy_gbps, (k, d))]
    name = f"gated_gemm_{a.dtype}" + ("" if bf16 else f"_{a.quant}") + ("" if a.model == "llama-3-8b" else "_1b")
    layout = "per-tensor" if a.quant == "static" else "per-token activation / per-channel weight"
    what = ("bf16 operands and output, no quantization" if bf16 else
            f"{a.dtype} operands, {layout} scales, bf16 GEMM output, {a.quant} {a.dtype} quantization of the activation")
    common.write_results(name, rows, title="Gate-up GEMM + SiLU-and-mul (+ quantization): fused and unfused",
                         device="cuda", out_dir=a.out,
                         notes=[f"copy bandwidth {copy_gbps:.0f} GB/s; {a.model} gate-up (K {k}, 2D {2 * d}), {what}",
                                "gated table: the small-M table's config at that M whatever GATED_ROWS; gated: the op",
                                "us: µs a call, CUDA graphs over rotating weight copies replayed in turn; "
                                "pct_of_copy_bw: the weight's bytes; vs_unfused: unfused µs / this µs"])
    quant = "" if bf16 else f" + {a.quant} quant"
    common.plot_panels(name, rows, x="M", y="us", series="variant", panel=None, out_dir=a.out, logx=True,
                       title=f"Gate-up + SiLU{quant} ({a.dtype}, {a.model})", xlabel="M (tokens)", ylabel="µs a call")

if __name__ == "__main__":
    main(sys.argv[1:])
