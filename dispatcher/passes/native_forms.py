"""The native forms of the library's ops: what an op computes in plain torch, as a module's native path
(custom op off, the default at levels 3-4) calls it.

With the custom ops off a compiled model holds no ``dynamo_once`` op for a pass to name: Inductor sees the
plain torch code and fuses it itself. Where that fusion is known to be poor (a per-token quantization needs
its row's amax before it can write a value, which Inductor splits into reduction kernels and a second pass
over the row), a pass matches the native form and puts the library's fused op in its place. The forms live
with their ops (``ops`` registers them on import, ``ops -> dispatcher`` as the layers go); a pass looks them up
by the op's name and traces them into its patterns, so a pattern is the module's native code by construction,
not a copy of it.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["register_native_form", "native_form", "native_forms_key", "registered_native_forms"]

_FORMS: dict[str, Callable[..., Any]] = {}


def register_native_form(op_name: str, fn: Callable[..., Any]) -> None:
    """Declare ``fn`` the plain-torch form of ``dynamo_once::<op_name>`` (same arguments, same results).

    Raises:
        ValueError: ``op_name`` already has another form, or ``fn`` is not callable.
    """
    if not callable(fn):
        raise ValueError(f"register_native_form({op_name!r}): fn must be callable; got {type(fn).__name__}")
    if _FORMS.get(op_name, fn) is not fn:
        raise ValueError(f"register_native_form: {op_name!r} already has a native form "
                         f"({_FORMS[op_name].__qualname__}); got {fn.__qualname__}")
    _FORMS[op_name] = fn


def native_form(op_name: str) -> Callable[..., Any] | None:
    """The registered plain-torch form of ``dynamo_once::<op_name>``, or None."""
    return _FORMS.get(op_name)


def registered_native_forms() -> list[str]:
    """The names of the ops that have a native form, sorted."""
    return sorted(_FORMS)


def native_forms_key(op_names: list[str]) -> str:
    """A hash of the named ops' registered forms (name and source): part of a pass's cache key, so a change
    to a form the pass traces re-keys the graphs it rewrote."""
    digest = hashlib.sha256()
    for name in op_names:
        fn = _FORMS.get(name)
        if fn is None:
            continue
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = f"{fn.__module__}.{fn.__qualname__}"
        digest.update(f"{name}\n{source}\n".encode())
    return digest.hexdigest()
