"""Llama-3-8B's linear stack at decode-sized M: cuBLAS against the small-M Triton GEMM, on the copy-bandwidth ceiling.

The stack: 32 layers x (qkv 4096 -> 6144, o 4096 -> 4096, gate_up 4096 -> 28672, down 14336 -> 4096) + lm_head
4096 -> 128256, every layer with its OWN weight tensors (no L2 reuse between layers: 8.0 GB in fp8 / int8, 15 GB in
bf16, one dtype allocated at a time), timed as ONE CUDA graph of the whole stack (replays timed with CUDA events),
at each M of ``--ms`` (default 1, 8, 32, 128):

- bf16: cuBLAS (``F.linear``) against ours (``ops.small_m_mm``);
- fp8: cuBLAS (``ops.fp8_scaled_mm`` with ``DYNAMO_ONCE_SMALL_M_GEMM=0``: ``torch._scaled_mm``, per-tensor scales,
  its fast layout) against ours (``ops.small_m_scaled_mm``, the same scales);
- int8: today's ``ops.int8_scaled_mm`` with the switch off (``torch._int_mm``, M <= 16 padded to 24, then the fp32
  epilogue; per-token activation and per-channel weight scales, as the int8 checkpoints have) against ours.

The quantized stacks keep the lm_head in bf16, as checkpoints leave it unquantized: ``F.linear`` in the cuBLAS rows,
``small_m_mm`` in ours. Ours takes the config table's row for each GEMM, also above the public ops' range
(``ops.small_m_gemm.triton_max_m``, where they switch to cuBLAS; beyond the table its largest-M row), so that the
rows show the crossover. Only the GEMMs are timed (no activation quantization). ``weight_bytes``: every weight read
once; ``pct_of_copy_bw``: weight_bytes / time / the device-to-device copy bandwidth measured in the same run;
``correct``: ours against cuBLAS on layer 0 and the lm_head (int8 bit for bit, fp8 / bf16 within 2**-6 of the
largest output).

``--sweep``: for each distinct (N, K) of the stack (the lm_head in bf16 only) and M of ``--sweep-ms`` (1, 4, 16),
every config of a small grid (``sweep_grid``: ~30 a dtype, GEMV and tl.dot forms, split K) for int8, fp8 and bf16,
and cuBLAS, on ONE layer's weights in ~32 distinct copies (read from HBM, not L2), a CUDA graph of one call a copy;
prints the best config per (dtype, M, N, K) and saves ``gemm_sweep`` (every config) and ``gemm_sweep_best``. Triton's
compiles (~20 configs x 3 dtypes, ~1 s each) take most of its ~2-3 minutes on an H200.

``--model llama-3.2-1b``: the 1B's stack instead (16 layers x qkv 2048 -> 3072, o 2048 -> 2048, gate_up 2048 ->
16384, down 8192 -> 2048 + lm_head 2048 -> 128256); its files end in ``_llama-3.2-1b``.

Usage: ``python -m benchmarks.gemm [--model M] [--ms 1,8,32,128] [--sweep [--sweep-ms 1,4,16]] [--quick] [--out DIR]``; files
are written only with ``--out``. ``--quick``: tiny shapes on CUDA (a harness check); without CUDA it says so and
stops (the kernels run on CPU only in Triton's interpreter, far too slowly for these sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

import ops
from benchmarks import common
from ops.small_m_gemm import SMALL_M_TABLE, SmallMConfig, triton_max_m

BF16, FP8, INT8 = torch.bfloat16, torch.float8_e4m3fn, torch.int8
DTYPES = {"bf16": BF16, "fp8": FP8, "int8": INT8}
IMPLS = ("cuBLAS", "ours")
#: ``--fast-accum``'s extra impl: cuBLAS with fast fp8 accumulation (fp8 stacks only; ``ops.scaled_mm``).
FAST = "cuBLAS fast"


@dataclass(frozen=True)
class Model:
    """The linear layers of a decoder: ``shapes`` as (name, K, N), ``layers`` times, then the lm_head."""

    layers: int
    shapes: tuple[tuple[str, int, int], ...]
    lm_head: tuple[str, int, int]

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """Every weight read once: the layers in ``dtype``, the lm_head in bf16 (2 bytes)."""
        per_layer = sum(k * n for _, k, n in self.shapes)
        return self.layers * per_layer * dtype.itemsize + self.lm_head[1] * self.lm_head[2] * 2


LLAMA_3_8B = Model(32, (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)),
                   ("lm_head", 4096, 128256))
LLAMA_3_2_1B = Model(16, (("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048)),
                     ("lm_head", 2048, 128256))
#: ``--model`` -> the stack (files of a model other than the 8B end in ``_<model>``).
MODELS = {"llama-3-8b": LLAMA_3_8B, "llama-3.2-1b": LLAMA_3_2_1B}
# --quick: the same structure shrunk 16x (K and N multiples of 16), two layers.
QUICK = Model(2, (("qkv", 256, 384), ("o", 256, 256), ("gate_up", 256, 1792), ("down", 896, 256)),
              ("lm_head", 256, 8016))
def ours_config(m: int, n: int, k: int, dtype: torch.dtype, prefetch: int | None = None,
                preload: int | None = None) -> SmallMConfig | None:
    """The table's config, past SMALL_M_MAX too, up to the dtype's largest M and its largest-M row beyond (None
    where the table leaves the shape to cuBLAS: "ours" is then the op's cuBLAS path).

    ``prefetch`` (an "ours pfN" row): that ``SmallMConfig.PREFETCH``, and the kernel everywhere (fp8 shapes the
    table leaves to cuBLAS take int8's row, as ``ops.small_m_scaled_mm`` does by default). ``preload`` (an "ours
    plN" row): the table's configs with ``PRELOAD`` N where they are the unrolled GEMV (the others as they are)."""
    largest = max(rule.max_m for rule in SMALL_M_TABLE if dtype in rule.dtypes)
    config = ops.small_m_config(min(m, largest), n, k, dtype, max_m=largest)
    if preload is not None and config is not None and config.UNROLL:
        return dataclasses.replace(config, PRELOAD=preload)
    if prefetch is None:
        return config
    config = config or ops.small_m_config(min(m, largest), n, k, INT8, max_m=largest)
    return dataclasses.replace(config, PREFETCH=prefetch)


def impl_prefetch(impl: str, prefix: str = "ours pf") -> int | None:
    """``"ours pf4"`` -> 4; ``"ours"``, ``"cuBLAS"`` -> None (``prefix="ours pl"``: the "ours plN" rows' N)."""
    return int(impl.removeprefix(prefix)) if impl.startswith(prefix) else None


@contextmanager
def cublas_switch(impl: str):
    """``DYNAMO_ONCE_SMALL_M_GEMM=0`` for the cuBLAS rows, and ``DYNAMO_ONCE_FP8_FAST_ACCUM=1`` too for the
    "cuBLAS fast" rows (the ops read both at each call, so also in capture)."""
    if impl in ("cuBLAS", FAST):
        env = {"DYNAMO_ONCE_SMALL_M_GEMM": "0", "DYNAMO_ONCE_FP8_FAST_ACCUM": "1" if impl == FAST else "0"}
        with mock.patch.dict(os.environ, env):
            yield
    else:
        yield


def _weight(dtype: torch.dtype, n: int, k: int, device: str, g: torch.Generator) -> tuple[torch.Tensor, Any]:
    """A weight and its scale: int8 per channel, fp8 per tensor (the checkpoints' layouts), bf16 none."""
    if dtype == INT8:
        w = torch.randint(-127, 127, (n, k), generator=g, device=device, dtype=INT8)
        return w, 0.001 + 0.01 * torch.rand(n, generator=g, device=device)
    w = torch.randn(n, k, generator=g, device=device, dtype=BF16)
    if dtype == BF16:
        return w, None
    return (16 * w).to(FP8), torch.tensor([0.02], device=device)


def _activation(dtype: torch.dtype, m: int, k: int, device: str, g: torch.Generator) -> tuple[torch.Tensor, Any]:
    """``a`` and its scale: int8 per token ``[M, 1]``, fp8 per tensor ``[1]``, bf16 none."""
    if dtype == INT8:
        a = torch.randint(-127, 127, (m, k), generator=g, device=device, dtype=INT8)
        return a, 0.001 + 0.01 * torch.rand(m, 1, generator=g, device=device)
    x = torch.randn(m, k, generator=g, device=device, dtype=BF16)
    if dtype == BF16:
        return x, None
    return (16 * x).to(FP8), torch.tensor([0.05], device=device)


def gemm(impl: str, dtype: torch.dtype, a: tuple, w: tuple, config: SmallMConfig | None) -> torch.Tensor:
    """One GEMM of the stack: ``a`` and ``w`` as (tensor, scale). cuBLAS rows run under ``cublas_switch``."""
    if dtype == BF16:
        # "ours" where the table says cuBLAS (config None) is what ops.linear runs there: F.linear
        return F.linear(a[0], w[0]) if impl == "cuBLAS" or config is None else ops.small_m_mm(a[0], w[0], config=config)
    if impl == "ours" and config is not None:
        return ops.small_m_scaled_mm(a[0], w[0], a[1], w[1], BF16, config=config)
    op = ops.fp8_scaled_mm if dtype == FP8 else ops.int8_scaled_mm
    return op(a[0], w[0], a[1], w[1], BF16)


def build_stack(model: Model, dtype: torch.dtype, device: str) -> tuple[list[list[tuple]], torch.Tensor]:
    """Distinct weights for every layer (``[layer][shape] -> (w, scale)``) and the bf16 lm_head."""
    g = torch.Generator(device=device).manual_seed(0)
    layers = [[_weight(dtype, n, k, device, g) for _, k, n in model.shapes] for _ in range(model.layers)]
    _, k, n = model.lm_head
    return layers, torch.randn(n, k, generator=g, device=device, dtype=BF16)


def stack_step(model: Model, impl: str, dtype: torch.dtype, layers: list, lm_head: torch.Tensor, m: int,
               device: str) -> Callable[[], list[torch.Tensor]]:
    """The whole stack at M = ``m`` as one call (captured in one CUDA graph); returns layer 0's and the lm_head's
    outputs, for the correctness check."""
    g = torch.Generator(device=device).manual_seed(m)
    acts = {k: _activation(dtype, m, k, device, g) for k in {k for _, k, _ in model.shapes}}
    x = torch.randn(m, model.lm_head[1], generator=g, device=device, dtype=BF16)
    pf, pl = impl_prefetch(impl), impl_prefetch(impl, "ours pl")
    calls = [(acts[k], ours_config(m, n, k, dtype, pf, pl)) for _, k, n in model.shapes]
    head_config = ours_config(m, model.lm_head[2], model.lm_head[1], BF16, pf, pl)

    def step() -> list[torch.Tensor]:
        first = []
        for i, layer in enumerate(layers):
            outs = [gemm(impl, dtype, a, w, cfg) for (a, cfg), w in zip(calls, layer)]
            first = outs if i == 0 else first
        head = F.linear(x, lm_head) if impl == "cuBLAS" else ops.small_m_mm(x, lm_head, config=head_config)
        return first + [head]

    return step


def same_result(dtype: torch.dtype, ours: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> bool:
    """int8: bit for bit (both exact with the reference); else within 2**-6 of each output's largest magnitude
    (fp32 sums in another order, one bf16 rounding each: far inside it)."""
    if dtype == INT8:
        return all(torch.equal(o, r) for o, r in zip(ours[:-1], ref[:-1])) and _close(ours[-1], ref[-1])
    return all(_close(o, r) for o, r in zip(ours, ref))


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((out.float() - ref.float()).abs().max() <= 2.0**-6 * ref.float().abs().max())


def _bench_m(model: Model, impls: Sequence[str], dtype: torch.dtype, layers: list, lm_head: torch.Tensor, m: int,
             device: str, iters: int) -> tuple[dict[str, float], dict[str, bool]]:
    """µs of the whole stack at M = ``m`` per impl, and whether each of ours computed cuBLAS's results."""
    outs, times = {}, {}
    for impl in impls:
        step = stack_step(model, impl, dtype, layers, lm_head, m, device)
        with cublas_switch(impl):
            outs[impl] = step()
            times[impl] = common.bench_gpu(step, warmup=2, iters=iters, cuda_graph=True, graph_iters=1)
    return times, {impl: same_result(dtype, outs[impl], outs["cuBLAS"]) for impl in impls if impl != "cuBLAS"}


def bench_stack(model: Model, ms: list[int], device: str, copy_gbps: float, iters: int,
                impls: Sequence[str] = IMPLS, dtypes: Sequence[str] = tuple(DTYPES)) -> list[dict[str, Any]]:
    rows = []
    for name, dtype in DTYPES.items():
        if name not in dtypes:
            continue
        mine = [i for i in impls if i != FAST or dtype == FP8]
        layers, lm_head = build_stack(model, dtype, device)
        nbytes = model.weight_bytes(dtype)
        for m in ms:
            times, ok = _bench_m(model, mine, dtype, layers, lm_head, m, device, iters)
            for impl in mine:
                us = times[impl]
                rows.append({"dtype": name, "impl": impl, "M": m, "us": round(us, 1), "weight_bytes": nbytes,
                             "pct_of_copy_bw": round(100 * nbytes / (us * 1e-6) / (copy_gbps * 1e9), 1),
                             "speedup_vs_cublas": round(times["cuBLAS"] / us, 3), "correct": ok.get(impl, "")})
                print(rows[-1], flush=True)
        del layers, lm_head  # one dtype's stack at a time (bf16: 15 GB)
        torch.cuda.empty_cache()
    return rows


# The sweep's candidates (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, DOT, num_warps, num_stages[, PREFETCH, SERIAL, SWAP,
# UNROLL]): the unrolled GEMV (M = 1: one row a program), rolled GEMV rows of 4 (M = 2-4), 16-row dot tiles (every
# M <= 16), with split K in the rolled families. Triton compiles each once a dtype (M is not specialized; the
# unrolled GEMV once a K), ~1 s each on the H200 machine. The unrolled GEMV's rows: the fastest in
# benchmarks.l2_prefetch's first run (results/l2_prefetch_gemv.md) and their neighbours; the rolled GEMV rows of 1
# they replace never won a shape.
# The taller ones (16-32 weight rows a program) give each thread several rows of one K slice: a's conversion (and,
# for 8-bit weights, the per-element instructions that bound the GEMV) shared by the rows.
_GEMV_1 = [(1, b_n, b_k, 1, False, warps, 1, 1, False, False, True)
           for b_n, b_k, warps in ((2, 512, 4), (2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 256, 4), (8, 512, 4),
                                   (8, 512, 8), (16, 256, 8), (8, 1024, 4), (16, 256, 4), (16, 512, 4),
                                   (16, 1024, 8), (32, 256, 4), (32, 512, 8))]
# M = 1 on the tensor cores with the product swapped (w @ a.T: 64-128 weight rows the MMA's tall side, a's one row
# padded to 16): no per-element conversion of 8-bit weights.
_SWAP_16 = [(16, 64, 128, 1, True, 4, 4, 1, False, True), (16, 64, 256, 1, True, 4, 3, 1, False, True),
            (16, 128, 128, 1, True, 4, 4, 1, False, True), (16, 128, 256, 1, True, 8, 3, 1, False, True),
            (16, 64, 256, 2, True, 4, 3, 1, False, True)]
# The unrolled GEMV over 2-8 rows of a a program (each weight tile loaded once for all of them), at M = 2-16: int8's
# one-row tiles that won at M = 1 and a neighbour, at each row count up to M's (``sweep_grid``). The first sweep
# (results/gemm_sweep_separated_rows_bf16_h100.md) also had (2, 512, 4), (2, 1024, 4), (4, 1024, 4), (16, 256, 4)
# and (16, 512, 8); its bf16 GEMVs lost to cuBLAS or the dot tiles from M = 4 at every shape (each row's products
# are a multiply-add a weight element: instruction-bound), and their compiles took most of its 400 s.
_GEMV_ROW_TILES = ((4, 512, 4), (8, 256, 4), (8, 512, 4))
_GEMV_4 = [(4, 16, 128, 1, False, 4, 3), (4, 16, 256, 1, False, 8, 3), (4, 32, 128, 1, False, 8, 3),
           (4, 16, 128, 2, False, 4, 3)]
_DOT_16 = [(16, 16, 256, 1, True, 4, 4), (16, 32, 128, 1, True, 4, 4), (16, 32, 256, 1, True, 4, 4),
           (16, 64, 128, 1, True, 4, 4), (16, 64, 256, 1, True, 8, 3), (16, 32, 512, 1, True, 4, 3),
           (16, 32, 256, 2, True, 4, 4), (16, 32, 256, 4, True, 4, 4)]
# More split-K tiles, and split K without a second kernel (SERIAL: each tile's last split reduces).
_SPLIT_16 = [(16, 16, 256, 2, True, 4, 4), (16, 32, 128, 2, True, 4, 4), (16, 32, 256, 3, True, 4, 4),
             (16, 32, 256, 2, True, 4, 4, 1, True), (16, 32, 256, 3, True, 4, 4, 1, True),
             (16, 32, 256, 4, True, 4, 4, 1, True)]
# Past 16 rows: wider tiles (more weight bytes in flight a program, fewer programs re-reading a's rows) and
# deeper pipelines; at M > 64 also tiles as tall as 128 rows (the weights read once for every row), 8 warps
# (two warpgroups of wgmma) and split K for the narrow shapes.
_DOT_MID = [(32, 64, 256, 1, True, 4, 3), (32, 128, 128, 1, True, 4, 4), (32, 64, 128, 1, True, 4, 5),
            (32, 32, 256, 1, True, 4, 5)]
_DOT_WIDE = [(64, 64, 128, 1, True, 4, 5), (64, 128, 128, 1, True, 4, 4), (64, 128, 128, 1, True, 8, 4),
             (64, 64, 256, 1, True, 4, 3), (128, 32, 128, 1, True, 4, 4), (128, 32, 256, 1, True, 4, 3),
             (128, 64, 128, 1, True, 4, 4), (128, 64, 128, 1, True, 8, 4), (128, 64, 256, 1, True, 8, 3),
             (128, 128, 128, 1, True, 8, 3), (128, 128, 128, 1, True, 8, 4), (128, 128, 64, 1, True, 8, 5),
             (128, 256, 64, 1, True, 8, 4), (128, 64, 128, 2, True, 8, 4), (128, 32, 256, 2, True, 4, 3),
             (64, 64, 128, 2, True, 4, 5), (64, 128, 128, 2, True, 4, 4), (128, 128, 128, 2, True, 8, 3),
             (128, 128, 128, 4, True, 8, 3), (128, 128, 128, 4, True, 8, 3, 1, True), (64, 64, 128, 1, True, 4, 6),
             (64, 32, 256, 1, True, 4, 5), (64, 32, 128, 1, True, 4, 6), (128, 64, 128, 1, True, 4, 5),
             (64, 128, 64, 1, True, 4, 6)]


# The product swapped (w @ a.T, SmallMConfig.SWAP): weight tiles of 64-256 rows as the MMA's tall side (Hopper's
# wgmma), at 17-64 rows of a; with split K for the long-K down_proj.
_SWAP_MID = [(32, 64, 128, 1, True, 4, 4, 1, False, True), (32, 128, 128, 1, True, 4, 4, 1, False, True),
             (32, 128, 128, 1, True, 8, 4, 1, False, True), (32, 64, 256, 1, True, 4, 3, 1, False, True),
             (32, 128, 256, 1, True, 8, 3, 1, False, True), (32, 256, 128, 1, True, 8, 3, 1, False, True),
             (32, 64, 128, 1, True, 4, 6, 1, False, True), (32, 64, 256, 2, True, 4, 4, 1, False, True),
             (32, 128, 128, 2, True, 4, 4, 1, False, True)]


# The tiles that ran closest to cuBLAS at M = 64 and 128 (results/gemm_sweep_bf16_m128_separated_h100.csv), unswapped
# and (as tall as M) swapped, for ``sweep_grid``'s "tma" form: each with its operands read by tensor descriptors
# (SmallMConfig.TMA) and by pointer loads, side by side in one run.
_TMA_WIDE = [(64, 64, 128, 1, True, 4, 6), (64, 128, 128, 1, True, 4, 4), (64, 128, 128, 1, True, 8, 4),
             (64, 64, 256, 1, True, 4, 3), (64, 128, 64, 1, True, 4, 6), (128, 64, 128, 1, True, 8, 4),
             (128, 128, 64, 1, True, 8, 5), (128, 128, 128, 1, True, 8, 3), (128, 128, 128, 1, True, 8, 4),
             (128, 256, 64, 1, True, 8, 4), (128, 256, 64, 1, True, 8, 3)]
_TMA_SWAP = [(0, 64, 128, 1, True, 4, 6, 1, False, True), (0, 128, 128, 1, True, 4, 4, 1, False, True),
             (0, 128, 128, 1, True, 8, 4, 1, False, True), (0, 256, 128, 1, True, 8, 3, 1, False, True),
             (0, 128, 64, 1, True, 4, 6, 1, False, True)]


# Narrow shapes (Llama-3.2-1B's qkv, o and down: 2048-3072 outputs, ~32-48 tiles of 64 weight rows) past 16 rows,
# for ``sweep_grid``'s "narrow" form: swapped tiles as tall as M of 32-128 weight rows, one split and two or four
# summed in the kernel (SERIAL) so that the grid fills the SMs; stages as many as fit ~200 KB of shared memory.
_NARROW = [(64, 128, 1, 4, 6), (128, 128, 1, 4, 4), (32, 256, 1, 4, 4), (64, 256, 1, 4, 4), (64, 128, 2, 4, 6),
           (32, 256, 2, 4, 4), (64, 256, 2, 4, 4), (64, 128, 4, 4, 6), (32, 256, 4, 4, 4), (32, 128, 4, 4, 6)]


def _narrow_grid(m: int) -> list[SmallMConfig]:
    """The "narrow" form's candidates at M = ``m``, each read by pointer loads and by tensor descriptors."""
    bm = min(128, max(16, 1 << (m - 1).bit_length()))
    out = []
    for b_n, b_k, split, warps, stages in _NARROW:
        fit = (200 << 10) // (b_k * (b_n + bm) * 2)  # bf16 bytes of one stage's a and w tiles
        out += [SmallMConfig(bm, b_n, b_k, split, True, warps, max(2, min(stages, fit)), SERIAL=split > 1, SWAP=True,
                             TMA=tma) for tma in (False, True)]
    return out


def sweep_grid(m: int, forms: str = "all") -> list[SmallMConfig]:
    """The candidates at M = ``m`` (plus the table's own pick, added by ``sweep``); ``forms="unroll"``: the unrolled
    GEMV's alone (M = 1); ``"m1"``: those and the swapped 16-row dot tiles (M = 1); ``"rows"``: the unrolled GEMV
    over 1-8 rows of a a program (at most M's, rounded up to a power of 2); ``"swap"``: the swapped dot tiles alone,
    as tall as M (16-128 rows of a), which won every bf16 8B shape at M = 32 and were never in the grid below 17; each
    split-K one also with its splits summed in the kernel (``SERIAL``, as the table's split rows run); ``"tma"``: the
    tiles nearest cuBLAS past 32 rows (those no taller than M, the swapped ones as tall as M; up to 32 rows the
    swapped tiles of one split), each read by pointer loads and by tensor descriptors (``TMA``); ``"narrow"``: for
    shapes of few weight tiles (the 1B's), the swapped tiles as tall as M with one, two or four splits summed in the
    kernel, each read both ways."""
    if forms == "narrow":
        return _narrow_grid(m)
    if forms == "tma":  # at most 32 rows: the swapped tiles (those of one split) as tall as M
        bm = min(128, max(16, 1 << (m - 1).bit_length()))
        rows = [r for r in _TMA_WIDE if r[0] <= bm] + [(bm,) + r[1:] for r in _TMA_SWAP] if m > 32 else \
            [(bm,) + r[1:] for r in dict.fromkeys(_SWAP_16 + _SWAP_MID) if r[3] == 1]
        return [SmallMConfig(*r, TMA=tma) for tma in (False, True) for r in rows]
    if forms == "swap":  # 128 rows of a past 64 (the wgmma's N side takes up to 256): the weights read once
        bm = min(128, max(16, 1 << (m - 1).bit_length()))
        rows = [(bm,) + r[1:] for r in _SWAP_16 + _SWAP_MID]
        return [SmallMConfig(*r) for r in dict.fromkeys(rows + [r[:8] + (True,) + r[9:] for r in rows if r[3] > 1])]
    if forms in ("unroll", "m1"):
        return [SmallMConfig(*r) for r in _GEMV_1 + (_SWAP_16 if forms == "m1" else [])] if m == 1 else []
    if forms == "rows":  # the unrolled GEMV over 2, 4, 8 rows a program (those up to M's), and a row a program
        rows = [r for r in (1, 2, 4, 8) if r < 2 * m]
        return [SmallMConfig(r, b_n, b_k, DOT=False, num_warps=warps, num_stages=1, UNROLL=True)
                for r in rows for b_n, b_k, warps in _GEMV_ROW_TILES]
    rows = (_GEMV_1 if m == 1 else _GEMV_4 if m <= 4 else []) + _DOT_16 + _SPLIT_16
    if m > 16:  # past the small-M range: dot tiles as tall as M, up to 64 rows; wider and taller ones at M > 64
        bm = min(64, 1 << (m - 1).bit_length())
        rows = [(bm,) + r[1:] for r in _DOT_16] + (_DOT_WIDE if m > 64 else
                                                   [(bm,) + r[1:] for r in _DOT_MID + _SWAP_MID])
    return [SmallMConfig(*r) for r in rows]


def _copies(nbytes: int) -> int:
    """~32 copies of one layer's weight, so that a graph of one call a copy reads from HBM, at most 8 GiB."""
    return max(2, min(32, (8 << 30) // nbytes))


def _time_calls(fn: Callable[[tuple], Any], arg_sets: list[tuple], separated: bool = False) -> float:
    """µs a call: a CUDA graph of one call per copy in ``arg_sets``, replayed 10 times (median).

    ``separated``: each call follows a small elementwise kernel launched without PDL, as a decode step's GEMMs
    follow a norm or an activation, so no call overlaps the one before it; that kernel's own time (measured
    alone the same way) is subtracted."""
    n = len(arg_sets)
    if not separated:
        return common.bench_gpu(common.rotating(lambda *a: fn(a), arg_sets), warmup=n, iters=10 * n,
                                cuda_graph=True, graph_iters=n)
    scratch = torch.zeros(8192, device="cuda", dtype=BF16)

    def both(*a):
        scratch.add_(1)
        return fn(a)

    alone = common.bench_gpu(lambda: scratch.add_(1), warmup=n, iters=10 * n, cuda_graph=True, graph_iters=n)
    return common.bench_gpu(common.rotating(both, arg_sets), warmup=n, iters=10 * n, cuda_graph=True,
                            graph_iters=n) - alone


def sweep_shape(dtype: torch.dtype, n: int, k: int, ms: list[int], device: str, copy_gbps: float,
                separated: bool = False, forms: str = "all") -> list[dict[str, Any]]:
    """Every candidate for one (dtype, N, K) at each M, and cuBLAS; rows as the sweep table's."""
    g = torch.Generator(device=device).manual_seed(n + k)
    nbytes = n * k * dtype.itemsize
    weights = [_weight(dtype, n, k, device, g) for _ in range(_copies(nbytes))]
    name = next(key for key, v in DTYPES.items() if v == dtype)
    rows = []
    for m in ms:
        a = _activation(dtype, m, k, device, g)
        arg_sets = [(a, w) for w in weights]
        with cublas_switch("cuBLAS"):
            ref = gemm("cuBLAS", dtype, a, weights[0], None)
            us = _time_calls(lambda args: gemm("cuBLAS", dtype, args[0], args[1], None), arg_sets, separated)
        base = {"dtype": name, "M": m, "N": n, "K": k}
        rows.append({**base, "impl": "cuBLAS", "us": round(us, 2),
                     "pct_of_copy_bw": round(100 * nbytes / (us * 1e-6) / (copy_gbps * 1e9), 1)})
        table = ours_config(m, n, k, dtype)
        twin = table is not None and table.DOT and forms in ("tma", "narrow")
        picks = [] if table is None else [table, dataclasses.replace(table, TMA=True)] if twin else [table]
        # the table's pick (and, "tma" / "narrow", its twin of the other load), once
        for cfg in dict.fromkeys(sweep_grid(m, forms) + picks):
            try:
                out = gemm("ours", dtype, a, weights[0], cfg)
                us = _time_calls(lambda args, cfg=cfg: gemm("ours", dtype, args[0], args[1], cfg), arg_sets,
                                 separated)
            except Exception as e:  # a config Triton cannot build (shared memory, registers)
                print(f"sweep {name} M={m} N={n} K={k} {cfg}: {type(e).__name__}: {e}", flush=True)
                continue
            ok = torch.equal(out, ref) if dtype == INT8 else _close(out, ref)
            rows.append({**base, "impl": "ours", **asdict(cfg), "us": round(us, 2),
                         "pct_of_copy_bw": round(100 * nbytes / (us * 1e-6) / (copy_gbps * 1e9), 1),
                         "correct": ok, "table": cfg == table})
    del weights
    torch.cuda.empty_cache()
    return rows


def best_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dtype, M, N, K): the fastest correct config, with cuBLAS's and the table pick's times beside it."""
    out = []
    cells = dict.fromkeys((r["dtype"], r["M"], r["N"], r["K"]) for r in rows)
    for cell in cells:
        mine = [r for r in rows if (r["dtype"], r["M"], r["N"], r["K"]) == cell]
        ours = [r for r in mine if r["impl"] == "ours" and r["correct"]]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["us"])
        cublas = next(r["us"] for r in mine if r["impl"] == "cuBLAS")
        table = next((r["us"] for r in ours if r["table"]), "")
        out.append({**{k: v for k, v in best.items() if k not in ("impl", "correct", "table")},
                    "cublas_us": cublas, "table_us": table, "speedup_vs_cublas": round(cublas / best["us"], 3)})
    return out


SWEEP_COLUMNS = ["dtype", "M", "N", "K", "impl", *SmallMConfig.__dataclass_fields__, "us", "pct_of_copy_bw",
                 "correct", "table"]


def sweep(model: Model, ms: list[int], device: str, copy_gbps: float, out_dir: str | None,
          dtypes: Sequence[str] = tuple(DTYPES), suffix: str = "", separated: bool = False,
          forms: str = "all", shapes: Sequence[str] | None = None) -> None:
    """Sweep each layer shape (of ``shapes``' names in their order, default all) and the lm_head (bf16: unquantized
    in every model) in each of ``dtypes``; writes ``gemm_sweep{suffix}`` after every shape, then
    ``gemm_sweep_best``."""
    named = [(name, DTYPES[d], n, k) for d in dtypes for name, k, n in model.shapes]
    if "bf16" in dtypes:
        named.append((model.lm_head[0], BF16, model.lm_head[2], model.lm_head[1]))
    cells = [tuple(cell) for name, *cell in named] if shapes is None else \
        [tuple(cell) for want in shapes for name, *cell in named if name == want]  # in the order asked
    rows: list[dict[str, Any]] = []
    for dtype, n, k in dict.fromkeys(cells):
        rows += sweep_shape(dtype, n, k, ms, device, copy_gbps, separated, forms)
        # After every shape, so that a run cut short keeps what it measured.
        notes = [f"copy bandwidth {copy_gbps:.0f} GB/s; one CUDA graph of one call per weight copy (~32 copies, "
                 "<= 8 GiB) so every call reads its weights from HBM; median of 10 replays",
                 "separated: each call after a small elementwise kernel (no PDL), its time subtracted: no call "
                 f"overlaps the one before, as in a decode step ({'yes' if separated else 'no'})",
                 "correct: int8 bit for bit with cuBLAS (both exact), fp8 / bf16 within 2**-6 of the largest output; "
                 "table: the config SMALL_M_TABLE picks"]
        common.write_results(f"gemm_sweep{suffix}", rows, SWEEP_COLUMNS, notes=notes, device=device, out_dir=out_dir,
                             title="Small-M GEMM configs against cuBLAS, one layer's shapes")
    best = best_rows(rows)
    for r in best:
        print(f"best {r['dtype']} M={r['M']} N={r['N']} K={r['K']}: BLOCK_M={r['BLOCK_M']} BLOCK_N={r['BLOCK_N']} "
              f"BLOCK_K={r['BLOCK_K']} SPLIT_K={r['SPLIT_K']} DOT={r['DOT']} warps={r['num_warps']} "
              f"stages={r['num_stages']}: {r['us']} us ({r['pct_of_copy_bw']}% of copy), cuBLAS {r['cublas_us']} us, "
              f"table {r['table_us']} us", flush=True)
    common.write_results(f"gemm_sweep_best{suffix}", best, title="Best small-M GEMM config per dtype and shape",
                         notes=[f"copy bandwidth {copy_gbps:.0f} GB/s; from gemm_sweep"], device=device,
                         out_dir=out_dir)



def _dtype_list(p: argparse.ArgumentParser, flag: str, value: str) -> list[str]:
    names = [d.strip() for d in value.split(",") if d.strip()]
    if not names or any(d not in DTYPES for d in names):
        p.error(f"{flag}: expected comma-separated names of {', '.join(DTYPES)}; got {value!r}")
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ms", default="1,8,32,128", help="M (tokens) of the stack runs")
    p.add_argument("--sweep", action="store_true", help="only sweep the kernel's configs on one layer's shapes")
    p.add_argument("--sweep-ms", default="1,4,16", help="M of the sweep")
    p.add_argument("--separated", action="store_true", help="sweep: each call after a small elementwise kernel, as "
                   "in a decode step (back to back, a call's start overlaps the previous call's tail under PDL)")
    p.add_argument("--sweep-forms", default="all", choices=("all", "unroll", "m1", "rows", "swap", "tma", "narrow"),
                   help="sweep: every family of candidates, the unrolled GEMV's alone (M = 1), those and swapped 16-row "
                   "dot tiles (m1: M = 1), the unrolled GEMV over 1-8 rows a program (rows: M >= 1), the swapped dot "
                   "tiles as tall as M (swap), the wide tiles read by pointers and by tensor descriptors (tma), or the "
                   "swapped tiles with 1-4 splits read both ways, for narrow shapes (narrow), "
                   "beside cuBLAS and the table's pick")
    p.add_argument("--sweep-shapes", default=None, help="sweep: only these of the model's shapes, comma-separated (of "
                   + ", ".join(n for n, _, _ in LLAMA_3_8B.shapes) + ", lm_head); default all")
    p.add_argument("--sweep-dtypes", default=",".join(DTYPES), help=f"dtypes of the sweep (of {', '.join(DTYPES)})")
    p.add_argument("--iters", type=int, default=20, help="graph replays timed per stack run (median)")
    p.add_argument("--prefetch", default="", help="also time ours with these SmallMConfig.PREFETCH values (rows "
                                                    "'ours pfN'), e.g. 0,2,8")
    p.add_argument("--preload", default="", help="also time ours with these SmallMConfig.PRELOAD values in its "
                   "unrolled-GEMV rows (rows 'ours plN'), e.g. 1,2,8")
    p.add_argument("--fast-accum", action="store_true", help="also time fp8 on cuBLAS with fast accumulation "
                   "(rows 'cuBLAS fast': DYNAMO_ONCE_FP8_FAST_ACCUM=1)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"dtypes of the stack runs (of {', '.join(DTYPES)})")
    p.add_argument("--model", default="llama-3-8b", choices=tuple(MODELS), help="whose linear stack (default the 8B)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, 2 layers, on CUDA: checks the harness")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    ms, sweep_ms = common.int_list(p, "--ms", a.ms), common.int_list(p, "--sweep-ms", a.sweep_ms)
    pfs, pls = (common.int_list(p, flag, value, counts=True) for flag, value in
                (("--prefetch", a.prefetch), ("--preload", a.preload)))
    impls = list(IMPLS) + [f"ours pf{v}" for v in pfs] + [f"ours pl{v}" for v in pls] + ([FAST] if a.fast_accum else [])
    sweep_dtypes, dtypes = (_dtype_list(p, flag, value) for flag, value in
                            (("--sweep-dtypes", a.sweep_dtypes), ("--dtypes", a.dtypes)))
    names = [n for n, _, _ in LLAMA_3_8B.shapes] + ["lm_head"]
    shapes = None if a.sweep_shapes is None else [n.strip() for n in a.sweep_shapes.split(",") if n.strip()]
    if shapes is not None and (not shapes or any(n not in names for n in shapes)):
        p.error(f"--sweep-shapes: expected comma-separated names of {', '.join(names)}; got {a.sweep_shapes!r}")
    if not torch.cuda.is_available():
        if a.quick:
            print("benchmarks.gemm --quick: skipped, no CUDA GPU (the Triton kernels run on CPU only in Triton's "
                  "interpreter; tests/ops/test_small_m_gemm_interpreted.py checks them there)")
            return
        p.error("the GEMM benchmark needs a CUDA GPU; torch.cuda.is_available() is False")
    device = "cuda"
    model = QUICK if a.quick else MODELS[a.model]
    if a.quick:
        ms, sweep_ms = [m for m in ms if m <= 8] or [1], [1, 4]
    print(common.env_header(device), flush=True)
    copy_gbps = common.measure_copy_bandwidth(device=device)
    suffix = "_quick" if a.quick else "" if a.model == "llama-3-8b" else f"_{a.model}"
    label = "tiny" if a.quick else a.model
    if a.sweep:
        forms_suffix = "" if a.sweep_forms == "all" else f"_{a.sweep_forms}"
        sweep(model, sweep_ms, device, copy_gbps, a.out, sweep_dtypes,
              suffix + ("_separated" if a.separated else "") + forms_suffix, a.separated, a.sweep_forms, shapes)
        return
    rows = bench_stack(model, ms, device, copy_gbps, a.iters, impls, dtypes)
    notes = [f"copy bandwidth {copy_gbps:.0f} GB/s; {model.layers} layers x "
             + ", ".join(f"{name} {k}->{n}" for name, k, n in model.shapes)
             + f" + lm_head {model.lm_head[1]}->{model.lm_head[2]}, distinct weights per layer; one CUDA graph of the "
               f"whole stack, median of {a.iters} replays",
             "lm_head in bf16 for fp8 and int8 too (checkpoints leave it unquantized): F.linear in the cuBLAS rows, "
             "small_m_mm in ours",
             "fp8: per-tensor scales both sides (cuBLAS's fast layout); int8: per-token x per-channel, cuBLAS = "
             "ops.int8_scaled_mm with DYNAMO_ONCE_SMALL_M_GEMM=0 (torch._int_mm, M <= 16 padded to 24, fp32 epilogue)",
             "ours: the config table's row (the public ops take ours up to M = "
             + ", ".join(f"{name} {triton_max_m(d)}" for name, d in DTYPES.items())
             + "; rows above show the crossover); GEMMs only, no activation quantization",
             "correct: ours against cuBLAS on layer 0 and the lm_head (int8 bit for bit, else within 2**-6 of the "
             "largest output)",
             "ours pfN: the table's configs with PREFETCH = N (BLOCK_K steps of each program's weights prefetched into "
             "L2 before it waits for the kernel before), on every shape (fp8's cuBLAS shapes take int8's row); "
             "every small-M GEMM launches with programmatic dependent launch on Hopper"]
    if pls:
        notes.append("ours plN: the table's configs, its unrolled-GEMV rows with PRELOAD = N (BLOCK_K steps of each "
                     "program's weights loaded into registers before it waits for the kernel before)")
    if a.fast_accum:
        notes.append("cuBLAS fast: fp8 as the cuBLAS rows with DYNAMO_ONCE_FP8_FAST_ACCUM=1 (torch._scaled_mm's "
                     "use_fast_accum; the lm_head is bf16 either way); its correct column: within 2**-6 of the largest "
                     "output of cuBLAS's")
    common.write_results(f"gemm{suffix}", rows, title=f"{label} linear stack + lm_head: cuBLAS vs the small-M GEMM",
                         notes=notes, device=device, out_dir=a.out)
    common.plot_panels(f"gemm{suffix}", rows, x="M", y="pct_of_copy_bw", series="impl", panel="dtype", logx=True,
                       out_dir=a.out, title=f"{label} linear stack + lm_head ({common.device_name(device)})",
                       xlabel="M (tokens)", ylabel="% of copy bandwidth (weight bytes / time)")


if __name__ == "__main__":
    main()
