"""``PrefixCache``: full KV-cache blocks found again by their tokens, so that prompts sharing a prefix (a system
prompt, the earlier turns of a chat) compute its keys and values once.

A block is cached once all its ``block_size`` tokens have their keys and values in it. Its key is its tokens and
the key of the block before it in its sequence (the chain from the first token), so a block matches only where the
whole prefix up to its end is the same: a block of the same tokens after another prefix holds other keys and values
(positions, attention to what came before). Keys are compared exactly, not by a hash digest: the table maps
``(parent id, tokens)`` to the block, ``parent id`` being a number given to each cached block once and never again,
so a block that is evicted and refilled cannot be reached through its old children.

A cached block no sequence holds stays cached (``evictable``, least recently released first) until the cache needs
the block for new tokens: :class:`.kv_cache.KVCache` takes its free blocks first, then evicts from the front.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PrefixCache", "ROOT"]

#: The parent id of a sequence's first block.
ROOT = 0


class PrefixCache:
    """The table of cached blocks and the order the evictable ones go in.

    Args:
        block_size: tokens a block (the KV cache's).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._table: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent id, tokens) -> block
        self._key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> its table key
        self._id: dict[int, int] = {}  # block -> the id its children's keys name
        self._next_id = ROOT + 1
        #: Cached blocks no sequence holds, in the order they go when the cache needs blocks (first: first out).
        self.evictable: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._key

    def match(self, tokens: Sequence[int], num_blocks: int) -> tuple[list[int], int]:
        """The cached blocks of ``tokens``' longest cached prefix of at most ``num_blocks`` whole blocks, and the id
        of the last of them (``ROOT`` when none)."""
        bs, parent, blocks = self.block_size, ROOT, []
        for i in range(num_blocks):
            block = self._table.get((parent, tuple(tokens[i * bs:(i + 1) * bs])))
            if block is None:
                break
            blocks.append(block)
            parent = self._id[block]
        return blocks, parent

    def add(self, block: int, parent: int, tokens: Sequence[int]) -> int:
        """Cache ``block``, holding ``tokens`` (a whole block) after the block of id ``parent``; the id to give
        its next block. A block of this key already cached keeps it (``block`` then stays uncached), and its id
        continues the chain."""
        key = (parent, tuple(tokens))
        if len(key[1]) != self.block_size:
            raise ValueError(f"PrefixCache.add: a block holds {self.block_size} tokens; got {len(key[1])}")
        cached = self._table.get(key)
        if cached is not None:
            return self._id[cached]
        if block in self._key:
            raise ValueError(f"PrefixCache.add: block {block} is cached already")
        self._table[key] = block
        self._key[block] = key
        self._id[block] = self._next_id
        self._next_id += 1
        return self._id[block]

    def clear(self) -> list[int]:
        """Forget every cached block (none is found again); the ones no sequence holds, returned, are free."""
        freed = list(self.evictable)
        self._table.clear()
        self._key.clear()
        self._id.clear()
        self.evictable.clear()
        return freed

    def evict(self) -> int:
        """The least recently released cached block that no sequence holds, uncached."""
        block, _ = self.evictable.popitem(last=False)
        del self._table[self._key.pop(block)]
        del self._id[block]
        return block
