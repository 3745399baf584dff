"""silu_and_mul and gelu_and_mul: ``[..., 2d] -> [..., d]``; ``hidden`` below is d."""

import pytest
import torch
import torch.nn.functional as F
from ops_testing import DEVICES, assert_close, compile_params, compiled, grid_params, strided_rows

import ops
from dispatcher import CompilationConfig, set_compilation_config

ACTS = {
    # name: (op(x), reference(x), independent fp64 formula of gate)
    "silu": (ops.silu_and_mul, ops.silu_and_mul_ref, lambda a: a * torch.sigmoid(a)),
    "gelu": (ops.gelu_and_mul, ops.gelu_and_mul_ref, lambda a: 0.5 * a * (1 + torch.erf(a / 2**0.5))),
    "gelu_tanh": (
        lambda x: ops.gelu_and_mul(x, "tanh"),
        lambda x: ops.gelu_and_mul_ref(x, "tanh"),
        lambda a: 0.5 * a * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (a + 0.044715 * a**3))),
    ),
}


def _input(t, d, dtype, device):
    g = torch.Generator().manual_seed(0)
    # Scaled by 3 to reach both tails of the activations.
    return (3 * torch.randn(t, 2 * d, generator=g)).to(dtype).to(device)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("device,num_tokens,hidden,dtype", grid_params())
def test_act_and_mul(device, num_tokens, hidden, dtype, act):
    op, ref, _ = ACTS[act]
    x = _input(num_tokens, hidden, dtype, device)
    out = op(x)
    assert out.shape == (num_tokens, hidden) and out.is_contiguous()
    assert_close(out, ref(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("num_tokens,hidden", [(7, 769), (83, 5120), (4096, 8)])
def test_strided_and_3d_inputs(device, act, num_tokens, hidden):
    op, ref, _ = ACTS[act]
    x = _input(num_tokens, hidden, torch.bfloat16, device)
    assert_close(op(strided_rows(x)), ref(x))
    x3 = x.reshape(1, num_tokens, 2 * hidden)
    assert_close(op(x3), ref(x3))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("device,num_tokens,hidden,dtype", compile_params())
def test_compiled(device, num_tokens, hidden, dtype, act):
    op, ref, _ = ACTS[act]
    x = _input(num_tokens, hidden, dtype, device)
    assert_close(compiled(op)(x), ref(x))


@pytest.mark.parametrize("act", ACTS)
def test_reference_matches_an_independent_float64_formula(act):
    _, ref, gate = ACTS[act]
    x = _input(83, 769, torch.float32, "cpu")
    a, b = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(ref(x), (gate(a) * b).float(), atol=1e-5, rtol=1e-5)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        ops.GeluAndMul("fast")
    with pytest.raises(Exception, match="approximate"):
        ops.gelu_and_mul(torch.randn(2, 4), "fast")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("custom_ops", [["all"], ["none"]])
def test_modules(device, custom_ops):
    x = _input(83, 769, torch.bfloat16, device)
    with set_compilation_config(CompilationConfig(level=0, custom_ops=custom_ops)):
        mods = [ops.SiluAndMul(), ops.GeluAndMul("none"), ops.GeluAndMul("tanh")]
    assert_close(mods[0](x), ops.silu_and_mul_ref(x))
    assert_close(mods[1](x), ops.gelu_and_mul_ref(x, "none"))
    assert_close(mods[2](x), ops.gelu_and_mul_ref(x, "tanh"))
    assert_close(mods[2](x), (F.gelu(x.float()[:, :769], approximate="tanh") * x.float()[:, 769:]).to(x.dtype))
