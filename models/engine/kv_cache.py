"""The paged KV cache of a model: one ``[2, num_blocks, block_size, Hkv, D]`` tensor per layer, and its blocks.

Sized from a token budget: ``num_blocks = ceil(num_cache_tokens / block_size)``
blocks shared by all layers' tensors (block ``j`` of every layer belongs to the
same sequence). Blocks are handed out whole; a sequence of ``n`` tokens holds
``ceil(n / block_size)`` of them. With ``pad_block``, one more block after them
belongs to no sequence: the padding tokens of CUDA-graph steps write there, so
the sequences keep the whole budget.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ops.triton_utils import cdiv

from ..attention import Attention

logger = logging.getLogger(__name__)

__all__ = ["KVCache", "attention_layers"]


def attention_layers(model: nn.Module) -> dict[str, Attention]:
    """Every :class:`Attention` in ``model`` by its ``layer_name``; names must be unique."""
    layers: dict[str, Attention] = {}
    for module in model.modules():
        if isinstance(module, Attention):
            if module.layer_name in layers:
                raise ValueError(f"two Attention modules share the layer_name {module.layer_name!r}")
            layers[module.layer_name] = module
    return layers


class KVCache:
    """Allocate every attention layer's cache from a token budget, and hand out its blocks.

    Args:
        layers: the model's attention layers (:func:`attention_layers`); each gets ``kv_cache`` set.
        num_cache_tokens: the budget; rounded up to whole blocks.
        block_size: tokens per block (16: small enough to waste little per sequence,
            large enough for the decode kernel's 64-key tiles to span few blocks).
        dtype, device: of the cache tensors.
        pad_block: one block more, outside the budget (:attr:`pad_block`).

    Attributes:
        num_blocks: the sequences' blocks (the budget's).
        pad_block: the block after them that padding tokens write to (never read by a sequence), or None.
    """

    def __init__(self, layers: dict[str, Attention], num_cache_tokens: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 pad_block: bool = False) -> None:
        if num_cache_tokens < 1 or block_size < 1:
            raise ValueError(f"KVCache: num_cache_tokens and block_size must be >= 1; got {num_cache_tokens}, "
                             f"{block_size}")
        self.block_size = block_size
        self.num_blocks = cdiv(num_cache_tokens, block_size)
        # Outside the budget: taken from it, a prompt of exactly num_cache_tokens passed LLM.generate's check and
        # then never fitted the free blocks (issue 17: 2048 + 1 tokens in a 2064-token cache on CUDA)
        self.pad_block = self.num_blocks if pad_block else None
        self.layers = layers
        self.tensors: dict[str, torch.Tensor] = {}
        for name, layer in layers.items():
            t = torch.zeros(2, self.num_blocks + pad_block, block_size, layer.num_kv_heads, layer.head_size,
                            dtype=dtype, device=device)
            layer.kv_cache = t
            self.tensors[name] = t
        # Block 0 first out; a stack keeps recently freed (cache-warm) blocks in use.
        self._free = list(range(self.num_blocks - 1, -1, -1))
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        logger.info("KV cache: %d blocks x %d tokens, %d layers, %.1f MiB", self.num_blocks, block_size,
                    len(layers), nbytes / 2**20)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate(self, num_tokens: int) -> list[int]:
        """Blocks for a sequence of ``num_tokens``; raises if the budget has too few free."""
        n = self.blocks_for(num_tokens)
        if n > len(self._free):
            raise RuntimeError(f"KVCache: a sequence of {num_tokens} tokens needs {n} blocks, "
                               f"{len(self._free)} of {self.num_blocks} are free; raise num_cache_tokens")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
