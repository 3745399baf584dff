"""Shared by the quantized-model tests: tiny W8A8 checkpoints made from a tiny HF Llama, and the fp32 reference.

A checkpoint is the HF model's weights quantized by compressed-tensors' own ``quantize`` (the library that
writes the public FP8 / INT8 Llama 3 checkpoints) with the config it serializes, or, for AutoFP8, by hand
with AutoFP8's names (``quant_method: fp8``, 0-d scales). Static input scales are calibrated as the tools
do: ``amax(|x|) / 448`` (or ``/ 127``) of each linear's inputs over the calibration prompts.

The reference is our floating-point Llama at level 0 with each linear's weights the checkpoint's
dequantized ones and its input quantized-dequantized by the ops' reference functions: the quantized
model's math, in fp32, computed another way (the GEMM on dequantized operands).
"""

import json
import os
import re

import pytest
import torch
from safetensors.torch import save_file

import models_testing
import ops

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import quantize  # noqa: E402

#: name -> (format, weights args, activation args, ignore); None format: AutoFP8 with that activation scheme
SCHEMES = {
    # The neuralmagic ...-FP8 layout: per-tensor weights, static per-tensor activations.
    "fp8-static": ("float-quantized", dict(type="float", strategy="tensor"),
                   dict(type="float", strategy="tensor", dynamic=False), ["lm_head"]),
    # ...-FP8-dynamic: per-channel weights, dynamic per-token activations; one down_proj left in bf16 by regex.
    "fp8-dynamic-token": ("float-quantized", dict(type="float", strategy="channel"),
                          dict(type="float", strategy="token", dynamic=True),
                          ["lm_head", r"re:.*layers\.1\.mlp\.down_proj$"]),
    "fp8-dynamic-tensor": ("float-quantized", dict(type="float", strategy="tensor"),
                           dict(type="float", strategy="tensor", dynamic=True), ["lm_head"]),
    # RedHatAI ...-quantized.w8a8: per-channel int8 weights, dynamic per-token int8 activations; here the
    # LM head quantized too.
    "int8-dynamic-token": ("int-quantized", dict(type="int", strategy="channel"),
                           dict(type="int", strategy="token", dynamic=True), []),
    "int8-static": ("int-quantized", dict(type="int", strategy="tensor"),
                    dict(type="int", strategy="tensor", dynamic=False), ["lm_head"]),
    "autofp8-static": (None, "static", None, ["lm_head"]),
    "autofp8-dynamic": (None, "dynamic", None, ["lm_head"]),
}

MERGED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def compressed_tensors_config(fmt, weights, acts, ignore):
    """``quantization_config`` as compressed-tensors serializes it."""
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(num_bits=8, symmetric=True, **weights),
                                input_activations=QuantizationArgs(num_bits=8, symmetric=True, **acts))
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=ignore,
                                quantization_status="compressed")
    return config.model_dump()


def linear_names(hf):
    return [n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)]


def ignored(name, ignore):
    return any(re.match(i[3:], name) if i.startswith("re:") else i == name for i in ignore)


def calibrate_input_amax(hf, prompts):
    """amax(|x|) of each linear layer's input over the prompts (what a static calibration records)."""
    amax, hooks = {}, []
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, 0.0), args[0].abs().max().item())
            hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for p in prompts:
            hf(torch.tensor([p]))
    for h in hooks:
        h.remove()
    return amax


def _weight_scale(w, kind, per_channel, scale_dtype):
    qmax = 448.0 if kind == "float" else 127.0
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    # Rounded to the stored dtype first, then used to quantize: what a bf16 model's checkpoint holds.
    return (amax / qmax).to(scale_dtype)


def save_quantized(path, hf, name, prompts, scale_dtype=torch.float32):
    """Write ``hf`` quantized by scheme ``name`` (:data:`SCHEMES`) to ``path``: config.json + model.safetensors."""
    fmt, w_args, a_args, ignore = SCHEMES[name]
    os.makedirs(path, exist_ok=True)
    autofp8 = fmt is None
    kind = "float" if autofp8 else w_args["type"]
    per_channel = not autofp8 and w_args["strategy"] == "channel"
    static = (w_args == "static") if autofp8 else not a_args["dynamic"]
    amax = calibrate_input_amax(hf, prompts) if static else {}
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")  # the embedding's, as HF saves it
    for layer in linear_names(hf):
        if ignored(layer, ignore) or f"{layer}.weight" not in tensors:
            continue
        w = tensors[f"{layer}.weight"].float()
        scale = _weight_scale(w, kind, per_channel, scale_dtype)
        args = QuantizationArgs(num_bits=8, type=kind, strategy="channel" if per_channel else "tensor")
        dtype = torch.float8_e4m3fn if kind == "float" else torch.int8
        tensors[f"{layer}.weight"] = quantize(w, scale.float(), None, args, dtype=dtype)
        tensors[f"{layer}.weight_scale"] = scale.reshape(()) if autofp8 else scale
        if static:
            # k_proj and up_proj calibrated apart from their siblings (same input, larger amax): the merged
            # projection must take the largest of its shards' input scales.
            spread = 1.25 if layer.endswith(("k_proj", "up_proj")) else 1.0
            s = torch.tensor([spread * amax[layer] / (448.0 if kind == "float" else 127.0)]).to(scale_dtype)
            tensors[f"{layer}.input_scale"] = s.reshape(()) if autofp8 else s
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    if autofp8:
        config["quantization_config"] = dict(quant_method="fp8", activation_scheme=w_args, ignored_layers=ignore)
    else:
        config["quantization_config"] = compressed_tensors_config(fmt, w_args, a_args, ignore)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return config["quantization_config"]


def tiny_quantized(tmp_path_factory, name):
    """A tiny W8A8 Llama checkpoint (models_testing's HF Llama, quantized by scheme ``name``): its directory."""
    hf = models_testing.save_hf_llama(tmp_path_factory.mktemp("hf"))
    path = tmp_path_factory.mktemp(name)
    save_quantized(path, hf, name, models_testing.PROMPTS)
    return str(path)


def load_tensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def dequantized_state(tensors):
    """The checkpoint's float weights as our model computes with them: ``q * scale``, and for a merged
    projection with per-tensor scales, each shard first requantized to the largest shard scale (the
    layout models/quant_linear.py documents); independent of the loader."""
    out = {k: v for k, v in tensors.items() if not k.endswith(("_scale",)) and v.dtype.is_floating_point
           and v.dtype != torch.float8_e4m3fn}
    groups = {}
    for key in tensors:
        if key.endswith(".weight_scale"):
            layer = key.removesuffix(".weight_scale")
            groups.setdefault(our_module(layer), []).append(layer)
    for layers in groups.values():
        scales = [tensors[f"{l}.weight_scale"].float() for l in layers]
        per_tensor = scales[0].numel() == 1
        s_max = torch.stack([s.reshape(()) for s in scales]).max() if per_tensor else None
        for layer, s in zip(layers, scales):
            q = tensors[f"{layer}.weight"]
            if per_tensor:
                q, s = _requantize(q, s.reshape(1), s_max.reshape(1)), s_max
            out[f"{layer}.weight"] = q.float() * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
    return out


def _requantize(q, s, s_max):
    if torch.equal(s, s_max):
        return q
    x = q.float() * s
    if q.dtype == torch.int8:
        return torch.round(x / s_max).clamp(-128, 127).to(torch.int8)
    return (x / s_max).clamp(-448, 448).to(torch.float8_e4m3fn)


def input_scales(tensors):
    """Static input scale per our layer: the checkpoint's, the max over a merged projection's shards."""
    out = {}
    for key, value in tensors.items():
        if key.endswith(".input_scale"):
            ours = our_module(key.removesuffix(".input_scale"))
            out[ours] = max(out.get(ours, 0.0), value.float().item())
    return out


def our_module(hf_layer):
    """Our module of an HF linear layer: ``...self_attn.k_proj`` -> ``...self_attn.qkv_proj``."""
    parent, _, leaf = hf_layer.rpartition(".")
    ours = MERGED.get(leaf, leaf)
    return f"{parent}.{ours}" if parent else ours


def fake_quant(x, kind, static_scale=None, per_token=False):
    """quantize-dequantize ``x`` with the ops' reference functions."""
    if static_scale is not None:
        s = torch.tensor([static_scale], dtype=torch.float32)
        q = ops.static_scaled_fp8_quant_ref(x, s) if kind == "fp8" else ops.static_scaled_int8_quant_ref(x, s)
    elif kind == "int8":
        q, s = ops.dynamic_scaled_int8_quant_ref(x)
    elif per_token:
        q, s = ops.dynamic_per_token_scaled_fp8_quant_ref(x)
    else:
        q, s = ops.dynamic_scaled_fp8_quant_ref(x)
    return (q.float() * s).to(x.dtype)


def scheme_of(name):
    """``(kind, static, per_token)`` of the activations of scheme ``name``."""
    fmt, w_args, a_args, _ = SCHEMES[name]
    if fmt is None:
        return "fp8", w_args == "static", False
    return ("fp8" if a_args["type"] == "float" else "int8"), not a_args["dynamic"], a_args["strategy"] == "token"


def reference_model(qpath, ref_path, name):
    """Our fp32 Llama with the checkpoint's dequantized weights and fake-quantized linear inputs (level 0)."""
    from dispatcher import CompilationConfig, set_compilation_config
    from models import load_model

    tensors = load_tensors(qpath)
    os.makedirs(ref_path, exist_ok=True)
    save_file(dequantized_state(tensors), os.path.join(ref_path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(qpath, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(os.path.join(ref_path, "config.json"), "w") as f:
        json.dump(config, f)
    with set_compilation_config(CompilationConfig(level=0)):  # eager: the hooks below run on every call
        model = load_model(str(ref_path))
    kind, static, per_token = scheme_of(name)
    scales = input_scales(tensors)
    quantized = {our_module(k.removesuffix(".weight_scale")) for k in tensors if k.endswith(".weight_scale")}
    for module_name, module in model.named_modules():
        if module_name in quantized:
            scale = scales[module_name] if static else None
            module.register_forward_pre_hook(
                lambda mod, args, scale=scale: (fake_quant(args[0], kind, scale, per_token),))
    return model


# Tolerances on the logits against the reference, derived from the formats. Both sides quantize the same
# activations with the same reference functions, so they agree on every 8-bit value as long as the float
# inputs to the quantizers agree. Those differ by fp32 rounding only: the reference multiplies dequantized
# operands, the model scales the fp32 (fp8: exact products) or exact (int8) product of the 8-bit values, so a
# linear's outputs differ by ~K * 2**-24 relative (K <= 128: < 1e-5), which reaches logits of |l| <= 6 as a
# few 1e-6 (measured: at most 2.5e-6 at levels 0, 2 and 3, every scheme): TIGHT, as for the float model.
# A quantizer input within that distance of a rounding boundary may round the other way on one side: one
# activation moves by one unit of its grid, 2**-3 of its magnitude for e4m3 (3 mantissa bits), amax / 127
# for int8 per token. Bumping the largest activation of each layer's input by one unit moves these logits
# by at most 0.35 (fp8) and 0.07 (int8), in the one sequence holding it; the chance of such a flip is
# ~1e-5 per activation (1e-6 relative noise / a 2**-3 unit), ~0.1 per test over its ~1e4 activations.
# So: every sequence's logits within TIGHT but at most one, which is within FLIP_ATOL.
TIGHT = dict(rtol=1e-4, atol=1e-4)
FLIP_ATOL = 0.5


def prefill_logits(llm, prompts):
    """``[prompts, vocab]``: each prompt's last-token logits (models_testing.prefill_logits, stacked)."""
    return torch.stack(models_testing.prefill_logits(llm, prompts))


def cuda_prefill_logits(path, passes, custom_ops=("none",)):
    """The quantized checkpoint at ``path`` in bf16 on the GPU at level 3 (CUDA graphs on), the custom ops
    ``custom_ops`` (default off: a W8A8 checkpoint's default on CUDA turns them on, models.compile_defaults), with
    the graph passes ``passes``: ``(logits, counts, llm)``, each of models_testing.PROMPTS' last-token logits (fp32,
    on the CPU), the passes' counts (``pass_counter``) over the compile, and the LLM."""
    from dispatcher import CompilationConfig, compat
    from dispatcher.passes import pass_counter
    from models import LLM

    torch._dynamo.reset()
    cfg = CompilationConfig(level=3, custom_ops=list(custom_ops), pass_config=passes)
    with compat.fresh_inductor_cache(), pass_counter.record() as counts:
        llm = LLM(path, max_num_tokens=32, compilation_config=cfg, device="cuda", dtype=torch.bfloat16)
        logits = prefill_logits(llm, models_testing.PROMPTS).cpu()
    return logits, counts, llm


def assert_logits_match(got, ref):
    """``got``, ``ref``: ``[sequences, vocab]``; see TIGHT and FLIP_ATOL."""
    diff = (got - ref).abs()
    off = (diff > TIGHT["atol"] + TIGHT["rtol"] * ref.abs()).any(dim=-1)
    assert off.sum() <= 1, f"{int(off.sum())} sequences' logits beyond {TIGHT}: max |diff| {diff.max():.3g}"
    assert diff.max() <= FLIP_ATOL, f"max |diff| {diff.max():.3g}"
