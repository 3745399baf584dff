"""Levels 3-4: splitting at the splitting ops, piecewise Inductor compiles, CUDA graphs per size."""

import pytest
import torch

from dispatcher import CompilationConfig, compilation_counter, set_compilation_config, support_torch_compile
from dispatcher.cuda_graph import CUDAGraphAddressError


# A stand-in for attention: opaque to Dynamo and Inductor, so it is a split point.
@torch.library.custom_op("dynamo_once_test::mix", mutates_args=())
def mix(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(0) / (1 + torch.arange(x.shape[0], device=x.device, dtype=x.dtype))[:, None]


@mix.register_fake
def _(x):
    return torch.empty_like(x)


N_LAYERS = 3


@support_torch_compile
class Toy(torch.nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(N_LAYERS))
        self.out = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.ops.dynamo_once_test.mix(torch.relu(layer(x)))
        return self.out(x)


def eager(m, x):
    for layer in m.layers:
        x = mix(torch.relu(layer(x)))
    return m.out(x)


def config(**kw):
    kw.setdefault("use_cudagraph", False)
    return CompilationConfig(level=3, splitting_ops=["dynamo_once_test::mix"], **kw)


PIECES = 2 * N_LAYERS + 1  # piece, mix, piece, mix, piece, mix, piece
CAPTURABLE = N_LAYERS + 1  # the pieces between (and around) the splitting ops


@torch.no_grad()
def test_split_and_compile_counters_on_cpu():
    with set_compilation_config(config(compile_sizes=[8])):
        m = Toy()
    with compilation_counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=PIECES,
        num_piecewise_capturable_graphs_seen=CAPTURABLE,
        num_backend_compilations=CAPTURABLE,  # one symbolic-size compile per piece
        num_cudagraph_captured=0,
    ):
        x = torch.randn(5, 32)
        torch.testing.assert_close(m(x), eager(m, x), rtol=1e-4, atol=1e-4)
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=CAPTURABLE):  # size 8: once more each
        x = torch.randn(8, 32)
        torch.testing.assert_close(m(x), eager(m, x), rtol=1e-4, atol=1e-4)
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):
        for n in (8, 1, 13):
            x = torch.randn(n, 32)
            torch.testing.assert_close(m(x), eager(m, x), rtol=1e-4, atol=1e-4)
    pw = m._do_backend.piecewise
    assert [it.is_splitting_op for it in pw.items] == [False, True] * N_LAYERS + [False]


@torch.no_grad()
def test_no_splitting_op_in_graph_is_one_piece():
    with set_compilation_config(CompilationConfig(level=3, use_cudagraph=False)):
        m = Toy()  # the default splitting op (attention) does not occur: one piece holds everything
    with compilation_counter.expect(num_piecewise_graphs_seen=1, num_piecewise_capturable_graphs_seen=1,
                                    num_backend_compilations=1):
        x = torch.randn(4, 32)
        torch.testing.assert_close(m(x), eager(m, x), rtol=1e-4, atol=1e-4)


def test_config_validation():
    with pytest.raises(ValueError, match="splitting_ops"):
        CompilationConfig(splitting_ops=["attention"])
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        CompilationConfig(cudagraph_capture_sizes=[0, 8])
    with pytest.raises(ValueError, match="cudagraph_mode"):
        CompilationConfig(cudagraph_mode="full")
    assert CompilationConfig(compile_sizes=[8, 2, 8]).compile_sizes == [2, 8]
    assert CompilationConfig().cudagraph_capture_sizes == [1, 2, 4] + list(range(8, 257, 8))


SIZES = [1, 2, 4, 8]


@pytest.mark.cuda
@torch.no_grad()
def test_cuda_graphs_per_piece_per_size():
    torch.manual_seed(0)
    with set_compilation_config(config(use_cudagraph=True, cudagraph_capture_sizes=SIZES)):
        m = Toy().cuda()
    with set_compilation_config(config(use_cudagraph=False)):
        plain = Toy().cuda()
    plain.load_state_dict(m.state_dict())
    m(torch.randn(16, 32, device="cuda"))  # first call traces (16: not a capture size)
    plain(torch.randn(16, 32, device="cuda"))
    with compilation_counter.expect(num_cudagraph_captured=CAPTURABLE * len(SIZES),  # one per piece per size
                                    num_graphs_seen=0):
        for n in SIZES:
            for _ in range(2):  # warm-up, then capture: both calls' outputs are real
                x = torch.randn(n, 32, device="cuda")
                torch.testing.assert_close(m(x), plain(x), rtol=0, atol=0)
    outs = []
    with compilation_counter.expect(num_cudagraph_captured=0, num_backend_compilations=0):
        for n in SIZES + [5, 300]:  # 5 and 300: no graph, compiled pieces
            x = torch.randn(n, 32, device="cuda")
            y = m(x)
            outs.append(y)
            torch.testing.assert_close(y, plain(x), rtol=0, atol=0)  # bitwise: same kernels, replayed
            torch.testing.assert_close(y, eager(m, x), rtol=1e-3, atol=1e-3)
    # Returned outputs are the caller's: a later replay does not overwrite them.
    x = torch.randn(4, 32, device="cuda")
    first = m(x)
    kept = first.clone()
    m(torch.randn(4, 32, device="cuda"))
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


@pytest.mark.cuda
@torch.no_grad()
def test_debug_mode_catches_parameter_reassigned_after_capture():
    with set_compilation_config(config(use_cudagraph=True, cudagraph_capture_sizes=[4], debug=True)):
        m = Toy().cuda()
    m(torch.randn(8, 32, device="cuda"))
    for _ in range(3):
        m(torch.randn(4, 32, device="cuda"))
    m.layers[1].weight = torch.nn.Parameter(torch.randn(32, 32, device="cuda"))
    with pytest.raises(CUDAGraphAddressError, match="captured reading it at"):
        m(torch.randn(4, 32, device="cuda"))


@pytest.mark.cuda
@torch.no_grad()
def test_full_graph_captures_whole_step_including_splitting_ops():
    from dispatcher.cuda_graph import FullGraphs

    with set_compilation_config(config(use_cudagraph=True, cudagraph_capture_sizes=[4])):
        m = Toy().cuda()
    m(torch.randn(8, 32, device="cuda"))
    buf = torch.randn(4, 32, device="cuda")  # a runner's persistent input buffer
    graphs = FullGraphs()
    with compilation_counter.expect(num_cudagraph_captured=1):  # one whole-step graph, no piece graphs
        out = graphs.capture(4, lambda: m(buf))
    for _ in range(3):
        buf.copy_(torch.randn(4, 32, device="cuda"))
        graphs.replay(4)
        torch.testing.assert_close(out, eager(m, buf), rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
@torch.no_grad()
def test_views_of_static_buffers_are_read_in_place_and_checked():
    from dispatcher.cuda_graph import mark_static_buffers

    with set_compilation_config(config(use_cudagraph=True, cudagraph_capture_sizes=[4])):
        m = Toy().cuda()
    buf = torch.randn(16, 32, device="cuda")
    mark_static_buffers(buf)
    m(buf[:8])
    for _ in range(2):
        m(buf[:4])
    buf[:4] = torch.randn(4, 32, device="cuda")
    torch.testing.assert_close(m(buf[:4]), eager(m, buf[:4]), rtol=1e-3, atol=1e-3)
    with pytest.raises(CUDAGraphAddressError, match="view of a persistent buffer"):
        m(buf[4:8])
