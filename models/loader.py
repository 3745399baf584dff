"""``load_model``: an HF checkpoint directory (or a built-in name) to one of our models.

A directory holds ``config.json`` (its ``architectures`` picks the class) and
``*.safetensors``: one file, or shards listed in
``model.safetensors.index.json``. HF tensor names map to ours one to one,
except merged projections (``q_proj``/``k_proj``/``v_proj`` -> rows of
``qkv_proj``, see :class:`models.layers.MergedLinear`) and each model's
``checkpoint_name`` renames. Every tensor is checked (headers only) before
any is read: unexpected names, missing names, shape and dtype mismatches are
reported together, by name. Nothing is fetched from a hub.

A ``quantization_config`` in ``config.json`` (:mod:`models.quantization`)
builds quantized linear layers (:mod:`models.quant_linear`): their fp8 / int8
weights load as stored (F8_E4M3 / I8, no float cast), their scales as fp32.
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

from dispatcher import get_compilation_config, set_compilation_config

from .compile_defaults import checkpoint_defaults
from .layers import ConfigError, default_dtype
from .quantization import QuantizationError

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


def read_json_object(file: str) -> dict[str, Any]:
    """A checkpoint's JSON file (config.json, generation_config.json, ...) holding one object, or a
    CheckpointError naming the file."""
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable {os.path.basename(file)}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object; got {type(data).__name__}")
    return data


def read_config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: no config.json (expected an HF checkpoint directory)")
    return read_json_object(file)


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

    A ``quantization_config`` makes the targeted linear layers quantized ones (:mod:`models.quantization`).
    Construct it under the compilation config it should run with (the level
    and custom-op switch are read at construction); a W8A8 checkpoint's model fills in that config's
    unset custom-op switch and passes (:mod:`models.compile_defaults`).
    """
    cls = model_class_for(config, where)
    if config.get("quantization_config") is not None and not getattr(cls, "supports_quantization", False):
        quantized = [a for a in supported_architectures() if getattr(_ARCHITECTURES[a](), "supports_quantization", False)]
        raise CheckpointError(f"{_config_file(where)}: quantization_config given for {cls.__name__}, which is not "
                              f"quantized here; quantized architectures: {', '.join(quantized)}")
    try:
        model_config = cls.config_class.from_hf(config)
        if dtype is None and model_config.torch_dtype is not None:
            try:
                parse_dtype(model_config.torch_dtype)
            except ValueError as e:
                raise ConfigError(f"torch_dtype: {e}") from None
        dt = parse_dtype(dtype if dtype is not None else model_config.torch_dtype)
        compilation = get_compilation_config()
        # the model config parsed quantization_config already (None: a floating-point model, or one without it)
        chosen = checkpoint_defaults(compilation, getattr(model_config, "quantization", None), device)
        with default_dtype(dt), torch.device(device or "cpu"), set_compilation_config(chosen):
            model = cls(model_config)
    except (QuantizationError, ConfigError) as e:
        raise CheckpointError(f"{_config_file(where)}: {e}") from None
    return model.eval().requires_grad_(False)


def _config_file(where: str) -> str:
    return os.path.join(where, "config.json") if os.path.isdir(where) else where


Narrow = tuple[int, int, int] | None
"""``(dim, start, length)``: the slice of a checkpoint tensor that a (tensor-parallel) parameter holds."""


def checkpoint_layout(model: nn.Module) -> dict[str, tuple[str, torch.Tensor, int, tuple[int, ...], Narrow]]:
    """HF tensor name -> (our parameter name, parameter, first row, expected shape, slice read) for every
    checkpoint tensor.

    A module with a ``checkpoint_rows(leaf)`` method (merged, quantized and tensor-parallel linears) says
    where each checkpoint tensor of its parameter ``leaf`` goes: ``(HF sibling module name or None for its
    own, first row, shape)``, and for a tensor-parallel layer a fourth entry, ``(dim, start, length)``: only
    that slice of the checkpoint tensor is read (the shape checked is the whole tensor's).
    """
    rename = getattr(model, "checkpoint_name", lambda n: n)
    modules = dict(model.named_modules())
    layout: dict[str, tuple[str, torch.Tensor, int, tuple[int, ...], Narrow]] = {}
    for name, param in model.named_parameters():  # a tied weight appears once
        module_name, _, leaf = name.rpartition(".")
        rows = getattr(modules[module_name], "checkpoint_rows", None)
        if rows is None:
            layout[rename(name)] = (name, param, 0, tuple(param.shape), None)
            continue
        parent = module_name.rpartition(".")[0]
        for shard, row, shape, *narrow in rows(leaf):
            base = module_name if shard is None else f"{parent}.{shard}" if parent else shard
            layout[rename(f"{base}.{leaf}")] = (name, param, row, shape, narrow[0] if narrow else None)
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


_FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


def _dtype_problem(name: str, param: torch.Tensor, dtype: str) -> str | None:
    """Quantized weights load as stored (fp8 as F8_E4M3, int8 as I8); everything else is a float, cast."""
    if param.dtype == torch.float8_e4m3fn:
        return None if dtype == "F8_E4M3" else f"{name}: expected F8_E4M3 (fp8 e4m3), checkpoint has {dtype}"
    if param.dtype == torch.int8:
        return None if dtype == "I8" else f"{name}: expected I8 (int8), checkpoint has {dtype}"
    if dtype in _FLOAT_DTYPES:
        return None
    return f"{name}: expected a floating-point tensor (F32/F16/BF16), checkpoint has {dtype}"


def _shape_ok(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    # A per-tensor scale is stored as [1] (compressed-tensors) or [] (AutoFP8).
    return shape == expected or (expected == (1,) and shape == ())


def _check_tensors(model: nn.Module, files: list[str], layout: dict[str, Any],
                   canonical: Callable[[str], str]) -> set[str]:
    """Every tensor's name, shape and dtype against ``layout`` (headers only); the mapped names found.

    Raises:
        CheckpointError: every unexpected, missing, mis-shaped and mis-typed tensor, by name.
    """
    ignored = [re.compile(p) for p in getattr(model, "ignored_checkpoint_names", ())]
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        ignored.append(re.compile(r"^lm_head\.weight$"))  # some tied checkpoints store the copy anyway
    found: set[str] = set()
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
                found.add(hf)
                sl = f.get_slice(key)
                shape, expected = tuple(sl.get_shape()), layout[hf][3]
                if not _shape_ok(shape, expected):
                    bad_shape.append(f"{hf}: expected shape {list(expected)}, checkpoint has {list(shape)}")
                problem = _dtype_problem(hf, layout[hf][1], sl.get_dtype())
                if problem:
                    bad_dtype.append(problem)
    missing = sorted(set(layout) - found)
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
    return found


def _read(f: Any, key: str, narrow: Narrow) -> torch.Tensor:
    """A checkpoint tensor, or only its ``(dim, start, length)`` slice (a tensor-parallel rank's)."""
    if narrow is None:
        return f.get_tensor(key)
    dim, start, length = narrow
    index = (slice(None),) * dim + (slice(start, start + length),)
    return f.get_slice(key)[index]


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each module that asks (quantized merged linears: one weight and input scale over their shards)
    finish its weights once they are all in."""
    for module in model.modules():
        finish = getattr(module, "process_weights_after_loading", None)
        if finish is not None:
            finish()


def load_weights(model: nn.Module, files: list[str], progress: bool = True) -> None:
    """Check every tensor of ``files`` against ``model``, then copy them in: floats cast to the parameter's
    dtype, quantized weights (fp8, int8) as stored. ``model`` is freshly built (not loaded before)."""
    from tqdm.auto import tqdm

    layout = checkpoint_layout(model)
    # A model whose checkpoints come in several layouts (Llava: transformers 4 and 5 names) maps each
    # stored name to one; ignored names and the layout use the mapped name.
    canonical = getattr(model, "canonical_checkpoint_name", lambda n: n)
    found = _check_tensors(model, files, layout, canonical)
    for file in tqdm(files, desc="loading shards", unit="shard", disable=not progress or None):
        with _open(file) as f:
            for key in f.keys():
                hf = canonical(key)
                if hf not in found:
                    continue
                _, param, row, shape, narrow = layout[hf]
                try:
                    tensor = _read(f, key, narrow)
                except Exception as e:
                    raise CheckpointError(f"{file}: cannot read tensor {hf} (truncated file?): {e}") from None
                with torch.no_grad():
                    rows = param.data[row:row + (narrow[2] if narrow and narrow[0] == 0 else shape[0])]
                    rows.copy_(tensor.reshape(rows.shape))  # [out, 1] and [] scales into [out] and [1]
    process_weights_after_loading(model)


#: Models up to this many parameters draw their random weights on the CPU (same weights on every device:
#: tests compare a CPU and a GPU build); larger ones on their own device (8B on the CPU took ~60 s).
CPU_INIT_MAX_PARAMS = 1 << 28


def init_random_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) linear and embedding weights, zero biases, from a fixed seed; norms keep their init.

    Up to :data:`CPU_INIT_MAX_PARAMS` parameters, drawn on the CPU in fp32 and copied, so such a model has
    the same weights on every device; larger models draw on their device (fixed per device type). A
    quantized linear draws the same fp32 weights, one layer at a time (no fp32 copy of the model), and
    quantizes them (``quantize_from``).
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
            quantized = hasattr(module, "quantize_from")
            if quantized or isinstance(module, (nn.Linear, nn.Embedding)) or hasattr(module, "tp_shard"):
                w = module.weight
                # A tensor-parallel layer draws the whole weight (the same draws as one rank would) and keeps its slice.
                shape = getattr(module, "full_weight_shape", w.shape)
                drawn = torch.empty(shape, dtype=torch.float32, device=draw_on).normal_(0.0, std, generator=gen)
                if hasattr(module, "tp_shard"):
                    drawn = module.tp_shard(drawn)
                if quantized:
                    module.quantize_from(drawn)
                else:
                    w.copy_(drawn)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
    process_weights_after_loading(model)


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
