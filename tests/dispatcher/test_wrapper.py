"""TorchCompileWrapperWithCustomDispatcher: capture, dispatch and the properties that make it safe."""

import gc
import threading
import types
import weakref

import pytest
import torch
from threads_testing import run_in_threads

from dispatcher import (
    CompilationConfig,
    CompilationLevel,
    RecompileError,
    TorchCompileWrapperWithCustomDispatcher,
    compat,
    compilation_counter,
    set_compilation_config,
)


class Net(TorchCompileWrapperWithCustomDispatcher, torch.nn.Module):
    def __init__(self, scale: float, level=None):
        torch.nn.Module.__init__(self)
        self.lin = torch.nn.Linear(16, 16)
        self.scale = scale
        TorchCompileWrapperWithCustomDispatcher.__init__(self, compilation_level=level)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


def eager(net, x):
    return torch.relu(net.lin(x)) * net.scale


def test_attributes_and_level_2_dispatch():
    net = Net(2.0, level=2)
    assert net.use_custom_dispatcher and net.compiled_codes == []
    assert net.original_code_object is Net.forward.__code__
    x = torch.randn(8, 16)
    with compilation_counter.expect(num_models_seen=1, num_graphs_seen=1, num_backend_compilations=1,
                                    num_codes_captured=1, num_dispatched_calls=0):
        torch.testing.assert_close(net(x), eager(net, x))
    assert len(net.compiled_codes) == 1
    assert net.compiled_codes[0].co_varnames[:2] == ("self", "x")  # same arguments as forward
    # Later calls, also at other sizes of the dynamic dim (1: the decode case), never trace again.
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0, num_dispatched_calls=3):
        for n in (3, 1, 100):
            y = torch.randn(n, 16)
            torch.testing.assert_close(net(y), eager(net, y))


def test_level_1_is_stock_torch_compile_with_guards():
    net = Net(1.0, level=1)
    assert not net.use_custom_dispatcher
    x = torch.randn(8, 16)
    with compilation_counter.expect(num_graphs_seen=1, num_codes_captured=0, num_dispatched_calls=0):
        net(x)
        net(torch.randn(5, 16))  # dim 0 was marked dynamic: no recompile
    net.scale = 3.0  # a guarded attribute: stock Dynamo recompiles
    with compilation_counter.expect(num_graphs_seen=1, num_recompiles=1, num_dispatched_calls=0):
        torch.testing.assert_close(net(x), eager(net, x))


def test_level_0_runs_eager_without_dynamo():
    net = Net(1.0, level=0)
    with compilation_counter.expect(num_models_seen=0, num_graphs_seen=0, num_dispatched_calls=0):
        x = torch.randn(4, 16)
        torch.testing.assert_close(net(x), eager(net, x))


def test_per_instance_capture_without_reset():
    a, b = Net(1.0, level=2), Net(-1.0, level=2)
    x = torch.randn(6, 16)
    with compilation_counter.expect(num_graphs_seen=2, num_codes_captured=2):
        ya, yb = a(x), b(x)
    assert len(a.compiled_codes) == 1 and len(b.compiled_codes) == 1
    assert a.compiled_codes[0] is not b.compiled_codes[0]
    torch.testing.assert_close(ya, eager(a, x))
    torch.testing.assert_close(yb, eager(b, x))
    # Dispatched calls each run their own captured code (b negates, a does not).
    z = torch.randn(3, 16)
    torch.testing.assert_close(a(z), eager(a, z))
    torch.testing.assert_close(b(z), eager(b, z))


def test_fast_path_mutates_nothing_shared():
    net = Net(1.0, level=2)
    x = torch.randn(4, 16)
    net(x)
    code_before = Net.forward.__code__
    fn = net.dispatch_fn(0)
    assert net.dispatch_fn(0) is fn  # built once
    assert isinstance(fn, types.MethodType) and fn.__func__.__code__ is net.compiled_codes[0]
    net(x)
    assert Net.forward.__code__ is code_before is net.original_code_object


class Fails(TorchCompileWrapperWithCustomDispatcher, torch.nn.Module):
    def __init__(self):
        torch.nn.Module.__init__(self)
        TorchCompileWrapperWithCustomDispatcher.__init__(self, compilation_level=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(-1, 3) + 1  # x: [n, 4]; raises unless 3 divides n


def test_exception_inside_dispatched_call_leaves_nothing_swapped():
    m = Fails()
    m(torch.ones(3, 4))
    with pytest.raises(RuntimeError):
        m(torch.ones(2, 4))
    assert Fails.forward.__code__ is m.original_code_object
    with pytest.raises(RuntimeError, match="boom"):
        with m.dispatch_to_code(0):
            assert Fails.forward.__code__ is m.compiled_codes[0]
            raise RuntimeError("boom")
    assert Fails.forward.__code__ is m.original_code_object
    torch.testing.assert_close(m(torch.ones(6, 4)), torch.full((8, 3), 2.0))


class TwoCodes(TorchCompileWrapperWithCustomDispatcher, torch.nn.Module):
    """A subclass that compiles twice (with and without ``bias``) and dispatches by argument."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        TorchCompileWrapperWithCustomDispatcher.__init__(self, compilation_level=2)
        self.which: dict[bool, int] = {}

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = x * 2
        return y if bias is None else y + bias

    def __call__(self, x, bias=None):
        key = bias is not None
        if key not in self.which:  # the wrapper's own compiled_callable: its traces are captured
            out = self.compiled_callable(x, bias)
            self.which[key] = len(self.compiled_codes) - 1
            return out
        with self.dispatch_to_code(self.which[key]):
            return self.forward(x, bias)


def test_subclass_dispatches_among_several_codes():
    m = TwoCodes()
    x, b = torch.randn(4, 5), torch.randn(5)
    torch.testing.assert_close(m(x), x * 2)
    torch.testing.assert_close(m(x, b), x * 2 + b)
    assert len(m.compiled_codes) == 2 and m.which == {False: 0, True: 1}
    with compilation_counter.expect(num_graphs_seen=0):
        x2 = torch.randn(7, 5)
        torch.testing.assert_close(m(x2, b), x2 * 2 + b)
        torch.testing.assert_close(m(x2), x2 * 2)
    assert TwoCodes.forward.__code__ is m.original_code_object


class Runner(TorchCompileWrapperWithCustomDispatcher):
    """A plain class (not a module) whose forward calls a model."""

    def __init__(self, model):
        self.model = model
        super().__init__(compilation_level=2)

    def forward(self, x):
        return self.model(x).sum(-1)


def test_plain_class_whose_forward_calls_a_model():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    r = Runner(model)
    x = torch.randn(5, 8)
    torch.testing.assert_close(r(x), model(x).sum(-1))
    assert len(r.compiled_codes) == 1
    y = torch.randn(9, 8)
    with compilation_counter.expect(num_dispatched_calls=1, num_graphs_seen=0):
        torch.testing.assert_close(r(y), model(y).sum(-1))


def test_threads_calling_several_instances():
    nets = [Net(float(i + 1), level=2) for i in range(4)]
    for n in nets:
        n(torch.randn(4, 16))

    def work(net, seed):
        g = torch.Generator().manual_seed(seed)
        for i in range(50):
            x = torch.randn(1 + (i + seed) % 9, 16, generator=g)
            torch.testing.assert_close(net(x), eager(net, x))

    run_in_threads(work, [(nets[i % 4], i) for i in range(8)])


def test_threads_compiling_instances_concurrently():
    nets = [Net(float(i + 1), level=2) for i in range(4)]

    def work(net):
        x = torch.randn(6, 16)
        torch.testing.assert_close(net(x), eager(net, x))

    run_in_threads(work, [(n,) for n in nets])
    assert all(len(n.compiled_codes) == 1 for n in nets)
    assert len({id(n.compiled_codes[0]) for n in nets}) == 4


def test_threads_using_the_swap_contract():
    ms = [TwoCodes() for _ in range(3)]
    b = torch.randn(5)
    for m in ms:
        m(torch.randn(3, 5)), m(torch.randn(3, 5), b)

    def work(m, i):
        for j in range(40):
            x = torch.randn(2 + j % 5, 5)
            want = x * 2 + b if (i + j) % 2 else x * 2
            got = m(x, b) if (i + j) % 2 else m(x)
            torch.testing.assert_close(got, want)

    run_in_threads(work, [(ms[i % 3], i) for i in range(6)])
    assert TwoCodes.forward.__code__ is ms[0].original_code_object


def test_no_leak_hook_neither_keeps_instance_alive_nor_outlives_it():
    hooks_before = len(compat.bytecode_hooks())
    net = Net(1.0, level=2)
    net(torch.randn(4, 16))
    net(torch.randn(2, 16))
    assert len(compat.bytecode_hooks()) == hooks_before  # registered only while tracing
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None


def test_hook_ignores_other_code_and_other_threads():
    net = Net(1.0, level=2)
    net.bytecode_hook(Fails.forward.__code__, Fails.forward.__code__)
    assert net.compiled_codes == []
    # While one instance's hook is registered (inside its compiled_callable), another thread compiles the
    # same class's forward with plain torch.compile: only the instance's own trace is captured.
    seen = []

    class Spy(TorchCompileWrapperWithCustomDispatcher, torch.nn.Module):
        def __init__(self, scale):
            torch.nn.Module.__init__(self)
            self.scale = scale
            inner = torch.compile(self.forward, backend="eager")

            def compiled(x):
                if scale == 1.0:
                    other = Spy(2.0)
                    t = threading.Thread(target=lambda: seen.append(
                        torch.compile(other.forward, backend="eager")(torch.randn(4, 16))))
                    t.start()
                    t.join()
                return inner(x)

            TorchCompileWrapperWithCustomDispatcher.__init__(self, compiled, compilation_level=2)

        def forward(self, x):
            return x * self.scale

    spy = Spy(1.0)
    x = torch.randn(4, 16)
    torch.testing.assert_close(spy(x), x)
    assert len(seen) == 1 and len(spy.compiled_codes) == 1
    torch.testing.assert_close(seen[0].shape, torch.Size([4, 16]))
    with compilation_counter.expect(num_dispatched_calls=1, num_codes_captured=0):
        torch.testing.assert_close(spy(x[:3]), x[:3])


class CacheModel(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, cache=None):
        y = self.lin(x)
        return y if cache is None else y + cache


class MyWrapper(TorchCompileWrapperWithCustomDispatcher):
    """vLLM's wrapper-test pattern, word for word: the subclass builds its own compiled callable and
    overrides __call__, never calling anything private."""

    def __init__(self, model):
        self.model = model
        compiled_callable = torch.compile(self.forward, backend="eager")
        super().__init__(compiled_callable, compilation_level=CompilationLevel.DYNAMO_ONCE)

    def forward(self, x, cache=None):
        return self.model(x, cache)

    def __call__(self, x, cache=None):
        if len(self.compiled_codes) >= 2:
            with self.dispatch_to_code(0 if cache is None else 1):
                return self.forward(x, cache)
        return self.compiled_callable(x, cache)


def _frames_traced():
    return torch._dynamo.utils.counters["frames"]["total"]


@pytest.mark.parametrize("reset_between", [False, True])
def test_subclass_overriding_call_captures_and_dispatches(reset_between):
    """After w(x) and w(x, cache), each instance holds its two codes in compile order, and later calls
    run them with no Dynamo involved (even with Dynamo's caches dropped)."""
    wrappers = []
    for seed in range(3):  # several instances alive at once
        if reset_between:
            torch._dynamo.reset()
        w = MyWrapper(CacheModel(seed))
        x, cache = torch.randn(4, 8), torch.randn(4, 8)
        with compilation_counter.expect(num_codes_captured=2):
            torch.testing.assert_close(w(x), w.model(x))
            torch.testing.assert_close(w(x, cache), w.model(x, cache))
        assert len(w.compiled_codes) == 2
        wrappers.append(w)
    assert len({id(c) for w in wrappers for c in w.compiled_codes}) == 6  # each instance its own
    torch._dynamo.reset()  # a call that went through Dynamo would now trace again
    frames = _frames_traced()
    for w in wrappers:
        for n in (4, 2, 7):
            x, cache = torch.randn(n, 8), torch.randn(n, 8)
            torch.testing.assert_close(w(x), w.model(x))
            torch.testing.assert_close(w(x, cache), w.model(x, cache))
        assert len(w.compiled_codes) == 2
    assert _frames_traced() == frames
    assert MyWrapper.forward.__code__ is wrappers[0].original_code_object  # nothing left swapped


def test_subclass_compiled_callable_that_fails_leaves_nothing_registered_or_swapped():
    class Broken(torch.nn.Module):
        def forward(self, x, cache=None):
            raise RuntimeError("the model failed")

    hooks_before = len(compat.bytecode_hooks())
    w = MyWrapper(Broken())
    with pytest.raises(RuntimeError, match="the model failed"):
        w(torch.randn(4, 8))
    assert MyWrapper.forward.__code__ is w.original_code_object
    assert len(compat.bytecode_hooks()) == hooks_before and w.compiled_codes == []


def test_subclass_pattern_at_level_0_and_1():
    """Level 0: compiled_callable runs forward eagerly (Dynamo never runs); level 1: stock torch.compile,
    nothing captured."""
    for level, frames_delta in ((0, 0), (1, 1)):
        class AtLevel(MyWrapper):
            def __init__(self, model):
                self.model = model
                TorchCompileWrapperWithCustomDispatcher.__init__(
                    self, torch.compile(self.forward, backend="eager"), compilation_level=level)

        w = AtLevel(CacheModel(0))
        frames = _frames_traced()
        x = torch.randn(4, 8)
        torch.testing.assert_close(w(x), w.model(x))
        assert _frames_traced() - frames == frames_delta and w.compiled_codes == []


def test_user_compiled_callable():
    class Custom(TorchCompileWrapperWithCustomDispatcher, torch.nn.Module):
        def __init__(self):
            torch.nn.Module.__init__(self)
            TorchCompileWrapperWithCustomDispatcher.__init__(
                self, compiled_callable=torch.compile(self.forward, backend="eager", fullgraph=True),
                compilation_level=2)

        def forward(self, x):
            return x.sin() + 1

    m = Custom()
    x = torch.randn(5)
    torch.testing.assert_close(m(x), x.sin() + 1)
    assert len(m.compiled_codes) == 1
    y = torch.randn(3)
    with compilation_counter.expect(num_dispatched_calls=1):
        torch.testing.assert_close(m(y), y.sin() + 1)


def test_guard_filter_mode_stays_in_dynamo_and_refuses_recompiles():
    with set_compilation_config(CompilationConfig(level=2, use_bytecode_hook=False)):
        net = Net(1.0)
    assert not net.use_custom_dispatcher and net.compilation_level == CompilationLevel.DYNAMO_ONCE
    x = torch.randn(6, 16)
    torch.testing.assert_close(net(x), eager(net, x))
    net.scale = 5.0  # stock Dynamo would recompile on this; with every guard dropped it does not
    with compilation_counter.expect(num_graphs_seen=0, num_dispatched_calls=0):
        torch.testing.assert_close(net(torch.randn(3, 16)).shape, torch.Size([3, 16]))
    torch._dynamo.reset()  # drop the cache entry: the next call must trace again, which is refused
    with pytest.raises(RecompileError, match="Net.forward"), compilation_counter.expect(num_recompiles=1):
        net(x)


def test_bad_level_argument():
    with pytest.raises(ValueError, match="compilation level"):
        Net(1.0, level=9)
