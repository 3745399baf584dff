"""The level-3 piecewise decode step alone: pieces replayed as CUDA graphs, attention eager between them.

A host-bound path whose timings drift by tens of percent between runs, so it prints the median of
several blocks and is meant to be run alternately against another checkout (``gpu_pass.sh comparepw``).
On a checkout from before ``dispatcher.CUDAGraphs`` (pieces captured on their second call) it times
that mechanism instead, which is what makes before/after comparisons possible.

Usage: ``python -m benchmarks.piecewise_step [--model llama-3.2-1b] [--batches 1,8,32,128] [--tag after]``
(prints one JSON line; GPU only).
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


def measure(model: str, batches: list[int], context: int = 512, blocks: int = 7, per_block: int = 30) -> dict[int, float]:
    """Median µs per piecewise decode step over ``blocks`` blocks of ``per_block`` steps, per batch size."""
    cfg = decode.mode_config("level 3 piecewise", True, batches)
    h = decode.Harness(model, cfg, max(batches), context, 0, torch.device("cuda"), torch.bfloat16)
    h.first_call(max(batches))
    try:
        from dispatcher import CUDAGraphs

        graphs = CUDAGraphs()
    except ImportError:
        graphs = None
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
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--tag", default="", help="a label printed with the result (e.g. after, before)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the piecewise step needs a CUDA GPU; torch.cuda.is_available() is False")
    try:
        batches = [int(v) for v in a.batches.split(",")]
    except ValueError:
        p.error(f"--batches: expected comma-separated integers; got {a.batches!r}")
    print(json.dumps({"tag": a.tag, "model": a.model, "piecewise_us": measure(a.model, batches)}), flush=True)


if __name__ == "__main__":
    main()
