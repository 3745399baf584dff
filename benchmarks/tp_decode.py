"""Tensor parallelism end to end (issue 17): ``LLM.generate``'s decode step and a prefill at TP=1 and TP=N.

For each model (built-in random weights, level 3, CUDA graphs, NCCL between the ranks) and each
``--tp`` size: one ``models.LLM``; per batch size B, B prompts of 16 tokens and 64 new tokens, greedy,
``LLM.generate`` twice (the first warms up), the median decode step of the second (``LLM.stats``: host
scheduling, input copies, graph replays on every rank, sampling); then one ``--prefill``-token prompt, its
one step timed around ``LLM.generate(prompt, 1)`` (median of 5). Every size gets a fresh LLM: the TP=1 row
is the baseline of the same harness.

``--sp`` (issue 17's sequence-parallel rewrite): for each TP > 1, the prefill alone (no decode unless
``--batches`` names some) in three configurations, each compiled for exactly the prefill's token count
(``compile_sizes``) with the fused-add pass: ``plain`` (the all-reduces), ``sp`` (pass ``sequence_parallel``:
reduce-scatter, norm on the rank's tokens, all-gather, the GEMMs fused with their collectives through torch's
symmetric-memory ops), ``sp, no async`` (the same rewrite, plain GEMMs and NCCL collectives:
``DYNAMO_ONCE_ASYNC_TP=0``), and ``plain, one graph`` / ``sp, one graph``: the model compiled as one graph
(``splitting_ops=[]``, no CUDA graphs), where the residual stays a shard from the first layer to the final norm
instead of being gathered where each piece ends at attention (``--variants`` picks some, ';'-separated). The pass rewrites compiles of at least the prefill's size
(``DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS``); NVLink multicast stays off (the LLM's workers set it).

Usage: ``python -m benchmarks.tp_decode [--models llama-3-8b] [--tp 1,2] [--sp] [--out DIR]`` (two GPUs for
TP=2); ``--quick`` runs tiny-llama on the CPU at TP 1 and 2 (gloo) to check the harness.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch

from benchmarks import common

PROMPT, NEW = 16, 64


_SP = "+fused_add_rms_norm,+sequence_parallel"
#: one graph: no split at attention (the residual stays a shard through every layer; no CUDA graphs, which the
#: prefill does not replay anyway)
_ONE_GRAPH = {"splitting_ops": [], "cudagraph_mode": "none"}
#: ``--sp`` configurations: label -> (pass switches, environment, other config fields)
SP_VARIANTS = {
    "plain": ("+fused_add_rms_norm", {}, {}),
    "sp": (_SP, {"DYNAMO_ONCE_ASYNC_TP": "1"}, {}),
    "sp, no async": (_SP, {"DYNAMO_ONCE_ASYNC_TP": "0"}, {}),
    "plain, one graph": ("+fused_add_rms_norm", {}, _ONE_GRAPH),
    "sp, one graph": (_SP, {"DYNAMO_ONCE_ASYNC_TP": "1"}, _ONE_GRAPH),
}


def sp_config(passes: str, prefill: int, fields: dict[str, Any]) -> Any:
    """Level 3 compiled for the prefill's exact size too, with ``passes``; the rewrite from that size on."""
    from dispatcher import CompilationConfig

    os.environ["DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS"] = str(prefill)  # the workers inherit it
    return CompilationConfig.from_env(level=3, pass_config=passes, compile_sizes=[prefill], **fields)


def bench(name: str, tp: int, batches: list[int], prefill: int, device: str, dtype: torch.dtype,
          config: Any = None, variant: str = "") -> list[dict[str, Any]]:
    from dispatcher.passes import pass_counter
    from models import LLM

    max_b = max(batches, default=1)
    before = pass_counter.snapshot()  # rank 0's rewrites from start-up on: compile_sizes are compiled there
    t0 = time.perf_counter()
    llm = LLM(name, level=3, tensor_parallel_size=tp, max_num_tokens=max(512, max_b, prefill), max_num_seqs=max_b,
              dtype=dtype, device=device, num_cache_tokens=max(max_b * (PROMPT + NEW + 16), prefill + 16),
              compilation_config=config, enable_prefix_caching=False)
    start_s = time.perf_counter() - t0
    rows = []
    tag = dict(variant=variant) if variant else {}
    vocab = min(1000, llm.vocab_size - 1)
    try:
        for b in batches:
            prompts = [[(7 * i + j) % vocab + 1 for j in range(PROMPT)] for i in range(b)]
            llm.generate(prompts, NEW)  # warm-up
            llm.generate(prompts, NEW)
            rows.append(dict(model=name, tp=tp, **tag, what="decode step", batch=b,
                             us=round(llm.stats.median_decode_step_s * 1e6, 1), start_s=round(start_s, 1)))
            print(rows[-1], flush=True)
        prompt = [(3 * j) % vocab + 1 for j in range(prefill)]
        llm.generate([prompt], 1)
        if variant:  # none where a compile cache served the graph
            tag["sp_rewrites"] = (pass_counter.snapshot().matches["sequence_parallel"]
                                  - before.matches["sequence_parallel"])
        times = []
        for _ in range(5):
            t = time.perf_counter()
            llm.generate([prompt], 1)
            times.append(time.perf_counter() - t)
        rows.append(dict(model=name, tp=tp, **tag, what=f"prefill {prefill} (generate, 1 token)", batch=1,
                         us=round(statistics.median(times) * 1e6, 1), start_s=round(start_s, 1)))
        print(rows[-1], flush=True)
    finally:
        llm.close()
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def plot(name: str, rows: list[dict[str, Any]], sp: bool, out_dir: str | None) -> str | None:
    """``<name>.png``: without ``sp``, µs per decode step against the batch, a line per model and TP size (the
    prefill rows are in the table); with ``sp``, a bar per TP size and variant, its prefill's ms."""
    if sp:
        bars = [dict(r, tp=f"TP={r['tp']}", variant=r.get("variant") or "?", ms=float(r["us"]) / 1e3)
                for r in rows if str(r["what"]).startswith("prefill")]
        return common.plot_stacked_bars(name, bars, label=("model", "tp", "variant"), parts=("ms",), out_dir=out_dir,
                                        title=f"Tensor parallel {str(bars[0]['what']).split(' (')[0] if bars else 'prefill'}"
                                              " tokens: plain against sequence parallel", ylabel="ms")
    lines = [dict(batch=int(r["batch"]), us=float(r["us"]), line=f"{r['model']}, TP={r['tp']}")
             for r in rows if r["what"] == "decode step"]
    return common.plot_lines(name, lines, x="batch", y="us", series="line", logx=True, out_dir=out_dir,
                             title="Tensor parallel: LLM.generate's median decode step", xlabel="batch (sequences)",
                             ylabel="µs per decode step")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    p.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,32,128; none with --sp)")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="tiny-llama on the CPU (gloo), TP 1 and 2")
    p.add_argument("--sp", action="store_true", help="TP > 1: the prefill with the sequence-parallel rewrite against "
                   "without (module docstring); decode only for --batches given")
    p.add_argument("--variants", default=";".join(SP_VARIANTS), help="--sp: the configurations, ';'-separated")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        tps = [int(t) for t in a.tp.split(",")]
        spec = a.batches if a.batches is not None else ("" if a.sp else "1,8,32,128")
        batches = [int(b) for b in spec.split(",") if b.strip()]
    except ValueError:
        p.error(f"--tp and --batches: expected comma-separated integers; got {a.tp!r} and {a.batches!r}")
    if a.quick:
        device, dtype, names, prefill = "cpu", torch.float32, ["tiny-llama"], 64
        batches = [] if a.sp and a.batches is None else [1, 4]
    else:
        if torch.cuda.device_count() < max(tps):
            p.error(f"--tp {max(tps)} needs that many GPUs; {torch.cuda.device_count()} visible")
        device, dtype, names, prefill = "cuda", torch.bfloat16, a.models.split(","), a.prefill
    rows: list[dict[str, Any]] = []
    labels = [v.strip() for v in a.variants.split(";") if v.strip()]
    if a.sp and not set(labels) <= set(SP_VARIANTS):
        p.error(f"--variants: expected ';'-separated labels among {list(SP_VARIANTS)}; got {a.variants!r}")
    runs = [(tp, "", None) for tp in tps] if not a.sp else [
        (tp, label, SP_VARIANTS[label]) for tp in tps if tp > 1 for label in labels]
    for name in names:
        for tp, label, variant in runs:
            config = None
            if variant is not None:
                os.environ.update(variant[1])
                config = sp_config(variant[0], prefill, variant[2])
            rows += bench(name, tp, batches, prefill, device, dtype, config, label)
            stem = "tp_decode" + ("_sp" if a.sp else "") + ("_quick" if a.quick else "")
            common.write_results(stem, rows, device=torch.device(device),
                                 out_dir=a.out, title="Tensor parallel: LLM.generate decode step and prefill",
                                 notes=[f"level 3, CUDA graphs; {PROMPT}-token prompts, {NEW} new tokens, greedy; "
                                        "us: the median decode step of LLM.generate (end to end), or the prefill "
                                        "call's wall time (median of 5)",
                                        "start_s: LLM(...) with every rank's load, compile and capture"]
                                 + (["sp_rewrites: the sequence-parallel pass's rewrites in rank 0's compile for "
                                     "the prefill size, from its start-up to the first prefill (0 also when a compile "
                                     "cache served that graph: no pass runs then)"] if a.sp else []))
            plot(stem, rows, a.sp, a.out)
    return rows


if __name__ == "__main__":
    main()
