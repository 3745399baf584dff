"""``ops.gated_linear`` (gate-up GEMM + SiLU-and-mul): on the GPU, one gated small-M kernel where
``GATED_ROWS`` has a config (M = 1 for bf16 / fp16), the unfused pair elsewhere, both within the bound derived from
the GEMM's and the activation's roundings, and the same replayed from a CUDA graph; on any machine, the reference bit
for bit, the fake kernel (opcheck) and errors that name the argument. The kernel's arithmetic against the unfused
kernels, bit for bit: test_gated_linear_interpreted.py.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from ops_testing import spy_on_rows
from test_scaled_mm import U32, U_OUT

import ops

gated_linear_module = importlib.import_module("ops.gated_linear")
BF16, FP16 = torch.bfloat16, torch.float16
# (K, 2D): Llama 3.2 1B's and Llama 3 8B's gate-up projections
SHAPES = [(2048, 16384), (4096, 28672)]


def _operands(m, k, n, dtype=BF16, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed + m + n)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    return x, w


def _assert_within_bound(h, x, w):
    """Each GEMM output within the fp32-sum bound of the exact product plus its rounding to the dtype (``tg``, ``tu``),
    then ``silu(g) * u`` (|silu'| <= 1.1, |silu(g)| <= |g|) and its own rounding."""
    d, k = w.shape[0] // 2, x.shape[1]
    exact = x.double() @ w.double().t()
    s = x.double().abs() @ w.double().abs().t()
    fp32 = 2 * (k + 1) * U32 * s
    tol_mm = fp32 + U_OUT[h.dtype] * (exact.abs() + fp32)
    g, u, tg, tu = exact[:, :d], exact[:, d:], tol_mm[:, :d], tol_mm[:, d:]
    ref = F.silu(g) * u
    tol = 1.1 * tg * (u.abs() + tu) + (g.abs() + tg) * tu + U_OUT[h.dtype] * (ref.abs() + 1e-30) + 4 * U32 * ref.abs()
    err = (h.double() - ref).abs()
    assert h.dtype == x.dtype and h.shape == ref.shape
    assert (err <= tol).all(), f"max err / tol = {(err / tol).max().item():.3g}"


@pytest.fixture
def gated_calls(monkeypatch):
    """The M of every call ``ops.gated_linear`` makes to the gated small-M launcher."""
    return spy_on_rows(monkeypatch, gated_linear_module, "small_m_gated_mm")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k,n", SHAPES, ids=[f"{k}to{n}" for k, n in SHAPES])
@pytest.mark.parametrize("m", [1, 4, 16, 17])
def test_gated_rows_take_the_gated_kernel(m, k, n, dtype, gated_calls):
    """Where GATED_ROWS has a config the gated kernel runs, else the unfused pair; both within the bound."""
    x, w = _operands(m, k, n, dtype)
    h = ops.gated_linear(x, w)
    gated = ops.small_m_gemm.gated_row(m, dtype) is not None
    assert gated_calls == ([m] if gated else []) and ops.gated_linear_uses_small_m(x, w) == gated
    _assert_within_bound(h, x, w)


@pytest.mark.cuda
def test_unfused_with_the_switch_off_and_for_strided_rows(monkeypatch, gated_calls):
    """The unfused pair, ``ops.linear`` then ``ops.silu_and_mul``, bit for bit."""
    x, w = _operands(1, 2048, 4096)
    wide = torch.randn(1, 4096, device="cuda").to(BF16)[:, ::2]  # column stride 2
    assert torch.equal(ops.gated_linear(wide, w), ops.silu_and_mul(ops.linear(wide, w)))
    monkeypatch.setenv("DYNAMO_ONCE_SMALL_M_GEMM", "0")
    assert torch.equal(ops.gated_linear(x, w), ops.silu_and_mul(ops.linear(x, w)))
    assert gated_calls == []


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph(gated_calls):
    x, w = _operands(1, 2048, 4096)
    expected = ops.gated_linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.gated_linear(x, w)
    x.copy_(_operands(1, 2048, 4096, seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    _assert_within_bound(out, x, w)
    assert not torch.equal(out, expected) and gated_calls == [1, 1]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 5])
def test_cpu_is_the_reference_bit_for_bit(m, dtype, gated_calls):
    x, w = _operands(m, 64, 96, dtype, device="cpu")
    h = ops.gated_linear(x, w)
    assert torch.equal(h, ops.gated_linear_ref(x, w)) and h.shape == (m, 48)
    assert gated_calls == [] and not ops.gated_linear_uses_small_m(x, w)


def test_opcheck():
    x, w = _operands(3, 32, 16, device="cpu")
    torch.library.opcheck(torch.ops.dynamo_once.gated_linear.default, (x, w))


@pytest.mark.parametrize("change, exc, match", [
    (dict(x=torch.zeros(2, 8)), TypeError, "x and weight must both be bfloat16 or float16; got torch.float32"),
    (dict(weight=torch.zeros(4, 8, dtype=FP16)), TypeError, "got torch.bfloat16 and torch.float16"),
    (dict(x=torch.zeros(2, 3, 8, dtype=BF16)), ValueError, r"x must be \[M, K\] and weight \[2D, K\]; got \[2, 3, 8\]"),
    (dict(weight=torch.zeros(4, 6, dtype=BF16)), ValueError, r"got \[2, 8\] and \[4, 6\]"),
    (dict(weight=torch.zeros(5, 8, dtype=BF16)), ValueError, r"an even number of rows; got \[5, 8\]"),
])
def test_errors_name_the_argument(change, exc, match):
    args = dict(x=torch.zeros(2, 8, dtype=BF16), weight=torch.zeros(4, 8, dtype=BF16)) | change
    with pytest.raises(exc, match=match):
        ops.gated_linear(**args)


@pytest.mark.cuda
def test_gated_linear_past_small_m_launches_its_activation_directly(monkeypatch):
    """Past the small-M rows (a prefill's tokens) the op runs cuBLAS's GEMM, then SiLU-and-mul's kernel launched
    directly, not through torch's Triton higher-order op (``wrap_triton``: its eager call costs ~0.3-0.9 ms of host
    time, and the op runs eagerly in every mixed step's compiled pieces): the unfused ops' result, bit for bit."""
    act_and_mul = importlib.import_module("ops.silu_and_mul")
    x, w = _operands(512, 256, 2 * 384)
    expected = ops.silu_and_mul(F.linear(x, w))
    monkeypatch.setattr(act_and_mul, "wrap_triton", lambda kernel: pytest.fail("launched through wrap_triton"))
    torch.testing.assert_close(torch.ops.dynamo_once.gated_linear(x, w), expected, rtol=0, atol=0)
