"""Launch configs by size: latency configs only for sizes known without a guard, bandwidth configs kept.

The kernels' numbers at these sizes are in the op tests' grids; here: the choices themselves, the
boundaries between them (16 x 8192 elements; 64K for the single-program dynamic fp8 quant), and that a
symbolic size reads as unknown without adding a guard.
"""

import importlib

import pytest
import torch
from ops_testing import DEVICES, assert_close
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import ops
from ops.triton_utils import known_int, needs_int64

rms = importlib.import_module("ops.rms_norm")
act = importlib.import_module("ops.silu_and_mul")
norm_quant = importlib.import_module("ops.norm_quant")
quant = importlib.import_module("ops.quant_fp8")

BF16 = 2


def test_known_int_reads_a_symbolic_size_as_unknown_without_a_guard():
    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(17, ConstantSource("tokens")), hint=17)
    assert known_int(7) == 7 and known_int(s) is None
    assert needs_int64(s * 4096) and not needs_int64(32768 * 16384, 8192) and needs_int64(2**31)
    assert env.guards == []


def test_bandwidth_configs_are_the_swept_ones():
    """Large known sizes keep the H200 sweep's bandwidth choices (87-103% of copy); a symbolic size (a compiled
    graph serving one token and thousands) gets the tiles that sweep best at both (benchmarks.fused_quant_configs)."""
    for n_rows in (None, 17, 4096, 32768):
        assert rms.rms_norm_config(4096, BF16, n_rows if n_rows != 17 else None) == (4096, 1, 8)
    for n_rows in (4096, 32768):
        assert act.act_and_mul_config(4096, BF16, n_rows) == (4096, 1, 16)
    assert rms.rms_norm_config(8192, BF16, 17) == (8192, 1, 8)  # 17 x 8192 > SMALL_ELEMENTS
    assert act.act_and_mul_config(8192, BF16, 17) == (4096, 1, 16)
    assert quant.static_fp8_quant_config(17 * 8192, BF16) == (4096, 8)
    # Symbolic: 1024-wide tiles on 4 warps (14 programs for one 14336-wide token); the norm + static quant's rows
    # split over 4 programs at a known few tokens only, else one program a row, a 16-byte vector a thread.
    assert act.act_and_mul_config(14336, BF16, None) == (1024, 1, 4)
    assert act.act_and_mul_config(256, BF16, None) == (256, 4, 4)
    assert quant.static_fp8_quant_config(None, BF16) == (1024, 4)
    assert norm_quant.norm_quant_col_split(4096, None, dynamic=False) == 1
    assert norm_quant.norm_quant_config(4096, BF16, None) == (4096, 1, 16)
    assert norm_quant.norm_quant_config(4096, BF16, 4096) == (4096, 1, 16)
    assert norm_quant.norm_quant_config(4096, BF16, 1) == rms.rms_norm_config(4096, BF16, 1)
    assert norm_quant.norm_quant_config(2048, BF16, None) == (2048, 1, 8)  # a 16-byte vector a thread
    assert norm_quant.norm_quant_config(8192, BF16, None) == (8192, 1, 16)
    assert norm_quant.norm_quant_config(1024, BF16, None) == rms.rms_norm_config(1024, BF16, None)  # 2 rows
    assert norm_quant.norm_quant_col_split(4096, 1, dynamic=False) == 4
    assert norm_quant.norm_quant_col_split(4096, 4096, dynamic=False) == 1
    assert norm_quant.norm_quant_col_split(4096, None, dynamic=True) == 1
    assert norm_quant.norm_quant_col_split(1024, None, dynamic=False) == 1


def test_latency_configs():
    """Known sizes <= 16 x 8192 elements get the configs that beat torch.compile in the H200 sweep."""
    # act_and_mul: 512-element tiles on 8 warps (2 elements a thread): a 512-wide row block below 8
    # tokens, 2 rows of 256 from 8 tokens; short rows stacked.
    assert act.act_and_mul_config(4096, BF16, 1) == (512, 1, 8)  # 8 programs
    assert act.act_and_mul_config(4096, BF16, 16) == (256, 2, 8)  # 128 programs
    assert act.act_and_mul_config(8192, BF16, 16) == (256, 2, 8)  # 16 x 8192 == SMALL_ELEMENTS: still small
    assert act.act_and_mul_config(8, BF16, 7) == (8, 8, 1)  # short rows stacked, no more than the rows
    assert act.act_and_mul_config(4096, 4, 1) == (512, 1, 8)
    # rms_norm: one row per program, two 16-byte vectors per thread.
    assert rms.rms_norm_config(2048, BF16, 16) == (2048, 1, 4)
    assert rms.rms_norm_config(4096, BF16, 1) == (4096, 1, 8)
    assert rms.rms_norm_config(8192, BF16, 16) == (8192, 1, 16)
    assert rms.rms_norm_config(8, BF16, 7) == (8, 8, 1)
    # static fp8: 8 warps, 1 element a thread up to one 8192-wide token, 2 beyond; tiny tensors in one block.
    assert quant.static_fp8_quant_config(4096, BF16) == (256, 8)
    assert quant.static_fp8_quant_config(8192, BF16) == (256, 8)
    assert quant.static_fp8_quant_config(16 * 4096, BF16) == (512, 8)
    assert quant.static_fp8_quant_config(7, BF16) == (32, 1)
    # Single-program dynamic quant (n <= 8192): one 16-byte vector per thread, up to 16 warps.
    assert quant._SINGLE_PROGRAM_MAX == 8192 and quant._PARTIALS_MAX == 1 << 20
    assert quant.dynamic_fp8_quant_single_config(4096, BF16) == (4096, 1, 16)
    assert quant.dynamic_fp8_quant_single_config(8192, BF16) == (4096, 2, 16)
    assert quant.dynamic_fp8_quant_single_config(8192, 4) == (2048, 4, 16)
    for n in (1, 8, 769, 4096, 8192):
        block, blocks, warps = quant.dynamic_fp8_quant_single_config(n, BF16)
        assert block * blocks >= n and block & (block - 1) == 0 and 1 <= warps <= 16


def test_exact_tiling_is_only_claimed_for_known_sizes():
    """EVEN (the mask-free kernels) needs known sizes that the tiles divide; a symbolic size never claims it."""
    assert act.act_tiles_even(16, 4096, 1, 256) and act.act_tiles_even(8, 8, 8, 8)
    assert not act.act_tiles_even(7, 8, 8, 8)  # 7 rows in tiles of 8
    assert not act.act_tiles_even(16, 769, 1, 256)
    assert not act.act_tiles_even(None, 4096, 1, 256)


# Around the boundaries: 16 x 8192 (small) vs 17 x 8192; for the dynamic quant 8192 elements (one program)
# vs 8193 (partials), 2**20 (partials) vs 2**20 + 1 (atomic max).
BOUNDARY = [(1, 4096), (16, 2048), (16, 4096), (16, 8192), (17, 8192), (1, 8192), (1, 8193), (1, 65536),
            (9, 8193), (256, 4096), (1, 1 << 20), (1, (1 << 20) + 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_tokens,hidden", BOUNDARY)
def test_ops_at_the_boundaries(device, num_tokens, hidden):
    g = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(num_tokens, hidden, generator=g)).to(torch.bfloat16).to(device)
    r = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16).to(device)
    assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_ref(x, w, 1e-6))
    normed, res = ops.gemma_fused_add_rms_norm(x, r, w, 1e-6)
    ref_normed, ref_res = ops.fused_add_rms_norm_ref(x, r, w, 1e-6, gemma=True)
    assert torch.equal(res, ref_res)
    assert_close(normed, ref_normed)
    x2 = torch.cat([x, r], dim=-1)
    assert_close(ops.silu_and_mul(x2), ops.silu_and_mul_ref(x2))
    assert_close(ops.gelu_and_mul(x2, "tanh"), ops.gelu_and_mul_ref(x2, "tanh"))
    scale = torch.tensor([0.03], device=device)
    q = ops.static_scaled_fp8_quant(x, scale)
    assert torch.equal(q.view(torch.uint8), ops.static_scaled_fp8_quant_ref(x, scale).view(torch.uint8))
    q, s = ops.dynamic_scaled_fp8_quant(x)
    q_ref, s_ref = ops.dynamic_scaled_fp8_quant_ref(x)
    assert s.shape == (1,) and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_fp8_under_a_symbolic_token_count_is_exact(device):
    """The symbolic-size compile takes the two-kernel path at every size, small ones included."""
    backend = "inductor" if device == "cuda" else "aot_eager"
    f = torch.compile(ops.dynamic_scaled_fp8_quant, backend=backend, fullgraph=True)
    for num_tokens in (3, 16, 40):
        x = (4 * torch.randn(num_tokens, 4096)).to(torch.bfloat16).to(device)
        torch._dynamo.mark_dynamic(x, 0)
        q, s = f(x)
        q_ref, s_ref = ops.dynamic_scaled_fp8_quant_ref(x)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))

