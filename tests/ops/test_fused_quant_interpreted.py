"""The fused norm + quant and activation + quant kernels, run on CPU tensors in Triton's interpreter.

Two comparisons, bit for bit (the interpreter's own fp8 conversion, which is not the GPU's, is applied to the
expected quotients, as test_kernels_interpreted.py does; int8 needs nothing of the kind):

- against the unfused kernels (``rms_norm``'s / ``silu_and_mul``'s, then the quant) on random inputs: the same
  numpy operations on the same tiles, so every dtype, including bf16, whose conversion the interpreter
  truncates instead of rounding to nearest even;
- against the references (the definition) on inputs with exact sums of squares, in fp32 and fp16 (whose
  conversions the interpreter rounds as torch does).
"""

import importlib

import pytest
import torch
from test_fused_quant import ACTS, EPS, QUANT_DTYPES, Q_IDS, STATIC_SCALE, TIES, dyadic, randn
from test_kernels_interpreted import _interpreter_fp8

import ops

pytestmark = [pytest.mark.interpret,
              # NumPy's exp overflows to inf inside tanh-GELU's formula for large inputs: the result is right.
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]

rms = importlib.import_module("ops.rms_norm")
act_mod = importlib.import_module("ops.silu_and_mul")
norm_quant = importlib.import_module("ops.norm_quant")
act_quant = importlib.import_module("ops.act_quant")

# (tokens, width): one token, a few, a width with no 16-byte vectors, a power of two, a wide row.
SHAPES = [(1, 8), (7, 769), (16, 1024), (3, 5120)]
DTYPES = [torch.float32, torch.bfloat16]
IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
KINDS = [(False, False), (False, True), (True, False), (True, True)]  # (residual, dynamic)
KIND_IDS = ["static", "dynamic", "add-static", "add-dynamic"]


def interpreted_quant(y, scale, quant_dtype):
    """``(q, scale or None)``: the quant references of ``y`` (per token when ``scale`` is None), the fp8 codes
    from the interpreter's conversion of the references' saturated fp32 quotients."""
    if quant_dtype == torch.int8:
        if scale is None:
            return ops.dynamic_scaled_int8_quant_ref(y)
        return ops.static_scaled_int8_quant_ref(y, scale), None
    s = ops.dynamic_per_token_scaled_fp8_quant_ref(y)[1] if scale is None else scale
    return _interpreter_fp8((y.float() / s).clamp(-448.0, 448.0)), (s if scale is None else None)


def assert_same(actual, expected):
    for a, e in zip(actual, expected, strict=True):
        assert (a is None) == (e is None)
        if e is not None:
            assert a.dtype == e.dtype and a.shape == e.shape
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               e.view(torch.uint8) if e.element_size() == 1 else e)


def norm_args(t, n, dtype, residual, dynamic, exact=False, seed=0):
    make = (lambda s: dyadic((t, n), dtype, "cpu", k=8, seed=s)) if exact else \
        (lambda s: randn((t, n), dtype, "cpu", seed=s))
    x, r = make(seed), make(seed + 1) if residual else None
    w = (1 + 0.1 * randn((n,), torch.float32, "cpu", seed=seed + 2)).to(dtype)
    return x, r, w, None if dynamic else torch.tensor([STATIC_SCALE])


def unfused_norm(x, r, w, scale, quant_dtype, gemma, config=None):
    """rms_norm's kernel (interpreted), then the quant: ``(q, scale or None, residual or None)``."""
    normed, res = rms._launch_rms_norm(x, r, w, EPS, gemma, config)
    return (*interpreted_quant(normed, scale, quant_dtype), res)


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("residual,dynamic", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("t,n", SHAPES)
def test_norm_quant_kernel_is_the_unfused_kernels(t, n, dtype, residual, dynamic, quant_dtype, gemma):
    x, r, w, scale = norm_args(t, n, dtype, residual, dynamic)
    out = norm_quant._launch_rms_norm_quant(x, r, w, EPS, scale, quant_dtype, gemma)
    assert_same(out, unfused_norm(x, r, w, scale, quant_dtype, gemma))


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("residual,dynamic", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=IDS.get)
@pytest.mark.parametrize("t,n", SHAPES)
def test_norm_quant_kernel_is_the_reference(t, n, dtype, residual, dynamic, quant_dtype):
    """Exact sums of squares: the reference's normed row, rounded to the model dtype, then its quant."""
    x, r, w, scale = norm_args(t, n, dtype, residual, dynamic, exact=True)
    for gemma in (False, True):
        if residual:
            normed, res = ops.fused_add_rms_norm_ref(x, r, w, EPS, gemma=gemma)
        else:
            normed, res = ops.rms_norm_ref(x, w, EPS, gemma=gemma), None
        out = norm_quant._launch_rms_norm_quant(x, r, w, EPS, scale, quant_dtype, gemma)
        assert_same(out, (*interpreted_quant(normed, scale, quant_dtype), res))
        if quant_dtype == torch.int8:  # the op's own reference, to the bit
            name = ("fused_add_" if residual else "") + ("rms_norm_dynamic_quant" if dynamic else "rms_norm_static_quant")
            args = [x] + ([r] if residual else []) + [w, EPS] + ([] if dynamic else [scale]) + [quant_dtype, gemma]
            ref = getattr(ops, name + "_ref")(*args)
            ref = ref if isinstance(ref, tuple) else (ref,)
            assert_same([o for o in out if o is not None], ref)


@pytest.mark.parametrize("config", [(1024, 4, 4), (2048, 1, 8), (1024, 16, 8)], ids=str)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
def test_norm_quant_configs_and_strided_rows(config, quant_dtype):
    """Several rows a program, a partial last program, rows (x and residual) that are slices of wider rows."""
    wide = randn((10, 1500), torch.bfloat16, "cpu")
    wide_r = randn((10, 1500), torch.bfloat16, "cpu", seed=1)
    x, r, w = wide[:, :1000], wide_r[:, :1000], randn((1000,), torch.bfloat16, "cpu", seed=2)
    for residual, dynamic in KINDS:
        rr, scale = (r if residual else None), (None if dynamic else torch.tensor([STATIC_SCALE]))
        out = norm_quant._launch_rms_norm_quant(x, rr, w, EPS, scale, quant_dtype, False, config)
        assert_same(out, unfused_norm(x.contiguous(), None if rr is None else rr.contiguous(), w, scale,
                                      quant_dtype, False, config))


@pytest.mark.parametrize("n_rows", [5, 40])
@pytest.mark.parametrize("col_split", [2, 4, 8])
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
def test_norm_quant_column_split_is_bit_for_bit_one_program_a_row(n_rows, col_split, quant_dtype):
    """Static scale, the columns of a row block split over programs (a few tokens spread over SMs): the same
    values as one program a row, for partial slices (a width not a multiple of the split) and strided rows."""
    wide = randn((n_rows, 2500), torch.bfloat16, "cpu")
    x, r = wide[:, :2049], randn((n_rows, 2049), torch.bfloat16, "cpu", seed=1)
    w, scale = randn((2049,), torch.bfloat16, "cpu", seed=2), torch.tensor([STATIC_SCALE])
    for rr in (None, r):
        for gemma in (False, True):
            one = norm_quant._launch_rms_norm_quant(x, rr, w, EPS, scale, quant_dtype, gemma, (4096, 2, 8),
                                                    col_split=1)
            split = norm_quant._launch_rms_norm_quant(x, rr, w, EPS, scale, quant_dtype, gemma, (4096, 2, 8),
                                                      col_split=col_split)
            assert_same(split, one)
    with pytest.raises(ValueError, match="col_split"):
        norm_quant._launch_rms_norm_quant(x, None, w, EPS, None, quant_dtype, False, col_split=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_zero_rows_and_int8_ties(dtype):
    """All-zero rows: the min scale, zeros. Ties (x = 1, eps = 0: the normed row is the weight, k + 0.5 exactly;
    per token with 127 in the row, scale 1): to the even neighbour, saturated beyond the range."""
    x = randn((6, 769), dtype, "cpu")
    x[[1, 4]] = 0
    for quant_dtype, min_scale in ((torch.int8, ops.INT8_MIN_SCALE), (ops.FP8_DTYPE, ops.MIN_SCALE)):
        q, s, _ = norm_quant._launch_rms_norm_quant(x, None, torch.ones(769, dtype=dtype), EPS, None, quant_dtype, False)
        assert s[1].item() == s[4].item() == min_scale and (q[[1, 4]].float() == 0).all()
    ones, w = torch.ones(2, len(TIES)), TIES.clone()
    q, _, _ = norm_quant._launch_rms_norm_quant(ones, None, w, 0.0, torch.tensor([1.0]), torch.int8, False)
    assert torch.equal(q, torch.round(TIES).clamp(-128, 127).to(torch.int8).expand(2, -1))
    row = torch.cat([TIES[3:-3], torch.tensor([127.0])])
    q, s, _ = norm_quant._launch_rms_norm_quant(torch.ones(1, len(row)), None, row, 0.0, None, torch.int8, False)
    assert s.item() == 1.0 and torch.equal(q[0], torch.round(row).to(torch.int8))


def unfused_act(x, scale, act, quant_dtype):
    return interpreted_quant(act_mod.launch_act_and_mul(x, act_quant.ACTIVATIONS[act]), scale, quant_dtype)


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("t,d", SHAPES)
def test_act_quant_kernel_is_the_unfused_kernels(t, d, dtype, act, dynamic, quant_dtype):
    x = randn((t, 2 * d), dtype, "cpu", scale=3.0)
    scale = None if dynamic else torch.tensor([STATIC_SCALE])
    assert_same(act_quant._launch_act_and_mul_quant(x, scale, act, quant_dtype), unfused_act(x, scale, act, quant_dtype))


# (BLOCK_D, ROWS, num_warps): static tiles (several column blocks a row, several rows a program), and per token
# (a row in one block) one and several rows a program; 37 rows of 768 outputs: a partial last program.
ACT_CONFIGS = [(False, (64, 1, 2)), (False, (128, 4, 4)), (False, (256, 16, 8)), (False, (512, 2, 4)),
               (True, (1024, 1, 4)), (True, (1024, 4, 8))]


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("dynamic,config", ACT_CONFIGS, ids=str)
def test_act_quant_configs_and_strided_rows(dynamic, config, quant_dtype):
    wide = randn((37, 2 * 768 + 40), torch.bfloat16, "cpu", scale=3.0)
    x = wide[:, : 2 * 768]  # rows a slice of wider rows, read in place
    scale = None if dynamic else torch.tensor([STATIC_SCALE])
    out = act_quant._launch_act_and_mul_quant(x, scale, "gelu_tanh", quant_dtype, config)
    assert_same(out, unfused_act(x.contiguous(), scale, "gelu_tanh", quant_dtype))


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
def test_act_quant_wide_rows(quant_dtype):
    """Per token, rows wider than ONE_PASS_MAX run the unfused kernels; forced, the fused one agrees."""
    d = act_quant.ONE_PASS_MAX + 8
    x = randn((2, 2 * d), torch.bfloat16, "cpu", scale=3.0)
    expected = unfused_act(x, None, "silu", quant_dtype)
    assert_same(act_quant._launch_act_and_mul_quant(x, None, "silu", quant_dtype), expected)
    assert_same(act_quant._launch_act_and_mul_quant(x, None, "silu", quant_dtype, (32768, 1, 16)), expected)


def test_act_quant_zero_rows_and_int8_ties():
    """silu(32) = gelu(32) = 32 exactly, so 32 * (t / 32) = t: the ties, static scale 1."""
    x = randn((4, 2 * 96), torch.float32, "cpu")
    x[2] = 0
    q, s = act_quant._launch_act_and_mul_quant(x, None, "silu", torch.int8)
    assert s[2].item() == ops.INT8_MIN_SCALE and (q[2] == 0).all()
    x = torch.cat([torch.full((2, len(TIES)), 32.0), (TIES / 32).expand(2, -1)], dim=-1)
    for act in ACTS:
        q, _ = act_quant._launch_act_and_mul_quant(x, torch.tensor([1.0]), act, torch.int8)
        assert torch.equal(q, torch.round(TIES).clamp(-128, 127).to(torch.int8).expand(2, -1))
