"""``ops.rope_linear`` (QKV GEMM + the rotary embedding of q and k): on the GPU, one fused kernel at one token where
the small-M table has a GEMV row for the shape, the unfused pair (``ops.linear``, then the rotary kernel in place)
elsewhere, both within the bound derived from the GEMM's and the rotation's roundings, and the same replayed from
a CUDA graph; on any machine, the reference bit for bit, the fake kernel (opcheck) and errors that name the
argument. The fused kernel against the unfused kernels, bit for bit: test_rope_linear_interpreted.py.
"""

import importlib

import pytest
import torch
from ops_testing import spy_on_rows
from test_scaled_mm import U32, U_OUT

import ops

rope_module = importlib.import_module("ops.rope_linear")
BF16, FP16 = torch.bfloat16, torch.float16
# (K, head_size, q heads, kv heads): Llama 3.2 1B's and Llama 3 8B's attention
SHAPES = [(2048, 64, 32, 8), (4096, 128, 32, 8)]


def _operands(m, k, d, hq, hk, dtype=BF16, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed + m + k)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn((hq + 2 * hk) * d, k, generator=g, device=device) / k**0.5).to(dtype)
    cache = ops.compute_cos_sin_cache(d, 8192, dtype=dtype, device=device)
    pos = torch.randint(0, 8192, (m,), generator=g, device=device)
    return x, w, pos, cache


def _assert_within_bound(out, x, w, pos, cache, d, rot_heads):
    """Each GEMM output within the fp32-sum bound of the exact product plus its rounding (``t``), then the rotation
    (|cos|, |sin| <= 1: the two inputs' bounds add) and its own rounding."""
    k, cols = x.shape[1], rot_heads * d
    exact = x.double() @ w.double().t()
    s = x.double().abs() @ w.double().abs().t()
    fp32 = 2 * (k + 1) * U32 * s
    t = fp32 + U_OUT[out.dtype] * (exact.abs() + fp32)
    cos, sin = cache.double()[pos].chunk(2, dim=-1)
    e, te = exact[:, :cols].unflatten(1, (rot_heads, d)), t[:, :cols].unflatten(1, (rot_heads, d))
    x1, x2, t1, t2 = e[..., :d // 2], e[..., d // 2:], te[..., :d // 2], te[..., d // 2:]
    cos, sin = cos[:, None], sin[:, None]
    ref = torch.cat((exact[:, :0], torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(1),
                     exact[:, cols:]), 1)
    tol_rot = (t1 + t2).repeat(1, 1, 2).flatten(1)
    tol = torch.cat((tol_rot + 4 * U32 * (x1.abs() + x2.abs()).repeat(1, 1, 2).flatten(1), t[:, cols:]), 1)
    tol = tol + U_OUT[out.dtype] * (ref.abs() + tol)
    err = (out.double() - ref).abs()
    assert out.dtype == x.dtype and out.shape == ref.shape
    assert (err <= tol).all(), f"max err / tol = {(err / tol).max().item():.3g}"


@pytest.fixture
def fused_calls(monkeypatch):
    """The M of every call ``ops.rope_linear`` makes to the fused kernel's launcher."""
    return spy_on_rows(monkeypatch, rope_module, "rope_small_m_mm")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("k,d,hq,hk", SHAPES, ids=["1b", "8b"])
@pytest.mark.parametrize("m", [1, 4, 17])
def test_one_token_takes_the_fused_kernel(m, k, d, hq, hk, dtype, fused_calls):
    x, w, pos, cache = _operands(m, k, d, hq, hk, dtype)
    out = ops.rope_linear(x, w, pos, cache, d, hq + hk)
    fused = ops.small_m_config(1, w.shape[0], k, dtype) is not None and m == 1
    assert fused_calls == ([1] if fused else []) and ops.rope_linear_uses_small_m(x, w, d) == fused
    _assert_within_bound(out, x, w, pos, cache, d, hq + hk)


@pytest.mark.cuda
def test_unfused_with_the_switch_off(monkeypatch, fused_calls):
    """The unfused pair: ``ops.linear``, then the rotary kernel, whose values are ``ops.rotary_embedding``'s."""
    x, w, pos, cache = _operands(1, 2048, 64, 32, 8)
    monkeypatch.setenv("DYNAMO_ONCE_SMALL_M_GEMM", "0")
    out = ops.rope_linear(x, w, pos, cache, 64, 40)
    h = ops.linear(x, w)
    q, k = ops.rotary_embedding(pos, h[:, :2048], h[:, 2048:2560], cache, 64)
    assert torch.equal(out, torch.cat((q, k, h[:, 2560:]), 1)) and fused_calls == []


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph(fused_calls):
    x, w, pos, cache = _operands(1, 2048, 64, 32, 8)
    expected = ops.rope_linear(x, w, pos, cache, 64, 40)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.rope_linear(x, w, pos, cache, 64, 40)
    pos.fill_(4321)
    graph.replay()
    torch.cuda.synchronize()
    _assert_within_bound(out, x, w, pos, cache, 64, 40)
    assert not torch.equal(out, expected) and fused_calls == [1, 1]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 5])
def test_cpu_is_the_reference_bit_for_bit(m, dtype, fused_calls):
    """The reference is ``F.linear`` then the rotary reference on q's and k's heads (the module's native form)."""
    x, w, pos, cache = _operands(m, 64, 16, 4, 2, dtype, device="cpu")
    out = ops.rope_linear(x, w, pos, cache, 16, 6)
    h = torch.nn.functional.linear(x, w)
    q, k = ops.rotary_embedding_native(pos, h[:, :64], h[:, 64:96], cache, 16)
    assert torch.equal(out, ops.rope_linear_ref(x, w, pos, cache, 16, 6))
    assert torch.equal(out, torch.cat((q, k, h[:, 96:]), 1))
    assert fused_calls == [] and not ops.rope_linear_uses_small_m(x, w, 16)


def test_opcheck():
    x, w, pos, cache = _operands(3, 32, 8, 2, 1, device="cpu")
    torch.library.opcheck(torch.ops.dynamo_once.rope_linear.default, (x, w, pos, cache, 8, 3))


_OK = dict(x=torch.zeros(2, 8, dtype=BF16), weight=torch.zeros(32, 8, dtype=BF16), positions=torch.zeros(2, dtype=torch.long),
           cos_sin_cache=torch.zeros(16, 8, dtype=BF16), head_size=8, rot_heads=3)


@pytest.mark.parametrize("change, exc, match", [
    (dict(x=torch.zeros(2, 8)), TypeError, "x and weight must both be bfloat16 or float16; got torch.float32"),
    (dict(weight=torch.zeros(4, 6, dtype=BF16)), ValueError, r"x must be \[M, K\] and weight \[N, K\]"),
    (dict(head_size=6), ValueError, "head_size must be even and divide N = 32"),
    (dict(rot_heads=5), ValueError, "rot_heads \\* head_size at most N; got head_size 8, rot_heads 5"),
    (dict(cos_sin_cache=torch.zeros(16, 4, dtype=BF16)), ValueError, r"\[max_position, head_size = 8\].*got \[16, 4\]"),
    (dict(positions=torch.zeros(2, 1, dtype=torch.long)), ValueError, r"positions must be 1-d int32 / int64"),
    (dict(positions=torch.zeros(3, dtype=torch.long)), RuntimeError, "positions must have one entry a row of x"),
])
def test_errors_name_the_argument(change, exc, match):
    with pytest.raises(exc, match=match):
        ops.rope_linear(**(_OK | change))
