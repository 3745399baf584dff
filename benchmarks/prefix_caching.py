"""``LLM.generate`` over prompts that share a long prefix (a system prompt), without and with prefix caching.

Each of ``--prompts`` prompts is the same ``--shared-len`` random token ids followed by ``--unique-len`` of its own;
each generates ``--max-tokens`` (``ignore_eos``, greedy), at most ``--max-num-tokens`` tokens a step (longer prompts
in chunks) and ``--max-num-seqs`` sequences in flight. For each model (built-in random weights) one ``LLM`` without
the cache and one with ``enable_prefix_caching=True``, each warmed up first on the same workload built around
another prefix (the same steps' shapes: their compiles, graphs and the Triton kernels' first-use compiles), after
which the prefix cache is reset. Reported per run: the prompt tokens computed and found cached
(``LLM.stats.num_cached_tokens``), the steps, their median and slowest, wall seconds and output tokens/s of the
call, and how the two runs' outputs compare: prompts with the same tokens, with the same first token, the mean
length of the tokens they agree on before the first difference, and the largest difference between the runs'
log-probabilities of the first token (greedy on random weights: the logits are nearly flat, so a cached prefix's
values differing from a whole prefill's in the last bits can turn a near-tie; the first token's log-probabilities
say whether the cached run computes the same distribution).

Usage: ``python -m benchmarks.prefix_caching [--models llama-3.2-1b,llama-3-8b] [--out DIR]``; ``--quick`` runs
tiny-llama on the CPU to check the harness.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from typing import Any

import torch

from benchmarks import common

COLUMNS = ["model", "prefix_caching", "prompts", "shared_len", "unique_len", "max_tokens", "prompt_tokens",
           "computed_prompt_tokens", "cached_tokens", "steps", "median_step_ms", "slowest_step_ms", "total_s",
           "tokens_per_s",
           "same_tokens", "same_first_token", "mean_agreeing_tokens", "first_logprob_max_diff"]


def workload(vocab: int, a: argparse.Namespace, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(a.shared_len)]
    return [shared + [rng.randrange(vocab) for _ in range(a.unique_len)] for _ in range(a.prompts)]


def run(name: str, caching: bool, a: argparse.Namespace, device: torch.device, dtype: torch.dtype
        ) -> tuple[dict[str, Any], list[Any]]:
    """One LLM's warm-up and timed call: its row and its tokens."""
    from models import LLM, SamplingParams

    llm = LLM(name, level=a.level, max_num_tokens=a.max_num_tokens, max_num_seqs=a.max_num_seqs, dtype=dtype,
              device=device, num_cache_tokens=a.max_num_seqs * (a.shared_len + a.unique_len + a.max_tokens + 32),
              enable_prefix_caching=caching)
    common.generate_exactly(llm, workload(llm.vocab_size, a, seed=1), a.max_tokens)
    llm.reset_prefix_cache()
    prompts = workload(llm.vocab_size, a)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True, logprobs=5)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t0
    stats, tokens = llm.stats, [list(o.token_ids) for o in outs]
    outs = [(list(o.token_ids), o.logprobs[0]) for o in outs]
    if sum(map(len, tokens)) != a.max_tokens * a.prompts:
        raise RuntimeError(f"LLM.generate gave {sum(map(len, tokens))} tokens, not {a.max_tokens * a.prompts}")
    cached, total = stats.num_cached_tokens, sum(len(p) for p in prompts)
    row = dict(model=name, prefix_caching="on" if caching else "off", prompts=a.prompts, shared_len=a.shared_len,
               unique_len=a.unique_len, max_tokens=a.max_tokens, prompt_tokens=total,
               computed_prompt_tokens=total - cached, cached_tokens=cached, steps=stats.num_steps,
               median_step_ms=round(statistics.median(stats.step_times_s) * 1e3, 3),
               slowest_step_ms=round(max(stats.step_times_s) * 1e3, 3), total_s=round(wall, 3),
               tokens_per_s=round(a.max_tokens * a.prompts / wall, 1))
    del llm
    gc.collect()
    return row, outs


def agreement(off: list[Any], on: list[Any]) -> dict[str, Any]:
    """How the run with the cache's outputs compare with the run without it (per prompt: tokens, first logprobs)."""
    def leading(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))

    n = len(off)
    # The off run's first token, as each run scores it (inf: outside the other run's top logprobs)
    diffs = [abs(lp_off[x[0]] - lp_on.get(x[0], float("-inf"))) for (x, lp_off), (_, lp_on) in zip(off, on)]
    return dict(same_tokens=f"{sum(x == y for (x, _), (y, _) in zip(off, on))}/{n}",
                same_first_token=f"{sum(x[0] == y[0] for (x, _), (y, _) in zip(off, on))}/{n}",
                mean_agreeing_tokens=round(sum(leading(x, y) for (x, _), (y, _) in zip(off, on)) / n, 1),
                first_logprob_max_diff=round(max(diffs), 4))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--shared-len", type=int, default=1024, help="tokens every prompt starts with")
    p.add_argument("--unique-len", type=int, default=64, help="tokens of each prompt's own after them")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-tokens", type=int, default=512, help="tokens a step takes (the prefill chunk)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in flight")
    p.add_argument("--level", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the models' dtype (GPU)")
    p.add_argument("--quick", action="store_true", help="tiny-llama on the CPU, a few short prompts")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    for flag in ("prompts", "shared_len", "unique_len", "max_tokens", "max_num_tokens", "max_num_seqs"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {getattr(a, flag)}")
    if a.quick:
        device, dtype, names = torch.device("cpu"), torch.float32, ["tiny-llama"]
        a.prompts, a.shared_len, a.unique_len, a.max_tokens, a.max_num_tokens, a.max_num_seqs = 6, 48, 8, 4, 32, 4
    else:
        if not torch.cuda.is_available():
            p.error("the prefix-caching benchmark runs on a CUDA GPU (torch.cuda.is_available() is False); "
                    "--quick checks the harness on the CPU")
        device, dtype, names = torch.device("cuda"), getattr(torch, a.dtype), a.models.split(",")
    rows: list[dict[str, Any]] = []
    stem = "prefix_caching" + ("_quick" if a.quick else "" if a.dtype == "bfloat16" else f"_{a.dtype}")
    for name in names:
        off, off_outs = run(name, False, a, device, dtype)
        on, on_outs = run(name, True, a, device, dtype)
        rows += [dict(off, **{k: "" for k in COLUMNS[-4:]}), dict(on, **agreement(off_outs, on_outs))]
        print(rows[-2], rows[-1], sep="\n", flush=True)
        common.write_results(stem, rows, COLUMNS, device=device, out_dir=a.out,
                             title="LLM.generate over prompts sharing a prefix, without and with prefix caching",
                             notes=[f"{a.prompts} prompts: the same {a.shared_len} random token ids, then "
                                    f"{a.unique_len} of each's own; {a.max_tokens} output tokens each (ignore_eos), "
                                    f"greedy; level {a.level}; at most {a.max_num_tokens} tokens a step, "
                                    f"{a.max_num_seqs} sequences in flight; one LLM a row, warmed up on the same "
                                    "workload around another prefix, then its prefix cache reset; total_s: the one "
                                    "timed LLM.generate call",
                                    f"{a.dtype if not a.quick else 'float32'}; same_tokens / same_first_token: prompts "
                                    "whose tokens / first token equal the run without the cache's; "
                                    "mean_agreeing_tokens: tokens equal before the first difference; "
                                    "first_logprob_max_diff: the largest |difference| of the two runs' "
                                    "log-probabilities of the uncached run's first token"])
    common.plot_stacked_bars(stem, [dict(r, computed=r["computed_prompt_tokens"], cached=r["cached_tokens"])
                                    for r in rows], label=["model", "prefix_caching"], parts=["computed", "cached"],
                             title="Prompt tokens of LLM.generate: computed, and found in the prefix cache",
                             ylabel="prompt tokens", out_dir=a.out)
    return rows


if __name__ == "__main__":
    main()
