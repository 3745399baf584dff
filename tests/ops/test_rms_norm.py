import pytest
import torch
from ops_testing import DEVICES, assert_close, compile_params, compiled, grid_params, strided_rows

import ops
from dispatcher import CompilationConfig, set_compilation_config

EPS = 1e-6
FORMS = {
    # name: (functional op, fused-add op, gemma)
    "llama": (ops.rms_norm, ops.fused_add_rms_norm, False),
    "gemma": (ops.gemma_rms_norm, ops.gemma_fused_add_rms_norm, True),
}


def _inputs(t, h, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype).to(device)
    r = torch.randn(t, h, generator=g).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype).to(device)
    return x, r, w


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("device,num_tokens,hidden,dtype", grid_params())
def test_rms_norm(device, num_tokens, hidden, dtype, form):
    op, fused, gemma = FORMS[form]
    x, r, w = _inputs(num_tokens, hidden, dtype, device)
    assert_close(op(x, w, EPS), ops.rms_norm_ref(x, w, EPS, gemma=gemma))

    normed, res = fused(x, r, w, EPS)
    ref_normed, ref_res = ops.fused_add_rms_norm_ref(x, r, w, EPS, gemma=gemma)
    # The sum is one rounding of an exact fp32 sum: bit-exact.
    assert torch.equal(res, ref_res)
    assert_close(normed, ref_normed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_add_rounds_the_sum_first(device, dtype):
    """fused_add_rms_norm(x, r) == rms_norm(x + r) with the sum in the input dtype, and inputs are untouched."""
    x, r, w = _inputs(83, 769, dtype, device)
    x0, r0 = x.clone(), r.clone()
    normed, res = ops.fused_add_rms_norm(x, r, w, EPS)
    assert torch.equal(res, x + r)
    assert_close(normed, ops.rms_norm(x + r, w, EPS))
    assert torch.equal(x, x0) and torch.equal(r, r0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("num_tokens,hidden", [(7, 769), (83, 5120), (4096, 8)])
def test_strided_and_3d_inputs(device, form, num_tokens, hidden):
    op, fused, gemma = FORMS[form]
    x, r, w = _inputs(num_tokens, hidden, torch.bfloat16, device)
    xs, rs = strided_rows(x), strided_rows(r)
    out = op(xs, w, EPS)
    assert out.is_contiguous()
    assert_close(out, ops.rms_norm_ref(x, w, EPS, gemma=gemma))
    normed, res = fused(xs, rs, w, EPS)
    assert torch.equal(res, ops.fused_add_rms_norm_ref(x, r, w, EPS, gemma=gemma)[1])
    # [B, S, H] inputs keep their shape.
    x3 = x.reshape(1, num_tokens, hidden)
    assert_close(op(x3, w, EPS), ops.rms_norm_ref(x3, w, EPS, gemma=gemma))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("device,num_tokens,hidden,dtype", compile_params())
def test_compiled(device, num_tokens, hidden, dtype, form):
    op, fused, gemma = FORMS[form]
    x, r, w = _inputs(num_tokens, hidden, dtype, device)

    def f(x, r, w):
        normed, res = fused(x, r, w, EPS)
        return op(res, w, EPS) * 2, normed

    out, normed = compiled(f)(x, r, w)
    ref_normed, ref_res = ops.fused_add_rms_norm_ref(x, r, w, EPS, gemma=gemma)
    assert_close(normed, ref_normed)
    # Inductor may fuse the "* 2" into the op's output rounding: compare after the same rounding.
    assert_close(out, (ops.rms_norm_ref(ref_res, w, EPS, gemma=gemma) * 2))


@pytest.mark.cuda
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compiled_at_a_symbolic_token_count_is_the_eager_op(dtype, form):
    """The token dim dynamic (one graph for every size, as at level 3): Inductor launches its own copy of the
    kernel, and passes it ``eps`` as fp64; the normalization stays fp32, the eager op's values bit for bit."""
    op, fused, _ = FORMS[form]
    x, r, w = _inputs(300, 4096, dtype, "cuda")

    def f(x, r, w):
        return op(x, w, EPS), *fused(x, r, w, EPS)

    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(r, 0)
    for out, expected in zip(torch.compile(f, fullgraph=True)(x, r, w), f(x, r, w), strict=True):
        assert torch.equal(out, expected)


def test_fp32_reference_matches_an_independent_float64_formula():
    x, r, w = _inputs(83, 769, torch.float32, "cpu")
    xd, wd = x.double(), w.double()
    expected = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + EPS) * wd
    torch.testing.assert_close(ops.rms_norm_ref(x, w, EPS), expected.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.rms_norm_ref(x, w, EPS, gemma=True), (expected / wd * (1 + wd)).float())


def test_gemma_reference_matches_transformers():
    """Gemma 2's RMSNorm computes (x normed) * (1 + w) in fp32 and casts once, as we do: bit-exact in bf16."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    hf = gemma2.Gemma2RMSNorm(769, eps=EPS)
    with torch.no_grad():
        hf.weight.normal_()
    x = torch.randn(83, 769, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ops.gemma_rms_norm(x, hf.weight, EPS), hf(x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("custom_ops", [["all"], ["none"]])
def test_modules(device, custom_ops):
    """RMSNorm / GemmaRMSNorm give the reference's result whichever implementation the switch picks."""
    with set_compilation_config(CompilationConfig(level=0, custom_ops=custom_ops)):
        norm = ops.RMSNorm(769, eps=EPS, dtype=torch.bfloat16).to(device)
        gnorm = ops.GemmaRMSNorm(769, eps=EPS, dtype=torch.bfloat16).to(device)
    if custom_ops == ["none"]:
        expected = "forward_native"
    else:  # chosen by the machine, not the tensors: forward_cuda also serves CPU tensors (through the reference)
        expected = "forward_cuda" if torch.cuda.is_available() and ops.HAS_TRITON else "forward_cpu"
    assert norm._forward_method.__name__ == gnorm._forward_method.__name__ == expected
    assert torch.all(gnorm.weight == 0)  # Gemma checkpoints store w - 1
    x, r, _ = _inputs(83, 769, torch.bfloat16, device)
    with torch.no_grad():
        norm.weight.normal_()
        gnorm.weight.normal_()
        for m, gemma in ((norm, False), (gnorm, True)):
            assert_close(m(x), ops.rms_norm_ref(x, m.weight, EPS, gemma=gemma))
            normed, res = m(x, r)
            ref = ops.fused_add_rms_norm_ref(x, r, m.weight, EPS, gemma=gemma)
            assert torch.equal(res, ref[1])
            assert_close(normed, ref[0])
