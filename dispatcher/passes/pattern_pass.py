"""``PatternPass``: a graph pass made of Inductor patterns (a search function -> its replacement)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch
import torch.fx

from .. import compat
from .graph_pass import GraphPass

logger = logging.getLogger(__name__)

__all__ = ["PatternPass"]


class PatternPass(GraphPass):
    """Rewrites every match of its patterns with Inductor's pattern matcher.

    Subclasses implement :meth:`register_patterns`, which registers each pattern with
    ``compat.register_replacement`` (traced on example inputs, so a pattern has the aten ops and dtype
    conversions of a post-grad graph). Patterns are traced once, on first use, and again only when
    :meth:`state_key` (e.g. which ops are registered) changes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._patterns: Any = None
        self._prepared_for: str | None = None
        self.num_patterns = 0

    def register_patterns(self, patterns: Any) -> int:
        """Register every pattern into ``patterns`` (a ``PatternMatcherPass``); return how many."""
        raise NotImplementedError(f"{type(self).__name__} must implement register_patterns(patterns)")

    def prepare(self) -> None:
        """Trace the patterns now, if not yet traced for this :meth:`state_key` (the first call does; callable
        from inside a compile)."""
        key = self.state_key()
        with self._lock:
            if self._prepared_for == key:
                return
            t0 = time.perf_counter()
            patterns = compat.pattern_matcher_pass(self.name)
            # Models are built under a default device (the loader's "cuda" or "meta") and dtype (the model's):
            # the example inputs are fp32 CPU tensors unless a pass says otherwise. A pattern holds no device:
            # it matches graphs on any.
            dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.float32)
            try:
                with compat.outside_compile(), torch.device("cpu"):
                    self.num_patterns = self.register_patterns(patterns)
            finally:
                torch.set_default_dtype(dtype)
            self._patterns, self._prepared_for = patterns, key
        logger.debug("%s: %d patterns traced in %.2fs", self.name, self.num_patterns, time.perf_counter() - t0)

    def anchor_ops(self) -> frozenset | None:
        """Ops every pattern of this pass contains, or None (the default): a graph calling none of them is left
        alone without tracing the patterns (a pass that is on by default then costs a model it cannot match
        nothing)."""
        return None

    def apply_patterns(self, graph: torch.fx.Graph) -> int:
        """Rewrite ``graph`` with the traced patterns; return the rewrites counted as matches (a pass of several
        stages applies each here)."""
        return int(self._patterns.apply(graph) or 0)

    def __call__(self, graph: torch.fx.Graph, size: int | None) -> int:
        anchors = self.anchor_ops()
        if anchors is not None and not any(node.target in anchors for node in graph.nodes):
            return 0
        self.prepare()
        return self.apply_patterns(graph)
