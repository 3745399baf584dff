"""The producer + quant + GEMM ops (``ops.prologue_gemm``): on the GPU, the fused kernel against the unfused ops it
replaces at Llama-3-8B's shapes (int8 bit for bit on inputs whose sums of squares are exact, fp8 within the fp32
accumulation's bound; the new residual bit for bit), from a CUDA graph, past ``PROLOGUE_MAX_M`` and with the
small-M switch off (the unfused ops, exactly); on any machine, the definition on CPU and the argument errors. The
kernel's indexing is also checked in Triton's interpreter (test_prologue_gemm_interpreted.py).
"""

import pytest
import torch
from test_fused_quant import EPS, dyadic, randn

import ops

FP8, INT8, BF16 = ops.FP8_DTYPE, torch.int8, torch.bfloat16
SCALE = 8.0 / 448.0
# (K, N): qkv, o, gate_up (a norm's or the attention output's row of 4096), down (SiLU-and-mul's 14336).
NORM_SHAPES = [(4096, 6144), (4096, 28672)]
DECODE_M = [1, 5, 16]


def _weight(qdtype, n, k, device):
    w = randn((n, k), torch.float32, device, seed=n + k) / k**0.5
    if qdtype == FP8:
        q, s = ops.dynamic_scaled_fp8_quant_ref(w)
        return q, s.reshape(1)
    q, s = ops.dynamic_scaled_int8_quant_ref(w)
    return q, s.reshape(-1)


def _unfused(kind, x, r, gamma, a_scale, w, w_scale, bias=None):
    """The ops the fused one replaces, as a level-3 graph with the quant passes runs them."""
    mm = ops.fp8_scaled_mm if w.dtype == FP8 else ops.int8_scaled_mm
    if kind == "act":
        return mm(ops.act_and_mul_static_quant(x, a_scale, "silu", w.dtype), w, a_scale, w_scale, BF16, bias), None
    if kind == "add-norm":
        if a_scale is None:
            q, s_, res = ops.fused_add_rms_norm_dynamic_quant(x, r, gamma, EPS, w.dtype)
            return mm(q, w, s_, w_scale, BF16, bias), res
        q, res = ops.fused_add_rms_norm_static_quant(x, r, gamma, EPS, a_scale, w.dtype)
        return mm(q, w, a_scale, w_scale, BF16, bias), res
    if a_scale is None:
        q, s_ = ops.rms_norm_dynamic_quant(x, gamma, EPS, w.dtype)
        return mm(q, w, s_, w_scale, BF16, bias), None
    return mm(ops.rms_norm_static_quant(x, gamma, EPS, a_scale, w.dtype), w, a_scale, w_scale, BF16, bias), None


def _fused(kind, x, r, gamma, a_scale, w, w_scale, bias=None):
    """The fused kernel at any M (its launcher; the ops take it up to ``PROLOGUE_MAX_M``)."""
    if kind == "act":
        return ops.prologue_scaled_mm(x, w, a_scale, w_scale, BF16, bias, act="silu")
    return ops.prologue_scaled_mm(x, w, a_scale, w_scale, BF16, bias, norm_weight=gamma, eps=EPS,
                                  residual=r if kind == "add-norm" else None)


def _inputs(kind, m, k, device):
    width = 2 * k if kind == "act" else k
    x = dyadic((m, width), BF16, device, k=8, seed=m)
    r = dyadic((m, width), BF16, device, k=8, seed=m + 1)
    gamma = dyadic((k,), BF16, device, k=8, seed=2)
    return x, r, gamma


def _assert_matches(out, ref, qdtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if qdtype == INT8:
        assert torch.equal(out, ref)
    else:  # fp32 sums of up to 4096 exact products in two orders, one bf16 rounding each
        assert (out.float() - ref.float()).abs().max() <= 2.0**-6 * ref.float().abs().max()


@pytest.mark.cuda
@pytest.mark.parametrize("qdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("kind", ["norm", "add-norm"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "per-token"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=["qkv", "gate_up"])
@pytest.mark.parametrize("m", DECODE_M)
def test_the_norm_prologue_is_the_unfused_ops_on_the_gpu(qdtype, kind, dynamic, shape, m):
    k, n = shape
    x, r, gamma = _inputs(kind, m, k, "cuda")
    w, w_scale = _weight(qdtype, n, k, "cuda")
    a_scale = None if dynamic else torch.tensor([SCALE], device="cuda")
    out, res = _fused(kind, x, r, gamma, a_scale, w, w_scale)
    ref, ref_res = _unfused(kind, x, r, gamma, a_scale, w, w_scale)
    _assert_matches(out, ref, qdtype)
    if m <= ops.PROLOGUE_MAX_M:  # the op runs the kernel
        via_op = (ops.fused_add_rms_norm_quant_mm(x, r, gamma, EPS, a_scale, w, w_scale, BF16) if kind == "add-norm"
                  else (ops.rms_norm_quant_mm(x, gamma, EPS, a_scale, w, w_scale, BF16), None))
        assert torch.equal(via_op[0], out) and (res is None or torch.equal(via_op[1], res))
    assert (res is None) == (ref_res is None) and (res is None or torch.equal(res, ref_res))
    assert torch.equal(x, _inputs(kind, m, k, "cuda")[0])  # inputs untouched


@pytest.mark.cuda
@pytest.mark.parametrize("qdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("m", DECODE_M)
def test_act_and_mul_quant_mm_and_quant_mm_on_the_gpu(qdtype, m):
    x, _, _ = _inputs("act", m, 14336, "cuda")
    w, w_scale = _weight(qdtype, 4096, 14336, "cuda")
    a_scale = torch.tensor([SCALE], device="cuda")
    bias = randn((4096,), BF16, "cuda", seed=3)
    _assert_matches(_fused("act", x, None, None, a_scale, w, w_scale, bias)[0],
                    _unfused("act", x, None, None, a_scale, w, w_scale, bias)[0], qdtype)
    _assert_matches(ops.act_and_mul_quant_mm(x, "silu", a_scale, w, w_scale, BF16, bias),
                    _unfused("act", x, None, None, a_scale, w, w_scale, bias)[0], qdtype)
    wo, wo_scale = _weight(qdtype, 4096, 4096, "cuda")
    attn_out = x[:, :4096].contiguous()
    for s in (a_scale, None):
        q, qs = _quant(attn_out, s, qdtype)
        mm = ops.fp8_scaled_mm if qdtype == FP8 else ops.int8_scaled_mm
        _assert_matches(ops.quant_mm(attn_out, s, wo, wo_scale, BF16), mm(q, wo, qs, wo_scale, BF16), qdtype)
        _assert_matches(ops.prologue_scaled_mm(attn_out, wo, s, wo_scale, BF16)[0], mm(q, wo, qs, wo_scale, BF16),
                        qdtype)


def _quant(x, scale, qdtype):
    """The quant ops' ``(q, scale)``: static with ``scale``, else per token."""
    if qdtype == FP8:
        return ops.dynamic_per_token_scaled_fp8_quant(x) if scale is None else (ops.static_scaled_fp8_quant(x, scale),
                                                                                scale)
    return ops.dynamic_scaled_int8_quant(x) if scale is None else (ops.static_scaled_int8_quant(x, scale), scale)


@pytest.mark.cuda
def test_from_a_cuda_graph_past_the_fused_range_and_switched_off(monkeypatch):
    k, n = 4096, 6144
    w, w_scale = _weight(INT8, n, k, "cuda")
    for m in (1, ops.PROLOGUE_MAX_M + 1):
        x, r, gamma = _inputs("add-norm", m, k, "cuda")
        eager = ops.fused_add_rms_norm_quant_mm(x, r, gamma, EPS, None, w, w_scale, BF16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = ops.fused_add_rms_norm_quant_mm(x, r, gamma, EPS, None, w, w_scale, BF16)
        graph.replay()
        assert all(torch.equal(a, b) for a, b in zip(captured, eager))
        ref = _unfused("add-norm", x, r, gamma, None, w, w_scale)
        assert all(torch.equal(a, b) for a, b in zip(eager, ref))
    monkeypatch.setenv("DYNAMO_ONCE_SMALL_M_GEMM", "0")
    x, r, gamma = _inputs("add-norm", 1, k, "cuda")
    off = ops.fused_add_rms_norm_quant_mm(x, r, gamma, EPS, None, w, w_scale, BF16)
    ref = _unfused("add-norm", x, r, gamma, None, w, w_scale)
    assert all(torch.equal(a, b) for a, b in zip(off, ref))


@pytest.mark.parametrize("qdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "per-token"])
def test_the_ops_compute_the_definition_on_cpu(qdtype, dynamic):
    x, r, gamma = _inputs("add-norm", 3, 64, "cpu")
    w, w_scale = _weight(qdtype, 48, 64, "cpu")
    a_scale = None if dynamic else torch.tensor([SCALE])
    bias = randn((48,), BF16, "cpu", seed=4)
    out, s = ops.fused_add_rms_norm_quant_mm(x, r, gamma, EPS, a_scale, w, w_scale, BF16, bias, True)
    ref, ref_s = ops.fused_add_rms_norm_quant_mm_ref(x, r, gamma, EPS, a_scale, w, w_scale, BF16, bias, True)
    assert torch.equal(out, ref) and torch.equal(s, ref_s)
    assert torch.equal(ops.rms_norm_quant_mm(x, gamma, EPS, a_scale, w, w_scale, BF16),
                       ops.rms_norm_quant_mm_ref(x, gamma, EPS, a_scale, w, w_scale, BF16))
    assert torch.equal(ops.quant_mm(x, a_scale, w, w_scale, torch.float32),
                       ops.quant_mm_ref(x, a_scale, w, w_scale, torch.float32))
    xa = randn((3, 128), BF16, "cpu", seed=5)
    scale = torch.tensor([SCALE])
    assert torch.equal(ops.act_and_mul_quant_mm(xa, "gelu_tanh", scale, w, w_scale, BF16),
                       ops.act_and_mul_quant_mm_ref(xa, "gelu_tanh", scale, w, w_scale, BF16))


def test_bad_arguments_are_named():
    x, r, gamma = _inputs("norm", 2, 64, "cpu")
    w, w_scale = _weight(FP8, 48, 64, "cpu")
    with pytest.raises(TypeError, match=r"rms_norm_quant_mm: w must be torch.float8_e4m3fn or torch.int8; got "
                                        r"torch.bfloat16"):
        ops.rms_norm_quant_mm(x, gamma, EPS, None, w.to(BF16), w_scale, BF16)
    with pytest.raises(ValueError, match=r"quant_mm: x must be \[M, 64\] for w of shape \[48, 64\]; got \[2, 32\]"):
        ops.quant_mm(x[:, :32], None, w, w_scale, BF16)
    with pytest.raises(ValueError, match=r"act_and_mul_quant_mm: act must be one of \['gelu', 'gelu_tanh', 'silu'\]; "
                                         r"got 'relu'"):
        ops.act_and_mul_quant_mm(torch.cat([x, x], 1), "relu", torch.tensor([SCALE]), w, w_scale, BF16)
    with pytest.raises(ValueError, match=r"act_and_mul_quant_mm: x must be \[M, 128\]"):
        ops.act_and_mul_quant_mm(x, "silu", torch.tensor([SCALE]), w, w_scale, BF16)
    with pytest.raises((TypeError, ValueError), match="residual"):
        ops.fused_add_rms_norm_quant_mm(x, r[:1], gamma, EPS, None, w, w_scale, BF16)
