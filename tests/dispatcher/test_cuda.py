"""CUDA variants of the dispatch-core tests (run on the GPU machine)."""


import pytest
import torch
from threads_testing import run_in_threads

from dispatcher import (
    CUDAGraphMode,
    CUDAGraphs,
    InputMismatchError,
    ShapeGuardError,
    compilation_counter,
    compile_once,
    support_torch_compile,
)

pytestmark = pytest.mark.cuda


@support_torch_compile
class Block(torch.nn.Module):
    def __init__(self, hidden: int = 256):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, 4 * hidden)
        self.down = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def reference(m, x):
    return x + m.down(torch.nn.functional.gelu(m.up(m.norm(x))))


@pytest.mark.parametrize("lvl", [1, 2, 3, 4])
@torch.no_grad()
def test_levels_on_cuda_match_eager(level, lvl):
    with level(lvl):
        m = Block().cuda().to(torch.bfloat16)
    for n in (64, 1, 7, 300):
        x = torch.randn(n, 256, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(m(x), reference(m, x), rtol=2e-2, atol=2e-2)
    if lvl >= 2:
        assert len(m.compiled_codes) == 1


@torch.no_grad()
def test_traced_once_on_cuda(level):
    with level(3):
        m = Block().cuda()
    with compilation_counter.expect(num_graphs_seen=1, num_backend_compilations=1, num_dispatched_calls=3):
        for n in (16, 1, 5, 4096):
            m(torch.randn(n, 256, device="cuda"))


@torch.no_grad()
def test_device_mismatch_is_named(level):
    with level(2):
        m = Block().cuda()
    m(torch.randn(8, 256, device="cuda"))
    with pytest.raises(InputMismatchError, match=r"argument 'x' was traced as .* on cuda:0.*tensor on cpu"):
        m(torch.randn(8, 256))


@torch.no_grad()
def test_debug_shape_guard_on_cuda(level):
    @compile_once
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] > 8 else x * 3

    with level(3, debug=True):
        torch.testing.assert_close(f(torch.ones(16, 4, device="cuda")), torch.full((16, 4), 2.0, device="cuda"))
        with pytest.raises(ShapeGuardError):
            f(torch.ones(4, 4, device="cuda"))


@torch.no_grad()
def test_threads_on_cuda(level):
    with level(3):
        ms = [Block().cuda() for _ in range(3)]

    def work(m, seed):
        with torch.no_grad():
            g = torch.Generator(device="cuda").manual_seed(seed)
            for i in range(20):
                x = torch.randn(2 + (i * 7 + seed) % 50, 256, device="cuda", generator=g)
                torch.testing.assert_close(m(x), reference(m, x), rtol=1e-3, atol=1e-3)

    run_in_threads(work, [(ms[i % 3], i) for i in range(6)])
    assert all(len(m.compiled_codes) == 1 for m in ms)


@torch.no_grad()
def test_level_3_captures_no_graph_unless_asked(level):
    """Graphs are captured only through CUDAGraphs: repeated calls at any size run the compiled code."""
    with level(3):
        m = Block().cuda()
    with compilation_counter.expect(num_cudagraph_captured=0):
        for _ in range(3):
            for n in (8, 1, 2, 4):
                x = torch.randn(n, 256, device="cuda")
                torch.testing.assert_close(m(x), reference(m, x), rtol=1e-3, atol=1e-3)


@torch.no_grad()
def test_piecewise_graphs_of_a_model_without_splitting_op(level):
    with level(3):
        m = Block().cuda()
    buf = torch.randn(64, 256, device="cuda")
    graphs = CUDAGraphs()
    graphs.mark_static(buf)
    m(buf[:16])

    def step(n):
        return m(buf[:n])

    with compilation_counter.expect(num_cudagraph_captured=3):  # one piece (no splitting op), 3 sizes
        graphs.capture([1, 8, 64], CUDAGraphMode.PIECEWISE, step)
    for n in (8, 1, 64):
        buf.copy_(torch.randn_like(buf))
        y = graphs.run(CUDAGraphMode.PIECEWISE, n, step)
        torch.testing.assert_close(y, graphs.run(CUDAGraphMode.NONE, n, step), rtol=0, atol=0)
        torch.testing.assert_close(y, reference(m, buf[:n]), rtol=1e-3, atol=1e-3)
