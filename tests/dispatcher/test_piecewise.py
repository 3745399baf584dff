"""Levels 3-4: splitting at the splitting ops, piecewise Inductor compiles, CUDA graphs per size."""

import contextlib
from unittest import mock

import pytest
import torch
from piecewise_testing import CAPTURABLE, DISTINCT, N_LAYERS, PIECES, Toy, TwoSizes, config, eager, mix

from dispatcher import (
    CompilationConfig,
    CUDAGraphAddressError,
    CUDAGraphCaptureError,
    CUDAGraphMode,
    CUDAGraphNotCapturedError,
    CUDAGraphs,
    compilation_counter,
    default_capture_sizes,
    set_compilation_config,
    support_torch_compile,
)
from dispatcher.cuda_graph import CapturedGraph

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


@torch.no_grad()
def test_split_and_compile_counters_on_cpu():
    with set_compilation_config(config(compile_sizes=[8])):
        m = Toy()
    with compilation_counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=PIECES,
        num_piecewise_capturable_graphs_seen=CAPTURABLE,
        num_backend_compilations=DISTINCT,  # one symbolic-size compile per piece structure
        num_cudagraph_captured=0,
    ):
        x = torch.randn(5, 32)
        torch.testing.assert_close(m(x), eager(m, x), rtol=1e-4, atol=1e-4)
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=DISTINCT):  # size 8: once more each
        x = torch.randn(8, 32)
        torch.testing.assert_close(m(x), eager(m, x), rtol=1e-4, atol=1e-4)
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):
        for n in (8, 1, 13):
            x = torch.randn(n, 32)
            torch.testing.assert_close(m(x), eager(m, x), rtol=1e-4, atol=1e-4)
    pw = m._do_backend.piecewise
    assert [it.is_splitting_op for it in pw.items] == [False, True] * N_LAYERS + [False]
    assert pw.num_piece_compiles == DISTINCT
    assert pw.num_pieces_replayed == N_LAYERS - 1  # the layers after the first: not run on fake tensors


@torch.no_grad()
def test_a_splitting_ops_eager_impl_is_called_between_the_pieces_instead_of_the_op():
    """plugins.set_splitting_op_eager_impl: a model compiled after it is set calls the function for each of its
    splitting op's calls between the pieces (not the op, so not the op's kernel), with the op's arguments; one
    compiled before, or after it is removed, calls the op. Bad arguments name what was expected."""
    from dispatcher import plugins

    seen = []

    def fn(x):
        seen.append(x.shape)
        return mix(x)  # what the op's kernel does

    x = torch.randn(5, 32)
    plugins.set_splitting_op_eager_impl("dynamo_once_test::mix", fn)
    try:
        with set_compilation_config(config()):
            m = Toy()
        torch.testing.assert_close(m(x), eager(m, x), rtol=1e-4, atol=1e-4)
        seen.clear()
        with mock.patch.object(torch.ops.dynamo_once_test.mix, "default", side_effect=AssertionError("op called")):
            out = m(torch.randn(7, 32))
        assert seen == [torch.Size([7, 32])] * N_LAYERS and out.shape == (7, 32)
    finally:
        plugins.set_splitting_op_eager_impl("dynamo_once_test::mix", None)
    assert plugins.get_splitting_op_eager_impl("dynamo_once_test::mix") is None
    with set_compilation_config(config()):
        m2 = Toy()
    seen.clear()
    torch.testing.assert_close(m2(x), eager(m2, x), rtol=1e-4, atol=1e-4)
    assert seen == []
    with pytest.raises(ValueError, match="'namespace::name' string; got 'mix'"):
        plugins.set_splitting_op_eager_impl("mix", fn)
    with pytest.raises(ValueError, match="fn must be callable or None; got 3"):
        plugins.set_splitting_op_eager_impl("dynamo_once_test::mix", 3)


def test_piece_replay_makes_fresh_outputs_of_the_same_description_or_runs():
    """An identical piece's outputs are new fake tensors described as the first one's (a view keeps its offset,
    strides and storage size); outputs that alias an input, or each other, are not replayed."""
    from dispatcher import compat
    from dispatcher.piece_replay import MISS, PieceReplay

    with compat.new_fake_mode():
        x = torch.empty(6, 8)
        fresh = torch.empty(6, 16)
        view = torch.empty(6, 24)[:, 8:]  # a view of a fresh base at a nonzero offset
        replay = PieceReplay()
        replay.record("a", [x], (fresh, view, 3))
        out = replay.replay("a")
        assert out is not MISS and out[2] == 3
        for new, old in zip(out[:2], (fresh, view)):
            assert (new.shape, new.stride(), new.storage_offset()) == (old.shape, old.stride(), old.storage_offset())
            assert new.untyped_storage().nbytes() == old.untyped_storage().nbytes()
            assert compat.storage_key(new) != compat.storage_key(old)
        assert out[1]._base is not None
        replay.record("b", [x], x[1:])  # a view of the piece's input
        replay.record("c", [x], (fresh, fresh[1:]))  # two outputs on one storage
        assert replay.replay("b") is MISS and replay.replay("c") is MISS and replay.replay("d") is MISS
        assert replay.replayed == 1


@torch.no_grad()
def test_pieces_of_one_structure_share_a_compile_but_not_their_inputs():
    """The layers' pieces share one compile: each still computes with its own layer's weights, and a piece whose
    inputs differ in shape (here a wider last layer) gets its own."""

    @support_torch_compile
    class Widening(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32), torch.nn.Linear(32, 32),
                                               torch.nn.Linear(32, 48)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.ops.dynamo_once_test.mix(torch.relu(layer(x)))
            return x

    with set_compilation_config(config()):
        m = Widening()
    x = torch.randn(6, 32)
    expected = x
    for layer in m.layers:
        expected = mix(torch.relu(layer(expected)))
    with compilation_counter.expect(num_graphs_seen=1, num_backend_compilations=2):
        torch.testing.assert_close(m(x), expected, rtol=1e-4, atol=1e-4)
    pw = m._do_backend.piecewise
    assert pw.num_piece_compiles == 2
    first, second = [pw.pieces[it.name] for it in pw.items if not it.is_splitting_op][:2]
    assert first.compiles is second.compiles  # one compile ...
    assert first.input_names != second.input_names  # ... but each names its own inputs (the address checks')


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
    # 1, 2, 4, every 8 to 256, every 16 to 512 (vLLM's spacing): a default LLM's 512-token steps replay graphs
    assert CompilationConfig().cudagraph_capture_sizes == [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))
    assert default_capture_sizes(24) == [1, 2, 4, 8, 16, 24]


SIZES = [1, 2, 4, 8]


@contextlib.contextmanager
def counting_replays():
    """The names of the piece graphs replayed inside the block, in order."""
    names = []
    replay = CapturedGraph.replay

    def counted(self, args):
        names.append(self.name)
        return replay(self, args)

    with mock.patch.object(CapturedGraph, "replay", counted):
        yield names


def cuda_toy(**kw):
    """A level-3 Toy on CUDA with graphs possible, traced at 16 tokens (no size a test captures)."""
    with set_compilation_config(config(use_cudagraph=True, **kw)):
        m = Toy().cuda()
    m(torch.randn(16, 32, device="cuda"))
    return m


@pytest.mark.cuda
def test_piecewise_graphs_per_piece_per_size():
    torch.manual_seed(0)
    m = cuda_toy()
    graphs = CUDAGraphs()
    x = torch.randn(max(SIZES), 32, device="cuda")
    with compilation_counter.expect(num_cudagraph_captured=CAPTURABLE * len(SIZES),  # one per piece per size
                                    num_graphs_seen=0, num_backend_compilations=0):
        seconds = graphs.capture(SIZES, PIECEWISE, lambda n: m(x[:n]))
    assert seconds > 0
    assert graphs.sizes(PIECEWISE) == SIZES and graphs.sizes(FULL) == []
    assert (PIECEWISE, 4) in graphs and (PIECEWISE, 5) not in graphs and (FULL, 4) not in graphs
    with compilation_counter.expect(num_cudagraph_captured=0, num_backend_compilations=0, num_graphs_seen=0):
        for n in SIZES + [4]:
            x = torch.randn(n, 32, device="cuda")
            with counting_replays() as replays:
                y = graphs.run(PIECEWISE, n, lambda k: m(x))
            assert len(replays) == CAPTURABLE and all(r.endswith(f"[{n} tokens]") for r in replays)
            with counting_replays() as replays:
                plain = graphs.run(NONE, n, lambda k: m(x))  # the compiled pieces, no graphs
            assert replays == []
            torch.testing.assert_close(y, plain, rtol=0, atol=0)  # bitwise: the same kernels, replayed
            torch.testing.assert_close(y, eager(m, x), rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
def test_sizes_not_captured_and_calls_outside_a_step_run_without_graphs():
    m = cuda_toy()
    graphs = CUDAGraphs()
    x = torch.randn(8, 32, device="cuda")
    graphs.capture([4, 8], PIECEWISE, lambda n: m(x[:n]))
    with counting_replays() as replays, compilation_counter.expect(num_cudagraph_captured=0):
        for n in (5, 300, 4, 8):  # 4 and 8 are captured, but no step is declared: no graph either
            x = torch.randn(n, 32, device="cuda")
            torch.testing.assert_close(m(x), graphs.run(NONE, n, lambda k: m(x)), rtol=0, atol=0)
            torch.testing.assert_close(m(x), eager(m, x), rtol=1e-3, atol=1e-3)
    assert replays == []
    with pytest.raises(CUDAGraphNotCapturedError, match=r"\(PIECEWISE, 5\).*captured: \[4, 8\]"):
        graphs.run(PIECEWISE, 5, lambda k: m(torch.randn(5, 32, device="cuda")))


@pytest.mark.cuda
def test_outputs_of_a_piecewise_step_are_the_callers():
    m = cuda_toy()
    graphs = CUDAGraphs()
    x = torch.randn(4, 32, device="cuda")
    graphs.capture([4], PIECEWISE, lambda n: m(x))
    first = graphs.run(PIECEWISE, 4, lambda n: m(torch.randn(4, 32, device="cuda")))
    assert first.data_ptr() not in graphs.output_ptrs  # the last piece's output was cloned
    kept = first.clone()
    graphs.run(PIECEWISE, 4, lambda n: m(torch.randn(4, 32, device="cuda")))
    torch.testing.assert_close(first, kept, rtol=0, atol=0)


@pytest.mark.cuda
def test_a_piecewise_step_captures_every_compiled_model_it_calls():
    a, b = cuda_toy(), cuda_toy()
    graphs = CUDAGraphs()
    x = torch.randn(8, 32, device="cuda")

    def step(n):
        return b(a(x[:n]))

    with compilation_counter.expect(num_cudagraph_captured=2 * CAPTURABLE * 2):  # 2 models, 2 sizes
        graphs.capture([2, 8], PIECEWISE, step)
    for n in (2, 8, 2):
        x.copy_(torch.randn(8, 32, device="cuda"))
        with counting_replays() as replays:
            y = graphs.run(PIECEWISE, n, step)
        assert len(replays) == 2 * CAPTURABLE
        torch.testing.assert_close(y, graphs.run(NONE, n, step), rtol=0, atol=0)


@pytest.mark.cuda
def test_debug_mode_catches_parameter_reassigned_after_capture():
    m = cuda_toy(debug=True)
    graphs = CUDAGraphs()
    x = torch.randn(4, 32, device="cuda")
    graphs.capture([4], PIECEWISE, lambda n: m(x))
    graphs.run(PIECEWISE, 4, lambda n: m(x))
    m.layers[1].weight = torch.nn.Parameter(torch.randn(32, 32, device="cuda"))
    with pytest.raises(CUDAGraphAddressError, match="captured reading it at"):
        graphs.run(PIECEWISE, 4, lambda n: m(x))


@pytest.mark.cuda
def test_full_graph_captures_whole_step_including_splitting_ops():
    m = cuda_toy()
    buf = torch.randn(8, 32, device="cuda")  # a runner's persistent input buffer
    graphs = CUDAGraphs()
    graphs.mark_static(buf)

    def step(n):
        return m(buf[:n])

    def not_called(n):
        raise AssertionError("a FULL step replays its graph; fn is not called")

    prepared = []
    with compilation_counter.expect(num_cudagraph_captured=2):  # one whole-step graph per size, no piece graphs
        graphs.capture([2, 4], FULL, step, prepare=prepared.append)
    assert prepared == [4, 2] and graphs.sizes(FULL) == [2, 4] and graphs.sizes(PIECEWISE) == []
    # PIECEWISE graphs of the same model in the same pool, replayed in turn with the whole-step ones.
    with compilation_counter.expect(num_cudagraph_captured=CAPTURABLE * 2):
        graphs.capture([2, 4], PIECEWISE, step)
    for mode, n in [(FULL, 4), (PIECEWISE, 2), (FULL, 2), (PIECEWISE, 4), (FULL, 4)]:
        buf.copy_(torch.randn(8, 32, device="cuda"))
        with counting_replays() as replays:
            out = graphs.run(mode, n, not_called if mode is FULL else step)
        assert len(replays) == (0 if mode is FULL else CAPTURABLE)
        assert out.shape == (n, 32)
        torch.testing.assert_close(out, eager(m, buf[:n]), rtol=1e-3, atol=1e-3)
    with pytest.raises(CUDAGraphNotCapturedError, match=r"\(FULL, 8\)"):
        graphs.run(FULL, 8, not_called)


@pytest.mark.cuda
def test_views_of_static_buffers_are_read_in_place_and_checked():
    m = cuda_toy()
    buf = torch.randn(16, 32, device="cuda")
    graphs = CUDAGraphs()
    graphs.mark_static(buf)
    graphs.capture([4], PIECEWISE, lambda n: m(buf[:n]))
    buf[:4] = torch.randn(4, 32, device="cuda")  # written in place: the graph reads it with no copy
    torch.testing.assert_close(graphs.run(PIECEWISE, 4, lambda n: m(buf[:n])), eager(m, buf[:4]),
                               rtol=1e-3, atol=1e-3)
    with pytest.raises(CUDAGraphAddressError, match="view of a persistent buffer"):
        graphs.run(PIECEWISE, 4, lambda n: m(buf[4:4 + n]))
    # Another CUDAGraphs object did not mark buf: its graphs copy the view in, at any offset.
    other = CUDAGraphs()
    other.capture([4], PIECEWISE, lambda n: m(buf[:n]))
    torch.testing.assert_close(other.run(PIECEWISE, 4, lambda n: m(buf[4:4 + n])), eager(m, buf[4:8]),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
def test_piecewise_capture_without_any_piece_graph_raises():
    graphs = CUDAGraphs()
    # Two dynamic sizes: the pieces cannot tell their token count.
    with set_compilation_config(config(use_cudagraph=True)):
        two = TwoSizes().cuda()
    x, y = torch.randn(8, 32, device="cuda"), torch.randn(3, 32, device="cuda")
    two(x, y)
    assert two.num_dynamic_sizes == 2
    with pytest.raises(CUDAGraphCaptureError, match="PIECEWISE at size 4 captured no graph"):
        graphs.capture([4], PIECEWISE, lambda n: two(x[:n], y))
    # CUDA graphs off in the config.
    with set_compilation_config(config(use_cudagraph=False)):
        plain = Toy().cuda()
    plain(x)
    with pytest.raises(CUDAGraphCaptureError, match="size 4"):
        graphs.capture([4], PIECEWISE, lambda n: plain(x[:n]))
    # A size larger than the inputs hold: the pieces see 8 tokens, not 16.
    m = cuda_toy()
    with pytest.raises(CUDAGraphCaptureError, match="size 16"):
        graphs.capture([16], PIECEWISE, lambda n: m(x[:n]))
    assert graphs.sizes(PIECEWISE) == []
