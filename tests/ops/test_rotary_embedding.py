import pytest
import torch
from ops_testing import DEVICES, DTYPE_IDS, DTYPES, NUM_TOKENS, assert_close, compiled

import ops
from dispatcher import CompilationConfig, set_compilation_config

MAX_POSITION = 8192
# (n_q_heads, n_kv_heads, head_size, rotary_dim): tiny, GPT-2-like, Llama-3-8B, partial rotary with an odd
# head count, and a head size that is not a power of 2.
HEADS = [(1, 1, 8, 8), (12, 4, 64, 64), (32, 8, 128, 128), (5, 1, 128, 64), (3, 1, 80, 32)]
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _inputs(t, heads, dtype, device, strided=True):
    n_q, n_kv, hs, _ = heads
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=g).to(device)
    # q and k as vLLM gets them: slices of the qkv projection, so their rows are strided.
    qkv = torch.randn(t, (n_q + 2 * n_kv) * hs, generator=g).to(dtype).to(device)
    q, k, _ = qkv.split([n_q * hs, n_kv * hs, n_kv * hs], dim=-1)
    if not strided:
        q, k = q.contiguous(), k.contiguous()
    return positions, q, k


def _params():
    out = []
    for dev in DEVICES:
        device = dev.values[0]
        for t in NUM_TOKENS:
            for heads in HEADS:
                for dt in DTYPES:
                    if device == "cpu" and t == 4096 and heads[0] > 12 and dt != torch.bfloat16:
                        continue
                    out.append(pytest.param(device, t, heads, dt, marks=dev.marks, id=f"{device}-{t}-{heads}-{DTYPE_IDS[dt]}"))
    return out


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("device,num_tokens,heads,dtype", _params())
def test_rotary_embedding(device, num_tokens, heads, dtype, is_neox):
    positions, q, k = _inputs(num_tokens, heads, dtype, device)
    cache = ops.compute_cos_sin_cache(heads[3], MAX_POSITION, 500000.0, LLAMA3_SCALING, dtype, device)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = ops.rotary_embedding(positions, q, k, cache, heads[2], is_neox)
    q_ref, k_ref = ops.rotary_embedding_ref(positions, q, k, cache, heads[2], is_neox)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert_close(q_out, q_ref)
    assert_close(k_out, k_ref)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # functional
    if heads[3] < heads[2]:  # the dims past rotary_dim pass through unchanged
        hs, rot = heads[2], heads[3]
        assert torch.equal(q_out.unflatten(-1, (-1, hs))[..., rot:], q.unflatten(-1, (-1, hs))[..., rot:])


@pytest.mark.parametrize("device", DEVICES)
def test_3d_inputs(device):
    positions, q, k = _inputs(83, (12, 4, 64, 64), torch.bfloat16, device, strided=False)
    cache = ops.compute_cos_sin_cache(64, MAX_POSITION, dtype=torch.bfloat16, device=device)
    q3, k3 = q.unflatten(-1, (12, 64)), k.unflatten(-1, (4, 64))
    q_out, k_out = ops.rotary_embedding(positions, q3, k3, cache, 64, True)
    assert q_out.shape == q3.shape and k_out.shape == k3.shape
    q_ref, k_ref = ops.rotary_embedding_ref(positions, q, k, cache, 64, True)
    assert_close(q_out.flatten(1), q_ref)
    assert_close(k_out.flatten(1), k_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("heads", [(12, 4, 64, 64), (3, 1, 80, 32)])
def test_compiled(device, dtype, heads):
    positions, q, k = _inputs(83, heads, dtype, device)
    cache = ops.compute_cos_sin_cache(heads[3], MAX_POSITION, dtype=dtype, device=device)
    out = compiled(lambda p, q, k: ops.rotary_embedding(p, q, k, cache, heads[2], True))(positions, q, k)
    ref = ops.rotary_embedding_ref(positions, q, k, cache, heads[2], True)
    assert_close(out[0], ref[0])
    assert_close(out[1], ref[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("heads", [(12, 4, 64, 64), (5, 1, 128, 64)])
def test_native_form_equals_reference(device, heads, is_neox):
    """The module's native form (q and k heads rotated as one tensor, one kernel under Inductor) gives the
    reference's values bit for bit, eager and compiled, 2-d and 3-d; its outputs are views with unit last stride."""
    positions, q, k = _inputs(83, heads, torch.bfloat16, device)
    cache = ops.compute_cos_sin_cache(heads[3], MAX_POSITION, 500000.0, LLAMA3_SCALING, torch.bfloat16, device)
    ref = ops.rotary_embedding_ref(positions, q, k, cache, heads[2], is_neox)
    native = lambda p, q, k: ops.rotary_embedding_native(p, q, k, cache, heads[2], is_neox)
    for out in (native(positions, q, k), compiled(native)(positions, q, k)):
        assert out[0].shape == q.shape and out[1].shape == k.shape
        assert out[0].stride(-1) == 1 and out[1].stride(-1) == 1
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    q3, k3 = native(positions, q.unflatten(-1, (heads[0], -1)), k.unflatten(-1, (heads[1], -1)))
    assert torch.equal(q3.flatten(1), ref[0]) and torch.equal(k3.flatten(1), ref[1])


def test_reference_matches_transformers_llama():
    """Our cache + NeoX rotation equal HF Llama's rotate_half formulation (fp32)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    positions, q, k = _inputs(83, (4, 2, 64, 64), torch.float32, "cpu", strided=False)
    cache = ops.compute_cos_sin_cache(64, MAX_POSITION, 10000.0)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]  # [1, T, 64]
    # HF: q [B, n_heads, T, head_size]
    q_hf, k_hf = (x.unflatten(-1, (-1, 64)).transpose(0, 1)[None] for x in (q, k))
    q_exp, k_exp = llama.apply_rotary_pos_emb(q_hf, k_hf, cos, sin)
    q_ref, k_ref = ops.rotary_embedding_ref(positions, q, k, cache, 64, True)
    torch.testing.assert_close(q_ref, q_exp[0].transpose(0, 1).flatten(1))
    torch.testing.assert_close(k_ref, k_exp[0].transpose(0, 1).flatten(1))


def _hf_llama3_inv_freq(head_dim, base):
    rope_utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    fn = rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    for kwargs in (
        {"rope_parameters": {**LLAMA3_SCALING, "rope_theta": base}},  # transformers >= 5
        {"rope_scaling": dict(LLAMA3_SCALING), "rope_theta": base},
    ):
        try:
            cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, **kwargs)
            return fn(cfg, "cpu")[0]
        except Exception:  # the other transformers major version
            continue
    pytest.skip("no llama3 rope init in this transformers")


def test_llama3_frequencies_match_transformers():
    inv_freq = _hf_llama3_inv_freq(128, 500000.0)
    cache = ops.compute_cos_sin_cache(128, 4, 500000.0, LLAMA3_SCALING)
    # Row 1 holds cos(f), sin(f) for position 1.
    torch.testing.assert_close(torch.atan2(cache[1, 64:], cache[1, :64]), inv_freq.float(), atol=1e-6, rtol=1e-5)


def test_bad_rope_scaling():
    with pytest.raises(ValueError, match="rope_type"):
        ops.compute_cos_sin_cache(64, 16, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.RotaryEmbedding(64, 65, 16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("custom_ops", [["all"], ["none"]])
def test_module(device, custom_ops):
    with set_compilation_config(CompilationConfig(level=0, custom_ops=custom_ops)):
        rope = ops.RotaryEmbedding(128, 128, MAX_POSITION, 500000.0, True, LLAMA3_SCALING, torch.bfloat16).to(device)
    assert rope.cos_sin_cache.shape == (MAX_POSITION, 128) and rope.cos_sin_cache.dtype == torch.bfloat16
    assert "cos_sin_cache" not in rope.state_dict()  # rebuilt, not loaded from checkpoints
    positions, q, k = _inputs(83, (32, 8, 128, 128), torch.bfloat16, device)
    out = rope(positions, q, k)
    ref = ops.rotary_embedding_ref(positions, q, k, rope.cos_sin_cache, 128, True)
    assert_close(out[0], ref[0])
    assert_close(out[1], ref[1])


def test_positions_must_match_the_tokens():
    cache = ops.compute_cos_sin_cache(16, 64)
    with pytest.raises(RuntimeError, match="positions has 4 entries, q 5 tokens"):
        ops.rotary_embedding(torch.arange(4), torch.randn(5, 32), torch.randn(5, 16), cache, 16)


def test_the_op_ties_positions_to_the_token_count_in_a_trace(monkeypatch):
    """On CUDA the op's body is a Triton launch, which relates no shapes: the op itself must tell Dynamo that
    positions and q share the token count, or a level-3 trace whose inputs are separate views (the runner's)
    gets two dynamic sizes, and models.LLM refuses it. Simulated here: the body stubbed as a launch would be."""
    import importlib

    from dispatcher import support_torch_compile

    rotary = importlib.import_module("ops.rotary_embedding")
    monkeypatch.setattr(rotary, "use_triton", lambda q: True)
    monkeypatch.setattr(rotary, "_launch_rotary_embedding",
                        lambda positions, q, k, cache, head_size, is_neox: (torch.empty_like(q), torch.empty_like(k)))
    cache = ops.compute_cos_sin_cache(16, 64)

    @support_torch_compile
    class Rotate(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Embedding(32, 48)

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            q, k = self.proj(input_ids).split([32, 16], -1)
            q, k = ops.rotary_embedding(positions, q, k, cache, 16)
            return q.sum(-1) + k.sum(-1)

    with set_compilation_config(CompilationConfig(level=3, use_cudagraph=False)):
        m = Rotate()
    buf = torch.arange(20)
    with torch.no_grad():
        m(buf[:5], buf[10:15])  # two views of one buffer, as the runner's input_ids and positions
    assert m.num_dynamic_sizes == 1


@pytest.mark.cuda
def test_level3_rotation_is_its_kernel_alone():
    """With the custom ops on at level 3, the op is its one Triton kernel in the compiled piece and Inductor adds no
    kernel of its own for it: the no-op reshape of positions in the op's body, left in the decomposed body, once made
    Inductor copy positions in a kernel of its own, one more launch a layer
    (``triton_poi_fused_rotary_embedding_split_with_sizes`` in an H200 profile of the fp8 8B's step)."""
    import re

    from dispatcher import compat
    from models import LLM

    torch._dynamo.reset()
    cfg = CompilationConfig(level=3, custom_ops=["all"], use_cudagraph=False)
    with compat.fresh_inductor_cache():
        _, code = compat.inductor_code(lambda: LLM("tiny-llama", max_num_tokens=16, compilation_config=cfg,
                                                   device="cuda", dtype=torch.bfloat16))
    source = "\n".join(code)
    assert "_rotary_embedding_kernel" in source
    assert not re.search(r"def triton_\w*rotary_embedding", source), "an Inductor kernel made of the rotary op"
