"""Where a warm start's trace and compile phases go: a model's level-3 start-up, cold then warm, each in a fresh
process, and one more warm start under cProfile.

The graph's size, not the weights, drives the trace (the AOT forward's rebuild, the split) and compile (the pieces'
fake run, Inductor's cache loads) phases, so on a CPU host a tiny Llama with the 8B's 32 layers stands in for it
(the default: ``tiny-llama`` with ``--layers 32``). On the GPU, ``--model llama-3-8b`` (no ``--layers``) measures
the real one. Prints one JSON line per start (``LLM.startup``'s phases, from ``benchmarks.decode``'s start-up
child), and with ``--profile`` the functions of dynamo-once, FX and Inductor that took longest in the warm start,
cumulative. Usage::

    OMP_NUM_THREADS=1 python -m benchmarks.startup_phases --profile          # CPU, tiny-llama x 32 layers
    python -m benchmarks.startup_phases --model llama-3-8b --profile        # GPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

# What the profile listing keeps: the library, and the parts of torch a warm start's phases run.
PROFILE_FILTER = ("dispatcher/|models/engine|split_module|_lazy_graph|fx/interpreter|graph_module.py|compile_fx|"
                  "autograd_cache|codecache|fake_tensor.py|output_code|async_compile|cpu_vec_isa|triton_heuristics")


def child(name: str, layers: int | None) -> None:
    """In this process: start ``name`` (with ``layers`` decoder layers, if given) as ``benchmarks.decode`` does."""
    from benchmarks import decode
    from models.registry import BUILTIN_MODELS

    if layers:
        config = dict(BUILTIN_MODELS[name])
        target = config["text_config"] if "text_config" in config else config
        target["num_hidden_layers"] = layers
        name = f"{name}-{layers}l"
        BUILTIN_MODELS[name] = config
    decode.startup_child(name)


def _run(argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"start-up failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line)


def measure(name: str, layers: int | None, warm_runs: int, profile: str | None) -> list[dict[str, Any]]:
    """Cold, ``warm_runs`` warm and (with ``profile``, a path) one profiled warm start, with caches of their own."""
    me = [sys.executable, "-m", "benchmarks.startup_phases", "--child", name, "--layers", str(layers or 0)]
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"), DYNAMO_ONCE_CACHE_DIR=os.path.join(cache, "ours"))
        env.pop("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", None)
        for kind in ["cold"] + ["warm"] * warm_runs:
            rows.append({"caches": kind, **_run(me, env)})
            print(json.dumps(rows[-1]), flush=True)
        if profile:
            argv = [sys.executable, "-m", "cProfile", "-o", profile, *me[1:]]
            rows.append({"caches": "warm, cProfile", **_run(argv, env)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def save(rows: list[dict[str, Any]], name: str, layers: int | None, out_dir: str) -> None:
    """The starts' phases as ``startup_phases_<cpu|cuda>.{md,csv,png}`` in ``out_dir``."""
    import torch

    from benchmarks import common

    device = "cuda" if torch.cuda.is_available() else "cpu"
    keep = ["caches", "model", "import_s", "load_s", "trace_s", "trace", "compile_s", "compile_cache", "capture_s",
            "ready_s", "first_token_s"]
    model = f"{name} with {layers} layers" if layers else name
    notes = [f"{model}, level 3; a fresh process a start; cold: empty Inductor, Triton and dynamo-once caches (a "
             "temporary directory), warm: the caches the cold start left; seconds (LLM.startup's phases)",
             f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}"]
    kept = [{k: r.get(k, "") for k in keep} for r in rows]
    common.write_results(f"startup_phases_{device}", kept, keep,
                         title="Start-up phases, cold and warm", notes=notes, device=device, out_dir=out_dir)
    plot(f"startup_phases_{device}", kept, out_dir)


def plot(name: str, rows: list[dict[str, Any]], out_dir: str | None) -> str | None:
    """``<name>.png``: a bar per start (model, caches), stacked by phase (``benchmarks.decode.plot_startup``)."""
    from benchmarks.decode import plot_startup

    return plot_startup(name, rows, out_dir)


def print_profile(path: str, limit: int) -> None:
    import pstats
    import re

    stats = pstats.Stats(path, stream=sys.stdout)
    stats.sort_stats("cumulative").print_stats(re.compile(PROFILE_FILTER), limit)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="a built-in model (models.registry)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (default: 32 for a tiny-* model, the model's own otherwise; 0: its own)")
    p.add_argument("--warm-runs", type=int, default=1)
    p.add_argument("--profile", nargs="?", const="warm_start.prof", default=None,
                   help="also a warm start under cProfile, written to this file (default warm_start.prof)")
    p.add_argument("--limit", type=int, default=60, help="functions listed from the profile")
    p.add_argument("--out", default=None, help="results folder for startup_phases_<device>.{md,csv,png} (nothing is "
                                               "written without it)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child, a.layers)
        return
    layers = a.layers if a.layers is not None else (32 if a.model.startswith("tiny-") else None)
    rows = measure(a.model, layers, a.warm_runs, a.profile)
    if a.out:
        save(rows, a.model, layers, a.out)
    if a.profile:
        print_profile(a.profile, a.limit)


if __name__ == "__main__":
    main()
