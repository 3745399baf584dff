"""``@support_torch_compile`` for ``nn.Module`` classes and ``@compile_once`` for functions and methods."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import wrapt

from .wrapper import _UNBOUND, TorchCompileWrapperWithCustomDispatcher

__all__ = ["support_torch_compile", "compile_once"]

T = TypeVar("T")
_TENSOR_ANNOTATIONS = {
    "torch.Tensor", "Tensor", "Optional[torch.Tensor]", "Optional[Tensor]", "torch.Tensor | None",
    "Tensor | None", "None | torch.Tensor", "typing.Optional[torch.Tensor]",
}


def _is_tensor_annotation(annotation: Any) -> bool:
    if annotation is torch.Tensor:
        return True
    if isinstance(annotation, str):
        return annotation.replace(" ", "") in {a.replace(" ", "") for a in _TENSOR_ANNOTATIONS}
    args = typing.get_args(annotation)
    return bool(args) and torch.Tensor in args and all(a in (torch.Tensor, type(None)) for a in args)


def _normalize_dims(fn: Callable[..., Any], dynamic_arg_dims: dict[str, int | list[int]] | None,
                    skip_self: bool, where: str) -> dict[str, list[int]] | None:
    """Validate ``dynamic_arg_dims`` against ``fn``'s signature; None means dim 0 of every tensor argument."""
    params = list(inspect.signature(fn).parameters.values())
    if skip_self:
        params = params[1:]
    names = [p.name for p in params]
    if dynamic_arg_dims is None:
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # unresolvable string annotations: compare the strings
            hints = {p.name: p.annotation for p in params}
        dims = {n: [0] for n in names if n in hints and _is_tensor_annotation(hints[n])}
        return dims or None
    if not isinstance(dynamic_arg_dims, dict):
        raise TypeError(f"{where}: dynamic_arg_dims must be a dict of argument name -> dim(s); "
                        f"got {type(dynamic_arg_dims).__name__}")
    out: dict[str, list[int]] = {}
    for name, dims in dynamic_arg_dims.items():
        if name not in names:
            raise ValueError(f"{where}: dynamic_arg_dims names {name!r}, which is not an argument of "
                             f"{fn.__qualname__}{inspect.signature(fn)}; its arguments are {names}")
        dims_list = [dims] if isinstance(dims, int) else list(dims)
        if not dims_list or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims_list):
            raise ValueError(f"{where}: dynamic_arg_dims[{name!r}] must be an int or a non-empty list of "
                             f"ints; got {dims!r}")
        out[name] = dims_list
    return out


def support_torch_compile(cls: type[T] | None = None, *,
                          dynamic_arg_dims: dict[str, int | list[int]] | None = None) -> Any:
    """Make an ``nn.Module`` class compile its ``forward`` once and dispatch the captured code.

    Bare, dim 0 of every ``forward`` argument annotated ``torch.Tensor`` or
    ``Optional[torch.Tensor]`` is dynamic; ``dynamic_arg_dims={"x": 0, "y": [0, 1]}``
    names them. The compilation level is read when an instance is constructed.
    Returns the class itself, with :class:`TorchCompileWrapperWithCustomDispatcher`
    added to its bases.
    """

    def decorate(cls: type[T]) -> type[T]:
        where = f"@support_torch_compile on {getattr(cls, '__qualname__', cls)!r}"
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            raise TypeError(f"{where}: expected an nn.Module subclass; got {cls!r}"
                            " (use @compile_once for functions and methods)")
        if cls.forward is torch.nn.Module.forward:
            raise TypeError(f"{where}: the class defines no forward")
        dims = _normalize_dims(cls.forward, dynamic_arg_dims, skip_self=True, where=where)
        if dims is None:
            raise ValueError(f"{where}: no forward argument is annotated torch.Tensor or "
                             "Optional[torch.Tensor]; annotate them or pass dynamic_arg_dims")
        if TorchCompileWrapperWithCustomDispatcher not in cls.__mro__:
            cls.__bases__ = cls.__bases__ + (TorchCompileWrapperWithCustomDispatcher,)
        cls._dynamo_once_dynamic_arg_dims = dims
        original_init = cls.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            if "_do_fast" not in self.__dict__:  # a decorated parent class already set it up
                TorchCompileWrapperWithCustomDispatcher.__init__(self)

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        __init__.__doc__ = original_init.__doc__
        cls.__init__ = __init__
        cls.__call__ = TorchCompileWrapperWithCustomDispatcher.__call__
        return cls

    return decorate if cls is None else decorate(cls)


class _FunctionDispatcher(TorchCompileWrapperWithCustomDispatcher):
    """The dispatcher behind ``@compile_once``: one per function, or one per instance for a method."""

    def __init__(self, function: Callable[..., Any], bound_to: Any, dims: dict[str, list[int]] | None):
        self._do_setup(function, bound_to, None, None, dims)


def compile_once(fn: Callable[..., Any] | None = None, *,
                 dynamic_arg_dims: dict[str, int | list[int]] | None = None) -> Any:
    """Compile a function (or a method, one capture per instance) once and dispatch the captured code.

    Bare, dim 0 of every argument annotated ``torch.Tensor`` (or
    ``Optional[torch.Tensor]``) is dynamic; with no such annotation, dim 0 of
    every tensor argument. The level is read at the first call (per instance
    for a method). Signature and docstring are preserved.
    """

    def decorate(fn: Callable[..., Any]) -> Any:
        where = f"@compile_once on {getattr(fn, '__qualname__', fn)!r}"
        if isinstance(fn, (staticmethod, classmethod)):
            raise TypeError(f"{where}: put @compile_once below @staticmethod / @classmethod")
        if not inspect.isfunction(fn):
            raise TypeError(f"{where}: expected a Python function or method; got {fn!r}")
        params = list(inspect.signature(fn).parameters)
        is_method = bool(params) and params[0] == "self"
        dims = _normalize_dims(fn, dynamic_arg_dims, skip_self=is_method, where=where)
        key = f"_dynamo_once_{fn.__name__}_{id(fn):x}"
        state: dict[str, Any] = {}

        @wrapt.decorator
        def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
            if instance is None or isinstance(instance, type):
                dispatcher = state.get("plain")
                if dispatcher is None:
                    dispatcher = state.setdefault("plain", _FunctionDispatcher(fn, _UNBOUND, dims))
                return dispatcher(*args, **kwargs)
            try:
                dispatcher = instance.__dict__[key]
            except KeyError:
                dispatcher = _FunctionDispatcher(fn, instance, dims)
                instance.__dict__[key] = dispatcher
            except AttributeError:
                raise TypeError(f"{where}: instances of {type(instance).__name__} have no __dict__ to hold "
                                "their per-instance capture") from None
            return dispatcher(*args, **kwargs)

        return wrapper(fn)

    return decorate if fn is None else decorate(fn)


def dispatcher_of(obj: Any, method: str | None = None) -> TorchCompileWrapperWithCustomDispatcher | None:
    """The dispatcher behind a decorated module, or behind ``obj.method`` for ``@compile_once`` methods."""
    if method is None:
        return obj if isinstance(obj, TorchCompileWrapperWithCustomDispatcher) else None
    for k, v in vars(obj).items():
        if k.startswith(f"_dynamo_once_{method}_") and isinstance(v, TorchCompileWrapperWithCustomDispatcher):
            return v
    return None

