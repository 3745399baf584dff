"""The small-M GEMM's kernels in Triton's interpreter, on CPU tensors, against ops.scaled_mm's references.

int8 bit for bit; fp8 and bf16 within the bound of their fp32 accumulation (``_tolerance``). Cases: M of 1, 3
and 16 (GEMV rows, masked tile rows, a full tile) with awkward sizes (K = 48, N = 80: multiples of 16 but of no
block; K = 208: of no BLOCK_K >= 32), every scale layout, bias on and off, every output dtype, every row of the
config table, split K (with empty splits), M over several row blocks, strided rows. The GPU's own paths (the
public ops, CUDA graphs, the switch) are tests/ops/test_small_m_gemm.py's. Run with
``TRITON_INTERPRET=1 pytest -m interpret`` (``make test`` does); elsewhere these are skipped.
"""

import dataclasses

import pytest
import torch

import ops
from ops.small_m_gemm import SMALL_M_TABLE, SmallMConfig, tma_operands

# bf16 dots: see conftest.py's fixture
pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("bf16_dot_in_the_interpreter")]

FP8, INT8, BF16 = torch.float8_e4m3fn, torch.int8, torch.bfloat16
OUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OUT_IDS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# (a_scale, w_scale): per tensor [1] / per token [M, 1]; per tensor [1] / per channel [N].
SCALINGS = [("tensor", "tensor"), ("token", "tensor"), ("tensor", "channel"), ("token", "channel")]
SHAPES = [(1, 48, 80), (3, 208, 48), (16, 48, 80)]  # (M, K, N)
TABLE_CONFIGS = list(dict.fromkeys(rule.config for rule in SMALL_M_TABLE if rule.config is not None))
# The swapped product (w @ a.T), with and without split K, beside the table's rows
SWAP_CONFIGS = [SmallMConfig(32, 64, 64, SWAP=True), SmallMConfig(16, 64, 32, SPLIT_K=2, SWAP=True)]
# The unrolled GEMV (K a compile-time constant): K = 208 ends in a partial step of 16 (or 80) at either block
# and over 2, 4 and 8 rows of a a program (M = 5: two 4-row blocks, the second masked past its first row; one 8-row);
# with weight tiles loaded before the others (PRELOAD): two of four steps, and more than there are (all, the partial
# last step's masked tile among them)
UNROLL_CONFIGS = [SmallMConfig(1, 4, 64, DOT=False, UNROLL=True), SmallMConfig(1, 16, 128, DOT=False, UNROLL=True),
                  SmallMConfig(2, 8, 64, DOT=False, UNROLL=True), SmallMConfig(4, 4, 128, DOT=False, UNROLL=True),
                  SmallMConfig(8, 16, 64, DOT=False, UNROLL=True),
                  SmallMConfig(1, 4, 64, DOT=False, UNROLL=True, PRELOAD=2),
                  SmallMConfig(1, 16, 128, DOT=False, UNROLL=True, PRELOAD=8),
                  SmallMConfig(2, 8, 64, DOT=False, UNROLL=True, PRELOAD=3)]

# Tiles read through tensor descriptors (TMA): unswapped, swapped, split K summed by a second kernel and in the
# kernel; on the awkward shapes the descriptors zero-fill the rows and K past the operands
TMA_CONFIGS = [SmallMConfig(16, 32, 64, TMA=True), SmallMConfig(32, 64, 64, SWAP=True, TMA=True),
               SmallMConfig(16, 16, 64, SPLIT_K=3, TMA=True), SmallMConfig(16, 64, 32, SPLIT_K=2, SERIAL=True,
                                                                           SWAP=True, TMA=True)]

U32 = 2.0**-24  # fp32 unit roundoff
# What the cast to the output dtype moves a value by, at most, relative to it. bf16: the interpreter converts
# fp32 -> bf16 by truncation (Triton 3.6), less than one ulp (2**-7); fp16 and fp32 round to nearest (numpy).
U_OUT = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-11, torch.float32: U32}


def _operands(dtype, m, k, n, a_scaling="tensor", w_scaling="tensor", out_dtype=BF16, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == INT8:
        a = torch.randint(-128, 128, (m, k), generator=g).to(INT8)
        w = torch.randint(-128, 128, (n, k), generator=g).to(INT8)
    else:  # fp8: values across e4m3's range (none past 448); bf16: its own
        s = 8.0 if dtype == FP8 else 1.0
        a = (s * torch.randn(m, k, generator=g)).clamp(-448, 448).to(dtype)
        w = (s * torch.randn(n, k, generator=g)).clamp(-448, 448).to(dtype)
    unit = 0.01 if dtype == INT8 else 1.0  # int8: amax / 127 of O(1) values, so fp16 outputs stay finite
    a_scale = unit * (0.01 + torch.rand(*((m, 1) if a_scaling == "token" else (1,)), generator=g))
    w_scale = unit * (0.01 + torch.rand(n if w_scaling == "channel" else 1, generator=g))
    b = torch.randn(n, generator=g).to(out_dtype) if bias else None
    return a, w, a_scale, w_scale, out_dtype, b


def _interpreter_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``y`` converted to ``dtype`` by the interpreter's own ``.to`` (bf16: truncation, not the GPU's
    rounding), so that a kernel's bf16 output can be compared bit for bit with everything before its cast."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(y_ptr, q_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(q_ptr + offs, tl.load(y_ptr + offs, mask=mask).to(q_ptr.dtype.element_ty), mask=mask)

    y = y.float().contiguous()
    q = torch.empty(y.shape, dtype=dtype)
    convert[(triton.cdiv(y.numel(), 1024),)](y, q, y.numel(), BLOCK=1024)
    return q


def _assert_int8_exact(out, a, w, a_scale, w_scale, out_dtype, bias):
    """Bit for bit the reference; a bf16 output against the interpreter's cast of the reference's fp32 result (the
    same value: ``out + bias.float()`` in fp32 either way)."""
    assert out.dtype == out_dtype and out.shape == (a.shape[0], w.shape[0]) and out.is_contiguous()
    if out_dtype == torch.bfloat16:
        fp32 = ops.int8_scaled_mm_ref(a, w, a_scale, w_scale, torch.float32, None if bias is None else bias.float())
        assert torch.equal(out, _interpreter_cast(fp32, out_dtype))
    else:
        assert torch.equal(out, ops.int8_scaled_mm_ref(a, w, a_scale, w_scale, out_dtype, bias))


def _tolerance(a, w, a_scale, w_scale, bias, out_dtype, exact):
    """The bound of an fp32 accumulation of exact products, elementwise.

    With S = |a_scale w_scale| sum_k |a_k w_k| + |bias|: every product of two e4m3 (4-bit significands) or two bf16
    (8-bit) values is exact in fp32 (<= 16 bits), so an fp32 sum of the K products, in any order (the kernel's
    blocks, tl.sum's tree, a split's partials), is within (K - 1) u of sum_k |a_k w_k| (u = 2**-24, to first order:
    K u << 1); the epilogue's two multiplies and the bias add add 3u S. So the fp32 result is within (K + 2) u S of
    the exact value e; one more u covers the second-order terms. The cast to the output dtype then moves it by at
    most U_OUT of its magnitude, <= |e| + (K + 3) u S; fp16's subnormals (below 2**-14) add 2**-25 absolute.
    """
    k = a.shape[1]
    s = (a.double().abs() @ w.double().abs().t()) * (a_scale.double() * w_scale.double()).abs()
    if bias is not None:
        s = s + bias.double().abs()
    fp32 = (k + 3) * U32 * s
    return fp32 + U_OUT[out_dtype] * (exact.abs() + fp32) + 2.0**-25


def _assert_within_bound(out, a, w, a_scale, w_scale, out_dtype, bias):
    assert out.dtype == out_dtype and out.shape == (a.shape[0], w.shape[0]) and out.is_contiguous()
    exact = (a.double() @ w.double().t()) * a_scale.double() * w_scale.double()
    exact = exact + bias.double() if bias is not None else exact
    err = (out.double() - exact).abs()
    tol = _tolerance(a, w, a_scale, w_scale, bias, out_dtype, exact)
    assert (err <= tol).all(), f"max err / tol = {(err / tol).max().item():.3g}"


def _scaled_cases(dtype):
    return [pytest.param(m, k, n, a_s, w_s, od, bias,
                         id=f"{m}x{k}x{n}-{a_s}-{w_s}-{OUT_IDS[od]}-{'bias' if bias else 'nobias'}")
            for m, k, n in SHAPES for a_s, w_s in SCALINGS for od in OUT_DTYPES for bias in (False, True)]


@pytest.mark.parametrize("m,k,n,a_scaling,w_scaling,out_dtype,bias", _scaled_cases(INT8))
def test_int8_is_the_reference_bit_for_bit(m, k, n, a_scaling, w_scaling, out_dtype, bias):
    args = _operands(INT8, m, k, n, a_scaling, w_scaling, out_dtype, bias)
    _assert_int8_exact(ops.small_m_scaled_mm(*args), *args)


@pytest.mark.parametrize("m,k,n,a_scaling,w_scaling,out_dtype,bias", _scaled_cases(FP8))
def test_fp8_within_the_fp32_accumulation_bound(m, k, n, a_scaling, w_scaling, out_dtype, bias):
    args = _operands(FP8, m, k, n, a_scaling, w_scaling, out_dtype, bias)
    _assert_within_bound(ops.small_m_scaled_mm(*args), *args)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_mm_within_the_fp32_accumulation_bound(m, k, n, bias, dtype):
    a, w, _, _, _, b = _operands(dtype, m, k, n, out_dtype=dtype, bias=bias)
    one = torch.ones(1)
    _assert_within_bound(ops.small_m_mm(a, w, b), a, w, one, one, dtype, b)


@pytest.mark.parametrize("dtype", [INT8, FP8, BF16], ids=["int8", "fp8", "bf16"])
@pytest.mark.parametrize("config", list(dict.fromkeys(TABLE_CONFIGS + SWAP_CONFIGS + UNROLL_CONFIGS + TMA_CONFIGS)),
                         ids=str)
def test_every_table_config(config, dtype):
    """Each row on a small awkward shape, whatever dtype its row serves: the kernel is one for all three. M = 5
    spans two row blocks of the 4-row GEMV configs and five of the 1-row ones."""
    a, w, a_scale, w_scale, out_dtype, b = _operands(dtype, 5, 208, 80, "token", "channel", torch.float32, True)
    if dtype == BF16:
        _assert_within_bound(ops.small_m_mm(a, w, b.to(BF16), config=config), a, w, torch.ones(1), torch.ones(1),
                             BF16, b.to(BF16))
    elif dtype == INT8:
        _assert_int8_exact(ops.small_m_scaled_mm(a, w, a_scale, w_scale, out_dtype, b, config), a, w, a_scale,
                           w_scale, out_dtype, b)
    else:
        _assert_within_bound(ops.small_m_scaled_mm(a, w, a_scale, w_scale, out_dtype, b, config), a, w, a_scale,
                             w_scale, out_dtype, b)


# Split K, GEMV and dot forms: 208 = 2 x 104 (a split of two 64-steps, the second masked); K = 48 in three splits
# of one 64-step (two of them past K: empty, their partials zero); 4 splits of 1024 that tile K = 4096 exactly.
SPLITS = [
    (3, 208, 80, SmallMConfig(1, 16, 64, SPLIT_K=2, DOT=False)),
    (3, 48, 80, SmallMConfig(4, 16, 64, SPLIT_K=3, DOT=False)),
    (16, 208, 48, SmallMConfig(16, 16, 64, SPLIT_K=2)),
    (7, 4096, 32, SmallMConfig(16, 32, 1024, SPLIT_K=4)),
]


@pytest.mark.parametrize("serial", [False, True], ids=["epilogue-kernel", "serial"])
@pytest.mark.parametrize("dtype", [INT8, FP8, BF16], ids=["int8", "fp8", "bf16"])
@pytest.mark.parametrize("m,k,n,config", SPLITS, ids=[f"{s[0]}x{s[1]}x{s[2]}-split{s[3].SPLIT_K}" for s in SPLITS])
def test_split_k(m, k, n, config, dtype, serial):
    """The partials summed in split order (by a second kernel, or SERIAL: by each tile's last split), then the same
    epilogue: int8 still bit for bit; called again (the arrival counters reset themselves), the same results."""
    config = dataclasses.replace(config, SERIAL=serial)
    a, w, a_scale, w_scale, _, b = _operands(dtype, m, k, n, "token", "channel", torch.float16, True, seed=1)
    for _ in range(2):
        if dtype == BF16:
            one = torch.ones(1)
            _assert_within_bound(ops.small_m_mm(a, w, b.to(BF16), config), a, w, one, one, BF16, b.to(BF16))
        elif dtype == INT8:
            out = ops.small_m_scaled_mm(a, w, a_scale, w_scale, torch.float16, b, config)
            _assert_int8_exact(out, a, w, a_scale, w_scale, torch.float16, b)
        else:
            out = ops.small_m_scaled_mm(a, w, a_scale, w_scale, torch.float16, b, config)
            _assert_within_bound(out, a, w, a_scale, w_scale, torch.float16, b)


def test_int8_large_accumulators_round_once_to_fp32():
    """Sums past 2**24 (where not every integer is an fp32): one rounding of the exact int32, as the reference."""
    k = 4096
    a = torch.full((3, k), 127, dtype=INT8)
    w = torch.randint(100, 128, (16, k), generator=torch.Generator().manual_seed(1)).to(INT8)
    one = torch.ones(1)
    for config in (None, SmallMConfig(16, 16, 512, SPLIT_K=2)):
        out = ops.small_m_scaled_mm(a, w, one, one, torch.float32, config=config)
        exact = a.long() @ w.long().t()
        assert (exact > 2**24).all() and torch.equal(out, exact.float())


def test_rows_past_the_table_and_strided_rows():
    """M = 20 over two 16-row dot tiles (the default beyond a row's M: the table's largest-M row) and a slice of a
    wider buffer as ``a`` (rows strided, read in place)."""
    a, w, a_scale, w_scale, out_dtype, b = _operands(INT8, 20, 48, 80, "token", "channel", torch.float32, True)
    wide = torch.zeros(20, 48 + 16, dtype=INT8)
    wide[:, :48] = a
    strided = wide[:, :48]
    assert strided.stride(0) == 64
    for config in (None, SmallMConfig(16, 32, 64)):
        _assert_int8_exact(ops.small_m_scaled_mm(strided, w, a_scale, w_scale, out_dtype, b, config), a, w,
                           a_scale, w_scale, out_dtype, b)


@pytest.mark.parametrize("config", TMA_CONFIGS[:2], ids=str)
def test_tma_tiles_fall_back_to_pointer_loads(config):
    """Operands no descriptor can take (``a``'s rows 50 bytes apart: not a multiple of 16) run the same tile with
    pointer loads: the same exact int8 result; the gated form, whose tiles mask the up rows, never takes them."""
    a, w, a_scale, w_scale, out_dtype, b = _operands(INT8, 5, 48, 80, "token", "channel", torch.float32, True)
    wide = torch.zeros(5, 50, dtype=INT8)
    wide[:, :48] = a
    strided = wide[:, :48]
    assert tma_operands(strided, w, config) == (None, None)
    assert all(d is not None for d in tma_operands(a, w, config))
    assert tma_operands(a, w, config, gated=True) == (None, None)
    _assert_int8_exact(ops.small_m_scaled_mm(strided, w, a_scale, w_scale, out_dtype, b, config), a, w, a_scale,
                       w_scale, out_dtype, b)

