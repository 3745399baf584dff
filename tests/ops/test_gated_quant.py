"""``ops.gated_scaled_mm_dynamic_quant``: the gate-up GEMM, SiLU-and-mul and per-token quantization in one op.

On the GPU, Llama-3-8B's gate-up shape (K = 4096, 2D = 28672) at decode sizes: the op's values are the unfused
ops' (``int8_scaled_mm`` / ``fp8_scaled_mm``, then ``act_and_mul_dynamic_quant``) bit for bit where the GEMM is
(int8 at every M; fp8 where the op and the GEMM op take the same kernel), eagerly and replayed from a CUDA graph;
at an M past the small-M table both run the unfused ops. On any machine: the reference path and the argument
errors. The kernels themselves, without a GPU: test_gated_quant_interpreted.py.
"""

import pytest
import torch

import ops
from ops import small_m_gemm

FP8, INT8, BF16 = ops.FP8_DTYPE, torch.int8, torch.bfloat16


def _operands(dtype, m, k, d, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    if dtype == INT8:
        a = torch.randint(-128, 128, (m, k), generator=g, device=device).to(INT8)
        w = torch.randint(-128, 128, (2 * d, k), generator=g, device=device).to(INT8)
    else:
        a = (8 * torch.randn(m, k, generator=g, device=device)).clamp(-448, 448).to(FP8)
        w = (torch.randn(2 * d, k, generator=g, device=device)).to(FP8)
    a_scale = 1e-3 * (0.5 + torch.rand(m, 1, generator=g, device=device))
    w_scale = 1e-3 * (0.5 + torch.rand(2 * d, generator=g, device=device))
    return a, w, a_scale, w_scale


def _unfused(a, w, a_scale, w_scale, out_dtype, quant_dtype):
    gemm = ops.int8_scaled_mm if a.dtype == INT8 else ops.fp8_scaled_mm
    return ops.act_and_mul_dynamic_quant(gemm(a, w, a_scale, w_scale, out_dtype), "silu", quant_dtype)


def _assert_same(actual, expected):
    (q, s), (q_ref, s_ref) = actual, expected
    assert q.dtype == q_ref.dtype and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 5, 16, 32, 64, 100, 128, 300])
@pytest.mark.parametrize("quant_dtype", [INT8, FP8], ids=["q-int8", "q-fp8"])
def test_cuda_int8_gate_up_is_the_unfused_ops(m, quant_dtype):
    """int8 operands, the table's GEMV, 16-, 32- and 128-row tiles, and cuBLAS past them (M = 300)."""
    a, w, a_scale, w_scale = _operands(INT8, m, 4096, 14336, "cuda")
    _assert_same(ops.gated_scaled_mm_dynamic_quant(a, w, a_scale, w_scale, BF16, "silu", quant_dtype),
                 _unfused(a, w, a_scale, w_scale, BF16, quant_dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 8, 64, 128])
def test_cuda_fp8_gate_up_is_the_unfused_ops(m):
    """fp8: the gated form where ``GATED_ROWS`` runs it (its fp32 sums in another order than the plain GEMM's), the
    unfused ops elsewhere (the same values)."""
    a, w, a_scale, w_scale = _operands(FP8, m, 4096, 14336, "cuda")
    out = ops.gated_scaled_mm_dynamic_quant(a, w, a_scale, w_scale, BF16, "silu", FP8)
    expected = _unfused(a, w, a_scale, w_scale, BF16, FP8)
    if small_m_gemm.gated_row(m, FP8) is None:
        _assert_same(out, expected)
    else:
        _assert_close_codes(out[0], expected[0])
        torch.testing.assert_close(out[1], expected[1], rtol=2**-7, atol=0)  # the amax of bf16 values an ulp apart


def _assert_close_codes(q, expected):
    """fp8 codes from sums in two orders: equal but where the activations round an ulp apart (a step apart)."""
    assert q.dtype == expected.dtype and q.shape == expected.shape
    differ = (q.float() != expected.float()).float().mean().item()
    # Which codes differ depends on the two accumulations (the 64-row tile takes Hopper's fp8 MMA, cuBLAS its own):
    # 1.3% at M = 64 on the H200; each at most a step apart (below) is what the result promises.
    assert differ < 0.03, f"{differ:.2%} of the codes differ"
    step = 1.0 if q.dtype == INT8 else expected.float().abs() * 2**-3 + 2**-9  # one int8 step; e4m3: 3 mantissa bits
    assert ((q.float() - expected.float()).abs() <= step).all()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 8, 32, 64, 128, 300])
def test_cuda_static_gate_up_is_the_unfused_ops(dtype, m):
    """A per-tensor scale, quantized in the GEMM's epilogue where the gated form runs (GATED_ROWS), the unfused
    ops elsewhere; both quant dtypes of the output."""
    a, w, a_scale, w_scale = _operands(dtype, m, 4096, 14336, "cuda")
    gemm = ops.int8_scaled_mm if dtype == INT8 else ops.fp8_scaled_mm
    for quant_dtype, scale in ((INT8, 0.02), (FP8, 0.004)):
        s = torch.tensor([scale], device="cuda")
        q = ops.gated_scaled_mm_static_quant(a, w, a_scale, w_scale, BF16, "silu", s, quant_dtype)
        expected = ops.act_and_mul_static_quant(gemm(a, w, a_scale, w_scale, BF16), s, "silu", quant_dtype)
        assert q.dtype == quant_dtype and q.shape == expected.shape
        if dtype == INT8 or small_m_gemm.gated_row(m, dtype) is None:
            assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
        else:  # fp8 sums in the gated kernel's order and the plain GEMM's (GEMV or cuBLAS) in their own
            _assert_close_codes(q, expected)


@pytest.mark.cuda
def test_cuda_gate_up_replays_from_a_cuda_graph():
    """Captured once, replayed on new inputs written in place: the eager op's values."""
    a, w, a_scale, w_scale = _operands(INT8, 32, 4096, 14336, "cuda")
    ops.gated_scaled_mm_dynamic_quant(a, w, a_scale, w_scale, BF16, "silu", INT8)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.gated_scaled_mm_dynamic_quant(a, w, a_scale, w_scale, BF16, "silu", INT8)
    a2, _, a_scale2, _ = _operands(INT8, 32, 4096, 14336, "cuda", seed=1)
    a.copy_(a2)
    a_scale.copy_(a_scale2)
    graph.replay()
    _assert_same(out, _unfused(a, w, a_scale, w_scale, BF16, INT8))


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_cpu_is_the_reference(act):
    a, w, a_scale, w_scale = _operands(INT8, 3, 64, 32, "cpu")
    out = ops.int8_scaled_mm_ref(a, w, a_scale, w_scale, torch.float16)
    _assert_same(ops.gated_scaled_mm_dynamic_quant(a, w, a_scale, w_scale, torch.float16, act, INT8),
                 ops.act_and_mul_dynamic_quant_ref(out, act, INT8))
    s = torch.tensor([0.01])
    assert torch.equal(ops.gated_scaled_mm_static_quant(a, w, a_scale, w_scale, torch.float16, act, s, INT8),
                       ops.act_and_mul_static_quant_ref(out, s, act, INT8))


def test_errors_name_the_argument():
    a, w, a_scale, w_scale = _operands(INT8, 3, 64, 32, "cpu")
    op = ops.gated_scaled_mm_dynamic_quant
    with pytest.raises(TypeError, match="a must be torch.float8_e4m3fn or torch.int8; got torch.bfloat16"):
        op(a.to(BF16), w, a_scale, w_scale, BF16, "silu", INT8)
    with pytest.raises(ValueError, match=r"w must be \[gate; up\], \[2D, K\] with D a multiple of 8; got shape "
                                         r"\[56, 64\]"):
        op(a, w[:56], a_scale, w_scale[:56], BF16, "silu", INT8)
    with pytest.raises(ValueError, match="act must be one of .*; got 'relu'"):
        op(a, w, a_scale, w_scale, BF16, "relu", INT8)
    with pytest.raises(ValueError, match="quant_dtype must be torch.float8_e4m3fn or torch.int8; got torch.bfloat16"):
        op(a, w, a_scale, w_scale, BF16, "silu", BF16)
    with pytest.raises(ValueError, match=r"a_scale must be \[1\] \(per tensor\) or \[M, 1\]"):
        op(a, w, a_scale[:2], w_scale, BF16, "silu", INT8)
    with pytest.raises(ValueError, match=r"scale must be fp32 with one element \(\[1\] or 0-d\); got torch.float32 of "
                                         r"shape \[2\]"):
        ops.gated_scaled_mm_static_quant(a, w, a_scale, w_scale, BF16, "silu", torch.ones(2), INT8)
    with pytest.raises(ValueError, match="^gated_scaled_mm_static_quant: act must be one of"):
        ops.gated_scaled_mm_static_quant(a, w, a_scale, w_scale, BF16, "relu", torch.ones(1), INT8)


@pytest.mark.parametrize("rule", [r for r in small_m_gemm.SMALL_M_TABLE if r.config is not None and r.config.UNROLL
                                  and r.config.BLOCK_M == 1 and set(r.dtypes) & {INT8, FP8}], ids=str)
def test_gated_gemv_keeps_int8s_row_bytes_and_fp8s_registers(rule):
    """The unrolled GEMV's gated form splits a program's rows into a gate and an up tile. int8: on half the warps a
    thread still loads as many adjacent bytes of a row as in the plain form (dp4a takes 16 of them); fp8: on all of
    them, a thread holds as many elements as in the plain form."""
    for dtype in set(rule.dtypes) & {INT8, FP8}:
        c = small_m_gemm.gated_config(rule.config, dtype)
        assert c.BLOCK_N == rule.config.BLOCK_N and c.SPLIT_K == 1
        per_thread = rule.config.BLOCK_N * rule.config.BLOCK_K // (32 * rule.config.num_warps)
        if dtype == INT8:
            assert (c.BLOCK_N // 2) * c.BLOCK_K // (32 * c.num_warps) == per_thread
        else:
            assert c.BLOCK_N * c.BLOCK_K // (32 * c.num_warps) == per_thread
