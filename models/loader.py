"""``load_model``: an HF checkpoint directory (or a built-in name) to one of our models.

A directory holds ``config.json`` (its ``architectures`` picks the class) and
``*.safetensors``: one file, or shards listed in
``model.safetensors.index.json``. HF tensor names map to ours one to one,
except merged projections (``q_proj``/``k_proj``/``v_proj`` -> rows of
``qkv_proj``, see :class:`models.layers.MergedLinear`) and each model's
``checkpoint_name`` renames. Every tensor is checked (headers only) before
any is read: unexpected names, missing names and shape mismatches are
reported together, by name. Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .layers import MergedLinear, default_dtype

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "load_model", "supported_architectures", "checkpoint_layout", "register_architecture",
           "parse_dtype", "build_model"]


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the file or tensor and the problem."""


_ARCHITECTURES: dict[str, Callable[[], type[nn.Module]]] = {}


def register_architecture(name: str, resolve: Callable[[], type[nn.Module]]) -> None:
    """Map an HF ``architectures`` entry to a model class (resolved lazily, so import stays cheap)."""
    _ARCHITECTURES[name] = resolve


def _llama() -> type[nn.Module]:
    from .llama import LlamaForCausalLM

    return LlamaForCausalLM


def _gemma2() -> type[nn.Module]:
    from .gemma2 import Gemma2ForCausalLM

    return Gemma2ForCausalLM


def _llava() -> type[nn.Module]:
    from .llava import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration


register_architecture("LlamaForCausalLM", _llama)
register_architecture("Gemma2ForCausalLM", _gemma2)
register_architecture("LlavaForConditionalGeneration", _llava)


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: torch.dtype | str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(set(_DTYPES))} or a torch.dtype; got {dtype!r}")
    return _DTYPES[key]


def read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: no config.json (expected an HF checkpoint directory)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable config.json: {e}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: expected a JSON object; got {type(config).__name__}")
    return config


def model_class_for(config: dict[str, Any], where: str) -> type[nn.Module]:
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch]()
    raise CheckpointError(f"{where}: unsupported architecture {archs or '(none given)'}; "
                          f"supported: {', '.join(supported_architectures())}")


def build_model(config: dict[str, Any], dtype: torch.dtype | str | None = None,
                device: torch.device | str | None = None, where: str = "config") -> nn.Module:
    """An uninitialized model for an HF config dict, constructed directly in ``dtype`` on ``device``.

    Construct it under the compilation config it should run with (the level
    and custom-op switch are read at construction).
    """
    cls = model_class_for(config, where)
    model_config = cls.config_class.from_hf(config)
    dt = parse_dtype(dtype if dtype is not None else model_config.torch_dtype)
    with default_dtype(dt), torch.device(device or "cpu"):
        model = cls(model_config)
    return model.eval().requires_grad_(False)


def checkpoint_layout(model: nn.Module) -> dict[str, tuple[str, torch.Tensor, int, tuple[int, ...]]]:
    """HF tensor name -> (our parameter name, parameter, first row, expected shape) for every checkpoint tensor."""
    rename = getattr(model, "checkpoint_name", lambda n: n)
    modules = dict(model.named_modules())
    layout: dict[str, tuple[str, torch.Tensor, int, tuple[int, ...]]] = {}
    for name, param in model.named_parameters():  # a tied weight appears once
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        if isinstance(module, MergedLinear):
            parent = module_name.rpartition(".")[0]
            row = 0
            for shard, size in zip(module.shard_names, module.shard_sizes):
                hf = rename(f"{parent}.{shard}.{leaf}" if parent else f"{shard}.{leaf}")
                layout[hf] = (name, param, row, (size, *param.shape[1:]))
                row += size
        else:
            layout[rename(name)] = (name, param, 0, tuple(param.shape))
    return layout


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: unreadable index (expected a JSON object with 'weight_map'): "
                                  f"{type(e).__name__}: {e}") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) that are not in {path}: {', '.join(missing)}")
        return [os.path.join(path, f) for f in files]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors file and no model.safetensors.index.json "
                              "(only safetensors checkpoints are supported)")
    return [os.path.join(path, f) for f in files]


def _open(file: str) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError and OSError
        raise CheckpointError(f"{file}: unreadable or truncated safetensors file: {e}") from None


def load_weights(model: nn.Module, files: list[str], progress: bool = True) -> None:
    """Check every tensor of ``files`` against ``model``, then copy them in (cast to the parameter's dtype)."""
    from tqdm.auto import tqdm

    layout = checkpoint_layout(model)
    # A model whose checkpoints come in several layouts (Llava: transformers 4 and 5 names) maps each
    # stored name to one; ignored names and the layout use the mapped name.
    canonical = getattr(model, "canonical_checkpoint_name", lambda n: n)
    ignored = [re.compile(p) for p in getattr(model, "ignored_checkpoint_names", ())]
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        ignored.append(re.compile(r"^lm_head\.weight$"))  # some tied checkpoints store the copy anyway
    found: dict[str, str] = {}
    unexpected, bad_shape, bad_dtype = [], [], []
    for file in files:
        with _open(file) as f:
            for key in f.keys():
                hf = canonical(key)
                if any(p.search(hf) for p in ignored):
                    continue
                if hf not in layout:
                    unexpected.append(f"{key} (in {os.path.basename(file)})")
                    continue
                found[hf] = file
                sl = f.get_slice(key)
                shape = tuple(sl.get_shape())
                expected = layout[hf][3]
                if shape != expected:
                    bad_shape.append(f"{hf}: expected shape {list(expected)}, checkpoint has {list(shape)}")
                dtype = sl.get_dtype()
                if dtype not in ("F32", "F16", "BF16", "F64"):
                    bad_dtype.append(f"{hf}: expected a floating-point tensor (F32/F16/BF16), checkpoint has "
                                     f"{dtype}")
    missing = sorted(set(layout) - set(found))
    problems = []
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): " + ", ".join(unexpected[:10])
                        + (" ..." if len(unexpected) > 10 else ""))
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): " + ", ".join(missing[:10])
                        + (" ..." if len(missing) > 10 else ""))
    problems += [f"shape mismatch: {m}" for m in bad_shape] + [f"dtype mismatch: {m}" for m in bad_dtype]
    if problems:
        where = os.path.dirname(files[0])
        raise CheckpointError(f"{where}: checkpoint does not match {type(model).__name__}:\n  "
                              + "\n  ".join(problems))
    for file in tqdm(files, desc="loading shards", unit="shard", disable=not progress or None):
        with _open(file) as f:
            for key in f.keys():
                hf = canonical(key)
                if hf not in found:
                    continue
                _, param, row, shape = layout[hf]
                try:
                    tensor = f.get_tensor(key)
                except Exception as e:
                    raise CheckpointError(f"{file}: cannot read tensor {hf} (truncated file?): {e}") from None
                with torch.no_grad():
                    param.data[row:row + shape[0]].copy_(tensor)


#: Models up to this many parameters draw their random weights on the CPU (same weights on every device:
#: tests compare a CPU and a GPU build); larger ones on their own device (8B on the CPU took ~60 s).
CPU_INIT_MAX_PARAMS = 1 << 28


def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) linear and embedding weights, zero biases, from a fixed seed; norms keep their init.

    Up to :data:`CPU_INIT_MAX_PARAMS` parameters, drawn on the CPU in fp32 and copied, so such a model has
    the same weights on every device; larger models draw on their device (fixed per device type).
    """
    params = list(model.parameters())
    device = params[0].device if params else torch.device("cpu")
    if device.type == "meta":  # shapes only: nothing to draw
        return
    on_cpu = device.type == "cpu" or sum(p.numel() for p in params) <= CPU_INIT_MAX_PARAMS
    draw_on = torch.device("cpu") if on_cpu else device
    gen = torch.Generator(device=draw_on).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                w = module.weight
                w.copy_(torch.empty(w.shape, dtype=torch.float32, device=draw_on).normal_(0.0, std, generator=gen))
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()


def load_model(path: str, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None,
               progress: bool = True) -> nn.Module:
    """A model from an HF checkpoint directory, or a built-in name (random weights, fixed seed).

    Args:
        path: checkpoint directory, or one of :data:`models.registry.BUILTIN_MODELS`.
        dtype: parameters' dtype (default: the config's ``torch_dtype``, else float32).
        device: where to build it (default CPU).
        progress: a progress bar over shards.

    Raises:
        CheckpointError: the problem, naming the file or tensor.
    """
    from .registry import BUILTIN_MODELS

    if not os.path.isdir(path):
        if path in BUILTIN_MODELS:
            model = build_model(BUILTIN_MODELS[path], dtype, device, where=path)
            init_random_weights(model, seed=0)
            return model
        raise CheckpointError(f"{path!r} is neither a checkpoint directory nor a built-in model "
                              f"(built-in: {', '.join(BUILTIN_MODELS)})")
    config = read_config(path)
    files = _weight_files(path)
    model = build_model(config, dtype, device, where=path)
    load_weights(model, files, progress=progress)
    logger.info("loaded %s from %d file(s) in %s", type(model).__name__, len(files), path)
    return model
