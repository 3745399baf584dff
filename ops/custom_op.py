"""``CustomOp``: a module with a native PyTorch forward and a per-device fast one, and the per-op switch.

The switch is a list of tokens, from ``CompilationConfig.custom_ops`` (which
already includes ``DYNAMO_ONCE_CUSTOM_OPS``):

- ``all`` / ``none``: every registered op on / off;
- ``+name`` / ``-name``: one op on / off, over ``all``/``none`` or the default;
- no ``all``/``none``: the default, on unless the model is compiled by
  Inductor (levels 3-4, or a backend named ``"inductor"`` at levels 1-2):
  Inductor fuses the native code with its neighbours, which a custom op
  would hide from it.

Each module picks its implementation once, at construction
(:meth:`CustomOp.dispatch_forward`), so the hot path is a single bound call.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from dispatcher import CompilationConfig, CompilationLevel, get_compilation_config
from dispatcher.plugins import get_torch_compile_backend

from .triton_utils import HAS_TRITON

logger = logging.getLogger(__name__)

__all__ = [
    "CustomOp",
    "OpStatus",
    "CustomOpSwitch",
    "parse_custom_ops",
    "uses_inductor",
    "enabled_custom_ops",
]

_NAME = re.compile(r"[a-z_][a-z0-9_]*")


class CustomOpSwitch(NamedTuple):
    """A parsed ``custom_ops`` list."""

    base: str | None
    """``"all"``, ``"none"``, or None when the default applies."""
    enabled: frozenset[str]
    """Ops named with ``+``."""
    disabled: frozenset[str]
    """Ops named with ``-``."""


class OpStatus(NamedTuple):
    """Whether one registered op is on, and why (for logs and ``diagnose``)."""

    enabled: bool
    reason: str


def parse_custom_ops(tokens: Sequence[str] | str, registered: Sequence[str] | None = None) -> CustomOpSwitch:
    """Validate and parse the switch's tokens.

    Args:
        tokens: e.g. ``["none", "+rms_norm"]``, or the comma-separated string.
        registered: the names ``+``/``-`` may use; default ``CustomOp.registry``.

    Raises:
        ValueError: both ``all`` and ``none``; ``all`` or ``none`` twice; one op
            both ``+`` and ``-``; an unknown op name; a token that is none of
            ``all``, ``none``, ``+name``, ``-name``.
    """
    if isinstance(tokens, str):
        tokens = [t for t in tokens.split(",")]
    names = sorted(CustomOp.registry if registered is None else registered)
    known = ", ".join(names)
    base: str | None = None
    enabled: set[str] = set()
    disabled: set[str] = set()
    for raw in tokens:
        tok = raw.strip()
        if tok in ("all", "none"):
            if base == tok:
                raise ValueError(f"custom_ops: {tok!r} given twice in {list(tokens)!r}")
            if base is not None:
                raise ValueError(f"custom_ops: 'all' and 'none' exclude each other; got {list(tokens)!r}")
            base = tok
            continue
        sign, name = tok[:1], tok[1:]
        if sign not in ("+", "-") or not _NAME.fullmatch(name):
            raise ValueError(
                f"custom_ops: bad token {raw!r}; expected 'all', 'none', '+name' or '-name' "
                f"(comma-separated) with a name among: {known}"
            )
        if name not in names:
            raise ValueError(f"custom_ops: unknown op {name!r} in {raw!r}; registered ops: {known}")
        (enabled if sign == "+" else disabled).add(name)
        if name in enabled and name in disabled:
            raise ValueError(f"custom_ops: op {name!r} is both enabled ('+') and disabled ('-')")
    return CustomOpSwitch(base, frozenset(enabled), frozenset(disabled))


def uses_inductor(config: CompilationConfig | None = None) -> bool:
    """Whether the model is compiled by Inductor under ``config`` (default: the current one)."""
    cfg = get_compilation_config() if config is None else config
    if cfg.level >= CompilationLevel.INDUCTOR:
        return True
    if cfg.level == CompilationLevel.NO_COMPILATION:
        return False
    backend = cfg.backend if cfg.backend is not None else get_torch_compile_backend()
    return isinstance(backend, str) and backend.strip().lower() == "inductor"


def _status(name: str, switch: CustomOpSwitch, config: CompilationConfig) -> OpStatus:
    if name in switch.enabled:
        return OpStatus(True, f"'+{name}' in custom_ops")
    if name in switch.disabled:
        return OpStatus(False, f"'-{name}' in custom_ops")
    if switch.base is not None:
        return OpStatus(switch.base == "all", f"'{switch.base}' in custom_ops")
    level = CompilationLevel(config.level)
    if uses_inductor(config):
        return OpStatus(False, f"default: off, level {int(level)} ({level.name}) compiles with Inductor")
    return OpStatus(True, f"default: on, level {int(level)} ({level.name}) without Inductor")


class CustomOp(nn.Module):
    """A module with a pure-PyTorch ``forward_native`` and faster per-device forwards.

    Subclasses implement ``forward_native`` (the reference semantics) and may
    override ``forward_cuda`` / ``forward_cpu`` (both default to native).
    ``dispatch_forward`` chooses one at construction: native when the op is
    switched off, else the one for this machine's device (CUDA when a GPU and
    Triton are present). Override ``dispatch_forward`` to force a choice.

    Register a subclass with ``@CustomOp.register("name")``; an unregistered
    subclass of a registered class follows its parent's name and switch.
    """

    registry: dict[str, type[CustomOp]] = {}
    name: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self._forward_method: Callable[..., Any] = self.dispatch_forward()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement forward_native")

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def dispatch_forward(self) -> Callable[..., Any]:
        """The bound forward this module will run; called once, in ``__init__``."""
        enabled = self.enabled()
        if not enabled:
            method = self.forward_native
        elif torch.cuda.is_available() and HAS_TRITON:
            method = self.forward_cuda
        else:
            # CUDA without Triton would only reach the reference through the op.
            method = self.forward_cpu
        logger.debug("%s (%s): enabled=%s, using %s", type(self).__name__, self.name, enabled, method.__name__)
        return method

    @classmethod
    def enabled(cls) -> bool:
        """Whether this op is switched on under the current compilation config."""
        if cls.name is None:
            raise TypeError(f"{cls.__name__} is not registered; decorate it with @CustomOp.register(name)")
        config = get_compilation_config()
        switch = parse_custom_ops(config.custom_ops)
        return _status(cls.name, switch, config).enabled

    @classmethod
    def register(cls, name: str) -> Callable[[type[CustomOp]], type[CustomOp]]:
        """Class decorator: register a ``CustomOp`` subclass under ``name`` for the switch."""
        if not _NAME.fullmatch(name) or name in ("all", "none"):
            raise ValueError(f"CustomOp.register: bad op name {name!r}; expected [a-z_][a-z0-9_]*, not all/none")

        def dec(op_cls: type[CustomOp]) -> type[CustomOp]:
            previous = CustomOp.registry.get(name)
            # Re-importing a module (importlib.reload) registers the same class again.
            if previous is not None and previous.__qualname__ != op_cls.__qualname__:
                raise ValueError(f"CustomOp.register: {name!r} already registered by {previous.__qualname__}")
            op_cls.name = name
            CustomOp.registry[name] = op_cls
            return op_cls

        return dec


def enabled_custom_ops(config: CompilationConfig | None = None) -> dict[str, OpStatus]:
    """Every registered op, whether it is on under ``config`` (default: the current one), and why.

    Raises:
        ValueError: the config's ``custom_ops`` is invalid (see :func:`parse_custom_ops`).
    """
    cfg = get_compilation_config() if config is None else config
    switch = parse_custom_ops(cfg.custom_ops)
    return {name: _status(name, switch, cfg) for name in sorted(CustomOp.registry)}
