"""The prologue GEMM's kernel in Triton's interpreter, on CPU tensors, against the definition (the unfused
references): RMSNorm (plain, with the residual add, Gemma's), SiLU / GELU-and-mul and plain quantization, each
before an fp8 and an int8 GEMM, static and per-token scales, split K, masked rows and columns.

int8 is compared bit for bit where the quantized operand is exact (inputs with exact sums of squares: the
kernel's reduction order cannot move the norm); fp8 within the bound of its fp32 accumulation. The activations'
exp / erf are NumPy's in the interpreter and torch's in the reference: there a quantized value may move by one
step, which the tolerance allows. Run with ``TRITON_INTERPRET=1 pytest -m interpret`` (``make test`` does).
"""

import pytest
import torch
from test_fused_quant import EPS, STATIC_SCALE, dyadic, randn
from test_small_m_gemm_interpreted import _tolerance

import ops
from ops.small_m_gemm import SmallMConfig

pytestmark = [pytest.mark.interpret]

FP8, INT8 = torch.float8_e4m3fn, torch.int8
# (M, K, N, config): one row; a few rows over two K splits, the second partly past K; a full 16-row tile with
# N past the last column block; two row blocks, the second partly past M.
CASES = [
    (1, 64, 64, SmallMConfig(16, 32, 32, num_stages=2)),
    (3, 96, 32, SmallMConfig(16, 32, 32, SPLIT_K=2)),
    (16, 64, 80, SmallMConfig(16, 32, 32)),
    (20, 64, 32, SmallMConfig(16, 32, 32, SPLIT_K=2)),
]
CASE_IDS = ["m1", "m3-splitk", "m16-masked-n", "m20-two-row-blocks"]


def _weights(n, k, qdtype, per_channel, seed=1):
    w = randn((n, k), torch.float32, "cpu", seed=seed)
    if qdtype == FP8:
        q, s = ops.dynamic_per_token_scaled_fp8_quant_ref(w) if per_channel else ops.dynamic_scaled_fp8_quant_ref(w)
    else:
        q, s = ops.dynamic_scaled_int8_quant_ref(w) if per_channel else ops.dynamic_scaled_int8_quant_ref(w.reshape(1, -1))
        q = q.reshape(n, k)
    return q, s.reshape(-1).float()


def _check(out, ref, q_steps, x_scale, w, w_scale, out_dtype, exact):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if exact:
        assert torch.equal(out, ref)
        return
    # the fp32 accumulation's bound, plus q_steps quantization steps of the operand under each weight
    a_unit = torch.ones(ref.shape[0], w.shape[1])
    tol = _tolerance(a_unit * 448.0, w.float(), torch.tensor([x_scale]).float(), w_scale, None, out_dtype, ref.float())
    step = q_steps * x_scale * (w.float().abs().amax(dim=1) * w_scale.expand(w.shape[0]))[None, :]
    assert ((out.float() - ref.float()).abs() <= tol + step).all()


def _a_scale_of(ref_scale):
    return float(ref_scale.max())


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("qdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "per-token"])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_norm_prologue_matches_the_unfused_definition(case, qdtype, dynamic, residual, gemma):
    m, k, n, config = case
    x = dyadic((m, k), torch.float16, "cpu", k=8, seed=2)
    r = dyadic((m, k), torch.float16, "cpu", k=8, seed=3) if residual else None
    gamma = dyadic((k,), torch.float16, "cpu", k=8, seed=4)
    w, w_scale = _weights(n, k, qdtype, per_channel=qdtype == INT8)
    a_scale = None if dynamic else torch.tensor([STATIC_SCALE])
    out_dtype = torch.float32
    out, s = ops.prologue_scaled_mm(x, w, a_scale, w_scale, out_dtype, norm_weight=gamma, residual=r, eps=EPS,
                                    gemma=gemma, config=config)
    if residual:
        ref, ref_s = ops.fused_add_rms_norm_quant_mm_ref(x, r, gamma, EPS, a_scale, w, w_scale, out_dtype, None, gemma)
        assert torch.equal(s, ref_s)
        normed = ref_s
    else:
        ref = ops.rms_norm_quant_mm_ref(x, gamma, EPS, a_scale, w, w_scale, out_dtype, None, gemma)
        assert s is None
        normed = x
    scale = STATIC_SCALE if not dynamic else _a_scale_of(
        ops.rms_norm_dynamic_quant_ref(normed, gamma, EPS, qdtype, gemma)[1])
    _check(out, ref, 0, scale, w, w_scale, out_dtype, exact=qdtype == INT8)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("qdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul_prologue_matches_the_unfused_definition(case, qdtype, act):
    m, k, n, config = case
    x = randn((m, 2 * k), torch.float16, "cpu", scale=2.0, seed=5)
    w, w_scale = _weights(n, k, qdtype, per_channel=False)
    a_scale = torch.tensor([STATIC_SCALE])
    out, s = ops.prologue_scaled_mm(x, w, a_scale, w_scale, torch.float32, act=act, config=config)
    ref = ops.act_and_mul_quant_mm_ref(x, act, a_scale, w, w_scale, torch.float32)
    assert s is None
    _check(out, ref, 1, STATIC_SCALE, w, w_scale, torch.float32, exact=False)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("qdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "per-token"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_quant_prologue_matches_the_unfused_definition(case, qdtype, dynamic, out_dtype):
    m, k, n, config = case
    x = randn((m, k), torch.float16, "cpu", seed=6)
    w, w_scale = _weights(n, k, qdtype, per_channel=True)
    a_scale = None if dynamic else torch.tensor([STATIC_SCALE])
    bias = randn((n,), out_dtype, "cpu", seed=7)
    out, _ = ops.prologue_scaled_mm(x, w, a_scale, w_scale, out_dtype, bias, config=config)
    ref = ops.quant_mm_ref(x, a_scale, w, w_scale, out_dtype, bias)
    scale = STATIC_SCALE if not dynamic else _a_scale_of(ops.dynamic_per_token_scaled_fp8_quant_ref(x)[1]
                                                         if qdtype == FP8 else ops.dynamic_scaled_int8_quant_ref(x)[1])
    _check(out, ref, 0, scale, w, w_scale, out_dtype, exact=qdtype == INT8)
