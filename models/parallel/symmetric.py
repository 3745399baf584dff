"""Which all-reduce a message takes: NCCL, or torch symmetric memory's one-shot / two-shot kernels, by size.

Between GPUs with peer access (NVLink) a small all-reduce is bound by latency, where symmetric memory's
kernels (each rank reads the others' buffers directly) can beat NCCL: one-shot (every rank reads all
ranks' whole inputs and reduces them) for the smallest messages, two-shot (a reduce-scatter then an
all-gather, each rank reducing its part) up to larger ones, NCCL above. The limits are measured, not
guessed: off by default (NCCL always) until ``DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE="ONE_SHOT_KIB,TWO_SHOT_KIB"``
sets them, e.g. from issue 17's measurement of both inside CUDA graphs (1-512 tokens x 4096 in bf16).

Each rank's group gets one symmetric buffer of the larger limit at start-up (:func:`enable`, a collective,
before any forward: a CUDA-graph capture cannot establish one); ``dynamo_once::all_reduce`` asks
:func:`symmetric_all_reduce` for each CUDA message and takes NCCL when it answers None. The kernels use no
multimem operations (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` in every process of the group).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dispatcher import compat, envs

logger = logging.getLogger(__name__)

__all__ = ["AllReduceLimits", "SymmetricAllReduce", "disable", "enable", "enable_from_env", "limits_from_env",
           "symmetric_all_reduce"]


@dataclasses.dataclass(frozen=True)
class AllReduceLimits:
    """The largest message (bytes) each symmetric-memory kernel takes; 0 turns it off."""

    one_shot_max_bytes: int = 0
    two_shot_max_bytes: int = 0

    def choose(self, nbytes: int) -> str:
        """``"one_shot"``, ``"two_shot"`` or ``"nccl"`` for a message of ``nbytes``."""
        if nbytes <= self.one_shot_max_bytes:
            return "one_shot"
        if nbytes <= self.two_shot_max_bytes:
            return "two_shot"
        return "nccl"

    @property
    def buffer_bytes(self) -> int:
        return max(self.one_shot_max_bytes, self.two_shot_max_bytes)


def limits_from_env() -> AllReduceLimits | None:
    """``DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE`` as limits; None when unset (or both 0)."""
    kib = envs.symm_mem_all_reduce()
    if kib is None or not any(kib):
        return None
    return AllReduceLimits(kib[0] * 1024, kib[1] * 1024)


class SymmetricAllReduce:
    """A group's symmetric buffer and the limits that route messages to it (built by :func:`enable`)."""

    def __init__(self, group_name: str, limits: AllReduceLimits, device: torch.device) -> None:
        self.group_name, self.limits = group_name, limits
        self.buffer = compat.symm_mem_buffer(limits.buffer_bytes, device, group_name)  # a collective

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of ``x`` over the group through symmetric memory; None: the message takes NCCL."""
        nbytes = x.numel() * x.element_size()
        algorithm = self.limits.choose(nbytes) if x.is_cuda and x.device == self.buffer.device else "nccl"
        if algorithm == "nccl":
            return None
        x = x.contiguous()
        symm = self.buffer[:nbytes].view(x.dtype).view(x.shape)  # this rank's part of the symmetric buffer
        ops = torch.ops.symm_mem
        if algorithm == "one_shot":
            if hasattr(ops, "one_shot_all_reduce_copy"):  # the copy into the buffer fused (torch >= 2.8)
                return ops.one_shot_all_reduce_copy(symm, x, "sum", self.group_name)
            symm.copy_(x)
            return ops.one_shot_all_reduce(symm, "sum", self.group_name)
        symm.copy_(x)
        if not hasattr(ops, "two_shot_all_reduce_out"):
            return ops.two_shot_all_reduce_(symm, "sum", self.group_name).clone()
        out = torch.empty_like(x)
        ops.two_shot_all_reduce_out(symm, "sum", self.group_name, out)
        return out


_enabled: dict[str, SymmetricAllReduce] = {}


def enable(group_name: str, limits: AllReduceLimits, device: torch.device) -> SymmetricAllReduce:
    """Route ``group_name``'s all-reduces up to ``limits`` through symmetric memory on ``device`` (CUDA). A
    collective: every rank of the group calls it, before any forward."""
    if device.type != "cuda":
        raise ValueError(f"DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE: symmetric memory needs CUDA tensors; the group's "
                         f"device is {device}")
    _enabled[group_name] = SymmetricAllReduce(group_name, limits, device)
    logger.info("tensor parallel: all-reduce through symmetric memory up to %d B one-shot, %d B two-shot (group %s)",
                limits.one_shot_max_bytes, limits.two_shot_max_bytes, group_name)
    return _enabled[group_name]


def enable_from_env(group_name: str, device_type: str) -> SymmetricAllReduce | None:
    """:func:`enable` with :func:`limits_from_env`'s limits on this process's current GPU; None when unset or
    not on CUDA (gloo groups always take their own all-reduce)."""
    limits = limits_from_env()
    if limits is None or device_type != "cuda":
        return None
    return enable(group_name, limits, torch.device("cuda", torch.cuda.current_device()))


def disable(group_name: str) -> None:
    _enabled.pop(group_name, None)


def symmetric_all_reduce(group_name: str) -> SymmetricAllReduce | None:
    return _enabled.get(group_name)
