"""``ops.act_quant_scaled_mm``: a W8A8 layer's static input quantization (alone, or after SiLU-and-mul) fused into
its GEMM. What a user relies on: the op gives the unfused ops' values (the quantization op, then the scaled GEMM)
bit for bit, on the GPU where the small-M kernel quantizes in its loop (fp8 down_proj at M <= 16, int8 up to 128),
where it falls back to the unfused ops (cuBLAS shapes, larger M), in a CUDA graph, and on the CPU (the
references); the kernel's prologue in Triton's interpreter against the unfused Triton kernels there; errors name
the argument.
"""

import importlib

import pytest
import torch

import ops
from ops.small_m_gemm import SmallMConfig

FP8, INT8, BF16 = torch.float8_e4m3fn, torch.int8, torch.bfloat16
QDTYPES = [pytest.param(FP8, id="fp8"), pytest.param(INT8, id="int8")]


def _operands(qdtype, m, k, n, act, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k if act == "silu" else k, generator=g).to(BF16)
    if qdtype == INT8:
        w = torch.randint(-128, 128, (n, k), generator=g).to(INT8)
    else:
        w = (8 * torch.randn(n, k, generator=g)).clamp(-448, 448).to(FP8)
    scale = torch.tensor([0.02 if qdtype == INT8 else 0.004])  # some values clamp: the clamp is exercised too
    w_scale = 0.01 + torch.rand(n if qdtype == INT8 else 1, generator=g)
    return [t.to(device) for t in (x, w, scale, w_scale)]


def _unfused(x, w, scale, w_scale, act, config=None):
    """The unfused Triton ops (quantization kernel, then the GEMM the fused op would take). In the interpreter
    (``config`` given) the activation's kernel itself: its bf16 rounding there is the interpreter's, as the fused
    kernel's is, where the op on CPU tensors would run the reference."""
    if act == "silu" and config is not None:
        q = importlib.import_module("ops.act_quant")._launch_act_and_mul_quant(x, scale, "silu", w.dtype, pdl=False)[0]
    elif act == "silu":
        q = ops.act_and_mul_static_quant(x, scale, "silu", w.dtype)
    else:
        q = (ops.static_scaled_int8_quant if w.dtype == INT8 else ops.static_scaled_fp8_quant)(x, scale)
    if config is not None:
        return ops.small_m_scaled_mm(q, w, scale, w_scale, BF16, None, config)
    return (ops.int8_scaled_mm if w.dtype == INT8 else ops.fp8_scaled_mm)(q, w, scale, w_scale, BF16)


@pytest.mark.interpret
@pytest.mark.usefixtures("bf16_dot_in_the_interpreter")
@pytest.mark.parametrize("act", ["none", "silu"])
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("config", [SmallMConfig(16, 32, 64, SPLIT_K=2, num_stages=2),
                                    SmallMConfig(16, 32, 32, num_stages=2), SmallMConfig(1, 16, 64, DOT=False)],
                         ids=["dot-split2", "dot", "gemv"])
def test_prologue_in_the_interpreter(m, qdtype, act, config):
    """K = 208 (no multiple of the loop step: masked K) and N = 48: the quantized rows made in the loop are the
    quantization kernel's, so the products are the unfused GEMM's."""
    x, w, scale, w_scale = _operands(qdtype, m, 208, 48, act)
    out = ops.small_m_act_quant_scaled_mm(x, w, scale, w_scale, BF16, None, act, config)
    assert torch.equal(out, _unfused(x, w, scale, w_scale, act, config))


@pytest.mark.parametrize("act", ["none", "silu"])
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_cpu_runs_the_reference(qdtype, act):
    x, w, scale, w_scale = _operands(qdtype, 5, 64, 32, act)
    out = ops.act_quant_scaled_mm(x, w, scale, w_scale, BF16, None, act)
    assert torch.equal(out, ops.act_quant_scaled_mm_ref(x, w, scale, w_scale, BF16, None, act))
    q = ops.act_and_mul_static_quant_ref(x, scale, "silu", qdtype) if act == "silu" else (
        ops.static_scaled_int8_quant_ref if qdtype == INT8 else ops.static_scaled_fp8_quant_ref)(x, scale)
    mm = ops.int8_scaled_mm_ref if qdtype == INT8 else ops.fp8_scaled_mm_ref
    assert torch.equal(out, mm(q, w, scale, w_scale, BF16))


@pytest.mark.parametrize("change,exc,match", [
    (dict(act="gelu"), ValueError, "act must be one of"),
    (dict(scale=torch.ones(2)), ValueError, "scale must be one fp32 element"),
    (dict(x=torch.zeros(3, 64, dtype=BF16)), ValueError, r"x must be \[M, 128\]"),
    (dict(w=torch.zeros(32, 64, dtype=BF16)), TypeError, "w must be float8_e4m3fn or int8"),
])
def test_errors_name_the_argument(change, exc, match):
    x, w, scale, w_scale = _operands(FP8, 3, 64, 32, "silu")
    args = dict(x=x, w=w, scale=scale, w_scale=w_scale, act="silu") | change
    with pytest.raises(exc, match=match):
        ops.act_quant_scaled_mm(args["x"], args["w"], args["scale"], args["w_scale"], BF16, None, args["act"])


# Llama-3-8B's down_proj (the small-M kernel's fp8 shape) and o_proj (cuBLAS's for fp8, the kernel's for int8)
CUDA_CASES = [(14336, 4096, "silu"), (4096, 4096, "none")]


@pytest.mark.cuda
@pytest.mark.parametrize("k,n,act", CUDA_CASES, ids=["down-silu", "o-none"])
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("m", [1, 7, 16, 200])
def test_cuda_equals_the_unfused_ops(m, qdtype, k, n, act):
    """In the kernel (M <= 16: fp8 down, int8 both) and in the unfused fallback (M = 200, fp8 o_proj)."""
    x, w, scale, w_scale = _operands(qdtype, m, k, n, act, "cuda")
    out = ops.act_quant_scaled_mm(x, w, scale, w_scale, BF16, None, act)
    assert torch.equal(out, _unfused(x, w, scale, w_scale, act))
    ref = ops.act_quant_scaled_mm_ref(x, w, scale, w_scale, torch.float32, None, act)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2**-7)


@pytest.mark.cuda
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_cuda_graph_replay(qdtype):
    x, w, scale, w_scale = _operands(qdtype, 4, 14336, 4096, "silu", "cuda")
    expected = _unfused(x, w, scale, w_scale, "silu")
    ops.act_quant_scaled_mm(x, w, scale, w_scale, BF16, None, "silu")  # compiled and warmed outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.act_quant_scaled_mm(x, w, scale, w_scale, BF16, None, "silu")
    x.copy_(x.flip(0))
    graph.replay()
    assert torch.equal(out, _unfused(x, w, scale, w_scale, "silu")) and not torch.equal(out, expected)
