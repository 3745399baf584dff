"""The RMSNorm kernels normalize in fp32 when Inductor launches them: compiled for Hopper (sm_90) without a GPU.

In a compiled graph Inductor re-emits a ``torch.library.triton_op``'s kernel and passes its float arguments as
fp64 (the signature it gives ``eps`` is ``fp64``; an eager launch passes fp32). Taken as it came, ``eps`` made
``rstd`` fp64 and every product with it too: about fifty fp64 instructions a thread in the kernel's machine code,
a slower kernel than the eager launch's, and values a quantization step away from it. Here each kernel goes through
Triton's compiler down to ptxas with ``eps`` typed as Inductor types it, and its SASS must hold no fp64 arithmetic;
and the configs a compiled graph launches keep a row in registers. Skipped where Triton or its NVIDIA backend is
not installed.
"""

import importlib
import re

import pytest
from benchmarks.gemv_instructions import read_cubin

triton = pytest.importorskip("triton")

rms_norm = importlib.import_module("ops.rms_norm")
norm_quant = importlib.import_module("ops.norm_quant")

# fp64 arithmetic and conversions to fp64 (a single fp64 -> fp32 conversion of eps is what the kernel should do)
_FP64 = re.compile(r"\b(DADD|DMUL|DFMA|MUFU\.RSQ64H|F2F\.F64\.\w+)\b")
_TENSORS = ("x_ptr", "res_ptr", "w_ptr", "res_out_ptr")


def _target():
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401  (the backend and its ptxas)
    except ImportError as e:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {e}")
    return GPUTarget("cuda", 90, 32)


def _cubin(fn, types: dict, consts: dict, num_warps: int) -> bytes:
    """``fn`` compiled for sm_90: ``types`` the non-constexpr arguments' (default i32), ``consts`` the constexprs."""
    sig = {name: "constexpr" if name in consts else types.get(name, "i32") for name in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=_target(), options=dict(num_warps=num_warps)).asm["cubin"]


def _sass(fn, types: dict, consts: dict, num_warps: int) -> str:
    return read_cubin(_cubin(fn, types, consts, num_warps), "-sass")


@pytest.mark.parametrize("residual", [False, True], ids=["norm", "fused-add"])
def test_rms_norm_kernel_takes_an_fp64_eps_in_fp32(residual):
    types = dict({p: "*bf16" for p in _TENSORS}, out_ptr="*bf16", eps="fp64")
    consts = dict(HAS_RESIDUAL=residual, GEMMA=False, BLOCK_N=4096, ROWS=1, INT64=True, EVICT_FIRST=True, PDL=False)
    sass = _sass(rms_norm._rms_norm_kernel, types, consts, num_warps=8)
    assert "RSQ" in sass and not _FP64.findall(sass)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "fused-add"])
def test_norm_quant_kernel_takes_an_fp64_eps_in_fp32(residual, dynamic):
    types = dict({p: "*bf16" for p in _TENSORS}, scale_ptr="*fp32", q_ptr="*i8" if dynamic else "*fp8e4nv", eps="fp64")
    consts = dict(MIN_S=1e-6, HAS_RESIDUAL=residual, GEMMA=False, INT8=dynamic, DYNAMIC=dynamic, BLOCK_N=4096, ROWS=1,
                  COL_SPLIT=1, INT64=True, EVICT_FIRST=True, PDL=False)
    sass = _sass(norm_quant._rms_norm_quant_kernel, types, consts, num_warps=16)
    assert "RSQ" in sass and not _FP64.findall(sass)


@pytest.mark.parametrize("n_cols", [2048, 4096, 5120])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_norm_quant_symbolic_configs_compile_without_spills(n_cols, dtype):
    """The config a compiled graph launches (a symbolic token count) for a few hidden sizes: it compiles for sm_90
    and keeps the row in registers (no local memory)."""
    block_n, rows, num_warps = norm_quant.norm_quant_config(n_cols, 2 if dtype == "bf16" else 4, None)
    types = dict({p: f"*{dtype}" for p in _TENSORS}, scale_ptr="*fp32", q_ptr="*fp8e4nv", eps="fp64")
    consts = dict(MIN_S=1e-6, HAS_RESIDUAL=True, GEMMA=False, INT8=False, DYNAMIC=False, BLOCK_N=block_n, ROWS=rows,
                  COL_SPLIT=norm_quant.norm_quant_col_split(block_n, None, False), INT64=True, EVICT_FIRST=True,
                  PDL=False)
    cubin = _cubin(norm_quant._rms_norm_quant_kernel, types, consts, num_warps)
    assert re.search(r"LOCAL:0\b", read_cubin(cubin, "-res-usage"))
