"""The small-M GEMM's kernel forms and the gated quantization kernel compile for Hopper (sm_90) on any machine.

Triton's interpreter (the ``*_interpreted.py`` tests) runs a kernel as Python: it checks the arithmetic, not what
Triton's compiler accepts (a constexpr condition must be a bool, int or None there; an early ``return`` in a
constexpr branch, and so on). Here each form goes through Triton's compiler down to ptxas for an H200-class
target, without a GPU: the plain GEMM (dot tiles, swapped, split K in the kernel and by the second kernel; the
unrolled GEMV with and without dp4a), its gated forms (per-token amax, and static int8 / fp8 quantization in the
epilogue), the bf16 dot tile read by tensor descriptors (TMA) and ``ops.gated_quant``'s kernel. Skipped where Triton
or its NVIDIA backend is not installed.
"""

import importlib
import re

import pytest
from benchmarks.gemv_instructions import read_cubin

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

gemm_mod = importlib.import_module("ops.small_m_gemm")
gated_quant = importlib.import_module("ops.gated_quant")

_POINTERS = {"a_ptr": "A", "w_ptr": "A", "a_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16",
             "lock_ptr": "*i32", "amax_ptr": "*fp32"}
# (GATED, H, out_ptr): the plain GEMM, the gated form with a per-token amax, and with a static quantization
FORMS = [(False, None, "*bf16"), (True, "bf16", "*bf16"), (True, "bf16", "*i8"), (True, "fp16", "*fp8e4nv")]


def _target():
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401  (the backend and its ptxas)
    except ImportError as e:
        pytest.skip(f"Triton's NVIDIA backend is not installed: {e}")
    return GPUTarget("cuda", 90, 32)


def _compile(fn, types, consts, **options):
    # a constexpr with a default the test leaves out (a form it does not exercise) takes its default; tensor
    # descriptors the test gives no type are None (the pointer-load forms)
    consts = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default and p.name not in types} | {
        name: None for name in ("a_desc", "w_desc") if name in fn.arg_names and name not in types} | consts
    sig = {name: "constexpr" if name in consts else types[name] for name in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    return triton.compile(src, target=_target(), options=dict(enable_fp_fusion=False, **options))


def _types(int8, out_ptr, **more):
    operand = "*i8" if int8 else "*fp8e4nv"
    types = {name: operand if t == "A" else t for name, t in _POINTERS.items()}
    return dict(types, out_ptr=out_ptr, M="i32", N="i32", stride_am="i32", stride_wn="i32", **more)


def _flags(int8, gated, h, even):
    return dict(INTEGER=int8, SCALED=True, A_PER_TOKEN=True, W_PER_CHANNEL=True, HAS_BIAS=False, EVEN=even,
                INT64=False, PDL=True, GATED=gated, H=getattr(tl, {"bf16": "bfloat16", "fp16": "float16"}[h]) if h
                else None)


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "fp8"])
@pytest.mark.parametrize("gated,h,out_ptr", FORMS, ids=["plain", "gated-amax", "gated-int8", "gated-fp8"])
@pytest.mark.parametrize("swap,even", [(False, True), (False, False), (True, True)], ids=["dot", "masked", "swap"])
def test_gemm_kernel_compiles_for_sm90(int8, gated, h, out_ptr, swap, even):
    types = _types(int8, out_ptr, ws_ptr="*i32" if int8 else "*fp32", K="i32", K_SPLIT="i32")
    consts = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, DOT=True, PF_LINES=8, LINE=128, SERIAL=False,
                  SWAP=swap, **_flags(int8, gated, h, even))
    assert _compile(gemm_mod._small_m_gemm_kernel, types, consts, num_warps=4, num_stages=4).asm["cubin"]


@pytest.mark.parametrize("serial", [True, False], ids=["serial", "second-kernel"])
def test_split_k_gemm_compiles_for_sm90(serial):
    types = _types(True, "*bf16", ws_ptr="*i32", K="i32", K_SPLIT="i32")
    consts = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=2, DOT=True, PF_LINES=8, LINE=128, SERIAL=serial,
                  SWAP=False, **_flags(True, False, None, True))
    assert _compile(gemm_mod._small_m_gemm_kernel, types, consts, num_warps=4, num_stages=4).asm["cubin"]


@pytest.mark.parametrize("swap", [False, True], ids=["dot", "swap"])
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_bf16_dot_tile_reads_by_tma_only_in_its_tma_form(tma, swap):
    """The table's descriptor rows (64 x 64 x 128 at 6 stages, unswapped and swapped): their loop's tiles come by
    bulk tensor copies (TMA) into shared memory and go to wgmma; the same tile's pointer form has no TMA copy."""
    types = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", K="i32", K_SPLIT="i32",
                 stride_am="i32", stride_wn="i32")
    if tma:
        types.update(a_desc="tensordesc<bf16[64, 128]>", w_desc="tensordesc<bf16[64, 128]>")
    consts = dict(a_scale_ptr=None, w_scale_ptr=None, bias_ptr=None, ws_ptr=None, lock_ptr=None, amax_ptr=None,
                  BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, DOT=True, PF_LINES=8, LINE=64, SERIAL=False,
                  SWAP=swap, TMA=tma, INTEGER=False, SCALED=False, A_PER_TOKEN=False, W_PER_CHANNEL=False,
                  HAS_BIAS=False, EVEN=True, INT64=False, PDL=True, GATED=False, H=None)
    ttgir = _compile(gemm_mod._small_m_gemm_kernel, types, consts, num_warps=4, num_stages=6).asm["ttgir"]
    assert ("async_tma_copy_global_to_local" in ttgir) == tma
    assert "warp_group_dot" in ttgir


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "fp8"])
@pytest.mark.parametrize("gated,h,out_ptr", FORMS, ids=["plain", "gated-amax", "gated-int8", "gated-fp8"])
def test_gemv_kernel_compiles_for_sm90(int8, gated, h, out_ptr):
    consts = dict(K=4096, BLOCK_N=8, BLOCK_K=256, BYTES=True, DP4A=int8, **_flags(int8, gated, h, True))
    assert _compile(gemm_mod._small_m_gemv_kernel, _types(int8, out_ptr), consts, num_warps=4).asm["cubin"]


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "fp8"])
@pytest.mark.parametrize("even", [True, False], ids=["even", "masked"])
def test_quantizing_gemv_compiles_for_sm90(int8, even):
    """The GEMV's QUANT_A form (``ops.static_quant_scaled_mm`` at one token) on the table's o_proj row: a bf16 row
    quantized as loaded, per-tensor scales; nothing spilled."""
    c = gemm_mod.small_m_config(1, 4096, 4096, gemm_mod.torch.int8 if int8 else gemm_mod.torch.float8_e4m3fn)
    types = dict(_types(int8, "*bf16"), a_ptr="*bf16")
    consts = dict(K=4096, BLOCK_N=c.BLOCK_N, BLOCK_K=c.BLOCK_K, BYTES=True, DP4A=False, QUANT_A=True,
                  **dict(_flags(int8, False, None, even), A_PER_TOKEN=False, W_PER_CHANNEL=False))
    compiled = _compile(gemm_mod._small_m_gemv_kernel, types, consts, num_warps=c.num_warps)
    assert re.search(r"LOCAL:0\b", read_cubin(compiled.asm["cubin"], "-res-usage"))


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "fp8"])
def test_gated_quant_kernel_compiles_for_sm90(int8):
    types = dict(h_ptr="*bf16", amax_ptr="*fp32", q_ptr="*i8" if int8 else "*fp8e4nv", scale_ptr="*fp32", D="i32",
                 BLOCKS="i32")
    consts = dict(MIN_S=1e-5, INT8=int8, BLOCK_D=gated_quant.GATED_QUANT_BLOCK, BLOCK_P=4096, PDL=True)
    assert _compile(gated_quant._gated_quant_kernel, types, consts, num_warps=4).asm["cubin"]


def _bf16_gated(**more):
    """The bf16 gated form ``small_m_gated_mm`` launches: no scales, no bias, no amax (None: constexprs)."""
    types = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", stride_am="i32", stride_wn="i32",
                 **more)
    consts = dict(a_scale_ptr=None, w_scale_ptr=None, bias_ptr=None, amax_ptr=None, INTEGER=False, SCALED=False,
                  A_PER_TOKEN=False, W_PER_CHANNEL=False, HAS_BIAS=False, EVEN=True, INT64=False, PDL=True, GATED=True,
                  H=tl.bfloat16)
    return types, consts


def test_bf16_gated_gemv_compiles_for_sm90():
    """``GATED_ROWS``' bf16 row as ``ops.gated_linear`` launches it: one gate row and one up row a program."""
    types, consts = _bf16_gated()
    c = gemm_mod.gated_config(gemm_mod.gated_row(1, gemm_mod.torch.bfloat16), gemm_mod.torch.bfloat16)
    consts.update(K=4096, BLOCK_N=c.BLOCK_N // 2, BLOCK_K=c.BLOCK_K, BYTES=False, DP4A=False)
    usage = read_cubin(_compile(gemm_mod._small_m_gemv_kernel, types, consts, num_warps=c.num_warps).asm["cubin"],
                       "-res-usage")
    assert re.search(r"LOCAL:0\b", usage), usage  # the two accumulators in registers: nothing spilled


def test_bf16_gated_dot_tile_compiles_for_sm90():
    types, consts = _bf16_gated(ws_ptr="*fp32", lock_ptr="*i32", K="i32", K_SPLIT="i32")
    consts.update(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, DOT=True, PF_LINES=8, LINE=128, SERIAL=False,
                  SWAP=False)
    assert _compile(gemm_mod._small_m_gemm_kernel, types, consts, num_warps=4, num_stages=4).asm["cubin"]


_ROPE_TYPES = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", pos_ptr="*i64", cs_ptr="*bf16", M="i32", N="i32",
                   K="i32", rot_cols="i32", stride_am="i32", stride_wn="i32", stride_cs="i32")


def test_rope_gemv_compiles_for_sm90():
    """``ops.rope_linear``'s fused GEMV as it launches at the bf16 QKV GEMV row: one column pair a program, the
    rotation in the epilogue; nothing spilled."""
    rope = importlib.import_module("ops.rope_linear")
    consts = dict(K=4096, BLOCK_N=1, BLOCK_K=1024, HALF=64, EVEN=True, INT64=False, PDL=True)
    usage = read_cubin(_compile(rope._rope_gemv_kernel, _ROPE_TYPES, consts, num_warps=4).asm["cubin"], "-res-usage")
    assert re.search(r"LOCAL:0\b", usage), usage


def test_rope_dot_tile_compiles_for_sm90():
    """Its dot-tile form (2-16 tokens): 16 rows, 32 column pairs, two accumulators."""
    rope = importlib.import_module("ops.rope_linear")
    consts = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, HALF=64, EVEN=True, SWAP=False, INT64=False, PDL=True)
    assert _compile(rope._rope_gemm_kernel, _ROPE_TYPES, consts, num_warps=4, num_stages=4).asm["cubin"]



def test_dot_tile_pdl_form_prefetches_its_weights_before_the_wait_and_loads_nothing():
    """``SmallMConfig.PREFETCH`` with PDL: the dot tile issues its L2 prefetches of the weights (which do not depend
    on the kernel before) ahead of ``griddepcontrol.wait``, and no global load there (a, the scales and the weights
    are read after it); without ``PF_LINES`` no prefetch at all. The unrolled GEMV prefetches nothing."""
    types = dict(_types(False, "*bf16"), ws_ptr="*fp32", K="i32", K_SPLIT="i32")
    consts = dict(_flags(False, False, None, True), BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1, DOT=True,
                  SERIAL=False, SWAP=False, LINE=128)
    ptx = _compile(gemm_mod._small_m_gemm_kernel, types, dict(consts, PF_LINES=4), num_warps=4, num_stages=4).asm["ptx"]
    head = ptx.split("griddepcontrol.wait")[0]
    assert len(head) < len(ptx) and head.count("prefetch.global.L2") > 0
    assert "ld.global" not in head and "cp.async" not in head
    none = _compile(gemm_mod._small_m_gemm_kernel, types, dict(consts, PF_LINES=0), num_warps=4, num_stages=4)
    assert "prefetch.global.L2" not in none.asm["ptx"]
    gemv = dict(_flags(False, False, None, True), K=4096, BLOCK_N=8, BLOCK_K=512, BYTES=True, DP4A=False)
    assert "prefetch.global.L2" not in _compile(gemm_mod._small_m_gemv_kernel, _types(False, "*bf16"), gemv,
                                                num_warps=4).asm["ptx"]


@pytest.mark.parametrize("rows", [1, 2], ids=["one-row", "two-rows"])
@pytest.mark.parametrize("preload", [0, 2, 8], ids=["none", "two-steps", "all"])
def test_gemv_preload_loads_its_weights_before_the_wait(preload, rows):
    """``SmallMConfig.PRELOAD``: the unrolled GEMV issues its first ``PRELOAD`` loop steps' weight loads (of 4,
    K = 2048 in steps of 512) ahead of ``griddepcontrol.wait``, the rest and ``a`` after it; 0: no load ahead."""
    int8 = False
    consts = dict(_flags(int8, False, None, True), K=2048, BLOCK_N=8, BLOCK_K=512, BYTES=True, DP4A=False,
                  PRELOAD=min(preload, 4))
    if rows > 1:
        kernel = gemm_mod._small_m_gemv_rows_kernel
        # fp8 over several rows: a broadcast, not read in w's layout (BYTES is int8's there, as the launcher has it)
        consts = {k: v for k, v in consts.items() if k not in ("GATED", "H")} | dict(ROWS=rows, BYTES=False)
        types = {k: v for k, v in _types(int8, "*bf16").items() if k != "amax_ptr"}
    else:
        kernel, types = gemm_mod._small_m_gemv_kernel, _types(int8, "*bf16")
    ptx = _compile(kernel, types, consts, num_warps=4).asm["ptx"]
    head, _, tail = ptx.partition("griddepcontrol.wait")
    # each thread loads its 8 x 512 / 128 = 32 weight bytes a step as wide loads: the same count each step
    ahead, after = head.count("ld.global"), tail.count("ld.global")
    if preload == 0:
        assert ahead == 0 and after > 0
    else:
        steps = min(preload, 4)
        assert ahead > 0 and after > 0
        # the weight loads ahead are `steps` of the 4 steps' (a's loads and the scales' are all after)
        per_step = ahead // steps
        assert ahead == steps * per_step and after >= (4 - steps) * per_step + 1


_NORM_TYPES = dict(x_ptr="*bf16", r_ptr="*bf16", g_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", h_ptr="*bf16", M="i32",
                   N="i32", stride_xm="i32", stride_rm="i32", stride_wn="i32", eps="fp32")


@pytest.mark.parametrize("k", [2048, 4096], ids=["1b", "8b"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_norm_gemv_compiles_for_sm90_and_preloads_its_weights(gated, k):
    """``ops.norm_linear``'s fused GEMV as it launches at the bf16 GEMV row (NORM_MIN_ROWS weight rows a program,
    1024-column steps; the 8B's K: two steps loaded ahead): nothing spilled; the preloaded weights read ahead of
    ``griddepcontrol.wait``, the activation row and the residual after it."""
    norm = importlib.import_module("ops.norm_linear")
    from ops.small_m_gemm import SmallMConfig, preload_steps

    config = SmallMConfig(1, norm.NORM_MIN_ROWS, 1024, DOT=False, UNROLL=True, PRELOAD=2)
    preload = preload_steps(config, k)
    consts = dict(K=k, BLOCK_N=config.BLOCK_N // 2 if gated else config.BLOCK_N, BLOCK_K=1024, EVEN=True,
                  INT64=False, PDL=True, GATED=gated, H=tl.bfloat16, PRELOAD=preload)
    compiled = _compile(norm._norm_gemv_kernel, _NORM_TYPES, consts, num_warps=4)
    assert re.search(r"LOCAL:0\b", read_cubin(compiled.asm["cubin"], "-res-usage"))
    head, _, tail = compiled.asm["ptx"].partition("griddepcontrol.wait")
    assert tail and (head.count("ld.global") > 0) == (preload > 0) and tail.count("ld.global") > 0
