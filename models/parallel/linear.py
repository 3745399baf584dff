"""Column- and row-parallel linear layers: each rank holds a slice of a projection's weight.

- :class:`ColumnParallelLinear` (merged QKV, gate-up): rank ``r`` holds rows ``r * n : (r + 1) * n`` of each
  of the checkpoint's shards (``n`` = the shard's rows / world size), stacked as :class:`MergedLinear`
  stacks the whole shards. Its output is this rank's heads / intermediate slice; no communication.
- :class:`RowParallelLinear` (o_proj, down_proj): rank ``r`` holds columns ``r * k : (r + 1) * k`` of the
  weight and takes the matching slice of the input features; the partial products are summed by one
  ``dynamo_once::all_reduce``, and the bias (whole on every rank) is added once, after it.

Both speak the loader's protocol (``checkpoint_rows``, see :func:`models.loader.checkpoint_layout`) with a
fourth entry per tensor, ``(dim, start, length)``: the slice of the checkpoint tensor this rank reads. The
factories return the plain layers when the process has no tensor-parallel group, so a model built without
one is exactly the model it always was.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import ConfigError, MergedLinear
from ..quant_linear import make_linear, make_merged_linear
from ..quantization import QuantizationConfig
from . import async_tp  # noqa: F401  (registers the fused GEMM + collective ops the sequence-parallel pass makes)
from .communication import tensor_parallel_all_reduce
from .state import get_tp_state, tp_size

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "column_parallel_linear", "refuse_quantized",
           "row_parallel_linear"]

Rows = list[tuple[str | None, int, tuple[int, ...], tuple[int, int, int] | None]]


def refuse_quantized(quant: QuantizationConfig | None) -> None:
    """Tensor parallelism takes floating-point checkpoints only, for now.

    Raises:
        ConfigError: ``quant`` is a quantization config.
    """
    if quant is not None:
        raise ConfigError(f"quantization_config: W8A8 checkpoints are not supported with tensor_parallel_size="
                          f"{tp_size()} (their layers are not sharded yet); run them with tensor_parallel_size=1")


class ColumnParallelLinear(MergedLinear):
    """This rank's rows of one or more projections of the same input (``shard_sizes``: this rank's rows of
    each; the checkpoint holds ``world_size`` times as many)."""

    def __init__(self, in_features: int, shard_sizes: list[int], shard_names: list[str], bias: bool = False,
                 rank: int = 0, world_size: int = 1) -> None:
        super().__init__(in_features, shard_sizes, shard_names, bias)
        self.rank, self.world_size = rank, world_size

    def checkpoint_rows(self, leaf: str) -> Rows:
        rows, row = [], 0
        for name, size in zip(self.shard_names, self.shard_sizes):
            full = (size * self.world_size, self.in_features) if leaf == "weight" else (size * self.world_size,)
            rows.append((name, row, full, (0, self.rank * size, size)))
            row += size
        return rows

    @property
    def full_weight_shape(self) -> tuple[int, int]:
        """The unsharded weight's shape (all ranks' rows, shards stacked as the checkpoint's order)."""
        return self.out_features * self.world_size, self.in_features

    def tp_shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of ``full`` (:attr:`full_weight_shape`: whole shards stacked)."""
        parts, start = [], 0
        for size in self.shard_sizes:
            parts.append(full[start + self.rank * size:start + (self.rank + 1) * size])
            start += size * self.world_size
        return torch.cat(parts)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rank={self.rank}/{self.world_size}"


class RowParallelLinear(nn.Linear):
    """This rank's columns of a projection (``in_features``: this rank's slice of the input), then the
    all-reduce that sums the ranks' partial outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, rank: int = 0,
                 world_size: int = 1, group_name: str | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.rank, self.world_size, self.group_name = rank, world_size, group_name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [T, in / N] -> this rank's partial [T, out] -> summed over the ranks
        out = tensor_parallel_all_reduce(F.linear(x, self.weight), self.group_name)
        return out if self.bias is None else out + self.bias

    def checkpoint_rows(self, leaf: str) -> Rows:
        if leaf == "weight":
            k = self.in_features
            return [(None, 0, (self.out_features, k * self.world_size), (1, self.rank * k, k))]
        return [(None, 0, (self.out_features,), None)]

    @property
    def full_weight_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features * self.world_size

    def tp_shard(self, full: torch.Tensor) -> torch.Tensor:
        k = self.in_features
        return full[:, self.rank * k:(self.rank + 1) * k]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", rank={self.rank}/{self.world_size}"


def column_parallel_linear(in_features: int, shard_sizes: list[int], shard_names: list[str], bias: bool,
                           quant: QuantizationConfig | None, prefix: str) -> nn.Module:
    """A merged projection with ``shard_sizes`` rows of each shard on this rank (the plain merged layer, float
    or quantized, without a tensor-parallel group)."""
    if tp_size() == 1:
        return make_merged_linear(in_features, shard_sizes, shard_names, bias, quant, prefix)
    refuse_quantized(quant)
    state = get_tp_state()
    return ColumnParallelLinear(in_features, shard_sizes, shard_names, bias, state.rank, state.world_size)


def row_parallel_linear(in_features: int, out_features: int, bias: bool, quant: QuantizationConfig | None,
                        name: str) -> nn.Module:
    """A projection over this rank's ``in_features`` input features, summed over the ranks (the plain
    layer, float or quantized, without a tensor-parallel group)."""
    if tp_size() == 1:
        return make_linear(in_features, out_features, bias, quant, name)
    refuse_quantized(quant)
    state = get_tp_state()
    return RowParallelLinear(in_features, out_features, bias, state.rank, state.world_size, state.group_name)
