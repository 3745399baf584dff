"""User-set Dynamo backend (levels 1-2) and additional Inductor options (levels 3-4)."""

from __future__ import annotations

from typing import Any, Callable

__all__ = [
    "set_torch_compile_backend",
    "get_torch_compile_backend",
    "set_inductor_additional_configs",
    "get_inductor_additional_configs",
]

_backend: str | Callable[..., Any] | None = None
_inductor_configs: dict[str, Any] = {}


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
