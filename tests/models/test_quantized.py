"""W8A8 Llama (and Gemma 2): compressed-tensors and AutoFP8 checkpoints, quantized linears, built-ins.

Each scheme's checkpoint is a tiny HF Llama quantized by compressed-tensors (quant_testing.py); its logits at
levels 0, 2 and 3 are compared with an fp32 reference of the same quantized math: our float Llama with the
dequantized weights and the activations quantized-dequantized by the ops' reference functions.
"""

import gc

import pytest
import torch

from dispatcher import CompilationConfig, compilation_counter, set_compilation_config
from models import LLM, CheckpointError, load_model
from models.layers import MergedLinear
from models.quant_linear import QuantLinear, QuantMergedLinear
from models.quantization import QuantizationConfig, QuantScheme, parse_quantization_config

from models_testing import PROMPTS, save_hf_gemma2, save_hf_llama
from quant_testing import (
    FLIP_ATOL, SCHEMES, assert_logits_match, load_tensors, prefill_logits, reference_model, save_quantized, scheme_of,
)

@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama")
    return save_hf_llama(path)


@pytest.fixture(scope="module")
def quantized(hf_llama, tmp_path_factory):
    """scheme name -> (checkpoint dir, reference logits, reference greedy tokens)."""
    cache = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            # One scheme stores its scales in bf16, as checkpoints of bf16 models do.
            save_quantized(path, hf_llama, name, PROMPTS, torch.bfloat16 if name == "fp8-dynamic-token" else
                           torch.float32)
            ref = LLM(reference_model(path, path / "reference", name), max_num_tokens=32)
            cache[name] = str(path), prefill_logits(ref, PROMPTS), ref.generate(PROMPTS, max_new_tokens=8)
        return cache[name]

    return get


EXPECTED = {
    "fp8-static": QuantScheme("fp8", weight_per_channel=False, act_static=True),
    "fp8-dynamic-token": QuantScheme("fp8", weight_per_channel=True, act_static=False, act_per_token=True),
    "fp8-dynamic-tensor": QuantScheme("fp8", weight_per_channel=False, act_static=False),
    "int8-dynamic-token": QuantScheme("int8", weight_per_channel=True, act_static=False, act_per_token=True),
    "int8-static": QuantScheme("int8", weight_per_channel=False, act_static=True),
    "autofp8-static": QuantScheme("fp8", weight_per_channel=False, act_static=True),
    "autofp8-dynamic": QuantScheme("fp8", weight_per_channel=False, act_static=False),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_config_parses_to_its_scheme(quantized, name):
    import json
    import os

    path = quantized(name)[0]
    config = parse_quantization_config(json.load(open(os.path.join(path, "config.json"))))
    assert config.schemes() == {EXPECTED[name]}
    assert config.scheme_for("model.layers.0.self_attn.q_proj") == EXPECTED[name]
    assert config.scheme_for("lm_head") == (EXPECTED[name] if name == "int8-dynamic-token" else None)


def test_scheme_matching_ignore_and_precedence():
    fp8 = QuantScheme("fp8", weight_per_channel=False, act_static=True)
    int8 = QuantScheme("int8", weight_per_channel=True, act_static=False, act_per_token=True)
    per_token = QuantScheme("fp8", weight_per_channel=True, act_static=False, act_per_token=True)
    config = QuantizationConfig("compressed-tensors", (
        (("Linear",), fp8),
        ((r"re:.*mlp\.down_proj$",), int8),
        (("model.layers.1.mlp.down_proj",), per_token),
    ), ignore=("lm_head", r"re:model\.layers\.0\.self_attn\.o"))
    assert config.scheme_for("model.layers.0.self_attn.q_proj") == fp8
    assert config.scheme_for("model.layers.0.mlp.down_proj") == int8  # a regex beats "Linear"
    assert config.scheme_for("model.layers.1.mlp.down_proj") == per_token  # the exact name beats a regex
    assert config.scheme_for("lm_head") is None
    assert config.scheme_for("model.layers.0.self_attn.o_proj") is None  # re: matches from the start
    assert config.scheme_for("model.layers.1.self_attn.o_proj") == fp8


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("level", [0, 2, 3])
def test_logits_and_tokens_match_the_reference(quantized, name, level):
    path, ref_logits, ref_tokens = quantized(name)
    llm = LLM(path, level=level, max_num_tokens=32)
    assert int(llm.level) == level
    assert_logits_match(prefill_logits(llm, PROMPTS), ref_logits)
    assert llm.generate(PROMPTS, max_new_tokens=8) == ref_tokens


def test_layers_dtypes_and_ignored_layers(quantized):
    model = load_model(quantized("fp8-dynamic-token")[0])
    layer0, layer1 = model.model.layers
    assert isinstance(layer0.self_attn.qkv_proj, QuantMergedLinear) and isinstance(layer0.mlp.down_proj, QuantLinear)
    assert layer0.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer0.self_attn.qkv_proj.weight_scale.shape == (64 + 32 + 32,)  # per channel, fp32 (stored bf16)
    assert layer0.self_attn.qkv_proj.weight_scale.dtype == torch.float32
    # ignored by regex and by name: floating point, as stored
    assert type(layer1.mlp.down_proj) is torch.nn.Linear
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype in (torch.float32, torch.bfloat16)
    int8 = load_model(quantized("int8-dynamic-token")[0])
    assert isinstance(int8.lm_head, QuantLinear) and int8.lm_head.weight.dtype == torch.int8


@pytest.mark.parametrize("name", ["fp8-static", "int8-static"])
def test_merged_per_tensor_shards_requantized_to_the_max_scale(quantized, name):
    """q, k and v have different per-tensor scales in the checkpoint: the merged layer keeps the largest, the
    shard that had it bit-exact, the others within half a unit of the new grid; the input scale is the max."""
    path = quantized(name)[0]
    tensors = load_tensors(path)
    qkv = load_model(path).model.layers[0].self_attn.qkv_proj
    prefix = "model.layers.0.self_attn"
    scales = {s: tensors[f"{prefix}.{s}.weight_scale"].float().reshape(()) for s in ("q_proj", "k_proj", "v_proj")}
    assert len(set(scales.values())) == 3  # they do differ
    s_max = max(scales.values())
    assert qkv.weight_scale.shape == (1,) and qkv.weight_scale.item() == s_max
    assert qkv.input_scale.shape == (1,)
    assert qkv.input_scale.item() == max(tensors[f"{prefix}.{s}.input_scale"].float().item() for s in scales)
    rows = 0
    for shard, size in zip(("q_proj", "k_proj", "v_proj"), qkv.shard_sizes):
        original = tensors[f"{prefix}.{shard}.weight"].float() * scales[shard]
        loaded = qkv.weight[rows:rows + size].float() * s_max
        if scales[shard] == s_max:
            assert torch.equal(qkv.weight[rows:rows + size], tensors[f"{prefix}.{shard}.weight"])
        # half a unit of the new grid: int8 s_max / 2; fp8 2**-4 relative (3 mantissa bits), or half the
        # smallest subnormal step (2**-9 s_max) near zero
        half_unit = s_max / 2 if name.startswith("int8") else torch.maximum(original.abs() / 16, 2**-10 * s_max)
        assert ((loaded - original).abs() <= half_unit + 1e-7).all(), shard
        rows += size


def test_tiny_gemma2_fp8(tmp_path):
    """Gemma 2 uses the same layers: a static fp8 checkpoint against its reference, levels 0 and 3."""
    hf = save_hf_gemma2(tmp_path / "hf")
    save_quantized(tmp_path / "q", hf, "fp8-static", PROMPTS)
    ref = LLM(reference_model(tmp_path / "q", tmp_path / "ref", "fp8-static"), max_num_tokens=32)
    ref_logits = prefill_logits(ref, PROMPTS)
    for level in (0, 3):
        llm = LLM(str(tmp_path / "q"), level=level, max_num_tokens=32)
        assert isinstance(llm.model.model.layers[0].mlp.gate_up_proj, QuantMergedLinear)
        assert_logits_match(prefill_logits(llm, PROMPTS), ref_logits)


def test_level3_splits_only_at_attention(quantized):
    """The GEMMs are opaque custom ops inside the Inductor-compiled pieces: 2 attention layers, 3 pieces."""
    path = quantized("fp8-static")[0]
    cfg = CompilationConfig(level=3, use_cudagraph=False)
    with compilation_counter.expect(num_piecewise_graphs_seen=5, num_piecewise_capturable_graphs_seen=3):
        LLM(path, max_num_tokens=32, compilation_config=cfg)


@pytest.mark.parametrize("name", ["fp8-static", "fp8-dynamic-token", "int8-dynamic-token"])
def test_custom_op_switch(quantized, name):
    """The activation quantization is a CustomOp: switched on at level 3 (the torch op in the graph instead of
    Inductor's fusion of the reference) the logits match the reference as well."""
    path, ref_logits, ref_tokens = quantized(name)
    kind = scheme_of(name)[0]
    llm = LLM(path, max_num_tokens=32, compilation_config=CompilationConfig(level=3, custom_ops=[f"+quant_{kind}"]))
    quant = [m for m in llm.model.modules() if type(m).__name__ == f"Quant{kind.upper().replace('INT', 'Int')}"]
    with set_compilation_config(llm.compilation_config):
        assert quant and all(m.enabled() for m in quant)
    assert_logits_match(prefill_logits(llm, PROMPTS), ref_logits)
    assert llm.generate(PROMPTS, max_new_tokens=8) == ref_tokens


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_builtins_generate(kind):
    name = f"tiny-llama-{kind}"
    model = load_model(name)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantMergedLinear) and qkv.weight.dtype == (torch.float8_e4m3fn if kind == "fp8" else
                                                                      torch.int8)
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype in (torch.float32, torch.bfloat16)
    if kind == "fp8":  # per-tensor weights, static per-tensor activations
        assert qkv.weight_scale.shape == (1,) and qkv.input_scale.shape == (1,)
    else:  # per-channel weights, dynamic per-token activations
        assert qkv.weight_scale.shape == (qkv.out_features,) and qkv.input_scale is None
    logits = {}
    for level in (0, 3):
        llm = LLM(name, level=level, max_num_tokens=32)
        assert [len(t) for t in llm.generate(PROMPTS, max_new_tokens=8)] == [8] * len(PROMPTS)
        logits[level] = prefill_logits(llm, PROMPTS)
    # Not the tokens: std-0.02 random weights leave top-2 logit gaps down to 1e-4, within a rounding flip's reach.
    assert_logits_match(logits[3], logits[0])


def test_builtin_weights_are_the_float_builtins_quantized():
    """Same seed, same draws: tiny-llama-int8's dequantized weights are tiny-llama's within half a unit."""
    ref, q = load_model("tiny-llama"), load_model("tiny-llama-int8")
    w = ref.model.layers[1].mlp.down_proj.weight
    layer = q.model.layers[1].mlp.down_proj
    deq = layer.weight.float() * layer.weight_scale[:, None]
    assert ((deq - w).abs() <= layer.weight_scale[:, None] / 2 + 1e-9).all()


def test_merged_shards_quantized_differently_are_refused(quantized, tmp_path):
    import json
    import os
    import shutil

    path = shutil.copytree(quantized("fp8-static")[0], tmp_path / "c")
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"]["ignore"].append("model.layers.0.self_attn.k_proj")
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"config\.json: .*merged projection must be quantized alike.*"
                                              r"model\.layers\.0\.self_attn\.k_proj: not quantized"):
        load_model(str(path))


def test_unquantized_models_keep_float_layers():
    model = load_model("tiny-llama")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, MergedLinear)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_cli_quantization(quantized, capsys):
    from models.cli import main

    assert main(["generate", "--model", "tiny-llama", "--quantization", "fp8", "--level", "0",
                 "--random-prompts", "--num-prompts", "2", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert "model tiny-llama-fp8 (LlamaForCausalLM" in capsys.readouterr().out
    assert main(["diagnose", "--model", "tiny-llama-int8", "--quantization", "int8", "--levels", "0,2",
                 "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert "0 vs 2: 0  agree" in capsys.readouterr().out
    path = quantized("fp8-static")[0]
    assert main(["generate", "--model", path, "--quantization", "fp8", "--level", "0",
                 "--random-prompts", "--num-prompts", "1", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    capsys.readouterr()
    for argv, message in [
        (["--model", "tiny-llama", "--quantization", "int4"],
         "dynamo-once generate: --quantization: expected one of fp8, int8; got 'int4'"),
        (["--model", "gemma-2-2b", "--quantization", "fp8"],
         "dynamo-once generate: --quantization fp8: no built-in 'gemma-2-2b-fp8' (quantized built-ins: "
         "tiny-llama-fp8, tiny-llama-int8, llama-3-8b-fp8, llama-3-8b-int8)"),
        (["--model", path, "--quantization", "int8"], f"dynamo-once generate: --quantization int8: checkpoint {path} is fp8"),
    ]:
        assert main(["generate", *argv, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err == message + "\n", err


def test_8b_builtins_are_w8a8_in_their_layout():
    """Built on the meta device (shapes only): every decoder linear quantized, the LM head and embeddings bf16;
    the 8-bit weights are 6.98 GB, the float ones 2.1 GB (no float copy of the linears is kept)."""
    from models.loader import build_model
    from models.registry import BUILTIN_MODELS

    for kind, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        model = build_model(BUILTIN_MODELS[f"llama-3-8b-{kind}"], device="meta")
        quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert len(quant) == 32 * 4 and all(m.weight.dtype == dtype for m in quant)
        assert sum(m.weight.numel() for m in quant) == 32 * (6144 * 4096 + 4096 * 4096 + 3 * 14336 * 4096)
        floats = [p for p in model.parameters() if p.dtype == torch.bfloat16]
        assert sum(p.numel() for p in floats) == 2 * 128256 * 4096 + 65 * 4096  # embeddings, head, norms
        assert all(m.input_scale is not None for m in quant) == (kind == "fp8")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["fp8-static", "fp8-dynamic-token", "int8-dynamic-token", "int8-static"])
@pytest.mark.parametrize("level", [0, 3])
def test_cuda_matches_the_reference(quantized, name, level):
    """On the GPU (Triton quant kernels, torch._scaled_mm / torch._int_mm), fp32: the CPU reference's logits.

    int8 accumulates exactly in int32, so it meets the CPU bound (TIGHT but one sequence) and gives the same
    tokens. Hopper's fp8 tensor cores accumulate with reduced precision (about 2**-14 relative inside an MMA,
    promoted to fp32 between MMAs; see tests/ops/test_scaled_mm.py), ~100x the CPU's 1e-6: with ~1e4
    activations re-quantized to a 2**-3 grid, a handful of roundings flip in every run. Measured on an H200
    (levels 0 and 3): two of the four sequences within 3e-4 relative, two moved by flips, 0.028-0.060
    relative (||got - ref|| / ||ref|| per sequence), at most 0.28 absolute. So fp8 is held to FLIP_ATOL in
    every sequence and to 0.1 relative (a few flips in a 64-wide hidden state, each 2**-3 of one
    activation); greedy tokens of random weights have near-ties, so they are not compared for fp8.
    """
    path, ref_logits, ref_tokens = quantized(name)
    llm = LLM(path, level=level, max_num_tokens=32, device="cuda")
    got = prefill_logits(llm, PROMPTS).cpu()
    if name.startswith("int8"):
        assert_logits_match(got, ref_logits)
        assert llm.generate(PROMPTS, max_new_tokens=8) == ref_tokens
        return
    diff = (got - ref_logits).abs()
    assert diff.max() <= FLIP_ATOL, f"max |diff| {diff.max():.3g}"
    rel = (got - ref_logits).norm(dim=-1) / ref_logits.norm(dim=-1)
    assert rel.max() <= 0.1, f"relative error of the logits per sequence: {rel.tolist()}"
    assert len(llm.generate(PROMPTS, max_new_tokens=8)[0]) == 8


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_cuda_8b_builtins_generate_without_a_float_copy(kind):
    """llama-3-8b-fp8 / -int8 drawn and quantized on the GPU one layer at a time: the peak stays near the
    model's 9.1 GB (a bf16 copy of the linears would add 14 GB, an fp32 one 28 GB).

    The previous case's LLM goes first: a model and its compiled callable reference each other, so only the
    garbage collector frees them (the "extra 7.5 GiB" int8 seemed to take, running second, was fp8's model)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(f"llama-3-8b-{kind}", level=3, max_num_tokens=64, num_cache_tokens=1024, device="cuda")
    assert torch.cuda.max_memory_allocated() < 12 * 2**30
    out = llm.generate(PROMPTS, max_new_tokens=4)
    assert [len(o) for o in out] == [4] * len(PROMPTS)
