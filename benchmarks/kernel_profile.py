"""Where a CUDA graph's time goes, kernel by kernel: the decode step of a model at level 3 (its whole-step graph),
or benchmarks.gemm's linear stack, replayed under torch.profiler (CUPTI records each kernel of a replayed graph).

Per graph it reports, per replay: the kernels (count, device µs), the span from the first kernel's start to the
last one's end, the idle time inside the span (no kernel running: launch gaps, dependency waits) and the kernels
that started before the one before them ended (launched early, under programmatic dependent launch); then the
kernels grouped by kind (GEMM, attention, the library's other Triton ops, Inductor's generated kernels, other)
and the top kernels by time. This is the profile the decode-kernel work (issue 16) steers by: at batch 1 a step
is a weight read, and every µs that is not a GEMM streaming weights is overhead.

Usage: ``python -m benchmarks.kernel_profile [--models llama-3-8b-fp8,llama-3-8b] [--batches 1,128]
[--prefill 2048] [--stack bf16,fp8] [--context 512] [--out DIR]``; CUDA only. Files (``kernel_profile.{md,csv}``, a row per
graph and kind, and ``kernel_profile_top.{md,csv}``) only with ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from benchmarks import common, gemm_step_ab
from dispatcher import compat

# Kernel kinds, the first pattern that matches a kernel's name wins.
KINDS = (
    ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitK|cublas|_small_m_", re.I)),
    ("attention", re.compile(r"_decode_split|_decode_merge|_prefill_kernel|_write_kv_cache|attention|paged", re.I)),
    ("inductor", re.compile(r"^triton_")),
    ("ops", re.compile(r"^_.*_kernel$")),
)


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def kernel_events(fn: Callable[[], Any], replays: int) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every CUDA kernel ``fn`` runs in ``replays`` back-to-back calls."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    out = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
           if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    return sorted(out, key=lambda e: e[1])


def _own_time(events: list[tuple[str, float, float]]) -> tuple[list[float], dict[str, float], dict[str, int]]:
    """Walks the union of kernel intervals (kernels of a stream overlap under PDL): each kernel's own time (the part
    of it no kernel before covered: what it adds to the busy time; a kernel launched early and waiting owns only
    what runs past its predecessor's end), the idle time right before each kind's kernels, and per kind the kernels
    that started before the ones before them ended."""
    own, end = [], None
    idle_before: dict[str, float] = defaultdict(float)
    early: dict[str, int] = defaultdict(int)
    for name, s, e in events:
        if end is not None and s < end:
            early[kind_of(name)] += 1
        elif end is not None:
            idle_before[kind_of(name)] += s - end
        own.append(max(0.0, e - max(s, end if end is not None else s)))
        end = e if end is None else max(end, e)
    return own, idle_before, early


def summarize(graph: str, events: list[tuple[str, float, float]], replays: int
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows per kind (and a ``total`` row with span and idle) and per kernel name, per replay."""
    own, idle_before, early = _own_time(events)
    busy = sum(own)
    span = (events[-1][2] - events[0][1]) if events else 0.0
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for (name, s, e), mine in zip(events, own):
        for table, key in ((by_kind, kind_of(name)), (by_name, name)):
            table[key][0] += 1
            table[key][1] += e - s
            table[key][2] += mine
    n = replays
    kinds = [{"graph": graph, "kind": "total", "kernels": round(len(events) / n, 1),
              "us": round(sum(e - s for _, s, e in events) / n, 1), "own_us": round(busy / n, 1),
              "span_us": round(span / n, 1), "idle_us": round((span - busy) / n, 1),
              "early": round(sum(early.values()) / n, 1)}]
    kinds += [{"graph": graph, "kind": k, "kernels": round(c / n, 1), "us": round(t / n, 1), "own_us": round(o / n, 1),
               "span_us": "", "idle_us": round(idle_before[k] / n, 1), "early": round(early[k] / n, 1)}
              for k, (c, t, o) in sorted(by_kind.items(), key=lambda kv: -kv[1][2])]
    top = [{"graph": graph, "kernel": name[:90], "kind": kind_of(name), "count": round(c / n, 1),
            "us": round(t / n, 1), "own_us": round(o / n, 1), "mean_us": round(t / c, 2)}
           for name, (c, t, o) in sorted(by_name.items(), key=lambda kv: -kv[1][2])[:25]]
    return kinds, top


def decode_graphs(name: str, batches: list[int], context: int, mode: str = "level 3"
                  ) -> dict[int, Callable[[], Any]]:
    """``name``'s decode step in ``mode`` (a level-3 mode of benchmarks.decode: ``level 3``, ``level 3 +ops``,
    ``level 3 +ops +passes``) at each batch as one whole-step CUDA graph replay (benchmarks.decode's); ``level 3
    piecewise``: the step on the piecewise path (each piece's graph replayed, attention launched eagerly between
    them, inputs and attention's outputs read in place, as benchmarks.decode's piecewise mode runs it)."""
    from benchmarks.decode import Harness, mode_config
    from dispatcher import CUDAGraphMode, CUDAGraphs

    device = torch.device("cuda")
    h = Harness(name, mode_config(mode, True, batches), max(batches), context, 0, device, torch.bfloat16)
    h.first_call(max(max(batches), 2))
    graphs = CUDAGraphs()
    graph_mode = CUDAGraphMode.FULL
    if mode == "level 3 piecewise":
        graph_mode = CUDAGraphMode.PIECEWISE
        h.as_the_runner(graphs, max(batches))
    current = [None]  # the harness's batch: a piecewise replay runs the pieces on the harness's inputs as they are

    def run(b: int) -> None:
        if current[0] != b:  # once a batch (kernel_events' first call, before it profiles)
            h.set_decode(b)
            current[0] = b
        graphs.run(graph_mode, b, lambda n: h.step())

    for b in batches:
        h.set_decode(b)
        graphs.capture([b], graph_mode, lambda n: h.step())
        current[0] = b
    return {b: lambda b=b: run(b) for b in batches}


def prefill_run(name: str, tokens: int, mode: str = "level 3") -> Callable[[], Any]:
    """``name``'s prefill of one ``tokens``-token prompt in ``mode`` (as ``benchmarks.decode``'s prefill rows run
    it: the compiled model called directly, its pieces and kernels launched from the host)."""
    from benchmarks.decode import Harness, mode_config

    h = Harness(name, mode_config(mode, True, [1]), 1, 0, tokens, torch.device("cuda"), torch.bfloat16)
    h.first_call(tokens)
    h.set_prefill(tokens)
    return h.step


@contextlib.contextmanager
def gemm_table(fp8_ours: bool, prefetch: int | None) -> Iterator[None]:
    """``ops.small_m_gemm.SMALL_M_TABLE`` for a variant: ``fp8_ours``, fp8 GEMMs up to ``SMALL_M_MAX`` take the
    kernel with int8's rows (same bytes a weight) where the table leaves them to cuBLAS; ``prefetch``, every row's
    ``PREFETCH``. The ops read the table at each call, so the captured graphs take the variant's kernels."""
    from ops import small_m_gemm as smg

    table = list(smg.SMALL_M_TABLE)
    if fp8_ours:
        table = [dataclasses.replace(r, dtypes=(torch.float8_e4m3fn,)) for r in table
                 if r.dtypes == (torch.int8,) and r.max_m <= smg.SMALL_M_MAX] + table
    if prefetch is not None:
        table = gemm_step_ab.with_prefetch(tuple(table), prefetch)
    with mock.patch.object(smg, "SMALL_M_TABLE", tuple(table)):
        yield


def stack_graph(dtype_name: str, impl: str, m: int) -> Callable[[], Any]:
    """benchmarks.gemm's Llama-3-8B linear stack at M = ``m`` for ``impl`` in one CUDA graph."""
    from benchmarks import gemm

    dtype = gemm.DTYPES[dtype_name]
    layers, lm_head = gemm.build_stack(gemm.LLAMA_3_8B, dtype, "cuda")
    step = gemm.stack_step(gemm.LLAMA_3_8B, impl, dtype, layers, lm_head, m, "cuda")
    with gemm.cublas_switch(impl):
        graph = common.capture_graph(step, 1)
    return graph.replay


def _inductor_pdl(p: argparse.ArgumentParser, value: int | None) -> str:
    """Set Inductor's PDL option for this run's compiles when ``--inductor-pdl`` is given (as a plugin sets an
    Inductor option); what the compiles then take, for the notes."""
    if value is None:
        has_option = compat.inductor_pdl_option() is not None
        return "as the library sets it" if has_option else "none (this torch has no option)"
    try:
        gemm_step_ab.set_inductor_pdl(bool(value))
    except ValueError as e:
        p.error(f"--inductor-pdl: {e}")
    return "on" if value else "off"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b-fp8,llama-3-8b", help="models whose decode step to profile")
    p.add_argument("--batches", default="1,128", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="cached tokens a sequence")
    p.add_argument("--stack", default="", help="also benchmarks.gemm's stack at M = 1 for these dtypes (bf16,fp8)")
    p.add_argument("--prefill", type=int, default=0, help="also each model's prefill of a prompt of this many "
                   "tokens (0: none)")
    p.add_argument("--replays", type=int, default=5, help="graph replays profiled")
    p.add_argument("--fp8-ours", action="store_true", help="fp8 GEMMs up to SMALL_M_MAX on the small-M kernel "
                                                           "everywhere (int8's rows where the table says cuBLAS)")
    p.add_argument("--prefetch", type=int, default=None, help="every small-M config's PREFETCH")
    p.add_argument("--mode", default="level 3",
                   help="the decode graphs' mode, a level-3 mode of benchmarks.decode: 'level 3' (native code), "
                        "'level 3 +ops' (the Triton ops), 'level 3 +ops +passes', 'level 3 +NAME' (pass NAME on), "
                        "...; 'level 3 piecewise': the step on the piecewise path (piece graphs, attention eager)")
    p.add_argument("--inductor-pdl", type=int, choices=(0, 1), default=None,
                   help="Inductor's kernels launched without (0) / with (1) programmatic dependent launch (its "
                        "triton.enable_pdl option; default: the library's, on at level 3 unless DYNAMO_ONCE_PDL=0)")
    p.add_argument("--variant", default=None, help="a benchmarks.gemm_step_ab variant in place for the run "
                   "(NAME=RULES: small-M table rules, prefetch=N, preload=N, attn_rule=..., ...)")
    p.add_argument("--tag", default="", help="a label for the graphs of this run (e.g. the variant)")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    if not (a.mode in ("level 3", "level 3 piecewise") or a.mode.startswith(("level 3 +", "level 3 -"))):
        p.error(f"--mode: expected a level-3 mode of benchmarks.decode ('level 3', 'level 3 piecewise', "
                f"'level 3 +ops', 'level 3 +NAME', ...); got {a.mode!r}")
    if a.variant is not None:
        try:
            gemm_step_ab.parse_variant(a.variant)
        except ValueError as e:
            p.error(f"--variant: {e}")
    if not torch.cuda.is_available():
        p.error("the kernel profile needs a CUDA GPU; torch.cuda.is_available() is False")
    print(common.env_header("cuda"), flush=True)
    inductor_pdl = _inductor_pdl(p, a.inductor_pdl)
    tag = f" {a.tag}" if a.tag else ""
    # builders, each of {label: graph replay}, built one at a time (a model's graphs freed before the next)
    builders: list[Callable[[], dict[str, Callable[[], Any]]]] = []
    for dt in [d for d in a.stack.split(",") if d]:
        builders += [lambda dt=dt, impl=impl: {f"stack {dt} {impl} M=1{tag}": stack_graph(dt, impl, 1)}
                   for impl in ("cuBLAS", "ours")]
    batches = common.int_list(p, "--batches", a.batches)
    for name in [m for m in a.models.split(",") if m]:
        builders.append(lambda name=name: {f"{name} decode b{b}{tag}": run for b, run
                                           in decode_graphs(name, batches, a.context, a.mode).items()})
        if a.prefill:
            builders.append(lambda name=name: {f"{name} prefill {a.prefill}{tag}": prefill_run(name, a.prefill,
                                                                                               a.mode)})
    kinds, tops = [], []
    with gemm_table(a.fp8_ours, a.prefetch), \
            gemm_step_ab.applied(a.variant) if a.variant is not None else contextlib.nullcontext():
        for build in builders:
            torch._dynamo.reset()
            for label, run in build().items():
                k, t = summarize(label, kernel_events(run, a.replays), a.replays)
                kinds += k
                tops += t
            torch.cuda.empty_cache()
        what = "step (piece graphs, attention eager)" if a.mode == "level 3 piecewise" else "whole-step graph"
        notes = [f"torch.profiler (CUDA activity) over {a.replays} back-to-back replays of each graph, per replay; "
                 f"decode: {a.mode} {what}, context {a.context}; prefill: the compiled model's call, no "
                 "graph; stack: benchmarks.gemm's 8B linear stack",
                 "span: first kernel start to last kernel end; idle: time in the span with no kernel running (a kind's "
                 "row: the idle time right before its kernels); early: kernels that started before the kernel before "
                 "them ended (launched early, programmatic dependent launch); us: the kernels' durations (under PDL "
                 "an early kernel's includes its wait); own_us: the part of each kernel no kernel before it covered "
                 "(its share of the span: total own_us + idle_us = span_us)",
                 f"variant: fp8 GEMMs {'on the small-M kernel at M <= 16' if a.fp8_ours else 'as the table says'}, "
                 f"PREFETCH {'as the table says' if a.prefetch is None else a.prefetch}, Inductor's PDL {inductor_pdl}"
                 + (f"; gemm_step_ab variant {a.variant}" if a.variant is not None else "")]
        common.write_results("kernel_profile", kinds, notes=notes, device="cuda", out_dir=a.out,
                             title="Kernel time by kind, per graph replay")
        common.write_results("kernel_profile_top", tops, notes=notes, device="cuda", out_dir=a.out,
                             title="Top kernels per graph replay")


if __name__ == "__main__":
    main()
