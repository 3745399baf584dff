"""dynamo-once's compile-once core: trace ``forward`` once, then dispatch the captured bytecode."""

from .config import (
    CompilationConfig,
    CompilationLevel,
    get_compilation_config,
    set_compilation_config,
)
from .counters import compilation_counter

__all__ = [
    "CompilationConfig",
    "CompilationLevel",
    "compilation_counter",
    "get_compilation_config",
    "set_compilation_config",
]
