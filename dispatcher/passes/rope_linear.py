"""``RopeLinearPass``: a bf16 / fp16 merged QKV GEMM and the rotary embedding of its q and k -> one
``dynamo_once::rope_linear``, which at one token rotates them in the GEMV's epilogue (one kernel), elsewhere runs
the GEMM and the rotary kernel in place on its output.

An attention layer's QKV projection writes ``[T, (Hq + 2 Hkv) D]``, splits it into q, k and v, and rotates q's and
k's heads: at a decode step's one token, one more launch a layer after a GEMM that is a read of its weight. The op
decides at run time, on the concrete M, so one compile serves every size. The values are the unfused ops': the
GEMM's output rounded to the model's dtype, then the rotation in fp32, rounded once.

Two stages, both Inductor patterns:

1. the rotary module's native form (custom ops off, level 3's default; ``native_forms``), q and k the first two
   parts of a split of a GEMM's output, -> ``dynamo_once::rotary_embedding`` (traced, and checked by retracing on
   the matched shapes as ``register_replacement`` does; the head size is the cos/sin cache's width: full rotary);
2. ``rotary_embedding(positions, split(mm(x, w.T))[0], split(...)[1], cache, D, True)`` -> ``rope_linear``, split
   again into q, k, v: written node by node, because the rewrite needs the split's sizes, which a traced pattern
   does not capture. Also what the model calls with the custom ops on (kept opaque while the pass runs).

A split of three parts of a no-bias GEMM of a 2-d bf16 / fp16 input, NeoX rotation of the whole head: anything
else is left as it is. Runs before ``small_m_linear``, which would take the GEMM first; compiles for more than
``small_m_linear.MAX_TOKENS`` tokens are left alone. This module names ops, never models.
"""

from __future__ import annotations

import operator
from typing import Any, ClassVar

import torch

from .. import compat
from .fused_add_rms_norm import dynamo_once_op
from .native_forms import native_form, native_forms_key
from .pattern_pass import PatternPass
from .small_m_linear import MAX_TOKENS

__all__ = ["RopeLinearPass"]

_DTYPES = (torch.bfloat16, torch.float16)
_MM, _SPLIT, _PERMUTE = torch.ops.aten.mm.default, torch.ops.aten.split_with_sizes.default, torch.ops.aten.permute.default


def _val(node: Any) -> Any:
    return getattr(node, "meta", {}).get("val")


def _split_part(node: Any, index: int) -> Any:
    """The ``split_with_sizes`` node whose part ``index`` ``node`` is (a GEMM of a transposed weight's output), else
    None."""
    if getattr(node, "target", None) is not operator.getitem or node.args[1] != index:
        return None
    split = node.args[0]
    if getattr(split, "target", None) is not _SPLIT or len(split.args[1]) != 3:
        return None
    gemm = split.args[0]
    if getattr(gemm, "target", None) is not _MM or getattr(gemm.args[1], "target", None) is not _PERMUTE:
        return None
    return split


def _native_search(rotary: Any) -> Any:
    def search(positions, q, k, cache):
        return rotary(positions, q, k, cache, cache.shape[-1], True)
    return search


def _to_op(op: Any) -> Any:
    def replace(positions, q, k, cache):
        return op(positions, q, k, cache, cache.shape[-1], True)
    return replace


def _native_check(match: Any) -> bool:
    """Stage 1 only where stage 2 will fuse: q and k the parts 0 and 1 of one three-part split of a GEMM's output,
    bf16 / fp16."""
    q, k = match.kwargs["q"], match.kwargs["k"]
    split = _split_part(q, 0)
    return split is not None and split is _split_part(k, 1) and getattr(_val(q), "dtype", None) in _DTYPES


def _fused_pattern(rotary_op: Any) -> Any:
    """``rotary_op(positions, q, k, cache, head_size, is_neox)`` of ``q, k, v = split_with_sizes(mm(x, w.T))``:
    outputs the rotated q, k and v."""
    p = compat.pattern_expressions()
    gemm = p.CallFunction(_MM, p.KeywordArg("x"), p.CallFunction(_PERMUTE, p.KeywordArg("w"), p.Ignored()))
    split = p.CallFunction(_SPLIT, gemm, p.KeywordArg("sizes"), p.KeywordArg("dim"), _users=3)
    q, k, v = (p.CallFunction(operator.getitem, split, i) for i in range(3))
    rope = p.CallFunction(rotary_op, p.KeywordArg("positions"), q, k, p.KeywordArg("cache"), p.KeywordArg("head_size"),
                          p.KeywordArg("is_neox"), _users=2)
    return p.MultiOutputPattern([p.CallFunction(operator.getitem, rope, 0), p.CallFunction(operator.getitem, rope, 1), v])


def _fusable(match: Any) -> bool:
    """A 2-d bf16 / fp16 GEMM's output split in three along its last dim, whole heads of the cache's width rotated
    NeoX-style: what ``rope_linear`` computes."""
    kw = match.kwargs
    x, w, cache = _val(kw["x"]), _val(kw["w"]), _val(kw["cache"])
    sizes, head_size = kw["sizes"], kw["head_size"]
    if not all(isinstance(t, torch.Tensor) for t in (x, w, cache)) or kw["is_neox"] is not True:
        return False
    if x.dtype not in _DTYPES or w.dtype != x.dtype or x.dim() != 2 or w.dim() != 2 or kw["dim"] not in (-1, 1):
        return False
    if not (isinstance(head_size, int) and cache.dim() == 2 and cache.shape[-1] == head_size and head_size % 2 == 0):
        return False
    return (all(isinstance(s, int) and s % head_size == 0 for s in sizes)  # whole heads: the op pairs a head's halves
            and compat.statically_equal([sum(sizes)], w.shape[:1]))


def _fuse(op: Any) -> Any:
    def handler(match: Any, x: Any, w: Any, sizes: list, dim: int, positions: Any, cache: Any, head_size: int,
                is_neox: bool) -> None:
        q_size, k_size, v_size = sizes

        def replace(x, w, positions, cache):
            out = op(x, w, positions, cache, head_size, (q_size + k_size) // head_size)
            q, k, v = out.split([q_size, k_size, v_size], dim=-1)
            return q, k, v

        compat.replace_match(match, replace, [x, w, positions, cache])
    return handler


class RopeLinearPass(PatternPass):
    """bf16 / fp16 ``rotary(split(mm(x, w.T)))`` -> ``dynamo_once::rope_linear`` (QKV GEMM + rotary of q and k in one
    kernel at one token), in compiles for the symbolic size and for sizes up to ``MAX_TOKENS``."""

    name = "rope_linear"
    opaque_ops: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self._fusions: Any = None

    def is_available(self) -> bool:
        return dynamo_once_op("rope_linear") is not None and dynamo_once_op("rotary_embedding") is not None

    def is_applicable(self, size: int | None) -> bool:
        return size is None or size <= MAX_TOKENS

    def state_key(self) -> str:
        return native_forms_key(["rotary_embedding"])

    def anchor_ops(self) -> frozenset:
        """``aten.mm``: a graph without a GEMM traces no pattern."""
        return frozenset({_MM})

    def register_patterns(self, patterns: Any) -> int:
        """Stage 1 into ``patterns``, stage 2 into a pass of its own (applied after)."""
        op, rotary_op, native = dynamo_once_op("rope_linear"), dynamo_once_op("rotary_embedding"), native_form("rotary_embedding")
        count = 0
        with compat.triton_ops_decomposed(False):  # the ops opaque, as the compiles see them while the pass runs
            if native is not None:
                for cache_dtype in (torch.bfloat16, torch.float32):  # a cache in the model's dtype is upcast first
                    example = [torch.zeros(4, dtype=torch.long), torch.zeros(4, 32, dtype=torch.bfloat16),
                               torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(64, 16, dtype=cache_dtype)]
                    compat.register_replacement(_native_search(native), _to_op(rotary_op), example, patterns, None,
                                                _native_check)
                    count += 1
        self._fusions = compat.pattern_matcher_pass(f"{self.name}_fuse")
        compat.register_graph_pattern(_fused_pattern(rotary_op), self._fusions, _fuse(op), _fusable)
        return count + 1

    def apply_patterns(self, graph: torch.fx.Graph) -> int:
        """Stage 1, then stage 2; the count is stage 2's (the fusions)."""
        self._patterns.apply(graph)
        return int(self._fusions.apply(graph) or 0)
