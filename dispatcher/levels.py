"""The compilation levels 0-4 (``CompilationLevel``); ``dispatcher.config`` re-exports them.

A module of its own so that ``dispatcher.envs`` can parse ``DYNAMO_ONCE_COMPILE_LEVEL``
without importing the config that reads it (no import circle).
"""

from __future__ import annotations

import enum

__all__ = ["CompilationLevel"]


class CompilationLevel(enum.IntEnum):
    """How much of torch.compile a decorated model goes through."""

    def __new__(cls, value: int, doc: str) -> CompilationLevel:
        member = int.__new__(cls, value)
        member._value_ = value
        member.__doc__ = doc
        return member

    NO_COMPILATION = 0, "Plain eager PyTorch: Dynamo never runs. The reference for every other level."
    DYNAMO_AS_IS = 1, "Stock torch.compile: guards are evaluated on every call; a failed guard recompiles."
    DYNAMO_ONCE = 2, "Dynamo traces forward once; later calls run the captured bytecode with no guard evaluation."
    INDUCTOR = 3, "As DYNAMO_ONCE, and Inductor compiles the captured graph."
    INDUCTOR_MAX_AUTOTUNE = 4, "As INDUCTOR, with Inductor's max_autotune (slower compile, faster kernels)."

    @classmethod
    def parse(cls, value: int | str | CompilationLevel) -> CompilationLevel:
        """A level from an int 0-4, a digit string, or a member name in any case."""
        allowed = ", ".join(f"{m.value} ({m.name})" for m in cls)
        if isinstance(value, bool):
            raise ValueError(f"expected a compilation level, one of {allowed}; got {value!r}")
        if isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                raise ValueError(f"expected a compilation level, one of {allowed}; got {value!r}") from None
        if isinstance(value, str):
            v = value.strip()
            if v.lstrip("-").isdigit():
                return cls.parse(int(v))
            try:
                return cls[v.upper()]
            except KeyError:
                raise ValueError(f"expected a compilation level, one of {allowed}; got {value!r}") from None
        raise ValueError(f"expected a compilation level, one of {allowed}; got {value!r} ({type(value).__name__})")
