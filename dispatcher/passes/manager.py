"""``PostGradPassManager``: runs the configured graph passes inside every level 3-4 Inductor compile.

Installed as Inductor's ``post_grad_custom_post_pass`` option (``compat.POST_GRAD_PASS_OPTION``) in the
config patches of every compile the piecewise backend makes: each piece, once for the symbolic token
count (size None) and once per size in ``compile_sizes``. Inductor calls it with the post-grad graph,
after its own passes; it runs the library's passes (``PassConfig`` order), with plugin passes
(``dispatcher.plugins.add_post_grad_pass``) at the places they asked for, then any pass the user's
Inductor options had set there.

Its :meth:`~PostGradPassManager.uuid` enters the key of Inductor's FX graph cache: a hash of which
passes run and of their source, so that a graph compiled with other passes is never reused.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch.fx

from .. import compat, envs, plugins
from .counters import pass_counter
from .fused_add_rms_norm import FusedAddRMSNormPass
from .gated_linear import GatedLinearPass
from .gemm_act_quant import GemmActQuantPass
from .graph_pass import GraphPass, module_source_hash
from .native_ops import NativeOpsPass
from .noop_elimination import NoOpEliminationPass
from .norm_linear import NormLinearPass
from .pass_config import PassConfig
from .pattern_pass import PatternPass
from .quant_fusion import ActQuantPass, RMSNormQuantPass
from .quant_gemm import QuantGemmPass
from .rope_linear import RopeLinearPass
from .sequence_parallel import SequenceParallelPass
from .small_m_linear import SmallMLinearPass

logger = logging.getLogger(__name__)

__all__ = ["PostGradPassManager", "build_pass_manager", "builtin_passes", "order_passes", "with_compile_size",
           "compile_context"]


@functools.cache
def builtin_passes() -> tuple[GraphPass, ...]:
    """The library's passes, one instance each per process (patterns are traced once), in ``PassConfig`` order."""
    passes = (NoOpEliminationPass(), FusedAddRMSNormPass(), RMSNormQuantPass(), ActQuantPass(), GemmActQuantPass(),
              QuantGemmPass(), SequenceParallelPass(), GatedLinearPass(), RopeLinearPass(), SmallMLinearPass(),
              NormLinearPass(), NativeOpsPass())
    assert tuple(p.name for p in passes) == PassConfig.names(), "PassConfig's fields name the builtin passes"
    return passes


def order_passes(builtins: Sequence[GraphPass],
                 added: Sequence[tuple[GraphPass, str | None, str | None]]) -> list[GraphPass]:
    """``builtins`` in order, each added ``(pass, before, after)`` placed just before ``before``, just after
    ``after`` (and after the passes added earlier with the same ``after``), or, with neither, at the end."""
    order = list(builtins)
    for p, before, after in added:
        names = [q.name for q in order]
        if before is not None:
            i = names.index(before)
        elif after is not None:
            i = names.index(after) + 1
            while i < len(order) and any(q is order[i] and a == after for q, _, a in added):
                i += 1
        else:
            i = len(order)
        order.insert(i, p)
    return order


def _chained(option: Any) -> tuple[Any, ...]:
    """The passes already in the Inductor option (the user's): run after ours; each must have a uuid()."""
    if option is None or isinstance(option, PostGradPassManager):
        return ()
    passes = tuple(option) if isinstance(option, (list, tuple)) else (option,)
    base = compat.custom_graph_pass_class()
    for p in passes:
        if not isinstance(p, base):
            raise ValueError(
                f"Inductor option {compat.POST_GRAD_PASS_OPTION}={p!r}: the pass manager runs it after its passes "
                "only if it is a torch._inductor.custom_graph_pass.CustomGraphPass (Inductor's cache keys on its "
                "uuid()); or add it as a dispatcher.passes.GraphPass with dispatcher.plugins.add_post_grad_pass")
    return passes


class PostGradPassManager(compat.custom_graph_pass_class()):
    """The passes of one compile, in order; ``size`` is the token count compiled for (None: symbolic).

    Attributes:
        passes: every pass switched on (the library's by :class:`PassConfig`, plugin passes while added),
            in the order they run; each also checks, per graph, ``is_available()`` and ``is_applicable(size)``.
        config: the :class:`PassConfig` it was built from.
    """

    def __init__(self, passes: Sequence[GraphPass], config: PassConfig, size: int | None = None,
                 chained: tuple[Any, ...] = ()) -> None:
        self.passes = list(passes)
        self.config = config
        self.size = size
        self.chained = chained

    def for_size(self, size: int | None) -> PostGradPassManager:
        """The same passes for a compile of ``size`` tokens."""
        manager = copy.copy(self)
        manager.size = size
        return manager

    def active_passes(self) -> list[GraphPass]:
        """The passes that run on a graph of this compile."""
        return [p for p in self.passes if p.is_available() and p.is_applicable(self.size)]

    def keeps_ops_opaque(self) -> bool:
        """Whether a pass of this compile matches the library's ops as called (``GraphPass.opaque_ops``)."""
        return any(p.opaque_ops for p in self.active_passes())

    def prepare(self) -> None:
        """Trace the patterns of the available pattern passes now (each pass otherwise traces its own on the
        first graph it runs on)."""
        for p in self.passes:
            if isinstance(p, PatternPass) and p.is_available():
                p.prepare()

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass_counter.add("runs", "manager")
        for p in self.passes:
            if not p.is_available() or not p.is_applicable(self.size):
                why = "unavailable (its ops are not registered)" if not p.is_available() else "not applicable"
                logger.debug("pass %s skipped at size %s: %s", p.name, self.size, why)
                pass_counter.add("skipped", p.name)
                continue
            t0 = time.perf_counter()
            n = p(graph, self.size) or 0
            pass_counter.add("runs", p.name)
            pass_counter.add("matches", p.name, n)
            logger.debug("pass %s at size %s: %d rewrites in %.1f ms", p.name, self.size, n,
                         (time.perf_counter() - t0) * 1e3)
        # The library's Triton ops in the graph (kept opaque for the passes that match them, or put in by a pass)
        # go back to the form torch gives an op a model calls: their Triton kernels, which Inductor launches from
        # its code. Left opaque, each is a call through the dispatcher into Python at run time (tens of µs of host
        # time a call: 45% of the fp8 8B's 2048-token prefill).
        n = compat.decompose_triton_ops(graph, compat.triton_op_names("dynamo_once"))
        pass_counter.add("matches", "decompose_triton_ops", n)
        for c in self.chained:
            c(graph)

    def uuid(self) -> str | None:
        """A hash of this manager's source, then of each pass that runs (name and ``uuid()``), then of the
        chained passes' ``uuid()``; None (Inductor does not cache) when a chained pass returns None.

        ``DYNAMO_ONCE_PDL`` too: the library's ops, opaque in the graph the key is computed from, trace to their
        kernels' PDL or plain form by it (``ops.triton_utils.pdl_launch``); a graph compiled one way must not serve
        the other."""
        h = hashlib.sha256(module_source_hash(__name__).encode())
        h.update(module_source_hash(compat.__name__).encode())  # the Triton ops' decomposition after the passes
        h.update(f"\npdl:{envs.pdl()}".encode())
        for p in self.active_passes():
            h.update(f"\n{p.name}:{p.uuid()}".encode())
        for c in self.chained:
            key = c.uuid()
            if key is None:
                return None
            h.update(f"\nchained:{key!r}".encode())
        return h.hexdigest()

    def __repr__(self) -> str:
        return f"PostGradPassManager(passes={[p.name for p in self.passes]}, size={self.size})"


def build_pass_manager(config: PassConfig, existing: Any = None,
                       sequence_parallel_min_tokens: int | None = None) -> PostGradPassManager:
    """The manager of a level 3-4 model: the library's passes ``config`` leaves on and the plugin passes,
    in order; ``existing`` is what the Inductor options already held (run after ours).
    ``sequence_parallel_min_tokens``: the smallest compile size pass ``sequence_parallel`` rewrites (None: its
    default)."""
    added = plugins.get_post_grad_passes()
    builtin_names = PassConfig.names()
    ordered = order_passes(builtin_passes(), added)
    on = [p for p in ordered if p.name not in builtin_names or config.enabled(p.name)]
    if sequence_parallel_min_tokens is not None:
        on = [p.with_min_tokens(sequence_parallel_min_tokens) if isinstance(p, SequenceParallelPass) else p
              for p in on]
    manager = PostGradPassManager(on, config, chained=_chained(existing))
    logger.debug("post-grad passes: %s", ", ".join(p.name for p in on) or "none")
    return manager


def with_compile_size(options: dict[str, Any], size: int | None) -> dict[str, Any]:
    """``options`` whose pass manager (if any) runs for a compile of ``size`` tokens (None: symbolic)."""
    manager = options.get(compat.POST_GRAD_PASS_OPTION)
    if not isinstance(manager, PostGradPassManager):
        return options
    return {**options, compat.POST_GRAD_PASS_OPTION: manager.for_size(size)}


def compile_context(options: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """What an Inductor compile with ``options`` runs under: ``torch.library.triton_op`` ops kept opaque when
    its pass manager has a pass that matches them, else inlined into their Triton kernels (torch's default)."""
    manager = options.get(compat.POST_GRAD_PASS_OPTION)
    if isinstance(manager, PostGradPassManager) and manager.keeps_ops_opaque():
        return compat.triton_ops_decomposed(False)
    return contextlib.nullcontext()
