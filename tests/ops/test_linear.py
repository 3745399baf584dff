"""``ops.linear``: on the GPU, the small-M Triton GEMM at decode sizes where the table has a config (Llama 3 1B and
8B shapes, within the bf16 GEMM bound), ``F.linear`` bit for bit above the bf16 range (``triton_max_m``), with the
switch off and for
a strided input, and the same replayed from a CUDA graph; on any machine, ``F.linear`` bit for bit, the fake
kernel (opcheck) and errors that name the argument.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from ops_testing import spy_on_rows
from test_small_m_gemm import _assert_mm_within_bound

import ops
from ops.small_m_gemm import triton_max_m

linear_module = importlib.import_module("ops.linear")
BF16, FP16 = torch.bfloat16, torch.float16
# (K, N): Llama 3.2 1B's qkv, o, gate_up, down; the 8B's qkv, o, gate_up, down.
SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (4096, 6144), (4096, 4096), (4096, 28672),
          (14336, 4096)]
SHAPE_IDS = [f"{k}to{n}" for k, n in SHAPES]


def _operands(m, k, n, dtype=BF16, device="cuda", bias=False, seed=0):
    g = torch.Generator(device=device).manual_seed(seed + m + n)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g, device=device).to(dtype) if bias else None
    return x, w, b


@pytest.fixture
def triton_calls(monkeypatch):
    """The M of every call ``ops.linear`` makes to the small-M launcher."""
    return spy_on_rows(monkeypatch, linear_module, "small_m_mm")


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("m", [1, 2, 7, 16, 17, 32])
def test_decode_sizes_take_the_table(m, k, n, triton_calls):
    """Where the table has a config the kernel runs, within the bf16 GEMM bound; elsewhere cuBLAS, bit for bit. From
    M = 17 (the swapped dot tiles, up to bf16's range) every 8B shape takes the kernel."""
    x, w, _ = _operands(m, k, n)
    out = ops.linear(x, w)
    config = ops.small_m_config(m, n, k, BF16, max_m=triton_max_m(BF16))
    assert config is not None or m <= 16 or n < 4096
    if config is None:
        assert triton_calls == [] and torch.equal(out, F.linear(x, w))
    else:
        assert triton_calls == [m]
        _assert_mm_within_bound(out, x, w, None)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_bias_and_fp16(dtype, triton_calls):
    x, w, b = _operands(4, 2048, 2048, dtype, bias=True)
    out = ops.linear(x, w, b)
    assert triton_calls == [4] and out.dtype == dtype
    _assert_mm_within_bound(out, x, w, b)


@pytest.mark.cuda
def test_cublas_above_small_m_switched_off_and_for_strided_rows(monkeypatch, triton_calls):
    x, w, _ = _operands(triton_max_m(BF16) + 1, 4096, 4096)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))
    wide = torch.randn(4, 8192, device="cuda").to(BF16)[:, ::2]  # column stride 2
    assert torch.equal(ops.linear(wide, w), F.linear(wide, w))
    monkeypatch.setenv("DYNAMO_ONCE_SMALL_M_GEMM", "0")
    x, w, _ = _operands(1, 2048, 2048)
    assert torch.equal(ops.linear(x, w), F.linear(x, w))
    assert triton_calls == []


@pytest.mark.cuda
def test_replayed_from_a_cuda_graph(triton_calls):
    x, w, _ = _operands(2, 2048, 2048)  # o_proj's shape: the kernel's (qkv's is cuBLAS's)
    expected = ops.linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear(x, w)
    x.copy_(_operands(2, 2048, 2048, seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    _assert_mm_within_bound(out, x, w, None)
    assert not torch.equal(out, expected) and triton_calls == [2, 2]


@pytest.mark.cuda
@pytest.mark.parametrize("m,k,n", [(64, 14336, 4096), (48, 4096, 4096), (128, 14336, 4096)])
def test_descriptor_rows_replayed_from_a_cuda_graph(m, k, n, triton_calls):
    """The 8B's down_proj (33-128 tokens) and o_proj (33-64) rows read their tiles through tensor descriptors, whose
    addresses a capture keeps: replayed on a new input copied into the captured one, the new input's result."""
    x, w, _ = _operands(m, k, n)
    assert ops.small_m_config(m, n, k, BF16, max_m=triton_max_m(BF16)).TMA
    ops.linear(x, w)  # the first call compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.linear(x, w)
    x.copy_(_operands(m, k, n, seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    _assert_mm_within_bound(out, x, w, None)
    assert triton_calls == [m, m]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_cpu_is_f_linear_bit_for_bit(dtype, bias, triton_calls):
    x, w, b = _operands(5, 64, 48, dtype, device="cpu", bias=bias)
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))
    assert triton_calls == [] and not ops.linear_uses_small_m(x, w)


def test_opcheck():
    x, w, b = _operands(3, 32, 16, device="cpu", bias=True)
    torch.library.opcheck(torch.ops.dynamo_once.linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.dynamo_once.linear.default, (x, w, None))


@pytest.mark.parametrize("change, exc, match", [
    (dict(x=torch.zeros(2, 8)), TypeError, "x and weight must both be bfloat16 or float16; got torch.float32"),
    (dict(weight=torch.zeros(4, 8, dtype=FP16)), TypeError, "got torch.bfloat16 and torch.float16"),
    (dict(x=torch.zeros(2, 3, 8, dtype=BF16)), ValueError, r"x must be \[M, K\] and weight \[N, K\]; got \[2, 3, 8\]"),
    (dict(weight=torch.zeros(4, 6, dtype=BF16)), ValueError, r"got \[2, 8\] and \[4, 6\]"),
    (dict(bias=torch.zeros(3, dtype=BF16)), ValueError, r"bias must be \[N\] = \[4\] in torch.bfloat16; got \[3\]"),
    (dict(bias=torch.zeros(4)), ValueError, r"got \[4\] in torch.float32"),
])
def test_errors_name_the_argument(change, exc, match):
    args = dict(x=torch.zeros(2, 8, dtype=BF16), weight=torch.zeros(4, 8, dtype=BF16), bias=None) | change
    with pytest.raises(exc, match=match):
        ops.linear(**args)


def test_errors_above_small_m_too():
    """The op's body takes F.linear at once above the kernel's range; the public call still checks its arguments."""
    with pytest.raises(TypeError, match="x and weight must both be bfloat16 or float16; got torch.float32"):
        ops.linear(torch.zeros(triton_max_m(BF16) + 1, 8), torch.zeros(4, 8, dtype=BF16))
