"""User-set Dynamo backend (levels 1-2), additional Inductor options and post-grad passes (levels 3-4), and the
eager functions the piecewise path calls for splitting ops between the pieces."""

from __future__ import annotations

import threading
from typing import Any, Callable

from .passes.graph_pass import GraphPass
from .passes.pass_config import PassConfig

__all__ = [
    "set_torch_compile_backend",
    "get_torch_compile_backend",
    "set_inductor_additional_configs",
    "get_inductor_additional_configs",
    "add_post_grad_pass",
    "remove_post_grad_pass",
    "get_post_grad_passes",
    "set_splitting_op_eager_impl",
    "get_splitting_op_eager_impl",
]

_backend: str | Callable[..., Any] | None = None
_inductor_configs: dict[str, Any] = {}
_passes_lock = threading.Lock()
#: (pass, before, after) in the order added
_post_grad_passes: list[tuple[GraphPass, str | None, str | None]] = []
#: "namespace::name" -> the Python function the split graph calls for that splitting op
_eager_impls: dict[str, Callable[..., Any]] = {}


def set_torch_compile_backend(backend: str | Callable[..., Any] | None) -> None:
    """The backend levels 1-2 use when ``CompilationConfig.backend`` is None (``None`` clears it)."""
    global _backend
    if backend is not None and not (isinstance(backend, str) or callable(backend)):
        raise ValueError(
            f"set_torch_compile_backend: backend must be a backend name, a callable or None; "
            f"got {backend!r} ({type(backend).__name__})"
        )
    _backend = backend


def get_torch_compile_backend() -> str | Callable[..., Any] | None:
    return _backend


def set_inductor_additional_configs(configs: dict[str, Any]) -> None:
    """Inductor options merged into every level 3-4 compile (replaces the previous dict)."""
    global _inductor_configs
    if not isinstance(configs, dict):
        raise ValueError(
            f"set_inductor_additional_configs: configs must be a dict; got {type(configs).__name__}"
        )
    _inductor_configs = dict(configs)


def get_inductor_additional_configs() -> dict[str, Any]:
    return dict(_inductor_configs)


def _check_pass(pass_: object, taken: list[str]) -> GraphPass:
    if not isinstance(pass_, GraphPass):
        raise ValueError(f"add_post_grad_pass: expected a dispatcher.passes.GraphPass instance; "
                         f"got {pass_!r} ({type(pass_).__name__})")
    try:
        GraphPass.check_name(pass_.name)
    except ValueError as e:
        raise ValueError(f"add_post_grad_pass: {type(pass_).__name__}.name: {e}") from None
    if pass_.name in taken:
        raise ValueError(f"add_post_grad_pass: a pass named {pass_.name!r} is already in use; "
                         f"passes: {', '.join(taken)}")
    if type(pass_).__call__ is GraphPass.__call__:
        raise ValueError(f"add_post_grad_pass: {type(pass_).__name__} does not implement __call__(graph, size)")
    try:
        pass_.uuid()  # Inductor's cache keys on it: fail here, not inside a compile
    except ValueError as e:
        raise ValueError(f"add_post_grad_pass: {e}") from None
    return pass_


def add_post_grad_pass(pass_: GraphPass, *, before: str | None = None, after: str | None = None) -> None:
    """Run ``pass_`` in every level 3-4 Inductor compile made from now on, with the library's passes.

    Args:
        pass_: a ``dispatcher.passes.GraphPass`` with a ``name`` not used by another pass; its source
            (or its own ``uuid()``) keys Inductor's FX graph cache.
        before / after: the name of a pass (the library's, ``PassConfig.names()``, or one added before) to run
            just before / just after; neither: after every pass so far. At most one of them.

    Raises:
        ValueError: not a ``GraphPass``; a bad or taken name; no ``__call__``; an unreadable source; both
            ``before`` and ``after``; an unknown pass named there.
    """
    with _passes_lock:
        taken = list(PassConfig.names()) + [p.name for p, _, _ in _post_grad_passes]
        _check_pass(pass_, taken)
        if before is not None and after is not None:
            raise ValueError(f"add_post_grad_pass: give before= or after=, not both (got {before!r}, {after!r})")
        anchor = before if before is not None else after
        if anchor is not None and anchor not in taken:
            raise ValueError(f"add_post_grad_pass: no pass named {anchor!r} to run "
                             f"{'before' if before is not None else 'after'}; passes: {', '.join(taken)}")
        _post_grad_passes.append((pass_, before, after))


def remove_post_grad_pass(name: str) -> None:
    """Stop running the added pass ``name`` in later compiles.

    Raises:
        ValueError: no added pass has that name; another added pass is placed relative to it.
    """
    with _passes_lock:
        names = [p.name for p, _, _ in _post_grad_passes]
        if name not in names:
            raise ValueError(f"remove_post_grad_pass: no added pass named {name!r}; "
                             f"added: {', '.join(names) or 'none'}")
        anchored = [p.name for p, b, a in _post_grad_passes if name in (b, a)]
        if anchored:
            raise ValueError(f"remove_post_grad_pass: {', '.join(anchored)} run(s) next to {name!r}; remove them first")
        del _post_grad_passes[names.index(name)]


def get_post_grad_passes() -> list[tuple[GraphPass, str | None, str | None]]:
    """The added passes as ``(pass, before, after)``, in the order added."""
    with _passes_lock:
        return list(_post_grad_passes)


def set_splitting_op_eager_impl(op: str, fn: Callable[..., Any] | None) -> None:
    """The function levels 3-4 call for splitting op ``op`` (``"namespace::name"``, as in
    ``CompilationConfig.splitting_ops``) between the compiled pieces, instead of the op through torch's dispatcher:
    ``fn`` takes the op's arguments as the graph passes them and must do what the op's eager kernel does (usually
    it is that kernel, the op's Python implementation). A splitting op runs eagerly once a layer a step on the
    piecewise path, where the dispatcher's ~2-3 µs a call are host time the GPU may wait for. Read when a graph is
    split (set it before compiling); ``None`` removes it."""
    if not isinstance(op, str) or op.count("::") != 1:
        raise ValueError(f"set_splitting_op_eager_impl: op must be a 'namespace::name' string; got {op!r}")
    if fn is None:
        _eager_impls.pop(op, None)
        return
    if not callable(fn):
        raise ValueError(f"set_splitting_op_eager_impl: fn must be callable or None; got {fn!r} ({type(fn).__name__})")
    _eager_impls[op] = fn


def get_splitting_op_eager_impl(op: str) -> Callable[..., Any] | None:
    return _eager_impls.get(op)
