"""The tensor-parallel group of this process: its rank, its world size and its ``torch.distributed`` group.

One group a process, set up by :func:`init_tensor_parallel` (the caller of ``LLM(..., tensor_parallel_size=N)``
as rank 0, each worker as its rank). The layers read it at construction, inside
:func:`use_tensor_parallel`; outside, every model is rank 0 of 1 and its layers are the plain ones (so a
process with a tensor-parallel LLM open still builds unsharded models elsewhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

from dispatcher import compat

from ..layers import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["TensorParallelState", "destroy_tensor_parallel", "divide", "get_tp_state", "init_tensor_parallel",
           "process_group", "tp_rank", "tp_size", "use_tensor_parallel"]


@dataclasses.dataclass(frozen=True)
class TensorParallelState:
    """This process's place in the tensor-parallel group.

    Attributes:
        rank: 0 .. world_size - 1.
        world_size: the number of ranks (the tensor-parallel size).
        group_name: the ``torch.distributed`` group's name, what the collective ops take (None: no group).
        backend: ``"gloo"`` or ``"nccl"`` (None: no group).
    """

    rank: int = 0
    world_size: int = 1
    group_name: str | None = None
    backend: str | None = None


_SINGLE = TensorParallelState()
_current = _SINGLE
_groups: dict[str, dist.ProcessGroup] = {}


def get_tp_state() -> TensorParallelState:
    """The group that models built now shard over (:func:`use_tensor_parallel`); rank 0 of 1 outside one."""
    return _current


def tp_rank() -> int:
    return _current.rank


def tp_size() -> int:
    return _current.world_size


@contextlib.contextmanager
def use_tensor_parallel(state: TensorParallelState) -> Iterator[TensorParallelState]:
    """Build models in the block as ``state``'s rank (each layer keeps its group's name for its collectives,
    so a model runs the same outside the block)."""
    global _current
    previous, _current = _current, state
    try:
        yield state
    finally:
        _current = previous


def process_group(name: str) -> dist.ProcessGroup:
    """The group a collective op names (the op takes a string: a custom op's schema has no group type)."""
    group = _groups.get(name)
    if group is None:
        raise RuntimeError(f"tensor parallel: no process group named {name!r} in this process (known: "
                           f"{sorted(_groups) or 'none'}); was the LLM closed, or the model built in another "
                           f"process?")
    return group


def init_tensor_parallel(rank: int, world_size: int, backend: str, store: dist.Store,
                         timeout_s: float) -> TensorParallelState:
    """Join the group of ``world_size`` ranks that meet at ``store``; every collective times out after
    ``timeout_s`` (a rank that never arrives is an error, not a hang). Models built under
    ``use_tensor_parallel(state)`` then shard over it.

    Raises:
        RuntimeError: this process already has a ``torch.distributed`` default group.
    """
    if dist.is_initialized():
        raise RuntimeError("tensor parallel: this process already has a torch.distributed default group (another "
                           "tensor-parallel LLM still open? close() it first)")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    group = dist.group.WORLD
    _groups[group.group_name] = group
    logger.debug("tensor parallel: rank %d of %d joined group %s (%s)", rank, world_size, group.group_name, backend)
    return TensorParallelState(rank, world_size, group.group_name, backend)


def destroy_tensor_parallel(state: TensorParallelState, abort: bool = False) -> None:
    """Leave ``state``'s group (its models' collectives fail from then on, naming it), waiting for no other rank.

    On NCCL every group of the process is aborted (:func:`dispatcher.compat.abort_process_groups`) once this
    rank's work is done: a plain destroy is a collective of every rank of the node, which a closing rank 0 and its
    workers cannot be relied on to enter together. On gloo the group is destroyed; ``abort``: a rank is gone, abort
    it first (``ProcessGroup.abort``, torch >= 2.6)."""
    if state.group_name is None:
        return
    group = _groups.pop(state.group_name, None)
    if group is None or not dist.is_initialized():
        return
    if state.backend == "nccl":
        torch.cuda.synchronize()  # the last step's collectives done: nothing is in flight when it aborts
        compat.abort_process_groups()  # every group (symmetric memory's too): a shutdown of one left would wait
        return
    if abort and hasattr(group, "abort"):
        with contextlib.suppress(Exception):
            group.abort()
    dist.destroy_process_group()


def divide(value: int, field: str, size: int | None = None) -> int:
    """``value / size`` (default: this group's size) for a config field that each rank holds a slice of.

    Raises:
        ConfigError: naming the field, when ``size`` does not divide it.
    """
    size = tp_size() if size is None else size
    if value % size:
        raise ConfigError(f"{field}: {value} is not divisible by tensor_parallel_size={size} (each rank holds "
                          f"{field} / tensor_parallel_size of them)")
    return value // size
