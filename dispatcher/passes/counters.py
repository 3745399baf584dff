"""``pass_counter``: what the post-grad passes did, per pass, for tests and logs to assert on.

Counts only graphs that Inductor compiled: a graph loaded from its FX graph cache runs no pass. ::

    with pass_counter.record() as counts:
        model(x)
    assert counts.matches["fused_add_rms_norm"] == 2 * n_layers
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Iterator

__all__ = ["PassCounts", "PassCounter", "pass_counter"]


@dataclasses.dataclass
class PassCounts:
    runs: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Graphs each pass ran on (pass name -> count); ``"manager"`` counts the graphs the manager saw."""
    matches: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Rewrites each pass made (pass name -> count)."""
    skipped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """Graphs a pass did not run on: unavailable (its ops not registered) or not applicable at the size."""


class PassCounter:
    """Process-wide counts (:attr:`total`) and the counts inside a block (:meth:`record`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = PassCounts()

    def add(self, kind: str, name: str, n: int = 1) -> None:
        with self._lock:
            getattr(self.total, kind)[name] += n

    def snapshot(self) -> PassCounts:
        with self._lock:
            return PassCounts(*(collections.Counter(getattr(self.total, f.name))
                                for f in dataclasses.fields(PassCounts)))

    @contextlib.contextmanager
    def record(self) -> Iterator[PassCounts]:
        """Yields counts that hold, once the block ends, what the passes did inside it (zero counts dropped)."""
        before = self.snapshot()
        counts = PassCounts()
        yield counts
        after = self.snapshot()
        for f in dataclasses.fields(PassCounts):
            delta = getattr(after, f.name) - getattr(before, f.name)
            getattr(counts, f.name).update(delta)


pass_counter = PassCounter()
