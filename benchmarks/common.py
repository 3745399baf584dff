"""Shared benchmark helpers: environment header, GPU timing, copy-bandwidth ceiling, tables, CSV, plots.

Every result file states the device, torch (and Triton) version and date. Files are written only
where ``--out`` says (the committed results live in ``benchmarks/results/``); tables and plots come
from ``models.reporting``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from models.reporting import (  # noqa: F401  (re-exported for the benchmark scripts)
    device_name,
    env_header,
    markdown_table,
    plot_lines,
    plot_panels,
    plot_stacked_bars,
    read_results,
    switches,
    utc_now,
    write_results,
)


def capture_graph(fn: Callable[[], Any], calls: int, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn``, after ``warmup`` calls on a side stream (as capture needs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def bench_gpu(fn: Callable[[], Any], *, warmup: int = 10, iters: int = 100, cuda_graph: bool = False,
              graph_iters: int = 20) -> float:
    """Median µs per call of ``fn`` on the current CUDA stream, timed with CUDA events.

    With ``cuda_graph=True``, ``graph_iters`` calls are captured into one CUDA
    graph and replays are timed, which removes CPU launch latency (the
    serving regime for small batches).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if cuda_graph:
        run, per = capture_graph(fn, graph_iters).replay, graph_iters
    else:
        run, per = fn, 1
    for _ in range(3):
        run()
    times = []
    for _ in range(max(5, iters // per)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / per)
    times.sort()
    return times[len(times) // 2]


def bench_gpu_interleaved(fns: dict[str, Callable[[], Any]], *, graph_iters: int = 128, rounds: int = 60,
                          warmup: int = 3) -> dict[str, float]:
    """Median µs per call of each ``fn`` under CUDA-graph replay, the graphs replayed in turn, round by round.

    For latency-bound kernels (about a microsecond a call) whose differences are tens of nanoseconds:
    ``graph_iters`` calls per graph make the events' own cost per call negligible, and replaying every
    graph in each round (in a rotated order) exposes them all to the same clock and temperature drift,
    which separate measurements, minutes apart, do not.
    """
    graphs = {name: capture_graph(fn, graph_iters, warmup) for name, fn in fns.items()}
    names = list(graphs)
    for name in names:  # one untimed replay each: clocks up, instruction caches warm
        graphs[name].replay()
    times: dict[str, list[float]] = {name: [] for name in names}
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in names]
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for (start, end), name in zip(events, order):
            start.record()
            graphs[name].replay()
            end.record()
        torch.cuda.synchronize()
        for (start, end), name in zip(events, order):
            times[name].append(start.elapsed_time(end) * 1e3 / graph_iters)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def bench_cpu(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 20) -> float:
    """Median µs per call of ``fn`` by wall clock (CPU runs, smoke tests of GPU benchmarks)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[len(times) // 2]


def bench(fn: Callable[[], Any], device: torch.device | str, **kwargs: Any) -> float:
    """:func:`bench_gpu` on CUDA (``kwargs`` passed on), else :func:`bench_cpu`."""
    if torch.device(device).type == "cuda":
        return bench_gpu(fn, **kwargs)
    return bench_cpu(fn)


def rotating(fn: Callable[..., Any], arg_sets: Sequence[tuple]) -> Callable[[], Any]:
    """A no-argument callable that calls ``fn`` on ``arg_sets[0]``, ``[1]``, ... in turn.

    Rotating through copies of the inputs whose total size exceeds the L2 cache
    keeps repeated calls (and CUDA-graph captures of them) reading from DRAM,
    as a layer of a real model does, instead of from a warm L2.
    """
    state = {"i": 0}

    def call() -> Any:
        args = arg_sets[state["i"] % len(arg_sets)]
        state["i"] += 1
        return fn(*args)

    return call


def copies_to_exceed_cache(nbytes: int, cache_bytes: int = 256 << 20, limit: int = 16) -> int:
    """Power-of-2 number of input copies whose total exceeds ``cache_bytes`` (H200 L2: 50 MiB; 5x that), at most ``limit``."""
    n = max(1, math.ceil(cache_bytes / max(nbytes, 1)))
    return min(1 << (n - 1).bit_length(), limit)


def measure_copy_bandwidth(nbytes: int = 2 << 30, device: str = "cuda", trials: int = 3) -> float:
    """Copy bandwidth in GB/s, counting bytes read plus bytes written (``nbytes`` in all): the best of ``trials``
    timings. The best, as a floor's ceiling must be: one timing on a GPU just woken read 5% low (3998 against the
    H200's usual 4200 GB/s), which would flatter every step measured against it."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = min(bench(lambda: dst.copy_(src), device, warmup=5, iters=20) for _ in range(trials))
    del src, dst
    return nbytes / (us * 1e-6) / 1e9


def int_list(p: argparse.ArgumentParser, flag: str, value: str, counts: bool = False) -> list[int]:
    """A flag's comma-separated positive integers (``counts``: integers >= 0, none at all allowed, as an optional
    flag's empty default), or the parser's error naming the flag (exit 2)."""
    vals = [v.strip() for v in value.split(",") if v.strip()]
    if counts and not all(v.isdigit() for v in vals):
        p.error(f"{flag}: expected comma-separated integers >= 0; got {value!r}")
    if not counts and (not vals or not all(v.isdigit() and int(v) > 0 for v in vals)):
        p.error(f"{flag}: expected comma-separated positive integers; got {value!r}")
    return [int(v) for v in vals]


def generate_exactly(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """``llm.generate`` of token-id ``prompts``, greedy, ``max_tokens`` each (``ignore_eos``); its wall seconds.
    Raises when it gave another number of tokens (a benchmark's tokens/s would be wrong)."""
    from models import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t0
    got = sum(len(o.token_ids) for o in outs)
    if got != max_tokens * len(prompts):
        raise RuntimeError(f"LLM.generate gave {got} tokens, not {max_tokens * len(prompts)}")
    return wall
