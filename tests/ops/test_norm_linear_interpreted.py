"""The residual add + RMSNorm + GEMV in one kernel (``ops.norm_linear``'s fused kernel, ``norm_small_m_mm``: the
unrolled GEMV, plain and gated), in Triton's interpreter on CPU tensors, against the unfused kernels.

The sum ``h`` bit for bit against ``ops.fused_add_rms_norm``'s kernel (the same fp32 add, rounded to the operands'
dtype); the output near the unfused kernels' (the norm kernel, then the small-M GEMM or its gated form with the same
tile): the mean square is summed in another order, which may move a normalized element by one rounding; and near
the fp32 reference. The public op's GPU path: tests/ops/test_norm_linear.py. Run with ``TRITON_INTERPRET=1 pytest
-m interpret`` (``make test`` does); elsewhere these are skipped.
"""

import dataclasses
import importlib

import pytest
import torch

import ops
from ops.norm_linear import NORM_MIN_ROWS, norm_small_m_mm
from ops.small_m_gemm import GATED_ROWS, SmallMConfig, gated_config, small_m_gated_mm, small_m_mm

pytestmark = [pytest.mark.interpret]

rms_norm_module = importlib.import_module("ops.rms_norm")

# GATED_ROWS' bf16 GEMV row (one gate and one up row, run with NORM_MIN_ROWS), and a GEMV of eight rows with K in
# 64-column steps, the first two loaded before the wait (PRELOAD)
CONFIGS = [GATED_ROWS[torch.bfloat16][0][1], SmallMConfig(1, 8, 64, DOT=False, UNROLL=True, PRELOAD=2)]
# (M, K, N): one token, K in several steps; three rows (a program a row), K = 208 (the last step masked), N = 52 (the
# last column block masked)
SHAPES = [(1, 256, 64), (3, 208, 52)]


def _operands(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + m + k)
    x, r = (torch.randn(m, k, generator=g).to(dtype) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return x, r, nw, w


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"{m}x{k}x{n}" for m, k, n in SHAPES])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_norm_small_m_mm_is_the_unfused_kernels(config, m, k, n, dtype, gated, monkeypatch):
    x, r, nw, w = _operands(m, k, n, dtype)
    out, h = norm_small_m_mm(x, r, nw, w, 1e-5, config, gated)
    monkeypatch.setattr(rms_norm_module, "use_triton", lambda t: True)  # the norm kernel, in the interpreter
    normed, h_kernel = ops.fused_add_rms_norm(x, r, nw, 1e-5)
    c = dataclasses.replace(config, BLOCK_N=max(config.BLOCK_N, NORM_MIN_ROWS))
    unfused = small_m_gated_mm(normed, w, c) if gated else small_m_mm(normed, w, None, c)
    assert out.shape == (m, n // 2 if gated else n) and out.dtype == h.dtype == dtype
    assert torch.equal(h, h_kernel)
    # one rounding of a normalized element at most apart (2**-7 relative, truncated), summed over K with |w| ~ k**-0.5
    torch.testing.assert_close(out.float(), unfused.float(), rtol=2**-6, atol=2**-6)
    ref_out, ref_h = ops.norm_linear_ref(x, r, nw, w, 1e-5, gated)
    torch.testing.assert_close(h.float(), ref_h.float(), rtol=2**-7, atol=0)  # truncated, not rounded to nearest
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-5, atol=2**-5)


def test_norm_small_m_mm_refuses_a_tile_form():
    x, r, nw, w = _operands(1, 64, 16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"norm_small_m_mm: config must be an unrolled GEMV of a row a program"):
        norm_small_m_mm(x, r, nw, w, 1e-5, SmallMConfig(16, 16, 64))
    with pytest.raises(ValueError, match=r"norm_small_m_mm: config must be an unrolled GEMV of a row a program"):
        norm_small_m_mm(x, r, nw, w, 1e-5, SmallMConfig(2, 8, 64, DOT=False, UNROLL=True))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_rows_a_program_change_the_tiling_not_the_values(gated):
    """``min_rows`` (``benchmarks.norm_linear --rows``): 2 to 16 weight rows a program; a column's sums do not depend
    on the other rows of its program (here, in the interpreter, not even their order): the same output and sum bit
    for bit."""
    x, r, nw, w = _operands(1, 256, 64, torch.bfloat16)
    config = SmallMConfig(1, 2, 128, DOT=False, UNROLL=True)
    first = norm_small_m_mm(x, r, nw, w, 1e-5, config, gated, min_rows=2)
    for rows in (4, NORM_MIN_ROWS, 16):
        out, h = norm_small_m_mm(x, r, nw, w, 1e-5, config, gated, min_rows=rows)
        assert torch.equal(out, first[0]) and torch.equal(h, first[1])
