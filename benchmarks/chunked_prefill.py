"""``LLM.generate`` with chunked prefill over many prompts: how many steps mix prefill and decode, and what
they cost (issue 18).

A step that holds a prompt chunk and decodes cannot replay a whole-step CUDA graph: it takes the piecewise
path (pieces replayed, attention eager between them), whose host time issue 18 is about. With more prompt
tokens than ``--max-num-tokens`` a step takes, the scheduler splits prompts into chunks and fills each step
with the decodes running plus a chunk: a large share of the run's steps and time is then mixed. For each
model (built-in random weights, level 3) this runs ``LLM.generate`` on ``--prompts`` prompts of
``--prompt-len`` random token ids, ``--max-tokens`` each (``ignore_eos``, greedy), with at most
``--max-num-seqs`` sequences in flight, and reports from the engine's step statistics (``LLM.stats``):

- steps: all, decode-only, with a prompt chunk (prefill-only and mixed), mixed;
- the share of the steps and of the summed step time that is mixed (or, on a tree whose statistics do not
  time the mixed steps apart, that holds a prompt chunk);
- the median decode-only and mixed step, output tokens/s of the whole call;
- the eager attention calls' host time (mean, median, 90th percentile: the split graph's eager function timed
  around; the median of a step's first call and of its later ones apart), and
  how the steps that ran them got their launch state: built, from the workspace's cache of recent steps', inherited.

A step's time is its forward, sampling and the read of its tokens (a mixed step is read when it ends; decode
steps may overlap the next launch). ``--tag`` labels the rows: run the script against another checkout
(``PYTHONPATH=<checkout>``) for a before/after pair (``gpu_pass.sh chunked``).

Usage: ``python -m benchmarks.chunked_prefill [--models llama-3.2-1b,llama-3-8b] [--out DIR]``; ``--quick``
runs tiny-llama on the CPU to check the harness.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks import common
from dispatcher import CompilationConfig, default_capture_sizes

COLUMNS = ["model", "tag", "prompts", "prompt_len", "max_tokens", "chunk", "largest_graph", "capture_s",
           "eager_warm_s", "steps", "decode_steps", "prefill_steps", "mixed_steps", "mixed_share_steps",
           "mixed_share_time", "median_decode_ms", "median_mixed_ms", "total_s", "tokens_per_s", "attention_calls",
           "attention_host_us_mean", "attention_host_us_p50", "attention_host_us_p90", "attention_host_us_p99",
           "attention_host_us_max", "attention_slow_calls", "attention_slow_ms", "attention_first_us_p50",
           "attention_later_us_p50", "jit_compiles", "eager_steps", "steps_built", "steps_from_cache",
           "steps_inherited", "pieces_built", "pieces_from_cache"]


def run(llm: Any, prompts: list[list[int]], max_tokens: int) -> tuple[Any, float]:
    """``LLM.generate`` of ``prompts``: its statistics and wall seconds."""
    wall = common.generate_exactly(llm, prompts, max_tokens)
    return llm.stats, wall


def summarize(stats: Any, wall: float, num_tokens: int) -> dict[str, Any]:
    """The step counts, the mixed steps' share of steps and time, medians and tokens/s of one call.

    ``mixed_step_times_s`` where the statistics have it; else the mixed share of time is that of every step
    with a prompt chunk (the steps that are not decode-only), marked ``prefill+mixed``."""
    total = sum(stats.step_times_s)
    decode = stats.decode_step_times_s
    mixed = getattr(stats, "mixed_step_times_s", None)
    with_prompt = stats.num_steps - len(decode)
    if mixed is not None:
        share_time = f"{100 * sum(mixed) / total:.1f}%"
        median_mixed = round(statistics.median(mixed) * 1e3, 3) if mixed else ""
    else:
        share_time = f"{100 * (total - sum(decode)) / total:.1f}% (prefill+mixed)"
        median_mixed = ""
    return dict(steps=stats.num_steps, decode_steps=len(decode), prefill_steps=with_prompt - stats.num_mixed_steps,
                mixed_steps=stats.num_mixed_steps,
                mixed_share_steps=f"{100 * stats.num_mixed_steps / max(stats.num_steps, 1):.1f}%",
                mixed_share_time=share_time,
                median_decode_ms=round(statistics.median(decode) * 1e3, 3) if decode else "",
                median_mixed_ms=median_mixed, total_s=round(wall, 3), tokens_per_s=round(num_tokens / wall, 1))


def launch_state(eager: int, cache: Any, before: tuple[Any, Any] | None) -> dict[str, Any]:
    """How the ``eager`` steps whose attention ran eagerly (between the pieces: prefill-only and mixed steps on a
    GPU, whose decode-only steps replay whole-step graphs) got their launch state: built anew, taken from the
    workspace's cache of recent steps' (``ops.launch_cache``; a layer's whole step state, ``"call"``), or inherited
    from the last step's; and the pieces (plans, bound launches, step states) built and taken. Blank on a tree
    without the cache."""
    if cache is None:
        return dict(eager_steps=eager, steps_built="", steps_from_cache="", steps_inherited="", pieces_built="",
                    pieces_from_cache="")
    built, taken = cache.misses - before[0], cache.hits - before[1]
    # a step takes a recent step's whole state ("step"), or builds its own from pieces: its layers' state ("call")
    # taken from the cache or built
    from_cache = taken["step"] + taken["call"]
    return dict(eager_steps=eager, steps_built=built["call"], steps_from_cache=from_cache,
                steps_inherited=eager - built["call"] - from_cache, pieces_built=sum(built.values()) - built["step"],
                pieces_from_cache=sum(taken.values()) - taken["step"])


@contextlib.contextmanager
def timed_attention() -> Iterator[list[tuple[float, bool]]]:
    """Host seconds of each eager ``dynamo_once::attention`` call between the pieces (the split graph's eager
    function, wrapped for the block: set it before the model compiles), and whether it was its step's first call (the
    one that builds or takes the step's launch state; the others replay it), appended to the list yielded."""
    from dispatcher import plugins
    from models.forward_context import get_forward_context

    name = "dynamo_once::attention"
    impl = plugins.get_splitting_op_eager_impl(name)
    times: list[tuple[float, bool]] = []
    last: list[Any] = [None]  # the last call's step metadata

    def timed(*args: Any) -> Any:
        md = get_forward_context().attn_metadata
        t0 = time.perf_counter()
        out = impl(*args)
        times.append((time.perf_counter() - t0, md is not last[0]))
        last[0] = md
        return out

    plugins.set_splitting_op_eager_impl(name, timed)
    try:
        yield times
    finally:
        plugins.set_splitting_op_eager_impl(name, impl)


SLOW_CALL_S = 1e-3  # an attention call over this much host time is counted apart (a compile, a wait on the GPU)


def attention_times(host: list[tuple[float, bool]]) -> dict[str, Any]:
    """The attention columns of :func:`timed_attention`'s calls, µs: how many, mean, median, 90th and 99th percentile
    and the largest; the calls over :data:`SLOW_CALL_S` and their summed ms; the median of the steps' first calls and
    of their later ones (blank without calls)."""
    us = sorted(t * 1e6 for t, _ in host)
    first, later = ([t * 1e6 for t, f in host if f == want] for want in (True, False))
    slow = [t for t in us if t > SLOW_CALL_S * 1e6]

    def median(xs: list[float]) -> float | str:
        return round(statistics.median(xs), 1) if xs else ""

    def pct(q: float) -> float | str:
        return round(us[int(q * (len(us) - 1))], 1) if us else ""

    return dict(attention_calls=len(us), attention_host_us_mean=round(statistics.fmean(us), 1) if us else "",
                attention_host_us_p50=median(us), attention_host_us_p90=pct(0.9), attention_host_us_p99=pct(0.99),
                attention_host_us_max=pct(1.0), attention_slow_calls=len(slow),
                attention_slow_ms=round(sum(slow) / 1e3, 1), attention_first_us_p50=median(first),
                attention_later_us_p50=median(later))


@contextlib.contextmanager
def jit_compiles() -> Iterator[collections.Counter]:
    """The Triton kernels the block compiled or loaded from Triton's disk cache (a miss of a kernel's in-memory cache
    of specializations: ``triton.knobs.runtime.jit_cache_hook``, called before each), counted by kernel and
    specialization (the hook's ``repr``: name, options and argument types); a hook already set is still called."""
    from triton import knobs

    seen: collections.Counter = collections.Counter()
    previous = knobs.runtime.jit_cache_hook

    def hook(**kwargs: Any) -> Any:
        seen[kwargs["repr"]] += 1
        return previous(**kwargs) if previous else None

    knobs.runtime.jit_cache_hook = hook
    try:
        yield seen
    finally:
        knobs.runtime.jit_cache_hook = previous


@contextlib.contextmanager
def profiled(on: bool, out_dir: str | None, filename: str) -> Iterator[None]:
    """With ``on``: cProfile the block, and print its 45 functions of most own time, then of most cumulative time
    (to ``filename`` under ``out_dir`` too, where given)."""
    if not on:
        yield
        return
    import cProfile
    import io
    import os
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
    buf = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(45)
    print(buf.getvalue())
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, filename), "w") as f:
            f.write(buf.getvalue())


def capture_sizes(capture_to: int | None) -> list[int] | None:
    """The default schedule of capture sizes (``dispatcher.default_capture_sizes``: every 16 tokens past 256) up to
    ``capture_to`` tokens, so that steps of up to that many replay their pieces' graphs and larger ones run the
    pieces' code (256: the default before 2026-12-06); None: the defaults (to 512)."""
    if not capture_to:
        return None
    return default_capture_sizes(capture_to)


def bench_model(name: str, a: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from models import LLM

    sizes = capture_sizes(a.capture_to)
    with timed_attention() as host, jit_compiles() as at_start:
        llm = LLM(name, level=a.level, max_num_tokens=a.max_num_tokens, max_num_seqs=a.max_num_seqs, dtype=dtype,
                  compilation_config=CompilationConfig(cudagraph_capture_sizes=sizes) if sizes else None,
                  device=device, num_cache_tokens=a.max_num_seqs * (a.prompt_len + a.max_tokens + 32),
                  enable_prefix_caching=False)  # the warm-up's prompts are the timed run's first
        rng = random.Random(0)
        prompts = [[rng.randrange(llm.vocab_size) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
        run(llm, prompts[: min(a.warmup_prompts, len(prompts))], a.max_tokens)  # the step sizes' compiles, graphs
        cache = getattr(llm.input_batch.decode_workspace, "launches", None)  # None: a tree without ops.launch_cache
        before = (cache.misses.copy(), cache.hits.copy()) if cache is not None else None
        host.clear()
        startup_compiles = sum(at_start.values())  # before the timed run (whose compiles the hook counts too)
        with profiled(a.cprofile, a.out, f"chunked_prefill_cprofile_{name}.txt"), jit_compiles() as compiled:
            stats, wall = run(llm, prompts, a.max_tokens)
    for spec, n in compiled.most_common():
        print(f"compiled in the timed run ({n}x): {spec}", flush=True)
    r = dict(model=name, tag=a.tag, prompts=a.prompts, prompt_len=a.prompt_len, max_tokens=a.max_tokens,
             chunk=a.max_num_tokens, largest_graph=max(llm.graphs.piece_sizes, default=0),
             capture_s=round(llm.capture_time_s, 2), eager_warm_s=round(getattr(llm.graphs, "eager_warm_s", 0.0), 2),
             startup_jit_compiles=startup_compiles,
             **summarize(stats, wall, a.prompts * a.max_tokens), **attention_times(host),
             jit_compiles=sum(compiled.values()),
             **launch_state(len(host) // len(llm.layers), cache, before))
    print(r, flush=True)
    return r


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-tokens", type=int, default=512, help="tokens a step takes (the prefill chunk)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in flight")
    p.add_argument("--level", type=int, default=3)
    p.add_argument("--capture-to", type=int, default=0,
                   help="CUDA graphs for steps of up to this many tokens (the default schedule cut there: 256 is "
                        "the default before 2026-12-06); 0: the default sizes (to 512)")
    p.add_argument("--warmup-prompts", type=int, default=4,
                   help="prompts of an untimed run first (compiles, CUDA graphs); --prompts: every layout the timed "
                        "run has, its kernels' specializations included")
    p.add_argument("--tag", default="", help="a label for the rows (e.g. after, before)")
    p.add_argument("--cprofile", action="store_true",
                   help="cProfile the timed run (its figures then include the profiler's cost); the functions by own "
                        "and cumulative time, printed and under --out")
    p.add_argument("--quick", action="store_true", help="tiny-llama on the CPU, a few short prompts")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    for flag in ("prompts", "prompt_len", "max_tokens", "max_num_tokens", "max_num_seqs", "warmup_prompts"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {getattr(a, flag)}")
    if a.capture_to and a.capture_to < 8:
        p.error(f"--capture-to: expected 0 (the default sizes) or an integer >= 8, got {a.capture_to}")
    if a.quick:
        device, dtype, names = torch.device("cpu"), torch.float32, ["tiny-llama"]
        a.prompts, a.prompt_len, a.max_tokens, a.max_num_tokens, a.max_num_seqs = 6, 40, 6, 32, 4
    else:
        if not torch.cuda.is_available():
            p.error("the chunked-prefill benchmark runs on a CUDA GPU (torch.cuda.is_available() is False); "
                    "--quick checks the harness on the CPU")
        device, dtype, names = torch.device("cuda"), torch.bfloat16, a.models.split(",")
    rows = []
    stem = "chunked_prefill" + ("_quick" if a.quick else "") + (f"_{a.tag}" if a.tag else "")
    for name in names:
        rows.append(bench_model(name, a, device, dtype))
        common.write_results(stem, rows, COLUMNS, device=device, out_dir=a.out,
                             title="LLM.generate with chunked prefill: the mixed steps' share and cost",
                             notes=[f"{a.prompts} prompts of {a.prompt_len} random token ids, {a.max_tokens} output "
                                    f"tokens each (ignore_eos), greedy; level {a.level}; at most {a.max_num_tokens} "
                                    f"tokens a step (longer prompts in chunks), {a.max_num_seqs} sequences in flight",
                                    "steps from LLM.stats: decode-only, prefill-only (prompt chunks alone), mixed "
                                    "(prompt chunk + decodes: the piecewise path); share of the steps and of their "
                                    "summed time; a step = forward + sampling + reading its tokens",
                                    "largest_graph: the largest step whose pieces replay CUDA graphs (--capture-to; "
                                    "a larger step runs their code; 0: no graphs, as on the CPU); capture_s: the "
                                    "start-up's CUDA-graph captures with eager_warm_s, its eager attention launches "
                                    "over every step layout (their Triton kernels compiled or loaded); "
                                    "startup_jit_compiles: the Triton kernel specializations compiled or loaded "
                                    "from Triton's disk cache from LLM() to the timed run (the warm-up prompts' "
                                    "included)",
                                    "attention_calls: the eager dynamo_once::attention calls (one a layer a "
                                    "prefill-only or mixed step, between the pieces; none at level 0, where no graph "
                                    "is split); attention_host_us_mean / _p50 / _p90: their host time (perf_counter "
                                    "around each call: a kernel compiled at its first launch counts), mean, median, "
                                    "90th and 99th percentile, largest; attention_slow_calls / _ms: the calls over "
                                    f"{SLOW_CALL_S * 1e3:g} ms and their sum; untimed first: {a.warmup_prompts} of "
                                    "the prompts; jit_compiles: the Triton kernel specializations compiled (or loaded "
                                    "from Triton's disk cache) in the timed run, each printed; "
                                    "attention_first_us_p50 / attention_later_us_p50: the median of a step's first "
                                    "call (which builds or takes the step's launch state) and of its later ones (which "
                                    "replay it)",
                                    "eager_steps: the steps whose attention ran eagerly (attention_calls over the "
                                    "model's layers: on a GPU the prefill-only and mixed steps); of "
                                    "them steps_built built their attention launch state anew, steps_from_cache took "
                                    "it from the workspace's cache of recent steps' (ops.launch_cache), steps_inherited "
                                    "took it over from the last step's (AttentionMetadata.inherit); pieces_built / "
                                    "pieces_from_cache: the plans, bound launches and step states built / taken, over "
                                    "the timed run"])
    common.plot_stacked_bars(stem, [dict(r, decode=r["decode_steps"], prefill=r["prefill_steps"], mixed=r["mixed_steps"])
                                    for r in rows], label=["model", "tag"], parts=["decode", "prefill", "mixed"],
                             title="Steps of LLM.generate with chunked prefill, by kind", ylabel="steps", out_dir=a.out)
    return rows


if __name__ == "__main__":
    main()
