"""Compilation counters that tests assert on.

``compilation_counter`` is process-wide. Use :meth:`CompilationCounter.expect`
to assert exact deltas over a block::

    with compilation_counter.expect(num_graphs_seen=1, num_backend_compilations=1):
        model(x)
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator

__all__ = ["CompilationCounter", "compilation_counter"]


@dataclasses.dataclass
class CompilationCounter:
    num_models_seen: int = 0
    """Decorated instances (or functions) that went through their first compile at levels >= 1."""
    num_graphs_seen: int = 0
    """FX graphs Dynamo traced and handed to our backend."""
    num_backend_compilations: int = 0
    """Backend compilations (one per graph, plus one per piece and size for piecewise levels)."""
    num_codes_captured: int = 0
    """Transformed code objects captured by the bytecode hook."""
    num_dispatched_calls: int = 0
    """Calls that ran a captured code directly, skipping Dynamo."""
    num_aot_loads: int = 0
    """Forwards rebuilt from an AOT artifact of the compile cache (levels 3-4): their first call skipped Dynamo."""
    num_recompiles: int = 0
    """Traces after an instance's first (level 1 recompiles, or a refused one at level 2)."""
    num_piecewise_graphs_seen: int = 0
    num_piecewise_capturable_graphs_seen: int = 0
    num_cudagraph_captured: int = 0

    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that each named counter grows by exactly the given amount inside the block."""
        names = set(self.snapshot())
        unknown = sorted(set(deltas) - names)
        if unknown:
            raise ValueError(f"expect: unknown counter(s) {unknown}; known: {sorted(names)}")
        before = self.snapshot()
        yield
        after = self.snapshot()
        wrong = {
            k: (after[k] - before[k], v) for k, v in deltas.items() if after[k] - before[k] != v
        }
        if wrong:
            detail = ", ".join(f"{k}: got +{got}, expected +{exp}" for k, (got, exp) in wrong.items())
            raise AssertionError(f"compilation counters: {detail}")


compilation_counter = CompilationCounter()
