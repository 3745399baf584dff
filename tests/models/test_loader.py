"""load_model: single and sharded checkpoints, built-in names, and every error case, named."""

import json
import re
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import BUILTIN_MODELS, CheckpointError, LlamaForCausalLM, load_model, supported_architectures

from models_testing import save_hf_llama


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_hf_llama(path)
    return str(path)


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def edit_tensors(path, fn):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    fn(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_single_file_maps_hf_names(ckpt):
    model = load_model(ckpt)
    hf = load_file(os.path.join(ckpt, "model.safetensors"))
    layer = model.model.layers[1]
    q = hf["model.layers.1.self_attn.q_proj.weight"]
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight[: q.shape[0]], q, rtol=0, atol=0)
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight[-q.shape[0] // 2:],
                               hf["model.layers.1.self_attn.v_proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight[128:], hf["model.layers.1.mlp.up_proj.weight"], rtol=0, atol=0)


def test_sharded_with_index_and_dtype(tmp_path):
    hf = save_hf_llama(tmp_path / "src")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    a, b = load_model(str(tmp_path / "src")), load_model(str(tmp_path / "sharded"))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    half = load_model(str(tmp_path / "sharded"), dtype="bfloat16")
    assert next(half.parameters()).dtype == torch.bfloat16


def test_index_lists_a_missing_shard(tmp_path):
    hf = save_hf_llama(tmp_path / "src")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    victim = sorted(f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors"))[0]
    os.remove(tmp_path / "sharded" / victim)
    with pytest.raises(CheckpointError, match=f"lists shard.*{victim}"):
        load_model(str(tmp_path / "sharded"))


def test_builtin_names_are_seeded():
    a, b = load_model("tiny-llama"), load_model("tiny-llama")
    torch.testing.assert_close(a.lm_head.weight, b.lm_head.weight, rtol=0, atol=0)
    assert {"tiny-llama", "llama-3.2-1b", "llama-3-8b", "gemma-2-2b"} <= set(BUILTIN_MODELS)


@pytest.mark.cuda
def test_large_builtins_draw_on_their_device_and_stay_seeded(monkeypatch):
    """Above CPU_INIT_MAX_PARAMS the weights are drawn on the GPU: still the same for the same seed."""
    import models.loader as loader

    small = load_model("tiny-llama", device="cuda")
    cpu = load_model("tiny-llama")
    assert torch.equal(small.lm_head.weight.cpu(), cpu.lm_head.weight)  # small: the CPU draw everywhere
    monkeypatch.setattr(loader, "CPU_INIT_MAX_PARAMS", 0)
    a, b = load_model("tiny-llama", device="cuda"), load_model("tiny-llama", device="cuda")
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.lm_head.weight.cpu(), cpu.lm_head.weight)
    assert abs(a.lm_head.weight.float().std().item() - 0.02) < 2e-3


def test_unsupported_architecture_lists_supported(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "c")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["architectures"] = ["MistralForCausalLM"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"unsupported architecture \['MistralForCausalLM'\]; supported: .*LlamaForCausalLM"):
        load_model(path)
    assert "LlamaForCausalLM" in supported_architectures()


def test_missing_tensor(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "c")
    edit_tensors(path, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\): model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(path)


def test_unexpected_tensor(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "c")
    edit_tensors(path, lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected tensor\(s\): model\.layers\.0\.self_attn\.extra\.weight"):
        load_model(path)


def test_shape_mismatch(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "c")
    edit_tensors(path, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(CheckpointError, match=r"shape mismatch: model\.norm\.weight: expected shape \[64\], checkpoint has \[65\]"):
        load_model(path)


def test_dtype_mismatch(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "c")
    edit_tensors(path, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match=r"dtype mismatch: model\.norm\.weight: expected a floating-point .* has I8"):
        load_model(path)


def test_truncated_file(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "c")
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(unreadable or truncated|truncated file)"):
        load_model(path)


def test_garbage_file(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "c")
    open(os.path.join(path, "model.safetensors"), "wb").write(b"\x00" * 7)
    with pytest.raises(CheckpointError, match="unreadable or truncated"):
        load_model(path)


def test_no_weights_no_config_no_such_name(ckpt, tmp_path):
    path = copy_ckpt(ckpt, tmp_path / "c")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors file"):
        load_model(path)
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(path)
    with pytest.raises(CheckpointError, match="neither a checkpoint directory nor a built-in model.*tiny-llama"):
        load_model("tiny-lama")
    open(os.path.join(path, "config.json"), "w").write("{not json")
    with pytest.raises(CheckpointError, match="unreadable config.json"):
        load_model(path)


def test_loads_as_llama(ckpt):
    assert type(load_model(ckpt)) is LlamaForCausalLM


# ---------------------------------------------------------------- quantized checkpoints (W8A8): every error named

@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """A static fp8 compressed-tensors checkpoint of the tiny Llama (quant_testing.py)."""
    from models_testing import PROMPTS
    from quant_testing import save_quantized

    path = tmp_path_factory.mktemp("fp8")
    save_quantized(path, save_hf_llama(tmp_path_factory.mktemp("hf")), "fp8-static", PROMPTS)
    return str(path)


def edit_quant_config(path, fn):
    file = os.path.join(path, "config.json")
    cfg = json.load(open(file))
    fn(cfg["quantization_config"], cfg)
    json.dump(cfg, open(file, "w"))


def _group(qc):
    return qc["config_groups"]["group_0"]


def _int8(qc, dynamic=False, fmt="int-quantized"):
    qc["format"] = fmt
    _group(qc)["weights"]["type"] = "int"
    _group(qc)["input_activations"].update(type="int", dynamic=dynamic)


CONFIG_ERRORS = {
    "block-wise fp8": (lambda qc, _: _group(qc)["weights"].update(strategy="block", block_structure=[128, 128]),
                       r"config_groups\.group_0\.weights: strategy 'block' \(block-wise, block_structure \[128, 128\]\) "
                       r"is not supported; supported: 8-bit symmetric W8A8"),
    "int4": (lambda qc, _: _group(qc)["weights"].update(num_bits=4, type="int"),
             r"group_0\.weights\.num_bits: 4 \(4-bit int\) is not supported; supported: 8-bit"),
    "asymmetric": (lambda qc, _: _group(qc)["input_activations"].update(symmetric=False),
                   r"group_0\.input_activations\.symmetric: False \(asymmetric, with zero points\) is not supported"),
    "group strategy": (lambda qc, _: _group(qc)["weights"].update(strategy="group", group_size=128),
                       r"weights: strategy 'group' \(group_size 128\) is not supported"),
    "weight-only": (lambda qc, _: _group(qc).update(input_activations=None),
                    r"group_0\.input_activations: None \(weight-only quantization\) is not supported"),
    "int8 dynamic per tensor": (lambda qc, _: _int8(qc, dynamic=True),
                                r"input_activations: dynamic strategy 'tensor' is not supported for int8"),
    "int8 in an fp8 format": (lambda qc, _: _int8(qc, fmt="float-quantized"),
                              r"group_0: format 'float-quantized' does not hold int8 weights"),
    "mixed types": (lambda qc, _: _group(qc)["input_activations"].update(type="int"),
                    r"group_0: fp8 weights with int8 activations are not supported"),
    "packed format": (lambda qc, _: qc.update(format="pack-quantized"),
                      r"group_0: format 'pack-quantized' is not supported; supported: float-quantized, int-quantized"),
    "int8 kv cache": (lambda qc, _: qc.update(kv_cache_scheme=dict(num_bits=8, type="int")),
                      r"quantization_config\.kv_cache_scheme: 8-bit int KV-cache quantization is not supported; "
                      r"supported: an fp8 \(e4m3\) KV cache, static per tensor, symmetric"),
    "per-head kv cache": (lambda qc, _: qc.update(kv_cache_scheme=dict(num_bits=8, type="float", strategy="attn_head")),
                          r"kv_cache_scheme: strategy 'attn_head', dynamic False, symmetric True is not supported"),
    "unknown method": (lambda qc, _: qc.update(quant_method="gptq"),
                       r"quantization_config\.quant_method: 'gptq' is not supported; supported: 'compressed-tensors' "
                       r"and 'fp8' \(AutoFP8\)"),
    "AutoFP8 block-wise": (lambda qc, _: (qc.clear(), qc.update(quant_method="fp8", weight_block_size=[128, 128])),
                           r"quantization_config\.weight_block_size: \[128, 128\] \(block-wise fp8\) is not supported"),
    "AutoFP8 scheme": (lambda qc, _: (qc.clear(), qc.update(quant_method="fp8", activation_scheme="per-token")),
                       r"activation_scheme: expected 'static' or 'dynamic'; got 'per-token'"),
    "architecture": (lambda qc, cfg: cfg.update(architectures=["LlavaForConditionalGeneration"]),
                     r"quantization_config given for LlavaForConditionalGeneration, which is not quantized here; "
                     r"quantized architectures: Gemma2ForCausalLM, LlamaForCausalLM"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_quantization_config_errors(fp8_ckpt, tmp_path, case):
    edit, message = CONFIG_ERRORS[case]
    path = copy_ckpt(fp8_ckpt, tmp_path / "c")
    edit_quant_config(path, edit)
    with pytest.raises(CheckpointError, match=r"config\.json: .*" + message):
        load_model(path)


TENSOR_ERRORS = {
    "missing weight_scale": (lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale"),
                             r"1 missing tensor\(s\): model\.layers\.0\.self_attn\.k_proj\.weight_scale"),
    "missing input_scale": (lambda t: t.pop("model.layers.1.mlp.down_proj.input_scale"),
                            r"1 missing tensor\(s\): model\.layers\.1\.mlp\.down_proj\.input_scale"),
    "float weight": (lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 128)}),
                     r"dtype mismatch: model\.layers\.0\.mlp\.down_proj\.weight: expected F8_E4M3 \(fp8 e4m3\), "
                     r"checkpoint has F32"),
    "int8 weight": (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64, dtype=torch.int8)}),
                    r"dtype mismatch: model\.layers\.0\.mlp\.up_proj\.weight: expected F8_E4M3 \(fp8 e4m3\), "
                    r"checkpoint has I8"),
    "e5m2 weight": (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64,
                                                                                       dtype=torch.float8_e5m2)}),
                    r"expected F8_E4M3 \(fp8 e4m3\), checkpoint has F8_E5M2"),
    "int scale": (lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale": torch.ones(1, dtype=torch.int32)}),
                  r"o_proj\.weight_scale: expected a floating-point tensor \(F32/F16/BF16\), checkpoint has I32"),
    "per-tensor scale of 2": (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_scale": torch.ones(2)}),
                              r"shape mismatch: model\.layers\.0\.self_attn\.q_proj\.weight_scale: expected shape \[1\], "
                              r"checkpoint has \[2\]"),
    "per-channel scale": (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale": torch.ones(64, 1)}),
                          r"down_proj\.weight_scale: expected shape \[1\], checkpoint has \[64, 1\]"),
    "unexpected zero point": (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_zero_point": torch.zeros(1)}),
                              r"1 unexpected tensor\(s\): model\.layers\.0\.mlp\.down_proj\.weight_zero_point"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_ERRORS))
def test_quantized_tensor_errors(fp8_ckpt, tmp_path, case):
    edit, message = TENSOR_ERRORS[case]
    path = copy_ckpt(fp8_ckpt, tmp_path / "c")
    edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=r"checkpoint does not match LlamaForCausalLM:\n.*" + message):
        load_model(path)


def test_per_channel_scale_shape_is_checked(tmp_path):
    """Per channel, the scale is [out, 1]: a flat [out] one is named."""
    from models_testing import PROMPTS
    from quant_testing import save_quantized

    save_quantized(tmp_path, save_hf_llama(tmp_path / "hf"), "int8-dynamic-token", PROMPTS)
    edit_tensors(str(tmp_path), lambda t: t.update({"model.layers.1.self_attn.v_proj.weight_scale": torch.ones(32)}))
    with pytest.raises(CheckpointError, match=r"shape mismatch: model\.layers\.1\.self_attn\.v_proj\.weight_scale: "
                                              r"expected shape \[32, 1\], checkpoint has \[32\]"):
        load_model(str(tmp_path))


def test_float_checkpoint_of_a_quantized_config_names_the_weights(ckpt, tmp_path):
    """A quantization_config over float weights (not compressed) fails on the weights' dtype, by name."""
    from quant_testing import compressed_tensors_config

    path = copy_ckpt(ckpt, tmp_path / "c")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"] = compressed_tensors_config(
        "float-quantized", dict(type="float", strategy="tensor"), dict(type="float", strategy="token", dynamic=True),
        ["lm_head"])
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(CheckpointError, match=r"\d+ missing tensor\(s\): .*weight_scale(.|\n)*dtype mismatch: "
                                              r".*\.weight: expected F8_E4M3 \(fp8 e4m3\), checkpoint has F32"):
        load_model(path)


def edit_config(path, **changes):
    """Set config.json fields (``...`` drops one); the file, escaped for a regex."""
    file = os.path.join(path, "config.json")
    cfg = json.load(open(file))
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(file, "w"))
    return re.escape(file)


@pytest.mark.parametrize("changes, message", [
    ({"sliding_window": 16}, r"sliding_window: 16 \(sliding-window attention, e\.g\. Mistral\) is not supported by "
                             r"LlamaForCausalLM \(supported: null, or at least max_position_embeddings=\d+\)"),
    ({"hidden_act": "gelu"}, r"hidden_act: 'gelu' is not supported by LlamaForCausalLM \(supported: 'silu'\)"),
    ({"hidden_size": "4096"}, r"hidden_size: expected an int; got '4096' \(str\)"),
    ({"num_hidden_layers": 2.0}, r"num_hidden_layers: expected an int; got 2\.0 \(float\)"),
    ({"rms_norm_eps": "1e-5"}, r"rms_norm_eps: expected a number; got '1e-5' \(str\)"),
    ({"tie_word_embeddings": "false"}, r"tie_word_embeddings: expected a bool \(true/false\); got 'false'"),
    ({"num_attention_heads": 0}, r"num_attention_heads: expected a positive int; got 0"),
    ({"vocab_size": ...}, r"vocab_size: required field is missing \(expected an int\)"),
    ({"intermediate_size": None}, r"intermediate_size: required field is missing"),
    ({"torch_dtype": "float64", "dtype": ...}, r"torch_dtype: dtype: expected one of"),
])
def test_config_the_model_would_ignore_or_cannot_read(ckpt, tmp_path, changes, message):
    path = copy_ckpt(ckpt, tmp_path / "c")
    file = edit_config(path, **changes)
    with pytest.raises(CheckpointError, match=f"^{file}: {message}"):
        load_model(path)


def test_config_a_mistral_relabelled_llama_is_refused_by_name(ckpt, tmp_path):
    # A Mistral config.json (sliding window below the context) under LlamaForCausalLM.
    path = copy_ckpt(ckpt, tmp_path / "c")
    edit_config(path, model_type="mistral", sliding_window=4, max_position_embeddings=64)
    with pytest.raises(CheckpointError, match=r"config\.json: sliding_window: 4 .*not supported by LlamaForCausalLM"):
        load_model(path)


@pytest.mark.parametrize("changes", [
    {"sliding_window": None},  # Mistral v0.2+: no window
    {"sliding_window": 1 << 20},  # a window past the context changes nothing
    {"sliding_window": 4, "use_sliding_window": False},  # Qwen2-style: window given, off
    {"hidden_act": ...},  # absent: silu
])
def test_config_fields_that_change_nothing_load(ckpt, tmp_path, changes):
    path = copy_ckpt(ckpt, tmp_path / "c")
    edit_config(path, **changes)
    assert isinstance(load_model(path), LlamaForCausalLM)
