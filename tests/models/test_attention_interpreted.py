"""The attention op's CUDA path (Triton cache write, split-KV decode kernel, mixed batches) on CPU tensors
in Triton's interpreter, against the native path. ``make test`` runs these with ``TRITON_INTERPRET=1``.
The kernels alone, against their references: tests/ops/test_kernels_interpreted.py."""

import pytest
import torch
from test_attention import (BLOCK, HEAD, HEADS, SPECS, UNIFIED_SPECS, make_batch, new_layer, prefill_write_off_and_on,
                            unified_and_split)

from models.attention import attention_cuda, attention_native

pytestmark = pytest.mark.interpret

SCALE = HEAD**-0.5
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def both_paths(layer, q, k, v, md, **kw):
    cache = layer.kv_cache.clone()
    out = attention_cuda(q, k, v, layer.kv_cache, md, HEADS, HEAD, SCALE, kw.get("sliding_window"),
                         kw.get("logits_soft_cap"))
    ref = attention_native(q, k, v, cache, md, HEADS, HEAD, SCALE, kw.get("sliding_window"), kw.get("logits_soft_cap"))
    torch.testing.assert_close(layer.kv_cache, cache, rtol=0, atol=0)  # the same cache writes
    return out, ref


# fp32 only: the interpreter's tl.dot of bf16 blocks returns garbage (Triton 3.6; a 16x16 bf16 product is off
# by ~1e10), so bf16 is the CUDA tests' (test_attention.py) alone.
@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 7}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_decode_kernel_matches_native(kw, dtype):
    # Contexts from the first token to several blocks, a partial last block, one longer than a split.
    specs = [(0, 1), (5, 1), (BLOCK * 9 + 2, 1), (70, 1), (BLOCK - 1, 1)]
    layer = new_layer(dtype=dtype, num_blocks=len(specs) * 20, **kw)
    q, k, v, md = make_batch(layer, specs, dtype=dtype)
    assert md.is_decode_only
    out, ref = both_paths(layer, q, k, v, md, **kw)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("unified", [True, False], ids=["unified", "split"])
def test_mixed_batch_matches_native(unified, monkeypatch):
    """Decodes and prompts (whole, and a chunk after cached tokens) in one step: in one launch of the prefill kernel
    (unified, the default for this step), or decodes through the split-KV kernel and prompts through the prefill
    kernel."""
    import models.attention as attention_module

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", unified)
    layer = new_layer()
    q, k, v, md = make_batch(layer, SPECS)
    out, ref = both_paths(layer, q, k, v, md)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model,level,padded,overlap", [
    ("tiny-llama", 0, False, False), ("tiny-llama", 0, True, False), ("tiny-llama", 3, False, False),
    ("tiny-llama", 3, True, False), ("tiny-gemma2", 0, True, False), ("tiny-llama", 3, True, True)])
def test_llm_with_the_cuda_attention_path_generates_the_native_paths_tokens(model, level, padded, overlap,
                                                                           monkeypatch):
    """End to end: the runner's steps (mixed batches, chunked prefill after cached tokens, decodes) through
    the CUDA path's kernels, forced onto CPU tensors, give the native path's greedy tokens; ``padded``:
    with the steps padded as for CUDA graphs (dummy decode sequences in the pad block, padding tokens).
    tiny-gemma2: a sliding window shorter than the prompts, and attention logit soft-capping. ``overlap``:
    async scheduling, decode steps whose input ids come from the device."""
    from models import LLM
    from models.attention import Attention

    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3] * 13, [42]]
    native = LLM(model, level=level, max_num_tokens=16, max_num_seqs=4)
    expected = native.generate(prompts, max_new_tokens=8)

    def forward_impl(self, q, k, v, md):
        return attention_cuda(q, k, v, self.kv_cache, md, self.num_heads, self.head_size, self.scale,
                              self.sliding_window, self.logits_soft_cap)

    monkeypatch.setattr(Attention, "forward_impl", forward_impl)
    llm = LLM(model, level=level, max_num_tokens=16, max_num_seqs=4, async_scheduling=overlap)
    if padded:  # what _setup_cuda_graphs sets on CUDA
        llm.piece_sizes, llm.pad_block = [1, 2, 4, 8, 16], llm.kv_cache.allocate(1)[0]
    assert llm.generate(prompts, max_new_tokens=8) == expected
    assert llm.generate(prompts[:3], max_new_tokens=5) == [t[:5] for t in expected[:3]]  # 3 decodes pad to 4
    assert llm.stats.num_mixed_steps >= 1  # 16 tokens a step: the 13-token prompt is chunked next to decodes


@pytest.mark.parametrize("level", [0, 3])
def test_llm_steps_of_one_shape_take_over_the_last_steps_launches_and_generate_the_native_tokens(level,
                                                                                                  monkeypatch):
    """A long prompt chunked beside the same decodes: consecutive steps of one shape, each taking over the last
    one's plans and bound launches (AttentionMetadata.inherit) on the CUDA path's kernels (forced onto CPU tensors),
    give the native path's greedy tokens."""
    from models import LLM, AttentionMetadata
    from models.attention import Attention

    prompts = [[1, 2, 3], [9, 8], [5, 6, 7, 8] * 16]  # 64 tokens: chunks of 14 beside two decodes
    native = LLM("tiny-llama", level=level, max_num_tokens=16, max_num_seqs=4)
    expected = native.generate(prompts, max_new_tokens=6)

    def forward_impl(self, q, k, v, md):
        return attention_cuda(q, k, v, self.kv_cache, md, self.num_heads, self.head_size, self.scale,
                              self.sliding_window, self.logits_soft_cap)

    taken = []
    inherit = AttentionMetadata.inherit
    monkeypatch.setattr(Attention, "forward_impl", forward_impl)
    monkeypatch.setattr(AttentionMetadata, "inherit", lambda md, last: taken.append(inherit(md, last)) or taken[-1])
    llm = LLM("tiny-llama", level=level, max_num_tokens=16, max_num_seqs=4)
    assert llm.generate(prompts, max_new_tokens=6) == expected
    assert sum(taken) >= 2  # 14-token chunks beside the 2 decodes, step after step


def test_llm_steps_of_recent_layouts_take_their_launches_from_the_cache_and_generate_the_native_tokens(monkeypatch):
    """Two long prompts chunked beside decodes that come and go: steps whose layout a recent step had, not the last,
    take its launch state from the workspace's cache (ops.launch_cache) on the CUDA path's kernels (forced onto CPU
    tensors), and give the native path's greedy tokens."""
    from models import LLM
    from models.attention import Attention

    prompts = [[1, 2, 3], [9, 8], [5, 6, 7, 8] * 12, [4, 2] * 20, [7] * 5]
    native = LLM("tiny-llama", level=0, max_num_tokens=16, max_num_seqs=4)
    expected = native.generate(prompts, max_new_tokens=8)

    def forward_impl(self, q, k, v, md):
        return attention_cuda(q, k, v, self.kv_cache, md, self.num_heads, self.head_size, self.scale,
                              self.sliding_window, self.logits_soft_cap)

    monkeypatch.setattr(Attention, "forward_impl", forward_impl)
    llm = LLM("tiny-llama", level=0, max_num_tokens=16, max_num_seqs=4)
    assert llm.generate(prompts, max_new_tokens=8) == expected
    cache = llm.input_batch.decode_workspace.launches
    assert sum(cache.hits.values()) >= 1 and cache.misses["call"] >= 2, (cache.hits, cache.misses)


@pytest.mark.parametrize("num_decodes", [1, 5])
def test_layers_of_a_step_share_one_plan_from_the_workspace(num_decodes, monkeypatch):
    """Three layers' calls on one step's metadata with a persistent workspace: one plan, the native results (the
    split form: the unified launch has no decode plan)."""
    import dataclasses

    import models.attention as attention_module
    from ops.paged_attention import DecodeWorkspace

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", False)

    specs = [(9, 1), (70, 1), (0, 1), (3, 1), (BLOCK * 5, 1)][:num_decodes] + [(0, 6), (5, 3)]
    layer = new_layer(num_blocks=len(specs) * 20)
    q, k, v, md = make_batch(layer, specs)
    md = dataclasses.replace(md, workspace=DecodeWorkspace(8))
    for _ in range(3):
        out, ref = both_paths(layer, q, k, v, md)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(md._plans) == 1


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 7}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_fused_forms_in_the_op_match_native(kw, splits, monkeypatch):
    """The table's rows fused (merge and cache write in the decode kernel): a decode-only step and a mixed one
    (the decodes' keys and values written by the decode kernel, the prompts' by the cache-write kernel), each
    twice on one step's metadata with a persistent workspace (its counters), the native path's output and cache."""
    import dataclasses

    import models.attention as attention_module
    import ops.paged_attention as pa
    from ops.paged_attention import DecodeWorkspace
    from ops.paged_decode_config import DecodeConfig

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", False)  # the mixed step in the split form
    fused = DecodeConfig(num_splits=splits, BLOCK_N=16, fused_merge=True, fused_write=True)
    monkeypatch.setattr(pa, "decode_config", lambda b, d, *_: fused)
    decodes = [(9, 1), (70, 1), (0, 1), (BLOCK * 5, 1)]
    for specs in (decodes, decodes + [(0, 6), (5, 3)]):
        layer = new_layer(num_blocks=len(specs) * 20, **kw)
        q, k, v, md = make_batch(layer, specs)
        md = dataclasses.replace(md, workspace=DecodeWorkspace(8))
        for _ in range(2):
            out, ref = both_paths(layer, q, k, v, md, **kw)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        (plan,) = md._plans.values()
        assert plan.fused_write and plan.fused_merge == (splits > 1)


@pytest.mark.parametrize("specs", [SPECS, SPECS[:3]], ids=["mixed", "decodes"])
def test_layers_of_a_step_with_their_own_tensors_match_native(specs, monkeypatch):
    """Layers of one step share its ``_StepCall`` (plan, bound launches; strides are read per call): two layers
    with caches of different shapes, q, k, v as column slices of one qkv tensor (strided rows) and an output with
    another row stride, alternating, each the native path's output and cache. A decode config that fuses neither the
    write nor the merge: a mixed step's decode kernel writes and merges anyway (the prompts' rows written by the
    prefill kernel); a decode-only step takes the cache-write launch and the merge kernel."""
    import models.attention as attention_module
    import ops.paged_attention as pa
    from ops.paged_decode_config import DecodeConfig

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", False)  # the split form's launches
    monkeypatch.setattr(pa, "decode_config", lambda b, d, *_: DecodeConfig(num_splits=2, BLOCK_N=16))
    layers = [new_layer("l0", num_blocks=len(specs) * 20), new_layer("l1", num_blocks=len(specs) * 20 + 3)]
    q, k, v, md = make_batch(layers[0], specs)
    layers[1].kv_cache.copy_(torch.randn(layers[1].kv_cache.shape))
    qkv = torch.cat([q, k, v], 1)
    sq, sk, sv = qkv.split([q.shape[1], k.shape[1], v.shape[1]], 1)
    for layer, args in ((layers[0], (q, k, v)), (layers[1], (sq, sk, sv)), (layers[0], (sq, sk, sv)),
                        (layers[1], (q, k, v))):
        cache = layer.kv_cache.clone()
        out = torch.full((q.shape[0], 2 * q.shape[1]), float("nan"))[:, 1:q.shape[1] + 1]
        res = attention_cuda(*args, layer.kv_cache, md, HEADS, HEAD, SCALE, out=out)
        ref = attention_native(*args, cache, md, HEADS, HEAD, SCALE)
        assert res is out
        torch.testing.assert_close(layer.kv_cache, cache, rtol=0, atol=0)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(md.layer_calls) == 2  # one a cache shape
    plan = next(iter(md.layer_calls.values())).plan
    assert plan.fused_write == plan.fused_merge == (len(specs) > 3)


@pytest.mark.parametrize("two_splits", [False, True], ids=["table", "two_splits"])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_prefill_writes_kv_in_the_op_equals_the_separate_write(kw, two_splits, monkeypatch):
    """models.attention.PREFILL_WRITES_KV on: the prompts' keys and values written by the prefill kernel (the
    decodes' by the decode kernel, as in every step with a prompt; the table's config or two fused splits): the
    output and the cache bit for bit those of the switch off (a cache-write launch for the prompts' rows), on a mixed
    step (decodes, whole prompts, a chunk after cached context), a prompts-only one, with k, v column slices of a qkv
    tensor as the models pass them; GQA 2:1."""
    import ops.paged_attention as pa
    from ops.paged_decode_config import DecodeConfig

    if two_splits:
        monkeypatch.setattr(pa, "decode_config", lambda b, d, *_: DecodeConfig(num_splits=2, BLOCK_N=16,
                                                                            fused_merge=True, fused_write=True))
    for specs in (SPECS, [(0, 6), (BLOCK * 3 + 1, 9), (0, 11)]):
        layer = new_layer(num_blocks=len(specs) * 20, **kw)
        outs, caches, q, k, v, md, start = prefill_write_off_and_on(layer, specs, kw, monkeypatch)
        assert torch.equal(outs[1], outs[0]) and not outs[1].isnan().any()
        assert torch.equal(caches[1], caches[0])
        ref = attention_native(q, k, v, start.clone(), md, HEADS, HEAD, SCALE, kw.get("sliding_window"),
                               kw.get("logits_soft_cap"))
        torch.testing.assert_close(outs[1], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_unified_attention_matches_native_and_the_split_form(kw, monkeypatch):
    """models.attention.UNIFIED_ATTENTION: a mixed step whose decodes fit (decodes at the first token and after
    context, whole prompts, a chunk after cached context) and a prompts-only one in one launch of the prefill kernel,
    k, v column slices of a qkv tensor: the native path's output and the split form's, and the split form's cache,
    every new key and value written (no NaN left in the step's slots)."""
    for specs in (UNIFIED_SPECS, [(0, 6), (BLOCK * 3 + 1, 9), (0, 11)]):
        layer = new_layer(num_blocks=len(specs) * 20, **kw)
        outs, caches, q, k, v, md, start = unified_and_split(layer, specs, kw, monkeypatch)
        assert md.decodes_fit_unified() and not outs[0].isnan().any()
        assert torch.equal(caches[0], caches[1])
        ref = attention_native(q, k, v, start.clone(), md, HEADS, HEAD, SCALE, kw.get("sliding_window"),
                               kw.get("logits_soft_cap"))
        torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
