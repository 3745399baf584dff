import pytest
import torch

from dispatcher import CompilationConfig, set_compilation_config


@pytest.fixture
def level():
    """``level(n, **kw)``: a context manager setting the compilation config for the block."""

    def make(n, **kwargs):
        return set_compilation_config(CompilationConfig(level=n, **kwargs))

    return make


@pytest.fixture(autouse=True)
def _grad_off():
    """Inference, as the models run: no autograd graph is recorded (it would add guards and graphs)."""
    with torch.no_grad():
        yield
