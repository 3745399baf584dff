"""The collectives of the tensor-parallel layers, as custom ops: one opaque node each in the traced graph.

``torch.ops.dynamo_once.all_reduce(x, group_name)`` (sum), ``all_gather(x, dim, group_name)``,
``reduce_scatter(x, dim, group_name)`` (sum, then this rank's block of ``dim``) and ``rank_shard(x, dim,
group_name)`` (this rank's block of ``dim``, no communication: what the sequence-parallel pass slices the
residual with) are functional (a new tensor out, the input untouched) and have fake implementations, so
Dynamo traces them, AOTAutograd and Inductor keep each as one node (a graph pass can match
``GEMM -> all_reduce``), and the piecewise backend leaves them inside the pieces (they are not splitting
ops: NCCL collectives are captured in CUDA graphs). The group travels as its name, a string, which a
custom op's schema can hold; :func:`models.parallel.process_group` resolves it at run time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import process_group
from .symmetric import symmetric_all_reduce

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "rank_shard", "tensor_parallel_all_reduce",
           "tensor_parallel_all_gather"]

# torch 2.13 renames all_gather_into_tensor and reduce_scatter_tensor (deprecated there); 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@torch.library.custom_op("dynamo_once::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group_name``, on every rank: through symmetric memory where its
    limits take the message (:mod:`.symmetric`; off by default), else ``torch.distributed`` (NCCL, gloo)."""
    symmetric = symmetric_all_reduce(group_name)
    if symmetric is not None:
        out = symmetric(x)
        if out is not None:
            return out
    # dist.all_reduce works in place and a functional op leaves x as it was: one copy (x.contiguous().clone()
    # made two of a strided x). No copy at all would need an out-of-place all-reduce, which ProcessGroupNCCL
    # does not offer (torch's functional all_reduce clones too), or a mutating op that Inductor re-inplaces.
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=process_group(group_name))
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("dynamo_once::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, on every rank."""
    group = process_group(group_name)
    n = dist.get_world_size(group)
    dim = dim % x.dim()
    x = x.movedim(dim, 0).contiguous()  # [.., d, ..] -> [d, ..]: ranks' blocks are then contiguous
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out.movedim(0, dim).contiguous()  # [n * d, ..] -> [.., n * d, ..]


@all_gather.register_fake
def _(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= dist.get_world_size(process_group(group_name))
    return x.new_empty(shape)


def _blocks(x: torch.Tensor, dim: int, n: int) -> int:
    """``x.shape[dim] / n``, the length of one rank's block (raises when ``n`` does not divide it)."""
    if x.shape[dim] % n:
        raise ValueError(f"tensor parallel: dim {dim} of a {tuple(x.shape)} tensor is not divisible by the group's "
                         f"{n} ranks")
    return x.shape[dim] // n


@torch.library.custom_op("dynamo_once::reduce_scatter", mutates_args=())
def reduce_scatter(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group_name``, of which this rank keeps its block of ``dim`` (rank
    ``r``: rows ``r * d : (r + 1) * d``, ``d = x.shape[dim] / world size``)."""
    group = process_group(group_name)
    n = dist.get_world_size(group)
    dim = dim % x.dim()
    d = _blocks(x, dim, n)
    x = x.movedim(dim, 0).contiguous()  # the ranks' blocks contiguous
    out = x.new_empty((d, *x.shape[1:]))
    _reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim).contiguous()


@reduce_scatter.register_fake
def _(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] //= dist.get_world_size(process_group(group_name))
    return x.new_empty(shape)


@torch.library.custom_op("dynamo_once::rank_shard", mutates_args=())
def rank_shard(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """This rank's block of ``dim`` of ``x`` (as :func:`reduce_scatter` keeps it), copied: no communication."""
    group = process_group(group_name)
    d = _blocks(x, dim, dist.get_world_size(group))
    return x.narrow(dim, dist.get_rank(group) * d, d).clone(memory_format=torch.contiguous_format)


@rank_shard.register_fake
def _(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] //= dist.get_world_size(process_group(group_name))
    return x.new_empty(shape)


def tensor_parallel_all_reduce(x: torch.Tensor, group_name: str | None) -> torch.Tensor:
    """``x`` summed over the group ``group_name`` (``x`` itself for None: no group)."""
    return x if group_name is None else torch.ops.dynamo_once.all_reduce(x, group_name)


def tensor_parallel_all_gather(x: torch.Tensor, dim: int, group_name: str | None) -> torch.Tensor:
    """``x`` of every rank of ``group_name`` concatenated along ``dim`` (``x`` itself for None: no group)."""
    return x if group_name is None else torch.ops.dynamo_once.all_gather(x, dim, group_name)
