import pytest

from dispatcher import CompilationConfig, set_compilation_config


@pytest.fixture
def level():
    """``level(n, **kw)``: a context manager setting the compilation config for the block."""

    def make(n, **kwargs):
        return set_compilation_config(CompilationConfig(level=n, **kwargs))

    return make
