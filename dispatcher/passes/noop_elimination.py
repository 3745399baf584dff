"""``NoOpEliminationPass``: drop views, reshapes, slices and expands to the shape their input already has.

Such a node changes nothing (same shape, so the same strides and storage offset) but sits between the
ops a fusion pattern must see adjacent: ``h = (x + r).view(-1, hidden)`` of a ``[T, hidden]`` sum, a
full slice ``h[:, :hidden]``. Inductor's own no-op removal runs before the custom passes, but it misses
``_unsafe_view``, ``reshape`` and ``expand``, and does not run with ``pattern_matcher=False``.
Shapes are compared for every value of the symbolic sizes, without adding a guard.
"""

from __future__ import annotations

import torch
import torch.fx

from .. import compat
from .graph_pass import GraphPass

__all__ = ["NoOpEliminationPass"]

_aten = torch.ops.aten
#: ops returning their first argument, or a view of all of it, whenever the output has the input's shape
_SAME_SHAPE_NOOPS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default,
                     _aten.slice.Tensor, _aten.expand.default)


def _is_noop(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _SAME_SHAPE_NOOPS or not node.args:
        return False
    src = node.args[0]
    if not isinstance(src, torch.fx.Node):
        return False
    out, inp = node.meta.get("val"), src.meta.get("val")
    return (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor) and out.dtype == inp.dtype
            and compat.statically_equal(out.shape, inp.shape))


class NoOpEliminationPass(GraphPass):
    """Replace each same-shape view / reshape / slice / expand by its input; returns how many it removed."""

    name = "noop"

    def __call__(self, graph: torch.fx.Graph, size: int | None) -> int:
        removed = 0
        for node in list(graph.nodes):
            if _is_noop(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                removed += 1
        return removed
