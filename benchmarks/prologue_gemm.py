"""Llama-3-8B's quantized layer chain at decode-sized M: each linear layer's producer as its own kernel, against the
producer in the GEMM's prologue (``ops.prologue_gemm``).

The chain, 32 layers with their own weights, then the bf16 lm_head, as ONE CUDA graph (replays timed with CUDA
events, median of ``--iters``): per layer, the fused-add RMSNorm + quantization before QKV, the attention output's
quantization before o_proj (the attention itself left out), the fused-add RMSNorm + quantization before gate-up,
SiLU-and-mul + quantization before down; the residual carried from layer to layer as in the model.

- ``unfused``: the library's fused producer ops (``ops.fused_add_rms_norm_*_quant``, ``ops.act_and_mul_*_quant``,
  the quant ops), then ``ops.fp8_scaled_mm`` / ``ops.int8_scaled_mm``: what a level-3 graph runs with the custom
  ops and the quant passes on;
- ``prologue``: ``ops.fused_add_rms_norm_quant_mm``, ``ops.quant_mm``, ``ops.act_and_mul_quant_mm`` (int8's per-token
  SiLU-and-mul stays unfused: the ops do not fuse it).

Schemes, as the built-in checkpoints: fp8 static per-tensor activations and weights; int8 per-token activations,
per-channel weights. ``pct_of_copy_bw``: the weight bytes / time / the copy bandwidth measured in the same run;
``launches``: kernels a layer in the graph; ``correct``: layer 0's output and residual against the unfused chain's
(``max_rel_diff``: the largest difference over the largest magnitude; correct within 2**-5: the GEMMs' fp32 sums
in other orders move bf16 roundings, and a rounding a step apart moves an 8-bit code by one, through four GEMMs;
later layers amplify such differences through random weights and are not compared).

Usage: ``python -m benchmarks.prologue_gemm [--ms 1,2,4,8,16] [--iters 20] [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

import ops
from benchmarks import common

prologue_gemm = importlib.import_module("ops.prologue_gemm")

BF16, FP8, INT8 = torch.bfloat16, torch.float8_e4m3fn, torch.int8
SCHEMES = {"fp8": FP8, "int8": INT8}
IMPLS = ("unfused", "prologue")
EPS = 1e-5
# (layers, hidden, qkv out, intermediate, vocab)
LLAMA_3_8B = (32, 4096, 6144, 14336, 128256)
QUICK = (2, 256, 384, 512, 1024)


def _weight(dtype: torch.dtype, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=g, device="cuda", dtype=BF16) / k**0.5
    if dtype == FP8:
        q, s = ops.dynamic_scaled_fp8_quant(w)
        return q, s.reshape(1)
    q, s = ops.dynamic_scaled_int8_quant(w)
    return q, s.reshape(-1)


def build(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[list[dict[str, Any]], torch.Tensor]:
    layers, h, qkv, inter, vocab = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for _ in range(layers):
        out.append({"qkv": _weight(dtype, qkv, h, g), "o": _weight(dtype, h, h, g),
                    "gate_up": _weight(dtype, 2 * inter, h, g), "down": _weight(dtype, h, inter, g),
                    "norm1": 1 + 0.1 * torch.randn(h, generator=g, device="cuda", dtype=BF16),
                    "norm2": 1 + 0.1 * torch.randn(h, generator=g, device="cuda", dtype=BF16)})
    return out, torch.randn(vocab, h, generator=g, device="cuda", dtype=BF16) / h**0.5


def _mm(q: torch.Tensor, w: tuple, a_scale: torch.Tensor) -> torch.Tensor:
    mm = ops.fp8_scaled_mm if w[0].dtype == FP8 else ops.int8_scaled_mm
    return mm(q, w[0], a_scale, w[1], BF16)


def _norm_mm_unfused(x, r, norm, w, a_scale):
    qd = w[0].dtype
    if a_scale is None:
        q, scale, s = ops.fused_add_rms_norm_dynamic_quant(x, r, norm, EPS, qd)
        return _mm(q, w, scale), s
    q, s = ops.fused_add_rms_norm_static_quant(x, r, norm, EPS, a_scale, qd)
    return _mm(q, w, a_scale), s


def _quant_unfused(x, w, a_scale):
    if w[0].dtype == FP8:
        if a_scale is None:
            q, scale = ops.dynamic_per_token_scaled_fp8_quant(x)
            return _mm(q, w, scale)
        return _mm(ops.static_scaled_fp8_quant(x, a_scale), w, a_scale)
    if a_scale is None:
        q, scale = ops.dynamic_scaled_int8_quant(x)
        return _mm(q, w, scale)
    return _mm(ops.static_scaled_int8_quant(x, a_scale), w, a_scale)


def _act_unfused(x, w, a_scale):
    if a_scale is None:
        q, scale = ops.act_and_mul_dynamic_quant(x, "silu", w[0].dtype)
        return _mm(q, w, scale)
    return _mm(ops.act_and_mul_static_quant(x, a_scale, "silu", w[0].dtype), w, a_scale)


def layer(impl: str, p: dict[str, Any], x: torch.Tensor, r: torch.Tensor, a_scale: torch.Tensor | None):
    """One decoder layer's linear chain (attention left out: its output is taken as q/k/v's first columns)."""
    h = x.shape[1]
    if impl == "unfused":
        qkv, r = _norm_mm_unfused(x, r, p["norm1"], p["qkv"], a_scale)
        o = _quant_unfused(qkv[:, :h].contiguous(), p["o"], a_scale)
        gu, r = _norm_mm_unfused(o, r, p["norm2"], p["gate_up"], a_scale)
        return _act_unfused(gu, p["down"], a_scale), r
    qkv, r = ops.fused_add_rms_norm_quant_mm(x, r, p["norm1"], EPS, a_scale, *p["qkv"], BF16)
    o = ops.quant_mm(qkv[:, :h].contiguous(), a_scale, *p["o"], BF16)
    gu, r = ops.fused_add_rms_norm_quant_mm(o, r, p["norm2"], EPS, a_scale, *p["gate_up"], BF16)
    if a_scale is None:
        return _act_unfused(gu, p["down"], None), r
    return ops.act_and_mul_quant_mm(gu, "silu", a_scale, *p["down"], BF16), r


def chain(impl: str, layers: list, lm_head: torch.Tensor, m: int,
          dtype: torch.dtype) -> Callable[[], list[torch.Tensor]]:
    h = lm_head.shape[1]
    g = torch.Generator(device="cuda").manual_seed(m)
    x0 = torch.randn(m, h, generator=g, device="cuda", dtype=BF16)
    r0 = torch.randn(m, h, generator=g, device="cuda", dtype=BF16)
    a_scale = torch.tensor([8.0 / 448.0], device="cuda") if dtype == FP8 else None

    base, _, prefetch = impl.partition(" sp")

    def step() -> list[torch.Tensor]:
        x, r = x0, r0
        first = []
        with _stage_prefetch(int(prefetch) if prefetch else None):
            for i, p in enumerate(layers):
                x, r = layer(base, p, x, r, a_scale)
                first = [x, r] if i == 0 else first
        normed, _ = ops.fused_add_rms_norm(x, r, layers[-1]["norm1"], EPS)
        return first + [F.linear(normed, lm_head)]

    return step


@contextlib.contextmanager
def _stage_prefetch(steps: int | None) -> Iterator[None]:
    """``ops.prologue_gemm.STAGE_PREFETCH`` set to ``steps`` for the block (None: as it is)."""
    if steps is None:
        yield
        return
    with mock.patch.object(prologue_gemm, "STAGE_PREFETCH", steps):
        yield


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _weight_bytes(shape: tuple[int, ...]) -> int:
    layers, h, qkv, inter, vocab = shape
    return layers * (h * qkv + h * h + 2 * inter * h + inter * h) + 2 * vocab * h


def _launches(step: Callable[[], list[torch.Tensor]], layers: int) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return round(len(kernels) / layers, 1)


def run(shape: tuple[int, ...], ms: list[int], iters: int, copy_gbps: float,
        impls: tuple[str, ...] = IMPLS) -> list[dict[str, Any]]:
    rows = []
    nbytes = _weight_bytes(shape)
    for name, dtype in SCHEMES.items():
        layers, lm_head = build(shape, dtype)
        for m in ms:
            steps = {impl: chain(impl, layers, lm_head, m, dtype) for impl in impls}
            outs = {impl: s()[:2] for impl, s in steps.items()}
            times = {impl: common.bench_gpu(s, warmup=2, iters=iters, cuda_graph=True, graph_iters=1)
                     for impl, s in steps.items()}
            for impl in impls:
                diff = max(_rel_diff(o, ref) for o, ref in zip(outs[impl], outs["unfused"]))
                rows.append({"scheme": name, "impl": impl, "M": m, "us": round(times[impl], 1),
                             "pct_of_copy_bw": round(100 * nbytes / (times[impl] * 1e-6) / (copy_gbps * 1e9), 1),
                             "speedup": round(times["unfused"] / times[impl], 3),
                             "launches": _launches(steps[impl], shape[0]), "max_rel_diff": f"{diff:.2e}",
                             "correct": diff <= 2.0**-5})
                print(rows[-1], flush=True)
        del layers, lm_head
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="1,2,4,8,16", help="M (tokens) of the chain runs")
    p.add_argument("--iters", type=int, default=20, help="graph replays timed per run (median)")
    p.add_argument("--stage-prefetch", default="", help="also time the prologue with these STAGE_PREFETCH values "
                                                          "(rows 'prologue spN'), e.g. 0,4,16")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 layers: checks the harness")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    ms = common.int_list(p, "--ms", a.ms)
    sps = [v.strip() for v in a.stage_prefetch.split(",") if v.strip()]
    if not all(v.isdigit() for v in sps):
        p.error(f"--stage-prefetch: expected comma-separated integers >= 0; got {a.stage_prefetch!r}")
    extra = tuple(f"prologue sp{v}" for v in sps)
    if not torch.cuda.is_available():
        p.error("the prologue GEMM benchmark needs a CUDA GPU; torch.cuda.is_available() is False")
    shape = QUICK if a.quick else LLAMA_3_8B
    print(common.env_header("cuda"), flush=True)
    copy_gbps = common.measure_copy_bandwidth(device="cuda")
    rows = run(shape, ms, a.iters, copy_gbps, IMPLS + extra)
    name = "prologue_gemm" + ("_quick" if a.quick else "")
    notes = [f"copy bandwidth {copy_gbps:.0f} GB/s; {shape[0]} layers (hidden {shape[1]}, qkv {shape[2]}, "
             f"intermediate {shape[3]}) + bf16 lm_head {shape[4]}, distinct weights per layer; one CUDA graph of the "
             f"chain, median of {a.iters} replays; attention left out",
             "fp8: static per-tensor activations and weights; int8: per-token activations, per-channel weights "
             "(its SiLU-and-mul + per-token quant stays unfused in both rows)",
             f"speedup: unfused / this row; launches: kernels a layer (profiler); prologue: STAGE_PREFETCH = "
             f"{prologue_gemm.STAGE_PREFETCH} loop steps of weights prefetched into L2 before stage 1, spN: N"]
    common.write_results(name, rows, title="8B quantized layer chain: producer kernels against the GEMM prologue",
                         notes=notes, device="cuda", out_dir=a.out)
    common.plot_panels(name, rows, x="M", y="us", series="impl", panel="scheme", logx=True, out_dir=a.out,
                       title=f"8B quantized chain ({common.device_name('cuda')})", xlabel="M (tokens)",
                       ylabel="µs a step (one CUDA graph)")


if __name__ == "__main__":
    main()
