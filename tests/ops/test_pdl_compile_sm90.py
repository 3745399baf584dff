"""The PDL form of every library kernel that Inductor may run inlined (a ``torch.library.triton_op``'s kernel, which
``dispatcher.compat.launch_user_kernels_with_pdl`` launches early): compiled for Hopper (sm_90) without a GPU, its PTX
touches no global memory before ``griddepcontrol.wait`` (loads, stores, atomics, async copies) and lets the next
kernel launch after it. That is what makes an early launch correct: a kernel launched while the one before it still
runs reads its outputs, and writes buffers it may still read, only once it has ended. Skipped where Triton or its
NVIDIA backend is not installed.
"""

import importlib
import re

import pytest

triton = pytest.importorskip("triton")

# Global memory accesses of any kind; griddepcontrol is no access
_GLOBAL = re.compile(r"\b(ld\.global|st\.global|atom\.|red\.|cp\.async|ld\.volatile\.global|prefetch\.global)")


def _target():
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401  (the backend and its ptxas)
    except ImportError as e:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {e}")
    return GPUTarget("cuda", 90, 32)


def _kernel(module: str, name: str):
    return getattr(importlib.import_module(module), name)


# (module, kernel, pointer dtypes (the rest *bf16), float arguments, constexprs); every kernel with PDL on
KERNELS = {
    "rotary": ("ops.rotary_embedding", "_rotary_embedding_kernel", {"pos_ptr": "*i64"}, (),
               dict(HEAD_SIZE=128, ROT_DIM=128, IS_NEOX=True, BLOCK_H=8, BLOCK_HALF=64, BLOCK_PASS=0)),
    "rms_norm": ("ops.rms_norm", "_rms_norm_kernel", {}, ("eps",),
                 dict(HAS_RESIDUAL=True, GEMMA=False, BLOCK_N=4096, ROWS=1, INT64=False, EVICT_FIRST=False)),
    "rms_norm_quant": ("ops.norm_quant", "_rms_norm_quant_kernel", {"scale_ptr": "*fp32", "q_ptr": "*fp8e4nv"},
                       ("eps",), dict(MIN_S=1e-6, HAS_RESIDUAL=True, GEMMA=False, INT8=False, DYNAMIC=False,
                                      BLOCK_N=4096, ROWS=1, COL_SPLIT=1, INT64=False, EVICT_FIRST=False)),
    "act_and_mul": ("ops.silu_and_mul", "_act_and_mul_kernel", {}, (),
                    dict(ACT=0, BLOCK_D=1024, ROWS=1, INT64=False, EVEN=True)),
    "act_and_mul_quant": ("ops.act_quant", "_act_and_mul_quant_kernel", {"scale_ptr": "*fp32", "q_ptr": "*i8"}, (),
                          dict(MIN_S=1e-6, ACT=0, INT8=True, DYNAMIC=True, BLOCK_D=4096, ROWS=1, INT64=False)),
    "static_fp8_quant": ("ops.quant_fp8", "_static_fp8_quant_kernel", {"scale_ptr": "*fp32", "q_ptr": "*fp8e4nv"},
                         (), dict(BLOCK=1024, INT64=False, EVEN=False)),
    "per_token_quant": ("ops.quant_fp8", "_per_token_quant_kernel", {"scale_ptr": "*fp32", "q_ptr": "*fp8e4nv"}, (),
                        dict(MIN_S=1e-6, BLOCK=4096, ROWS=1, ONE_PASS=True, INT8=False, INT64=False)),
    "static_int8_quant": ("ops.quant_int8", "_static_int8_quant_kernel", {"scale_ptr": "*fp32", "q_ptr": "*i8"}, (),
                          dict(BLOCK=1024, INT64=False, EVEN=False)),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_pdl_form_waits_before_any_global_access_and_lets_the_next_launch(name):
    module, kernel_name, pointers, floats, consts = KERNELS[name]
    fn = _kernel(module, kernel_name)
    consts = dict(consts, PDL=True)
    sig = {a: "constexpr" if a in consts else pointers.get(a, "*bf16") if a.endswith("_ptr") else
           "fp32" if a in floats else "i32" for a in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=_target(), options=dict(num_warps=4)).asm["ptx"]
    head, wait, tail = ptx.partition("griddepcontrol.wait")
    assert wait, f"{kernel_name}: no griddepcontrol.wait in its PDL form"
    assert not _GLOBAL.findall(head), f"{kernel_name} touches global memory before its wait: {_GLOBAL.findall(head)}"
    assert "griddepcontrol.launch_dependents" in tail
