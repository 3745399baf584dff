"""An fp8 KV cache (``LLM(kv_cache_dtype="fp8")``, ``ops.kv_quant``): what the cache holds, attention over it,
the engine. The interpreted tests run the CUDA path's kernels on CPU tensors (``TRITON_INTERPRET=1``, fp32 q:
the interpreter's bf16 ``tl.dot`` is wrong); the CUDA ones run them in bf16 on the GPU."""

import dataclasses

import pytest
import torch
from test_attention import BLOCK, HEAD, HEADS, KV_HEADS, SPECS, UNIFIED_SPECS, dense_reference, make_batch, new_layer

import ops
from models import LLM
from models.attention import attention_cuda, attention_native
from models.forward_context import ForwardContext, set_forward_context

FP8 = torch.float8_e4m3fn
# Not 1, and apart: a scale applied the wrong way round (or to the wrong half) is off by 6.8x or more.
K_SCALE, V_SCALE = 0.37, 2.5
SCALE = HEAD**-0.5
DECODES = [(0, 1), (5, 1), (BLOCK * 9 + 2, 1), (70, 1), (BLOCK - 1, 1)]


def fp8_layer(device="cpu", num_blocks=64, **kw):
    layer = new_layer(device=device, dtype=FP8, num_blocks=num_blocks, **kw)
    layer.set_kv_scales(K_SCALE, V_SCALE)
    return layer


def dequantized(layer, md, i):
    """Sequence i's keys and values as the fp8 cache stands for them (times the scales), fp32 ``[L, Hkv, D]``."""
    n = md.seq_lens_cpu[i]
    blocks = md.block_table[i, : (n + BLOCK - 1) // BLOCK].long()
    k, v = (layer.kv_cache[h].index_select(0, blocks).flatten(0, 1)[:n].float() for h in (0, 1))
    return k * K_SCALE, v * V_SCALE


def test_the_cache_holds_the_scaled_values_rounded_to_fp8_and_clamped():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, KV_HEADS * HEAD, generator=g)
    x[0, :4] = torch.tensor([1e4, -1e4, 448 * K_SCALE, 1e-6])
    q = ops.quantize_kv_ref(x, K_SCALE, FP8)
    assert q.dtype == FP8
    assert q[0, 0].item() == 448 and q[0, 1].item() == -448  # clamped, not NaN
    back = q.float() * K_SCALE
    # e4m3: 3 mantissa bits, a relative error of at most 2**-4 (2**-10 absolute in the subnormals)
    assert ((back - x).abs()[1:] <= 2**-4 * x.abs()[1:] + 2**-10 * K_SCALE).all()
    assert torch.equal(ops.quantize_kv_ref(x, K_SCALE, torch.float32), x)  # other dtypes: the values as they are
    layer = fp8_layer()
    slots = torch.randperm(64 * BLOCK, generator=g)[:64]
    ops.write_kv_cache(layer.kv_cache, x, 2 * x, slots, K_SCALE, V_SCALE)
    flat = layer.kv_cache.view(2, -1, KV_HEADS, HEAD)
    assert torch.equal(flat[0][slots].view(torch.uint8), q.view(-1, KV_HEADS, HEAD).view(torch.uint8))
    assert torch.equal(flat[1][slots].float(), ops.quantize_kv_ref(2 * x, V_SCALE, FP8).view(-1, KV_HEADS, HEAD).float())


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 5}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_attention_over_an_fp8_cache_is_attention_over_its_dequantized_values(kw):
    """The op (native path) on a mixed step: each sequence's output is fp64 attention over the keys and values the
    cache holds times its scales, the new tokens' included."""
    layer = fp8_layer(**kw)
    q, k, v, md = make_batch(layer, SPECS)
    with set_forward_context(ForwardContext({"l0": layer}, md)):
        out = torch.ops.dynamo_once.attention(q, k, v, "l0")
    flat = layer.kv_cache.view(2, -1, KV_HEADS, HEAD)
    assert torch.equal(flat[0][md.slot_mapping].float(), ops.quantize_kv_ref(k, K_SCALE, FP8).view(-1, KV_HEADS,
                                                                                                    HEAD).float())
    for i in range(len(SPECS)):
        s, e = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        k_all, v_all = dequantized(layer, md, i)
        ref = dense_reference(q[s:e].view(e - s, HEADS, HEAD), k_all, v_all, SCALE, kw.get("sliding_window"),
                              kw.get("logits_soft_cap"))
        torch.testing.assert_close(out[s:e].view(e - s, HEADS, HEAD).double(), ref, rtol=1e-5, atol=1e-5)


def test_kv_scales_and_cache_dtype_errors_name_the_argument():
    layer = new_layer()
    for bad in (0.0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
            layer.set_kv_scales(bad, 1.0)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3; got 'int8'"):
        LLM("tiny-llama", level=0, kv_cache_dtype="int8")


@pytest.mark.parametrize("level", [0, 3])
def test_llm_with_an_fp8_cache_generates_at_every_level_and_holds_one_byte_an_element(level):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3] * 13, [42]]
    llm = LLM("tiny-llama", level=level, kv_cache_dtype="fp8", max_num_tokens=16, max_num_seqs=4)
    assert llm.kv_cache_dtype == FP8
    assert all(t.dtype == FP8 for t in llm.kv_cache.tensors.values())
    tokens = llm.generate(prompts, max_new_tokens=8)
    eager = LLM("tiny-llama", level=0, kv_cache_dtype="fp8", max_num_tokens=16, max_num_seqs=4)
    assert tokens == eager.generate(prompts, max_new_tokens=8)
    assert LLM("tiny-llama", level=0, max_num_tokens=16).kv_cache_dtype == torch.float32  # auto: the model's


# ----------------------------------------------------------------------------------------- the kernels
def both_paths(layer, q, k, v, md, **kw):
    cache = layer.kv_cache.clone()
    args = (HEADS, HEAD, SCALE, kw.get("sliding_window"), kw.get("logits_soft_cap"))
    out = attention_cuda(q, k, v, layer.kv_cache, md, *args, kv_scales=layer.kv_scales)
    ref = attention_native(q, k, v, cache, md, *args, kv_scales=layer.kv_scales)
    assert torch.equal(layer.kv_cache.view(torch.uint8), cache.view(torch.uint8))  # the same bytes written
    return out, ref


@pytest.mark.interpret
@pytest.mark.parametrize("splits,fused", [(1, False), (4, False), (4, True)], ids=["one-split", "split", "fused"])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 7}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_decode_kernel_over_an_fp8_cache_matches_native(kw, splits, fused, monkeypatch):
    """The split-KV kernel, its merge, and its fused forms (the new keys and values quantized by the kernel)."""
    import ops.paged_attention as pa
    from ops.paged_attention import DecodeWorkspace
    from ops.paged_decode_config import DecodeConfig

    config = DecodeConfig(num_splits=splits, BLOCK_N=16, fused_merge=fused, fused_write=fused)
    monkeypatch.setattr(pa, "decode_config", lambda b, d, *_: config)
    layer = fp8_layer(num_blocks=len(DECODES) * 20, **kw)
    q, k, v, md = make_batch(layer, DECODES)
    md = dataclasses.replace(md, workspace=DecodeWorkspace(8))
    out, ref = both_paths(layer, q, k, v, md, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.interpret
@pytest.mark.parametrize("unified", [True, False], ids=["unified", "split"])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 7}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_mixed_step_over_an_fp8_cache_matches_native(kw, unified, monkeypatch):
    """Decodes and prompts (whole, and chunks after cached tokens) in the unified launch or the split form."""
    import models.attention as attention_module

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", unified)
    layer = fp8_layer(**kw)
    q, k, v, md = make_batch(layer, UNIFIED_SPECS)
    out, ref = both_paths(layer, q, k, v, md, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.interpret
def test_cache_write_kernel_writes_the_references_bytes():
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(2, 32, BLOCK, KV_HEADS, HEAD, dtype=FP8)
    k, v = (torch.randn(40, KV_HEADS * HEAD, generator=g) * 300 for _ in range(2))  # some past 448 * scale
    slots = torch.randperm(32 * BLOCK, generator=g)[:40]
    expected = cache.clone()
    ops.write_kv_cache_ref(expected, k, v, slots, K_SCALE, V_SCALE)
    ops.write_kv_cache_triton(cache, k, v, slots, K_SCALE, V_SCALE)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.interpret
def test_llm_with_the_cuda_attention_path_over_an_fp8_cache_generates_the_native_tokens(monkeypatch):
    """End to end through the CUDA path's kernels (forced onto CPU tensors), chunked prefill beside decodes."""
    from models.attention import Attention

    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3] * 13, [42]]
    native = LLM("tiny-llama", level=0, kv_cache_dtype="fp8", max_num_tokens=16, max_num_seqs=4)
    expected = native.generate(prompts, max_new_tokens=8)

    def forward_impl(self, q, k, v, md, out=None):
        return attention_cuda(q, k, v, self.kv_cache, md, self.num_heads, self.head_size, self.scale,
                              self.sliding_window, self.logits_soft_cap, out, self.kv_scales)

    monkeypatch.setattr(Attention, "forward_impl", forward_impl)
    llm = LLM("tiny-llama", level=0, kv_cache_dtype="fp8", max_num_tokens=16, max_num_seqs=4)
    assert llm.generate(prompts, max_new_tokens=8) == expected


# ----------------------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("specs", [DECODES, SPECS, UNIFIED_SPECS], ids=["decodes", "mixed", "unified"])
def test_cuda_attention_over_an_fp8_cache_matches_native(specs):
    """bf16 q, k, v: the kernels write the reference's bytes and attend within bf16's tolerance of it."""
    layer = fp8_layer(device="cuda", num_blocks=len(specs) * 20)
    q, k, v, md = make_batch(layer, specs, device="cuda", dtype=torch.bfloat16)
    out, ref = both_paths(layer, q, k, v, md)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("row", range(5), ids=lambda i: f"row{i}")
def test_cuda_every_fp8_table_row_attends_as_native(row, monkeypatch):
    """Each of ``DECODE_TABLE_FP8``'s configs (those with ``convert_v``: each value tile converted as loaded) over the
    same batch of decodes: the reference's cache bytes, attention within bf16's tolerance of it."""
    import ops.paged_attention as pa
    from ops.paged_attention import DecodeWorkspace
    from ops.paged_decode_config import DECODE_TABLE_FP8

    assert len(DECODE_TABLE_FP8) == 5  # the parametrization covers every row
    config = DECODE_TABLE_FP8[row].config
    monkeypatch.setattr(pa, "decode_config", lambda b, d, *_: config)
    layer = fp8_layer(device="cuda", num_blocks=len(DECODES) * 20)
    q, k, v, md = make_batch(layer, DECODES, device="cuda", dtype=torch.bfloat16)
    md = dataclasses.replace(md, workspace=DecodeWorkspace(8))
    out, ref = both_paths(layer, q, k, v, md)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_cuda_llm_with_an_fp8_cache_replays_its_graphs_with_the_eager_tokens():
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3] * 13, [42]]
    kw = dict(kv_cache_dtype="fp8", max_num_tokens=16, max_num_seqs=4, dtype=torch.bfloat16, device="cuda")
    graphs = LLM("tiny-llama", level=3, **kw)
    assert graphs.kv_cache_dtype == FP8
    assert graphs.generate(prompts, max_new_tokens=8) == LLM("tiny-llama", level=0, **kw).generate(prompts,
                                                                                                  max_new_tokens=8)


# ----------------------------------------------------------------------------------- the checkpoint's scales
@pytest.fixture(scope="module")
def fp8_kv_ckpt(tmp_path_factory):
    """The tiny Llama's static fp8 compressed-tensors checkpoint with an fp8 ``kv_cache_scheme`` and each attention
    module's ``k_scale`` / ``v_scale`` (stored as ``[]`` and ``[1]``, as llm-compressor writes either)."""
    import json
    import os

    from models_testing import PROMPTS, save_hf_llama
    from quant_testing import save_quantized
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("fp8kv")
    save_quantized(path, save_hf_llama(tmp_path_factory.mktemp("hf")), "fp8-static", PROMPTS)
    file = os.path.join(path, "config.json")
    cfg = json.load(open(file))
    cfg["quantization_config"]["kv_cache_scheme"] = dict(num_bits=8, type="float", strategy="tensor", dynamic=False,
                                                         symmetric=True)
    json.dump(cfg, open(file, "w"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for i in range(cfg["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([0.02 * (i + 2)])
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


def test_an_fp8_kv_checkpoint_sets_each_layers_scales_and_an_fp8_cache(fp8_kv_ckpt):
    llm = LLM(fp8_kv_ckpt, level=0, max_num_tokens=16)
    assert llm.kv_cache_dtype == FP8  # "auto" follows the checkpoint's scheme
    scales = [s for layer in llm.layers.values() for s in (layer.kv_scales.k_scale, layer.kv_scales.v_scale)]
    assert scales == pytest.approx([s for i in range(len(llm.layers)) for s in (0.05 * (i + 1), 0.02 * (i + 2))])
    out = llm.generate([[1, 2, 3, 4, 5]], max_new_tokens=4)
    assert len(out[0]) == 4
    assert LLM(fp8_kv_ckpt, level=0, max_num_tokens=16, kv_cache_dtype="fp8").kv_cache_dtype == FP8


@pytest.mark.parametrize("case", ["missing scale", "scales without the scheme"])
def test_kv_scale_tensor_errors_are_named(fp8_kv_ckpt, tmp_path, case):
    import json
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    from models import CheckpointError, load_model

    path = str(tmp_path / "c")
    shutil.copytree(fp8_kv_ckpt, path)
    if case == "missing scale":
        tensors = load_file(os.path.join(path, "model.safetensors"))
        tensors.pop("model.layers.1.self_attn.v_scale")
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        message = r"1 missing tensor\(s\): model\.layers\.1\.self_attn\.v_scale"
    else:
        cfg = json.load(open(os.path.join(path, "config.json")))
        del cfg["quantization_config"]["kv_cache_scheme"]
        json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
        message = r"unexpected tensor\(s\): model\.layers\.0\.self_attn\.k_scale"
    with pytest.raises(CheckpointError, match=message):
        load_model(path)
