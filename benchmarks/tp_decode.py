"""Tensor parallelism end to end (issue 17): ``LLM.generate``'s decode step and a prefill at TP=1 and TP=N.

For each model (built-in random weights, level 3, CUDA graphs, NCCL between the ranks) and each
``--tp`` size: one ``models.LLM``; per batch size B, B prompts of 16 tokens and 64 new tokens, greedy,
``LLM.generate`` twice (the first warms up), the median decode step of the second (``LLM.stats``: host
scheduling, input copies, graph replays on every rank, sampling); then one ``--prefill``-token prompt, its
one step timed around ``LLM.generate(prompt, 1)`` (median of 5). Every size gets a fresh LLM: the TP=1 row
is the baseline of the same harness.

Usage: ``python -m benchmarks.tp_decode [--models llama-3-8b] [--tp 1,2] [--out DIR]`` (two GPUs for TP=2);
``--quick`` runs tiny-llama on the CPU at TP 1 and 2 (gloo) to check the harness.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

from benchmarks import common

PROMPT, NEW = 16, 64


def bench(name: str, tp: int, batches: list[int], prefill: int, device: str, dtype: torch.dtype
          ) -> list[dict[str, Any]]:
    from models import LLM

    max_b = max(batches)
    t0 = time.perf_counter()
    llm = LLM(name, level=3, tensor_parallel_size=tp, max_num_tokens=max(512, max_b, prefill), max_num_seqs=max_b,
              dtype=dtype, device=device, num_cache_tokens=max(max_b * (PROMPT + NEW + 16), prefill + 16))
    start_s = time.perf_counter() - t0
    rows = []
    vocab = min(1000, llm.vocab_size - 1)
    try:
        for b in batches:
            prompts = [[(7 * i + j) % vocab + 1 for j in range(PROMPT)] for i in range(b)]
            llm.generate(prompts, NEW)  # warm-up
            llm.generate(prompts, NEW)
            rows.append(dict(model=name, tp=tp, what="decode step", batch=b,
                             us=round(llm.stats.median_decode_step_s * 1e6, 1), start_s=round(start_s, 1)))
            print(rows[-1], flush=True)
        prompt = [(3 * j) % vocab + 1 for j in range(prefill)]
        llm.generate([prompt], 1)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            llm.generate([prompt], 1)
            times.append(time.perf_counter() - t)
        rows.append(dict(model=name, tp=tp, what=f"prefill {prefill} (generate, 1 token)", batch=1,
                         us=round(statistics.median(times) * 1e6, 1), start_s=round(start_s, 1)))
        print(rows[-1], flush=True)
    finally:
        llm.close()
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b")
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="tiny-llama on the CPU (gloo), TP 1 and 2")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        tps = [int(t) for t in a.tp.split(",")]
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError:
        p.error(f"--tp and --batches: expected comma-separated integers; got {a.tp!r} and {a.batches!r}")
    if a.quick:
        device, dtype, names, batches, prefill = "cpu", torch.float32, ["tiny-llama"], [1, 4], 64
    else:
        if torch.cuda.device_count() < max(tps):
            p.error(f"--tp {max(tps)} needs that many GPUs; {torch.cuda.device_count()} visible")
        device, dtype, names, prefill = "cuda", torch.bfloat16, a.models.split(","), a.prefill
    rows: list[dict[str, Any]] = []
    for name in names:
        for tp in tps:
            rows += bench(name, tp, batches, prefill, device, dtype)
            common.write_results("tp_decode" + ("_quick" if a.quick else ""), rows, device=torch.device(device),
                                 out_dir=a.out, title="Tensor parallel: LLM.generate decode step and prefill",
                                 notes=[f"level 3, CUDA graphs; {PROMPT}-token prompts, {NEW} new tokens, greedy; "
                                        "us: the median decode step of LLM.generate (end to end), or the prefill "
                                        "call's wall time (median of 5)",
                                        "start_s: LLM(...) with every rank's load, compile and capture"])
    return rows


if __name__ == "__main__":
    main()
