"""The small-M GEMM on the GPU through the public W8A8 ops: Llama-3-8B's decode shapes at M = 1, 7 and 16 (int8 bit
for bit with the reference, fp8 within test_scaled_mm.py's bound), the same replayed from a CUDA graph, and cuBLAS
again with ``DYNAMO_ONCE_SMALL_M_GEMM=0``; the launchers on every table row and split K; and, on any machine, the
table's choice, the config's checks, the switch and the launchers' argument errors. The kernels' indexing and
epilogue are also checked without a GPU, in Triton's interpreter (test_small_m_gemm_interpreted.py).
"""

import functools
import importlib

import pytest
import torch
from ops_testing import spy_on_rows
from test_scaled_mm import U32, U_OUT, _bound

import ops
from dispatcher import envs
from ops.small_m_gemm import (INT8_TRITON_MAX_M, SMALL_M_MAX, SMALL_M_TABLE, SmallMConfig, preload_steps, tma_operands,
                              triton_max_m)

scaled_mm = importlib.import_module("ops.scaled_mm")

FP8, INT8, BF16 = ops.FP8_DTYPE, torch.int8, torch.bfloat16
QDTYPES = [pytest.param(INT8, id="int8"), pytest.param(FP8, id="fp8")]
# Llama-3-8B's linear layers as (K, N): qkv, o, gate_up, down.
SHAPES_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
SHAPE_IDS = [f"{k}to{n}" for k, n in SHAPES_8B]
DECODE_M = [1, 7, 16]
# (a_scale, w_scale, out_dtype, bias): the fp8 checkpoints' per-tensor layout; int8's per token x per channel.
VARIANTS = [("tensor", "tensor", torch.bfloat16, False), ("token", "channel", torch.float32, True)]
VARIANT_IDS = ["per-tensor-bf16", "token-channel-fp32-bias"]
TABLE_CONFIGS = list(dict.fromkeys(rule.config for rule in SMALL_M_TABLE if rule.config is not None))
SPLIT_CONFIGS = [SmallMConfig(1, 16, 256, SPLIT_K=4, DOT=False), SmallMConfig(16, 32, 128, SPLIT_K=3),
                 SmallMConfig(16, 32, 128, SPLIT_K=3, SERIAL=True), SmallMConfig(16, 32, 256, SPLIT_K=2, SERIAL=True)]


@functools.cache
def _weight(qdtype, n, k):
    """One weight per dtype and shape for the whole session (the 8B's gate_up is 117 MB in int8)."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    if qdtype == INT8:
        return torch.randint(-128, 128, (n, k), generator=g, device="cuda", dtype=torch.int16).to(INT8)
    s = 8.0 if qdtype == FP8 else 1.0  # fp8: across e4m3's range, none past 448
    return (s * torch.randn(n, k, generator=g, device="cuda")).clamp(-448, 448).to(qdtype)


def _args(qdtype, m, k, n, a_scaling, w_scaling, out_dtype, bias, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + m)
    if qdtype == INT8:
        a = torch.randint(-128, 128, (m, k), generator=g, device="cuda", dtype=torch.int16).to(INT8)
    else:
        a = (8 * torch.randn(m, k, generator=g, device="cuda")).clamp(-448, 448).to(FP8)
    unit = 0.01 if qdtype == INT8 else 1.0  # int8: amax / 127 of O(1) values, as a quantization gives
    a_scale = unit * (0.01 + torch.rand(*((m, 1) if a_scaling == "token" else (1,)), generator=g, device="cuda"))
    w_scale = unit * (0.01 + torch.rand(n if w_scaling == "channel" else 1, generator=g, device="cuda"))
    b = torch.randn(n, generator=g, device="cuda").to(out_dtype) if bias else None
    return [a, _weight(qdtype, n, k), a_scale, w_scale, out_dtype, b]


def _op(qdtype):
    return ops.int8_scaled_mm if qdtype == INT8 else ops.fp8_scaled_mm


def _assert_matches_reference(qdtype, out, args):
    """int8: bit for bit (an exact int32 sum, then the reference's epilogue op for op). fp8: test_scaled_mm's CUDA
    bound, |sa sw| sum |a w| + |bias| times 2**-10 + 2 (K - 1) u (+ the epilogue's 3u), then the output roundings:
    the 2**-10 covers Hopper's fp8 MMAs (about 14 bits kept inside an MMA) that tl.dot uses as cuBLAS does; the
    GEMV form's fp32 sums, and the reference's, are within (K - 1) u each."""
    a, w, a_scale, w_scale, out_dtype, bias = args
    ref = (ops.int8_scaled_mm_ref if qdtype == INT8 else ops.fp8_scaled_mm_ref)(*args)
    assert out.dtype == out_dtype and out.shape == ref.shape and out.is_contiguous()
    if qdtype == INT8:
        assert torch.equal(out, ref)
        return
    k = a.shape[1]
    tol = _bound(a, w, a_scale, w_scale, bias, k, 2.0**-10 + 2 * (k - 1) * U32)
    tol = tol + U_OUT[out_dtype] * (2 * ref.double().abs().cpu() + tol)
    err = (out.double() - ref.double()).abs().cpu()
    assert (err <= tol).all(), f"max err / tol = {(err / tol).max().item():.3g}"
    # Far inside the bound on average: a systematic error (a scale twice, a row's scale on another row) is not.
    assert (out.double() - ref.double()).pow(2).mean().sqrt() <= ref.double().pow(2).mean().sqrt() / 64


def _assert_mm_within_bound(out, a, w, bias):
    """bf16: exact products, fp32 sums (within (K - 1) u of sum |a w|; doubled for the tensor cores' adds, which
    need not round to nearest), the bias add (u), then the cast to bf16 (2**-8 of the value)."""
    k = a.shape[1]
    exact = a.double() @ w.double().t() + (bias.double() if bias is not None else 0)
    s = a.double().abs() @ w.double().abs().t() + (bias.double().abs() if bias is not None else 0)
    fp32 = (2 * (k + 1)) * U32 * s
    tol = fp32 + U_OUT[out.dtype] * (exact.abs() + fp32)
    err = (out.double() - exact).abs()
    assert out.dtype == a.dtype and out.shape == exact.shape
    assert (err <= tol).all(), f"max err / tol = {(err / tol).max().item():.3g}"


@pytest.fixture
def triton_calls(monkeypatch):
    """The M of every call the public ops make to the Triton kernel's launcher."""
    return spy_on_rows(monkeypatch, scaled_mm, "small_m_scaled_mm")


def _needs_fp8(qdtype):
    if qdtype == FP8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability 8.9 (else the reference runs)")


@pytest.mark.cuda
@pytest.mark.parametrize("a_scaling,w_scaling,out_dtype,bias", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("k,n", SHAPES_8B, ids=SHAPE_IDS)
@pytest.mark.parametrize("m", DECODE_M)
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_public_ops_take_the_kernel_on_8b_shapes(qdtype, m, k, n, a_scaling, w_scaling, out_dtype, bias,
                                                 triton_calls):
    _needs_fp8(qdtype)
    args = _args(qdtype, m, k, n, a_scaling, w_scaling, out_dtype, bias)
    out = _op(qdtype)(*args)
    # fp8 takes the kernel where the table says it wins (down_proj's shape), cuBLAS elsewhere
    assert triton_calls == ([m] if ops.small_m_config(m, n, k, qdtype) is not None else [])
    _assert_matches_reference(qdtype, out, args)


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", SHAPES_8B, ids=SHAPE_IDS)
@pytest.mark.parametrize("m", DECODE_M)
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_public_ops_replayed_from_a_cuda_graph(qdtype, m, k, n, triton_calls):
    """Captured once (no host sync in the launch, the workspace from the graph's pool), replayed twice on new
    inputs copied into the captured ones: each time the new inputs' results (split K: the in-kernel reduction's
    counters reset themselves)."""
    _needs_fp8(qdtype)
    static = _args(qdtype, m, k, n, "token", "channel", torch.bfloat16, True, seed=1)
    op = _op(qdtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the first call compiles; capture wants warm-up calls off the capture stream
        op(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(*static)
    for seed in (2, 3):
        fresh = _args(qdtype, m, k, n, "token", "channel", torch.bfloat16, True, seed=seed)
        for dst, src in zip(static, fresh):
            if isinstance(dst, torch.Tensor) and dst is not src:  # the weight is the same tensor
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches_reference(qdtype, out, static)
    assert triton_calls == ([m, m] if ops.small_m_config(m, n, k, qdtype) is not None else [])


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", SHAPES_8B, ids=SHAPE_IDS)
@pytest.mark.parametrize("m", DECODE_M)
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_switched_off_the_ops_take_cublas(monkeypatch, qdtype, m, k, n, triton_calls):
    _needs_fp8(qdtype)
    monkeypatch.setenv("DYNAMO_ONCE_SMALL_M_GEMM", "0")
    args = _args(qdtype, m, k, n, "token", "channel", torch.bfloat16, True)
    out = _op(qdtype)(*args)
    assert triton_calls == []
    _assert_matches_reference(qdtype, out, args)


@pytest.mark.cuda
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_larger_m_takes_cublas(qdtype, triton_calls):
    _needs_fp8(qdtype)
    m = INT8_TRITON_MAX_M + 1 if qdtype == INT8 else SMALL_M_MAX + 1
    args = _args(qdtype, m, 4096, 4096, "token", "channel", torch.bfloat16, False)
    _assert_matches_reference(qdtype, _op(qdtype)(*args), args)
    assert triton_calls == []


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [INT8, FP8, BF16], ids=["int8", "fp8", "bf16"])
@pytest.mark.parametrize("config", TABLE_CONFIGS + SPLIT_CONFIGS, ids=str)
def test_launchers_on_every_config(config, dtype):
    """M = 5 (several row blocks of the GEMV rows), K = 1040 and N = 272: multiples of 16, of no larger block."""
    _needs_fp8(dtype)
    m, k, n = 5, 1040, 272
    if dtype == BF16:
        a = torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda").to(BF16)
        w, b = _weight(BF16, n, k), torch.randn(n, device="cuda").to(BF16)
        _assert_mm_within_bound(ops.small_m_mm(a, w, b, config), a, w, b)
        return
    args = _args(dtype, m, k, n, "token", "channel", torch.float16, True)
    for _ in range(2):  # SERIAL: the arrival counters reset themselves
        _assert_matches_reference(dtype, ops.small_m_scaled_mm(*args, config=config), args)


# The unrolled GEMV's tiles: the table's M = 1 rows for each dtype (int8 sums four products an instruction, dp4a,
# where each thread holds 16 adjacent bytes of a row, and falls back to widened products elsewhere; both exact).
GEMV_CASES = [(dtype, rule.config) for dtype in (INT8, FP8, BF16)
              for rule in dict.fromkeys(r for r in SMALL_M_TABLE if r.max_m == 1 and dtype in r.dtypes)]


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", SHAPES_8B, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype,config", GEMV_CASES,
                         ids=[f"{str(d)[6:]}-{c.BLOCK_N}x{c.BLOCK_K}w{c.num_warps}" for d, c in GEMV_CASES])
def test_gemv_forms_on_8b_shapes(dtype, config, k, n):
    """Each of the table's M = 1 tiles on every 8B shape, whichever shape its rule serves, at M = 1 and 3 (one row a
    program); int8 bit for bit, fp8 / bf16 within their fp32-sum bounds."""
    _needs_fp8(dtype)
    for m in (1, 3):
        if dtype == BF16:
            a = torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(m), device="cuda").to(BF16)
            w = _weight(BF16, n, k)
            _assert_mm_within_bound(ops.small_m_mm(a, w, config=config), a, w, None)
            continue
        args = _args(dtype, m, k, n, "token", "channel", torch.bfloat16, False)
        _assert_matches_reference(dtype, ops.small_m_scaled_mm(*args, config=config), args)


# The unrolled GEMV over several rows of a a program: 2, 4 and 8 rows on 8-bit (4-16 weight rows) and bf16 tiles
ROWS_CASES = [SmallMConfig(rows, b_n, b_k, DOT=False, num_warps=4, num_stages=1, UNROLL=True)
              for rows in (2, 4, 8) for b_n, b_k in ((8, 512), (2, 1024))]


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", SHAPES_8B, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [INT8, FP8, BF16], ids=["int8", "fp8", "bf16"])
@pytest.mark.parametrize("config", ROWS_CASES, ids=lambda c: f"rows{c.BLOCK_M}-{c.BLOCK_N}x{c.BLOCK_K}")
def test_gemv_rows_on_8b_shapes(config, dtype, k, n):
    """Each weight tile into 2-8 rows' sums: at M = 1, 3, 8 and 11 (rows past M masked, several row blocks), on
    every 8B shape, per-token and per-channel scales with a bias; int8 (dp4a) bit for bit, fp8 / bf16 within their
    fp32-sum bounds."""
    _needs_fp8(dtype)
    for m in (1, 3, 8, 11):
        if dtype == BF16:
            a = torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(m), device="cuda").to(BF16)
            w, b = _weight(BF16, n, k), torch.randn(n, device="cuda").to(BF16)
            _assert_mm_within_bound(ops.small_m_mm(a, w, b, config=config), a, w, b)
            continue
        args = _args(dtype, m, k, n, "token", "channel", torch.bfloat16, True)
        _assert_matches_reference(dtype, ops.small_m_scaled_mm(*args, config=config), args)


@pytest.mark.cuda
@pytest.mark.parametrize("config", [c for d, c in GEMV_CASES if d == INT8] + ROWS_CASES[::2],
                         ids=lambda c: f"rows{c.BLOCK_M}-{c.BLOCK_N}x{c.BLOCK_K}w{c.num_warps}")
def test_int8_gemv_on_unaligned_rows(config):
    """Rows 16-byte aligned or not (K = 4100: a row stride of 4100 bytes), in a masked tail or not, and an activation
    that starts 1 byte into its storage: bit for bit."""
    for k in (4096 + 4, 4096 + 64):
        args = _args(INT8, 2, k, 96, "token", "channel", torch.float32, True)
        _assert_matches_reference(INT8, ops.small_m_scaled_mm(*args, config=config), args)
    args = _args(INT8, 2, 4097, 96, "token", "channel", torch.float32, True)
    args[0], args[1] = args[0][:, 1:], args[1][:, 1:].contiguous()  # a: K = 4096, its data 1 byte past 16-aligned
    _assert_matches_reference(INT8, ops.small_m_scaled_mm(*args, config=config), args)


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", SHAPES_8B, ids=SHAPE_IDS)
@pytest.mark.parametrize("m", [1, 16, 64, 128])  # 64, 128: bf16's down_proj rows past 32 (the rest cuBLAS)
def test_small_m_mm_on_8b_shapes(m, k, n):
    a = torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(m), device="cuda").to(BF16)
    w = _weight(BF16, n, k)
    _assert_mm_within_bound(ops.small_m_mm(a, w), a, w, None)


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", [(2048, 3072), (8192, 2048)], ids=["qkv_1b", "down_1b"])
@pytest.mark.parametrize("m", [17, 32])
def test_small_m_mm_on_the_1b_narrow_shapes(m, k, n):
    """The table's rows for Llama-3.2-1B's qkv and down_proj at 17-32 tokens (swapped tiles read by descriptors, the
    down over two splits summed in the kernel), as the public op runs them: within the fp32 accumulation's bound,
    twice (the split tile's arrival counters reset themselves)."""
    a = torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(m), device="cuda").to(BF16)
    w = _weight(BF16, n, k)
    config = ops.small_m_config(m, n, k, BF16, max_m=triton_max_m(BF16))
    assert config is not None and config.TMA and all(d is not None for d in tma_operands(a, w, config))
    for _ in range(2):
        _assert_mm_within_bound(ops.small_m_mm(a, w), a, w, None)


# Dot tiles read by tensor descriptors (TMA): unswapped and swapped, one and two (summed in the kernel) K splits,
# at the decode sizes where the wide tiles run, on every 8B shape (N and K multiples of every block: no zero-filled
# tail; test_small_m_gemm_interpreted.py has the tails).
TMA_CONFIGS = [SmallMConfig(128, 128, 64, num_warps=8, num_stages=5, TMA=True),
               SmallMConfig(64, 128, 128, num_warps=4, num_stages=4, SWAP=True, TMA=True),
               SmallMConfig(64, 64, 128, SPLIT_K=2, num_warps=4, num_stages=5, SERIAL=True, TMA=True)]


@pytest.mark.cuda
@pytest.mark.parametrize("k,n", SHAPES_8B, ids=SHAPE_IDS)
@pytest.mark.parametrize("m", [5, 64, 128])
@pytest.mark.parametrize("config", TMA_CONFIGS, ids=str)
def test_tma_tiles_on_8b_shapes(config, m, k, n):
    """bf16 within the fp32 accumulation's bound and int8 bit for bit (twice: the split tile's arrival counters reset
    themselves), the operands read through descriptors."""
    a = torch.randn(m, k, generator=torch.Generator(device="cuda").manual_seed(m), device="cuda").to(BF16)
    w = _weight(BF16, n, k)
    assert all(d is not None for d in tma_operands(a, w, config))
    _assert_mm_within_bound(ops.small_m_mm(a, w, None, config), a, w, None)
    args = _args(INT8, m, k, n, "token", "channel", torch.float16, True)
    for _ in range(2):
        _assert_matches_reference(INT8, ops.small_m_scaled_mm(*args, config=config), args)


def test_the_table_covers_small_m_and_leaves_larger_m_to_cublas():
    """Every small M has a config but the shapes where cuBLAS measured as fast: fp8's gate-up and o (its down_proj and
    qkv take the kernel); bf16 takes it on every 8B shape (N >= 4096) and on narrower ones where K >= N (at its
    largest M, 128, on the 8B's down_proj and lm_head alone). At M = 1
    every shape of every dtype takes the unrolled GEMV; at M = 2 the 8B's int8 and bf16 shapes do, but bf16's gate-up
    and lm_head (the swapped dot tiles)."""
    for dtype in (INT8, FP8, BF16, torch.float16):
        largest = max(rule.max_m for rule in SMALL_M_TABLE if dtype in rule.dtypes)
        for k, n in SHAPES_8B + [(4096, 128256)]:  # and the lm_head
            expected = {INT8: True, FP8: k >= 2 * n or n == 6144}.get(dtype, n >= 4096 or k >= n)
            assert all((ops.small_m_config(m, n, k, dtype) is not None) == expected for m in range(3, SMALL_M_MAX + 1))
            two = ops.small_m_config(2, n, k, dtype)
            gemv = dtype == INT8 or (dtype != FP8 and n not in (28672, 128256))
            assert (two is not None and two.UNROLL) == gemv and (two is not None) == (gemv or expected)
            one = ops.small_m_config(1, n, k, dtype)
            assert one is not None and one.UNROLL
            assert ops.small_m_config(SMALL_M_MAX + 1, n, k, dtype) is None
            at_largest = ops.small_m_config(largest, n, k, dtype, max_m=largest)  # bf16's 128: its down and lm_head
            assert (at_largest is not None) == (dtype in (INT8, FP8) or (k, n) in ((14336, 4096), (4096, 128256)))
            assert ops.small_m_config(largest + 1, n, k, dtype, max_m=largest + 1) is None
    assert ops.small_m_config(1, 4096, 4096, torch.float32) is None


def test_bf16_takes_the_swapped_tiles_up_to_its_range_on_8b_shapes():
    """bf16 / fp16 run the kernel up to ``triton_max_m`` (128): at 17-32 rows every 8B shape (N >= 4096, the lm_head
    too) and the 1B's qkv and down take the swapped dot tiles (the 1B's down over two splits, both by descriptors),
    the 1B's o_proj cuBLAS; at 33-128 the 8B's down_proj and lm_head alone (and at 33-64 its o_proj and the 1B's
    lm_head, K 2048); the 1B's narrow shapes past 32 and every shape past 128 cuBLAS."""
    lm_8b, lm_1b, down_8b = (4096, 128256), (2048, 128256), (14336, 4096)
    for dtype in (BF16, torch.float16):
        top = triton_max_m(dtype)
        assert top == 128 and top > SMALL_M_MAX
        for k, n in SHAPES_8B + [lm_8b, lm_1b, (2048, 3072), (2048, 2048), (8192, 2048)]:
            for m in (SMALL_M_MAX + 1, 32):
                config = ops.small_m_config(m, n, k, dtype, max_m=top)
                assert (config is not None and config.SWAP and config.BLOCK_M == 32) == (n >= 3072 or k == 4 * n)
                if n < 4096 and config is not None:  # the 1B's narrow rows: descriptors, its down over two splits
                    assert config.TMA and (config.SPLIT_K, config.SERIAL) == ((2, True) if k == 4 * n else (1, False))
            for m in (33, 64):
                taken = (k, n) in (lm_8b, lm_1b, down_8b, (4096, 4096))
                assert (ops.small_m_config(m, n, k, dtype, max_m=top) is not None) == taken
            for m in (65, top):
                assert (ops.small_m_config(m, n, k, dtype, max_m=top) is not None) == ((k, n) in (lm_8b, down_8b))
            assert ops.small_m_config(top + 1, n, k, dtype, max_m=top) is None
    # the small_m_linear pass rewrites compiles up to the same size (the dispatcher names no ops module)
    from dispatcher.passes import small_m_linear
    assert small_m_linear.MAX_TOKENS == triton_max_m(BF16)
    assert ops.small_m_config(0, 4096, 4096, INT8) is None


def test_config_checks():
    with pytest.raises(ValueError, match="BLOCK_N must be a power of 2; got 48"):
        SmallMConfig(16, 48, 64)
    with pytest.raises(ValueError, match="tl.dot .* needs BLOCK_M, BLOCK_N, BLOCK_K >= 16"):
        SmallMConfig(4, 16, 64, DOT=True)
    with pytest.raises(ValueError, match="SPLIT_K and num_stages must be >= 1"):
        SmallMConfig(1, 16, 64, SPLIT_K=0, DOT=False)
    with pytest.raises(ValueError, match="SWAP .* needs DOT=True"):
        SmallMConfig(4, 16, 64, DOT=False, SWAP=True)
    for bad in (dict(DOT=True, BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M=16), dict(SPLIT_K=2)):
        with pytest.raises(ValueError, match="UNROLL .* needs DOT=False, BLOCK_M <= 8 and SPLIT_K=1"):
            SmallMConfig(**{"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 64, "DOT": False, **bad}, UNROLL=True)
    with pytest.raises(ValueError, match="TMA .* needs DOT=True"):
        SmallMConfig(4, 16, 64, DOT=False, TMA=True)
    with pytest.raises(ValueError, match="PRELOAD .* is the unrolled GEMV's"):
        SmallMConfig(16, 32, 128, PRELOAD=2)
    with pytest.raises(ValueError, match="PREFETCH and PRELOAD >= 0"):
        SmallMConfig(1, 16, 64, DOT=False, UNROLL=True, PRELOAD=-1)


def test_preload_takes_at_most_half_of_a_programs_steps_and_none_under_four():
    """What the launcher preloads of ``SmallMConfig.PRELOAD`` at a K: all of a program's steps made the step slower,
    one of two no faster (``preload_steps``' measurements)."""
    two = SmallMConfig(1, 8, 512, DOT=False, UNROLL=True, PRELOAD=2)
    eight = SmallMConfig(1, 8, 512, DOT=False, UNROLL=True, PRELOAD=8)
    assert [preload_steps(two, k) for k in (1024, 1536, 2048, 4096, 14336)] == [0, 0, 2, 2, 2]
    assert [preload_steps(eight, k) for k in (1536, 2048, 3072, 4096, 14336)] == [0, 2, 3, 4, 8]
    assert preload_steps(SmallMConfig(1, 8, 512, DOT=False, UNROLL=True), 4096) == 0


@pytest.mark.parametrize("value,expected", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_switch(monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv("DYNAMO_ONCE_SMALL_M_GEMM", value)
    assert envs.small_m_gemm() is expected


def test_bad_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_SMALL_M_GEMM", "triton")
    with pytest.raises(ValueError, match=r"DYNAMO_ONCE_SMALL_M_GEMM='triton'.*0, 1"):
        envs.small_m_gemm()
    # The ops read it at each call on CUDA only: on the CPU they run the reference whatever it says.
    a, w = torch.zeros(1, 16, dtype=INT8), torch.zeros(8, 16, dtype=INT8)
    assert ops.int8_scaled_mm(a, w, torch.ones(1), torch.ones(1), torch.float32).shape == (1, 8)


def test_cpu_ops_run_the_reference(triton_calls):
    a = torch.ones(3, 32, dtype=INT8)
    ops.int8_scaled_mm(a, torch.ones(8, 32, dtype=INT8), torch.ones(1), torch.ones(1), torch.float32)
    assert triton_calls == []


BAD_LAUNCHES = [
    (dict(a=torch.zeros(2, 32), w=torch.zeros(16, 32)), TypeError, r"a and w must both be one of"),
    (dict(w=torch.zeros(16, 32).to(FP8)), TypeError, r"got torch.int8 and torch.float8_e4m3fn"),
    (dict(w=torch.zeros(16, 48, dtype=INT8)), ValueError, r"a must be \[M, K\] and w \[N, K\]; got \[2, 32\] and"),
    (dict(a_scale=torch.ones(2)), ValueError, r"a_scale must be \[1\] or \[M, 1\] = \[2, 1\]"),
    (dict(w_scale=torch.ones(8)), ValueError, r"w_scale \[1\] or \[N\] = \[16\]; got \[1\] and \[8\]"),
    (dict(a_scale=torch.ones(1).double()), TypeError, r"scales must be float32"),
    (dict(out_dtype=torch.int32), TypeError, r"out_dtype must be one of"),
    (dict(bias=torch.zeros(8)), ValueError, r"bias must be \[N\] = \[16\]; got \[8\]"),
]


@pytest.mark.parametrize("change,exc,match", BAD_LAUNCHES, ids=range(len(BAD_LAUNCHES)))
def test_launcher_errors_name_the_argument(change, exc, match):
    args = dict(a=torch.zeros(2, 32, dtype=INT8), w=torch.zeros(16, 32, dtype=INT8), a_scale=torch.ones(1),
                w_scale=torch.ones(1), out_dtype=torch.bfloat16, bias=None)
    with pytest.raises(exc, match=match):
        ops.small_m_scaled_mm(**{**args, **change})
