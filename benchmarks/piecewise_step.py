"""The level-3 piecewise decode step alone: pieces replayed as CUDA graphs, attention eager between them.

A host-bound path whose timings drift by tens of percent between runs, so it prints the median of
several blocks and is meant to be run alternately against another checkout (``gpu_pass.sh comparepw``).
On a checkout from before ``dispatcher.CUDAGraphs`` (pieces captured on their second call) it times
that mechanism instead, which is what makes before/after comparisons possible.

Usage: ``python -m benchmarks.piecewise_step [--model llama-3.2-1b] [--batches 1,8,32,128] [--tag after]
[--cprofile STEPS]`` (prints one JSON line: the step's µs back to back, and ``host_us``, the host time of one step
launched on an idle GPU; GPU only; ``--cprofile``: where the host time of a step goes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from benchmarks import decode


def _step_fn(h: decode.Harness, graphs: object | None, b: int):
    """Capture the pieces' graphs at ``b`` tokens; the callable of one replayed step."""
    if graphs is None:  # the implicit mechanism of older checkouts: warm-up, then capture on the second call
        h.step()
        h.step()
        return h.step
    from dispatcher import CUDAGraphMode

    graphs.capture([b], CUDAGraphMode.PIECEWISE, lambda n: h.step())
    return lambda: graphs.run(CUDAGraphMode.PIECEWISE, b, lambda n: h.step())


def host_time(step, steps: int = 50) -> float:
    """Median µs of host time of one step launched on an idle GPU (synchronized before each, not inside the
    timing): the time to enqueue the step's launches. Near the step's GPU time, the path is host-bound."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def measure(model: str, batches: list[int], context: int = 512, blocks: int = 7, per_block: int = 30,
            cprofile: int = 0, hosts: dict[int, float] | None = None) -> dict[int, float]:
    """Median µs per piecewise decode step over ``blocks`` blocks of ``per_block`` steps, per batch size.
    ``cprofile``: then that many more steps under cProfile, each batch's top functions by own time printed.
    ``hosts``: filled with each batch's :func:`host_time`."""
    cfg = decode.mode_config("level 3 piecewise", True, batches)
    h = decode.Harness(model, cfg, max(batches), context, 0, torch.device("cuda"), torch.bfloat16)
    h.first_call(max(batches))
    try:
        from dispatcher import CUDAGraphs

        graphs = CUDAGraphs()
    except ImportError:
        graphs = None
    if graphs is not None and hasattr(h, "as_the_runner"):  # inputs and attention's outputs in place, as the engine
        h.as_the_runner(graphs, max(batches))
    out = {}
    for b in batches:
        h.set_decode(b)
        step = _step_fn(h, graphs, b)
        for _ in range(20):
            step()
        times = []
        for _ in range(blocks):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(per_block):
                step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / per_block * 1e6)
        out[b] = round(statistics.median(times), 1)
        if hosts is not None:
            hosts[b] = host_time(step)
        if cprofile:
            print(f"== cProfile, batch {b}: {cprofile} steps (host time; the GPU is not waited for in between)")
            print(_profile(step, cprofile), flush=True)
    return out


def _profile(step, steps: int, rows: int = 35) -> str:
    """The functions of ``steps`` back-to-back steps by their own time (cProfile), as text."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--tag", default="", help="a label printed with the result (e.g. after, before)")
    p.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                   help="after timing, profile STEPS more steps per batch (cProfile, functions by own time)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the piecewise step needs a CUDA GPU; torch.cuda.is_available() is False")
    try:
        batches = [int(v) for v in a.batches.split(",")]
    except ValueError:
        p.error(f"--batches: expected comma-separated integers; got {a.batches!r}")
    if a.cprofile < 0:
        p.error(f"--cprofile: expected a number of steps >= 0; got {a.cprofile}")
    hosts: dict[int, float] = {}
    times = measure(a.model, batches, cprofile=a.cprofile, hosts=hosts)
    print(json.dumps({"tag": a.tag, "model": a.model, "piecewise_us": times, "host_us": hosts}), flush=True)


if __name__ == "__main__":
    main()
