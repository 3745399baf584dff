"""dynamo-once's compile-once core: trace ``forward`` once, then dispatch the captured bytecode."""

from .config import (
    CompilationConfig,
    CompilationLevel,
    PassConfig,
    default_capture_sizes,
    get_compilation_config,
    set_compilation_config,
)
from .counters import CompilationCounter, compilation_counter
from .cuda_graph import (
    CUDAGraphAddressError,
    CUDAGraphCaptureError,
    CUDAGraphMode,
    CUDAGraphNotCapturedError,
    CUDAGraphs,
)
from .decorators import compile_once, dispatcher_of, support_torch_compile
from .errors import (
    DynamoOnceError,
    GraphBreakError,
    InputMismatchError,
    RecompileError,
    ShapeGuardError,
)
from .passes import pass_counter
from .wrapper import TorchCompileWrapperWithCustomDispatcher

__all__ = [
    "CUDAGraphAddressError",
    "CUDAGraphCaptureError",
    "CUDAGraphMode",
    "CUDAGraphNotCapturedError",
    "CUDAGraphs",
    "CompilationConfig",
    "CompilationCounter",
    "CompilationLevel",
    "DynamoOnceError",
    "GraphBreakError",
    "InputMismatchError",
    "PassConfig",
    "default_capture_sizes",
    "RecompileError",
    "ShapeGuardError",
    "TorchCompileWrapperWithCustomDispatcher",
    "compilation_counter",
    "compile_once",
    "dispatcher_of",
    "get_compilation_config",
    "pass_counter",
    "set_compilation_config",
    "support_torch_compile",
]
