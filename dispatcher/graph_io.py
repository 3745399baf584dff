"""A Dynamo FX graph as plain data (tuples, strings, numbers) and back, for the AOT forward (``dispatcher.aot``).

What is kept: every node's op, name, target, arguments and type annotation, its ``stack_trace``, and its example value (the
placeholders' are the backend's fake inputs; ``split_module`` finds the symbols each piece needs in the
others'): a tensor's sizes, strides and storage offset (ints, or expressions of the trace's dynamic symbols),
dtype, device, ``requires_grad`` and whether it is an inference tensor; a SymInt's expression; a tuple of them. Each symbol is kept with the
name of its source and its hint, from which :func:`graph_from_data` makes the same symbol in a new ShapeEnv,
so that the rebuilt graph's fake inputs equal the trace's (and Inductor's cache keys with them). Rebuilt, each
placeholder has a fake tensor of its own; intermediate nodes of one description share one (:class:`_Examples`).

A target is kept by name: an operator as ``ns::name.overload``, a Python callable as its module and qualified
name, checked at save time to resolve to the very object. A graph with anything else (``get_attr``,
``call_module``, a constant of another type, a target no name resolves to) raises :class:`Unsupported`.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any

import torch
import torch.fx

from . import compat

__all__ = ["Unsupported", "graph_to_data", "graph_from_data"]

_LITERALS = (bool, int, float, str, type(None))
_EXPR = re.compile(r"^[\w*+\-() /]+$")


class Unsupported(ValueError):
    """A graph (or value) that this module cannot write down faithfully."""


# ------------------------------------------------------------------ targets
def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve_op(name: str) -> Any:
    ns, rest = name.split("::", 1)
    packet, _, overload = rest.partition(".")
    op = getattr(getattr(torch.ops, ns), packet)
    return getattr(op, overload) if overload else op


def _target_to_data(target: Any) -> tuple:
    if isinstance(target, str):
        return ("str", target)
    name = compat.op_name(target)
    if name is not None:
        if _resolve_op(name) is not target:
            raise Unsupported(f"operator {name} does not resolve to itself")
        return ("op", name)
    module = getattr(target, "__module__", None) or ("builtins" if isinstance(target, type(len)) else None)
    # A function by its qualified name; a builtin method (torch.rsqrt: torch._VariableFunctionsClass.rsqrt)
    # by its module's attribute of its name.
    for name in (getattr(target, "__qualname__", None), getattr(target, "__name__", None)):
        if not module or not name or "<" in name:
            continue
        try:
            if _resolve(module, name) is target:
                return ("fn", module, name)
        except (ImportError, AttributeError):
            pass
    raise Unsupported(f"target {target!r} has no importable name")


def _target_from_data(data: tuple) -> Any:
    kind = data[0]
    if kind == "str":
        return data[1]
    if kind == "op":
        return _resolve_op(data[1])
    return _resolve(data[1], data[2])


# ------------------------------------------------------------------ arguments
def _arg_to_data(v: Any) -> Any:
    if isinstance(v, torch.fx.Node):
        return ("node", v.name)
    if isinstance(v, _LITERALS):
        if isinstance(v, float) and not math.isfinite(v):
            return ("float", repr(v))
        return ("lit", v)
    if isinstance(v, (tuple, list)):
        return ("tuple" if isinstance(v, tuple) else "list", [_arg_to_data(x) for x in v])
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return ("dict", [(k, _arg_to_data(x)) for k, x in v.items()])
    if isinstance(v, slice):
        return ("slice", [_arg_to_data(x) for x in (v.start, v.stop, v.step)])
    if v is Ellipsis:
        return ("ellipsis",)
    if isinstance(v, (torch.dtype, torch.layout, torch.memory_format)):
        return ("torch", str(v).split(".", 1)[1])
    if isinstance(v, torch.device):
        return ("device", str(v))
    raise Unsupported(f"a constant of type {type(v).__name__} in the graph: {v!r}")


def _arg_from_data(d: Any, nodes: dict[str, torch.fx.Node]) -> Any:
    kind = d[0]
    if kind == "node":
        return nodes[d[1]]
    if kind == "lit":
        return d[1]
    if kind == "float":
        return float(d[1])
    if kind in ("tuple", "list"):
        items = [_arg_from_data(x, nodes) for x in d[1]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return {k: _arg_from_data(x, nodes) for k, x in d[1]}
    if kind == "slice":
        return slice(*(_arg_from_data(x, nodes) for x in d[1]))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "torch":
        return getattr(torch, d[1])
    if kind == "device":
        return torch.device(d[1])
    raise Unsupported(f"unknown argument kind {kind!r}")


# ------------------------------------------------------------------ placeholders' example values
def _sym(value: Any, symbols: dict[str, tuple[str, int]]) -> str:
    expr, free = compat.symbols_of(value)
    for name, source, hint in free:
        symbols.setdefault(name, (source, hint))
    return expr


def _example_to_data(v: Any, symbols: dict[str, tuple[str, int]]) -> tuple:
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided or type(v).__name__ not in ("FakeTensor", "Tensor", "Parameter"):
            raise Unsupported(f"a {type(v).__name__} value of layout {v.layout}")
        return ("tensor", [_sym(s, symbols) for s in v.shape], [_sym(s, symbols) for s in v.stride()],
                _sym(v.storage_offset(), symbols), str(v.dtype).split(".", 1)[1], str(v.device), v.requires_grad,
                v.is_inference())
    if isinstance(v, (torch.SymInt, int)) and not isinstance(v, bool):
        return ("symint", _sym(v, symbols))
    if isinstance(v, (tuple, list)):
        return ("seq", [_example_to_data(x, symbols) for x in v], isinstance(v, tuple))
    return ("none",)  # no shape to keep (None, a float, a SymBool): split_module only looks for symbols


def _eval(expr: str, env: dict[str, Any]) -> Any:
    if not _EXPR.match(expr):
        raise Unsupported(f"expression {expr!r}")
    return eval(expr, {"__builtins__": {}}, env)  # noqa: S307 - checked above: names, digits, + - * / ( )


class _Examples:
    """Rebuilds example values in one FakeTensorMode, each symbolic expression evaluated once.

    A placeholder's tensor is its own (the backend's fake inputs: one storage each, as Dynamo's). An intermediate
    node's tensor is shared by every node with the same description (a decoder's 32 layers hold a few dozen
    distinct ones among thousands of nodes): only its shape, strides and symbols are read (``split_module``: the
    symbols a piece needs; Inductor's pre-grad passes: shapes), and making a symbolic fake tensor costs a
    dispatch with sympy arithmetic, which made up most of a warm start's rebuild.
    """

    def __init__(self, env: dict[str, Any], fake_mode: Any):
        self.env = env
        self.fake_mode = fake_mode
        self.exprs: dict[str, Any] = {}
        self.shared: dict[Any, Any] = {}

    def expr(self, expr: str) -> Any:
        value = self.exprs.get(expr, self)
        if value is self:
            value = self.exprs[expr] = _eval(expr, self.env)
        return value

    def value(self, d: tuple, fresh: bool) -> Any:
        """The example value of ``d``; ``fresh``: a tensor of its own (a placeholder's), else a shared one."""
        if d[0] == "symint":
            return self.expr(d[1])
        if d[0] == "seq":
            items = [self.value(x, fresh) for x in d[1]]
            return tuple(items) if d[2] else items
        if d[0] == "none":
            return None
        if fresh:
            return self._tensor(d, fresh)
        key = _frozen(d)
        t = self.shared.get(key)
        if t is None:
            t = self.shared[key] = self._tensor(d, fresh)
        return t

    def _tensor(self, d: tuple, fresh: bool) -> Any:
        _, sizes, strides, offset, dtype, device, requires_grad, inference = d
        sizes = [self.expr(s) for s in sizes]
        strides = [self.expr(s) for s in strides]
        offset = self.expr(offset)
        dtype, device = getattr(torch, dtype), torch.device(device)
        with self.fake_mode, torch.inference_mode(inference):
            if not fresh and isinstance(offset, int) and offset == 0:
                t = torch.empty_strided(sizes, strides, dtype=dtype, device=device)  # one dispatch, not two
            else:
                extent = 1 + offset + sum((n - 1) * s for n, s in zip(sizes, strides))
                t = torch.empty(extent, dtype=dtype, device=device).as_strided(sizes, strides, offset)
        return t.requires_grad_(requires_grad) if requires_grad else t


def _frozen(d: Any) -> Any:
    """``d`` (lists inside) as a hashable key."""
    return tuple(_frozen(x) for x in d) if isinstance(d, (tuple, list)) else d


# ------------------------------------------------------------------ the graph
def graph_to_data(gm: torch.fx.GraphModule) -> dict[str, Any]:
    """``gm`` (a Dynamo graph: inputs only, no module state) as plain data. Raises Unsupported."""
    symbols: dict[str, tuple[str, int]] = {}
    nodes = []
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            raise Unsupported(f"node {node.name} is a {node.op} (module state in the graph)")
        example = _example_to_data(node.meta.get("example_value"), symbols)
        if node.op == "placeholder" and example[0] not in ("tensor", "symint"):
            raise Unsupported(f"graph input {node.name} is a {example[0]}")
        type_ = None if node.type is None else _target_to_data(node.type)  # AOTAutograd's cache key reads it
        nodes.append((node.op, node.name, _target_to_data(node.target), _arg_to_data(node.args),
                      _arg_to_data(dict(node.kwargs)), node.meta.get("stack_trace"), example, type_))
    return {"nodes": nodes, "symbols": sorted((k, *v) for k, v in symbols.items())}


def graph_from_data(data: dict[str, Any]) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The graph and its fake example inputs (in a new FakeTensorMode), as :func:`graph_to_data` wrote them.

    Raises Unsupported, or ValueError where this torch would name a symbol otherwise than the trace did."""
    fake_mode = compat.new_fake_mode()
    env = {name: compat.make_symint(fake_mode, name, source, hint) for name, source, hint in data["symbols"]}
    rebuild = _Examples(env, fake_mode)
    graph = torch.fx.Graph()
    nodes: dict[str, torch.fx.Node] = {}
    examples = []
    for op, name, target, args, kwargs, stack_trace, example, type_ in data["nodes"]:
        node = graph.create_node(op, _target_from_data(target), _arg_from_data(args, nodes),
                                 _arg_from_data(kwargs, nodes), name,
                                 None if type_ is None else _target_from_data(type_))
        if node.name != name:
            raise Unsupported(f"node {name} came back as {node.name}")
        if stack_trace is not None:
            node.meta["stack_trace"] = stack_trace
        value = rebuild.value(example, fresh=op == "placeholder")
        if value is not None:
            node.meta["example_value"] = value
        if op == "placeholder":
            examples.append(value)
        nodes[name] = node
    return torch.fx.GraphModule(torch.nn.Module(), graph), examples

