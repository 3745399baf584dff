"""The QKV GEMV with the rotary embedding in its epilogue (``ops.rope_linear``'s fused kernel, ``rope_gemv``), in
Triton's interpreter on CPU tensors, against the unfused kernels.

Bit for bit: the unfused sequence is the plain unrolled GEMV with the same tile (the same sums in the same order,
rounded to the operands' dtype), then the rotary kernel in place on its output (the same fp32 arithmetic; the
interpreter's bf16 conversion, a truncation, is then the same on both sides). The public op's GPU path:
tests/ops/test_rope_linear.py. Run with ``TRITON_INTERPRET=1 pytest -m interpret`` (``make test`` does).
"""

import importlib

import pytest
import torch

import ops
from ops.rope_linear import rope_gemv
from ops.small_m_gemm import SmallMConfig, small_m_mm

pytestmark = pytest.mark.interpret

rotary = importlib.import_module("ops.rotary_embedding")

# The table's bf16 GEMV row (one pair a program), two pairs a program, and K in several steps with a masked last one.
CONFIGS = [SmallMConfig(1, 2, 1024, DOT=False, num_warps=4, num_stages=1, UNROLL=True),
           SmallMConfig(1, 4, 64, DOT=False, num_warps=4, num_stages=1, UNROLL=True)]
# (M, K, head_size, q heads, kv heads): one token; three tokens (a program a row); K = 208: 64-steps, the last masked
SHAPES = [(1, 128, 16, 4, 2), (3, 208, 8, 2, 1)]


def _operands(m, k, d, hq, hk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn((hq + 2 * hk) * d, k, generator=g) / k**0.5).to(dtype)
    cache = ops.compute_cos_sin_cache(d, 256, dtype=dtype)
    return x, w, torch.randint(0, 256, (m,), generator=g), cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,k,d,hq,hk", SHAPES, ids=[f"{s[0]}x{s[1]}-d{s[2]}" for s in SHAPES])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_rope_gemv_is_the_unfused_kernels(config, m, k, d, hq, hk, dtype, monkeypatch):
    x, w, pos, cache = _operands(m, k, d, hq, hk, dtype)
    out = rope_gemv(x, w, pos, cache, d, hq + hk, config)
    unfused = small_m_mm(x, w, None, config)
    monkeypatch.setattr(rotary, "use_triton", lambda t: True)  # the rotary kernel, in the interpreter
    rotary.rotate_heads_in_place(pos, unfused, cache, d, hq + hk)
    assert out.shape == (m, w.shape[0]) and out.dtype == dtype
    assert torch.equal(out, unfused)
    # the value heads untouched, the rest near the fp32 reference (truncating conversions: 2**-7 relative each)
    ref = ops.rope_linear_ref(x, w, pos, cache, d, hq + hk).float()
    torch.testing.assert_close(out.float(), ref, rtol=2**-5, atol=2**-5)


def test_rope_gemv_refuses_a_tile_across_a_head():
    x, w, pos, cache = _operands(1, 64, 8, 2, 1, torch.bfloat16)
    with pytest.raises(ValueError, match=r"rope_gemv: config must be an unrolled GEMV of BLOCK_N = 2 x a divisor of "
                                         r"head_size / 2 = 4"):
        rope_gemv(x, w, pos, cache, 8, 3, SmallMConfig(1, 16, 64, DOT=False, UNROLL=True))
