"""Every registered ``torch.ops.dynamo_once`` op through ``torch.library.opcheck``, and under symbolic token counts."""

import pytest
import sympy
import torch
from ops_testing import DEVICES

import ops
from torch._dynamo.backends.registry import lookup_backend

HEAD_SIZE = 64
EPS = 1e-6


def _write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``ops.write_kv_cache``, returning the cache it wrote in place (the op returns nothing)."""
    ops.write_kv_cache(kv_cache, k, v, slots)
    return kv_cache


def _samples(num_tokens: int, device: str) -> dict:
    """torch op name -> (functional wrapper, args): one sample call per op; dim 0 of the token (or, for
    paged_decode, sequence) tensors is ``num_tokens``, every other size is fixed."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    def ints(high, *shape, dtype=torch.int64):
        return torch.randint(0, high, shape, generator=g).to(dtype).to(device)

    x, r, w = rand(num_tokens, 96), rand(num_tokens, 96), rand(96)
    cache = ops.compute_cos_sin_cache(HEAD_SIZE, 4096, dtype=torch.bfloat16, device=device)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g).to(device)
    # Paged KV cache: 32 blocks of 16 tokens, 2 KV heads (4 query heads); up to 4 blocks a sequence, which
    # may share blocks. A fixed cache shape across token counts: only dim 0 of the others is dynamic.
    kv_cache = rand(2, 32, 16, 2, HEAD_SIZE)
    slots = torch.randperm(32 * 16, generator=g)[:num_tokens].to(device)
    block_table, seq_lens = ints(32, num_tokens, 4, dtype=torch.int32), 1 + ints(64, num_tokens, dtype=torch.int32)
    # W8A8 GEMMs: a [T, 96] times w [48, 96] (N = 48: no token count of the tests, so w stays static), per-token
    # activation scales [T, 1], per-channel weight scales, a bias: every argument the ops take.
    fp8_a, fp8_w = rand(num_tokens, 96, dtype=ops.FP8_DTYPE), rand(48, 96, dtype=ops.FP8_DTYPE)
    int8_a, int8_w = (ints(256, num_tokens, 96) - 128).to(torch.int8), (ints(256, 48, 96) - 128).to(torch.int8)
    a_scale, w_scale = rand(num_tokens, 1, dtype=torch.float32).abs() + 0.01, rand(48, dtype=torch.float32).abs() + 0.01
    q_scale = torch.tensor([0.02], device=device)
    return {
        "rms_norm": (ops.rms_norm, (x, w, EPS)),
        "gemma_rms_norm": (ops.gemma_rms_norm, (x, w, EPS)),
        "fused_add_rms_norm": (ops.fused_add_rms_norm, (x, r, w, EPS)),
        "gemma_fused_add_rms_norm": (ops.gemma_fused_add_rms_norm, (x, r, w, EPS)),
        "silu_and_mul": (ops.silu_and_mul, (x,)),
        "gelu_and_mul": (ops.gelu_and_mul, (x, "tanh")),
        "rotary_embedding": (
            ops.rotary_embedding,
            (positions, rand(num_tokens, 4 * HEAD_SIZE), rand(num_tokens, 2 * HEAD_SIZE), cache, HEAD_SIZE, True),
        ),
        "static_scaled_fp8_quant": (ops.static_scaled_fp8_quant, (x, torch.tensor([0.02], device=device))),
        "dynamic_scaled_fp8_quant": (ops.dynamic_scaled_fp8_quant, (x,)),
        "dynamic_per_token_scaled_fp8_quant": (ops.dynamic_per_token_scaled_fp8_quant, (x,)),
        "static_scaled_int8_quant": (ops.static_scaled_int8_quant, (x, torch.tensor([0.02], device=device))),
        "dynamic_scaled_int8_quant": (ops.dynamic_scaled_int8_quant, (x,)),
        "fp8_scaled_mm": (ops.fp8_scaled_mm, (fp8_a, fp8_w, a_scale, w_scale, torch.bfloat16, rand(48))),
        "int8_scaled_mm": (ops.int8_scaled_mm, (int8_a, int8_w, a_scale, w_scale, torch.bfloat16, rand(48))),
        "linear": (ops.linear, (x, rand(48, x.shape[1]), rand(48))),
        "gated_linear": (ops.gated_linear, (x, rand(48, x.shape[1]))),
        "rope_linear": (ops.rope_linear, (x, rand(3 * HEAD_SIZE, x.shape[1]), positions, cache, HEAD_SIZE, 2)),
        "norm_linear": (ops.norm_linear, (x, r, w, rand(48, x.shape[1]), EPS, True)),
        "write_kv_cache": (_write_kv_cache, (kv_cache, rand(num_tokens, 2 * HEAD_SIZE), rand(num_tokens, 2 * HEAD_SIZE),
                                             slots)),
        "paged_decode": (ops.paged_decode, (rand(num_tokens, 4 * HEAD_SIZE), kv_cache, block_table, seq_lens, 4,
                                            HEAD_SIZE, HEAD_SIZE**-0.5, 48, 50.0)),
        # One sequence: its T new tokens after 64 cached ones, 8 blocks of the cache's 32; max_query_len is a
        # bound on T (64), not T, so that it is one constant under a symbolic T.
        "paged_prefill": (ops.paged_prefill, (rand(num_tokens, 4 * HEAD_SIZE), kv_cache,
                                              torch.arange(8, dtype=torch.int32, device=device)[None],
                                              torch.tensor([64 + num_tokens], dtype=torch.int32, device=device),
                                              torch.tensor([0, num_tokens], dtype=torch.int32, device=device), 64, 4,
                                              HEAD_SIZE, HEAD_SIZE**-0.5, 48, 50.0)),
        # Fused norm / activation + quant: both quant dtypes, both norm forms, each activation among the six.
        "rms_norm_static_quant": (ops.rms_norm_static_quant, (x, w, EPS, q_scale, ops.FP8_DTYPE)),
        "rms_norm_dynamic_quant": (ops.rms_norm_dynamic_quant, (x, w, EPS, torch.int8, True)),
        "fused_add_rms_norm_static_quant": (ops.fused_add_rms_norm_static_quant,
                                            (x, r, w, EPS, q_scale, torch.int8, True)),
        "fused_add_rms_norm_dynamic_quant": (ops.fused_add_rms_norm_dynamic_quant, (x, r, w, EPS, ops.FP8_DTYPE)),
        "act_and_mul_static_quant": (ops.act_and_mul_static_quant, (x, q_scale, "gelu_tanh", torch.int8)),
        "act_and_mul_dynamic_quant": (ops.act_and_mul_dynamic_quant, (x, "silu", ops.FP8_DTYPE)),
        "gated_scaled_mm_dynamic_quant": (ops.gated_scaled_mm_dynamic_quant,
                                          (int8_a, int8_w, a_scale, w_scale, torch.bfloat16, "silu", torch.int8)),
        "gated_scaled_mm_static_quant": (ops.gated_scaled_mm_static_quant,
                                         (int8_a, int8_w, a_scale, w_scale, torch.float16, "silu", q_scale,
                                          torch.int8)),
        # int8 weights: opcheck's schema test compares inputs with torch.allclose, which has no fp8 kernel
        "static_quant_scaled_mm": (ops.static_quant_scaled_mm, (x, int8_w, q_scale, w_scale, torch.bfloat16,
                                                                rand(48))),
    }


def test_every_registered_op_is_listed_and_sampled():
    registered = {n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("dynamo_once::")}
    # models/ adds its attention op and the tensor-parallel collectives (models/parallel/communication.py and
    # async_tp.py, opchecked in tests/models/test_tensor_parallel.py and test_sequence_parallel.py) to the
    # namespace when a test in this worker imported them.
    models_ops = {"attention", "all_reduce", "all_gather", "reduce_scatter", "rank_shard", "matmul_reduce_scatter",
                  "all_gather_matmul"}
    assert registered - models_ops == set(ops.TORCH_OP_NAMES) == set(_samples(3, "cpu"))


# opcheck's test_schema compares each input before and after the call with torch.allclose, which has no fp8
# kernel ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'); test_scaled_mm.py checks that the fp8
# GEMM leaves its inputs unchanged, bit for bit.
_NO_SCHEMA_CHECK = {"fp8_scaled_mm"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ops.TORCH_OP_NAMES)
def test_opcheck(device, name):
    _, args = _samples(7, device)[name]
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if name in _NO_SCHEMA_CHECK:
        utils = utils[1:]
    torch.library.opcheck(getattr(torch.ops.dynamo_once, name).default, args, test_utils=utils)


class _RecordingBackend:
    """Counts compiles and keeps each graph's ShapeEnv, to read the guards the compile left."""

    def __init__(self, backend: str):
        self.backend = lookup_backend(backend)
        self.frame_count = 0
        self.shape_envs = []

    def __call__(self, gm, example_inputs):
        self.frame_count += 1
        self.shape_envs.append(torch._guards.detect_fake_mode(example_inputs).shape_env)
        return self.backend(gm, example_inputs)


def _pinned(shape_env) -> list:
    """Guards or replacements that fix a symbolic size to a constant (``Eq(s0, 2048)``).

    Other guards (``Eq(Mod(96*s0, 16), 0)`` for alignment, ranges) leave the size free.
    """
    bad = [s for s, v in shape_env.replacements.items() if isinstance(v, sympy.Integer)]
    for guard in shape_env.guards:
        expr = guard.expr
        if isinstance(expr, sympy.Eq) and any(a.is_Symbol for a in expr.args) and any(a.is_number for a in expr.args):
            bad.append(expr)
    return bad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ops.TORCH_OP_NAMES)
def test_symbolic_token_count(device, name):
    """Compiled once with dim 0 dynamic, called with three token counts: one compile, no pinned size."""
    backend = _RecordingBackend("inductor" if device == "cuda" else "aot_eager")
    fn, _ = _samples(3, device)[name]

    def f(*args):
        return fn(*args)

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    for num_tokens in (3, 17, 64):
        args = _samples(num_tokens, device)[name][1]
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == num_tokens:
                torch._dynamo.mark_dynamic(a, 0)
        expected = fn(*args)
        out = compiled(*args)
        for o, e in zip(out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,)):
            assert o.shape == e.shape
    assert backend.frame_count == 1
    assert _pinned(backend.shape_envs[0]) == []
