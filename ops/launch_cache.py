"""What a step's attention launches are built from, kept across steps: :class:`LaunchCache`.

A mixed step of chunked prefill (prompt chunks beside decodes) changes its layout from one step to the next, so it
cannot take over the last step's plans (``models.AttentionMetadata.inherit``); its first attention call then builds
the decode plan, binds each kernel (:class:`~ops.triton_utils.BoundLaunch`) and records the launch program the
other layers replay (:mod:`ops.launch_program`): on the piecewise path, host time paid once a step, 85-260 µs on an
H100's host. Yet a serving engine's layouts recur: the decode plan depends on the decode count only, the prompts'
launch on it and the chunk's length. A :class:`LaunchCache`, owned with the persistent buffers the launches are bound
to (``ops.paged_attention.DecodeWorkspace``), keeps each built piece under a key of everything it was built from (the
bound tensors' address, shape, strides, dtype, device, and the sizes), so that a step takes every piece it shares
with a recent step instead of building it, and a step of a recent step's whole layout takes that step's state in
one lookup (``models.AttentionMetadata.inherit``).

A key holds tensors' addresses; the value holds those tensors (views of the persistent buffers), so that no other
tensor can take an address while its entry lives. The least recently used entries go first past ``max_entries``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["LaunchCache"]


class LaunchCache:
    """A bounded map from build keys to built launch state (plans, bound launches, a layer's step call), least
    recently used out first. ``hits`` and ``misses`` count :meth:`get_or_build`'s answers by the kind of state, a key's
    first element (``"plan"``, ``"write"``, ``"prefill"``; ``"call"``, a layer configuration's whole step state;
    ``"step"``, a step's metadata whose state a later step of its layout takes over; benchmarks report them).

    Args:
        max_entries: the most entries kept (a positive int). Each is a few small Python objects (views, tuples, a
            step's host lists). The default, 4096, holds a serving engine's decode counts beside a few prompt layouts
            each, and the steps whose whole layout recurs: smaller, a run whose layouts cycle through more than it
            holds would drop each entry just before its next use (the least recently used goes first).
    """

    def __init__(self, max_entries: int = 4096) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"LaunchCache: max_entries must be a positive int; got {max_entries!r}")
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self.hits: Counter[Hashable] = Counter()
        self.misses: Counter[Hashable] = Counter()

    def get_or_build(self, key: tuple, build: Callable[[], Any]) -> Any:
        """The entry under ``key`` (a tuple, its kind first), or ``build()``'s result, stored under it."""
        entries = self._entries
        try:
            value = entries[key]
        except KeyError:
            self.misses[key[0]] += 1
            value = entries[key] = build()
            if len(entries) > self.max_entries:
                entries.popitem(last=False)
            return value
        entries.move_to_end(key)
        self.hits[key[0]] += 1
        return value

    def clear(self) -> None:
        """Drop every entry (the counts stay)."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
