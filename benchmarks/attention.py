"""Paged decode attention alone, as % of copy bandwidth (issue 16: target >= 85% at batch 32 and 128).

Llama-3-8B's attention shape (32 query heads, 8 KV heads, head size 128, bf16 KV cache, the engine's 16-token
pages) at decode: one query token per sequence, every sequence ``context`` tokens long, its pages scattered over
the cache (a random permutation of the blocks). The op as the model calls it (``ops.paged_attention.
paged_decode_launch`` on a prebuilt ``DecodePlan``, given the new tokens' keys and values: one launch under the
table's ``fused_write`` and ``fused_merge``, else the cache-write kernel, the split kernel and, when the plan
splits, the merge kernel), at batch 1, 8, 32, 128 x context 512, 1024, 2048, 4096.

Timing: one CUDA graph of ``copies`` calls, each over its own block table (disjoint blocks of one cache), so that
a call reads its keys and values from HBM, not L2 (``copies``: the fewest, a power of two, whose KV bytes exceed
256 MiB, at most 64); median over ``--replays`` replays, per call. ``bytes``: every key and value byte the call
reads, plus q and the output; ``pct_of_copy_bw``: bytes / time / the device-to-device copy bandwidth measured in
the same run (``benchmarks.common.measure_copy_bandwidth``). ``correct``: the output against
``ops.paged_decode_ref`` (fp32) within 2e-2 (bf16 rounding). ``copy_us`` / ``copy_pct_of_copy_bw``: a
device-to-device copy moving the same bytes (half read, half written), timed in the same harness: the share of the
copy bandwidth one plain kernel of that size reaches, launch and ramp included.

``--sweep``: per shape, every candidate config of the decode kernel (``sweep_candidates``: tokens per loop step
BLOCK_N, num_warps, num_stages and the split count, around the two-wave rule's or ``--splits``; ~100 a shape;
then the fastest six again in each other form of ``FORMS``: the other grid order ``heads_first``, and the fused
merge and cache write), timed the same way, after a pass that compiles them all (in
parallel threads, Triton's ``AsyncCompileMode``). Shapes go batch 32, 128, 8, 1 (the issue's first); ``--deadline``
seconds (default 220) bounds the whole sweep: at the deadline it stops and writes what it measured. Saves
``attention_sweep`` (every config), ``attention_sweep_best`` (the fastest per shape, with the table's), and
prints suggested ``DECODE_TABLE`` rows (``ops/paged_decode_config.py``): per batch, the config with the least
geometric-mean loss over the contexts against each context's fastest.

``--variant NAME=FIELD=VALUE,...`` (repeatable): at every shape, the table's config with those ``DecodeConfig``
fields changed (``n64=BLOCK_N=64,num_stages=4``; ``ops.paged_decode_config.config_fields``), timed alternately with
the table's own over ``--rounds`` rounds on one case; saves ``attention_variants`` (each one's mean, its % of the
copy bandwidth and its speed against the table's).

``--head-size 64``: Llama-3.2-1B's heads (32 query heads, 8 KV heads, head size 64; files end in ``_d64``).

Usage: ``python -m benchmarks.attention [--batches 1,8,32,128] [--contexts 512,1024,2048,4096] [--head-size 128]
[--sweep [--deadline 220] [--splits 1,2,4]] [--variant NAME=FIELD=VALUE,... [--rounds 2]] [--out DIR]``; files
(CSV, Markdown, PNG) are written only with ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks import common
from ops.paged_attention import DecodePlan, paged_decode_launch, paged_decode_ref
from ops.paged_decode_config import DecodeConfig, config_fields, decode_config

HEADS, KV_HEADS, HEAD, PAGE = 32, 8, 128, 16  # Llama-3-8B (``--head-size 64``: Llama-3.2-1B); the engine's block size
MODEL_OF_HEAD = {128: "Llama-3-8B", 64: "Llama-3.2-1B"}
HEAD_TAG = ""  # the files' suffix for the head size: "" (128), "_d64"; set by main
DTYPE = torch.bfloat16
#: The cache's dtype: None (DTYPE's), or fp8 with ``--kv-cache-dtype fp8`` (``ops.kv_quant``, scales 1); set by main.
CACHE_DTYPE: torch.dtype | None = None
#: ``--splits``: the split counts the sweep tries at every batch, or None (around the two-wave rule's); set by main.
SWEEP_SPLITS: list[int] | None = None
SCALE = HEAD**-0.5
TOL = 2e-2
MAX_COPIES = 64
TOP_FLIPPED = 6  # the sweep's fastest configs per shape timed again in each of the other forms (FORMS)
#: The other forms the fastest configs are timed in again: the other grid order, and the fused kernels (the merge in
#: the split kernel; the cache write in it; both: one launch). The candidates take DecodeConfig's defaults (unfused).
FORMS = ({"heads_first": True}, {"fused_merge": True}, {"fused_write": True}, {"fused_merge": True, "fused_write": True})
#: Over an fp8 cache, also: each value tile converted as loaded (DecodeConfig.convert_v), alone and with both fusions.
FP8_FORMS = ({"convert_v": True}, {"convert_v": True, "fused_merge": True, "fused_write": True})


def kv_bytes(batch: int, context: int) -> int:
    """Every key and value byte of one call."""
    return 2 * batch * context * KV_HEADS * HEAD * _cache_dtype().itemsize


def io_bytes(batch: int, context: int) -> int:
    """The KV bytes plus q and the output."""
    return kv_bytes(batch, context) + 2 * batch * HEADS * HEAD * DTYPE.itemsize


@dataclass
class Case:
    """One shape's tensors: a cache of ``copies`` disjoint sets of pages, their block tables, q, the output."""

    batch: int
    context: int
    copies: int
    cache: torch.Tensor
    tables: list[torch.Tensor]
    seq_lens: torch.Tensor
    q: torch.Tensor
    out: torch.Tensor
    workspace: torch.Tensor
    counters: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    slots: list[torch.Tensor]


def new_token_slots(table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The flat cache slot of each sequence's last position (its new token's), from its block table row."""
    last = seq_lens.long() - 1
    return table.long()[torch.arange(table.shape[0], device=table.device), last // PAGE] * PAGE + last % PAGE


def make_case(batch: int, context: int, device: str) -> Case:
    copies = common.copies_to_exceed_cache(kv_bytes(batch, context), limit=MAX_COPIES)
    per_seq = context // PAGE
    total = copies * batch * per_seq
    g = torch.Generator(device=device).manual_seed(batch * 7919 + context)
    cache = torch.randn(2, total, PAGE, KV_HEADS, HEAD, generator=g, device=device, dtype=DTYPE).to(_cache_dtype())
    perm = torch.randperm(total, generator=g, device=device).to(torch.int32).view(copies, batch, per_seq)
    q = torch.randn(batch, HEADS * HEAD, generator=g, device=device, dtype=DTYPE)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    ws = torch.empty(batch * HEADS * 64 * (HEAD + 1), dtype=torch.float32, device=device)  # up to 64 splits
    counters = torch.zeros(batch * KV_HEADS, dtype=torch.int32, device=device)
    tables = list(perm.unbind(0))
    slots = [new_token_slots(t, seq_lens) for t in tables]
    # The new tokens' keys and values: what copy 0's cache holds at their slots (the write leaves it unchanged).
    k_new, v_new = (cache[i].flatten(0, 1)[slots[0]].flatten(1).to(DTYPE) for i in (0, 1))
    return Case(batch, context, copies, cache, tables, seq_lens, q, out, ws, counters, k_new, v_new, slots)


def plans(case: Case, config: DecodeConfig | None) -> list[DecodePlan]:
    """One plan per copy's block table (the partial results share the case's workspace: stream-ordered). Without
    PDL (``DecodeConfig.pdl``): the calls here are back to back, where each launch would overlap the one before
    it; the kernel alone is what is timed."""
    config = dataclasses.replace(config or decode_config(case.batch, HEAD, _fp8()), pdl=False)
    return [DecodePlan(t, case.seq_lens, HEADS, KV_HEADS, HEAD, PAGE, case.q.device, workspace=case.workspace,
                       config=config, counters=case.counters, kv_fp8=_fp8()) for t in case.tables]


def call(case: Case, plan: DecodePlan, slots: torch.Tensor, compile_only: bool = False) -> None:
    """One layer's decode attention as the model runs it: the new tokens' keys and values to the cache (by the
    decode kernel under ``fused_write``, else by the cache-write kernel first), then the decode."""
    paged_decode_launch(plan, case.q, case.cache, case.out, SCALE, compile_only=compile_only,
                        new_kv=(case.k_new, case.v_new, slots))


def reference(case: Case) -> torch.Tensor:
    return paged_decode_ref(case.q, case.cache, case.tables[0], case.seq_lens, HEADS, HEAD, SCALE)


def time_config(case: Case, config: DecodeConfig | None, replays: int, ref: torch.Tensor) -> tuple[float, bool, int]:
    """µs per call under ``config`` (None: the table's), whether copy 0's output matches ``ref``, and the splits."""
    ps = plans(case, config)
    call(case, ps[0], case.slots[0])
    ok = bool((case.out.float() - ref).abs().max() <= TOL)
    fn = common.rotating(lambda p, s: call(case, p, s), list(zip(ps, case.slots)))
    n = case.copies
    us = common.bench_gpu(fn, warmup=n, iters=replays * n, cuda_graph=True, graph_iters=n)
    return us, ok, ps[0].num_splits


def same_bytes_copy_us(nbytes: int, copies: int, replays: int, device: str) -> float:
    """µs a call of a device-to-device copy moving ``nbytes`` through HBM (half read, half written), in the same
    harness as an attention call: one CUDA graph of ``copies`` calls, each over its own buffers. What one plain
    kernel moving that many bytes reaches: the ceiling the size itself sets, beside the large copy that measured
    the copy bandwidth."""
    half = nbytes // 2
    src = torch.empty(copies, half, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    fn = common.rotating(lambda i: dst[i].copy_(src[i]), [(i,) for i in range(copies)])
    us = common.bench_gpu(fn, warmup=copies, iters=replays * copies, cuda_graph=True, graph_iters=copies)
    del src, dst
    return us


def pct(batch: int, context: int, us: float, copy_gbps: float) -> float:
    return round(100 * io_bytes(batch, context) / (us * 1e-6) / (copy_gbps * 1e9), 1)


def bench_table(batches: list[int], contexts: list[int], device: str, copy_gbps: float,
                replays: int) -> list[dict[str, Any]]:
    """The table's config at every shape."""
    rows = []
    for b in batches:
        for ctx in contexts:
            case = make_case(b, ctx, device)
            us, ok, splits = time_config(case, None, replays, reference(case))
            copy_us = same_bytes_copy_us(io_bytes(b, ctx), case.copies, replays, device)
            rows.append({"batch": b, "context": ctx, "splits": splits, "us": round(us, 2),
                         "kv_MB": round(kv_bytes(b, ctx) / 1e6, 1), "GB_per_s": round(io_bytes(b, ctx) / us / 1e3),
                         "pct_of_copy_bw": pct(b, ctx, us, copy_gbps), "copy_us": round(copy_us, 2),
                         "copy_pct_of_copy_bw": pct(b, ctx, copy_us, copy_gbps), "copies": case.copies, "correct": ok})
            print(rows[-1], flush=True)
            del case
            torch.cuda.empty_cache()
    return rows


def parse_variant(p: argparse.ArgumentParser, text: str) -> tuple[str, dict[str, Any]]:
    """``NAME=FIELD=VALUE,...`` -> (name, DecodeConfig fields); a parser error (one line) naming ``--variant``."""
    name, sep, fields = text.partition("=")
    if not sep or not name or name == "table":
        p.error(f"--variant: NAME=FIELD=VALUE,... with a NAME other than 'table'; got {text!r}")
    try:
        return name, config_fields(fields)
    except ValueError as e:
        p.error(f"--variant: {e}")
        raise  # p.error exits


def bench_variants(batches: list[int], contexts: list[int], device: str, copy_gbps: float, replays: int,
                   variants: list[tuple[str, dict[str, Any]]], rounds: int) -> list[dict[str, Any]]:
    """At every shape, the table's config and each variant of it, alternately for ``rounds`` rounds: their mean µs,
    % of the copy bandwidth, and ``vs_table`` (the table's µs over the variant's: > 1 faster)."""
    rows = []
    for b in batches:
        table = decode_config(b, HEAD, _fp8())
        configs: dict[str, DecodeConfig] = {"table": table}
        for name, fields in variants:
            try:
                configs[name] = dataclasses.replace(table, **fields)
            except ValueError as e:  # fields that make no valid config of this batch's row
                print(f"variant {name} at batch {b}: {e}", flush=True)
        for ctx in contexts:
            case = make_case(b, ctx, device)
            ref = reference(case)
            times: dict[str, list[float]] = {name: [] for name in configs}
            correct: dict[str, bool] = {}
            for _ in range(rounds):
                for name, cfg in configs.items():
                    us, ok, _ = time_config(case, cfg, replays, ref)
                    times[name].append(us)
                    correct[name] = correct.get(name, True) and ok
            base = sum(times["table"]) / rounds
            for name, ts in times.items():
                us = sum(ts) / rounds
                rows.append({"batch": b, "context": ctx, "variant": name, "us": round(us, 2),
                             "pct_of_copy_bw": pct(b, ctx, us, copy_gbps), "vs_table": round(base / us, 3),
                             "correct": correct[name], "runs_us": " ".join(f"{t:.2f}" for t in ts),
                             "series": f"batch {b} {name}"})
                print(rows[-1], flush=True)
            del case, ref
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ the sweep
# (BLOCK_N, num_warps, num_stages): 28 kernel variants, each compiled twice (one split, several: the count is not
# specialized); the merge kernel once per split count. ~60 compiles, ~1 s each on the H200 machine.
_TILES = [(bn, w, s) for bn in (16, 32, 64, 128) for w, s in ((2, 3), (4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (8, 4))]


def sweep_splits(batch: int, num_sms: int) -> list[int]:
    """Split counts around the two-wave rule's (a quarter of it to four times it, 1 to 32), or ``--splits``'."""
    if SWEEP_SPLITS:
        return list(SWEEP_SPLITS)
    s0 = DecodeConfig(waves=2).splits(batch, KV_HEADS, num_sms)
    return [s for s in (s0 // 4, s0 // 2, s0, s0 * 2, s0 * 4) if 1 <= s <= 32]


def sweep_candidates(batch: int, num_sms: int) -> list[DecodeConfig]:
    """Every candidate at ``batch``: each tile variant at each split count of :func:`sweep_splits`."""
    return [DecodeConfig(num_splits=s, BLOCK_N=bn, num_warps=w, num_stages=st)
            for s in sweep_splits(batch, num_sms) for bn, w, st in _TILES]


def _resolved(cfg: DecodeConfig, batch: int, num_sms: int) -> tuple:
    """What a config launches at ``batch``: (splits, BLOCK_N, warps, stages, merge warps, and its forms)."""
    return (cfg.splits(batch, KV_HEADS, num_sms), max(PAGE, cfg.BLOCK_N), cfg.num_warps, cfg.num_stages,
            cfg.merge_warps, cfg.heads_first, cfg.fused_merge, cfg.fused_write, cfg.convert_v and _fp8())


@contextmanager
def parallel_compiles(workers: int):
    """Triton's ``AsyncCompileMode`` on a thread pool (compiles started by ``compile_only`` launches run there,
    and are all done on exit); with ``workers`` <= 1 or without it (another Triton), nothing: the compiles then
    run one by one."""
    try:
        if workers <= 1:
            raise ImportError("serial compiles asked for")
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        yield
        return
    with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
        yield


def precompile(batches: list[int], device: str, num_sms: int, workers: int) -> None:
    """Compile every candidate's kernels (split and merge) on a small case, in parallel, before any timing: the
    sweep's launches then find them compiled (specializations are the same at every shape: strides of 16)."""
    t0 = time.perf_counter()
    case = make_case(8, 512, device)
    seen = set()
    with parallel_compiles(workers):
        for b in batches:
            for cfg in sweep_candidates(b, num_sms):
                key = (min(cfg.num_splits, 2), cfg.num_splits, cfg.BLOCK_N, cfg.num_warps, cfg.num_stages)
                if key in seen:
                    continue
                seen.add(key)
                try:
                    for form in ({}, *FORMS[1:]):  # the fused forms too: the sweep times some of them
                        call(case, plans(case, dataclasses.replace(cfg, **form))[0], case.slots[0], compile_only=True)
                except Exception as e:  # a config Triton cannot build: the sweep reports it again
                    print(f"precompile {cfg}: {type(e).__name__}: {e}", flush=True)
    print(f"precompiled {len(seen)} launch variants in {time.perf_counter() - t0:.1f} s", flush=True)


def sweep_shape(batch: int, context: int, device: str, copy_gbps: float, num_sms: int, replays: int,
                deadline: float) -> list[dict[str, Any]]:
    case = make_case(batch, context, device)
    ref = reference(case)
    table = _resolved(decode_config(batch, HEAD, _fp8()), batch, num_sms)
    rows: list[dict[str, Any]] = []

    def measure(configs: list[DecodeConfig]) -> None:
        for cfg in configs:
            if time.perf_counter() > deadline:
                print(f"sweep: deadline reached at batch {batch} context {context}", flush=True)
                return
            try:
                us, ok, _ = time_config(case, cfg, replays, ref)
            except Exception as e:  # shared memory or registers out of bounds
                print(f"sweep batch={batch} context={context} {cfg}: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append({"batch": batch, "context": context, **asdict(cfg), "us": round(us, 2),
                         "pct_of_copy_bw": pct(batch, context, us, copy_gbps), "correct": ok,
                         "table": _resolved(cfg, batch, num_sms) == table})

    measure(sweep_candidates(batch, num_sms))
    # The other forms (grid order, fused kernels): the fastest few again in each.
    top = sorted((r for r in rows if r["correct"]), key=lambda r: r["us"])[:TOP_FLIPPED]
    measure([dataclasses.replace(DecodeConfig(**{k: r[k] for k in _CONFIG_FIELDS}), **form)
             for form in FORMS + (FP8_FORMS if _fp8() else ()) for r in top])
    del case, ref
    torch.cuda.empty_cache()
    return rows


SWEEP_COLUMNS = ["batch", "context", *DecodeConfig.__dataclass_fields__, "us", "pct_of_copy_bw", "correct", "table"]
_CONFIG_FIELDS = ("num_splits", "BLOCK_N", "num_warps", "num_stages", "merge_warps", "heads_first", "fused_merge",
                  "fused_write", "convert_v")

#: A config field's default, for sweep files written before the field existed.
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecodeConfig)}


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (batch, context): the fastest correct config, with the table config's time beside it."""
    out = []
    for cell in dict.fromkeys((r["batch"], r["context"]) for r in rows):
        mine = [r for r in rows if (r["batch"], r["context"]) == cell and r["correct"]]
        if not mine:
            continue
        best = min(mine, key=lambda r: r["us"])
        table = next((r["us"] for r in mine if r["table"]), "")
        out.append({"batch": cell[0], "context": cell[1], **{k: best[k] for k in _CONFIG_FIELDS}, "us": best["us"],
                    "pct_of_copy_bw": best["pct_of_copy_bw"], "table_us": table,
                    "gain_vs_table": round(table / best["us"], 3) if table else ""})
    return out


def suggested_configs(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any], float, float]]:
    """Per batch of the sweep's ``rows``: the config (``DecodeConfig`` fields) with the least geometric-mean loss
    over the contexts against each context's fastest, with that mean loss and its worst: (batch, fields, mean,
    worst). Only configs measured correct at every context of the batch count."""
    out = []
    for b in dict.fromkeys(r["batch"] for r in rows):
        mine = [r for r in rows if r["batch"] == b and r["correct"] is True]
        contexts = sorted({r["context"] for r in mine})
        fastest = {c: min(r["us"] for r in mine if r["context"] == c) for c in contexts}
        by_cfg: dict[tuple, dict[int, float]] = {}
        for r in mine:
            by_cfg.setdefault(tuple(r.get(k, _DEFAULTS[k]) for k in _CONFIG_FIELDS), {})[r["context"]] = r["us"]
        loss = {k: [v[c] / fastest[c] for c in contexts] for k, v in by_cfg.items() if len(v) == len(contexts)}
        if not loss:
            continue
        k = min(loss, key=lambda k: math.fsum(math.log(x) for x in loss[k]))
        mean = math.exp(math.fsum(math.log(x) for x in loss[k]) / len(contexts))
        out.append((b, dict(zip(_CONFIG_FIELDS, k)), mean, max(loss[k])))
    return out


def suggested_rows(rows: list[dict[str, Any]]) -> list[str]:
    """:func:`suggested_configs` as ``DECODE_TABLE`` rows, with each one's mean and worst loss."""
    lines = []
    for b, fields, mean, worst in suggested_configs(rows):
        cs = sorted({r["context"] for r in rows if r["batch"] == b and r["correct"] is True})
        lines.append(f"    _R({b}, {HEAD}, _C({', '.join(f'{f}={v}' for f, v in fields.items())})),  # batch {b}, "
                     f"contexts {cs[0]}-{cs[-1]}: {mean:.3f}x the fastest on average, {worst:.3f}x at worst")
    return lines


def sweep(batches: list[int], contexts: list[int], device: str, copy_gbps: float, replays: int, seconds: float,
          out_dir: str | None, workers: int) -> None:
    start = time.perf_counter()
    deadline = start + seconds
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    order = [b for b in (32, 128, 8, 1) if b in batches] + [b for b in batches if b not in (32, 128, 8, 1)]
    precompile(order, device, num_sms, workers)
    rows: list[dict[str, Any]] = []
    notes = [f"copy bandwidth {copy_gbps:.0f} GB/s; {_shape_name()}, "
             f"{_kv_name()} KV, {PAGE}-token pages); one CUDA graph of one call per block-table copy, median of {replays} replays",
             "correct: within 2e-2 of the fp32 reference; table: what DECODE_TABLE launches at this batch"]
    for b in order:
        for ctx in contexts:
            if time.perf_counter() > deadline:
                print(f"sweep: deadline reached, batch {b} context {ctx} not measured", flush=True)
                continue
            rows += sweep_shape(b, ctx, device, copy_gbps, num_sms, replays, deadline)
            common.write_results("attention_sweep" + _tag(), rows, SWEEP_COLUMNS, notes=notes, device=device, out_dir=out_dir,
                                 title="Paged decode attention: every candidate config")
    best = best_rows(rows)
    common.write_results("attention_sweep_best" + _tag(), best, title="Fastest paged decode config per shape",
                         notes=[*notes[:1], f"sweep took {time.perf_counter() - start:.0f} s"], device=device,
                         out_dir=out_dir)
    print(f"suggested {'DECODE_TABLE_FP8' if _fp8() else 'DECODE_TABLE'} rows (ops/paged_decode_config.py; "
          "max_seqs: the batch measured):")
    for line in suggested_rows(rows):
        print("best " + line.strip(), flush=True)



def _cache_dtype() -> torch.dtype:
    return CACHE_DTYPE or DTYPE


def _fp8() -> bool:
    return CACHE_DTYPE == torch.float8_e4m3fn


def _tag() -> str:
    return ("_kvfp8" if _fp8() else "") + HEAD_TAG


def _shape_name() -> str:
    """The model whose attention shape this is, and the shape."""
    return f"{MODEL_OF_HEAD.get(HEAD, 'Llama')} attention ({HEADS} q heads, {KV_HEADS} KV heads, D {HEAD}"


def _kv_name() -> str:
    return "fp8 (e4m3)" if _fp8() else "bf16"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="512,1024,2048,4096", help="tokens per sequence (multiples of 16)")
    p.add_argument("--replays", type=int, default=20, help="graph replays timed (median)")
    p.add_argument("--sweep", action="store_true", help="also time every candidate config per shape")
    p.add_argument("--deadline", type=float, default=220.0, help="seconds the sweep may take (then it stops)")
    p.add_argument("--splits", default=None, help="the sweep's split counts at every batch, e.g. 1,2,4 (1-32; "
                   "default: a quarter to four times the two-wave rule's count)")
    p.add_argument("--compile-workers", type=int, default=min(16, os.cpu_count() or 1),
                   help="threads compiling the sweep's configs (1: one by one, without Triton's AsyncCompileMode)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                   help="the cache's dtype: auto (bf16, as q) or fp8 (e4m3, scales 1; files end in _kvfp8)")
    p.add_argument("--head-size", type=int, default=128, choices=sorted(MODEL_OF_HEAD),
                   help="the heads' size: 128 (Llama-3-8B's) or 64 (Llama-3.2-1B's; files end in _d64); 32 q, 8 KV heads")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FIELD=VALUE,...",
                   help="the table's config with these DecodeConfig fields changed, timed against it at every shape")
    p.add_argument("--rounds", type=int, default=2, help="--variant: alternating rounds (each config timed once a round)")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    variants = [parse_variant(p, v) for v in a.variant]
    if a.rounds < 1:
        p.error(f"--rounds: at least 1; got {a.rounds}")
    global CACHE_DTYPE, HEAD, SCALE, HEAD_TAG, SWEEP_SPLITS
    SWEEP_SPLITS = common.int_list(p, "--splits", a.splits) if a.splits is not None else None
    if SWEEP_SPLITS and not all(1 <= s <= 32 for s in SWEEP_SPLITS):
        p.error(f"--splits: split counts from 1 to 32; got {a.splits!r}")
    CACHE_DTYPE = torch.float8_e4m3fn if a.kv_cache_dtype == "fp8" else None
    HEAD, SCALE, HEAD_TAG = a.head_size, a.head_size**-0.5, "" if a.head_size == 128 else f"_d{a.head_size}"
    batches, contexts = common.int_list(p, "--batches", a.batches), common.int_list(p, "--contexts", a.contexts)
    if any(c % PAGE for c in contexts):
        p.error(f"--contexts: multiples of {PAGE} (whole pages); got {a.contexts!r}")
    if not torch.cuda.is_available():
        p.error("the attention benchmark needs a CUDA GPU (tests/ops/test_paged_decode_config.py checks the kernel's "
                "configs in Triton's interpreter)")
    device = "cuda"
    print(common.env_header(device), flush=True)
    copy_gbps = common.measure_copy_bandwidth(device=device)
    rows = bench_table(batches, contexts, device, copy_gbps, a.replays)
    notes = [f"copy bandwidth {copy_gbps:.0f} GB/s; {_shape_name()}, "
             f"{_kv_name()} KV, {PAGE}-token pages scattered); the config the decode table picks",
             f"one CUDA graph of `copies` calls, each over its own pages (KV read from HBM), median of {a.replays} "
             "replays, per call; bytes: every K and V byte + q + output",
             "correct: within 2e-2 of the fp32 reference (ops.paged_decode_ref)",
             "copy_us, copy_pct_of_copy_bw: a device-to-device copy moving the call's bytes (half read, half written) "
             "in the same harness: the ceiling one plain kernel of that size reaches"]
    common.write_results("attention" + _tag(), rows, title="Paged decode attention alone, % of copy bandwidth",
                         notes=notes, device=device, out_dir=a.out)
    common.plot_lines("attention" + _tag(), rows, x="context", y="pct_of_copy_bw", series="batch", logx=True, out_dir=a.out,
                      title=f"Paged decode attention, {MODEL_OF_HEAD.get(HEAD, 'Llama')} shape ({common.device_name(device)})",
                      xlabel="context (tokens)", ylabel="% of copy bandwidth", hlines={"target 85%": 85.0})
    if variants:
        vrows = bench_variants(batches, contexts, device, copy_gbps, a.replays, variants, a.rounds)
        common.write_results("attention_variants" + _tag(), vrows, title="Paged decode attention: the table's config "
                             "and its variants", notes=[*notes[:2], f"alternating, {a.rounds} rounds; us: their mean; "
                                                    "vs_table: the table's us / this one's"],
                             device=device, out_dir=a.out)
        common.plot_lines("attention_variants" + _tag(), vrows, x="context", y="pct_of_copy_bw", series="series",
                          logx=True, out_dir=a.out, title="Paged decode attention: table and variants",
                          xlabel="context (tokens)", ylabel="% of copy bandwidth", hlines={"target 85%": 85.0})
    if a.sweep:
        sweep(batches, contexts, device, copy_gbps, a.replays, a.deadline, a.out, a.compile_workers)


if __name__ == "__main__":
    main()
