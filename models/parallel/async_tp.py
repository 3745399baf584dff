"""GEMM fused with the collective next to it (async tensor parallelism), as custom ops for the
sequence-parallel pass (``dispatcher.passes.sequence_parallel``):

- ``torch.ops.dynamo_once.matmul_reduce_scatter(a, b, group_name)``: ``reduce_scatter(a @ b, 0)``;
- ``torch.ops.dynamo_once.all_gather_matmul(a, b, group_name)``: ``all_gather(a, 0) @ b``.

On CUDA over NCCL, where torch has them, they are torch's ``symm_mem.fused_matmul_reduce_scatter`` /
``fused_all_gather_matmul``: the GEMM is cut into one product per rank's block, and each block's transfer
through symmetric memory overlaps the next block's product. Elsewhere (the CPU, gloo, a torch without them,
``DYNAMO_ONCE_ASYNC_TP=0``, inside a CUDA-graph capture, where the workspace cannot grow) they are the
plain GEMM and the plain collective of :mod:`.communication`, one after the other. The fused ops take no
multimem path (``return_A=True``; ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` in every process of the group).
Their first call on a group establishes a symmetric workspace: a collective, so every rank makes the same
calls in the same order, as the ranks of one compiled model do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dispatcher import compat, envs

from .communication import all_gather, reduce_scatter
from .state import process_group

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


def _fused_ops(x: torch.Tensor, group_name: str) -> Any | None:
    """``torch.ops.symm_mem`` when its fused ops may take this call; None: the plain GEMM and collective."""
    if not x.is_cuda or not envs.async_tp() or torch.cuda.is_current_stream_capturing():
        return None
    if dist.get_backend(process_group(group_name)) != "nccl":
        return None
    return compat.symm_mem_fused_ops(group_name)


@torch.library.custom_op("dynamo_once::matmul_reduce_scatter", mutates_args=())
def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group_name: str) -> torch.Tensor:
    """``a @ b`` (``[M, K] @ [K, N]``) summed over the ranks, of which this rank keeps its block of rows."""
    ops = _fused_ops(a, group_name)
    if ops is None:
        return reduce_scatter(a @ b, 0, group_name)
    return ops.fused_matmul_reduce_scatter(a, b, "sum", 0, group_name)


@matmul_reduce_scatter.register_fake
def _(a: torch.Tensor, b: torch.Tensor, group_name: str) -> torch.Tensor:
    n = dist.get_world_size(process_group(group_name))
    return a.new_empty((a.shape[0] // n, b.shape[1]))


@torch.library.custom_op("dynamo_once::all_gather_matmul", mutates_args=())
def all_gather_matmul(a: torch.Tensor, b: torch.Tensor, group_name: str) -> torch.Tensor:
    """Every rank's rows ``a`` (``[M / N, K]``) stacked in rank order, times ``b`` (``[K, N]``)."""
    ops = _fused_ops(a, group_name)
    if ops is None:
        return all_gather(a, 0, group_name) @ b
    return ops.fused_all_gather_matmul(a, [b], 0, group_name, return_A=True)[1][0]


@all_gather_matmul.register_fake
def _(a: torch.Tensor, b: torch.Tensor, group_name: str) -> torch.Tensor:
    n = dist.get_world_size(process_group(group_name))
    return a.new_empty((a.shape[0] * n, b.shape[1]))
