"""The paged decode kernel over an fp8 cache compiles for Hopper (sm_90) on any machine, with and without
``DecodeConfig.convert_v``; converted as loaded, its loop no longer gathers the value tile a byte at a time. Its PDL
form (``DecodeConfig.pdl``) waits for the kernel before it ahead of any global load.

``convert_v`` uses inline assembly, which Triton's interpreter does not run (the plan turns it off on CPU tensors),
so its code is checked here: compiled down to ptxas and read back with cuobjdump (Triton's package carries both).
"""

import os

import pytest

triton = pytest.importorskip("triton")

from ops import paged_attention  # noqa: E402

_POINTERS = dict(q_ptr="*bf16", cache_ptr="*fp8e4nv", block_table_ptr="*i32", seq_lens_ptr="*i32", mid_o_ptr="*bf16",
                 mid_lse_ptr="*fp32", out_ptr="*bf16", counter_ptr="*i32", k_new_ptr="*bf16", v_new_ptr="*bf16",
                 slot_ptr="*i64")
_FLOATS = ("scale", "soft_cap", "k_inv", "v_inv", "v_scale")


def _compile(convert_v: bool, fused_write: bool, pdl: bool = False, pointers: dict[str, str] = _POINTERS,
             preload: bool = False, num_stages: int = 3):
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401  (the backend and its ptxas)
    except ImportError as e:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {e}")
    kernel = paged_attention._decode_split_kernel
    consts = dict(GROUP=4, BLOCK_G=16, HEAD_D=128, BLOCK_D=128, PAGE=16, BLOCK_N=64, SPLIT=False, EVEN_D=True,
                  USE_SOFTCAP=False, USE_WINDOW=False, IEEE=False, FUSED_WRITE=fused_write, FUSED_MERGE=False,
                  MERGE_G=4, MERGE_S=1, CONVERT_V=convert_v, PDL=pdl, PRELOAD=preload)
    sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n in _FLOATS else "i32")
           for n in kernel.arg_names}
    # what a launch on Llama-3-8B's cache specializes as 16-divisible: the pointers and the cache's strides
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
             if n.endswith("_ptr") or n.startswith("stride_c")}
    src = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=2, num_stages=num_stages))


def _loop(convert_v: bool, fused_write: bool):
    from benchmarks.attention_instructions import loop_counts
    from benchmarks.gemv_instructions import read_cubin, cuobjdump

    if not os.path.exists(cuobjdump()):
        pytest.skip("Triton's package has no cuobjdump")
    return loop_counts(read_cubin(_compile(convert_v, fused_write).asm["cubin"], "-sass"))


@pytest.mark.parametrize("fused_write", [False, True], ids=["decode", "fused-write"])
def test_fp8_value_tiles_converted_as_loaded_are_not_gathered_by_byte(fused_write):
    plain, converted = _loop(False, fused_write), _loop(True, fused_write)
    mma = [sum(v for k, v in c.items() if k.startswith("HMMA")) for c in (plain, converted)]
    assert mma[0] == mma[1] > 0  # the same dots
    assert plain["LDS.U8"] > 0 and converted["LDS.U8"] == 0
    assert sum(converted.values()) < 0.75 * sum(plain.values())


@pytest.mark.parametrize("fused_write", [False, True], ids=["decode", "fused-write"])
def test_pdl_form_waits_before_its_first_global_load(fused_write):
    """``DecodeConfig.pdl``: launched early, the kernel must read nothing the kernel before it may still write (q,
    the new keys and values, the cache): the wait comes before every global load, the trigger after it; without
    PDL neither is there."""
    bf16 = dict(_POINTERS, cache_ptr="*bf16")
    ptx = _compile(False, fused_write, pdl=True, pointers=bf16).asm["ptx"]
    wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    first_load = min(i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0)
    assert 0 <= wait < trigger < first_load
    assert "griddepcontrol" not in _compile(False, fused_write, pointers=bf16).asm["ptx"]


def test_preload_form_reads_the_cache_before_the_wait_and_q_after_it():
    """``DecodeConfig.preload`` (with the fused write): the sequence length, its block-table entries and the first
    chunk of K and V are loaded ahead of ``griddepcontrol.wait``; q and the new key and value (which the kernel
    before writes) after it, the trigger after the wait."""
    bf16 = dict(_POINTERS, cache_ptr="*bf16")
    ptx = _compile(False, True, pdl=True, pointers=bf16, preload=True).asm["ptx"]
    head, _, tail = ptx.partition("griddepcontrol.wait")
    assert tail and "griddepcontrol.launch_dependents" in tail and "launch_dependents" not in head
    # ahead: the length, the table entries of the chunk's 64 tokens and its K and V rows (16-byte vectors)
    assert head.count("ld.global.v4") >= 2 and head.count("ld.global") > head.count("ld.global.v4")
    # after: q, the new key and value, and the loop's chunks
    assert tail.count("ld.global") > 0


@pytest.mark.parametrize("num_stages,buffers", [(3, 1), (6, 2)])
def test_key_and_value_tiles_are_double_buffered_from_five_stages(num_stages, buffers):
    """``DecodeConfig.num_stages``: the loop's K and V tiles get one shared-memory buffer each at 3 stages (the
    block-table load their addresses come from takes the pipeline's first stages), two at 6, and the loop then waits
    for the chunk it uses with the next one's copies still in flight (``async_wait`` of more than 0 groups)."""
    import re

    ttgir = _compile(False, True, pointers=dict(_POINTERS, cache_ptr="*bf16"), num_stages=num_stages).asm["ttgir"]
    tiles = set(re.findall(r"memdesc<(\d+)x64x128xbf16", ttgir))  # [buffers, BLOCK_N, head size]
    assert tiles == {str(buffers)}
    loop = ttgir[ttgir.index("scf.for"):]
    waits = [int(n) for n in re.findall(r"ttg\.async_wait [^{]*\{num = (\d+)", loop.split("scf.yield")[0])]
    assert waits and (min(waits) > 0) == (buffers > 1)
