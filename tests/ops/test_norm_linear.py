"""``ops.norm_linear`` (residual add + RMSNorm + the linear layer after it, plain or gate-up): on the GPU, one fused
kernel at one token where the small-M table has a GEMV row, the unfused ops (``ops.fused_add_rms_norm``, then
``ops.linear`` / ``ops.gated_linear``) elsewhere, both within the bound derived from the roundings, and the same
replayed from a CUDA graph; on any machine, the reference bit for bit, the fake kernel (opcheck) and errors that
name the argument. The fused kernel against the unfused kernels: test_norm_linear_interpreted.py.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from ops_testing import spy_on_rows
from test_scaled_mm import U32, U_OUT

import ops

norm_linear_module = importlib.import_module("ops.norm_linear")
BF16, FP16 = torch.bfloat16, torch.float16
# (K, N, gated): Llama 3.2 1B's QKV and gate-up projections, Llama 3 8B's QKV
SHAPES = [(2048, 3072, False), (2048, 16384, True), (4096, 6144, False)]


def _operands(m, k, n, dtype=BF16, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed + m + n)
    x, r = (torch.randn(m, k, generator=g, device=device).to(dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, generator=g, device=device)).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    return x, r, nw, w


def _assert_within_bound(out, h, x, r, nw, w, gated):
    """``h`` the reference sum bit for bit; each GEMM output within the fp32-sum bound of the product of the
    reference's normalized row plus one rounding of each of its elements (the fused kernel's mean square is summed
    in another order) and the output's rounding; gated: then ``silu(g) * u`` (|silu'| <= 1.1) and its rounding."""
    normed, h_ref = ops.fused_add_rms_norm_ref(x, r, nw, 1e-5)
    assert torch.equal(h, h_ref)
    k = x.shape[1]
    exact = normed.double() @ w.double().t()
    s = normed.double().abs() @ w.double().abs().t()
    t = (2 * U_OUT[out.dtype] + 2 * (k + 1) * U32) * s
    t = t + U_OUT[out.dtype] * (exact.abs() + t)
    if gated:
        d = w.shape[0] // 2
        g, u, tg, tu = exact[:, :d], exact[:, d:], t[:, :d], t[:, d:]
        ref = F.silu(g) * u
        tol = 1.1 * tg * (u.abs() + tu) + (g.abs() + tg) * tu + U_OUT[out.dtype] * ref.abs() + 4 * U32 * ref.abs()
    else:
        ref, tol = exact, t
    err = (out.double() - ref).abs()
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert (err <= tol + 1e-30).all(), f"max err / tol = {(err / tol).max().item():.3g}"


@pytest.fixture
def fused_calls(monkeypatch):
    """The M of every call ``ops.norm_linear`` makes to the fused kernel's launcher."""
    return spy_on_rows(monkeypatch, norm_linear_module, "norm_small_m_mm")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k,n,gated", SHAPES, ids=["1b-qkv", "1b-gate-up", "8b-qkv"])
@pytest.mark.parametrize("m", [1, 4])
def test_one_token_takes_the_fused_kernel(m, k, n, gated, dtype, fused_calls):
    x, r, nw, w = _operands(m, k, n, dtype)
    out, h = ops.norm_linear(x, r, nw, w, 1e-5, gated)
    row = ops.small_m_config(1, n, k, dtype)  # the plain form fuses where the table's row is an unrolled GEMV
    fused = m == 1 and (gated or (row is not None and row.UNROLL and row.BLOCK_M == 1))
    assert fused_calls == ([1] if fused else []) and ops.norm_linear_uses_small_m(x, r, w, gated) == fused
    _assert_within_bound(out, h, x, r, nw, w, gated)


@pytest.mark.cuda
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_unfused_with_the_switch_off(monkeypatch, fused_calls, gated):
    """The unfused ops: the fused-add norm's kernel, then the linear op, whose values they are."""
    x, r, nw, w = _operands(1, 2048, 16384 if gated else 3072)
    monkeypatch.setenv("DYNAMO_ONCE_SMALL_M_GEMM", "0")
    out, h = ops.norm_linear(x, r, nw, w, 1e-5, gated)
    normed, h2 = ops.fused_add_rms_norm(x, r, nw, 1e-5)
    assert torch.equal(h, h2) and fused_calls == []
    assert torch.equal(out, ops.gated_linear(normed, w) if gated else ops.linear(normed, w))


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph(fused_calls):
    x, r, nw, w = _operands(1, 2048, 16384)
    expected, _ = ops.norm_linear(x, r, nw, w, 1e-5, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, h = ops.norm_linear(x, r, nw, w, 1e-5, True)
    x.mul_(-0.5)
    graph.replay()
    torch.cuda.synchronize()
    _assert_within_bound(out, h, x, r, nw, w, True)
    assert not torch.equal(out, expected) and fused_calls == [1, 1]


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 5])
def test_cpu_is_the_reference_bit_for_bit(m, dtype, gated, fused_calls):
    """On the CPU: the fused-add norm's reference, then ``F.linear`` (gated: the gated linear's reference)."""
    x, r, nw, w = _operands(m, 64, 96, dtype, device="cpu")
    out, h = ops.norm_linear(x, r, nw, w, 1e-5, gated)
    ref_out, ref_h = ops.norm_linear_ref(x, r, nw, w, 1e-5, gated)
    normed, _ = ops.fused_add_rms_norm_ref(x, r, nw, 1e-5)
    assert torch.equal(out, ref_out) and torch.equal(h, ref_h)
    assert torch.equal(out, ops.gated_linear_ref(normed, w) if gated else F.linear(normed, w))
    assert fused_calls == [] and not ops.norm_linear_uses_small_m(x, r, w, gated)


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_opcheck(gated):
    x, r, nw, w = _operands(3, 32, 48, device="cpu")
    torch.library.opcheck(torch.ops.dynamo_once.norm_linear.default, (x, r, nw, w, 1e-5, gated))


_OK = dict(x=torch.zeros(2, 8, dtype=BF16), residual=torch.zeros(2, 8, dtype=BF16), norm_weight=torch.ones(8),
           weight=torch.zeros(6, 8, dtype=BF16))


@pytest.mark.parametrize("change, exc, match", [
    (dict(x=torch.zeros(2, 8)), TypeError, "x, residual and weight must all be bfloat16 or float16; got torch.float32"),
    (dict(residual=torch.zeros(2, 8, dtype=FP16)), TypeError, "got torch.bfloat16, torch.float16 and torch.bfloat16"),
    (dict(residual=torch.zeros(3, 8, dtype=BF16)), ValueError,
     r"x and residual must be \[M, K\].*got \[2, 8\], \[3, 8\]"),
    (dict(weight=torch.zeros(6, 4, dtype=BF16)), ValueError, r"weight \[N, K\]; got \[2, 8\], \[2, 8\] and \[6, 4\]"),
    (dict(norm_weight=torch.ones(4)), ValueError, r"norm_weight must be \[K\] = \[8\]; got \[4\]"),
    (dict(weight=torch.zeros(5, 8, dtype=BF16), gated=True), ValueError,
     r"gated weight must be \[gate; up\].*\[5, 8\]"),
])
def test_errors_name_the_argument(change, exc, match):
    with pytest.raises(exc, match=match):
        ops.norm_linear(**(_OK | change))
