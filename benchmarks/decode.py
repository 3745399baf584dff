"""Decode-step latency and prefill throughput of the reference Llama, per compilation mode.

For each model shape (random bf16 weights) and decode batch size B (every
sequence holding ``--context`` tokens in the paged KV cache, one new token
each), the µs of one step (decoder + LM head), for:

- ``eager``: level 0 (dynamo-once's custom ops on, their default there);
- ``level 1``: stock torch.compile with Inductor (one compile, guards every call);
- ``reduce-overhead``: stock ``torch.compile(mode="reduce-overhead")`` of the whole step, compiled
  for each batch size separately (its CUDA graphs need static shapes);
  both stock modes, and the floor, see native PyTorch for every op but attention (``custom_ops=none``);
- ``level 3 piecewise``: ours, pieces between attention ops captured per size, attention eager;
- ``level 3``: ours, full_and_piecewise (a decode-only step replays one whole-step graph), the defaults: native
  code, but for a W8A8 checkpoint on CUDA the custom ops and passes of ``models.compile_defaults``;
- ``level 3 native``: as ``level 3`` with every custom op off (``custom_ops=none``), W8A8 checkpoints too;
- ``level 3 +ops``: as ``level 3`` with every dynamo-once Triton op on (Inductor's fusion off for them);
- ``level 3 +ops +passes``: as ``level 3 +ops`` with every graph pass of ``dispatcher.passes`` on (the
  fused-add recognition, the norm / activation + quantization fusions, the small-M linear rewrite);
  ``level 3 +ops +passes -NAME ...``: every pass but those named (``PassConfig``'s names); ``level 3 +NAME``,
  ``level 3 +ops +NAME``: the default passes and pass NAME; ``-op:NAME`` / ``+op:NAME``: custom op NAME off / on
  (after ``+ops``: every op but NAME); ``size:N``: also compile each piece for exactly N tokens
  (``compile_sizes``; the per-size compile a graph of N tokens then runs, which ``native_ops`` acts in);
- ``full-graph floor``: the level-1 compiled step captured whole in one CUDA graph (launch-overhead floor);
- ``weights+KV floor``: the bytes a decode step must read (every weight once, but of an embedding table only a
  lookup reads just a row a sequence; and the K and V of every cached token of every sequence in every layer) /
  measured copy bandwidth; ``pct_of_floor`` is that floor over a row's time.

Also prefill throughput (one ``--prefill`` token prompt) per mode and the
cold start-up of level 3 (trace + compile, then capture of every capture
size). Usage: ``python -m benchmarks.decode [--models llama-3.2-1b,llama-3-8b]``;
``--quick`` runs tiny-llama on CPU to check the harness.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import common
from benchmarks.gpu_clocks import ClockSampler, nvml_available
from dispatcher import CompilationConfig, CUDAGraphMode, CUDAGraphs, set_compilation_config
from models.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from models import KVCache, attention_layers
from models.loader import load_model
from ops.kv_quant import KV_CACHE_DTYPES, cache_dtype
from ops.paged_attention import DecodeWorkspace

logger = logging.getLogger(__name__)


class Harness:
    """A model with its paged cache and persistent step buffers: sequences of ``context`` cached tokens."""

    def __init__(self, name: str, config: CompilationConfig, max_batch: int, context: int, prefill: int,
                 device: torch.device, dtype: torch.dtype, kv_cache_dtype: str = "auto"):
        t0 = time.perf_counter()
        with set_compilation_config(config):
            self.model = load_model(name, dtype=dtype, device=device, progress=False).eval()
        self.load_s = time.perf_counter() - t0
        self.device = device
        self.layers = attention_layers(self.model)
        self.context = context
        block = 16
        per_seq = -(-(context + 1) // block)
        cache_dt = cache_dtype(kv_cache_dtype, dtype, getattr(self.model, "fp8_kv_cache", False))
        self.cache = KVCache(self.layers, max(max_batch * per_seq, -(-prefill // block)) * block, block,
                             dtype=cache_dt, device=device)
        self.dtype = dtype
        self.blocks_per_seq = per_seq
        max_tokens = max(max_batch, prefill, 2)  # the first call (the trace) takes 2 tokens
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.randint(0, self.model.config.vocab_size, (max_tokens,), device=device)
        self.positions = torch.zeros(max_tokens, dtype=i64, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=i64, device=device)
        self.query_start_loc = torch.zeros(max_tokens + 1, dtype=i32, device=device)
        self.seq_lens = torch.zeros(max_tokens, dtype=i32, device=device)
        self.block_table = torch.zeros(max(max_batch, 1), max(per_seq, -(-prefill // block)), dtype=i32,
                                       device=device)
        self.logits: torch.Tensor | None = None
        self.md: AttentionMetadata | None = None
        # The split-KV decode scratch and the fused merge's counters, persistent as the engine's InputBatch keeps
        # them: without it a step's plan allocates its own (per step, eagerly; in the graph's pool under capture,
        # where the fused merge's counters cannot be zeroed, so a captured step took the merge kernel).
        self.workspace = DecodeWorkspace(max(max_batch, 1))

    def as_the_runner(self, graphs: Any, rows: int) -> None:
        """Piecewise steps with ``graphs`` (a ``dispatcher.CUDAGraphs``) read their inputs as the engine's do
        (``models.engine.graphs.StepGraphs``): ``input_ids`` and ``positions`` in place (marked static: no copy into
        a piece's graph per replay), and each attention layer's output written into a persistent buffer of ``rows``
        rows that the next piece reads in place."""
        graphs.mark_static(self.input_ids, self.positions)
        for layer in self.layers.values():
            layer.piecewise_out = torch.empty(rows, layer.num_heads * layer.head_size, dtype=self.dtype,
                                              device=self.device)
            graphs.mark_static(layer.piecewise_out)

    def first_call(self, tokens: int = 2) -> float:
        """The trace + compile (warm-up with no cache, as the runner does) on ``tokens`` tokens; seconds.

        The size matters beyond the trace: Inductor picks a dynamic-shape kernel's launch config for this
        size (its candidates come from the size hint the compile sees, and its autotuning runs on the
        first launch) and keeps it for every size after. The runner warms up on ``max_num_tokens``.
        """
        t0 = time.perf_counter()
        with set_forward_context(ForwardContext(self.layers, None)), torch.inference_mode():
            self.model(self.input_ids[:tokens], self.positions[:tokens])
        _sync(self.device)
        return time.perf_counter() - t0

    def set_decode(self, batch: int) -> None:
        """Sequence i: blocks [i * per_seq, (i + 1) * per_seq), ``context`` tokens cached, one new token."""
        bs, per = self.cache.block_size, self.blocks_per_seq
        pos = self.context
        seq = torch.arange(batch, device=self.device)
        self.positions[:batch] = pos
        self.slot_mapping[:batch] = (seq * per + pos // bs) * bs + pos % bs
        self.query_start_loc[: batch + 1] = torch.arange(batch + 1, device=self.device, dtype=torch.int32)
        self.seq_lens[:batch] = pos + 1
        self.block_table[:batch, :per] = (seq[:, None] * per + torch.arange(per, device=self.device)).int()
        self.md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch], query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch], block_table=self.block_table[:batch], num_decodes=batch,
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[pos + 1] * batch, max_seq_len=pos + 1,
            workspace=self.workspace)
        self.batch = batch

    def set_prefill(self, tokens: int) -> None:
        bs = self.cache.block_size
        self.positions[:tokens] = torch.arange(tokens, device=self.device)
        self.slot_mapping[:tokens] = torch.arange(tokens, device=self.device)  # blocks 0.. in order
        self.query_start_loc[:2] = torch.tensor([0, tokens], dtype=torch.int32)
        self.seq_lens[:1] = tokens
        nblk = -(-tokens // bs)
        self.block_table[:1, :nblk] = torch.arange(nblk, device=self.device, dtype=torch.int32)
        self.md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens], query_start_loc=self.query_start_loc[:2],
            seq_lens=self.seq_lens[:1], block_table=self.block_table[:1], num_decodes=0,
            query_start_loc_cpu=[0, tokens], seq_lens_cpu=[tokens], max_seq_len=tokens, workspace=self.workspace)
        self.batch = tokens

    def step(self, model: Callable[..., Any] | None = None) -> torch.Tensor:
        t = self.batch
        fn = self.model if model is None else model
        with set_forward_context(ForwardContext(self.layers, self.md)), torch.inference_mode():
            hidden = fn(self.input_ids[:t], self.positions[:t])
            return self.model.compute_logits(hidden[-1:] if self.md.num_decodes == 0 else hidden)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], Any], device: torch.device, iters: int, clocks: ClockSampler | None = None) -> float:
    """Median µs of ``fn`` (wall clock with a sync each call: a decode step's latency as a server sees it);
    ``clocks`` samples the GPU's clock and power after each launch, while the call runs (before its sync)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        if clocks is not None:
            clocks.sample()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[len(times) // 2]


def _lookup_tables(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """The embedding tables only a lookup reads (by data pointer): a decode step reads one row a sequence of
    those, not the table; one tied to the LM head (Llama 3.2 1B's) is read whole there and is not listed."""
    tables = {m.weight.data_ptr(): m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for m in model.modules():
        if not isinstance(m, torch.nn.Embedding):
            for p in m.parameters(recurse=False):
                tables.pop(p.data_ptr(), None)
    return tables


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight a decode step reads whole: each parameter once, but the lookup-only embedding tables
    (``Floor`` counts the rows a step reads of them)."""
    seen, total = set(_lookup_tables(model)), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _row_bytes(model: torch.nn.Module) -> int:
    """Bytes a token reads of the lookup-only embedding tables: one row of each."""
    return sum(t[0].numel() * t.element_size() for t in _lookup_tables(model).values())


def _kv_bytes_per_token(cache: KVCache) -> float:
    """Bytes of K and V one cached token holds, over every layer."""
    total = sum(t.numel() * t.element_size() for t in cache.tensors.values())
    return total / (cache.num_blocks * cache.block_size)


class Floor:
    """The bandwidth floor of a decode step: weights read once, plus the K and V of every cached token.

    ``us(batch, context)``: µs to read ``weight_bytes + (kv_per_token * (context + 1) + row_bytes) * batch``
    bytes at the measured copy bandwidth (the step reads ``context`` cached tokens and writes, then reads, one
    more; and a row of the embedding table a sequence: ``row_bytes``).
    """

    def __init__(self, weight_bytes: int, kv_per_token: float, copy_bw_gbs: float, row_bytes: int = 0):
        self.weight_bytes = weight_bytes
        self.kv_per_token = kv_per_token
        self.copy_bw_gbs = copy_bw_gbs
        self.row_bytes = row_bytes

    def us(self, batch: int, context: int) -> float:
        nbytes = self.weight_bytes + (self.kv_per_token * (context + 1) + self.row_bytes) * batch
        return nbytes / (self.copy_bw_gbs * 1e9) * 1e6


def mode_config(mode: str, cuda: bool, capture_sizes: list[int], graphs: bool = True) -> CompilationConfig:
    """The compilation config a benchmark mode builds its model under.

    The stock baselines (level 1, reduce-overhead, the full-graph floor) see the model as stock
    torch.compile would: native PyTorch for every op but attention (``custom_ops=none``), so Inductor can
    fuse it; with dynamo-once's ops on (the default at levels 0-2) it would get our Triton kernels as
    opaque user kernels instead. ``graphs=False``: no CUDA graphs whatever the mode.
    """
    level = {"eager": 0, "level 1": 1, "reduce-overhead": 0, "full-graph floor": 1}.get(mode, 3)
    graph_mode = {"level 3 piecewise": "piecewise"}.get(mode, "full_and_piecewise" if level == 3 else "none")
    graph_mode = graph_mode if cuda and graphs else "none"
    words = _level3_words(mode)
    custom_ops = ["none"] if mode in ("level 1", "reduce-overhead", "full-graph floor") else \
        (["all"] if "+ops" in words else ["none"] if "native" in words else []) + \
        [w[0] + w[4:] for w in words if w[1:4] == "op:"]
    compile_sizes = [int(w[5:]) for w in words if w.startswith("size:")]
    return CompilationConfig(level=level, backend="inductor" if level == 1 else None, custom_ops=custom_ops,
                             pass_config=_mode_passes(mode), compile_sizes=compile_sizes,
                             use_cudagraph=graph_mode != "none", cudagraph_mode=graph_mode,
                             cudagraph_capture_sizes=sorted(set(capture_sizes)) if cuda else [1])


def _level3_words(mode: str) -> list[str]:
    """The switches after ``level 3`` in a mode (``["+ops", "+passes", "-noop"]``); none for other modes."""
    return mode.split()[2:] if mode.startswith("level 3 ") and mode != "level 3 piecewise" else []


def _mode_passes(mode: str) -> str:
    """The pass switches of a benchmark mode: ``all`` with ``+passes``, then each ``+NAME`` / ``-NAME`` (a
    ``PassConfig`` name); passes not named keep their default."""
    words = _level3_words(mode)
    return ",".join((["all"] if "+passes" in words else []) +
                    [w for w in words if w not in ("+ops", "+passes", "native") and w[1:4] != "op:"
                     and not w.startswith("size:")])


def bench_model(name: str, batches: list[int], context: int, prefill: int, device: torch.device,
                dtype: torch.dtype, modes: list[str], iters: int, copy_bw: float | None,
                save: Callable[[list, list, dict], None] = lambda rows, prefill_rows, startup: None,
                trace_tokens: int | None = None, kv_cache_dtype: str = "auto") -> tuple[list, list, dict]:
    """Every mode at every batch size, then prefill; ``save(rows, prefill_rows, startup)`` after each mode.
    ``kv_cache_dtype``: as ``models.LLM``'s (the floor counts the cache's bytes a token).

    ``trace_tokens``: the size of each compiled mode's first call (see :meth:`Harness.first_call`); None:
    the largest step, ``max(batches, prefill)``, as the runner warms up on its ``max_num_tokens``.
    """
    if trace_tokens is None:
        trace_tokens = max(max(batches), prefill, 2)
    if not 2 <= trace_tokens <= max(max(batches), prefill, 2):
        raise ValueError(f"bench_model: trace_tokens must be in [2, max(batches, prefill)="
                         f"{max(max(batches), prefill, 2)}]; got {trace_tokens}")
    rows: list[dict[str, Any]] = []
    prefill_rows: list[dict[str, Any]] = []
    startup: dict[str, Any] = {}
    cuda = device.type == "cuda"
    floor: Floor | None = None
    # The floor replays level 1's compiled step in one CUDA graph: measured on level 1's harness when
    # both are asked for (one model build and compile less).
    floor_with_level1 = cuda and "level 1" in modes and "full-graph floor" in modes
    for mode in modes:
        if mode == "full-graph floor" and floor_with_level1:
            continue
        run = _ModeRun(name, mode, batches, context, prefill, device, dtype, trace_tokens, kv_cache_dtype,
                       capture=False)
        h, graphs, compile_s = run.h, run.graphs, run.compile_s
        if floor is None and copy_bw:
            floor = Floor(_weight_bytes(h.model), _kv_bytes_per_token(h.cache), copy_bw, _row_bytes(h.model))
        capture_s = 0.0
        floor_graphs = CUDAGraphs() if floor_with_level1 and mode == "level 1" else None
        for b in batches:
            h.set_decode(b)
            if mode == "reduce-overhead":
                torch._dynamo.reset()
                compiled = torch.compile(h.model, mode="reduce-overhead", dynamic=False)
                t0 = time.perf_counter()
                h.step(compiled)
                h.step(compiled)
                _sync(device)
                compile_b = time.perf_counter() - t0
                us = _time(lambda: h.step(compiled), device, iters)
                rows.append(dict(model=name, mode=mode, batch=b, us_per_step=round(us, 1),
                                 compile_s=round(compile_b, 1)))
                print(rows[-1], flush=True)
                continue
            if graphs is not None:
                capture_s += graphs.capture([b], run.graph_mode, lambda n: h.step())
                us = _time(lambda: graphs.run(run.graph_mode, b, lambda n: h.step()),  # noqa: B023 - called here
                           device, iters)
            else:
                us = _time(h.step, device, iters)
            rows.append(dict(model=name, mode=mode, batch=b, us_per_step=round(us, 1),
                             compile_s=round(compile_s, 1)))
            print(rows[-1], flush=True)
            if floor_graphs is not None:
                floor_graphs.capture([b], CUDAGraphMode.FULL, lambda n: h.step())
                us = _time(lambda: floor_graphs.run(CUDAGraphMode.FULL, b, None), device, iters)  # noqa: B023
                rows.append(dict(model=name, mode="full-graph floor", batch=b, us_per_step=round(us, 1),
                                 compile_s=round(compile_s, 1)))
                print(rows[-1], flush=True)
        if mode == "level 3" or (not cuda and mode == "level 3 piecewise"):
            startup = dict(model=name, load_s=round(h.load_s, 1), trace_and_compile_s=round(compile_s, 1),
                           capture_s=round(capture_s, 1), sizes=len(batches))
        if prefill and mode != "full-graph floor":
            h.set_prefill(prefill)
            step = h.step
            if mode == "reduce-overhead":
                torch._dynamo.reset()
                compiled = torch.compile(h.model, mode="reduce-overhead", dynamic=False)
                step = lambda: h.step(compiled)  # noqa: E731
            # The median of 10 or more: with 3, one H100's two level-3 runs of the 1B's 2048-token prefill in one
            # process gave 8.43 and 12.28 ms (results/gatedlin_repeat_prefill_llama-3.2-1b_h100.md). ~0.5 s for the 8B.
            us = _time(step, device, max(10, iters // 3))
            prefill_rows.append(dict(model=name, mode=mode, tokens=prefill, ms=round(us / 1e3, 2),
                                     tokens_per_s=round(prefill / (us * 1e-6))))
            print(prefill_rows[-1], flush=True)
        del h, graphs, run
        save(_with_floor(rows, floor, name, batches, context), prefill_rows, startup)
    rows = _with_floor(rows, floor, name, batches, context)
    return rows, prefill_rows, startup


class _ModeRun:
    """One mode's harness, built and compiled (its first call), with its explicit graphs
    (``dispatcher.CUDAGraphs``: a whole-step graph per batch, or each piece's graph per size; None without graphs)
    captured for every batch size unless ``capture`` is False (:func:`bench_model` captures each before timing it)."""

    def __init__(self, name: str, mode: str, batches: list[int], context: int, prefill: int, device: torch.device,
                 dtype: torch.dtype, trace_tokens: int, kv_cache_dtype: str, capture: bool = True):
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
        cuda = device.type == "cuda"
        cfg = mode_config(mode, cuda, batches)
        self.mode = mode
        self.h = Harness(name, cfg, max(batches), context, prefill, device, dtype, kv_cache_dtype)
        self.compile_s = self.h.first_call(trace_tokens) if cfg.level > 0 else 0.0
        full = cuda and (mode in ("level 3", "full-graph floor") or bool(_level3_words(mode)))
        self.graph_mode = CUDAGraphMode.FULL if full else CUDAGraphMode.PIECEWISE
        pieces = cuda and cfg.cudagraph_mode == "piecewise"
        self.graphs = CUDAGraphs() if full or pieces else None
        if pieces:  # inputs and attention's outputs read in place, as models.engine.graphs.StepGraphs has them
            self.h.as_the_runner(self.graphs, max(batches))
        for b in batches if capture and self.graphs is not None else ():
            self.h.set_decode(b)
            self.graphs.capture([b], self.graph_mode, lambda n: self.h.step())

    def time_decode(self, batch: int, iters: int, clocks: ClockSampler | None = None) -> float:
        h = self.h
        h.set_decode(batch)
        if self.graphs is None:
            return _time(h.step, h.device, iters, clocks)
        return _time(lambda: self.graphs.run(self.graph_mode, batch, lambda n: h.step()), h.device, iters, clocks)

    def time_prefill(self, tokens: int, iters: int) -> float:
        self.h.set_prefill(tokens)
        return _time(self.h.step, self.h.device, max(10, iters // 3))


#: Modes an interleaved run can time: each keeps one compiled model, so not the stock baselines that recompile
#: per size (reduce-overhead) or replay another mode's graph (the full-graph floor).
INTERLEAVABLE = ("eager", "level 1", "level 3", "level 3 piecewise")


def _check_interleavable(modes: list[str], rounds: int) -> None:
    if rounds < 1:
        raise ValueError(f"bench_interleaved: rounds must be >= 1; got {rounds}")
    bad = [m for m in modes if m not in INTERLEAVABLE and not _level3_words(m)]
    if bad:
        raise ValueError(f"--rounds: modes must be among {', '.join(INTERLEAVABLE)} or 'level 3 +...'; got "
                         f"{', '.join(bad)}")


def _in_turn(runs: list[_ModeRun], rounds: int, measure: Callable[[_ModeRun], float]
             ) -> list[tuple[_ModeRun, list[float], float]]:
    """``measure`` of every run in turn, ``rounds`` times: each run with its times in round order, and the median
    over the rounds of its time over the first run's in the same round (paired: a drift cancels)."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for r, ts in zip(runs, times):
            ts.append(measure(r))
    return [(r, ts, statistics.median([t / t0 for t, t0 in zip(ts, times[0])])) for r, ts in zip(runs, times)]


def bench_interleaved(name: str, batches: list[int], context: int, prefill: int, device: torch.device,
                      dtype: torch.dtype, modes: list[str], iters: int, copy_bw: float | None, rounds: int,
                      trace_tokens: int | None = None, kv_cache_dtype: str = "auto",
                      clocks: bool = False) -> tuple[list, list]:
    """Every mode built and captured first, all kept; then for each batch size (then the prefill) ``rounds``
    rounds that time each mode in turn (A B C A B C ...), so that a drift of the GPU's or host's speed over the
    run (clocks, heat, other tenants) falls on every mode alike rather than on the modes timed last, as
    :func:`bench_model`'s one mode after another lets it. A row's ``us_per_step`` is the median of its rounds'
    medians; ``rounds_us`` lists them in order; ``vs_first_mode``: the median of its per-round ratios to the first
    mode's time (a paired comparison, e.g. ``level 3 piecewise`` against ``level 3``). Needs every mode's model in
    memory at once. ``clocks``: each decode row also gives the median SM clock and power draw while its calls ran
    (``sm_mhz``, ``power_w``: :mod:`benchmarks.gpu_clocks`)."""
    _check_interleavable(modes, rounds)
    trace_tokens = trace_tokens or max(max(batches), prefill, 2)
    runs = [_ModeRun(name, m, batches, context, prefill, device, dtype, trace_tokens, kv_cache_dtype) for m in modes]
    floor = None
    if copy_bw:
        h = runs[0].h
        floor = Floor(_weight_bytes(h.model), _kv_bytes_per_token(h.cache), copy_bw, _row_bytes(h.model))
    rows, prefill_rows = [], []
    for b in batches:
        samplers = {id(r): ClockSampler(device) for r in runs} if clocks else {}
        measure = lambda r: r.time_decode(b, iters, samplers.get(id(r)))  # noqa: B023, E731 - called in this turn
        for r, us, ratio in _in_turn(runs, rounds, measure):
            rows.append(dict(model=name, mode=r.mode, batch=b, us_per_step=round(statistics.median(us), 1),
                             compile_s=round(r.compile_s, 1), vs_first_mode=round(ratio, 3),
                             rounds_us="/".join(f"{u:.1f}" for u in us),
                             **(samplers[id(r)].medians() if clocks else {})))
            print(rows[-1], flush=True)
    if prefill:
        for r, us, ratio in _in_turn(runs, rounds, lambda r: r.time_prefill(prefill, iters)):
            prefill_rows.append(dict(model=name, mode=r.mode, tokens=prefill, ms=round(statistics.median(us) / 1e3, 2),
                                     tokens_per_s=round(prefill / (statistics.median(us) * 1e-6)), vs_first_mode=round(ratio, 3),
                                     rounds_ms="/".join(f"{u / 1e3:.2f}" for u in us)))
            print(prefill_rows[-1], flush=True)
    return _with_floor(rows, floor, name, batches, context), prefill_rows


def _with_floor(rows: list[dict[str, Any]], floor: Floor | None, name: str, batches: list[int],
                context: int) -> list:
    """``rows`` plus the weights+KV floor per batch, each row with its % of the floor at its batch size."""
    if floor is None:
        return list(rows)
    out = [dict(r) for r in rows] + [dict(model=name, mode="weights+KV floor", batch=b,
                                          us_per_step=round(floor.us(b, context), 1)) for b in batches]
    for r in out:
        r["pct_of_floor"] = round(100 * floor.us(r["batch"], context) / r["us_per_step"], 1) if r["us_per_step"] else ""
    return out


def profile_step(name: str, modes: list[str], batch: int, context: int, device: torch.device,
                 dtype: torch.dtype, rows: int = 15, prefill: int = 0) -> None:
    """Print where one decode step's (``prefill``: one prompt's) time goes, per mode (torch.profiler, 5 steps):
    host time by op, and on CUDA also device time by kernel."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    what = f"prefill {prefill}" if prefill else f"batch {batch}"
    for mode in modes:
        torch._dynamo.reset()
        cfg = mode_config(mode, device.type == "cuda", [batch], graphs=False)
        h = Harness(name, cfg, batch, context, prefill, device, dtype)
        if cfg.level:
            h.first_call()
        h.set_prefill(prefill) if prefill else h.set_decode(batch)
        us = _time(h.step, device, 5 if prefill else 20)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(5):
                h.step()
            _sync(device)
        # Host time to enqueue one step (no sync inside it): above the step's time, the step is host-bound.
        enqueue = []
        for _ in range(5):
            _sync(device)
            t0 = time.perf_counter()
            h.step()
            enqueue.append((time.perf_counter() - t0) * 1e6)
        _sync(device)
        print(f"== profile {name} {mode} {what}: {us:.0f} us/step, host enqueue {sorted(enqueue)[2]:.0f} us",
              flush=True)
        stats = cProfile.Profile()
        stats.enable()
        for _ in range(5):
            h.step()
        _sync(device)
        stats.disable()
        pstats.Stats(stats).sort_stats("tottime").print_stats(rows)
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)
        if device.type == "cuda":
            print(table.table(sort_by="self_device_time_total", row_limit=rows), flush=True)
        del h


GENERATE_PROMPT, GENERATE_NEW = 16, 64
GENERATE_CONTEXT = GENERATE_PROMPT + GENERATE_NEW // 2
"""The mean context of an LLM.generate decode step in :func:`bench_generate` (its floor's KV part)."""


def bench_generate(name: str, batches: list[int], device: torch.device, dtype: torch.dtype,
                   new_tokens: int = GENERATE_NEW, prompt_len: int = GENERATE_PROMPT,
                   copy_bw: float | None = None) -> list[dict[str, Any]]:
    """End to end: the median decode step of ``models.LLM.generate`` at level 3 (host scheduling, input
    copies, graph replay, greedy sampling with its host sync), one LLM for every batch size; without and
    with ``async_scheduling`` (the next step launched before the last one's tokens are read)."""
    from models import LLM

    max_b = max(batches)
    llm = LLM(name, level=3, max_num_tokens=max(512, max_b), max_num_seqs=max_b, dtype=dtype, device=device,
              num_cache_tokens=max_b * (prompt_len + new_tokens + 16), enable_prefix_caching=False)
    floor = (Floor(_weight_bytes(llm.model), _kv_bytes_per_token(llm.kv_cache), copy_bw, _row_bytes(llm.model))
             if copy_bw else None)
    context = prompt_len + new_tokens // 2
    rows = []
    for b in batches:
        prompts = [[(7 * i + j) % 1000 + 1 for j in range(prompt_len)] for i in range(b)]
        llm.generate(prompts, 4)  # warm-up
        for overlap in (False, True):  # read at generate time: one LLM serves both
            llm.async_scheduling = overlap
            llm.generate(prompts, new_tokens)
            rows.append(dict(model=name, mode="LLM.generate, level 3" + (", async" if overlap else ""), batch=b,
                             us_per_step=round(llm.stats.median_decode_step_s * 1e6, 1),
                             compile_s=round(llm.compile_time_s + llm.capture_time_s, 1)))
            if floor is not None:  # at the mean context of its steps
                rows[-1]["pct_of_floor"] = round(100 * floor.us(b, context) / rows[-1]["us_per_step"], 1)
            print(rows[-1], flush=True)
        llm.async_scheduling = False
    del llm
    return rows


def startup_child(name: str) -> None:
    """In a fresh process, as a user starts one: build ``models.LLM`` at level 3 with every default capture size,
    generate one token; print the start-up phases (``LLM.startup``) and compile counters as JSON."""
    import dataclasses
    import json

    from dispatcher import compilation_counter
    from models import LLM

    cuda = torch.cuda.is_available()
    llm = LLM(name, level=3, max_num_tokens=512, max_num_seqs=256, dtype=torch.bfloat16 if cuda else torch.float32,
              device="cuda" if cuda else "cpu", enable_prefix_caching=False)
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], max_new_tokens=1)
    st = dataclasses.asdict(llm.startup)
    n_sizes = len(llm.full_sizes) + len(llm.piece_sizes)
    print(json.dumps({"model": name, **{k: round(v, 2) if isinstance(v, float) else v for k, v in st.items()},
                      "piecewise_sizes": len(llm.piece_sizes), "full_graph_sizes": len(llm.full_sizes),
                      "capture_ms_per_graph": round(1e3 * llm.startup.capture_s / max(1, n_sizes), 1),
                      "backend_compiles": compilation_counter.num_backend_compilations,
                      "dynamo_traces": compilation_counter.num_graphs_seen,
                      "cuda_graphs_captured": compilation_counter.num_cudagraph_captured}), flush=True)


STARTUP_PHASES = ("import_s", "load_s", "trace_s", "compile_s", "capture_s")


def plot_startup(name: str, rows: list[dict[str, Any]], out_dir: str | None) -> str | None:
    """``<name>.png``: a bar per start (model, caches), stacked by phase; ``other_s`` is the rest of the way to
    the first token (the allocations before capture, the first token's step)."""
    bars = [dict(r, other_s=round(float(r["first_token_s"]) - sum(float(r[k]) for k in STARTUP_PHASES), 2))
            for r in rows]
    return common.plot_stacked_bars(name, bars, label=("model", "caches"), parts=(*STARTUP_PHASES, "other_s"),
                                    title="process start to first token, by phase", ylabel="seconds",
                                    out_dir=out_dir)


def measure_startup(name: str, kinds: tuple[str, ...] = ("cold", "warm")) -> list[dict[str, Any]]:
    """Level-3 start-up in a subprocess with empty Inductor, Triton and dynamo-once caches (cold), then again with
    the caches the first run left (warm)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(cache, "triton"), DYNAMO_ONCE_CACHE_DIR=os.path.join(cache, "ours"))
        env.pop("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", None)
        # Byte-compiled imports first, as an installed torch has them (not a compile cache: both runs get them).
        subprocess.run([sys.executable, "-c", "import benchmarks.decode, models, triton"], env=env, check=False)
        for kind in kinds:
            out = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--startup-child", name], env=env,
                                 capture_output=True, text=True, check=False)
            line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("{")), None)
            if out.returncode != 0 or line is None:
                raise RuntimeError(f"start-up of {name} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
            rows.append({"caches": kind, **json.loads(line)})
            print(rows[-1], flush=True)
    return rows


# Most important first: results are saved after every mode, so a run cut short keeps these.
MODES = ["level 3", "reduce-overhead", "level 1", "full-graph floor", "eager"]
# Also available: "level 3 piecewise" (attention eager between captured pieces, no whole-step graphs) and
# "level 3 +ops" (level 3 with every dynamo-once Triton op on instead of Inductor's fusion of the native ops),
# "level 3 +ops +passes" (that with every graph pass on).


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--context", type=int, default=512, help="cached tokens per decode sequence")
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--trace-tokens", type=int, default=None,
                   help="tokens of each compiled mode's first call (Inductor autotunes dynamic-shape kernels at "
                        "that size; default: the largest step, max(batches, prefill), as the runner warms up on "
                        "max_num_tokens)")
    p.add_argument("--quick", action="store_true", help="tiny-llama on CPU, to check the harness")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the paged cache's dtype, as models.LLM's kv_cache_dtype (default auto: the model's, or the "
                        "checkpoint's fp8 kv_cache_scheme); results files then end in _kvfp8"),
    p.add_argument("--rounds", type=int, default=None,
                   help="interleave the modes: build and capture every mode first, then time them in turn for this "
                        "many rounds a batch size (a row: the median round; rounds_us: each round), so that a "
                        "drift over the run falls on every mode alike (default: one mode after another)")
    p.add_argument("--clocks", action="store_true",
                   help="with --rounds on a GPU: each decode row also gives the median SM clock (sm_mhz) and power "
                        "draw (power_w) NVML read while its calls ran (needs pynvml: nvidia-ml-py)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", nargs="?", const="decode", choices=["decode", "prefill"], default=None,
                   help="only print torch.profiler tables of one decode step (or with `prefill`, of one --prefill "
                        "token prompt) per mode (default eager, level 1, level 3; no CUDA graphs) at the first batch size")
    p.add_argument("--startup", nargs="?", const="cold,warm", default=None,
                   help="also measure level-3 start-up with every default capture size: cold (empty Inductor and "
                        "Triton caches) and/or warm (default: both)")
    p.add_argument("--startup-only", action="store_true", help="with --startup: measure nothing else")
    p.add_argument("--startup-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--generate", action="store_true",
                   help="also time a decode step of models.LLM.generate end to end (level 3; 16-token prompts, "
                        "64 new tokens)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if a.rounds is not None:
        try:
            _check_interleavable(a.modes.split(","), a.rounds)
        except ValueError as e:
            p.error(str(e))
    if a.clocks and (a.rounds is None or a.quick or not nvml_available()):
        p.error("--clocks: needs --rounds and NVML (a CUDA device and pynvml, from nvidia-ml-py); got "
                + ("no --rounds" if a.rounds is None else "--quick" if a.quick else "no NVML here"))
    if a.startup_child:
        startup_child(a.startup_child)
        return
    if a.profile:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        name = "tiny-llama" if a.quick else a.models.split(",")[0]
        profile_step(name, a.modes.split(",") if a.modes != ",".join(MODES) else ["eager", "level 1", "level 3"],
                     int(a.batches.split(",")[0]), a.context, device,
                     torch.bfloat16 if device.type == "cuda" else torch.float32,
                     prefill=(64 if a.quick else a.prefill) if a.profile == "prefill" else 0)
        return
    if a.quick:
        device, dtype = torch.device("cpu"), torch.float32
        names, batches, context, prefill = ["tiny-llama"], [2, 4], 32, 64
        modes = [m for m in a.modes.split(",") if m in ("eager", "level 1", "level 3", "level 3 piecewise",
                                                        "level 3 +ops", "level 3 +ops +passes")]
        iters = 5
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        names, batches = a.models.split(","), [int(b) for b in a.batches.split(",")]
        context, prefill, modes, iters = a.context, a.prefill, a.modes.split(","), a.iters
    copy_bw = common.measure_copy_bandwidth() if device.type == "cuda" else None
    trace_tokens = a.trace_tokens or max(max(batches), prefill, 2)
    suffix = "_quick" if a.quick else ""
    bw = f"copy bandwidth {copy_bw:.0f} GB/s" if copy_bw else "no bandwidth floor on CPU"
    kv_note = "" if a.kv_cache_dtype == "auto" else f"; KV cache {a.kv_cache_dtype} (e4m3, scales 1)"
    for name in names:
        tag = f"{suffix}_{name}" + ("" if a.kv_cache_dtype == "auto" else "_kvfp8")
        if a.startup and device.type == "cuda":
            startup_rows = measure_startup(name, tuple(a.startup.split(",")))
            common.write_results(
                f"startup_all_sizes{tag}", startup_rows, device=device,
                out_dir=a.out, title="Level-3 start-up of models.LLM with every default capture size",
                notes=["fresh process each, process start to first token (one 8-token prompt); cold: empty Inductor, "
                       "Triton and dynamo-once compile caches; warm: the caches the cold run left",
                       "import_s: process start to LLM(...); trace_s: Dynamo's trace and first run; compile_s: "
                       "Inductor or the compile cache's load; capture_s: every CUDA graph (piecewise and full)",
                       "max_num_tokens 512, max_num_seqs 256: piecewise and full graphs for sizes 1, 2, 4, 8, ..., 256",
                       "load_s: built-in random weights, no checkpoint read (models over 2^28 parameters draw them on the GPU)"])
            plot_startup(f"startup_all_sizes{tag}", startup_rows, a.out)
            if a.startup_only:
                continue

        def save(rows: list, prefill_rows: list, startup: dict, tag: str = tag, name: str = name) -> None:
            """After every mode, so that a run cut short keeps what it measured."""
            common.write_results(f"decode{tag}", rows, title="Decode step latency (decoder + LM head)",
                                 device=device, out_dir=a.out,
                                 notes=[f"context {context} cached tokens per sequence; {bw}{kv_note}",
                                        "pct_of_floor: the weights+KV floor (every weight, and K and V of every "
                                        "cached token, read once at the copy bandwidth; of the input embedding "
                                        "table, unless tied to the LM head, a row a sequence) / this step's time"
                                        + (f"; LLM.generate rows: at their own mean context ({GENERATE_CONTEXT} "
                                           "tokens)" if a.generate else ""),
                                        f"each compiled mode's first call (trace, compile, Inductor's autotuning of "
                                        f"dynamic-shape kernels): {trace_tokens} tokens"]
                                 + ([f"modes interleaved: every mode built and captured first, then timed in turn, "
                                     f"{a.rounds} rounds a batch size (rounds_us, in order; us_per_step: their median); "
                                     f"vs_first_mode: the median over the rounds of the row's time over "
                                     f"{modes[0]!r}'s in the same round"] if a.rounds else []))
            common.write_results(f"prefill{tag}", prefill_rows, title=f"Prefill of one {prefill}-token prompt",
                                 device=device, out_dir=a.out,
                                 notes=[f"each compiled mode's first call: {trace_tokens} tokens (reduce-overhead: "
                                        f"compiled for the prompt's length)"])
            if startup:
                common.write_results(f"startup{tag}", [startup], device=device, out_dir=a.out,
                                     title="Start-up of level 3 for the benchmarked sizes")
            common.plot_lines(f"decode{tag}", rows, x="batch", y="us_per_step", series="mode", logx=True,
                              logy=True, out_dir=a.out,
                              title=f"{name}: decode step latency ({common.device_name(device)})",
                              xlabel="batch (sequences)", ylabel="µs per step")

        if a.rounds is not None:
            rows, prefill_rows = bench_interleaved(name, batches, context, prefill, device, dtype, modes, iters,
                                                   copy_bw, a.rounds, trace_tokens, a.kv_cache_dtype, a.clocks)
            startup = {}
            save(rows, prefill_rows, startup, tag=tag + "_interleaved")
        else:
            rows, prefill_rows, startup = bench_model(name, batches, context, prefill, device, dtype, modes, iters,
                                                      copy_bw, save, trace_tokens=trace_tokens,
                                                      kv_cache_dtype=a.kv_cache_dtype)
        if a.generate:
            rows += bench_generate(name, batches, device, dtype, copy_bw=copy_bw)
            save(rows, prefill_rows, startup)


if __name__ == "__main__":
    main()
