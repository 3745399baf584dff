"""The ops' Triton kernels, run on CPU tensors in Triton's interpreter, against the references.

CI has no GPU: this is where it checks the kernels' indexing and masking (masked and mask-free
``EVEN`` tiles, several rows a program, strided rows, odd widths, paged blocks, KV splits). Speed
and the CUDA-only details are the CUDA tests' business. ``make test`` runs these in a second pytest with
``TRITON_INTERPRET=1`` (set before any kernel is defined); elsewhere they are skipped.
"""

import importlib

import pytest
import torch
from ops_testing import assert_close
from test_paged_attention import (
    BLOCK, CONTEXTS, HEAD, HEADS, KV_HEADS, SCALE, TOLERANCES, WINDOW_IDS, WINDOWS, decode_batch,
)

import ops

pytestmark = [pytest.mark.interpret,
              # NumPy's exp overflows to inf inside tanh-GELU's formula for large inputs: the result is right.
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]

rms = importlib.import_module("ops.rms_norm")
act = importlib.import_module("ops.silu_and_mul")
gelu = importlib.import_module("ops.gelu_and_mul")
rope = importlib.import_module("ops.rotary_embedding")
fp8 = importlib.import_module("ops.quant_fp8")
int8 = importlib.import_module("ops.quant_int8")

EPS = 1e-6
# (tokens, width): one token, a few, a width with no 16-byte vectors, a power of two that tiles exactly.
SHAPES = [(1, 8), (7, 769), (16, 1024), (3, 5120)]
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,n", SHAPES)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_rms_norm_and_fused_add(t, n, dtype, gemma):
    x, r, w = randn(t, n, dtype=dtype), randn(t, n, dtype=dtype, seed=1), randn(n, dtype=dtype, seed=2)
    out, none = rms._launch_rms_norm(x, None, w, EPS, gemma)
    assert none is None
    assert_close(out, rms.rms_norm_ref(x, w, EPS, gemma=gemma))
    out, res = rms._launch_rms_norm(x, r, w, EPS, gemma)
    ref_out, ref_res = rms.fused_add_rms_norm_ref(x, r, w, EPS, gemma=gemma)
    assert_close(res, ref_res)
    assert_close(out, ref_out)


@pytest.mark.parametrize("config", [(1024, 4, 4), (2048, 1, 8), (1024, 16, 8)], ids=str)
def test_rms_norm_configs_and_strided_rows(config):
    """Several rows a program, with a last program of fewer rows; rows that are a slice of wider rows."""
    wide = randn(10, 1500, dtype=torch.bfloat16)
    x, w = wide[:, :1000], randn(1000, dtype=torch.bfloat16, seed=1)
    out, _ = rms._launch_rms_norm(x, None, w, EPS, False, config)
    assert_close(out, rms.rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,d", SHAPES)
@pytest.mark.parametrize("kind", ["silu", "gelu", "gelu_tanh"])
def test_act_and_mul(t, d, dtype, kind):
    x = randn(t, 2 * d, dtype=dtype, scale=3.0)
    if kind == "silu":
        out, ref = act._launch_silu_and_mul(x), act.silu_and_mul_ref(x)
    else:
        approx = "tanh" if kind == "gelu_tanh" else "none"
        out, ref = gelu._launch_gelu_and_mul(x, approx), gelu.gelu_and_mul_ref(x, approx)
    assert_close(out, ref)


@pytest.mark.parametrize("config", [(64, 1, 2), (128, 4, 4), (256, 16, 8), (512, 2, 4)], ids=str)
def test_act_and_mul_configs(config):
    """Small and multi-row tiles (the sweep's candidates), over 37 rows: a partial last program."""
    x = randn(37, 2 * 768, dtype=torch.bfloat16, scale=3.0)
    assert_close(act._launch_silu_and_mul(x, config), act.silu_and_mul_ref(x))


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (80, 32)], ids=["full", "partial"])
def test_rotary_embedding(is_neox, head_size, rot_dim):
    t, hq, hk = 9, 4, 2
    cache = ops.compute_cos_sin_cache(rot_dim, 64, 10000.0)
    pos = torch.tensor([0, 3, 1, 63, 7, 7, 20, 2, 5])
    q = randn(t, hq * head_size, dtype=torch.bfloat16)
    k = randn(t, hk * head_size, dtype=torch.bfloat16, seed=1)
    q_out, k_out = rope._launch_rotary_embedding(pos, q, k, cache, head_size, is_neox)
    q_ref, k_ref = rope.rotary_embedding_ref(pos, q, k, cache, head_size, is_neox)
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)


def _interpreter_fp8(y: torch.Tensor) -> torch.Tensor:
    """``y`` (fp32) converted to fp8 by the interpreter itself. Its conversion is not the GPU's (it rounds
    ties away from zero, and 126.9 becomes 64, not 128), so a kernel's fp8 output is compared with the
    interpreter's conversion of the reference's fp32 values: what is checked is everything before it."""
    import triton
    import triton.language as tl

    @triton.jit
    def convert(y_ptr, q_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(q_ptr + offs, tl.load(y_ptr + offs, mask=mask).to(q_ptr.dtype.element_ty), mask=mask)

    y = y.float().contiguous()
    q = torch.empty(y.shape, dtype=fp8.FP8_DTYPE)
    convert[(triton.cdiv(y.numel(), 1024),)](y, q, y.numel(), BLOCK=1024)
    return q


def _fp8_equal(q, x, scale):
    """Bit-exact against saturate(x / scale) (fp32, correctly rounded division), converted as above."""
    y = (x.float() / scale.float()).clamp(-448.0, 448.0)
    assert torch.equal(q.view(torch.uint8), _interpreter_fp8(y).view(torch.uint8))


@pytest.mark.parametrize("n", [8, 4096, 5000, 70000])
def test_static_fp8_quant(n):
    x = randn(1, n, dtype=torch.bfloat16, scale=4.0)
    scale = torch.tensor([0.05])
    q = fp8._launch_static_fp8_quant(x, scale)
    assert q.dtype == fp8.FP8_DTYPE and q.shape == x.shape
    _fp8_equal(q, x, scale)


@pytest.mark.parametrize("n", [8, 4096, 5000, 70000, 600000])
def test_dynamic_fp8_quant(n):
    """Every path: one program (small), per-block partials, and the large-input reduction."""
    x = randn(1, n, dtype=torch.bfloat16, scale=4.0)
    q, scale = fp8._launch_dynamic_fp8_quant(x)
    _, ref_scale = fp8.dynamic_scaled_fp8_quant_ref(x)
    torch.testing.assert_close(scale, ref_scale, rtol=0, atol=0)
    _fp8_equal(q, x, ref_scale)


def test_dynamic_fp8_quant_of_zeros_has_a_finite_positive_scale():
    q, scale = fp8._launch_dynamic_fp8_quant(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert torch.isfinite(scale).all() and (scale > 0).all() and (q.float() == 0).all()


# Per-token quant: one program per row, many short rows a program (8 wide: 64 rows), a row in registers (769,
# 5120: masked / exact tiles), and rows wider than one block (20000 > 16384: two loops over 4096-wide blocks).
PER_TOKEN_SHAPES = [(1, 8), (65, 8), (7, 769), (3, 5120), (2, 20000)]
# Forced configs (BLOCK, ROWS, num_warps): the loop path on short rows, with one and several rows a program.
PER_TOKEN_CONFIGS = [(256, 1, 4), (256, 4, 4), (1024, 2, 8)]


def _int8_equal(q, ref):
    assert q.dtype == torch.int8 and q.shape == ref.shape
    assert torch.equal(q, ref)


@pytest.mark.parametrize("n", [8, 4096, 5000, 70000])
def test_static_int8_quant(n):
    x = randn(1, n, dtype=torch.bfloat16, scale=4.0)
    scale = torch.tensor([0.0314])
    _int8_equal(int8._launch_static_int8_quant(x, scale), int8.static_scaled_int8_quant_ref(x, scale))


def test_int8_quant_rounds_ties_to_even():
    """x / scale exactly k + 0.5 for every k in range: int8 conversion is exact in the interpreter, so the kernels'
    rounding (the 1.5 * 2**23 addition) is checked here, bit for bit."""
    ties = torch.arange(-140, 140, dtype=torch.float32) + 0.5
    q = int8._launch_static_int8_quant(ties.reshape(1, -1), torch.tensor([1.0]))
    _int8_equal(q, torch.round(ties).clamp(-128, 127).to(torch.int8).reshape(1, -1))
    assert q[0, 140:144].tolist() == [0, 2, 2, 4]  # 0.5, 1.5, 2.5, 3.5
    row = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5]])  # scale 1 exactly
    q, s = int8._launch_dynamic_int8_quant(row)
    assert s.item() == 1.0 and q.tolist() == [[127, 0, 2, 2, 0, -2, 126, -126]]


@pytest.mark.parametrize("t,n", PER_TOKEN_SHAPES)
def test_dynamic_int8_quant(t, n):
    x = randn(t, n, dtype=torch.bfloat16, scale=4.0)
    x[t // 2] = 0  # an all-zero row: INT8_MIN_SCALE, zeros
    q, scale = int8._launch_dynamic_int8_quant(x)
    q_ref, scale_ref = int8.dynamic_scaled_int8_quant_ref(x)
    assert scale.shape == (t, 1) and torch.equal(scale, scale_ref)
    assert scale[t // 2].item() == int8.INT8_MIN_SCALE
    _int8_equal(q, q_ref)


@pytest.mark.parametrize("config", PER_TOKEN_CONFIGS, ids=str)
def test_dynamic_int8_quant_configs_and_strided_rows(config):
    wide = randn(10, 1500, dtype=torch.bfloat16, scale=4.0)
    x = wide[:, :769]  # rows a slice of wider rows, read in place
    q, scale = int8._launch_dynamic_int8_quant(x, config)
    q_ref, scale_ref = int8.dynamic_scaled_int8_quant_ref(x)
    assert torch.equal(scale, scale_ref)
    _int8_equal(q, q_ref)


@pytest.mark.parametrize("t,n", PER_TOKEN_SHAPES)
def test_per_token_fp8_quant(t, n):
    x = randn(t, n, dtype=torch.bfloat16, scale=4.0)
    x[t // 2] = 0
    q, scale = fp8.launch_per_token_quant(x, fp8.FP8_DTYPE, fp8.MIN_SCALE)
    _, scale_ref = fp8.dynamic_per_token_scaled_fp8_quant_ref(x)
    assert scale.shape == (t, 1) and torch.equal(scale, scale_ref)
    assert scale[t // 2].item() == fp8.MIN_SCALE
    _fp8_equal(q, x, scale_ref)


@pytest.mark.parametrize("config", PER_TOKEN_CONFIGS, ids=str)
def test_per_token_fp8_quant_configs_and_strided_rows(config):
    wide = randn(10, 1500, dtype=torch.bfloat16, scale=4.0)
    x = wide[:, :769]
    q, scale = fp8.launch_per_token_quant(x, fp8.FP8_DTYPE, fp8.MIN_SCALE, config)
    _, scale_ref = fp8.dynamic_per_token_scaled_fp8_quant_ref(x)
    assert torch.equal(scale, scale_ref)
    _fp8_equal(q, x, scale_ref)


# fp32 only: the interpreter's tl.dot of bf16 blocks returns garbage (Triton 3.6; a 16x16 bf16 product is off
# by ~1e10), so bf16 is the CUDA tests' (test_paged_attention.py) alone.
@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("kw", WINDOWS, ids=WINDOW_IDS)
def test_paged_decode(kw, dtype):
    q, cache, table, seq_lens = decode_batch(CONTEXTS, dtype)
    out = ops.paged_decode_triton(q, cache, table, seq_lens, HEADS, HEAD, SCALE, **kw)
    ref = ops.paged_decode_ref(q, cache, table, seq_lens, HEADS, HEAD, SCALE, **kw)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("num_splits", [1, 2, 8, 32])
def test_paged_decode_splits_merge_to_the_same_result(num_splits):
    """Split-KV: however a sequence's pages are split, the merged result is the same attention."""
    q, cache, table, seq_lens = decode_batch([50, 9])
    out = ops.paged_decode_triton(q, cache, table, seq_lens, HEADS, HEAD, SCALE, num_splits=num_splits)
    torch.testing.assert_close(out, ops.paged_decode_ref(q, cache, table, seq_lens, HEADS, HEAD, SCALE),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_write_kv_cache_equals_index_copy(num_tokens):
    """k and v as column slices of one qkv tensor (strided rows), slots in any order."""
    g = torch.Generator().manual_seed(num_tokens)
    cache = torch.randn(2, 32, BLOCK, KV_HEADS, HEAD, generator=g).to(torch.bfloat16)
    qkv = torch.randn(num_tokens, (HEADS + 2 * KV_HEADS) * HEAD, generator=g).to(torch.bfloat16)
    k = qkv[:, HEADS * HEAD:(HEADS + KV_HEADS) * HEAD]
    v = qkv[:, (HEADS + KV_HEADS) * HEAD:]
    slots = torch.randperm(32 * BLOCK, generator=g)[:num_tokens]
    expected = cache.clone()
    ops.write_kv_cache_ref(expected, k, v, slots)
    ops.write_kv_cache_triton(cache, k, v, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
