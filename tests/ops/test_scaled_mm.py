"""The W8A8 GEMMs: references against independent fp64 / int64 computations, the CUDA paths against the references
(int8 bit for bit, fp8 within a bound derived from the accumulation), argument checks, and compiled use at
every level that matters: torch.compile with a symbolic token count, and the dispatcher's level 3."""

import pytest
import torch
from ops_testing import DEVICES

from torch._dynamo.backends.registry import lookup_backend

import ops
from dispatcher import CompilationConfig, compilation_counter, set_compilation_config, support_torch_compile

FP8, INT8 = ops.FP8_DTYPE, torch.int8
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OUT_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# (a_scale, w_scale) layouts: per tensor [1] / per token [M, 1]; per tensor [1] / per channel [N].
SCALINGS = [("tensor", "tensor"), ("token", "tensor"), ("tensor", "channel"), ("token", "channel")]
# (M, K, N): M around _int_mm's 16-row floor (padded below 17), 1 (decode), and a prefill-sized block.
CPU_SHAPES = [(1, 32, 16), (7, 64, 48), (17, 256, 32)]
CUDA_SHAPES = [(1, 4096, 1024), (7, 256, 48), (16, 1024, 512), (17, 768, 4096), (83, 4096, 4096)]

U32 = 2.0**-24  # fp32 unit roundoff
# Unit roundoff of each output dtype: a rounding to it moves a value by at most this much of it.
U_OUT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: U32}


def _operands(qdtype, m, k, n, a_scaling, w_scaling, out_dtype, bias, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if qdtype == FP8:  # values across e4m3's range, none above 448 (a conversion there gives NaN)
        a = (8 * torch.randn(m, k, generator=g)).clamp(-448, 448).to(FP8)
        w = (8 * torch.randn(n, k, generator=g)).clamp(-448, 448).to(FP8)
    else:
        a = torch.randint(-128, 128, (m, k), generator=g).to(INT8)
        w = torch.randint(-128, 128, (n, k), generator=g).to(INT8)
    # int8 scales as a quantization gives them (amax / 127 of O(1) values): outputs stay in fp16's range.
    unit = 0.01 if qdtype == INT8 else 1.0
    a_scale = unit * (0.01 + torch.rand(*((m, 1) if a_scaling == "token" else (1,)), generator=g))
    w_scale = unit * (0.01 + torch.rand(n if w_scaling == "channel" else 1, generator=g))
    b = torch.randn(n, generator=g).to(out_dtype) if bias else None
    return [t.to(device) if t is not None else None for t in (a, w, a_scale, w_scale)] + [out_dtype] + \
        [b.to(device) if b is not None else None]


def _gemm(qdtype):
    return (ops.fp8_scaled_mm, ops.fp8_scaled_mm_ref) if qdtype == FP8 else (ops.int8_scaled_mm, ops.int8_scaled_mm_ref)


def _cases(shapes, device_marks=()):
    out = []
    for qdtype, qid in ((FP8, "fp8"), (INT8, "int8")):
        for m, k, n in shapes:
            for a_s, w_s in SCALINGS:
                for od in OUT_DTYPES:
                    for bias in (False, True):
                        out.append(pytest.param(qdtype, m, k, n, a_s, w_s, od, bias, marks=device_marks,
                                                id=f"{qid}-{m}x{k}x{n}-{a_s}-{w_s}-{OUT_IDS[od]}-{'bias' if bias else 'nobias'}"))
    return out


def _bound(a, w, a_scale, w_scale, bias, k, acc_u):
    """|sa sw| * sum_k |a_k w_k| + |bias| (fp64, on the CPU), times the summation's relative error acc_u, plus
    the epilogue's 3 fp32 roundings (two multiplies and the bias add)."""
    s = (a.double().abs() @ w.double().abs().t()) * (a_scale.double() * w_scale.double()).abs()
    if bias is not None:
        s = s + bias.double().abs()
    return ((acc_u + 3 * U32) * s).cpu()


@pytest.mark.parametrize("qdtype,m,k,n,a_scaling,w_scaling,out_dtype,bias", _cases(CPU_SHAPES))
def test_references_against_independent_computations(qdtype, m, k, n, a_scaling, w_scaling, out_dtype, bias):
    a, w, a_scale, w_scale, od, b = _operands(qdtype, m, k, n, a_scaling, w_scaling, out_dtype, bias, "cpu")
    op, ref = _gemm(qdtype)
    out = ref(a, w, a_scale, w_scale, od, b)
    assert out.dtype == out_dtype and out.shape == (m, n) and out.is_contiguous()
    assert torch.equal(op(a, w, a_scale, w_scale, od, b), out)  # the CPU path is the reference
    if qdtype == INT8:
        # Exact integers (int64), one rounding to fp32, then the epilogue in its order: bit for bit.
        acc = (a.long() @ w.long().t()).float()
        expected = acc * a_scale * w_scale
        expected = (expected + b.float() if b is not None else expected).to(out_dtype)
        assert torch.equal(out, expected)
        return
    # fp8: products of e4m3 values are exact in fp32 and fp64 holds their sum exactly, so `exact` is exact up to
    # the fp64 epilogue. An fp32 sum of K terms in any order is within (K - 1) u of sum |terms| of it; the
    # output's rounding adds at most U_OUT of the value.
    exact = (a.double() @ w.double().t()) * a_scale.double() * w_scale.double()
    exact = exact + b.double() if b is not None else exact
    tol = _bound(a, w, a_scale, w_scale, b, k, (k - 1) * U32) + U_OUT[out_dtype] * exact.abs() + 1e-30
    assert ((out.double() - exact).abs() <= tol).all()


def test_int8_large_accumulators_round_once_to_fp32():
    """Sums beyond 2**24 (not every integer is an fp32): one rounding of the exact int, as the GPU converts int32."""
    k = 4096
    a = torch.full((3, k), 127, dtype=INT8)
    w = torch.randint(100, 128, (16, k), generator=torch.Generator().manual_seed(1)).to(INT8)
    one = torch.ones(1)
    out = ops.int8_scaled_mm(a, w, one, one, torch.float32)
    exact = a.long() @ w.long().t()
    assert (exact > 2**24).all() and torch.equal(out, exact.float())
    lowest = torch.full((1, k), -128, dtype=INT8)
    assert ops.int8_scaled_mm(lowest, lowest.expand(8, k), one, one, torch.float32).unique().item() == k * 2**14


@pytest.mark.parametrize("qdtype,m,k,n,a_scaling,w_scaling,out_dtype,bias",
                         _cases(CUDA_SHAPES, device_marks=pytest.mark.cuda))
def test_cuda_against_reference(qdtype, m, k, n, a_scaling, w_scaling, out_dtype, bias):
    args = _operands(qdtype, m, k, n, a_scaling, w_scaling, out_dtype, bias, "cuda")
    op, ref = _gemm(qdtype)
    out = op(*args)
    expected = ref(*args)
    assert out.dtype == out_dtype and out.shape == (m, n) and out.is_contiguous()
    if qdtype == INT8:
        # _int_mm's int32 sum is exact and the epilogue is the reference's, op for op: bit for bit, also with the
        # reference computed on the CPU (IEEE multiplies and adds round alike everywhere).
        assert torch.equal(out, expected)
        assert torch.equal(out.cpu(), ref(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in args]))
        return
    a, w, a_scale, w_scale, _, b = args
    # Tolerance, elementwise, from the accumulation:
    # - the reference sums exact products in fp32: within (K - 1) u of S = |sa sw| sum_k |a_k w_k| + |bias|, and
    #   its epilogue's three fp32 roundings add 3u S;
    # - the GPU: Hopper's fp8 tensor cores keep about 14 bits while accumulating inside an MMA (DeepSeek-V3
    #   technical report, 3.3.2); without fast accumulation cuBLAS adds the partial sums into fp32 at least every
    #   128 products, so the in-MMA error is below ~2**-11 of each chunk's sum of |terms|: bounded by 2**-10 S;
    #   the fp32 sum of the chunks and the epilogue add (K / 128 + 3) u S, below the reference's bound;
    # - both rounded to out_dtype: each moves by at most U_OUT of its value.
    tol = _bound(a, w, a_scale, w_scale, b, k, 2.0**-10 + 2 * (k - 1) * U32)
    tol = tol + U_OUT[out_dtype] * (2 * expected.double().abs().cpu() + tol)
    err = (out.double().cpu() - expected.double().cpu()).abs()
    assert (err <= tol).all(), f"max err / tol = {(err / tol).max().item():.3g}"
    # And on average far inside the bound: a systematic error (a scale applied twice, a row's scale on the wrong
    # row) moves the bulk of the outputs by much more than 1/64 of their RMS.
    assert (out.double() - expected.double()).pow(2).mean().sqrt() <= expected.double().pow(2).mean().sqrt() / 64


@pytest.mark.cuda
@pytest.mark.parametrize("m,k,n", [(17, 768, 4096), (128, 4096, 4096), (32, 14336, 4096)])
@pytest.mark.parametrize("a_scaling,w_scaling", [("tensor", "tensor"), ("token", "channel")])
def test_cuda_fp8_fast_accumulation_stays_within_its_bound(m, k, n, a_scaling, w_scaling, monkeypatch):
    """``DYNAMO_ONCE_FP8_FAST_ACCUM=1`` (cuBLAS's rows, M > 16): the tensor cores keep ~14 bits while summing and
    round at least once an MMA of 32 products, never promoting to fp32, so the sum is within K / 32 * 2**-14 of
    S = |sa sw| sum_k |a_k w_k| (worst case), plus the roundings ``test_cuda_against_reference`` allows."""
    monkeypatch.setenv("DYNAMO_ONCE_FP8_FAST_ACCUM", "1")
    args = _operands(FP8, m, k, n, a_scaling, w_scaling, torch.bfloat16, False, "cuda")
    out, expected = ops.fp8_scaled_mm(*args), ops.fp8_scaled_mm_ref(*args)
    a, w, a_scale, w_scale, _, _ = args
    tol = _bound(a, w, a_scale, w_scale, None, k, k / 32 * 2.0**-14 + 2 * (k - 1) * U32)
    tol = tol + U_OUT[torch.bfloat16] * (2 * expected.double().abs().cpu() + tol)
    err = (out.double().cpu() - expected.double().cpu()).abs()
    assert (err <= tol).all(), f"max err / tol = {(err / tol).max().item():.3g}"
    assert (out.double() - expected.double()).pow(2).mean().sqrt() <= expected.double().pow(2).mean().sqrt() / 64


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_leaves_its_inputs_unchanged(device):
    """Bit for bit (opcheck's schema test cannot compare fp8 tensors)."""
    args = _operands(FP8, 7, 64, 48, "token", "channel", torch.bfloat16, True, device)
    before = [t.view(torch.uint8).clone() if t.dtype == FP8 else t.clone() for t in args if isinstance(t, torch.Tensor)]
    ops.fp8_scaled_mm(*args)
    after = [t.view(torch.uint8) if t.dtype == FP8 else t for t in args if isinstance(t, torch.Tensor)]
    assert all(torch.equal(x, y) for x, y in zip(before, after))


def _fp8(*shape):
    return torch.zeros(*shape).to(FP8)


def _int8(*shape):
    return torch.zeros(*shape, dtype=INT8)


ONE = torch.ones(1)
BAD_ARGS = [
    # (op, args, exception, message)
    ("fp8", (_fp8(4, 32).float(), _fp8(16, 32), ONE, ONE, torch.bfloat16), TypeError,
     r"fp8_scaled_mm: a must be torch.float8_e4m3fn; got torch.float32"),
    ("int8", (_int8(4, 32), _fp8(16, 32), ONE, ONE, torch.bfloat16), TypeError,
     r"int8_scaled_mm: w must be torch.int8; got torch.float8_e4m3fn"),
    ("fp8", (_fp8(2, 4, 32), _fp8(16, 32), ONE, ONE, torch.bfloat16), ValueError,
     r"a must be 2-D \[M, K\]; got shape \[2, 4, 32\]"),
    ("fp8", (_fp8(4, 32), _fp8(32), ONE, ONE, torch.bfloat16), ValueError,
     r"w must be 2-D \[N, K\] \(nn.Linear's layout\); got shape \[32\]"),
    ("int8", (_int8(4, 32), _int8(32, 16), ONE, ONE, torch.bfloat16), ValueError,
     r"w must be \[N, K\] with a's K = 32; got w of shape \[32, 16\]"),
    ("fp8", (_fp8(4, 40), _fp8(16, 40), ONE, ONE, torch.bfloat16), ValueError,
     r"fp8_scaled_mm: K \(a.shape\[1\], w.shape\[1\]\) must be a multiple of 16; got 40"),
    ("fp8", (_fp8(4, 32), _fp8(24, 32), ONE, ONE, torch.bfloat16), ValueError,
     r"fp8_scaled_mm: N \(w.shape\[0\]\) must be a multiple of 16; got 24"),
    ("int8", (_int8(4, 12), _int8(16, 12), ONE, ONE, torch.bfloat16), ValueError,
     r"int8_scaled_mm: K .* must be a multiple of 8; got 12"),
    ("int8", (_int8(4, 32), _int8(16, 32), ONE.double(), ONE, torch.bfloat16), TypeError,
     r"a_scale must be float32; got torch.float64"),
    ("int8", (_int8(4, 32), _int8(16, 32), torch.ones(4), ONE, torch.bfloat16), ValueError,
     r"a_scale must be \[1\] \(per tensor\) or \[M, 1\] = \[4, 1\] \(per token\); got shape \[4\]"),
    ("fp8", (_fp8(4, 32), _fp8(16, 32), torch.ones(3, 1), ONE, torch.bfloat16), ValueError,
     r"a_scale must be .*; got shape \[3, 1\]"),
    ("fp8", (_fp8(4, 32), _fp8(16, 32), ONE, torch.ones(16, 1), torch.bfloat16), ValueError,
     r"w_scale must be \[1\] \(per tensor\) or \[N\] = \[16\] \(per channel\); got shape \[16, 1\]"),
    ("int8", (_int8(4, 32), _int8(16, 32), ONE, ONE, torch.int8), TypeError,
     r"out_dtype must be torch.bfloat16, torch.float16 or torch.float32; got torch.int8"),
    ("fp8", (_fp8(4, 32), _fp8(16, 32), ONE, ONE, torch.bfloat16, torch.zeros(16)), TypeError,
     r"bias must be in out_dtype torch.bfloat16; got torch.float32"),
    ("int8", (_int8(4, 32), _int8(16, 32), ONE, ONE, torch.float32, torch.zeros(8)), ValueError,
     r"bias must be \[N\] = \[16\]; got shape \[8\]"),
    ("fp8", (_fp8(4, 32), _fp8(16, 32), ONE, torch.ones(1, device="meta"), torch.bfloat16), ValueError,
     r"w_scale must be on a's device cpu; got meta"),
]


@pytest.mark.parametrize("which,args,exc,match", BAD_ARGS, ids=range(len(BAD_ARGS)))
def test_errors_name_the_argument(which, args, exc, match):
    op = ops.fp8_scaled_mm if which == "fp8" else ops.int8_scaled_mm
    with pytest.raises(exc, match=match):
        op(*args)
    # The fake implementation checks the same (torch.compile traces with fake tensors).
    with pytest.raises(Exception, match=match):
        torch.compile(op, backend="eager", fullgraph=True)(*args)


def test_int8_k_limit():
    k = ops.INT8_MM_MAX_K
    with pytest.raises(ValueError, match=rf"int8_scaled_mm: K \(a.shape\[1\]\) must be below {k}, so that the int32 "
                                         rf"accumulator cannot overflow; got {k}"):
        ops.int8_scaled_mm(_int8(1, k), _int8(8, k), ONE, ONE, torch.float32)


def _assert_same_gemm(out, expected, qdtype, device):
    """The same ops on the same inputs, compiled or not: bit for bit, except the fp8 GEMM on CUDA, where cuBLASLt
    may pick another kernel, summing in another order, for differently aligned buffers: then within an output
    ulp (2**-8 for bf16) plus an fp32 summation difference, which a later quantization may turn into one step."""
    if qdtype == FP8 and device == "cuda":
        torch.testing.assert_close(out, expected, rtol=2**-6, atol=2**-6 * expected.abs().max().item())
    else:
        assert torch.equal(out, expected)


def _w8a8(qdtype):
    """A W8A8 linear, quantizing its input per token: the GEMM op behind the quant op, one graph."""
    gemm = ops.fp8_scaled_mm if qdtype == FP8 else ops.int8_scaled_mm
    quant = ops.dynamic_per_token_scaled_fp8_quant if qdtype == FP8 else ops.dynamic_scaled_int8_quant

    def linear(x, w, w_scale, bias):
        q, a_scale = quant(x)
        return gemm(q, w, a_scale, w_scale, x.dtype, bias)

    return linear


def _weights(qdtype, n, k, device):
    g = torch.Generator().manual_seed(3)
    w = (8 * torch.randn(n, k, generator=g)).to(FP8) if qdtype == FP8 else \
        torch.randint(-127, 128, (n, k), generator=g).to(INT8)
    return w.to(device), (0.01 + torch.rand(n, generator=g)).to(device), torch.randn(n, generator=g).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qdtype", [FP8, INT8], ids=["fp8", "int8"])
def test_inductor_with_a_symbolic_token_count(device, qdtype):
    """One Inductor compile serves every token count: the GEMM sits in Inductor's graph as an extern call on
    fake tensors of symbolic M; results those of the eager ops (see _assert_same_gemm)."""
    w, w_scale, bias = _weights(qdtype, 48, 96, device)
    bias = bias.to(torch.bfloat16)
    linear = _w8a8(qdtype)
    graphs = []
    inductor = lookup_backend("inductor")

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inductor(gm, example_inputs)

    compiled = torch.compile(linear, backend=backend, fullgraph=True, dynamic=True)
    for m in (3, 17, 64):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(device)
        out = compiled(x, w, w_scale, bias)
        assert out.shape == (m, 48) and out.dtype == torch.bfloat16
        _assert_same_gemm(out, linear(x, w, w_scale, bias), qdtype, device)
    assert len(graphs) == 1
    gemm = "dynamo_once.fp8_scaled_mm" if qdtype == FP8 else "dynamo_once.int8_scaled_mm"
    assert any(gemm in str(n.target) for n in graphs[0].graph.nodes)


@support_torch_compile
class _W8A8MLP(torch.nn.Module):
    """Two W8A8 linears around an activation, quantizing through the CustomOp modules (switched per op)."""

    def __init__(self, qdtype, hidden, inner, device):
        super().__init__()
        self.qdtype = qdtype
        self.quant = ops.QuantFP8(per_token=True) if qdtype == FP8 else ops.QuantInt8()
        self.gemm = ops.fp8_scaled_mm if qdtype == FP8 else ops.int8_scaled_mm
        w1, s1, _ = _weights(qdtype, inner, hidden, device)
        w2, s2, b2 = _weights(qdtype, hidden, inner, device)
        for name, t in dict(w1=w1, s1=s1, w2=w2, s2=s2, b2=b2).items():
            self.register_buffer(name, t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = self.quant(x)
        h = torch.relu(self.gemm(q, self.w1, s, self.s1, torch.float32))  # h: [T, inner]
        q, s = self.quant(h)
        return self.gemm(q, self.w2, s, self.s2, torch.float32, self.b2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qdtype", [FP8, INT8], ids=["fp8", "int8"])
@pytest.mark.parametrize("custom_ops", [["all"], []], ids=["ops-on", "default-off"])
@torch.no_grad()
def test_level3(device, qdtype, custom_ops):
    """Level 3 (piecewise Inductor; no splitting op here, so one piece): the GEMMs inside the compiled piece.
    With the quant ops on, the eager result (see _assert_same_gemm); with the level's default (quant modules
    native and fused by Inductor, whose division may round a near-tie quotient the other way), close to it."""
    with set_compilation_config(CompilationConfig(level=3, use_cudagraph=False, custom_ops=custom_ops)):
        mlp = _W8A8MLP(qdtype, 64, 128, device)
    # One trace, one piece, one symbolic-size Inductor compile for every token count.
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=1, num_backend_compilations=1):
        for m in (5, 1, 33):  # the first call traces: a size >= 2 (Dynamo specializes 0 and 1)
            x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(device)
            out = mlp(x)
            expected = _eager_mlp(mlp, x)
            if custom_ops == ["all"]:
                _assert_same_gemm(out, expected, qdtype, device)
            else:
                torch.testing.assert_close(out, expected, rtol=0.02, atol=0.02 * expected.abs().max().item())


def _eager_mlp(mlp, x):
    quant = ops.dynamic_per_token_scaled_fp8_quant_ref if mlp.qdtype == FP8 else ops.dynamic_scaled_int8_quant_ref
    q, s = quant(x)
    h = torch.relu(mlp.gemm(q, mlp.w1, s, mlp.s1, torch.float32))
    q, s = quant(h)
    return mlp.gemm(q, mlp.w2, s, mlp.s2, torch.float32, mlp.b2)
