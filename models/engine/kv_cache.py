"""The paged KV cache of a model: one ``[2, num_blocks, block_size, Hkv, D]`` tensor per layer, and its blocks.

Sized from a token budget: ``num_blocks = ceil(num_cache_tokens / block_size)``
blocks shared by all layers' tensors (block ``j`` of every layer belongs to the
same sequence). Blocks are handed out whole; a sequence of ``n`` tokens holds
``ceil(n / block_size)`` of them. With ``pad_block``, one more block after them
belongs to no sequence: the padding tokens of CUDA-graph steps write there, so
the sequences keep the whole budget.

With ``prefix_caching`` (:mod:`.prefix_cache`) a block whose tokens are all computed stays findable by its
tokens and their prefix after its sequence ends, and a new sequence whose prompt starts with cached blocks
holds them too (a count of holders a block) and computes only the rest.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ops.triton_utils import cdiv

from ..attention import Attention
from .prefix_cache import PrefixCache
from .prompt_logprobs import wants_prompt_logprobs
from .sequence import Seq

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
        prefix_caching: keep whole blocks of computed tokens for later prompts with the same prefix.

    Attributes:
        num_blocks: the sequences' blocks (the budget's).
        pad_block: the block after them that padding tokens write to (never read by a sequence), or None.
        prefix: the :class:`.prefix_cache.PrefixCache` with ``prefix_caching``, else None.
    """

    def __init__(self, layers: dict[str, Attention], num_cache_tokens: int, block_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 pad_block: bool = False, prefix_caching: bool = False) -> None:
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
        # Block 0 first out; a stack keeps recently freed (cache-warm) blocks in use. With prefix caching these are
        # the uncached free blocks; the cached ones no sequence holds wait in prefix.evictable.
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self.prefix = PrefixCache(block_size) if prefix_caching else None
        self._holders = [0] * self.num_blocks  # sequences holding each block (prefix caching)
        nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        logger.info("KV cache: %d blocks x %d tokens, %d layers, %.1f MiB", self.num_blocks, block_size,
                    len(layers), nbytes / 2**20)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (with prefix caching: the cached ones too, which a new sequence evicts)."""
        return len(self._free) + (len(self.prefix.evictable) if self.prefix is not None else 0)

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def _new_and_free(self, num_tokens: int, cached: list[int]) -> tuple[int, int]:
        """The new blocks a sequence of ``num_tokens`` starting with ``cached`` needs, and the free blocks left for
        them (the cached ones no sequence holds are free blocks this sequence takes)."""
        return (self.blocks_for(num_tokens) - len(cached),
                self.num_free_blocks - sum(1 for b in cached if self._holders[b] == 0))

    def fits(self, num_tokens: int, cached: list[int] | None = None) -> bool:
        """Whether :meth:`allocate` of the same arguments finds enough free blocks."""
        n, free = self._new_and_free(num_tokens, cached or [])
        return n <= free

    def allocate(self, num_tokens: int, cached: list[int] | None = None) -> list[int]:
        """Blocks for a sequence of ``num_tokens``: ``cached`` (a prefix's blocks, from :meth:`cached_prefix`; held
        now by one more sequence) then new ones, taken free first, then evicted from the prefix cache; raises if
        the budget has too few."""
        cached = cached or []
        n, free = self._new_and_free(num_tokens, cached)
        if n > free:
            raise RuntimeError(f"KVCache: a sequence of {num_tokens} tokens needs {n} blocks, "
                               f"{free} of {self.num_blocks} are free; raise num_cache_tokens")
        if self.prefix is not None:
            for b in cached:
                if self._holders[b] == 0:
                    del self.prefix.evictable[b]
                self._holders[b] += 1
        return cached + self._take(n)

    def _take(self, n: int) -> list[int]:
        """``n`` new blocks, free ones first, then evicted from the prefix cache; each held by one sequence."""
        if self.prefix is None:
            return [self._free.pop() for _ in range(n)]
        new = [self._free.pop() if self._free else self.prefix.evict() for _ in range(n)]
        for b in new:
            self._holders[b] = 1
        return new

    def grow(self, blocks: list[int], num_tokens: int) -> bool:
        """Append to a running sequence's ``blocks`` the new ones it needs to hold ``num_tokens`` tokens, taken as
        :meth:`allocate` takes them; False (``blocks`` unchanged) when too few are free."""
        n = self.blocks_for(num_tokens) - len(blocks)
        if n <= 0:
            return True
        if n > self.num_free_blocks:
            return False
        blocks += self._take(n)
        return True

    def free(self, blocks: list[int]) -> None:
        """A sequence's blocks, released (with prefix caching: a cached block another sequence holds stays held, and
        one none holds stays cached until evicted, its sequence's last block first)."""
        if self.prefix is None:
            self._free.extend(reversed(blocks))
            return
        for b in reversed(blocks):
            self._holders[b] -= 1
            if self._holders[b] == 0:
                if b in self.prefix:
                    self.prefix.evictable[b] = None
                else:
                    self._free.append(b)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (later prompts find none of them); those no sequence holds are free again.
        How many blocks that frees (0 without prefix caching)."""
        if self.prefix is None:
            return 0
        freed = self.prefix.clear()
        self._free.extend(reversed(freed))
        return len(freed)

    def cached_prefix(self, seq: Seq) -> list[int]:
        """The cached blocks ``seq``'s prompt starts with (none without prefix caching, for a prompt with images,
        whose placeholder tokens do not name the images, or for one that asks for prompt logprobs, which need its
        forward). At most ``prompt_len - 1`` tokens: the last prompt token is always computed, for its logits. Sets
        ``seq.prefix_id`` for :meth:`cache_computed`. A preempted sequence's generated tokens count as its prompt's
        (``prefill_len``): their blocks too may be found again."""
        if self.prefix is None or seq.images is not None or wants_prompt_logprobs(seq):
            return []
        blocks, seq.prefix_id = self.prefix.match(seq.tokens, (seq.prefill_len - 1) // self.block_size)
        seq.num_keyed = len(blocks)
        return blocks

    def cache_computed(self, seq: Seq) -> None:
        """Cache ``seq``'s whole blocks whose tokens all have their keys and values now (after a step)."""
        if self.prefix is None or seq.images is not None or not seq.blocks:
            return
        bs = self.block_size
        full = min(seq.num_computed, len(seq.tokens)) // bs
        while seq.num_keyed < full:
            i = seq.num_keyed
            seq.prefix_id = self.prefix.add(seq.blocks[i], seq.prefix_id, seq.tokens[i * bs:(i + 1) * bs])
            seq.num_keyed += 1
