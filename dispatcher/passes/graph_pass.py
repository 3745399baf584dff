"""``GraphPass``: the interface of a post-grad graph pass, and the source hash that identifies one."""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from typing import ClassVar

import torch.fx

__all__ = ["GraphPass", "source_hash", "module_source_hash"]

_NAME = re.compile(r"[a-z_][a-z0-9_]*")


@functools.lru_cache(maxsize=None)
def module_source_hash(module_name: str) -> str:
    """sha256 of the source of an imported module (e.g. the pass manager's own)."""
    import sys

    return hashlib.sha256(inspect.getsource(sys.modules[module_name]).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def source_hash(cls: type) -> str:
    """sha256 of the source of every module defining ``cls`` or one of its bases (up to ``GraphPass``).

    Whole modules, not classes: a pass's search and replacement functions sit next to its class. A
    reloaded module defines a new class object, so an edited source is hashed anew.

    Raises:
        ValueError: a module's source cannot be read (a class defined interactively).
    """
    digest = hashlib.sha256()
    for c in cls.__mro__:
        if c is object or not issubclass(c, GraphPass):
            continue
        module = inspect.getmodule(c)
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError) as e:
            raise ValueError(f"graph pass {cls.__qualname__}: the source of {c.__module__} cannot be read ({e}); "
                             "define the pass in a file, or override uuid()") from None
        digest.update(f"{c.__module__}.{c.__qualname__}\n".encode())
        digest.update(source.encode())
    return digest.hexdigest()


class GraphPass:
    """A rewrite of the graph Inductor compiles, run by :class:`PostGradPassManager` after Inductor's own
    post-grad passes (the graph is functionalized aten: ``torch.ops.aten.*``, ``prims.convert_element_type``).

    Subclasses set :attr:`name` and implement :meth:`__call__`; they may narrow :meth:`is_available` (the
    pass can run in this process) and :meth:`is_applicable` (it runs for a compile size). A pass whose
    rewrites depend on more than its source says so in :meth:`state_key`.
    """

    name: ClassVar[str] = ""
    """Unique among the passes; ``[a-z_][a-z0-9_]*``."""
    opaque_ops: ClassVar[bool] = False
    """The pass matches ``torch.library.triton_op`` ops as the model calls them: while it runs, compiles keep
    such ops opaque (one node each) instead of inlining them into their Triton kernels."""

    def is_available(self) -> bool:
        """Whether the pass can run in this process, e.g. the ops it produces are registered (default: True).
        An unavailable pass is skipped, with a debug log."""
        return True

    def is_applicable(self, size: int | None) -> bool:
        """Whether the pass runs on a graph compiled for ``size`` tokens; None is the symbolic compile, which
        serves every size without a compile of its own (default: every compile)."""
        return True

    def __call__(self, graph: torch.fx.Graph, size: int | None) -> int | None:
        """Rewrite ``graph`` in place; return the number of rewrites (None: not counted)."""
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(graph, size)")

    def state_key(self) -> str:
        """What besides the source decides the rewrites (e.g. which ops exist); part of :meth:`uuid`."""
        return ""

    def uuid(self) -> str:
        """Identifies the rewrites this pass makes, for Inductor's FX graph cache: a hash of the modules that
        define it (:func:`source_hash`) and of :meth:`state_key`. Stable across processes."""
        return hashlib.sha256(f"{self.name}\n{source_hash(type(self))}\n{self.state_key()}".encode()).hexdigest()

    @classmethod
    def check_name(cls, name: object) -> str:
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name in ("all", "none"):
            raise ValueError(f"graph pass name: expected [a-z_][a-z0-9_]*, not all/none; got {name!r}")
        return name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
