"""``SequenceParallelPass``: GEMM -> all-reduce -> residual add + RMSNorm -> GEMM, rewritten as sequence parallelism.

A row-parallel GEMM (o_proj, down_proj) ends in an all-reduce of its partial products ``[T, hidden]``; the
residual add and the RMSNorm that follow are then computed by every rank on all T tokens, and the normed
rows feed the next column-parallel GEMM. For a graph compiled for T tokens (T a multiple of the group's N
ranks, at least ``min_tokens``), the pass rewrites each site::

    ar = all_reduce(x, g)                     rs = reduce_scatter(x, 0, g)              # [T / N, hidden]
    normed, res = fused_add_rms_norm(   ->    normed_s, res_s = fused_add_rms_norm(rs, rank_shard(residual, 0, g),
        ar, residual, w, eps)                                                      w, eps)
                                              normed = all_gather(normed_s, 0, g); res = all_gather(res_s, 0, g)

(also with a bias added after the all-reduce, ``ar + bias``, and Gemma's fused op), then simplifies the chain
and fuses the GEMMs with their collectives:

- ``rank_shard(all_gather(y, 0, g), 0, g)`` -> ``y``: the residual a site passes to the next site of the
  graph stays this rank's shard of tokens; it is gathered only where something else reads it (the graph's
  output: the piece boundary at attention). Per layer: a reduce-scatter and an all-gather in place of each
  all-reduce (the same bytes), plus one all-gather of the residual and one local slice of it per piece;
- ``reduce_scatter(mm(a, b), 0, g)`` -> ``dynamo_once::matmul_reduce_scatter(a, b, g)`` and
  ``mm(all_gather(a, 0, g), b)`` -> ``dynamo_once::all_gather_matmul(a, b, g)``: on CUDA, torch's
  ``symm_mem.fused_matmul_reduce_scatter`` / ``fused_all_gather_matmul``, which overlap the transfers with
  the GEMM (elsewhere the plain GEMM and collective: see ``models.parallel.async_tp``).

What it computes equals the unrewritten graph: the reduction sums the same partial products; the add and the
norm are row-wise, so a rank's rows come out as they would among all T; every GEMM reads the same full rows
(the fused ops cut the GEMM into one product per rank's block, which may round differently on the GPU). The
match needs the residual add and the norm as one ``dynamo_once::fused_add_rms_norm`` (or Gemma's) node right
after the all-reduce: the model's fused-add op with the custom ops on, else pass ``fused_add_rms_norm``
(run before this one) makes it from native code. Gemma 2 normalizes the all-reduce's output before the
residual add (its sandwich norms): not matched.

Only per-size compiles of at least ``min_tokens`` tokens are rewritten (``DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS``,
given by the backend): prefill sizes; the symbolic compile and the decode sizes keep the all-reduce. A size that
the group's rank count does not divide is left as it is. The ops are looked up by name (``dynamo_once``
namespace; registered by the tensor-parallel layers): this module names ops, never models.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.fx

from .. import compat
from .fused_add_rms_norm import dynamo_once_op
from .graph_pass import GraphPass

logger = logging.getLogger(__name__)

__all__ = ["SequenceParallelPass", "DEFAULT_MIN_TOKENS"]

#: The smallest compile size rewritten when the backend gives none (``dispatcher.envs`` holds the variable's default).
DEFAULT_MIN_TOKENS = 1024
_EPS_STAND_IN = 1e-6
_COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "rank_shard", "matmul_reduce_scatter",
                "all_gather_matmul")
_FUSED = ("fused_add_rms_norm", "gemma_fused_add_rms_norm")

Pattern = tuple[Callable[..., Any], Callable[..., Any], list[Any]]


def _op(name: str) -> Any:
    return getattr(torch.ops.dynamo_once, name).default


def _site_patterns(g: str, fused: Any, rows: int) -> list[Pattern]:
    """The four forms of one site of group ``g`` (normed and residual used, or normed only; with or without a
    bias added after the all-reduce), each with its rewrite. ``rows``: a token count the group divides."""
    x, w = [torch.empty(rows, 8), torch.empty(rows, 8)], torch.empty(8)
    forms = []
    for both in (True, False):
        plain, with_bias = _site_forms(g, fused, both)
        forms += [(*plain, x + [w, _EPS_STAND_IN]), (*with_bias, x + [w, torch.empty(8), _EPS_STAND_IN])]
    return forms


def _site_forms(g: str, fused: Any, both: bool) -> tuple[tuple[Callable, Callable], tuple[Callable, Callable]]:
    """(search, replacement) without and with a bias. Their argument names are the match's keys; eps comes last
    (see ``quant_fusion``)."""
    all_reduce, reduce_scatter, all_gather, shard = (_op(n) for n in _COLLECTIVES[:4])

    def outputs(out):
        return (out[0], out[1]) if both else out[0]

    def rewrite(rs, residual, weight, eps):
        out = fused(rs, shard(residual, 0, g), weight, eps)
        return (all_gather(out[0], 0, g), all_gather(out[1], 0, g)) if both else all_gather(out[0], 0, g)

    def search(x, residual, weight, eps):
        return outputs(fused(all_reduce(x, g), residual, weight, eps))

    def replace(x, residual, weight, eps):
        return rewrite(reduce_scatter(x, 0, g), residual, weight, eps)

    def search_bias(x, residual, weight, bias, eps):
        return outputs(fused(all_reduce(x, g) + bias, residual, weight, eps))

    def replace_bias(x, residual, weight, bias, eps):
        return rewrite(reduce_scatter(x, 0, g) + bias, residual, weight, eps)

    return (search, replace), (search_bias, replace_bias)


def _gemm_patterns(g: str, rows: int) -> list[Pattern]:
    """A GEMM into the reduce-scatter, and an all-gather into a GEMM -> the fused ops (same values)."""
    reduce_scatter, all_gather = _op("reduce_scatter"), _op("all_gather")
    mm_rs, ag_mm = _op("matmul_reduce_scatter"), _op("all_gather_matmul")

    def search_rs(a, b):
        return reduce_scatter(torch.mm(a, b), 0, g)

    def replace_rs(a, b):
        return mm_rs(a, b, g)

    def search_ag(a, b):
        return torch.mm(all_gather(a, 0, g), b)

    def replace_ag(a, b):
        return ag_mm(a, b, g)

    return [(search_rs, replace_rs, [torch.empty(rows, 6), torch.empty(6, 8)]),
            (search_ag, replace_ag, [torch.empty(rows, 6), torch.empty(6, 8)])]


def _group_names(graph: torch.fx.Graph) -> set[str]:
    """The groups of the graph's all-reduces."""
    target = _op("all_reduce")
    return {n.args[1] for n in graph.nodes if n.op == "call_function" and n.target == target
            and len(n.args) > 1 and isinstance(n.args[1], str)}


def _fold_shard_of_gather(graph: torch.fx.Graph, g: str) -> int:
    """``rank_shard(all_gather(y, 0, g), 0, g)`` -> ``y``; then drop the gathers and shards nobody reads."""
    shard, all_gather = _op("rank_shard"), _op("all_gather")
    folded = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != shard or tuple(node.args[1:]) != (0, g):
            continue
        src = node.args[0]
        if isinstance(src, torch.fx.Node) and src.target == all_gather and tuple(src.args[1:]) == (0, g):
            node.replace_all_uses_with(src.args[0])
            graph.erase_node(node)
            folded += 1
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.target in (shard, all_gather) and not node.users:
            graph.erase_node(node)
    return folded


class SequenceParallelPass(GraphPass):
    """All-reduce + fused-add RMSNorm -> reduce-scatter, the norm on this rank's tokens, all-gather (module doc)."""

    name = "sequence_parallel"
    #: the model's fused-add norm, a ``torch.library.triton_op``, must stay one node to be matched
    opaque_ops: ClassVar[bool] = True

    def __init__(self, min_tokens: int = DEFAULT_MIN_TOKENS) -> None:
        self.min_tokens = min_tokens
        self._lock = threading.Lock()
        self._patterns: dict[tuple[str, int], tuple[Any, Any]] = {}  # shared by copies (with_min_tokens)
        self._size = threading.local()

    def with_min_tokens(self, min_tokens: int) -> SequenceParallelPass:
        """This pass (its traced patterns shared) rewriting compiles of at least ``min_tokens`` tokens."""
        p = copy.copy(self)
        p.min_tokens = min_tokens
        return p

    def fused_ops(self) -> list[Any]:
        return [op for name in _FUSED if (op := dynamo_once_op(name)) is not None]

    def is_available(self) -> bool:
        return all(dynamo_once_op(n) is not None for n in _COLLECTIVES) and bool(self.fused_ops())

    def is_applicable(self, size: int | None) -> bool:
        return size is not None and size >= self.min_tokens

    def state_key(self) -> str:
        return f"min_tokens={self.min_tokens},fused={len(self.fused_ops())}"

    def _check(self, match: Any) -> bool:
        """The all-reduce's input is ``[size, hidden]`` (rows = the compile's tokens), the residual the same
        shape, the weight (and bias) ``[hidden]``."""
        vals = {k: v.meta.get("val") for k, v in match.kwargs.items() if hasattr(v, "meta")}
        x, residual, weight = vals.get("x"), vals.get("residual"), vals.get("weight")
        size = getattr(self._size, "value", None)
        if not all(isinstance(t, torch.Tensor) for t in (x, residual, weight)) or size is None or x.dim() != 2:
            return False
        ok = (compat.statically_equal(x.shape, (size, x.shape[1]))
              and compat.statically_equal(residual.shape, x.shape))
        vectors = [weight] + ([vals.get("bias")] if "bias" in match.kwargs else [])
        return ok and all(isinstance(v, torch.Tensor) and compat.statically_equal(v.shape, x.shape[1:])
                          for v in vectors)

    def _prepared(self, g: str, world: int) -> tuple[Any, Any]:
        """The site and GEMM patterns of group ``g`` (``world`` ranks), traced once on fake tensors (no collective
        runs)."""
        with self._lock:
            if (g, world) not in self._patterns:
                site = compat.pattern_matcher_pass(f"{self.name}_sites")
                gemm = compat.pattern_matcher_pass(f"{self.name}_gemms")
                with compat.fake_tensor_mode(), compat.triton_ops_decomposed(False):
                    for fused in self.fused_ops():
                        for search, replace, example in _site_patterns(g, fused, 2 * world):
                            compat.register_replacement(search, replace, example, site, {"eps": _EPS_STAND_IN},
                                                        self._check)
                    for search, replace, example in _gemm_patterns(g, 2 * world):
                        compat.register_replacement(search, replace, example, gemm)
                self._patterns[(g, world)] = (site, gemm)
            return self._patterns[(g, world)]

    def __call__(self, graph: torch.fx.Graph, size: int | None) -> int:
        rewrites = 0
        for g in sorted(_group_names(graph)):
            world = compat.process_group_size(g)
            if world is None or world < 2 or size is None or size % world:
                logger.debug("sequence_parallel: group %s (%s ranks) left at size %s", g, world, size)
                continue
            site, gemm = self._prepared(g, world)
            self._size.value = size
            try:
                found = int(site.apply(graph) or 0)
            finally:
                self._size.value = None
            if found:
                _fold_shard_of_gather(graph, g)
                gemm.apply(graph)
            rewrites += found
        return rewrites
