"""Building blocks shared by the models: fused projections, and what the loader needs to know of them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["ConfigError", "MergedLinear", "config_field", "default_dtype", "rope_from_hf"]


class ConfigError(ValueError):
    """A ``config.json`` field that is missing, ill-typed or not supported; the message starts with the field.

    The loader reports it as a :class:`models.loader.CheckpointError` naming the config file."""


_REQUIRED = object()
_KINDS = {int: "an int", float: "a number", bool: "a bool (true/false)", str: "a string", dict: "a JSON object"}


def config_field(hf: dict[str, Any], name: str, kind: type, default: Any = _REQUIRED, positive: bool = False) -> Any:
    """``hf[name]`` checked to be a ``kind`` (JSON ``null`` or absent: ``default``; no default: required).

    ``int`` refuses bools and floats, ``float`` takes ints (returned as float); ``positive`` ints are >= 1.

    Raises:
        ConfigError: naming the field: missing, ill-typed, or not positive.
    """
    value = hf.get(name)
    if value is None:
        if default is _REQUIRED:
            raise ConfigError(f"{name}: required field is missing (expected {_KINDS[kind]})")
        return default
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{name}: expected {_KINDS[kind]}; got {value!r} ({type(value).__name__})")
    if positive and value < 1:
        raise ConfigError(f"{name}: expected a positive int; got {value!r}")
    return float(value) if kind is float else value


class MergedLinear(nn.Linear):
    """Several HF linear layers with the same input, stored as one (one GEMM instead of several).

    ``MergedLinear(4096, [4096, 1024, 1024], ["q_proj", "k_proj", "v_proj"])``
    holds ``q_proj``, ``k_proj``, ``v_proj`` stacked on the output dim; the
    loader reads ``<prefix>.q_proj.weight`` into rows ``0:4096`` and so on.
    """

    def __init__(self, in_features: int, shard_sizes: list[int], shard_names: list[str], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        if len(shard_sizes) != len(shard_names):
            raise ValueError(f"MergedLinear: {len(shard_sizes)} sizes for {len(shard_names)} names")
        self.shard_sizes = list(shard_sizes)
        self.shard_names = list(shard_names)

    def checkpoint_rows(self, leaf: str) -> list[tuple[str | None, int, tuple[int, ...]]]:
        """Where the checkpoint's tensors of our parameter ``leaf`` go: ``(HF sibling name, first row, shape)``
        per shard (the loader's protocol: a name of None means this module's own name)."""
        rows, row = [], 0
        for name, size in zip(self.shard_names, self.shard_sizes):
            rows.append((name, row, (size, self.in_features) if leaf == "weight" else (size,)))
            row += size
        return rows

    def extra_repr(self) -> str:
        return super().extra_repr() + ", shards=" + ", ".join(
            f"{n}:{s}" for n, s in zip(self.shard_names, self.shard_sizes))


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """Construct parameters and buffers directly in ``dtype`` (no fp32 copy of a large model first)."""
    if dtype is None:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from an HF config: transformers 4 (``rope_theta``,
    ``rope_scaling``) or 5 (``rope_parameters``); scaling None for plain RoPE."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if kind == "default" else dict(scaling, rope_type=kind)
    return theta, scaling
