"""Per-token FP8 quantization, compared bit for bit: one scale a row, IEEE fp32 division, saturation to +-448,
round to nearest even. The reference is checked against an independent fp64 computation and an fp8 rounding
written from the format's value table; the op (the Triton kernel on CUDA) against the reference."""

import pytest
import torch
from ops_testing import DEVICES, compile_params, compiled, grid_params, strided_rows
from test_quant_int8 import _fp32_quotient

import ops
from dispatcher import CompilationConfig, set_compilation_config


def _input(t, h, dtype, device, scale=4.0):
    g = torch.Generator().manual_seed(0)
    return (scale * torch.randn(t, h, generator=g)).to(dtype).to(device)


def _bits(q):
    return q.view(torch.uint8).cpu()


def _fp8_rne_bits(y):
    """The e4m3fn code nearest to each fp64 ``y`` (|y| <= 448), ties to the even code, from the table of the
    format's values (codes 0x00-0x7E ascend from +0 to 448; 0x7F is NaN), not from torch's conversion."""
    values = torch.arange(0, 0x7F, dtype=torch.uint8).view(ops.FP8_DTYPE).double()
    a = y.abs()
    hi = torch.searchsorted(values, a).clamp(max=len(values) - 1)
    lo = (hi - 1).clamp(min=0)
    below, above = a - values[lo], values[hi] - a
    # Consecutive codes differ in the mantissa's last bit: the even code is the even mantissa.
    code = torch.where((above < below) | ((above == below) & (hi % 2 == 0)), hi, lo)
    return (code | (torch.signbit(y).long() << 7)).to(torch.uint8)


def _expected(x):
    amax = x.abs().amax(dim=-1, keepdim=True).double().cpu()
    scale = torch.clamp((amax / ops.FP8_MAX).float(), min=ops.MIN_SCALE)  # fp64 quotient rounded: IEEE fp32
    return _fp8_rne_bits(_fp32_quotient(x, scale).clamp(-ops.FP8_MAX, ops.FP8_MAX)), scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("t,h", [(1, 8), (7, 769), (83, 5120)])
def test_reference_against_fp64(t, h, dtype):
    x = _input(t, h, dtype, "cpu")
    x[t // 2, : h // 2] = 1e-4 * x[t // 2, : h // 2]  # fp8 subnormals and zeros in a row of larger values
    q, s = ops.dynamic_per_token_scaled_fp8_quant_ref(x)
    bits, scale = _expected(x)
    assert s.dtype == torch.float32 and s.shape == (t, 1) and torch.equal(s, scale)
    assert torch.equal(_bits(q), bits)
    assert (q.float().abs().amax(dim=-1) == ops.FP8_MAX).all()  # each row's amax lands on +-448


@pytest.mark.parametrize("device,num_tokens,hidden,dtype", grid_params())
def test_per_token(device, num_tokens, hidden, dtype):
    x = _input(num_tokens, hidden, dtype, device)
    q, s = ops.dynamic_per_token_scaled_fp8_quant(x)
    q_ref, s_ref = ops.dynamic_per_token_scaled_fp8_quant_ref(x)
    assert s.shape == (num_tokens, 1) and s.dtype == torch.float32 and s.is_contiguous()
    assert torch.equal(s, s_ref)
    assert q.dtype == ops.FP8_DTYPE and q.shape == x.shape and q.is_contiguous()
    assert torch.equal(_bits(q), _bits(q_ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_zero_rows_and_per_row_scales(device, dtype):
    mags = torch.tensor([1e-3, 0.0, 1.0, 300.0, 0.0, 6e4]).reshape(6, 1)
    x = (mags * _input(6, 769, torch.float32, "cpu", scale=1.0)).to(dtype).to(device)
    q, s = ops.dynamic_per_token_scaled_fp8_quant(x)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert s[1].item() == s[4].item() == ops.MIN_SCALE
    assert (q[[1, 4]].float() == 0).all()  # 0 * a negative value is -0.0, and stays -0.0
    bits, scale = _expected(x)
    assert torch.equal(s.cpu(), scale) and torch.equal(_bits(q), bits)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_3d_inputs(device):
    x = _input(83, 769, torch.bfloat16, device)
    q, s = ops.dynamic_per_token_scaled_fp8_quant(strided_rows(x))
    q_ref, s_ref = ops.dynamic_per_token_scaled_fp8_quant_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))
    x3 = _input(10, 64, torch.float16, device).reshape(2, 5, 64)
    q, s = ops.dynamic_per_token_scaled_fp8_quant(x3)
    assert q.shape == (2, 5, 64) and s.shape == (2, 5, 1)
    q_ref, s_ref = ops.dynamic_per_token_scaled_fp8_quant_ref(x3.reshape(10, 64))
    assert torch.equal(s.reshape(10, 1), s_ref) and torch.equal(_bits(q).reshape(10, 64), _bits(q_ref))


@pytest.mark.parametrize("device,num_tokens,hidden,dtype", compile_params())
def test_compiled(device, num_tokens, hidden, dtype):
    x = _input(num_tokens, hidden, dtype, device)
    q, s = compiled(ops.dynamic_per_token_scaled_fp8_quant)(x)
    q_ref, s_ref = ops.dynamic_per_token_scaled_fp8_quant_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("custom_ops", [["+quant_fp8"], ["-quant_fp8"]], ids=["on", "off"])
def test_module(device, custom_ops):
    with set_compilation_config(CompilationConfig(level=0, custom_ops=custom_ops)):
        quant = ops.QuantFP8(per_token=True)
    assert "per_token=True" in repr(quant)
    x = _input(83, 769, torch.bfloat16, device)
    q, s = quant(x)
    q_ref, s_ref = ops.dynamic_per_token_scaled_fp8_quant_ref(x)
    assert s.shape == (83, 1) and torch.equal(s, s_ref) and torch.equal(_bits(q), _bits(q_ref))
    with pytest.raises(ValueError, match="per_token scales are computed from x"):
        ops.QuantFP8(static=True, per_token=True)


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"dynamic_per_token_scaled_fp8_quant: x must be float32, float16 or bfloat16; "
                                        r"got torch.int32"):
        ops.dynamic_per_token_scaled_fp8_quant(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x must have rows to scale .*; got shape \[4, 0\]"):
        ops.dynamic_per_token_scaled_fp8_quant(torch.zeros(4, 0))
