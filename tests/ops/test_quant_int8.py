"""INT8 quantization, compared bit for bit: IEEE fp32 division, rounding half to even, saturation to [-128, 127];
per-token scales. The references are checked against an independent fp64 computation, the ops (Triton kernels
on CUDA) against the references."""

import pytest
import torch
from ops_testing import DEVICES, compile_params, compiled, grid_params, strided_rows

import ops
from dispatcher import CompilationConfig, set_compilation_config


def _input(t, h, dtype, device, scale=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(t, h, generator=g)).to(dtype).to(device)


def _fp32_quotient(x, scale):
    """x / scale correctly rounded to fp32, from fp64: a 53-bit quotient rounded again to 24 bits is the
    correctly rounded one (53 >= 2 * 24 + 2), so this is the IEEE fp32 division without computing one."""
    return (x.double().cpu() / scale.double().cpu()).float().double()


def _round_half_even(y):
    """Round to the nearest integer, ties to even, without torch.round: floor(y + 0.5), one less on an odd tie."""
    r = torch.floor(y + 0.5)  # y + 0.5 is exact in fp64 for |y| < 2**52
    tie = (r - y) == 0.5
    return torch.where(tie & (torch.remainder(r, 2) == 1), r - 1, r)


def _expected_q(x, scale):
    return _round_half_even(_fp32_quotient(x, scale)).clamp(-128, 127).to(torch.int8)


def _expected_scale(x):
    amax = x.abs().amax(dim=-1, keepdim=True).double().cpu()
    return torch.clamp((amax / 127.0).float(), min=ops.INT8_MIN_SCALE)


def _assert_same(q, q_ref):
    assert q.dtype == torch.int8 and q.shape == q_ref.shape and q.is_contiguous()
    assert torch.equal(q.cpu(), q_ref.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("t,h", [(1, 8), (7, 769), (83, 5120)])
def test_references_against_fp64(t, h, dtype):
    x = _input(t, h, dtype, "cpu")
    # 0.0314 is no power of two: quotients round; 4 * 4.5 / 0.0314 > 127: the largest saturate.
    scale = torch.tensor([0.0314])
    assert torch.equal(ops.static_scaled_int8_quant_ref(x, scale), _expected_q(x, scale))
    q, s = ops.dynamic_scaled_int8_quant_ref(x)
    assert s.dtype == torch.float32 and s.shape == (t, 1)
    assert torch.equal(s, _expected_scale(x))
    assert torch.equal(q, _expected_q(x, s))
    assert (q.abs().amax(dim=-1) == 127).all()  # each row's amax lands on the edge of the grid


# x / 1 = k + 0.5 for every k the range holds, and the edges: ties go to the even neighbour, then saturate.
TIES = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 125.5, 126.5, 127.5, 128.5, -126.5, -127.5, -128.5, -129.5, 1e9, -1e9]
TIES_Q = [0, 2, 2, 0, -2, -2, 126, 126, 127, 127, -126, -128, -128, -128, 127, -128]


@pytest.mark.parametrize("device", DEVICES)
def test_ties_round_to_even_and_saturate(device):
    x = torch.tensor([TIES], device=device)
    assert ops.static_scaled_int8_quant(x, torch.tensor([1.0], device=device)).tolist() == [TIES_Q]
    every_tie = (torch.arange(-140, 140, dtype=torch.float32) + 0.5).reshape(4, 70).to(device)
    scale = torch.tensor([0.25], device=device)  # a power of two: x * 4 exact, the ties stay ties
    _assert_same(ops.static_scaled_int8_quant(every_tie * 0.25, scale), _expected_q(every_tie * 0.25, scale))
    # Dynamic: amax 127 gives scale 1 exactly, so the row's ties are ties of the per-token quant too.
    row = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5]], device=device)
    q, s = ops.dynamic_scaled_int8_quant(row)
    assert s.item() == 1.0 and q.tolist() == [[127, 0, 2, 2, 0, -2, 126, -126]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_zero_rows_get_the_min_scale(device, dtype):
    x = _input(6, 769, dtype, device)
    x[1] = 0
    x[4] = 0
    q, s = ops.dynamic_scaled_int8_quant(x)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert s[1].item() == s[4].item() == ops.INT8_MIN_SCALE
    assert ops.INT8_MIN_SCALE == pytest.approx(1 / (127 * 512), rel=1e-7)
    assert (q[1] == 0).all() and (q[4] == 0).all()
    assert torch.equal(s.cpu(), _expected_scale(x))


@pytest.mark.parametrize("device", DEVICES)
def test_per_token_scales(device):
    """Rows of very different magnitudes each get their own scale; a tiny row is quantized on the floor's grid."""
    mags = torch.tensor([1e-6, 1e-3, 1.0, 300.0, 6e4]).reshape(5, 1)
    x = (mags * _input(5, 1024, torch.float32, "cpu", scale=1.0)).to(device)
    q, s = ops.dynamic_scaled_int8_quant(x)
    assert torch.equal(s.cpu(), _expected_scale(x))
    assert s[0].item() == ops.INT8_MIN_SCALE  # amax ~4e-6 < 127 * INT8_MIN_SCALE = 1/512
    assert (q[1:].abs().amax(dim=-1) == 127).all()
    _assert_same(q, _expected_q(x, s))


@pytest.mark.parametrize("device,num_tokens,hidden,dtype", grid_params())
def test_static_and_dynamic(device, num_tokens, hidden, dtype):
    x = _input(num_tokens, hidden, dtype, device)
    scale = torch.tensor([0.0314], device=device)
    _assert_same(ops.static_scaled_int8_quant(x, scale), ops.static_scaled_int8_quant_ref(x, scale))
    q, s = ops.dynamic_scaled_int8_quant(x)
    q_ref, s_ref = ops.dynamic_scaled_int8_quant_ref(x)
    assert s.shape == (num_tokens, 1) and s.dtype == torch.float32 and s.is_contiguous()
    assert torch.equal(s, s_ref)
    _assert_same(q, q_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_3d_inputs(device):
    x = _input(83, 769, torch.bfloat16, device)
    xs = strided_rows(x)
    scale = torch.tensor([0.02], device=device)
    _assert_same(ops.static_scaled_int8_quant(xs, scale), ops.static_scaled_int8_quant_ref(x, scale))
    q, s = ops.dynamic_scaled_int8_quant(xs)
    q_ref, s_ref = ops.dynamic_scaled_int8_quant_ref(x)
    assert torch.equal(s, s_ref)
    _assert_same(q, q_ref)
    x3 = _input(2 * 5, 64, torch.float16, device).reshape(2, 5, 64)
    q, s = ops.dynamic_scaled_int8_quant(x3)
    assert q.shape == (2, 5, 64) and s.shape == (2, 5, 1)  # per row of the last dim
    q_ref, s_ref = ops.dynamic_scaled_int8_quant_ref(x3.reshape(10, 64))
    assert torch.equal(s.reshape(10, 1), s_ref)
    _assert_same(q.reshape(10, 64), q_ref)


@pytest.mark.parametrize("device,num_tokens,hidden,dtype", compile_params())
def test_compiled(device, num_tokens, hidden, dtype):
    x = _input(num_tokens, hidden, dtype, device)
    scale = torch.tensor([0.0314], device=device)
    _assert_same(compiled(ops.static_scaled_int8_quant)(x, scale), ops.static_scaled_int8_quant_ref(x, scale))
    q, s = compiled(ops.dynamic_scaled_int8_quant)(x)
    q_ref, s_ref = ops.dynamic_scaled_int8_quant_ref(x)
    assert torch.equal(s, s_ref)
    _assert_same(q, q_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("custom_ops", [["+quant_int8"], ["-quant_int8"]], ids=["on", "off"])
def test_module_switch(device, custom_ops):
    """QuantInt8 on: the op (the Triton kernels on CUDA); off: the native torch code. Same results."""
    with set_compilation_config(CompilationConfig(level=0, custom_ops=custom_ops)):
        dynamic, static = ops.QuantInt8(), ops.QuantInt8(static=True)
    if custom_ops == ["-quant_int8"]:
        expected = "forward_native"
    else:  # chosen by the machine, not the tensors: forward_cuda also serves CPU tensors (through the reference)
        expected = "forward_cuda" if torch.cuda.is_available() and ops.HAS_TRITON else "forward_cpu"
    assert dynamic._forward_method.__name__ == static._forward_method.__name__ == expected
    x = _input(83, 769, torch.bfloat16, device)
    q, s = dynamic(x)
    q_ref, s_ref = ops.dynamic_scaled_int8_quant_ref(x)
    assert torch.equal(s, s_ref)
    _assert_same(q, q_ref)
    scale = torch.tensor([0.05], device=device)
    q, s = static(x, scale)
    assert s is scale
    _assert_same(q, ops.static_scaled_int8_quant_ref(x, scale))
    with pytest.raises(ValueError, match="needs a scale"):
        static(x)


@pytest.mark.cuda
@pytest.mark.parametrize("custom_ops,op_in_graph", [(["+quant_int8"], True), (["-quant_int8"], False)], ids=["on", "off"])
def test_module_switch_in_the_graph(custom_ops, op_in_graph):
    """On: the graph calls torch.ops.dynamo_once.dynamic_scaled_int8_quant; off: plain aten ops (round, amax)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with set_compilation_config(CompilationConfig(level=0, custom_ops=custom_ops)):
        quant = ops.QuantInt8()
    x = _input(16, 1024, torch.bfloat16, "cuda")
    out = torch.compile(quant, backend=backend, fullgraph=True)(x)
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert any("dynamic_scaled_int8_quant" in t for t in targets) == op_in_graph
    assert any("round" in t for t in targets) != op_in_graph
    assert torch.equal(out[0], ops.dynamic_scaled_int8_quant_ref(x)[0])


def test_errors_name_the_argument():
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match=r"static_scaled_int8_quant: x must be float32, float16 or bfloat16; got torch.int8"):
        ops.static_scaled_int8_quant(x.to(torch.int8), torch.tensor([1.0]))
    with pytest.raises(TypeError, match=r"dynamic_scaled_int8_quant: x must be .*; got torch.float64"):
        ops.dynamic_scaled_int8_quant(x.double())
    with pytest.raises(TypeError, match=r"static_scaled_int8_quant: scale must be float32; got torch.float16"):
        ops.static_scaled_int8_quant(x, torch.tensor([1.0], dtype=torch.float16))
    with pytest.raises(ValueError, match=r"scale must be one per-tensor value of shape \[1\]; got shape \[4, 1\]"):
        ops.static_scaled_int8_quant(x, torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"scale must be on x's device cpu; got meta"):
        ops.static_scaled_int8_quant(x, torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match=r"dynamic_scaled_int8_quant: x must have rows .*; got shape \[4, 0\]"):
        ops.dynamic_scaled_int8_quant(torch.zeros(4, 0))
    with pytest.raises(ValueError, match=r"got shape \[\]"):
        ops.dynamic_scaled_int8_quant(torch.tensor(1.0))
    # A 0-d scale is one per-tensor value too.
    assert torch.equal(ops.static_scaled_int8_quant(x, torch.tensor(0.5)), ops.static_scaled_int8_quant(x, torch.tensor([0.5])))
