"""The KV cache sized from the GPU's memory: ``LLM(gpu_memory_utilization=u)``, vLLM's knob.

``u`` is the share of the device's total memory this process may take: the weights, the step's activations, the
CUDA graphs' memory, the CUDA context and libraries, and the KV cache, which gets what is left. What a step needs is
measured, not estimated: the engine traces and compiles the model (its warm-up, one forward of ``max_num_tokens``
tokens) before any cache exists (the attention op runs without one then), and the peak of torch's allocator during
it, over what was allocated before, is the activation memory of the largest step. Then:

    cache bytes = u x total - (memory in use by anything but torch's allocator, this process's context and other
                  processes included) - (torch's allocated bytes: weights, persistent buffers)
                  - 2 x the activation peak - the sampler's room

twice the activation peak: once for the CUDA graphs' private memory, captured after the cache is allocated and held
for the process's life, once for the eager steps beside them; the sampler's room is four fp32 ``[max_num_seqs,
vocab]`` tensors (logits, and the softmax and sort of top-p / top-k). Like vLLM's, the rule is a budget, not a
promise: Triton's and cuBLAS's workspaces allocated later, or another process growing, can still run the device out
of memory; a lower ``u`` leaves more room.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator

import torch

from ..attention import Attention

logger = logging.getLogger(__name__)

__all__ = ["check_gpu_memory_utilization", "MemoryProfile", "profile_memory", "cache_tokens_for_memory"]

_GIB = 2**30


def check_gpu_memory_utilization(value: float | None, num_cache_tokens: int | None, tensor_parallel_size: int,
                                 device: torch.device | str | None) -> None:
    """The ``LLM`` arguments' contract, before anything is built: ``value`` None or a number in (0, 1], not with
    ``num_cache_tokens`` (one sizes the cache), one rank, and a CUDA device."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"LLM: gpu_memory_utilization must be a number in (0, 1] (the share of the GPU's memory "
                         f"this process may take); got {value!r}")
    if num_cache_tokens is not None:
        raise ValueError(f"LLM: pass num_cache_tokens or gpu_memory_utilization, not both (each sizes the KV "
                         f"cache); got {num_cache_tokens} and {value}")
    if tensor_parallel_size != 1:
        raise ValueError(f"LLM: gpu_memory_utilization sizes one process's cache; with tensor_parallel_size="
                         f"{tensor_parallel_size} pass num_cache_tokens (the ranks' caches must match)")
    dev = torch.device(device) if device is not None else None
    if (dev is not None and dev.type != "cuda") or not torch.cuda.is_available():
        where = f"device={str(dev)!r}" if dev is not None and dev.type != "cuda" else "no CUDA device here"
        raise ValueError(f"LLM: gpu_memory_utilization sizes the KV cache from a CUDA device's memory; {where}: "
                         f"pass num_cache_tokens instead")


@dataclasses.dataclass
class MemoryProfile:
    """What :func:`profile_memory` measured on one device, bytes."""

    allocated_before: int = 0
    peak: int = 0

    @property
    def activation(self) -> int:
        """The peak of torch's allocator over what it held before: the largest step's working memory."""
        return max(0, self.peak - self.allocated_before)


@contextlib.contextmanager
def profile_memory(device: torch.device) -> Iterator[MemoryProfile]:
    """Measure the peak of torch's allocator on ``device`` over the ``with`` block (the warm-up); ValueError for a
    device that is not CUDA (a model built on the CPU although CUDA is here)."""
    if device.type != "cuda":
        raise ValueError(f"LLM: gpu_memory_utilization sizes the KV cache from a CUDA device's memory; the model is "
                         f"on {device}: pass num_cache_tokens instead")
    torch.cuda.synchronize(device)
    profile = MemoryProfile(allocated_before=torch.cuda.memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    yield profile
    torch.cuda.synchronize(device)
    profile.peak = torch.cuda.max_memory_allocated(device)


def bytes_per_token(layers: dict[str, Attention], dtype: torch.dtype) -> int:
    """A token's keys and values over every layer's cache."""
    return sum(2 * layer.num_kv_heads * layer.head_size for layer in layers.values()) * dtype.itemsize


def cache_tokens_for_memory(utilization: float, profile: MemoryProfile, layers: dict[str, Attention],
                            dtype: torch.dtype, block_size: int, max_num_seqs: int, vocab_size: int,
                            min_tokens: int, device: torch.device) -> int:
    """The KV cache's token budget (whole blocks) that ``utilization`` of ``device``'s memory leaves, after the
    warm-up measured in ``profile`` (the module's rule); RuntimeError naming the figures when it is under
    ``min_tokens``."""
    torch.cuda.empty_cache()  # the warm-up's freed blocks back to the device: the cache may take them
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    outside = max(0, total - free - torch.cuda.memory_reserved(device))  # context, libraries, other processes
    sampler = 4 * max_num_seqs * vocab_size * 4
    budget = int(utilization * total) - outside - allocated - 2 * profile.activation - sampler
    per_token = bytes_per_token(layers, dtype)
    tokens = max(0, budget) // (per_token * block_size) * block_size
    logger.info("KV cache from gpu_memory_utilization=%.3g of %.2f GiB: %.2f GiB outside torch, %.2f GiB allocated, "
                "activation peak %.2f GiB (x2), sampler %.2f GiB -> %.2f GiB, %d tokens", utilization,
                total / _GIB, outside / _GIB, allocated / _GIB, profile.activation / _GIB, sampler / _GIB,
                max(0, budget) / _GIB, tokens)
    if tokens < min_tokens:
        raise RuntimeError(
            f"LLM: gpu_memory_utilization={utilization} leaves {max(0, budget) / _GIB:.2f} GiB for the KV cache, "
            f"{tokens} tokens, fewer than the {min_tokens} one step needs: of {total / _GIB:.2f} GiB, "
            f"{outside / _GIB:.2f} are in use outside torch, {allocated / _GIB:.2f} allocated (weights, buffers), "
            f"{profile.activation / _GIB:.2f} the largest step's activations (counted twice); raise "
            f"gpu_memory_utilization, lower max_num_tokens, or pass num_cache_tokens")
    return tokens
