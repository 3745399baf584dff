"""Errors raised where dispatching captured code could not be guaranteed correct."""

from __future__ import annotations

__all__ = ["DynamoOnceError", "InputMismatchError", "ShapeGuardError", "GraphBreakError", "RecompileError"]


class DynamoOnceError(RuntimeError):
    """Base class of dynamo-once's errors."""


class InputMismatchError(DynamoOnceError, ValueError):
    """A call's argument differs from the traced one in rank, dtype, device, a static size or a constant."""


class ShapeGuardError(DynamoOnceError):
    """Debug mode: a shape guard recorded at trace time fails for this call."""


class GraphBreakError(DynamoOnceError):
    """Dynamo could not capture ``forward`` as one graph, which levels >= 2 require."""


class RecompileError(DynamoOnceError):
    """A level >= 2 model was about to be traced again after its first trace."""
