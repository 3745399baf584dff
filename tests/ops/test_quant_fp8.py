"""FP8 quantization is compared bit for bit: both sides divide in IEEE fp32 and round to nearest even."""

import pytest
import torch
from ops_testing import DEVICES, compile_params, compiled, grid_params, strided_rows

import ops


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _assert_same(q, q_ref):
    assert q.dtype == ops.FP8_DTYPE and q.shape == q_ref.shape and q.is_contiguous()
    assert torch.equal(_bits(q), _bits(q_ref))


def _input(t, h, dtype, device):
    g = torch.Generator().manual_seed(0)
    return (4 * torch.randn(t, h, generator=g)).to(dtype).to(device)


@pytest.mark.parametrize("device,num_tokens,hidden,dtype", grid_params())
def test_static_and_dynamic(device, num_tokens, hidden, dtype):
    x = _input(num_tokens, hidden, dtype, device)
    # A scale that saturates the largest values: 4 * 4.5 / 0.03 > 448.
    scale = torch.tensor([0.03], device=device)
    _assert_same(ops.static_scaled_fp8_quant(x, scale), ops.static_scaled_fp8_quant_ref(x, scale))

    q, s = ops.dynamic_scaled_fp8_quant(x)
    q_ref, s_ref = ops.dynamic_scaled_fp8_quant_ref(x)
    assert s.shape == (1,) and s.dtype == torch.float32
    assert torch.equal(s, s_ref)
    amax = x.abs().max().float()
    # IEEE fp32 division (a tensor divisor: CUDA turns `/ python_float` into a reciprocal multiply).
    assert s.item() == max((amax / torch.full_like(amax, ops.FP8_MAX)).item(), ops.MIN_SCALE)
    _assert_same(q, q_ref)


def _adversarial_quotients(scale: float) -> torch.Tensor:
    """fp32 inputs whose quotients by ``scale`` probe the kernels' division (see ops.quant_fp8, the quotient):
    every magnitude from subnormal to beyond the saturation, signed zeros, and values a few ulps around x =
    q * scale for q on fp8's grid and its rounding midpoints."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-140, 40, (4096,), generator=g).float())
    grid = torch.arange(0, 256, dtype=torch.uint8).view(ops.FP8_DTYPE).float()
    grid = grid[torch.isfinite(grid)]
    mids = torch.cat([grid, (grid[1:] + grid[:-1]) / 2]) * scale
    near = (mids.view(torch.int32)[:, None] + torch.arange(-2, 3, dtype=torch.int32)).view(torch.float32).flatten()
    near = near[torch.isfinite(near)]  # the steps below +0 are NaN bit patterns (NaN is not an input the ops define)
    return torch.cat([wide, near, -near, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38])])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [0.0314, 0.03125, 1.9999999 * 2.0**-6, 3.0e-5, 7.0, 1e-30, 1e30],
                         ids=["0.0314", "pow2", "all-ones", "3e-5", "7", "tiny-div_rn", "huge-div_rn"])
def test_static_quotient_is_the_correctly_rounded_division(device, scale):
    """The static kernel's quotient (the rounded reciprocal and a correction, or div_rn for extreme scales) is
    the reference's correctly rounded division on every input, to the bit of the fp8 code."""
    x = _adversarial_quotients(scale).to(device)
    s = torch.tensor([scale], device=device)
    _assert_same(ops.static_scaled_fp8_quant(x[None], s), ops.static_scaled_fp8_quant_ref(x[None], s))


@pytest.mark.parametrize("device", DEVICES)
def test_saturates_and_round_trips(device):
    x = torch.tensor([[0.0, 1.0, -1.0, 448.0, -448.0, 1000.0, -1e9, 3.0e-3]], device=device)
    q = ops.static_scaled_fp8_quant(x, torch.tensor([1.0], device=device)).float()
    assert q.tolist() == [[0.0, 1.0, -1.0, 448.0, -448.0, 448.0, -448.0, q[0, 7].item()]]
    assert 0 < q[0, 7].item() <= 4e-3
    xq, s = ops.dynamic_scaled_fp8_quant(x)
    assert xq.float().abs().max().item() == 448.0 and s.item() == pytest.approx(1e9 / 448)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_zero_input_has_a_finite_positive_scale(device, dtype):
    q, s = ops.dynamic_scaled_fp8_quant(torch.zeros(7, 769, dtype=dtype, device=device))
    assert torch.isfinite(s).all() and s.item() == ops.MIN_SCALE > 0
    assert torch.equal(_bits(q), torch.zeros(7, 769, dtype=torch.uint8, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_input(device):
    x = _input(83, 769, torch.bfloat16, device)
    xs = strided_rows(x)
    scale = torch.tensor([0.02], device=device)
    _assert_same(ops.static_scaled_fp8_quant(xs, scale), ops.static_scaled_fp8_quant_ref(x, scale))
    q, s = ops.dynamic_scaled_fp8_quant(xs)
    assert torch.equal(s, ops.dynamic_scaled_fp8_quant_ref(x)[1])
    _assert_same(q, ops.dynamic_scaled_fp8_quant_ref(x)[0])


@pytest.mark.parametrize("device,num_tokens,hidden,dtype", compile_params())
def test_compiled(device, num_tokens, hidden, dtype):
    x = _input(num_tokens, hidden, dtype, device)
    scale = torch.tensor([0.03], device=device)
    _assert_same(compiled(ops.static_scaled_fp8_quant)(x, scale), ops.static_scaled_fp8_quant_ref(x, scale))
    q, s = compiled(ops.dynamic_scaled_fp8_quant)(x)
    q_ref, s_ref = ops.dynamic_scaled_fp8_quant_ref(x)
    assert torch.equal(s, s_ref)
    _assert_same(q, q_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_module(device):
    x = _input(83, 769, torch.bfloat16, device)
    q, s = ops.QuantFP8(static=False)(x)
    assert torch.equal(s, ops.dynamic_scaled_fp8_quant_ref(x)[1])
    scale = torch.tensor([0.05], device=device)
    q, s = ops.QuantFP8(static=True)(x, scale)
    assert s is scale
    _assert_same(q, ops.static_scaled_fp8_quant_ref(x, scale))
    with pytest.raises(ValueError, match="needs a scale"):
        ops.QuantFP8(static=True)(x)
