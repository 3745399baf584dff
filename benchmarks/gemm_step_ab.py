"""Small-M GEMM table rows A/B inside the decode step: is a row the sweep picked faster where the step runs it?

``benchmarks.gemm --sweep`` times one GEMM alone; a decode step runs it between norms, attention and the other
GEMMs, and the two orders can disagree (results/int8_table_step_ab.md: the sweep's pick for int8 gate-up at M = 32
was the slowest of three in the step). This times the level-3 decode step of one model (whole-step CUDA-graph
replay, ``benchmarks.decode``'s harness) once per variant of ``ops.small_m_gemm.SMALL_M_TABLE``, the variants
alternating for ``--rounds`` rounds, each run in a fresh process (one trace and compile each, as a user's start).

A variant is ``NAME=RULES``: rules ``DTYPE:MAX_M:MIN_RATIO:MIN_N:CONFIG`` separated by ``;`` (``NAME=`` alone: the
table as it is). Each rule goes before the table's first rule of its dtype with a ``max_m`` at least its own, so it
takes that M range over and leaves the smaller-M rows in front of it as they are; rules of one ``max_m`` keep the
order given (the first that fits a shape wins: a shape's own rule, then a catch-all). ``CONFIG`` is ``cublas`` or
``BMxBNxBK`` with optional ``/SPLIT_K``, ``,wWARPS``, ``,sSTAGES``, then ``,x`` (``SWAP``) or ``,u`` (the unrolled GEMV,
``UNROLL``: ``4x8x512,w4,u``), then ``,r`` (``SERIAL``: split K summed in the kernel), then ``,t`` (``TMA``: the
tiles read by tensor descriptors) (``64x64x128/2,w4,s5,x``);
``SmallMRule``'s docstring says what the other fields match. An item ``prefetch=N`` sets ``PREFETCH`` to N in every
config of the (patched) table and of ``GATED_ROWS`` (``base=;prefetch=0``: the table without the weight prefetch),
``preload=N`` ``PRELOAD`` to N in every unrolled GEMV's there (weight tiles loaded before the PDL wait), ``tma=1`` /
``=0`` ``TMA`` on / off in every dot tile's of the (patched) table (the tiles read by tensor descriptors);
``attn_preload=0`` / ``=1`` sets ``preload`` in every row of the decode attention's tables
(``ops.paged_decode_config.DECODE_TABLE`` and ``DECODE_TABLE_FP8``: the first K and V chunk read before the wait);
``attn_rule=MAX_SEQS:MAX_HEAD_SIZE:FIELD=VALUE,...`` sets ``DecodeConfig`` fields (integers; a bool field 0 or 1;
``num_splits=none``) in the row of each of those tables with that ``max_seqs`` and ``max_head_size``
(``attn_rule=8:128:num_splits=4``: the batch-8 row over four splits, where the decode kernel may launch with PDL);
``attn_row=MAX_SEQS:MAX_HEAD_SIZE:FIELD=VALUE,...`` puts a new row (those fields over ``DecodeConfig``'s defaults)
into ``DECODE_TABLE`` (the bf16 cache's) before its first row of at least that ``max_seqs`` and ``max_head_size``
(``attn_row=32:64:num_splits=2,BLOCK_N=64``: the 1B's 64-size heads at 9-32 sequences on their own row);
``gated_row=DTYPE:MAX_M:CONFIG`` puts a row into ``GATED_ROWS`` (where the gated form, GEMM + SiLU-and-mul in one
kernel, runs: ``gated_row=bf16:16:16x64x128,w4,s6,x``, bf16's gate-up at 2-16 tokens gated on the swapped tiles,
not the GEMM then the activation; ``cublas``: the unfused ops there), before its dtype's first row of a ``max_m`` at
least its own; ``inductor_pdl=0`` / ``=1`` runs the variant with Inductor's kernels launched without / with
programmatic dependent launch (its ``triton.enable_pdl`` option, on by default at level 3). A rule above the public
ops' range for its dtype (``small_m_gemm.TRITON_MAX_M``: int8 128, bf16 / fp16 128; fp8: ``SMALL_M_MAX`` = 16) raises
that range to its ``max_m`` for the run (``raised_ranges``), so e.g. an fp8 row at M <= 128 is timed against cuBLAS
inside the step. Beside the runs, ``gemm_step_ab_summary``: each variant's mean over its rounds and its change in %
against the first variant's, per batch.

``--sweep-variant NAME=CSV[,CSV...]`` adds a variant built from ``benchmarks.gemm --sweep`` files (``gemm_sweep*.csv``,
not ``_best``; several merged): per dtype, M and shape, the fastest correct config where it beats cuBLAS by at least
``--min-speedup`` (default 1.02), else ``cublas``; each rule fits its own shape (``MIN_N`` its N, ``MIN_RATIO`` its
K / N rounded down), the wider shapes first, then ``DTYPE:M:0:0:cublas`` for any other shape of that M
(:func:`sweep_rules`; ``--sweep-others table``: no such rule, the other shapes keep the table's rows).
``--attn-sweep-variant NAME=HEAD_SIZE:CSV[,CSV...]`` adds one from ``benchmarks.attention --sweep`` files of heads
of that size: per batch the config the sweep suggests, as an ``attn_row`` for batches up to it
(:func:`attention_sweep_items`).

Usage: ``python -m benchmarks.gemm_step_ab --model llama-3-8b-int8 --batches 32,128 --rounds 2 --variant base=
--variant "gu32=int8:32:0:16384:32x64x128,w4,s4" [--sweep-variant NAME=CSV] [--out DIR]`` (GPU only).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from benchmarks import common
from benchmarks.gemm import DTYPES  # the sweep's dtype names, the same in a rule
from dispatcher import compat, plugins
from ops import paged_decode_config, small_m_gemm
from ops.paged_decode_config import DecodeRule
from ops.small_m_gemm import SmallMConfig, SmallMRule

_CONFIG = re.compile(r"^(\d+)x(\d+)x(\d+)(?:/(\d+))?((?:,[ws]\d+)*)(,x|,u)?(,r)?(,t)?$")


def parse_config(text: str) -> SmallMConfig | None:
    """``cublas`` -> None; ``BMxBNxBK[/SPLIT_K][,wWARPS][,sSTAGES][,x|,u][,r][,t]`` -> the config (``,x``: ``SWAP``,
    the product as w @ a.T; ``,u``: ``UNROLL``, the unrolled GEMV; ``,r``: ``SERIAL``, split K summed in the kernel;
    ``,t``: ``TMA``, the tiles read by tensor descriptors); ValueError naming the text."""
    if text == "cublas":
        return None
    m = _CONFIG.match(text)
    if m is None:
        raise ValueError(f"a rule's config must be 'cublas' or "
                         f"BMxBNxBK[/SPLIT_K][,wWARPS][,sSTAGES][,x|,u][,r][,t] (e.g. 64x64x128/2,w4,s5); got {text!r}")
    options = dict(num_warps=4, num_stages=3)
    for opt in filter(None, m.group(5).split(",")):
        options["num_warps" if opt[0] == "w" else "num_stages"] = int(opt[1:])
    form = m.group(6)
    if form == ",u":  # the unrolled GEMV: no tl.dot, no pipeline stages
        options.update(DOT=False, UNROLL=True, num_stages=1)
    return SmallMConfig(int(m.group(1)), int(m.group(2)), int(m.group(3)), SPLIT_K=int(m.group(4) or 1),
                        SWAP=form == ",x", SERIAL=m.group(7) is not None, TMA=m.group(8) is not None, **options)


def config_text(config: SmallMConfig) -> str | None:
    """The rule text :func:`parse_config` reads back as ``config``, or None: a config a rule cannot name (the rolled
    GEMV form, a non-default ``PREFETCH`` or ``PRELOAD``)."""
    split = f"/{config.SPLIT_K}" if config.SPLIT_K > 1 else ""
    options = f",w{config.num_warps}" + (",u" if config.UNROLL else f",s{config.num_stages}")
    forms = (",x" if config.SWAP else "") + (",r" if config.SERIAL else "") + (",t" if config.TMA else "")
    text = f"{config.BLOCK_M}x{config.BLOCK_N}x{config.BLOCK_K}{split}{options}{forms}"
    try:
        return text if parse_config(text) == config else None
    except ValueError:  # the text's config is not a valid one (the rolled GEMV's tiles as dot tiles)
        return None


def sweep_rules(paths: list[str], min_speedup: float = 1.02, others: str = "cublas") -> list[str]:
    """Rules (``DTYPE:MAX_M:MIN_RATIO:MIN_N:CONFIG`` texts) from ``benchmarks.gemm --sweep`` CSV files: per dtype, M
    and shape (N, K), the fastest correct config a rule can name where cuBLAS takes at least ``min_speedup`` times
    as long, else ``cublas``; the shapes widest N first (then longest K / N), so that each rule's ``MIN_N`` and
    ``MIN_RATIO`` (K / N rounded down to 1e-4) fit no shape before it; then ``DTYPE:M:0:0:cublas`` for any other
    shape at that M (``others="table"``: none, so that the shapes the sweep did not have keep the table's rows).
    ValueError naming a file with no cuBLAS row."""
    cublas: dict[tuple[str, int, int, int], float] = {}
    best: dict[tuple[str, int, int, int], tuple[float, str]] = {}
    for path in paths:
        rows = common.read_results(path)[1]
        if not any(r["impl"] == "cuBLAS" for r in rows):
            raise ValueError(f"{path}: expected a benchmarks.gemm --sweep CSV (rows of impl cuBLAS and ours); found "
                             f"no cuBLAS row")
        for r in rows:
            key, us = (r["dtype"], r["M"], r["N"], r["K"]), r["us"]
            if r["impl"] == "cuBLAS":
                cublas[key] = min(us, cublas.get(key, math.inf))
            elif r["correct"] is not True or us >= best.get(key, (math.inf,))[0]:
                continue
            elif text := config_text(SmallMConfig(**{f: r[f] for f in SmallMConfig.__dataclass_fields__ if f in r})):
                best[key] = (us, text)
    rules = []
    for key in sorted(cublas, key=lambda c: (c[0], c[1], -c[2], -c[3] / c[2])):
        us, text = best.get(key, (math.inf, "cublas"))
        dtype, m, n, k = key
        rules.append(f"{dtype}:{m}:{math.floor(k / n * 1e4) / 1e4}:{n}:"
                     f"{text if cublas[key] >= min_speedup * us else 'cublas'}")
    if others == "table":
        return rules
    return rules + [f"{dtype}:{m}:0:0:cublas" for dtype, m in dict.fromkeys(key[:2] for key in sorted(cublas))]


def parse_rule(text: str) -> SmallMRule:
    """``DTYPE:MAX_M:MIN_RATIO:MIN_N:CONFIG`` -> a table rule (ValueError naming the field and what it held)."""
    fields = text.split(":")
    if len(fields) != 5:
        raise ValueError(f"a rule must be DTYPE:MAX_M:MIN_RATIO:MIN_N:CONFIG (5 fields); got {text!r}")
    dtype, max_m, ratio, min_n, config = fields
    if dtype not in DTYPES:
        raise ValueError(f"a rule's dtype must be one of {', '.join(DTYPES)}; got {dtype!r} in {text!r}")
    try:
        numbers = int(max_m), float(ratio), int(min_n)
    except ValueError:
        raise ValueError(f"a rule's MAX_M and MIN_N must be integers and MIN_RATIO a number; got {text!r}") from None
    return SmallMRule(numbers[0], (DTYPES[dtype],), numbers[1], numbers[2], parse_config(config))


_OVERRIDE = re.compile(r"^(prefetch|preload|tma|attn_preload|inductor_pdl)=(\d+)$")
_ATTN_RULE = "attn_rule="
_ATTN_ROW = "attn_row="
_GATED_ROW = "gated_row="
_DECODE_TABLES = ("DECODE_TABLE", "DECODE_TABLE_FP8")


def parse_variant(text: str) -> tuple[str, list[SmallMRule]]:
    """``NAME=RULE;RULE...`` -> (name, rules); ``NAME=``: no rules (the table as it is). ``prefetch=N``,
    ``preload=N``, ``tma=N``, ``attn_preload=N`` and ``inductor_pdl=N`` items are not rules
    (:func:`variant_option`), nor ``attn_rule=...`` / ``attn_row=...`` items (:func:`attention_tables`; checked
    here)."""
    name, sep, rules = text.partition("=")
    if not sep or not re.fullmatch(r"[\w.-]+", name):
        raise ValueError(f"a variant must be NAME=RULES with NAME of letters, digits, '_', '.' or '-'; got {text!r}")
    items = [r for r in rules.split(";") if r and not _OVERRIDE.match(r)]
    attention_tables(text)
    gated_rows(text)
    return name, [parse_rule(r) for r in items if not r.startswith((_ATTN_RULE, _ATTN_ROW, _GATED_ROW))]


def gated_rows(variant: str) -> dict[torch.dtype, tuple[tuple[int, SmallMConfig | None], ...]]:
    """``small_m_gemm.GATED_ROWS`` with the variant's ``gated_row=DTYPE:MAX_M:CONFIG`` items, each before its dtype's
    first row of a ``max_m`` at least its own (ValueError naming a malformed item)."""
    rows = dict(small_m_gemm.GATED_ROWS)
    for item in variant.partition("=")[2].split(";"):
        if not item.startswith(_GATED_ROW):
            continue
        fields = item[len(_GATED_ROW):].split(":")
        if len(fields) != 3 or fields[0] not in DTYPES or not fields[1].isdigit():
            raise ValueError(f"a gated_row item must be gated_row=DTYPE:MAX_M:CONFIG with DTYPE one of "
                             f"{', '.join(DTYPES)}; got {item!r}")
        dtype, max_m = DTYPES[fields[0]], int(fields[1])
        current = rows.get(dtype, ())
        at = next((i for i, (m, _) in enumerate(current) if m >= max_m), len(current))
        rows[dtype] = current[:at] + ((max_m, parse_config(fields[2])),) + current[at:]
    return rows


def parse_attn_rule(text: str) -> tuple[int, int, dict[str, Any]]:
    """``attn_rule=MAX_SEQS:MAX_HEAD_SIZE:FIELD=VALUE,...`` (or ``attn_row=...``) -> (max_seqs, max_head_size,
    fields); ValueError naming the item."""
    key = text.partition("=")[0]
    parts = text[len(key) + 1:].split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or not parts[2]:
        raise ValueError(f"an {key} item must be {key}=MAX_SEQS:MAX_HEAD_SIZE:FIELD=VALUE,...; got {text!r}")
    try:
        fields = paged_decode_config.config_fields(parts[2])
    except ValueError as e:
        raise ValueError(f"{e} (in {text!r})") from None
    return int(parts[0]), int(parts[1]), fields


def attention_tables(variant: str) -> dict[str, tuple[DecodeRule, ...]]:
    """The decode attention tables a variant changes (``paged_decode_config``'s names -> the changed table): its
    ``attn_rule`` items applied in order, then ``attn_preload``; ValueError where an item's row is in neither table
    or its fields make no valid config."""
    tables = {name: getattr(paged_decode_config, name) for name in _DECODE_TABLES}
    changed = set()
    for item in variant.partition("=")[2].split(";"):
        if item.startswith(_ATTN_ROW):
            tables["DECODE_TABLE"] = with_attention_row(tables["DECODE_TABLE"], *parse_attn_rule(item), item)
            changed.add("DECODE_TABLE")
        if not item.startswith(_ATTN_RULE):
            continue
        max_seqs, max_head, fields = parse_attn_rule(item)
        hits = [name for name, table in tables.items()
                if any((r.max_seqs, r.max_head_size) == (max_seqs, max_head) for r in table)]
        if not hits:
            raise ValueError(f"no decode table has a row of max_seqs {max_seqs} and max_head_size {max_head}: {item!r}")
        for name in hits:
            tables[name] = tuple(dataclasses.replace(r, config=dataclasses.replace(r.config, **fields))
                                 if (r.max_seqs, r.max_head_size) == (max_seqs, max_head) else r for r in tables[name])
        changed.update(hits)
    attn = variant_option(variant, "attn_preload")
    if attn is not None:
        tables = {name: attention_preload(table, bool(attn)) for name, table in tables.items()}
        changed.update(tables)
    return {name: tables[name] for name in changed}


def with_attention_row(table: tuple[DecodeRule, ...], max_seqs: int, max_head: int, fields: dict[str, Any],
                        item: str) -> tuple[DecodeRule, ...]:
    """``table`` with a new row (``DecodeConfig(**fields)``) before its first of at least ``max_seqs`` and
    ``max_head``: batches of at most ``max_seqs`` with heads of at most ``max_head`` that no row before it takes now
    take it. ValueError naming ``item`` where the fields make no valid config."""
    try:
        row = DecodeRule(max_seqs, max_head, paged_decode_config.DecodeConfig(**fields))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{e} (in {item!r})") from None
    at = next((i for i, r in enumerate(table) if r.max_seqs >= max_seqs and r.max_head_size >= max_head), len(table))
    return table[:at] + (row,) + table[at:]


def variant_option(text: str, name: str) -> int | None:
    """The variant's ``name=N`` item (``prefetch``, ``preload``, ``tma``, ``attn_preload``, ``inductor_pdl``; the last
    one given), or None: none given."""
    items = map(_OVERRIDE.match, text.partition("=")[2].split(";"))
    found = [int(m.group(2)) for m in items if m and m.group(1) == name]
    return found[-1] if found else None


def _early_reads(config: SmallMConfig | None, prefetch: int | None = None,
                 preload: int | None = None) -> SmallMConfig | None:
    """``config`` with ``PREFETCH = prefetch`` and, an unrolled GEMV's, ``PRELOAD = preload`` (either None: as it
    is; a config of None, a cuBLAS row: None)."""
    if config is not None and prefetch is not None:
        config = dataclasses.replace(config, PREFETCH=prefetch)
    if config is not None and config.UNROLL and preload is not None:
        config = dataclasses.replace(config, PRELOAD=preload)
    return config


def with_prefetch(table: tuple[SmallMRule, ...], prefetch: int | None,
                  preload: int | None = None) -> tuple[SmallMRule, ...]:
    """``table`` with ``PREFETCH = prefetch`` in every config and ``PRELOAD = preload`` in every unrolled GEMV's
    (either None: as it is; cuBLAS rows as they are)."""
    return tuple(dataclasses.replace(r, config=_early_reads(r.config, prefetch, preload)) for r in table)


def with_tma(table: tuple[SmallMRule, ...], on: bool) -> tuple[SmallMRule, ...]:
    """``table`` with ``TMA = on`` in every dot tile's config (the GEMVs and cuBLAS rows as they are)."""
    return tuple(dataclasses.replace(r, config=dataclasses.replace(r.config, TMA=on))
                 if r.config is not None and r.config.DOT else r for r in table)


def attention_preload(table: tuple[DecodeRule, ...], on: bool) -> tuple[DecodeRule, ...]:
    """A decode attention table with ``preload`` set to ``on`` in every row's config."""
    return tuple(dataclasses.replace(r, config=dataclasses.replace(r.config, preload=on)) for r in table)


def set_inductor_pdl(on: bool) -> None:
    """Inductor's own kernels launched with programmatic dependent launch (``on``) or not in this process's compiles,
    through its option as a plugin sets one; ValueError where this torch's Inductor has no such option."""
    key = compat.inductor_pdl_option()
    if key is None:
        raise ValueError("this torch's Inductor has no PDL option")
    plugins.set_inductor_additional_configs({key: on})


def patched_table(rules: list[SmallMRule],
                  table: tuple[SmallMRule, ...] = small_m_gemm.SMALL_M_TABLE) -> tuple[SmallMRule, ...]:
    """``table`` with each of ``rules`` before the table's first rule of its dtype whose ``max_m`` is at least its
    own (the table's end when there is none); rules that land at one place go smaller ``max_m`` first, in the order
    given where equal, so that a shape's own rule can precede a catch-all (results files before 2026-12-07 14:00 UTC
    were run with rules of one ``max_m`` in the reverse of their given order: each went before the one given before
    it)."""
    places: dict[int, list[SmallMRule]] = {}
    for rule in rules:
        at = next((i for i, r in enumerate(table) if set(rule.dtypes) <= set(r.dtypes) and r.max_m >= rule.max_m),
                  len(table))
        places.setdefault(at, []).append(rule)
    out: list[SmallMRule] = []
    for i, row in enumerate((*table, None)):
        out += sorted(places.get(i, ()), key=lambda r: r.max_m)  # stable: the given order where max_m is equal
        out += [row] if row is not None else []
    return tuple(out)


def raised_ranges(rules: list[SmallMRule]) -> dict[torch.dtype, int]:
    """Per dtype, the largest M the public ops take the kernel for under ``rules``: the ops' own range
    (``small_m_gemm.TRITON_MAX_M``, else ``SMALL_M_MAX``), raised to a rule's ``max_m`` above it (an fp8 rule at
    M <= 128 would otherwise never run: the fp8 op takes cuBLAS above 16)."""
    out = {}
    for rule in rules:
        if rule.config is None:
            continue
        for dtype in rule.dtypes:
            current = out.get(dtype, small_m_gemm.TRITON_MAX_M.get(dtype, small_m_gemm.SMALL_M_MAX))
            out[dtype] = max(current, rule.max_m)
    return out


@contextlib.contextmanager
def applied(variant: str) -> Iterator[None]:
    """The variant in place for the block: its small-M table (the rules over the table as it is now), ``GATED_ROWS``,
    the ops' raised ranges and the decode attention tables; an ``inductor_pdl`` item sets Inductor's option for this
    process's compiles (not undone)."""
    _, rules = parse_variant(variant)
    table, gated = patched_table(rules, small_m_gemm.SMALL_M_TABLE), gated_rows(variant)
    prefetch, preload = variant_option(variant, "prefetch"), variant_option(variant, "preload")
    if prefetch is not None or preload is not None:
        table = with_prefetch(table, prefetch, preload)
        gated = {dtype: tuple((m, _early_reads(c, prefetch, preload)) for m, c in rows)
                 for dtype, rows in gated.items()}
    tma = variant_option(variant, "tma")
    if tma is not None:
        table = with_tma(table, bool(tma))
    pdl = variant_option(variant, "inductor_pdl")
    if pdl is not None:
        set_inductor_pdl(bool(pdl))
    decode_tables = attention_tables(variant)
    with mock.patch.multiple(paged_decode_config, **decode_tables) if decode_tables else contextlib.nullcontext(), \
            mock.patch.object(small_m_gemm, "SMALL_M_TABLE", table), \
            mock.patch.dict(small_m_gemm.GATED_ROWS, gated), \
            mock.patch.dict(small_m_gemm.TRITON_MAX_M, raised_ranges(rules)):
        yield


def run_child(variant: str, model: str, batches: list[int], context: int, iters: int) -> None:
    """In this process: the step at every batch under the variant's table; one JSON line of rows on stdout."""
    from benchmarks import decode

    with applied(variant):
        rows, _, _ = decode.bench_model(model, batches, context, 0, torch.device("cuda"), torch.bfloat16,
                                        ["level 3"], iters, None)
    print(json.dumps([{"batch": r["batch"], "us_per_step": r["us_per_step"]} for r in rows if r["mode"] == "level 3"]))


def run_variant(variant: str, model: str, batches: list[int], context: int, iters: int) -> list[dict[str, Any]]:
    """One variant's step times, from a fresh process."""
    cmd = [sys.executable, "-m", "benchmarks.gemm_step_ab", "--child", variant, "--model", model,
           "--batches", ",".join(map(str, batches)), "--context", str(context), "--iters", str(iters)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"gemm_step_ab: the run of variant {variant!r} failed (exit {done.returncode}): "
                           f"{done.stderr.strip().splitlines()[-1:] or done.stdout[-500:]}")
    return json.loads(lines[-1])


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch and variant (in the order first run), the mean of its rounds' µs and its change against the first
    variant's mean at that batch in % (negative: faster)."""
    runs: dict[tuple[int, str], list[float]] = {}
    for r in rows:
        runs.setdefault((r["batch"], r["variant"]), []).append(r["us_per_step"])
    means = {key: sum(us) / len(us) for key, us in runs.items()}
    first: dict[int, float] = {}
    for (batch, _), mean in means.items():  # each batch's first variant is the first run there
        first.setdefault(batch, mean)
    return [dict(batch=batch, variant=name, rounds=len(runs[batch, name]), mean_us=round(mean, 1),
                 change_pct=round(100 * (mean / first[batch] - 1), 2))
            for (batch, name), mean in sorted(means.items(), key=lambda kv: kv[0][0])]  # stable: run order kept


def _built_variants(p: argparse.ArgumentParser, flag: str, form: str, items: list[str],
                    build: Callable[[str], list[str] | None]) -> list[str]:
    """``flag``'s ``NAME=SPEC`` items as variant texts, each ``NAME=`` and the items ``build(SPEC)`` gives, printed;
    an item without a name, a SPEC ``build`` refuses (None) or a file it cannot read is a one-line usage error naming
    ``form``."""
    texts = []
    for item in items:
        name, sep, spec = item.partition("=")
        try:
            built = build(spec) if sep and name and spec else None
        except (OSError, ValueError, KeyError) as e:
            p.error(f"{flag}: {type(e).__name__}: {e}")
        if built is None:
            p.error(f"{flag}: expected {form}; got {item!r}")
        texts.append(f"{name}=" + ";".join(built))
        print(f"{flag}: {texts[-1]}", flush=True)
    return texts


def _sweep_variants(p: argparse.ArgumentParser, items: list[str], min_speedup: float, others: str) -> list[str]:
    """The ``--sweep-variant NAME=CSV[,CSV...]`` items as variant texts (:func:`sweep_rules`); a bad item, file or
    ``--min-speedup`` is a one-line usage error."""
    if items and min_speedup <= 0:
        p.error(f"--min-speedup: expected a number > 0; got {min_speedup}")
    return _built_variants(p, "--sweep-variant", "NAME=CSV[,CSV...]", items,
                           lambda files: sweep_rules(files.split(","), min_speedup, others))


def attention_sweep_items(head_size: int, paths: list[str]) -> list[str]:
    """``attn_row`` items from ``benchmarks.attention --sweep`` files (``attention_sweep*.csv``, not ``_best``;
    several merged) of heads of ``head_size``: per batch the config its sweep suggests (``attention.
    suggested_configs``: the least mean loss over the contexts), as a row for batches up to that one.
    ValueError naming a file that is no such sweep."""
    from benchmarks import attention

    rows = []
    for path in paths:
        part = common.read_results(path)[1]
        if not part or not {"batch", "context", "us", "correct"} <= part[0].keys():
            raise ValueError(f"{path}: expected a benchmarks.attention --sweep CSV (columns batch, context, us, "
                             f"correct); got {sorted(part[0]) if part else 'no rows'}")
        rows += part
    items = []
    for batch, fields, _, _ in sorted(attention.suggested_configs(rows), key=lambda c: c[0]):
        text = ",".join(f"{k}={int(v) if isinstance(v, bool) else 'none' if v is None else v}"
                        for k, v in fields.items())
        items.append(f"{_ATTN_ROW}{batch}:{head_size}:{text}")
    return items


def _attn_sweep_variants(p: argparse.ArgumentParser, items: list[str]) -> list[str]:
    """The ``--attn-sweep-variant NAME=HEAD_SIZE:CSV[,CSV...]`` items as variant texts (:func:`attention_sweep_items`);
    a bad item or file is a one-line usage error."""
    def build(spec: str) -> list[str] | None:
        head, _, files = spec.partition(":")
        return attention_sweep_items(int(head), files.split(",")) if head.isdigit() and files else None

    return _built_variants(p, "--attn-sweep-variant", "NAME=HEAD_SIZE:CSV[,CSV...]", items, build)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3-8b-int8", help="a built-in model (its decode step at level 3)")
    p.add_argument("--batches", default="32,128", help="decode batch sizes")
    p.add_argument("--context", type=int, default=512, help="cached tokens per sequence")
    p.add_argument("--iters", type=int, default=30, help="timed steps per batch (median)")
    p.add_argument("--rounds", type=int, default=2, help="times each variant runs, the variants alternating")
    p.add_argument("--variant", action="append", default=[], help="NAME=RULES (see the module's docstring); repeat")
    p.add_argument("--sweep-variant", action="append", default=[], help="NAME=CSV[,CSV...]: a variant of the "
                   "sweep files' picks (see the module's docstring); repeat")
    p.add_argument("--attn-sweep-variant", action="append", default=[], help="NAME=HEAD_SIZE:CSV[,CSV...]: a "
                   "variant of the decode attention rows an attention sweep suggests (see the module's docstring)")
    p.add_argument("--min-speedup", type=float, default=1.02, help="--sweep-variant: a pick's least speedup over "
                   "cuBLAS (else cublas for its shape)")
    p.add_argument("--sweep-others", default="cublas", choices=("cublas", "table"), help="--sweep-variant: what "
                   "the shapes the sweep files do not have run at their M (cuBLAS, or the table's rows)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    batches = common.int_list(p, "--batches", a.batches)
    texts = a.variant + _sweep_variants(p, a.sweep_variant, a.min_speedup, a.sweep_others) \
        + _attn_sweep_variants(p, a.attn_sweep_variant) or ["table="]
    try:
        variants = [parse_variant(v) for v in texts]
    except ValueError as e:
        p.error(f"--variant: {e}")
    if len({name for name, _ in variants}) != len(variants):
        p.error(f"--variant: names must differ; got {[name for name, _ in variants]}")
    if a.rounds < 1:
        p.error(f"--rounds: expected >= 1; got {a.rounds}")
    if not torch.cuda.is_available():
        p.error("the small-M GEMM table is used on CUDA only; torch.cuda.is_available() is False")
    if a.child is not None:
        run_child(a.child, a.model, batches, a.context, a.iters)
        return []
    rows = []
    for round_ in range(1, a.rounds + 1):
        for text, (name, _) in zip(texts, variants):
            for r in run_variant(text, a.model, batches, a.context, a.iters):
                rows.append(dict(variant=name, round=round_, batch=r["batch"], us_per_step=r["us_per_step"]))
                print(rows[-1], flush=True)
    notes = [f"{a.model}, level 3, whole-step CUDA-graph replay of a decode step, context {a.context}; median of "
             f"{a.iters} steps; a fresh process a run, the variants alternating", *texts]
    common.write_results("gemm_step_ab", rows, title="Small-M GEMM table variants inside the decode step",
                         notes=notes, device="cuda", out_dir=a.out)
    common.write_results("gemm_step_ab_summary", summary(rows), title="Each variant's mean over its rounds",
                         notes=[f"change_pct: against {variants[0][0]}'s mean at that batch (negative: faster)",
                                *notes], device="cuda", out_dir=a.out)
    common.plot_lines("gemm_step_ab", [dict(r, line=f"{r['variant']} (round {r['round']})") for r in rows],
                      x="batch", y="us_per_step", series="line", logx=True, out_dir=a.out,
                      title=f"{a.model}: decode step per table variant", xlabel="batch", ylabel="µs per step")
    return rows


if __name__ == "__main__":
    main()
