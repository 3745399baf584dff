"""The gated small-M GEMM (gate-up GEMM + SiLU-and-mul in its epilogue, with each tile's row amax) and the
per-token quantization after it, in Triton's interpreter on CPU tensors, against the unfused kernels.

Bit for bit: the unfused sequence is the small-M GEMM with the same config, then ``silu_and_mul``'s kernel, then
``act_and_mul_dynamic_quant``'s (the same numpy operations on the same values, so bf16, whose conversion the
interpreter truncates, compares as well). int8 operands are exact in any order; fp8 operands are small integers,
so that their fp32 sums are exact too. The public op's GPU path: tests/ops/test_gated_quant.py.
Run with ``TRITON_INTERPRET=1 pytest -m interpret`` (``make test`` does); elsewhere these are skipped.
"""

import importlib

import pytest
import torch

import ops
from ops.small_m_gemm import SMALL_M_TABLE, SmallMConfig, gated_config, small_m_gated_scaled_mm, small_m_scaled_mm

pytestmark = pytest.mark.interpret

act_and_mul = importlib.import_module("ops.silu_and_mul")
act_quant = importlib.import_module("ops.act_quant")
gated_quant = importlib.import_module("ops.gated_quant")

INT8, FP8 = torch.int8, torch.float8_e4m3fn
# The table's gate-up rows of the 8-bit dtypes (split K and SERIAL dropped: gated_config), a GEMV of two rows,
# a dot tile with K in two steps and an uneven last one; that GEMV with
# three steps' weights loaded first (PRELOAD).
CONFIGS = list(dict.fromkeys(
    [r.config for r in SMALL_M_TABLE if r.config is not None and set(r.dtypes) & {INT8, FP8} and r.min_n >= 16384]
    + [SmallMConfig(1, 2, 64, DOT=False, UNROLL=True), SmallMConfig(16, 32, 128, num_stages=2),
       SmallMConfig(1, 2, 64, DOT=False, UNROLL=True, PRELOAD=3)]))
# (M, K, D): one token, rows masked in a tile, a block boundary; D = 40: no tile of 32 columns divides it.
SHAPES = [(1, 208, 48), (3, 256, 40), (17, 128, 64)]


def _operands(dtype, m, k, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == INT8:
        a = torch.randint(-128, 128, (m, k), generator=g).to(INT8)
        w = torch.randint(-128, 128, (2 * d, k), generator=g).to(INT8)
        unit = 1e-4
    else:  # small integers: fp32 sums exact in any order
        a = torch.randint(-8, 9, (m, k), generator=g).float().to(FP8)
        w = torch.randint(-8, 9, (2 * d, k), generator=g).float().to(FP8)
        unit = 1e-3
    a_scale = unit * (0.5 + torch.rand(m, 1, generator=g))
    w_scale = unit * (0.5 + torch.rand(2 * d, generator=g))
    return a, w, a_scale, w_scale


def _unfused(a, w, a_scale, w_scale, out_dtype, config, quant_dtype):
    out = small_m_scaled_mm(a, w, a_scale, w_scale, out_dtype, None, gated_config(config, a.dtype))
    return out, act_quant._launch_act_and_mul_quant(out, None, "silu", quant_dtype)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


# The GEMV rows (BLOCK_M 1: a program a row) run at M = 1 and 3 (the 17-row shape took up to half a minute a case in
# the interpreter, for rows no decode gives them); the dot tiles at every shape.
CASES = [(config, shape) for config in CONFIGS for shape in SHAPES if config.BLOCK_M > 1 or shape[0] <= 3]


@pytest.mark.parametrize("config,m,k,d", [(c, *shape) for c, shape in CASES],
                         ids=[f"{c}-{'x'.join(map(str, shape))}" for c, shape in CASES])
@pytest.mark.parametrize("dtype,out_dtype", [(INT8, torch.bfloat16), (FP8, torch.float16)], ids=["int8", "fp8"])
def test_gated_gemm_and_quant_are_the_unfused_kernels(config, m, k, d, dtype, out_dtype):
    a, w, a_scale, w_scale = _operands(dtype, m, k, d)
    h, amax = small_m_gated_scaled_mm(a, w, a_scale, w_scale, out_dtype, config)
    out, _ = _unfused(a, w, a_scale, w_scale, out_dtype, config, INT8)
    expected_h = act_and_mul.launch_act_and_mul(out, act_quant.ACTIVATIONS["silu"])
    assert h.dtype == out_dtype and torch.equal(h, expected_h)
    assert torch.equal(amax.amax(dim=1), expected_h.float().abs().amax(dim=1))
    for quant_dtype in (INT8, FP8):
        q, scale = gated_quant.launch_gated_quant(h, amax, quant_dtype)
        q_ref, scale_ref = act_quant._launch_act_and_mul_quant(out, None, "silu", quant_dtype)
        assert torch.equal(scale, scale_ref) and torch.equal(_bits(q), _bits(q_ref))


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[-1]], ids=str)
@pytest.mark.parametrize("quant_dtype", [INT8, FP8], ids=["q-int8", "q-fp8"])
@pytest.mark.parametrize("scale", [0.003, 1e-30], ids=["scale", "tiny-scale"])
def test_gated_gemm_static_quant_is_the_unfused_kernels(config, quant_dtype, scale):
    """A per-tensor scale: the gated kernel quantizes in its epilogue, as act_and_mul_static_quant's kernel does
    (a tiny scale: the quotient's other path, saturating)."""
    a, w, a_scale, w_scale = _operands(INT8, 3, 208, 40)
    s = torch.tensor([scale])
    q, none = small_m_gated_scaled_mm(a, w, a_scale, w_scale, torch.bfloat16, config, s, quant_dtype)
    out = small_m_scaled_mm(a, w, a_scale, w_scale, torch.bfloat16, None, gated_config(config, a.dtype))
    q_ref, _ = act_quant._launch_act_and_mul_quant(out, s, "silu", quant_dtype)
    assert none is None and q.dtype == quant_dtype and torch.equal(_bits(q), _bits(q_ref))


def test_gated_gemm_zero_rows_take_the_min_scale():
    """A token whose gate-up products are all zero: h = 0, amax 0, the min scale, q = 0."""
    a, w, a_scale, w_scale = _operands(INT8, 3, 64, 32)
    a[1] = 0
    a_scale.fill_(1e-2)
    h, amax = small_m_gated_scaled_mm(a, w, a_scale, w_scale, torch.bfloat16, SmallMConfig(16, 32, 64))
    q, scale = gated_quant.launch_gated_quant(h, amax, INT8)
    assert torch.equal(h[1], torch.zeros_like(h[1])) and not q[1].any()
    assert scale[1].item() == ops.INT8_MIN_SCALE and scale[0].item() > ops.INT8_MIN_SCALE


def test_gated_gemm_refuses_an_odd_weight():
    a, w, a_scale, w_scale = _operands(INT8, 1, 64, 32)
    with pytest.raises(ValueError, match=r"w must be \[gate; up\]"):
        small_m_gated_scaled_mm(a, w[:63], a_scale, w_scale[:63], torch.bfloat16, SmallMConfig(16, 32, 64))
