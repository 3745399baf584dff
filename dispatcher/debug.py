"""Checks that make guard-free dispatch safe, and dumps of captured code.

Guard-free dispatch rests on two assumptions: (1) every call looks like the
traced one (rank, dtype, device, static sizes, specialized constants), and
(2) the graph is valid for every size of a dynamic dim. :class:`InputChecker`
checks (1) on every call (``check_inputs``, on by default, a few hundred ns a
tensor); :class:`ShapeGuardChecker` checks (2) in debug mode by evaluating the
shape guards Dynamo recorded while tracing (e.g. ``s0 >= 4`` from a branch on
``x.shape[0] >= 4``).
"""

from __future__ import annotations

import dis
import inspect
import logging
import os
import re
import types
from collections.abc import Callable
from typing import Any

import torch

from . import compat
from .errors import InputMismatchError, ShapeGuardError

logger = logging.getLogger(__name__)

__all__ = ["InputChecker", "ShapeGuardChecker", "dump_captured_code"]

_CONST_TYPES = (int, float, bool, str, type(None))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-d {value.dtype} tensor on {value.device} with shape {tuple(value.shape)}"
    if isinstance(value, _CONST_TYPES):
        return f"{type(value).__name__} {value!r}"
    return f"a {type(value).__name__}"


class _TensorSpec:
    __slots__ = ("name", "ndim", "dtype", "device", "static", "dynamic", "shape")

    def __init__(self, name: str, t: torch.Tensor, dynamic: list[int]):
        self.name = name
        self.ndim = t.dim()
        self.dtype = t.dtype
        self.device = t.device
        self.dynamic = tuple(sorted(dynamic))
        self.static = tuple((i, s) for i, s in enumerate(t.shape) if i not in dynamic)
        self.shape = tuple("*" if i in dynamic else s for i, s in enumerate(t.shape))

    def describe(self) -> str:
        dims = ", ".join(str(s) for s in self.shape)
        dyn = f"; dim(s) {list(self.dynamic)} dynamic" if self.dynamic else ""
        return f"a {self.ndim}-d {self.dtype} tensor on {self.device} with shape ({dims}){dyn}"

    def check(self, value: Any, owner: str) -> None:
        if type(value) is torch.Tensor or isinstance(value, torch.Tensor):
            shape = value.shape
            if len(shape) == self.ndim and value.dtype == self.dtype and value.device == self.device:
                for i, s in self.static:
                    if shape[i] != s:
                        break
                else:
                    return
        raise InputMismatchError(
            f"{owner}: argument '{self.name}' was traced as {self.describe()}, but this call gives "
            f"{_describe(value)}. The captured graph is valid only for the traced rank, dtype, device "
            f"and static sizes; mark the dim dynamic (dynamic_arg_dims) or use a separate instance."
        )


class _ConstSpec:
    __slots__ = ("name", "value")

    def __init__(self, name: str, value: Any):
        self.name = name
        self.value = value

    def check(self, value: Any, owner: str) -> None:
        if type(value) is type(self.value) and value == self.value:
            return
        what = "None" if self.value is None else f"the constant {self.value!r}"
        raise InputMismatchError(
            f"{owner}: argument '{self.name}' was traced with {what}, but this call gives "
            f"{_describe(value)}. Dynamo specialized the captured graph on this value."
        )


class InputChecker:
    """Compares each call's arguments with those of the traced call.

    Tensors: rank, dtype, device and every size not marked dynamic. ``None``,
    ``int``, ``float``, ``bool``, ``str``: equal to the traced value (Dynamo
    specializes on them). Other objects are not checked.
    """

    def __init__(self, owner: str, signature: inspect.Signature, skip_first: bool,
                 args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: dict[str, list[int]]):
        self.owner = owner
        self.signature = signature
        self.skip_first = skip_first
        bound = self._bind(args, kwargs)
        specs: dict[str, Any] = {}
        for name, value in bound.items():
            if isinstance(value, torch.Tensor):
                specs[name] = _TensorSpec(name, value, dynamic.get(name, []))
            elif isinstance(value, _CONST_TYPES):
                specs[name] = _ConstSpec(name, value)
        self.by_name = specs
        # One C++ call checks every tensor of a call shaped like the trace (None: check in Python).
        tensor_names = [n for n in [*list(bound)[: len(args)], *kwargs] if isinstance(specs.get(n), _TensorSpec)]
        self._tensor_guards = compat.tensor_guards(
            [bound[n] for n in tensor_names], [list(specs[n].dynamic) for n in tensor_names])
        names = list(bound)
        # The common case, a call shaped like the traced one, checks by position.
        self.n_pos = len(args)
        self.kw_names = frozenset(kwargs)
        self.pos_specs = [specs.get(n) for n in names[: self.n_pos]]
        self.pos_specs = [(i, s) for i, s in enumerate(self.pos_specs) if s is not None]
        self.kw_specs = [(n, specs[n]) for n in kwargs if n in specs]
        self._fast = self._generate_fast_check()

    def _generate_fast_check(self) -> Callable[[tuple, dict], Any]:
        """Straight-line code for calls shaped like the traced one: ~0.2 µs a tensor instead of ~1.

        Any doubt (another call shape, a tensor subclass, a mismatch) goes to :meth:`_full_check`,
        which raises the detailed error.
        """
        ns: dict[str, Any] = {"Tensor": torch.Tensor, "full": self._full_check}
        lines = ["def check(args, kwargs):"]
        lines.append(f"    if len(args) != {self.n_pos} or " + (
            "kwargs.keys() != kw_names:" if self.kw_names else "kwargs:"))
        lines.append("        return full(args, kwargs)")
        ns["kw_names"] = self.kw_names
        items = [(f"args[{i}]", s) for i, s in self.pos_specs] + [(f"kwargs[{n!r}]", s) for n, s in self.kw_specs]
        guards = self._tensor_guards
        if guards is not None:
            ns["tensor_guards"] = guards
            tensor_exprs = [expr for expr, spec in items if isinstance(spec, _TensorSpec)]
            if tensor_exprs:
                lines.append(f"    if not tensor_guards({', '.join(tensor_exprs)}):")
                lines.append("        return full(args, kwargs)")
        for j, (expr, spec) in enumerate(items):
            v = f"v{j}"
            if isinstance(spec, _TensorSpec) and guards is not None:
                continue
            lines.append(f"    {v} = {expr}")
            if isinstance(spec, _TensorSpec):
                ns[f"dt{j}"], ns[f"dev{j}"] = spec.dtype, spec.device
                conds = [f"type({v}) is not Tensor", f"{v}.dtype is not dt{j}", f"{v}.device != dev{j}"]
                lines.append(f"    if {' or '.join(conds)}:")
                lines.append("        return full(args, kwargs)")
                lines.append(f"    s = {v}.shape")
                conds = [f"len(s) != {spec.ndim}"] + [f"s[{i}] != {size}" for i, size in spec.static]
                lines.append(f"    if {' or '.join(conds)}:")
                lines.append("        return full(args, kwargs)")
            else:
                ns[f"c{j}"], ns[f"t{j}"] = spec.value, type(spec.value)
                lines.append(f"    if type({v}) is not t{j} or {v} != c{j}:")
                lines.append("        return full(args, kwargs)")
        lines.append("    return None")
        exec("\n".join(lines), ns)  # noqa: S102 - generated from our own specs only
        return ns["check"]

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        full = (None, *args) if self.skip_first else args
        try:
            bound = self.signature.bind(*full, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.owner}: {e}") from None
        bound.apply_defaults()
        out = dict(bound.arguments)
        if self.skip_first:
            out.pop(next(iter(self.signature.parameters)))
        return out

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._fast(args, kwargs)

    def _full_check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if len(args) == self.n_pos and (kwargs.keys() == self.kw_names if kwargs else not self.kw_names):
            for i, spec in self.pos_specs:
                spec.check(args[i], self.owner)
            for name, spec in self.kw_specs:
                spec.check(kwargs[name], self.owner)
            return
        bound = self._bind(args, kwargs)
        for name, spec in self.by_name.items():
            spec.check(bound.get(name), self.owner)


class ShapeGuardChecker:
    """Debug mode: evaluates the shape guards of a trace against a call's actual sizes."""

    def __init__(self, owner: str, signature: inspect.Signature, shape_env: Any):
        import sympy

        self.owner = owner
        self.signature = signature
        self._sympy = sympy
        sources: dict[Any, Callable[[dict[str, Any]], Any]] = {}
        self.source_names: dict[Any, str] = {}
        for sym, srcs in getattr(shape_env, "var_to_sources", {}).items():
            if srcs:
                name = compat.source_name(srcs[0])
                self.source_names[sym] = name
                sources[sym] = eval(f"lambda L: {name}", {"torch": torch})  # noqa: S307 - our own guard source
        self.guards: list[tuple[Any, str]] = []
        for guard in getattr(shape_env, "guards", []):
            expr = guard.expr
            if expr.free_symbols and expr.free_symbols <= sources.keys():
                where = str(getattr(guard, "sloc", "") or "")
                self.guards.append((expr, where))
        self.sources = {s: sources[s] for expr, _ in self.guards for s in expr.free_symbols}

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.guards:
            return
        L = dict(self.signature.bind(*args, **kwargs).arguments)
        values: dict[Any, Any] = {}
        for sym, get in self.sources.items():
            try:
                values[sym] = self._sympy.Integer(int(get(L)))
            except Exception:  # a source this call cannot produce (e.g. None for a traced tensor)
                continue
        for expr, where in self.guards:
            if not expr.free_symbols <= values.keys():
                continue
            if not bool(expr.xreplace(values)):
                given = ", ".join(f"{self.source_names[s]} = {values[s]}" for s in sorted(expr.free_symbols, key=str))
                raise ShapeGuardError(
                    f"{self.owner}: shape guard `{expr}` recorded while tracing fails for this call ({given}). "
                    f"The captured code would silently run what was traced for other sizes."
                    + (f" Guard recorded at: {where}" if where else "")
                )


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _compiled_fn_names(code: types.CodeType) -> list[str]:
    """Globals a captured code calls that Dynamo installed (``__compiled_fn_*``), read with ``bytecode``."""
    try:
        from bytecode import Bytecode, Instr
    except ImportError:  # pragma: no cover - bytecode is a dependency
        return [n for n in code.co_names if n.startswith("__compiled_fn")]
    names = []
    for instr in Bytecode.from_code(code):
        if isinstance(instr, Instr) and instr.name in ("LOAD_GLOBAL", "LOAD_NAME"):
            arg = instr.arg[1] if isinstance(instr.arg, tuple) else instr.arg
            if isinstance(arg, str) and arg.startswith("__compiled_fn") and arg not in names:
                names.append(arg)
    return names


def dump_captured_code(path: str, owner: str, index: int, code: types.CodeType,
                       graphs: list[torch.fx.GraphModule]) -> str:
    """Write a captured code's disassembly, decompiled source (depyf) and FX graphs under ``path``.

    Returns the directory written.
    """
    out = os.path.join(path, f"{_safe(owner)}_{index}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "transformed_code.dis.txt"), "w") as f:
        f.write(f"# {owner}: captured code #{index}\n")
        f.write(f"# calls compiled graphs: {', '.join(_compiled_fn_names(code)) or '(none)'}\n\n")
        f.write(dis.Bytecode(code).dis())
    try:
        import depyf

        src = depyf.decompile(code)
    except ImportError:
        src = "# depyf is not installed (pip install 'dynamo-once[debug]'); see transformed_code.dis.txt\n"
    except Exception as e:  # depyf cannot decompile every code object
        src = f"# depyf could not decompile this code: {type(e).__name__}: {e}\n"
    with open(os.path.join(out, "transformed_code.py"), "w") as f:
        f.write(src)
    for i, gm in enumerate(graphs):
        with open(os.path.join(out, f"fx_graph_{i}.py"), "w") as f:
            f.write(gm.print_readable(print_output=False))
    logger.info("dumped captured code #%d of %s to %s", index, owner, out)
    return out
