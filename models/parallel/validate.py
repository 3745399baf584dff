"""What ``LLM(..., tensor_parallel_size=N)`` accepts, checked in the caller before any process starts."""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ..layers import ConfigError
from ..loader import CheckpointError, model_class_for, read_config
from .state import divide

logger = logging.getLogger(__name__)

__all__ = ["check_size", "check_tensor_parallel", "device_type"]


def check_size(tensor_parallel_size: Any) -> int:
    """``tensor_parallel_size`` as an int >= 1.

    Raises:
        ValueError: naming the argument, when it is not a positive int.
    """
    if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"LLM: tensor_parallel_size must be a positive int; got {tensor_parallel_size!r}")
    return tensor_parallel_size


def device_type(device: torch.device | str | None) -> str:
    """The device type a model built for ``device`` lands on (None: the loader's default, the CPU)."""
    return "cpu" if device is None else torch.device(device).type


def _hf_config(model: str) -> dict[str, Any]:
    from ..registry import BUILTIN_MODELS

    if os.path.isdir(model):
        return read_config(model)
    if model in BUILTIN_MODELS:
        return BUILTIN_MODELS[model]
    raise CheckpointError(f"{model!r} is neither a checkpoint directory nor a built-in model "
                          f"(built-in: {', '.join(BUILTIN_MODELS)})")


def _warn_about_plugins(where: str) -> None:
    """Plugins live in the caller's process: spawned workers start without them, and would compile otherwise."""
    from dispatcher import plugins

    found = [f"pass {p.name}" for p, _, _ in plugins.get_post_grad_passes()]
    if plugins.get_torch_compile_backend() is not None:
        found.append("a torch.compile backend")
    if plugins.get_inductor_additional_configs():
        found.append("Inductor options")
    if found:
        logger.warning("%s: %s set through dispatcher.plugins in this process do(es) not reach the worker processes "
                       "(spawned: rank 0 alone would compile with them)", where, ", ".join(found))


def check_tensor_parallel(model: Any, size: int, device: torch.device | str | None) -> None:
    """Refuse what tensor parallelism does not run, before any worker starts.

    Raises:
        RuntimeError: this process already has a ``torch.distributed`` group.
        ValueError: the model is not a path or built-in name; more ranks than GPUs (or not from GPU 0);
            the architecture is not Llama or Gemma 2; a checkpoint with a ``quantization_config``.
        CheckpointError: the checkpoint's config, naming the field that ``size`` does not divide.
    """
    where = f"LLM: tensor_parallel_size={size}"
    if dist.is_initialized():
        gc.collect()  # an LLM no longer referenced but not yet collected (a cycle) closes its group
    if dist.is_initialized():
        raise RuntimeError(f"{where}: this process already has a torch.distributed default group (another "
                           f"tensor-parallel LLM still open? close() it first)")
    if not isinstance(model, str):
        raise ValueError(f"{where} needs a checkpoint directory or a built-in name as model (every rank loads its "
                         f"own shard); got {type(model).__name__}")
    if device_type(device) == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"{where}: one GPU a rank, but {torch.cuda.device_count()} GPU(s) are visible")
    if device_type(device) == "cuda" and torch.device(device).index not in (None, 0):
        raise ValueError(f"{where}: rank r runs on GPU r (CUDA_VISIBLE_DEVICES picks them); expected device='cuda'; "
                         f"got device={device!r}")
    _warn_about_plugins(where)
    config = _hf_config(model)
    cls = model_class_for(config, model)
    if not getattr(cls, "supports_tensor_parallel", False):
        raise ValueError(f"{where}: {cls.__name__} is not sharded here (tensor parallelism supports "
                         f"LlamaForCausalLM and Gemma2ForCausalLM)")
    if config.get("quantization_config") is not None:
        raise ValueError(f"{where}: {model} is quantized (quantization_config); W8A8 layers are not sharded yet, "
                         f"run it with tensor_parallel_size=1")
    try:
        parsed = cls.config_class.from_hf(config)
        for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            divide(getattr(parsed, field), field, size)
    except ConfigError as e:
        raise CheckpointError(f"{os.path.join(model, 'config.json') if os.path.isdir(model) else model}: {e}") from None
