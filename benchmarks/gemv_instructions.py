"""Instructions a weight element of the small-M GEMM's unrolled GEMV form, counted in its sm_90 machine code.

At M = 1 each weight element is one multiply-add, and to keep up with the H200's HBM an SM must retire ~18 weight
bytes a clock: for 8-bit weights the instructions an element costs, not the bytes, can bound the kernel. This
compiles ``ops.small_m_gemm``'s GEMV kernel for Hopper (sm_90) here, with no GPU (Triton's compiler and the ptxas and
cuobjdump its package carries), and counts the SASS instructions of one program over the elements one thread
handles: K x BLOCK_N / (32 x num_warps). Per tile of ``SMALL_M_TABLE``'s M = 1 rows, for each 8-bit dtype in two
forms: the kernel's (``BYTES``: fp8 an fma a product, int8 dp4a where each thread holds 16 adjacent bytes of a row,
a read in w's layout) and the plain one bf16 keeps (a multiply and an add, a broadcast from shared memory); with
``--gated``, also the gated form the fused gate-up + SiLU op runs (``ops.gated_quant``); with ``--quant``, the form
quantizing a bf16 activation as loaded (``ops.static_quant_scaled_mm``); with ``--rows``, the GEMV over 2-8 rows of a
a program (``SmallMConfig.UNROLL`` with ``BLOCK_M > 1``); and for each its registers.

    python -m benchmarks.gemv_instructions [--k 4096] [--gated] [--quant] [--rows 2,4] [--norm]
        [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
import subprocess
import sys
import tempfile
from typing import Any

import torch

from benchmarks import common

_SIG = {"a_ptr": "*{t}", "w_ptr": "*{t}", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*fp32",
        "out_ptr": "*bf16", "amax_ptr": "*fp32", "M": "i32", "N": "i32", "stride_am": "i32", "stride_wn": "i32"}
# Arguments Triton specializes as 16-divisible at a launch on the 8B's shapes: the pointers, N and the strides.
_DIVISIBLE = ("a_ptr", "w_ptr", "a_scale_ptr", "w_scale_ptr", "bias_ptr", "out_ptr", "N", "stride_am", "stride_wn")
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv", torch.int8: "i8"}
_NAMES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8", torch.int8: "int8"}
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?P\d\s+)?([A-Z][A-Z0-9_.]*)")


def cuobjdump() -> str:
    """The cuobjdump Triton's package carries."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _compile_sm90(kernel: Any, sig: dict[str, str], consts: dict[str, Any], num_warps: int,
                  divisible: tuple[str, ...] = _DIVISIBLE) -> bytes:
    """``kernel`` compiled for Hopper (sm_90) on this machine, its ``divisible`` arguments (those it has) specialized
    as 16-divisible, as a launch on the 8B's shapes specializes them; the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible
             if name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, enable_fp_fusion=False))
    return compiled.asm["cubin"]


def compile_cubin(dtype: torch.dtype, block_n: int, block_k: int, num_warps: int, k: int, bytes_form: bool,
                  gated: bool = False, quant_a: bool = False) -> bytes:
    """The GEMV kernel compiled for sm_90 for one tile, per-tensor scales, no bias, every load unmasked (EVEN).
    ``gated``: the gate-up form (``ops.small_m_gemm``'s GATED, bf16 activation): ``block_n`` gate rows and as many
    up rows a program, as the op launches the gated config of a ``2 x block_n``-row tile; bf16 operands without the
    per-tile amax (``ops.gated_linear``'s launch: ``amax_ptr`` None). ``quant_a`` (8-bit weights): the quantizing
    form (``ops.static_quant_scaled_mm``'s: a bf16 ``a`` quantized as loaded, QUANT_A)."""
    import triton.language as tl

    from ops import small_m_gemm

    kernel = small_m_gemm._small_m_gemv_kernel
    t = _TRITON_TYPES[dtype]
    tile = small_m_gemm.SmallMConfig(1, block_n, block_k, DOT=False, num_warps=num_warps, num_stages=1, UNROLL=True)
    consts = dict(K=k, BLOCK_N=block_n, BLOCK_K=block_k, INTEGER=dtype == torch.int8, SCALED=dtype != torch.bfloat16,
                  A_PER_TOKEN=False, W_PER_CHANNEL=False, HAS_BIAS=False, EVEN=True, INT64=False, PDL=True,
                  BYTES=bytes_form, DP4A=bytes_form and dtype == torch.int8 and small_m_gemm._dp4a_tile(tile),
                  GATED=gated, H=tl.bfloat16 if gated else None, QUANT_A=quant_a,
                  PRELOAD=0)  # H: the gated form's activation
    if gated and dtype == torch.bfloat16:
        consts["amax_ptr"] = None
    if quant_a:
        consts["DP4A"] = False
    sig = {name: v.format(t=t) for name, v in _SIG.items()} | {name: "constexpr" for name in consts}
    if quant_a:
        sig["a_ptr"] = "*bf16"
    return _compile_sm90(kernel, sig, consts, num_warps)


def compile_rows_cubin(dtype: torch.dtype, rows: int, block_n: int, block_k: int, num_warps: int, k: int) -> bytes:
    """The GEMV over ``rows`` rows of a a program (``ops.small_m_gemm``'s ``_small_m_gemv_rows_kernel``, as the
    launcher runs a ``SmallMConfig(rows, ...)``: int8 with dp4a and a read in w's layout, fp8 and bf16 an fma a
    product with a's rows broadcast) compiled for sm_90: per-tensor scales, no bias, every load unmasked."""
    from ops import small_m_gemm

    kernel = small_m_gemm._small_m_gemv_rows_kernel
    tile = small_m_gemm.SmallMConfig(rows, block_n, block_k, DOT=False, num_warps=num_warps, num_stages=1,
                                     UNROLL=True)
    int8 = dtype == torch.int8
    consts = dict(K=k, ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, INTEGER=int8, SCALED=dtype != torch.bfloat16,
                  A_PER_TOKEN=False, W_PER_CHANNEL=False, HAS_BIAS=False, EVEN=True, INT64=False, PDL=True,
                  BYTES=int8, DP4A=int8 and small_m_gemm._dp4a_tile(tile), PRELOAD=0)
    sig = {name: v.format(t=_TRITON_TYPES[dtype]) for name, v in _SIG.items() if name != "amax_ptr"} \
        | {name: "constexpr" for name in consts}
    return _compile_sm90(kernel, sig, consts, num_warps)


def read_cubin(cubin: bytes, flag: str) -> str:
    """``cuobjdump flag`` (e.g. ``-sass``, ``-res-usage``) of a compiled kernel's cubin, as text."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([cuobjdump(), flag, path], check=True, capture_output=True, text=True).stdout


def compile_sass(dtype: torch.dtype, block_n: int, block_k: int, num_warps: int, k: int, bytes_form: bool,
                 gated: bool = False, quant_a: bool = False) -> str:
    """:func:`compile_cubin`'s SASS (``cuobjdump -sass``)."""
    return read_cubin(compile_cubin(dtype, block_n, block_k, num_warps, k, bytes_form, gated, quant_a), "-sass")


def registers(cubin: bytes) -> int:
    """Registers a thread of the kernel (``cuobjdump -res-usage``): with the warps, what bounds its programs an SM."""
    found = re.search(r"REG:(\d+)", read_cubin(cubin, "-res-usage"))
    assert found, "cuobjdump -res-usage names the kernel's registers"
    return int(found.group(1))


def compile_rope_cubin(block_n: int, block_k: int, num_warps: int, k: int, head_size: int = 128) -> bytes:
    """``ops.rope_linear``'s fused GEMV (QKV + rotary in the epilogue) compiled for sm_90 as it launches a
    ``block_n``-row bf16 tile: ``block_n / 2`` column pairs a program, every load unmasked."""
    import importlib

    kernel = importlib.import_module("ops.rope_linear")._rope_gemv_kernel  # the module: ops.rope_linear is the op
    consts = dict(K=k, BLOCK_N=block_n // 2, BLOCK_K=block_k, HALF=head_size // 2, EVEN=True, INT64=False, PDL=True)
    sig = {name: {"pos_ptr": "*i64", "cs_ptr": "*bf16", "rot_cols": "i32", "stride_cs": "i32"}.get(name)
           or _SIG[name].format(t="bf16") for name in kernel.arg_names if name not in consts} \
        | {name: "constexpr" for name in consts}
    return _compile_sm90(kernel, sig, consts, num_warps, (*_DIVISIBLE, "cs_ptr", "pos_ptr", "stride_cs"))


def compile_norm_cubin(block_n: int, block_k: int, num_warps: int, k: int, gated: bool) -> bytes:
    """``ops.norm_linear``'s fused GEMV (residual add + RMSNorm of the activation row, then the GEMV) compiled for
    sm_90 as it launches a bf16 ``block_n``-row tile (at least ``NORM_MIN_ROWS`` rows a program; ``gated``: half gate,
    half up), every load unmasked, no weight loaded before the wait (as the other forms here)."""
    import importlib

    import triton.language as tl

    norm = importlib.import_module("ops.norm_linear")  # the module: ops.norm_linear is the op
    rows = norm_rows(block_n)
    consts = dict(K=k, BLOCK_N=rows // 2 if gated else rows, BLOCK_K=block_k, EVEN=True, INT64=False, PDL=True,
                  GATED=gated, H=tl.bfloat16, PRELOAD=0)
    pointers = ("x_ptr", "r_ptr", "g_ptr", "w_ptr", "out_ptr", "h_ptr")
    sig = {name: "*bf16" if name in pointers else "fp32" if name == "eps" else "i32"
           for name in norm._norm_gemv_kernel.arg_names if name not in consts} | {name: "constexpr" for name in consts}
    return _compile_sm90(norm._norm_gemv_kernel, sig, consts, num_warps,
                         (*pointers, "N", "stride_xm", "stride_rm", "stride_wn"))


def norm_rows(block_n: int) -> int:
    """Weight rows a program of ``ops.norm_linear``'s GEMV streams on a ``block_n``-row tile."""
    import importlib

    return max(block_n, importlib.import_module("ops.norm_linear").NORM_MIN_ROWS)


def count(sass: str) -> collections.Counter:
    """Instructions by opcode (predicated ones included)."""
    return collections.Counter(m.group(1) for line in sass.splitlines() if (m := _SASS_LINE.match(line)))


def m1_tiles() -> list[tuple[torch.dtype, int, int, int]]:
    """(dtype, BLOCK_N, BLOCK_K, num_warps) of every M = 1 unrolled-GEMV row of the table, once each."""
    from ops.small_m_gemm import SMALL_M_TABLE

    tiles = []
    for rule in SMALL_M_TABLE:
        c = rule.config
        if rule.max_m == 1 and c is not None and c.UNROLL:
            tiles += [(d, c.BLOCK_N, c.BLOCK_K, c.num_warps) for d in rule.dtypes if d in _TRITON_TYPES]
    return list(dict.fromkeys(tiles))


def _row(dtype: torch.dtype, block_n: int, block_k: int, warps: int, k: int, form: str) -> dict[str, Any]:
    """One form of one tile: ``plain``, ``8-bit``, or ``8-bit gated`` / ``gated`` (bf16) (the gated config of the tile:
    its rows half gate, half up, as ``ops.small_m_gemm.gated_config`` runs a gate-up row of the table: int8 on half
    the warps), ``rope`` (bf16: ``ops.rope_linear``'s kernel on the tile), or ``norm`` / ``norm gated`` (bf16:
    ``ops.norm_linear``'s, its rows a program at least ``NORM_MIN_ROWS``)."""
    from ops import small_m_gemm

    label = form
    if form.endswith(" (norm rows)"):  # the plain or gated form on the rows a program the norm form takes
        form, block_n = form.split()[0], norm_rows(block_n)
    gated = form in ("8-bit gated", "gated")
    n, w = block_n, warps
    if gated:
        tile = small_m_gemm.SmallMConfig(1, block_n, block_k, DOT=False, num_warps=warps, num_stages=1, UNROLL=True)
        n, w = block_n // 2, small_m_gemm.gated_config(tile, dtype).num_warps
    if form == "rope":
        cubin = compile_rope_cubin(block_n, block_k, warps, k)
    elif form.startswith("norm"):
        cubin = compile_norm_cubin(block_n, block_k, warps, k, form == "norm gated")
        block_n = norm_rows(block_n)  # its rows a program
    elif form.startswith("rows "):
        cubin = compile_rows_cubin(dtype, int(form.split()[1]), block_n, block_k, warps, k)
    else:
        cubin = compile_cubin(dtype, n, block_k, w, k, form.startswith("8-bit"), gated, form == "8-bit quantizing")
    ops_count = count(read_cubin(cubin, "-sass"))
    elements = k * block_n // (32 * w)  # gated: n gate and n up rows
    total = sum(ops_count.values())
    return {"dtype": _NAMES[dtype], "tile": f"{block_n}x{block_k} w{warps}", "form": label,
            "elements_a_thread": elements, "instructions": total, "per_element": round(total / elements, 2),
            "registers": registers(cubin), "top": ", ".join(f"{op} {c}" for op, c in ops_count.most_common(4))}


def measure(k: int, gated: bool = False, quant: bool = False, row_counts: tuple[int, ...] = (),
            norm: bool = False) -> list[dict[str, Any]]:
    rows = []
    for dtype, block_n, block_k, warps in m1_tiles():
        forms = ["8-bit", "plain"] if dtype.itemsize == 1 else ["plain"]
        if quant and dtype.itemsize == 1:
            forms.insert(1, "8-bit quantizing")
        if gated and block_n >= 2:
            forms.insert(1, "8-bit gated" if dtype.itemsize == 1 else "gated")
            forms += ["rope"] if dtype == torch.bfloat16 else []
        forms += [f"rows {r}" for r in row_counts]
        if norm and dtype == torch.bfloat16:
            forms += ["plain (norm rows)", "norm", "gated (norm rows)", "norm gated"]
        for form in forms:
            rows.append(_row(dtype, block_n, block_k, warps, k, form))
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--k", type=int, default=4096, help="K (a compile-time constant of the GEMV; default the 8B's 4096)")
    p.add_argument("--gated", action="store_true", help="also the gated (gate-up + SiLU) form of each tile, and bf16's rope form")
    p.add_argument("--quant", action="store_true", help="also the quantizing form of each 8-bit tile (a bf16 a "
                                                         "quantized as loaded: ops.static_quant_scaled_mm)")
    p.add_argument("--rows", default="", help="also the GEMV over these rows of a a program (e.g. 2,4: a "
                                                "SmallMConfig's BLOCK_M with UNROLL), per tile; instructions an "
                                                "element count every row's products")
    p.add_argument("--norm", action="store_true", help="also bf16's norm forms of each tile (ops.norm_linear: the "
                                                        "residual add and RMSNorm in the GEMV, plain and gated)")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    row_counts = tuple(common.int_list(p, "--rows", a.rows)) if a.rows else ()
    if any(r not in (2, 4, 8) for r in row_counts):
        p.error(f"--rows: expected rows a program of 2, 4 or 8; got {a.rows}")
    if a.k < 1 or a.k % 1024:
        p.error(f"--k: expected a positive multiple of 1024 (every table tile's BLOCK_K divides it); got {a.k}")
    try:
        import triton  # noqa: F401
    except ImportError:
        p.error("needs Triton (pip install triton): its compiler, ptxas and cuobjdump make and read the SASS")
    if not os.path.exists(cuobjdump()):
        p.error(f"Triton's package has no cuobjdump at {cuobjdump()}")
    import triton

    rows = measure(a.k, a.gated, a.quant, row_counts, a.norm)
    header = (f"sm_90 SASS compiled on this machine (no GPU), triton {triton.__version__} with its ptxas, torch "
              f"{torch.__version__}, Python {platform.python_version()}, "
              f"{common.utc_now()}{common.switches()}")
    notes = [f"K = {a.k}; one program's instructions (cuobjdump -sass) over the weight elements one thread handles "
             "(K x BLOCK_N / (32 x num_warps)); per-tensor scales, no bias, unmasked loads, 16-byte aligned operands",
             "form 8-bit: the kernel's for fp8 / int8 weights (fp8 an fma a product, int8 dp4a, a read in w's layout); "
             "plain: bf16's (a multiply and an add, a broadcast through shared memory), and 8-bit weights' before",
             "8-bit gated (--gated): the gate-up GEMM with SiLU-and-mul in its epilogue (ops.gated_quant), the tile's "
             "rows half gate, half up (small_m_gemm.gated_config: int8 on half its warps); the epilogue's instructions "
             "count too; gated: bf16's (ops.gated_linear: no amax); rope: ops.rope_linear's fused GEMV (QKV + rotary "
             "in its epilogue, head size 128), the tile's rows the two halves of a head's columns",
             "8-bit quantizing (--quant): the 8-bit form with a bf16 a quantized as loaded with a per-tensor scale "
             "(QUANT_A: ops.static_quant_scaled_mm at one token), a's row read flat and broadcast",
             "rows R (--rows): the GEMV over R rows of a a program (int8 dp4a with a read in w's layout, fp8 / bf16 "
             "an fma a product, a's rows broadcast), every weight tile loaded and converted once for the R rows; "
             "per_element counts the R rows' products of an element",
             "norm / norm gated (--norm): ops.norm_linear's fused GEMV (bf16): each program adds its activation row "
             "to the residual, sums its squares over K, normalizes each step's chunk, then the GEMV (gated: half the "
             "rows gate, half up), on max(BLOCK_N, NORM_MIN_ROWS) rows a program (the tile column says which); "
             "plain / gated (norm rows): the GEMV without the norm on those rows, the same tile",
             "registers: a thread's (cuobjdump -res-usage)"]
    stem = "gemv_instructions" + ("_gated" if a.gated else "") + ("_quant" if a.quant else "") \
        + ("_rows" if row_counts else "") + ("_norm" if a.norm else "")
    common.write_results(stem, rows, title="Instructions a weight element of the unrolled GEMV (sm_90)",
                         notes=notes, out_dir=a.out, header=header)
    common.plot_stacked_bars(stem, rows, label=["dtype", "tile", "form"], parts=["per_element"],
                             title="SASS instructions a weight element, unrolled GEMV at M = 1 (sm_90)",
                             ylabel="instructions / element", out_dir=a.out)


if __name__ == "__main__":
    sys.exit(main())
