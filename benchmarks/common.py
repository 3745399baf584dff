"""Shared benchmark helpers: environment header, GPU timing, copy-bandwidth ceiling, tables, CSV, plots.

Every result file states the device, torch (and Triton) version and date.
Results go to ``benchmarks/results/`` unless ``out_dir`` is given.
"""

from __future__ import annotations

import csv
import datetime
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_name(device: torch.device | str | None = None) -> str:
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {cpu} ({os.cpu_count()} cores)"


def env_header(device: torch.device | str | None = None) -> str:
    """One line: device, torch, Triton (if importable), Python, UTC date."""
    try:
        import triton

        tri = f", triton {triton.__version__}"
    except ImportError:
        tri = ""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"{device_name(device)}, torch {torch.__version__}{tri}, Python {platform.python_version()}, "
            f"{date}")


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


def measure_copy_bandwidth(nbytes: int = 2 << 30, device: str = "cuda") -> float:
    """Copy bandwidth in GB/s, counting bytes read plus bytes written (``nbytes`` in all)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = bench(lambda: dst.copy_(src), device, warmup=3, iters=20)
    del src, dst
    return nbytes / (us * 1e-6) / 1e9


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) and abs(v) < 1e-2 and v != 0 else str(v)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    columns = list(columns or (rows[0].keys() if rows else []))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def write_results(name: str, rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None, *,
                  title: str = "", notes: Sequence[str] = (), device: torch.device | str | None = None,
                  out_dir: str | None = None, header: str | None = None) -> str:
    """Print a Markdown table and save ``<name>.csv`` and ``<name>.md``; returns the Markdown.

    ``header`` replaces the environment line (for rows measured elsewhere and assembled here).
    """
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    columns = list(columns or (rows[0].keys() if rows else []))
    header = header or env_header(device)
    md = "\n".join([f"# {title or name}", "", header, "", markdown_table(rows, columns), "",
                    *[f"- {n}" for n in notes]]) + "\n"
    print(md)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out_dir, f"{name}.csv"), "w", newline="") as f:
        f.write(f"# {header}\n")
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return md


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'dynamo-once[bench]')")
        return None
    return plt


def _draw(ax: Any, rows: Sequence[dict[str, Any]], x: str, y: str, series: str, logx: bool, logy: bool,
          hlines: dict[str, float] | None) -> None:
    """One line per value of ``series`` (rows without ``y`` skipped), dashed ``hlines``, log axes."""
    for s in dict.fromkeys(r[series] for r in rows):
        pts = [(r[x], r[y]) for r in rows if r[series] == s and r[y] not in ("", None)]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=str(s))
    for label, value in (hlines or {}).items():
        ax.axhline(value, linestyle="--", color="gray")
        ax.annotate(label, (0.01, value), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)


def plot_panels(name: str, rows: Sequence[dict[str, Any]], *, x: str, y: str, series: str, panel: str | None,
                title: str = "", xlabel: str = "", ylabel: str = "", logx: bool = False, logy: bool = False,
                hlines: dict[str, float] | None = None, out_dir: str | None = None) -> str | None:
    """Save ``<name>.png``: one subplot per value of ``panel`` (side by side, shared y; ``None``: one plot),
    each with ``y`` against ``x``, one line per value of ``series``. None without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    panels = list(dict.fromkeys(r[panel] for r in rows)) if panel else [None]
    width = 5 * len(panels) if panel else 8
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 5 if panel is None else 4.5), sharey=True,
                             squeeze=False)
    for ax, p in zip(axes[0], panels):
        _draw(ax, [r for r in rows if panel is None or r[panel] == p], x, y, series, logx, logy, hlines)
        if panel is not None:
            ax.set_title(f"{panel} = {p}", fontsize=9)
        ax.set_xlabel(xlabel or x)
    axes[0][0].set_ylabel(ylabel or y)
    axes[0][-1].legend(fontsize=8 if panel is None else 7)
    if panel is None:
        axes[0][0].set_title(title or name, fontsize=10)
    else:
        fig.suptitle(title or name, fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_lines(name: str, rows: Sequence[dict[str, Any]], *, x: str, y: str, series: str, **kwargs: Any) -> str | None:
    """Save ``<name>.png``: ``y`` against ``x``, one line per value of ``series`` (one panel of :func:`plot_panels`)."""
    return plot_panels(name, rows, x=x, y=y, series=series, panel=None, **kwargs)
