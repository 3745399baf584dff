"""``ops.static_quant_scaled_mm``: a static activation quantization and the W8A8 GEMM after it, in one op (one
kernel at one token on CUDA: the small-M GEMV quantizing as it loads, ``small_m_quant_scaled_mm``).

The op's values are the two ops' (``static_quant_scaled_mm_ref``). The kernel runs in Triton's interpreter against
the GEMV on the quantized tensor (the ``interpret`` tests: fp8 quantized by the interpreter's own conversion, which is
not the GPU's, as tests/ops/test_kernels_interpreted.py does), and on the GPU bit for bit against the quantization op
then the GEMM op (``-m cuda``).
"""

import pytest
import torch

import ops
from ops.small_m_gemm import SmallMConfig, small_m_quant_scaled_mm, small_m_scaled_mm

FP8, INT8 = torch.float8_e4m3fn, torch.int8
QUANT = {FP8: ops.static_scaled_fp8_quant, INT8: ops.static_scaled_int8_quant}
QUANT_REF = {FP8: ops.static_scaled_fp8_quant_ref, INT8: ops.static_scaled_int8_quant_ref}
GEMM = {FP8: ops.fp8_scaled_mm, INT8: ops.int8_scaled_mm}


def operands(m, k, n, wdtype, xdtype=torch.bfloat16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(xdtype)
    if wdtype == INT8:
        w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    else:
        w = (torch.randn(n, k, generator=g) * 8).clamp(-448, 448).to(FP8)
    scale = torch.tensor([0.03])
    w_scale = torch.rand(n, generator=g) + 0.5
    return [t.to(device) for t in (x, w, scale, w_scale)]


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("wdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_op_is_the_quantization_then_the_gemm(m, wdtype, out_dtype):
    x, w, scale, w_scale = operands(m, 64, 48, wdtype)
    bias = torch.randn(48).to(out_dtype)
    got = ops.static_quant_scaled_mm(x, w, scale, w_scale, out_dtype, bias)
    want = GEMM[wdtype](QUANT_REF[wdtype](x, scale), w, scale, w_scale, out_dtype, bias)
    assert got.dtype == out_dtype and torch.equal(got, want)
    assert torch.equal(ops.static_quant_scaled_mm_ref(x, w, scale, w_scale, out_dtype, bias), want)


@pytest.mark.parametrize("change, says", [
    (dict(x=torch.zeros(1, 64, dtype=torch.float64)), "x must be one of"),
    (dict(w=torch.zeros(48, 64)), "w must be torch.float8_e4m3fn or torch.int8"),
    (dict(x=torch.zeros(1, 32, dtype=torch.bfloat16)), "x must be [M, K] and w [N, K] with the same K"),
    (dict(scale=torch.ones(2)), "scale must be fp32 with one element"),
    (dict(w_scale=torch.ones(3)), "w_scale must be fp32 [1] or [N] = [48]"),
    (dict(bias=torch.ones(48)), "bias must be [N] = [48] in out_dtype"),
    (dict(w=torch.zeros(40, 72).to(FP8), x=torch.zeros(1, 72, dtype=torch.bfloat16),
          w_scale=torch.ones(40)), "must be a multiple of 16"),
])
def test_bad_arguments_are_named(change, says):
    x, w, scale, w_scale = operands(1, 64, 48, FP8)
    args = dict(x=x, w=w, scale=scale, w_scale=w_scale, out_dtype=torch.bfloat16, bias=None) | change
    with pytest.raises((TypeError, ValueError)) as e:
        ops.static_quant_scaled_mm(**args)
    assert says in str(e.value)


def _interpreter_quant(x, scale, wdtype):
    """The quantization as the interpreter's kernels compute it: int8 the reference's; fp8 the quotient converted by
    the interpreter's own fp8 conversion."""
    if wdtype == INT8:
        return ops.static_scaled_int8_quant_ref(x, scale)
    from test_kernels_interpreted import _interpreter_fp8

    return _interpreter_fp8((x.float() / scale.float()).clamp(-448.0, 448.0))


@pytest.mark.interpret
@pytest.mark.parametrize("wdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("k, config", [(256, SmallMConfig(1, 8, 64, DOT=False, num_warps=4, num_stages=1, UNROLL=True)),
                                        (208, SmallMConfig(1, 4, 64, DOT=False, num_warps=4, num_stages=1, UNROLL=True))],
                         ids=["even", "masked"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gemv_quantizes_as_it_loads(wdtype, xdtype, k, config, bias):
    """The GEMV's quantizing form equals the same GEMV on the tensor the quantization op writes, bit for bit (the
    epilogue's per-channel weight scale and bias included)."""
    x, w, scale, w_scale = operands(1, k, 48, wdtype, xdtype)
    b = torch.randn(48) if bias else None
    got = small_m_quant_scaled_mm(x, w, scale, w_scale, torch.float32, b, config)
    want = small_m_scaled_mm(_interpreter_quant(x, scale, wdtype), w, scale, w_scale, torch.float32, b, config)
    assert torch.equal(got, want)


def test_gemv_form_refuses_a_tile_config():
    x, w, scale, w_scale = operands(1, 64, 48, FP8)
    with pytest.raises(ValueError, match="unrolled GEMV"):
        small_m_quant_scaled_mm(x, w, scale, w_scale, torch.bfloat16, None, SmallMConfig(16, 32, 64))
    with pytest.raises(ValueError, match=r"a row a program \(UNROLL, BLOCK_M=1\); got SmallMConfig\(BLOCK_M=2"):
        small_m_quant_scaled_mm(x, w, scale, w_scale, torch.bfloat16, None,
                                SmallMConfig(2, 8, 64, DOT=False, num_stages=1, UNROLL=True))


@pytest.mark.cuda
@pytest.mark.parametrize("wdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("m, k, n", [(1, 4096, 4096), (1, 2048, 2048), (1, 14336, 4096), (5, 4096, 4096)])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_cuda_op_equals_the_quantization_then_the_gemm(wdtype, m, k, n, graph):
    """On the GPU: at one token one kernel, at more the two ops; bit for bit the quantization op's tensor through
    the GEMM op (the same small-M config), eager and in a CUDA graph."""
    if wdtype == FP8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability >= 8.9")
    x, w, scale, w_scale = operands(m, k, n, wdtype, device="cuda")
    want = GEMM[wdtype](QUANT[wdtype](x, scale), w, scale, w_scale, torch.bfloat16)
    if graph:
        ops.static_quant_scaled_mm(x, w, scale, w_scale, torch.bfloat16)  # compile outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = ops.static_quant_scaled_mm(x, w, scale, w_scale, torch.bfloat16)
        g.replay()
    else:
        got = ops.static_quant_scaled_mm(x, w, scale, w_scale, torch.bfloat16)
    torch.cuda.synchronize()
    assert torch.equal(got, want)
