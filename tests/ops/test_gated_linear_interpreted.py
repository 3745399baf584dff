"""The gated small-M GEMM on bf16 / fp16 operands (``small_m_gated_mm``: gate-up GEMM + SiLU-and-mul in its epilogue,
``ops.gated_linear``'s kernel), in Triton's interpreter on CPU tensors, against the unfused kernels.

Bit for bit: the unfused sequence is the plain small-M GEMM with the same config (the same sums in the same order,
rounded to the operands' dtype), then ``silu_and_mul``'s kernel (the same fp32 arithmetic on the same values). The
public op's GPU path: tests/ops/test_gated_linear.py. Run with ``TRITON_INTERPRET=1 pytest -m interpret``
(``make test`` does); elsewhere these are skipped.
"""

import importlib

import pytest
import torch

import ops
from ops.small_m_gemm import GATED_ROWS, SmallMConfig, gated_config, small_m_gated_mm, small_m_mm

# bf16 dots: see conftest.py's fixture
pytestmark = [pytest.mark.interpret, pytest.mark.usefixtures("bf16_dot_in_the_interpreter")]

act_and_mul = importlib.import_module("ops.silu_and_mul")

# GATED_ROWS' bf16 GEMV row, a GEMV of two rows with K in several steps, and a dot tile with K in two steps and an
# uneven last one; that GEMV with its first two
# steps' weights loaded first (PRELOAD).
CONFIGS = list(dict.fromkeys(
    [c for _, c in GATED_ROWS[torch.bfloat16] if c is not None]
    + [SmallMConfig(1, 4, 64, DOT=False, UNROLL=True), SmallMConfig(16, 32, 128, num_stages=2),
       SmallMConfig(1, 4, 64, DOT=False, UNROLL=True, PRELOAD=2)]))
# (M, K, D): one token, three rows (masked in a tile, one program a row in the GEMV), D = 40: no tile of 32 columns
# divides it.
SHAPES = [(1, 208, 48), (3, 256, 40)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m,k,d", SHAPES, ids=[f"{m}x{k}x{d}" for m, k, d in SHAPES])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_gated_mm_is_the_unfused_kernels(config, m, k, d, dtype):
    g = torch.Generator().manual_seed(m + k)
    a = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(2 * d, k, generator=g) / k**0.5).to(dtype)
    h = small_m_gated_mm(a, w, config)
    unfused = act_and_mul._launch_silu_and_mul(small_m_mm(a, w, None, gated_config(config, dtype)))
    assert h.shape == (m, d) and h.dtype == dtype
    assert torch.equal(h, unfused)
    # and near the fp32 reference (the interpreter truncates to bf16: two roundings of 2**-7 at most, and the sums)
    torch.testing.assert_close(h.float(), ops.gated_linear_ref(a, w).float(), rtol=2**-6, atol=2**-6)


def test_gated_mm_names_a_bad_weight():
    a = torch.randn(1, 64).bfloat16()
    with pytest.raises(ValueError, match=r"small_m_gated_mm: w must be \[gate; up\].*\[95, 64\]"):
        small_m_gated_mm(a, torch.randn(95, 64).bfloat16(), CONFIGS[0])
    with pytest.raises(TypeError, match="small_m_gated_mm: a and w"):
        small_m_gated_mm(a.float(), torch.randn(96, 64), CONFIGS[0])
    with pytest.raises(ValueError, match=r"gated form's unrolled GEMV takes a row of a a program \(BLOCK_M=1\)"):
        small_m_gated_mm(a, torch.randn(96, 64).bfloat16(), SmallMConfig(2, 8, 64, DOT=False, UNROLL=True))

