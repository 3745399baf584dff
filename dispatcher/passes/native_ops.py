"""Native code back above a token count (``native_ops``): the library's ops, in a compile for more tokens than
``DYNAMO_ONCE_NATIVE_OPS_ABOVE``, replaced by their native forms, which Inductor then fuses itself.

The custom ops and the fusion passes are chosen for a whole model, but which is faster depends on the step's
size: the library's kernels win at decode sizes, where a step is a chain of short launches, and Inductor's fusion
of the native code can win in larger steps (the fp8 8B's batch-128 step, README "Graph passes"). Each per-size
compile (``CompilationConfig.compile_sizes``: by default none, and then this pass changes nothing; the backend
warns) sees its size, so this pass, the last of the library's, puts every library op that has a registered
native form (``dispatcher.passes.native_forms``: the norms, activations, quantizations and the fused ops the
other passes made of them) back in that form in the compiles above the threshold; smaller ones and the symbolic
compile keep the library's kernels. Ops without a native form (attention, the GEMMs) stay.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from .. import compat, envs
from .graph_pass import GraphPass
from .native_forms import native_form, native_forms_key, registered_native_forms

__all__ = ["NativeOpsPass", "acts_in_any"]


def acts_in_any(compile_sizes: Iterable[int]) -> bool:
    """Whether the pass rewrites a compile of any of these token counts: more than ``DYNAMO_ONCE_NATIVE_OPS_ABOVE``.
    The symbolic compile it never rewrites, so without such a size in ``CompilationConfig.compile_sizes`` it does
    nothing."""
    above = envs.native_ops_above()
    return any(size > above for size in compile_sizes)


class NativeOpsPass(GraphPass):
    """Every ``dynamo_once`` op with a native form -> that form, in compiles of more than
    ``DYNAMO_ONCE_NATIVE_OPS_ABOVE`` tokens."""

    name = "native_ops"
    opaque_ops: ClassVar[bool] = True  # the ops as called, one node each, not their Triton kernels

    def is_applicable(self, size: int | None) -> bool:
        return size is not None and acts_in_any((size,))

    def state_key(self) -> str:
        names = registered_native_forms()
        return f"above={envs.native_ops_above()}|{native_forms_key(names)}"

    def __call__(self, graph: torch.fx.Graph, size: int | None) -> int:
        forms = {f"dynamo_once::{name}": native_form(name) for name in registered_native_forms()}
        return compat.replace_op_calls(graph, forms, self.name)
