"""Instructions a cache element of the decode attention's key-value loop, counted in its sm_90 machine code.

A decode step's attention reads each cached key and value once, and to keep up with the H200's HBM an SM must
retire ~18 cache bytes a clock: for an fp8 cache that is twice the elements a clock of a bf16 one, so the
instructions an element costs, not the bytes, can bound the kernel (the fp8 cache read at 48-56% of the copy
bandwidth where bf16 reaches 85-92%, README "fp8 KV cache"). This compiles ``benchmarks.attention_operands``'
one-split kernel for Hopper (sm_90) here, with no GPU (Triton's compiler and the ptxas and cuobjdump its package
carries), finds its loop over key tiles (the longest backward branch) and counts the SASS instructions of one
iteration: per cache (bf16, fp8), form (``attention_operands``' dot orders; 3 converts an fp8 value tile before its
shared-memory round trip) and tile. ``elements_per_warp_instr``: the tile's keys and values (BLOCK_N x 128 x 2) over
the loop's instructions on every warp; an SM issues at most 4 warp instructions a clock, so at ~18 bytes a clock an
fp8 loop needs ~4.5 elements a warp instruction at full issue, a bf16 one ~2.3.

    python -m benchmarks.attention_instructions [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
import sys
from typing import Any

import torch

from benchmarks import common
from benchmarks.gemv_instructions import read_cubin, cuobjdump

_TYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv"}
_SIG = {"q_ptr": "*bf16", "cache_ptr": "*{t}", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
        "stride_bt": "i32", "stride_half": "i64", "stride_b": "i64", "stride_s": "i32", "stride_h": "i32",
        "scale": "fp32"}
# What Triton specializes as 16-divisible at a launch on Llama-3-8B's cache: the pointers and the cache's strides.
_DIVISIBLE = ("q_ptr", "cache_ptr", "bt_ptr", "seq_lens_ptr", "out_ptr", "stride_half", "stride_b", "stride_s",
              "stride_h")
_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")
#: The tiles counted: (BLOCK_N, warps), as attention_operands' configs.
TILES = ((64, 4), (128, 4), (64, 2))


def compile_sass(dtype: torch.dtype, form: int, block_n: int, num_warps: int, num_stages: int = 3) -> str:
    """``attention_operands``' kernel for a ``dtype`` cache compiled for sm_90: its SASS (``cuobjdump -sass``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks import attention_operands as ao

    kernel = ao._kernel
    consts = dict(GROUP=ao.HEADS // ao.KV_HEADS, BLOCK_G=16, HEAD_D=ao.D, PAGE_=ao.PAGE, BLOCK_N=block_n, FORM=form)
    sig = {n: v.format(t=_TYPES[dtype]) for n, v in _SIG.items()} | {n: "constexpr" for n in consts}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in _DIVISIBLE}
    compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                            num_stages=num_stages))
    return read_cubin(compiled.asm["cubin"], "-sass")


def loop_counts(sass: str) -> collections.Counter:
    """Opcodes (with modifiers) of the longest loop in ``sass``: from a backward branch's target to the branch."""
    rows = [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]
    best: tuple[int, int, int] | None = None
    for at, text in rows:
        target = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < at:
            lo = int(target.group(1), 16)
            n = sum(1 for a, _ in rows if lo <= a <= at)
            if best is None or n > best[0]:
                best = (n, lo, at)
    assert best is not None, "the kernel has a loop over key tiles"
    _, lo, hi = best
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for a, t in rows if lo <= a <= hi)


def measure() -> list[dict[str, Any]]:
    from benchmarks import attention_operands as ao

    rows = []
    for dtype in _TYPES:
        for form in ao.forms(dtype):
            for block_n, warps in TILES:
                c = loop_counts(compile_sass(dtype, form, block_n, warps))
                n = sum(c.values())
                rows.append({"cache": str(dtype).removeprefix("torch."), "form": form, "BLOCK_N": block_n,
                             "warps": warps, "loop_instructions": n,
                             "elements_per_warp_instr": round(block_n * ao.D * 2 / (warps * n), 2),
                             "byte_shared_loads": c["LDS.U8"], "conversions": c["F2FP.F16.E4M3.UNPACK_B"],
                             "mma": sum(v for k, v in c.items() if k.startswith("HMMA"))})
                print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    try:
        import triton
    except ImportError:
        p.error("needs Triton (pip install triton): its compiler, ptxas and cuobjdump make and read the SASS")
    if not os.path.exists(cuobjdump()):
        p.error(f"Triton's package has no cuobjdump at {cuobjdump()}")
    rows = measure()
    header = (f"sm_90 SASS compiled on this machine (no GPU), triton {triton.__version__} with its ptxas, torch "
              f"{torch.__version__}, Python {platform.python_version()}, "
              f"{common.utc_now()}{common.switches()}")
    notes = ["sm_90 code compiled on the CPU (Triton's ptxas, cuobjdump -sass), benchmarks.attention_operands' "
             "kernel, Llama-3-8B heads (4 query heads a KV head on a 16-row MMA tile, D 128, 16-token pages), 3 "
             "stages; one iteration of the loop over key tiles, every warp's instructions",
             "form 0: q·kᵀ, p·v (ops.paged_attention's); 1: k·qᵀ; 2: k·qᵀ and vᵀ·pᵀ; 3: form 0, fp8 values "
             "converted before their shared-memory round trip",
             "byte_shared_loads: LDS.U8 (a transposed fp8 tile gathered a byte at a time); conversions: fp8 pairs "
             "to fp16 (F2FP.F16.E4M3.UNPACK_B)"]
    common.write_results("attention_instructions", rows, title="Decode attention's loop: sm_90 instructions a "
                         "cache element", out_dir=a.out, notes=notes, header=header)
    common.plot_panels("attention_instructions", [dict(r, tile=f"{r['BLOCK_N']}x{r['warps']}") for r in rows],
                       x="tile", y="elements_per_warp_instr", series="form", panel="cache", out_dir=a.out,
                       title="Decode attention loop: cache elements a warp instruction (sm_90)",
                       xlabel="BLOCK_N x warps", ylabel="elements a warp instruction")


if __name__ == "__main__":
    main(sys.argv[1:])
