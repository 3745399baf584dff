"""load_model: single and sharded checkpoints, built-in names, and every error case, named."""

import json
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
