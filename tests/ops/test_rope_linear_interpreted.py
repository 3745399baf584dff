"""The QKV GEMM with the rotary embedding in its epilogue (``ops.rope_linear``'s fused kernels, ``rope_small_m_mm``:
the unrolled GEMV and the dot tile), in Triton's interpreter on CPU tensors, against the unfused kernels.

Bit for bit: the unfused sequence is the plain small-M GEMM with the same tile (the same sums in the same order,
rounded to the operands' dtype), then the rotary kernel in place on its output (the same fp32 arithmetic; the
interpreter's bf16 conversion, a truncation, is then the same on both sides). The public op's GPU path:
tests/ops/test_rope_linear.py. Run with ``TRITON_INTERPRET=1 pytest -m interpret`` (``make test`` does).
"""

import importlib

import pytest
import torch

import ops
from ops.rope_linear import rope_small_m_mm
from ops.small_m_gemm import SmallMConfig, small_m_mm

# bf16 dots: see conftest.py's fixture
pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("bf16_dot_in_the_interpreter")]

rotary = importlib.import_module("ops.rotary_embedding")

# The table's bf16 GEMV row (one pair a program), two pairs a program with K in several steps and a masked last one,
# and a dot tile of 16 rows and 16 pairs (whole heads of 32 columns).
CONFIGS = [SmallMConfig(1, 2, 1024, DOT=False, num_warps=4, num_stages=1, UNROLL=True),
           SmallMConfig(1, 4, 64, DOT=False, num_warps=4, num_stages=1, UNROLL=True),
           SmallMConfig(16, 32, 64, num_warps=4, num_stages=2)]
# (M, K, head_size, q heads, kv heads): one token; three tokens (a program a row in the GEMV, masked rows in a tile),
# K = 208: 64-steps, the last masked
SHAPES = [(1, 128, 32, 4, 2), (3, 208, 32, 2, 1)]


def _operands(m, k, d, hq, hk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn((hq + 2 * hk) * d, k, generator=g) / k**0.5).to(dtype)
    cache = ops.compute_cos_sin_cache(d, 256, dtype=dtype)
    return x, w, torch.randint(0, 256, (m,), generator=g), cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,k,d,hq,hk", SHAPES, ids=[f"{s[0]}x{s[1]}-d{s[2]}" for s in SHAPES])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_rope_small_m_mm_is_the_unfused_kernels(config, m, k, d, hq, hk, dtype, monkeypatch):
    x, w, pos, cache = _operands(m, k, d, hq, hk, dtype)
    out = rope_small_m_mm(x, w, pos, cache, d, hq + hk, config)
    unfused = small_m_mm(x, w, None, config)
    monkeypatch.setattr(rotary, "use_triton", lambda t: True)  # the rotary kernel, in the interpreter
    rotary.rotate_heads_in_place(pos, unfused, cache, d, hq + hk)
    assert out.shape == (m, w.shape[0]) and out.dtype == dtype
    assert torch.equal(out, unfused)
    # the value heads untouched, the rest near the fp32 reference (truncating conversions: 2**-7 relative each)
    ref = ops.rope_linear_ref(x, w, pos, cache, d, hq + hk).float()
    torch.testing.assert_close(out.float(), ref, rtol=2**-5, atol=2**-5)


@pytest.mark.parametrize("config", [SmallMConfig(1, 16, 64, DOT=False, UNROLL=True), SmallMConfig(16, 16, 64),
                                    SmallMConfig(16, 32, 64, SPLIT_K=2)], ids=["across-a-head", "dot-of-8", "split"])
def test_rope_small_m_mm_refuses_a_tile_it_cannot_rotate(config):
    x, w, pos, cache = _operands(1, 64, 8, 2, 1, torch.bfloat16)
    with pytest.raises(ValueError, match=r"rope_small_m_mm: config must be an unrolled GEMV, or a dot tile of one split "
                                         r"with BLOCK_N >= 32, of BLOCK_N = 2 x a divisor of head_size / 2 = 4"):
        rope_small_m_mm(x, w, pos, cache, 8, 3, config)
