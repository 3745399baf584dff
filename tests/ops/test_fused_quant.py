"""Fused RMSNorm + quant and activation + quant (ops/norm_quant.py, ops/act_quant.py), compared bit for bit.

The references are the unfused references composed (the normed / activated tensor rounded to the model dtype,
then quantized). On CUDA the kernels must give what the unfused Triton ops give (``ops.rms_norm`` then the
quant), bit for bit: for the norm on inputs whose sums of squares are exact (``dyadic``: multiples of 1/8), so
that no reduction order can change the normed row; for the activation on any input (no reduction). Random
inputs are compared with the reference to within one quantization step. The kernels' interpreter tests are in
test_fused_quant_interpreted.py.
"""

import pytest
import torch
import torch._inductor.config
from ops_testing import DEVICES, DTYPE_IDS, HIDDEN, NUM_TOKENS, TOLERANCES, compile_params, compiled, grid_cases, \
    strided_rows

import ops

EPS = 1e-6
FP8 = ops.FP8_DTYPE
QUANT_DTYPES = [FP8, torch.int8]
Q_IDS = {FP8: "fp8", torch.int8: "int8"}
NORM_OPS = ["rms_norm_static_quant", "rms_norm_dynamic_quant", "fused_add_rms_norm_static_quant",
            "fused_add_rms_norm_dynamic_quant"]
ACT_OPS = ["act_and_mul_static_quant", "act_and_mul_dynamic_quant"]
ACTS = ["silu", "gelu", "gelu_tanh"]
# Not a power of two (quotients round); normed values reach ~4.5 / 0.0314 > 127: int8 saturates.
STATIC_SCALE = 0.0314


def randn(shape, dtype, device, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)


def dyadic(shape, dtype, device, k=16, seed=0):
    """Multiples of 1/8 in [-k/8, k/8]: exact in every float dtype, squares exact, and a row's sum of squares
    (at most k**2 * H units of 1/64, < 2**24 for H <= 65536 at k = 16) exact in fp32 in any order."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-k, k + 1, shape, generator=g) / 8).to(dtype).to(device)


def norm_inputs(t, h, dtype, device, exact=False, seed=0):
    """x, residual (x + residual: multiples of 1/8 again when exact), weight, static scale."""
    if exact:
        x, r = dyadic((t, h), dtype, device, k=8, seed=seed), dyadic((t, h), dtype, device, k=8, seed=seed + 1)
    else:
        x, r = randn((t, h), dtype, device, seed=seed), randn((t, h), dtype, device, seed=seed + 1)
    w = (1 + 0.1 * randn((h,), torch.float32, "cpu", seed=seed + 2)).to(dtype).to(device)
    return x, r, w, torch.tensor([STATIC_SCALE], device=device)


def _outputs(name, out):
    """``(q, scale or None, residual or None)`` of any of the ops or references."""
    out = out if isinstance(out, tuple) else (out,)
    return out[0], out[1] if "dynamic" in name else None, out[-1] if name.startswith("fused_add") else None


def norm_quant(name, x, r, w, scale, quant_dtype, gemma=False, ref=False, eps=EPS):
    """Call the op ``name`` (or its reference) with the arguments it takes."""
    args = [x] + ([r] if name.startswith("fused_add") else []) + [w, eps] + ([scale] if "static" in name else [])
    return _outputs(name, getattr(ops, name + "_ref" if ref else name)(*args, quant_dtype, gemma))


def act_quant(name, x, scale, act, quant_dtype, ref=False):
    args = [x] + ([scale] if "static" in name else []) + [act, quant_dtype]
    return _outputs(name, getattr(ops, name + "_ref" if ref else name)(*args))


def quantize(name, y, scale, quant_dtype):
    """The existing quant references applied to ``y``: ``(q, scale or None)``."""
    int8 = quant_dtype == torch.int8
    if "static" in name:
        return (ops.static_scaled_int8_quant_ref if int8 else ops.static_scaled_fp8_quant_ref)(y, scale), None
    return (ops.dynamic_scaled_int8_quant_ref if int8 else ops.dynamic_per_token_scaled_fp8_quant_ref)(y)


def unfused_norm_quant(name, x, r, w, scale, quant_dtype, gemma=False, triton=False, eps=EPS):
    """The unfused sequence: the norm (its reference, or with ``triton`` the ``ops.rms_norm`` op, Triton on
    CUDA), then the quant reference of its output."""
    if name.startswith("fused_add"):
        add_norm = (ops.gemma_fused_add_rms_norm if gemma else ops.fused_add_rms_norm) if triton else \
            (lambda *a: ops.fused_add_rms_norm_ref(*a, gemma=gemma))
        normed, res = add_norm(x, r, w, eps)
    else:
        norm = (ops.gemma_rms_norm if gemma else ops.rms_norm) if triton else \
            (lambda *a: ops.rms_norm_ref(*a, gemma=gemma))
        normed, res = norm(x, w, eps), None
    return (*quantize(name, normed, scale, quant_dtype), res)


def act_output(x, act, triton=False):
    if act == "silu":
        return ops.silu_and_mul(x) if triton else ops.silu_and_mul_ref(x)
    approximate = "tanh" if act == "gelu_tanh" else "none"
    return ops.gelu_and_mul(x, approximate) if triton else ops.gelu_and_mul_ref(x, approximate)


def assert_same(actual, expected):
    """``(q, scale, residual)`` equal bit for bit (None where the op has none)."""
    for a, e in zip(actual, expected, strict=True):
        assert (a is None) == (e is None)
        if e is not None:
            assert a.dtype == e.dtype and a.shape == e.shape and a.is_contiguous()
            assert torch.equal(a.cpu().view(torch.uint8) if a.element_size() == 1 else a.cpu(),
                               e.cpu().view(torch.uint8) if e.element_size() == 1 else e.cpu())


def assert_a_step_apart(actual, expected, quant_dtype, value_tol=None):
    """``(q, scale[, residual])`` of two computations of the same values whose inputs to the quantization may
    differ in the last bits: residuals equal; each dequantized value within one quantization step of the
    other's (int8: a scale; fp8: 2**-3 relative for normals, 2**-9 of the scale for subnormals).

    ``value_tol``: how far apart the two computations' unquantized values may be (a tensor broadcasting over
    q's rows); None: a last-bit difference, 1e-6 relative. Dynamic scales (a row's amax / qmax) may then be
    ``value_tol / qmax`` apart, and each dequantized value ``value_tol`` more than a step."""
    (q, s, *r), (qe, se, *re) = actual, expected
    for a, e in zip(r, re):
        assert (a is None) == (e is None) and (a is None or torch.equal(a, e))
    qmax = 127.0 if quant_dtype == torch.int8 else 448.0
    extra = 0.0 if value_tol is None else value_tol
    if se is not None:
        assert ((s - se).abs() <= 1e-6 * se.abs() + extra / qmax).all()
    scale = s if s is not None else torch.ones(())  # static: both quantized with one scale, in steps of it
    scale_e = se if se is not None else scale
    a, e = q.float() * scale.to(q.device), qe.float() * scale_e.to(q.device)
    top = torch.maximum(scale, scale_e).to(q.device)
    step = top if quant_dtype == torch.int8 else torch.maximum(2**-3 * e.abs(), 2**-9 * top)
    assert ((a - e).abs() <= step * (1 + 1e-5) + extra).all()


def assert_within_a_step(q, scale, y_ref, quant_dtype):
    """``q * scale`` within half a quantization step of the reference's (saturated) values ``y_ref``, plus the
    2 ulp of ``y_ref``'s dtype by which the unfused op and the reference may differ (ops_testing.TOLERANCES):
    int8 steps by ``scale``; fp8 by 2**-3 relative (normals) or 2**-9 * scale (subnormals)."""
    y, tol = y_ref.float(), TOLERANCES[y_ref.dtype]
    qmax, qmin = (127.0, -128.0) if quant_dtype == torch.int8 else (448.0, -448.0)
    y = torch.minimum(torch.maximum(y, qmin * scale), qmax * scale)
    half_step = 0.5 * scale if quant_dtype == torch.int8 else torch.maximum(2**-4 * y.abs(), 2**-10 * scale)
    bound = half_step * (1 + 1e-6) + tol["rtol"] * y.abs() + tol["atol"] * scale
    assert ((q.float() * scale - y).abs() <= bound).all()


# -- references --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("name", NORM_OPS)
def test_norm_references_are_the_unfused_references(name, quant_dtype, dtype, gemma):
    x, r, w, scale = norm_inputs(7, 769, dtype, "cpu")
    expected = unfused_norm_quant(name, x, r, w, scale, quant_dtype, gemma)
    assert_same(norm_quant(name, x, r, w, scale, quant_dtype, gemma, ref=True), expected)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("name", ACT_OPS)
def test_act_references_are_the_unfused_references(name, quant_dtype, dtype, act):
    x, scale = randn((7, 2 * 769), dtype, "cpu", scale=3.0), torch.tensor([STATIC_SCALE])
    assert_same(act_quant(name, x, scale, act, quant_dtype, ref=True),
                (*quantize(name, act_output(x, act), scale, quant_dtype), None))


def test_the_normed_row_is_rounded_to_the_model_dtype_before_quantizing():
    """bf16: quantizing the fp32 normed row would give other codes; the fused ops quantize the bf16 one."""
    x, _, w, scale = norm_inputs(83, 769, torch.bfloat16, "cpu")
    q = ops.rms_norm_static_quant_ref(x, w, EPS, scale, torch.int8)
    assert torch.equal(q, ops.static_scaled_int8_quant_ref(ops.rms_norm_ref(x, w, EPS), scale))
    assert not torch.equal(q, ops.static_scaled_int8_quant_ref(ops.rms_norm_ref(x.float(), w, EPS), scale))


# -- the ops -----------------------------------------------------------------------------------------------


def op_params():
    """(device, tokens, hidden, dtype): on CPU (where the ops run their references) a few awkward shapes, on
    CUDA the whole grid."""
    cpu = [(1, 8, torch.float32), (7, 769, torch.bfloat16), (83, 768, torch.float16)]
    out = [pytest.param("cpu", t, h, dt, id=f"cpu-{t}x{h}-{DTYPE_IDS[dt]}") for t, h, dt in cpu]
    return out + [pytest.param("cuda", t, h, dt, marks=pytest.mark.cuda, id=f"cuda-{t}x{h}-{DTYPE_IDS[dt]}")
                  for t, h, dt in grid_cases("cuda")]


@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("name", NORM_OPS)
@pytest.mark.parametrize("device,num_tokens,hidden,dtype", op_params())
def test_norm_quant(device, num_tokens, hidden, dtype, name, quant_dtype):
    """Random inputs: the reference exactly on CPU; on CUDA within a step of it, the residual exact (one rounding
    of an exact fp32 sum) and the scales within the normed values' tolerance."""
    x, r, w, scale = norm_inputs(num_tokens, hidden, dtype, device)
    for gemma in (False, True):
        q, s, res = norm_quant(name, x, r, w, scale, quant_dtype, gemma)
        expected = norm_quant(name, x, r, w, scale, quant_dtype, gemma, ref=True)
        if device == "cpu":
            assert_same((q, s, res), expected)
            continue
        assert_same((res,), (expected[2],))
        normed = (ops.fused_add_rms_norm_ref(x, r, w, EPS, gemma=gemma)[0] if res is not None
                  else ops.rms_norm_ref(x, w, EPS, gemma=gemma))
        if s is not None:
            assert s.shape == (num_tokens, 1) and s.is_contiguous()
            torch.testing.assert_close(s, expected[1], rtol=TOLERANCES[dtype]["rtol"], atol=0)
        assert_within_a_step(q, scale if s is None else s, normed, quant_dtype)


def exact_params():
    return [pytest.param(t, h, dt, id=f"{t}x{h}-{DTYPE_IDS[dt]}")
            for t in NUM_TOKENS for h in HIDDEN + [4096] for dt in (torch.float32, torch.float16, torch.bfloat16)]


@pytest.mark.cuda
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("name", NORM_OPS)
@pytest.mark.parametrize("num_tokens,hidden,dtype", exact_params())
def test_norm_quant_is_the_unfused_sequence_on_cuda(num_tokens, hidden, dtype, name, quant_dtype):
    """Exact sums of squares: the fused kernel gives the unfused ops' result (ops.rms_norm's Triton kernel, then
    the quant) bit for bit: the same arithmetic, and no reduction order to differ in."""
    x, r, w, scale = norm_inputs(num_tokens, hidden, dtype, "cuda", exact=True)
    for gemma in (False, True):
        assert_same(norm_quant(name, x, r, w, scale, quant_dtype, gemma),
                    unfused_norm_quant(name, x, r, w, scale, quant_dtype, gemma, triton=True))


@pytest.mark.cuda
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("name", NORM_OPS)
@pytest.mark.parametrize("num_tokens,hidden,dtype", [p for p in exact_params() if p.values[1] in (8, 4096)])
def test_norm_quant_is_the_reference_on_cuda(num_tokens, hidden, dtype, name, quant_dtype):
    """Exact sums of squares and power-of-two widths, where torch's mean (a multiplication by 1/H) and the
    kernel's division by H are both exact: the reference's result bit for bit, provided torch's CUDA rsqrt
    (rsqrtf) and Triton's tl.rsqrt round alike; the one assumption here the interpreter cannot check."""
    x, r, w, scale = norm_inputs(num_tokens, hidden, dtype, "cuda", exact=True)
    for gemma in (False, True):
        assert_same(norm_quant(name, x, r, w, scale, quant_dtype, gemma),
                    norm_quant(name, x, r, w, scale, quant_dtype, gemma, ref=True))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
@pytest.mark.parametrize("name", ACT_OPS)
@pytest.mark.parametrize("device,num_tokens,hidden,dtype", op_params())
def test_act_quant(device, num_tokens, hidden, dtype, name, quant_dtype, act):
    """The reference exactly on CPU; on CUDA the unfused Triton ops exactly (no reduction: the same arithmetic
    element by element) and within a step of the reference."""
    x, scale = randn((num_tokens, 2 * hidden), dtype, device, scale=3.0), torch.tensor([STATIC_SCALE], device=device)
    q, s, _ = act_quant(name, x, scale, act, quant_dtype)
    assert q.shape == (num_tokens, hidden)
    if device == "cpu":
        assert_same((q, s), act_quant(name, x, scale, act, quant_dtype, ref=True)[:2])
        return
    unfused = quantize(name, act_output(x, act, triton=True), scale, quant_dtype)
    if dtype == torch.float32 and act != "silu":
        # Measured on the H200: with fp32 inputs the fused GELU kernel's values differ from the unfused kernel's
        # and the reference's in the last bits (no cast to a narrower dtype rounds that away), so a value at a
        # rounding boundary quantizes one step apart from either.
        # gelu's 1 + tanh(z) (or erf) cancels for z < 0: a last-bit difference there is relative to x * up,
        # not to the (much smaller) result. 16 fp32 ulps of each row's largest |gate| * |up| bound it.
        gate, up = x.float().chunk(2, dim=-1)
        tol = 16 * 2**-23 * (gate.abs() * up.abs()).amax(dim=-1, keepdim=True)
        assert_a_step_apart((q, s), unfused, quant_dtype, tol)
        assert_a_step_apart((q, s), quantize(name, act_output(x, act), scale, quant_dtype), quant_dtype, tol)
        return
    assert_same((q, s), unfused)
    assert_within_a_step(q, scale if s is None else s, act_output(x, act), quant_dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
def test_act_quant_wide_rows_on_cuda(quant_dtype):
    """Per token, rows wider than ONE_PASS_MAX run the unfused kernels: the same result."""
    d = ops.act_quant.ONE_PASS_MAX + 8
    x = randn((5, 2 * d), torch.bfloat16, "cuda", scale=3.0)
    for act in ACTS:
        assert_same(act_quant("act_and_mul_dynamic_quant", x, None, act, quant_dtype),
                    (*quantize("dynamic", act_output(x, act, triton=True), None, quant_dtype), None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant_dtype", QUANT_DTYPES, ids=Q_IDS.get)
def test_all_zero_rows_get_the_min_scale(device, quant_dtype):
    x, r, w, _ = norm_inputs(6, 769, torch.bfloat16, device)
    x[[1, 4]] = 0
    min_scale = ops.INT8_MIN_SCALE if quant_dtype == torch.int8 else ops.MIN_SCALE
    q, s = ops.rms_norm_dynamic_quant(x, w, EPS, quant_dtype)
    xa = torch.cat([x, x], dim=-1)  # silu(0) * 0, gelu(0) * 0: zero rows again
    qa, sa = ops.act_and_mul_dynamic_quant(xa, "silu", quant_dtype)
    for q, s in ((q, s), (qa, sa)):
        assert torch.isfinite(s).all() and (s > 0).all()
        assert s[1].item() == s[4].item() == min_scale
        assert (q[[1, 4]].float() == 0).all()
    q, s, res = ops.fused_add_rms_norm_dynamic_quant(x, -x, w, EPS, quant_dtype)  # x + (-x): all rows zero
    assert (res == 0).all() and (s == min_scale).all() and (q.float() == 0).all()


# x / scale is k + 0.5 for every k in int8's range, and beyond: ties go to the even neighbour, then saturate.
TIES = torch.arange(-130, 130, dtype=torch.float32) + 0.5


@pytest.mark.parametrize("device", DEVICES)
def test_int8_ties_round_to_even(device):
    """Norm: x = 1 everywhere and eps = 0 make rstd = 1, so the normed row is the weight: the ties themselves.
    Activation: silu(32) = gelu(32) = 32 exactly in fp32, so 32 * (t / 32) = t. Static scale 1, and per token
    with 127 in the row (scale 127 / 127 = 1)."""
    one = torch.tensor([1.0], device=device)
    expected = torch.round(TIES).clamp(-128, 127).to(torch.int8)
    w = TIES.to(device)
    q = ops.rms_norm_static_quant(torch.ones(3, len(TIES), device=device), w, 0.0, one, torch.int8)
    assert torch.equal(q.cpu(), expected.expand(3, -1))
    x = torch.cat([torch.full((2, len(TIES)), 32.0), (TIES / 32).expand(2, -1)], dim=-1).to(device)
    for act in ACTS:
        assert torch.equal(ops.act_and_mul_static_quant(x, one, act, torch.int8).cpu(), expected.expand(2, -1))
    row = TIES[3:-3].clone()  # within +-127.5, then 127 appended
    row = torch.cat([row, torch.tensor([127.0])])
    q, s = ops.rms_norm_dynamic_quant(torch.ones(1, len(row), device=device), row.to(device), 0.0, torch.int8)
    assert s.item() == 1.0 and torch.equal(q.cpu()[0], torch.round(row).to(torch.int8))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_3d_inputs(device):
    x, r, w, scale = norm_inputs(83, 769, torch.bfloat16, device)
    for name in NORM_OPS:
        expected = norm_quant(name, x, r, w, scale, torch.int8)
        assert_same(norm_quant(name, strided_rows(x), strided_rows(r), w, scale, torch.int8), expected)
        q, s, res = norm_quant(name, x.reshape(1, 83, 769), r.reshape(1, 83, 769), w, scale, torch.int8)
        assert q.shape == (1, 83, 769) and (s is None or s.shape == (1, 83, 1))
        assert_same((q.reshape(83, 769), None if s is None else s.reshape(83, 1),
                     None if res is None else res.reshape(83, 769)), expected)
    xa = randn((83, 2 * 769), torch.bfloat16, device, scale=3.0)
    for name in ACT_OPS:
        expected = act_quant(name, xa, scale, "silu", FP8)
        assert_same(act_quant(name, strided_rows(xa), scale, "silu", FP8), expected)
        q, s, _ = act_quant(name, xa.reshape(83, 1, 2 * 769), scale, "silu", FP8)
        assert q.shape == (83, 1, 769) and (s is None or s.shape == (83, 1, 1))
        assert_same((q.reshape(83, 769), None if s is None else s.reshape(83, 1)), expected[:2])


@pytest.mark.parametrize("device,num_tokens,hidden,dtype", compile_params())
def test_compiled(device, num_tokens, hidden, dtype):
    """All six ops in one torch.compile(fullgraph=True) graph (Inductor), the dtype and str arguments included:
    the eager ops' results, bit for bit (every dtype: see the symbolic-count test below). On CUDA the graph runs
    the kernels. On CPU Inductor compiles the references' torch code, and by default it keeps a fused fp32 value
    in fp32 across ``.to(bf16).float()`` (the rounding of the normed row would be lost: seen with torch 2.13),
    unless asked to emulate eager's casts; and exact sums of squares leave its reduction order nothing to change."""
    x, r, w, scale = norm_inputs(num_tokens, hidden, dtype, device, exact=True)
    xa = randn((num_tokens, 2 * hidden), dtype, device, scale=3.0)

    def f(x, r, w, scale, xa):
        return (ops.rms_norm_static_quant(x, w, EPS, scale, FP8),
                ops.rms_norm_dynamic_quant(x, w, EPS, torch.int8, True),
                ops.fused_add_rms_norm_static_quant(x, r, w, EPS, scale, torch.int8, True),
                ops.fused_add_rms_norm_dynamic_quant(x, r, w, EPS, FP8),
                ops.act_and_mul_static_quant(xa, scale, "gelu_tanh", torch.int8),
                ops.act_and_mul_dynamic_quant(xa, "silu", FP8))

    with torch._inductor.config.patch(emulate_precision_casts=device == "cpu"):
        outs = compiled(f)(x, r, w, scale, xa)
    # torch < 2.13 on CPU: Inductor's code loses the normed row's rounding to fp16 / bf16 before a static
    # quantization even when emulating eager's casts (seen with torch 2.11, with its pattern matcher off too; the
    # static quantization compiled alone is exact), so a value may land a quantization step away
    drops_rounding = device == "cpu" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13)
    # each output's quant dtype and form: q, (q, scale), (q, residual), (q, scale, residual)
    forms = [(FP8, "q"), (torch.int8, "qs"), (torch.int8, "qr"), (FP8, "qsr"), (torch.int8, "q"), (FP8, "qs")]
    for out, expected, (qd, form) in zip(outs, f(x, r, w, scale, xa), forms, strict=True):
        out, expected = (out, expected) if isinstance(out, tuple) else ((out,), (expected,))
        if drops_rounding:
            named = [dict(zip(form, t)) for t in (out, expected)]
            assert_a_step_apart(*[(d["q"], d.get("s"), d.get("r")) for d in named], qd)
        else:
            assert_same(out, expected)


@pytest.mark.cuda
@pytest.mark.parametrize("num_tokens", [40, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
def test_compiled_at_a_symbolic_token_count_is_the_eager_op(num_tokens, dtype):
    """A compiled graph that serves every token count (the token dim dynamic, as at level 3) launches Inductor's
    copy of each norm kernel: on random inputs its values are the eager op's bit for bit (past 32 tokens both
    launch one config). Inductor passes the float ``eps`` to that copy as fp64; taken as it comes it made the
    normalization fp64, some values a quantization step away from the eager op's (seen with fp32 and fp16)."""
    x, r, w, scale = norm_inputs(num_tokens, 4096, dtype, "cuda")

    def f(x, r, w, scale):
        return (ops.rms_norm_static_quant(x, w, EPS, scale, FP8), ops.rms_norm_dynamic_quant(x, w, EPS, torch.int8),
                ops.fused_add_rms_norm_static_quant(x, r, w, EPS, scale, torch.int8),
                ops.fused_add_rms_norm_dynamic_quant(x, r, w, EPS, FP8, True))

    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(r, 0)
    outs = torch.compile(f, fullgraph=True)(x, r, w, scale)
    for out, expected in zip(outs, f(x, r, w, scale), strict=True):
        assert_same(*((out, expected) if isinstance(out, tuple) else ((out,), (expected,))))


def test_errors_name_the_argument():
    x, r, w, scale = norm_inputs(4, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"rms_norm_static_quant: quant_dtype must be torch.float8_e4m3fn or "
                                         r"torch.int8; got torch.float16"):
        ops.rms_norm_static_quant(x, w, EPS, scale, torch.float16)
    with pytest.raises(TypeError, match=r"rms_norm_dynamic_quant: x must be float32, float16 or bfloat16; got "
                                        r"torch.int32"):
        ops.rms_norm_dynamic_quant(x.to(torch.int32), w, EPS, FP8)
    with pytest.raises(ValueError, match=r"rms_norm_dynamic_quant: weight must have shape \[16\] \(x's last dim\); "
                                         r"got \[8\]"):
        ops.rms_norm_dynamic_quant(x, w[:8], EPS, FP8)
    with pytest.raises(ValueError, match=r"rms_norm_static_quant: x must have rows to normalize .*; got shape \[\]"):
        ops.rms_norm_static_quant(torch.tensor(1.0), w, EPS, scale, FP8)
    with pytest.raises(ValueError, match=r"weight must be on x's device cpu; got meta"):
        ops.rms_norm_dynamic_quant(x, w.to("meta"), EPS, FP8)
    with pytest.raises(ValueError, match=r"fused_add_rms_norm_static_quant: residual must have x's shape \[4, 16\] "
                                         r"and device cpu; got \[4, 8\] on cpu"):
        ops.fused_add_rms_norm_static_quant(x, r[:, :8], w, EPS, scale, torch.int8)
    with pytest.raises(TypeError, match=r"fused_add_rms_norm_static_quant: scale must be float32; got torch.float16"):
        ops.fused_add_rms_norm_static_quant(x, r, w, EPS, scale.half(), torch.int8)
    with pytest.raises(ValueError, match=r"fused_add_rms_norm_dynamic_quant: quant_dtype must be .*; got torch.uint8"):
        ops.fused_add_rms_norm_dynamic_quant(x, r, w, EPS, torch.uint8)
    with pytest.raises(ValueError, match=r"act_and_mul_static_quant: act must be one of \('silu', 'gelu', "
                                         r"'gelu_tanh'\); got 'relu'"):
        ops.act_and_mul_static_quant(x, scale, "relu", FP8)
    with pytest.raises(ValueError, match=r"act_and_mul_static_quant: scale must be one per-tensor value of shape "
                                         r"\[1\]; got shape \[4, 1\]"):
        ops.act_and_mul_static_quant(x, torch.ones(4, 1), "silu", FP8)
    with pytest.raises(ValueError, match=r"act_and_mul_dynamic_quant: x must have an even last dim \(gate and up "
                                         r"halves\); got shape \[4, 15\]"):
        ops.act_and_mul_dynamic_quant(x[:, :15], "silu", torch.int8)
    with pytest.raises(ValueError, match=r"act_and_mul_dynamic_quant: quant_dtype must be .*; got torch.bfloat16"):
        ops.act_and_mul_dynamic_quant(x, "gelu", torch.bfloat16)
    with pytest.raises(TypeError, match=r"act_and_mul_dynamic_quant: x must be .*; got torch.float64"):
        ops.act_and_mul_dynamic_quant(x.double(), "gelu", torch.int8)
