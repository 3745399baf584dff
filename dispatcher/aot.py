"""The AOT forward of levels 3-4: what lets a warm start skip Dynamo's trace.

After a model's first trace, :func:`capture` writes down what a later process needs to run the same thing
without Dynamo: the bytecode Dynamo produced for ``forward`` (``marshal``), the globals that bytecode loads
and Dynamo installed (the modules it imports by alias, and the name of its one compiled graph), the FX graph
Dynamo handed the backend (``dispatcher.graph_io``: nodes, and the placeholders' symbolic example values),
which graph inputs were static (parameters, buffers), and what the trace was specialized on: the first
call's arguments (:func:`call_spec`) and the model's plain attributes (:func:`module_state`).

:func:`load` rebuilds all of it in a new process; :meth:`AotForward.install` puts the globals into
``forward``'s module, the compiled graph as a stub that, at its first call, runs the backend on the rebuilt
graph (the split and every piece's Inductor compile, FX-graph-cache hits after the compile cache's load)
with the call's own arguments as the example inputs Dynamo would have passed, then replaces itself with
the result. The wrapper then dispatches the bytecode exactly as after a trace: no guards, the same input
checks. Anything that does not match (another call shape, other attributes, a torch that names a symbol
otherwise, a damaged payload) raises, and the caller traces instead.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import itertools
import logging
import marshal
import pickle
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from . import compat, graph_io

logger = logging.getLogger(__name__)

__all__ = ["AotForward", "Mismatch", "capture", "load", "call_spec", "module_state", "Unsupported"]

FORMAT = 1
Unsupported = graph_io.Unsupported
_ids = itertools.count()
_LITERALS = (bool, int, float, str, type(None))


class Mismatch(ValueError):
    """An intact artifact traced for something else: other arguments, other model attributes, or a torch that
    names the trace's symbols otherwise. The caller traces (and rewrites the artifact)."""


def call_spec(signature: inspect.Signature, skip_first: bool, args: tuple, kwargs: dict,
              dynamic: dict[str, list[int]]) -> list[tuple]:
    """What a trace is specialized on in a call's arguments: each tensor's dtype, device, rank, sizes (None
    for a dynamic dim) and ``requires_grad``; each plain constant's value; the type of anything else."""
    bound = signature.bind(*((None, *args) if skip_first else args), **kwargs)
    bound.apply_defaults()
    bound = bound.arguments
    spec = []
    for i, (name, value) in enumerate(bound.items()):
        if skip_first and i == 0:
            continue
        if isinstance(value, torch.Tensor):
            dyn = dynamic.get(name, [])
            sizes = [None if d in dyn else int(s) for d, s in enumerate(value.shape)]
            spec.append((name, "tensor", str(value.dtype), str(value.device), sizes, value.requires_grad))
        elif isinstance(value, _LITERALS):
            spec.append((name, "const", repr(value)))
        else:
            spec.append((name, "object", type(value).__qualname__))
    return spec


def _plain(value: Any) -> str | None:
    if isinstance(value, _LITERALS) or isinstance(value, (torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (tuple, list)) or dataclasses.is_dataclass(value):
        text = repr(value)
        return None if " at 0x" in text else text
    return None


def module_state(owner: Any, skip: frozenset[str] = frozenset()) -> list[tuple[str, str, str]]:
    """The plain attributes (numbers, strings, dtypes, dataclasses and sequences of them) of ``owner`` and
    its submodules, which Dynamo bakes into the graph as constants: an epsilon, a head count, a flag. ``skip``:
    names left out (the compile wrapper's own state), as are those starting with ``_do_``."""
    if not isinstance(owner, torch.nn.Module):
        return []
    state = []
    for prefix, module in owner.named_modules():
        for name, value in sorted(vars(module).items()):
            if name in skip or name.startswith("_do_"):
                continue
            text = _plain(value)
            if text is not None:
                state.append((prefix, name, text))
    return state


def _globals_plan(globals_: dict[str, Any], code: types.CodeType) -> dict[str, Any]:
    """The globals Dynamo installed that ``code`` loads: modules by alias, and its one compiled graph."""
    if any(isinstance(c, types.CodeType) for c in code.co_consts):
        raise Unsupported("the traced bytecode holds nested code")
    compiled, modules = [], {}
    for name in code.co_names:
        if not name.startswith("__") or name.endswith("__") or name not in globals_:
            continue  # an attribute name, or a global of the model's own module
        value = globals_[name]
        if name.startswith("__compiled_fn"):
            compiled.append(name)
        elif isinstance(value, types.ModuleType):
            modules[name] = value.__name__
        else:
            raise Unsupported(f"the traced bytecode loads a global Dynamo installed: {name}")
    if len(compiled) != 1:
        raise Unsupported(f"the traced bytecode calls {len(compiled)} compiled graphs (one expected)")
    return {"compiled_fn": compiled[0], "modules": modules}


def capture(function: types.FunctionType, code: types.CodeType, gm: torch.fx.GraphModule,
            static_indices: list[int], spec: list[tuple], state: list[tuple]) -> bytes | None:
    """The AOT artifact of a trace (None, logged at debug level, where this trace or torch has no AOT path)."""
    if not compat.aot_available():
        logger.debug("%s: no AOT artifact: this torch lacks what rebuilding the graph needs", function.__qualname__)
        return None
    try:
        plan = _globals_plan(function.__globals__, code)
        graph = graph_io.graph_to_data(gm)
        data = {"format": FORMAT, "code": marshal.dumps(code), "globals": plan, "graph": graph,
                "static": list(static_indices), "spec": spec, "state": state}
        return pickle.dumps(data, protocol=pickle.HIGHEST_PROTOCOL)
    except Unsupported as e:
        logger.debug("%s: no AOT artifact: %s", function.__qualname__, e)
        return None
    except Exception as e:  # e.g. an unbacked symbol (no source, no hint): never fail the first call for it
        logger.debug("%s: no AOT artifact (%s: %s)", function.__qualname__, type(e).__name__, e)
        return None


class _PlainUnpickler(pickle.Unpickler):
    """Loads plain data only: no class, no function."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"AOT artifact refers to {module}.{name}")


@dataclasses.dataclass
class AotForward:
    """A rebuilt trace: ``code`` (its compiled graph's global renamed for this instance), the graph with its
    fake example inputs, the static inputs' indices, and the modules the code loads by alias."""

    code: types.CodeType
    fn_name: str
    graph: torch.fx.GraphModule
    fake_args: list[Any]
    static: list[int]
    modules: dict[str, types.ModuleType]

    def install(self, function: types.FunctionType,
                compile_graph: Callable[[torch.fx.GraphModule, list[Any], list[Any], list[int]], Callable[..., Any]]
                ) -> None:
        """Put the code's globals into ``function``'s module: the modules, and a stub for the compiled graph
        that compiles it (``compile_graph(graph, example_inputs, fake_args, static)``) at its first call."""
        g = function.__globals__
        for name, module in self.modules.items():
            if g.setdefault(name, module) is not module:
                raise ValueError(f"global {name} of {function.__module__} is not module {module.__name__}")

        def first_call(*args: Any) -> Any:
            compiled = compat.dynamo_disable(compile_graph(self.graph, list(args), self.fake_args, self.static))
            g[self.fn_name] = compiled
            return compiled(*args)

        g[self.fn_name] = first_call

    def uninstall(self, function: types.FunctionType) -> None:
        function.__globals__.pop(self.fn_name, None)


def load(payload: bytes, function: types.FunctionType, spec: list[tuple], state: list[tuple]) -> AotForward:
    """Rebuild an artifact of :func:`capture` for ``function``, whose first call has ``spec`` and whose model
    has ``state``. Raises (ValueError, Unsupported, unpickling and marshal errors) where it cannot be used."""
    data = _PlainUnpickler(io.BytesIO(payload)).load()
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError("not an AOT artifact of this version")
    missing = {"code", "globals", "graph", "static", "spec", "state"} - set(data)
    if missing:
        raise ValueError(f"an AOT artifact without {sorted(missing)}")
    if data["spec"] != spec:
        raise Mismatch(f"traced for other arguments: {data['spec']} (this call: {spec})")
    if data["state"] != state:
        changed = sorted({f"{p}.{n}" for p, n, _ in set(map(tuple, data["state"])) ^ set(state)})[:5]
        raise Mismatch(f"traced for a model with other attributes ({', '.join(changed)})")
    code = marshal.loads(data["code"])
    ref = function.__code__
    if (code.co_argcount, code.co_kwonlyargcount, code.co_freevars) != (
            ref.co_argcount, ref.co_kwonlyargcount, ref.co_freevars):
        raise ValueError("the artifact's bytecode does not take forward's arguments")
    try:
        graph, fake_args = graph_io.graph_from_data(data["graph"])
    except compat.SymbolNameMismatch as e:
        raise Mismatch(str(e)) from None
    plan = data["globals"]
    old, new = plan["compiled_fn"], f"__dynamo_once_aot_fn_{next(_ids)}"
    code = code.replace(co_names=tuple(new if n == old else n for n in code.co_names))
    modules = {name: importlib.import_module(m) for name, m in plan["modules"].items()}
    return AotForward(code, new, graph, fake_args, list(data["static"]), modules)
