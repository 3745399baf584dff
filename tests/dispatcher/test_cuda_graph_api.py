"""CUDAGraphs without a GPU: argument validation, NONE mode, the wrapper's dynamic sizes, and the
PIECEWISE mechanism (step lookup, per-piece capture, replay, the output-copy rule) with a stand-in for
``CapturedGraph`` that "replays" by running the piece again into its captured output buffers.

The real graphs are tested in test_piecewise.py (marked cuda)."""

import threading

import pytest
import torch
from piecewise_testing import CAPTURABLE, Toy, TwoSizes, config, eager, two_sizes_eager

import dispatcher
from dispatcher import (
    CUDAGraphCaptureError,
    CUDAGraphMode,
    CUDAGraphNotCapturedError,
    CUDAGraphs,
    compilation_counter,
    set_compilation_config,
)
from dispatcher import cuda_graph, piecewise
from dispatcher.cuda_graph import thread_state

NONE, PIECEWISE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


def test_exported_from_dispatcher():
    for name in ("CUDAGraphMode", "CUDAGraphs", "CUDAGraphAddressError", "CUDAGraphCaptureError",
                 "CUDAGraphNotCapturedError"):
        assert name in dispatcher.__all__ and getattr(dispatcher, name) is getattr(cuda_graph, name)
    assert [m.name for m in CUDAGraphMode] == ["NONE", "PIECEWISE", "FULL"]
    for old in ("FullGraphs", "capture_sizes", "capturing_full_graph", "mark_static_buffers", "CUDAGraphPool"):
        assert not hasattr(cuda_graph, old)


def test_run_validates_mode_and_size():
    graphs = CUDAGraphs()
    with pytest.raises(TypeError, match=r"CUDAGraphs.run: mode must be a CUDAGraphMode .*got 'piecewise'"):
        graphs.run("piecewise", 4, lambda n: n)
    for size in (0, -1, True, 2.0, "4"):
        for mode in CUDAGraphMode:
            with pytest.raises(ValueError, match=r"CUDAGraphs.run: size must be a positive int"):
                graphs.run(mode, size, lambda n: n)


def test_run_of_a_size_never_captured_names_mode_and_size():
    graphs = CUDAGraphs()
    called = []
    for mode in (PIECEWISE, FULL):
        with pytest.raises(CUDAGraphNotCapturedError, match=rf"no CUDA graph captured for \({mode.name}, 4\); "
                                                            rf"{mode.name} sizes captured: \[\]"):
            graphs.run(mode, 4, called.append)
    assert called == []
    assert issubclass(CUDAGraphNotCapturedError, LookupError)


def test_capture_validates_its_arguments(monkeypatch):
    graphs = CUDAGraphs()
    cases = [
        (dict(mode="full"), TypeError, r"capture: mode must be a CUDAGraphMode"),
        (dict(mode=NONE), ValueError, r"capture: mode NONE runs without graphs"),
        (dict(sizes=[0, 8]), ValueError, r"capture: sizes must be positive ints; got \[0\]"),
        (dict(sizes=[4, True]), ValueError, r"capture: sizes must be positive ints; got \[True\]"),
        (dict(sizes=[4, 2.5]), ValueError, r"sizes must be positive ints"),
        (dict(sizes=8), TypeError, r"capture: sizes must be an iterable of positive ints"),
        (dict(sizes="8"), TypeError, r"capture: sizes must be an iterable"),
        (dict(fn=None), TypeError, r"capture: fn must be callable"),
        (dict(prepare=3), TypeError, r"capture: prepare must be callable"),
    ]
    for kw, exc, match in cases:
        args = dict(sizes=[1, 2], mode=PIECEWISE, fn=lambda n: n) | kw
        with pytest.raises(exc, match=match):
            graphs.capture(**args)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"CUDA graphs need a CUDA device"):
        graphs.capture([1, 2], FULL, lambda n: n)


def test_queries():
    graphs = CUDAGraphs()
    assert graphs.sizes(PIECEWISE) == graphs.sizes(FULL) == graphs.sizes(NONE) == []
    assert (NONE, 7) in graphs  # NONE runs any size, nothing to capture
    assert (NONE, 0) not in graphs and (PIECEWISE, 7) not in graphs and (FULL, 7) not in graphs
    with pytest.raises(TypeError, match=r"\(mode, size\) pair"):
        assert 7 in graphs
    with pytest.raises(TypeError, match=r"CUDAGraphs.sizes: mode must be a CUDAGraphMode"):
        graphs.sizes("full")
    with pytest.raises(TypeError, match=r"mark_static: expected tensors"):
        graphs.mark_static([1, 2])
    buf = torch.zeros(4, 8)
    graphs.mark_static(buf)
    assert buf[2:].untyped_storage().data_ptr() in graphs.static_storages


def test_none_mode_runs_the_compiled_model_with_no_step():
    with set_compilation_config(config(compile_sizes=[8])):
        m = Toy()
    graphs = CUDAGraphs()
    seen = []

    def step(n):
        seen.append((n, thread_state.step))
        return m(x[:n])

    x = torch.randn(8, 32)
    with compilation_counter.expect(num_cudagraph_captured=0):
        for n in (5, 8, 3):
            torch.testing.assert_close(graphs.run(NONE, n, step), eager(m, x[:n]), rtol=1e-4, atol=1e-4)
    assert seen == [(5, None), (8, None), (3, None)]


def test_num_dynamic_sizes_of_the_wrapper():
    with set_compilation_config(config()):
        m = Toy()
        two = TwoSizes()
    assert m.num_dynamic_sizes is None and two.num_dynamic_sizes is None  # before the trace
    m(torch.randn(5, 32))
    assert m.num_dynamic_sizes == 1
    x, y = torch.randn(6, 32), torch.randn(3, 32)  # different sizes: Dynamo would unify equal ones
    torch.testing.assert_close(two(x, y), two_sizes_eager(two, x, y), rtol=1e-4, atol=1e-4)
    assert two.num_dynamic_sizes == 2
    x, y = torch.randn(9, 32), torch.randn(2, 32)
    torch.testing.assert_close(two(x, y), two_sizes_eager(two, x, y), rtol=1e-4, atol=1e-4)


def test_num_dynamic_sizes_below_level_3_is_none():
    for level in (0, 1, 2):
        with set_compilation_config(dispatcher.CompilationConfig(level=level)):
            m = Toy()
        m(torch.randn(4, 32))
        assert m.num_dynamic_sizes is None


def test_two_dynamic_sizes_warn(caplog):
    with set_compilation_config(config()):
        two = TwoSizes()
    with caplog.at_level("WARNING", logger="dispatcher.piecewise"):
        two(torch.randn(6, 32), torch.randn(3, 32))
    assert "2 dynamic sizes; per-size compiles and CUDA graphs are off" in caplog.text


# ----------------------------------------------------------------- the PIECEWISE mechanism, simulated


class FakeGraph:
    """``CapturedGraph`` on the CPU: capture runs the piece once; a replay runs it again and copies the
    result into the captured outputs (as a graph writes its pool), which stay in ``owner.output_ptrs``."""

    replays: list[str] = []

    def __init__(self, name, fn, args, owner, input_names, static_ptrs, debug):
        self.name, self.fn = name, fn
        self.output = fn(*args)
        for t in _flat(self.output):
            owner.output_ptrs.add(t.data_ptr())
        compilation_counter.add("num_cudagraph_captured")

    def replay(self, args):
        FakeGraph.replays.append(self.name)
        for dst, src in zip(_flat(self.output), _flat(self.fn(*args))):
            dst.copy_(src)
        return self.output


def _flat(out):
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


@pytest.fixture
def simulated(monkeypatch):
    """Pieces traced inside may have graphs (on the CPU); ``claim_cuda()`` then lets ``capture`` run."""
    monkeypatch.setattr(piecewise, "_graphs_possible", lambda config, example_inputs: config.use_cudagraph)
    monkeypatch.setattr(cuda_graph, "CapturedGraph", FakeGraph)
    FakeGraph.replays = []

    def claim_cuda():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    return claim_cuda


def traced_toy():
    with set_compilation_config(config(use_cudagraph=True)):
        m = Toy()
    m(torch.randn(16, 32))
    return m


def test_simulated_piecewise_capture_and_replay(simulated):
    m = traced_toy()
    simulated()
    graphs = CUDAGraphs()
    x = torch.randn(8, 32)
    prepared = []
    with compilation_counter.expect(num_cudagraph_captured=CAPTURABLE * 3, num_graphs_seen=0):  # per piece per size
        graphs.capture([2, 8, 4, 8], PIECEWISE, lambda n: m(x[:n]), prepare=prepared.append)
    assert prepared == [8, 4, 2] and graphs.sizes(PIECEWISE) == [2, 4, 8]
    with compilation_counter.expect(num_cudagraph_captured=0):  # captured sizes are skipped
        graphs.capture([4], PIECEWISE, lambda n: m(x[:n]))
    FakeGraph.replays = []
    for n in (4, 2, 8):
        y = torch.randn(n, 32)
        out = graphs.run(PIECEWISE, n, lambda k: m(y))
        assert FakeGraph.replays == [f"Toy.forward:submod_{2 * i}[{n} tokens]" for i in range(CAPTURABLE)]
        FakeGraph.replays = []
        torch.testing.assert_close(out, eager(m, y), rtol=1e-4, atol=1e-4)
        assert out.data_ptr() not in graphs.output_ptrs  # the caller's copy
        kept = out.clone()
        graphs.run(PIECEWISE, n, lambda k: m(torch.randn(n, 32)))
        torch.testing.assert_close(out, kept, rtol=0, atol=0)  # not overwritten by the next replay
        FakeGraph.replays = []
    # Outside a step, in NONE, and at a size other than the step's: the compiled pieces.
    m(torch.randn(4, 32))
    graphs.run(NONE, 4, lambda k: m(torch.randn(4, 32)))
    graphs.run(PIECEWISE, 4, lambda k: m(torch.randn(5, 32)))
    assert FakeGraph.replays == []
    assert thread_state.step is None


def test_simulated_step_is_per_thread(simulated):
    m = traced_toy()
    simulated()
    graphs = CUDAGraphs()
    x = torch.randn(4, 32)
    graphs.capture([4], PIECEWISE, lambda n: m(x))
    FakeGraph.replays = []
    other = []

    def step(n):
        t = threading.Thread(target=lambda: other.append((thread_state.step, m(x))))
        t.start()
        t.join()
        return m(x)

    graphs.run(PIECEWISE, 4, step)
    assert len(FakeGraph.replays) == CAPTURABLE  # this thread's call only
    assert other[0][0] is None


def test_simulated_capture_that_captures_nothing_raises(simulated):
    m = traced_toy()
    with set_compilation_config(config(use_cudagraph=True)):
        two = TwoSizes()
    with set_compilation_config(config(use_cudagraph=False)):
        plain = Toy()
    x, y = torch.randn(8, 32), torch.randn(3, 32)
    two(x, y)
    plain(x)
    simulated()
    graphs = CUDAGraphs()
    for fn, size in [(lambda n: two(x[:n], y), 4), (lambda n: plain(x[:n]), 4), (lambda n: m(x[:n]), 16)]:
        with pytest.raises(CUDAGraphCaptureError, match=rf"PIECEWISE at size {size} captured no graph"):
            graphs.capture([size], PIECEWISE, fn)
        assert (PIECEWISE, size) not in graphs and thread_state.step is None
