"""Does prefetching a GEMM's weights into L2 during a latency-bound kernel make the GEMM faster?

A decode step at batch 1 runs attention (a few µs, a few MB of KV) between the QKV and o projections, leaving
HBM idle. This benchmark stands a spin kernel of ``--waits`` µs on one SM (``torch.cuda._sleep``) in for that
kernel and times, in CUDA graphs of many layers (distinct weights each, so every layer's weights start in HBM):

- ``none``: wait, then the GEMM at M = ``--m``;
- ``line`` / ``bulk``: :func:`l2_prefetch` of the GEMM's weights (that form) launched before the wait;
- ``line_side``: the line prefetch on a forked stream, alongside the wait (no launch on the main path);
- ``wait`` / ``wait_line``: the wait alone, and with the prefetch, without the GEMM (what the GEMM adds).

The prefetch kernels only issue requests, fire and forget (they read nothing into registers, write nothing):
``line`` is one ``prefetch.global.L2`` a 128-byte line, ``bulk`` one ``cp.async.bulk.prefetch.L2`` (Hopper's
TMA) a 16 KiB chunk. Measured on the H200 (results/l2_prefetch.md) they do not pay: the prefetch itself runs at
near full bandwidth (2.5-4.6 µs for 17-25 MB), and the GEMM after it is no faster; on a side stream it saves
at most 0.3-0.7 µs a layer. So the library has no prefetch op; this benchmark keeps the experiment.

Shapes: the 8B's o_proj and QKV in fp8 (``torch._scaled_mm``, per-tensor scales) and bf16, the 1B's in bf16.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import bench_gpu_interleaved, write_results
from ops.triton_utils import cdiv, tl, triton

SHAPES = {  # name: (dtype, N, K)
    "8b-fp8 o": (torch.float8_e4m3fn, 4096, 4096),
    "8b-fp8 qkv": (torch.float8_e4m3fn, 6144, 4096),
    "8b-bf16 o": (torch.bfloat16, 4096, 4096),
    "1b-bf16 o": (torch.bfloat16, 2048, 2048),
    "1b-bf16 qkv": (torch.bfloat16, 3072, 2048),
}

_LINE = 128  # bytes an L2 line
_LINES_A_PROGRAM = 1024  # the line form: addresses a program (8 a thread at 4 warps)
_BULK_CHUNK = 16384  # the bulk form: bytes a request
_BULK_A_PROGRAM = 32  # the bulk form: requests a program (one warp)


@triton.jit
def _l2_prefetch_line_kernel(ptr, nbytes, LINES: tl.constexpr, LINE: tl.constexpr):
    offs = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * LINE
    base = ptr.to(tl.pointer_type(tl.uint8))
    addr = base + tl.minimum(offs, nbytes - 1)  # clamped: a valid address (a repeat of the last line is free)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_bulk_kernel(ptr, nbytes, CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    offs = (tl.program_id(0) * CHUNKS + tl.arange(0, CHUNKS)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK)  # <= 0 past the end: the request is skipped
    size = tl.maximum(size, 0).to(tl.int32) // 16 * 16
    base = ptr.to(tl.pointer_type(tl.uint8))
    addr = base + tl.minimum(offs, nbytes - 1)
    tl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.gt.s32 p, $2, 0;\n\t@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\t"
        "mov.u32 $0, 0;\n\t}", "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, form: str) -> None:
    """Ask for contiguous CUDA tensor ``t``'s bytes to be read into L2 (``form``: ``"line"`` or ``"bulk"``, the
    latter sm_90+); returns once the requests are launched."""
    nbytes = t.numel() * t.element_size()
    if form == "line":
        grid = (cdiv(cdiv(nbytes, _LINE), _LINES_A_PROGRAM),)
        _l2_prefetch_line_kernel[grid](t, nbytes, LINES=_LINES_A_PROGRAM, LINE=_LINE, num_warps=4)
    else:
        grid = (cdiv(cdiv(nbytes, _BULK_CHUNK), _BULK_A_PROGRAM),)
        _l2_prefetch_bulk_kernel[grid](t, nbytes, CHUNKS=_BULK_A_PROGRAM, CHUNK=_BULK_CHUNK, num_warps=1)


@triton.jit
def _gemv_kernel(a_ptr, w_ptr, out_ptr, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One row of a: each program a BLOCK_N x K slab of w, every load of it unrolled (issued up front), one
    # [BLOCK_N, BLOCK_K] fp32 accumulator reduced once at the end.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k in tl.static_range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :])
        a = tl.load(a_ptr + offs_k)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty))


def _gemv(x: torch.Tensor, spec: str) -> Any:
    bn, bk, warps = (int(v) for v in spec.split("x"))

    def call(w: torch.Tensor) -> torch.Tensor:
        n, k = w.shape
        o = torch.empty(n, device="cuda", dtype=torch.bfloat16)
        _gemv_kernel[(n // bn,)](x, w, o, K=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
        return o
    return call


def _cycles_per_us() -> float:
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(2_000_000)
    end.record()
    end.synchronize()
    return 2_000_000 / (start.elapsed_time(end) * 1e3)


def _gemm(dtype: torch.dtype, n: int, k: int, m: int, layers: int, impl: str) -> tuple[list[torch.Tensor], Any]:
    ws = [torch.randn(n, k, device="cuda").to(dtype) for _ in range(layers)]
    x = torch.randn(m, k, device="cuda").to(dtype)
    if impl != "cublas":  # checked against a float reference first
        gemv = _gemv(x, impl)
        got, want = gemv(ws[0]).float(), (x.float() @ ws[0].float().t()).flatten()
        if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item()):
            raise SystemExit(f"gemv {impl}: wrong result for a {n}x{k} {dtype} weight")
        return ws, gemv
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device="cuda")
        return ws, lambda w: torch._scaled_mm(x, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return ws, lambda w: F.linear(x, w)


def _variants(ws: list[torch.Tensor], gemm: Any, cycles: int) -> dict[str, Any]:
    state = {"i": 0}
    side = torch.cuda.Stream()

    def layer(pf: str | None, with_gemm: bool, on_side: bool = False) -> Any:
        def call() -> None:
            w = ws[state["i"] % len(ws)]
            state["i"] += 1
            if pf and on_side:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    l2_prefetch(w, pf)
            elif pf:
                l2_prefetch(w, pf)
            torch.cuda._sleep(cycles)
            if pf and on_side:
                torch.cuda.current_stream().wait_stream(side)
            if with_gemm:
                gemm(w)
        return call

    return {"none": layer(None, True), "line": layer("line", True), "bulk": layer("bulk", True),
            "line_side": layer("line", True, on_side=True), "wait": layer(None, False),
            "wait_line": layer("line", False)}


def run(shapes: list[str], waits: list[float], m: int, layers: int, rounds: int,
        impls: list[str]) -> list[dict[str, Any]]:
    cpu = _cycles_per_us()
    rows = []
    for name, impl in [(s, i) for s in shapes for i in impls]:
        dtype, n, k = SHAPES[name]
        ws, gemm = _gemm(dtype, n, k, m, layers, impl)
        for wait in waits:
            t = bench_gpu_interleaved(_variants(ws, gemm, int(wait * cpu)), graph_iters=layers, rounds=rounds)
            base = t["none"]
            for v in ("none", "line", "bulk", "line_side"):
                rows.append({"shape": name, "impl": impl, "M": m, "wait_us": wait, "variant": v,
                             "layer_us": round(t[v], 2),
                             "gemm_us": round(t[v] - t["wait"], 2), "saved_us": round(base - t[v], 2),
                             "weight_MB": round(n * k * ws[0].element_size() / 1e6, 1)})
                print(rows[-1], flush=True)
            rows.append({"shape": name, "impl": impl, "M": m, "wait_us": wait, "variant": "wait_line",
                         "layer_us": round(t["wait_line"], 2), "gemm_us": 0.0,
                         "saved_us": round(t["wait"] - t["wait_line"], 2), "weight_MB": 0.0})
        del ws
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {list(SHAPES)}")
    p.add_argument("--waits", default="0,2,4,7,10", help="µs of the stand-in latency-bound kernel")
    p.add_argument("--m", type=int, default=1, help="the GEMM's rows")
    p.add_argument("--impls", default="cublas", help="comma-separated: cublas, or gemv:BLOCK_NxBLOCK_KxWARPS "
                   "(a Triton GEMV, M = 1 only)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default=None, help="directory for the table, CSV and plot (default: print only)")
    a = p.parse_args(argv)
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        p.error(f"--shapes: expected names of {list(SHAPES)}; got {bad}")
    try:
        waits = [float(v) for v in a.waits.split(",") if v.strip()]
    except ValueError:
        waits = []
    if not waits or any(w < 0 for w in waits):
        p.error(f"--waits: expected comma-separated non-negative µs; got {a.waits!r}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    impls = [i.strip().removeprefix("gemv:") for i in a.impls.split(",") if i.strip()]
    if any(i != "cublas" and (len(i.split("x")) != 3 or not all(v.isdigit() for v in i.split("x"))) for i in impls):
        p.error(f"--impls: expected cublas or gemv:BNxBKxW entries; got {a.impls!r}")
    if any(i != "cublas" for i in impls) and a.m != 1:
        p.error(f"--impls: the GEMV takes M = 1 only; got --m {a.m}")
    rows = run(shapes, waits, a.m, a.layers, a.rounds, impls)
    notes = ["µs a layer (wait + GEMM) in CUDA graphs of --layers layers with distinct weights, median over rounds",
             "gemm_us: layer_us less the wait alone; saved_us: none's layer_us less this variant's"]
    write_results("l2_prefetch", rows, title="L2 prefetch of a GEMM's weights during a latency-bound kernel",
                  notes=notes, out_dir=a.out)


if __name__ == "__main__":
    main()
