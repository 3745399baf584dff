"""@support_torch_compile and @compile_once: level semantics, dynamic dims, signatures."""

import inspect
from typing import Optional

import pytest
import torch

from dispatcher import (
    TorchCompileWrapperWithCustomDispatcher,
    compilation_counter,
    compile_once,
    dispatcher_of,
    support_torch_compile,
)


@support_torch_compile
class MLP(torch.nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = self.down(torch.nn.functional.silu(self.up(x)))
        return y if residual is None else y + residual


def mlp_eager(m, x, residual=None):
    y = m.down(torch.nn.functional.silu(m.up(x)))
    return y if residual is None else y + residual


def test_decorated_class_is_the_same_class_with_the_mixin():
    assert MLP.__name__ == "MLP" and issubclass(MLP, TorchCompileWrapperWithCustomDispatcher)
    assert MLP._dynamo_once_dynamic_arg_dims == {"x": [0], "residual": [0]}


def test_decorated_module_is_still_an_ordinary_module(level):
    with level(2):
        m = MLP()
    m(torch.randn(4, 16))
    assert [name for name, _ in m.named_modules()] == ["", "up", "down"]
    assert set(m.state_dict()) == {"up.weight", "up.bias", "down.weight", "down.bias"}
    m.to(torch.float64).to(torch.float32)  # walks children: must not recurse into the dispatcher


@pytest.mark.parametrize("lvl", [0, 1, 2, 3])
def test_levels_agree_with_eager(level, lvl):
    with level(lvl):
        m = MLP()
    assert m.compilation_level == lvl
    for n in (8, 3, 1, 33):
        x = torch.randn(n, 16)
        torch.testing.assert_close(m(x), mlp_eager(m, x), rtol=1e-5, atol=1e-5)


def test_level_read_at_construction(level):
    with level(0):
        m0 = MLP()
    with level(2):
        m2 = MLP()
    x = torch.randn(4, 16)
    with compilation_counter.expect(num_graphs_seen=1):
        m0(x), m2(x)
    assert m0.compiled_codes == [] and len(m2.compiled_codes) == 1


def test_level_from_environment(monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_LEVEL", "dynamo_once")
    m = MLP()
    m(torch.randn(4, 16))
    assert len(m.compiled_codes) == 1 and m.use_custom_dispatcher


def test_traced_once_for_every_size_including_decode(level):
    with level(2):
        m = MLP()
    with compilation_counter.expect(num_graphs_seen=1, num_dispatched_calls=5):
        for n in (16, 1, 2, 7, 1000, 1):
            x = torch.randn(n, 16)
            torch.testing.assert_close(m(x), mlp_eager(m, x), rtol=1e-5, atol=1e-5)


def test_optional_tensor_argument_traced_with_tensor(level):
    with level(2):
        m = MLP()
    x, r = torch.randn(5, 16), torch.randn(5, 16)
    torch.testing.assert_close(m(x, r), mlp_eager(m, x, r), rtol=1e-5, atol=1e-5)
    x, r = torch.randn(2, 16), torch.randn(2, 16)
    torch.testing.assert_close(m(x, residual=r), mlp_eager(m, x, r), rtol=1e-5, atol=1e-5)


def test_explicit_dynamic_arg_dims(level):
    @support_torch_compile(dynamic_arg_dims={"x": 0, "y": [0, 1]})
    class Outer(torch.nn.Module):
        def forward(self, x, y):
            return x.sum(-1, keepdim=True) * y.mean(-1, keepdim=True)

    with level(2):
        m = Outer()
    for (a, b, c) in [(4, 3, 6), (2, 3, 9), (7, 3, 2)]:
        x, y = torch.randn(a, b), torch.randn(a, c)
        torch.testing.assert_close(m(x, y), x.sum(-1, keepdim=True) * y.mean(-1, keepdim=True))
    assert len(m.compiled_codes) == 1


def test_decoration_errors():
    with pytest.raises(ValueError, match=r"dynamic_arg_dims names 'z'.*\['x'\]"):
        @support_torch_compile(dynamic_arg_dims={"z": 0})
        class A(torch.nn.Module):
            def forward(self, x):
                return x

    with pytest.raises(ValueError, match="annotated torch.Tensor"):
        @support_torch_compile
        class B(torch.nn.Module):
            def forward(self, x):
                return x

    with pytest.raises(TypeError, match="nn.Module subclass"):
        support_torch_compile(object)

    with pytest.raises(ValueError, match=r"dynamic_arg_dims\['x'\] must be"):
        support_torch_compile(dynamic_arg_dims={"x": "0"})(MLP)


def test_bad_dynamic_dim_for_rank_is_named(level):
    @support_torch_compile(dynamic_arg_dims={"x": 3})
    class C(torch.nn.Module):
        def forward(self, x):
            return x + 1

    with level(2):
        m = C()
    with pytest.raises(ValueError, match=r"dynamic_arg_dims\['x'\] has dim 3.*2-d"):
        m(torch.randn(4, 4))


def test_first_call_with_size_one_on_dynamic_dim_is_refused(level):
    with level(3):
        m = MLP()
    with pytest.raises(ValueError, match=r"dynamic dim 0 of argument 'x' has size 1.*size >= 2"):
        m(torch.randn(1, 16))


def test_inside_outer_compile_calls_forward_directly(level):
    with level(2):
        inner = MLP()

    def outer(x):
        return inner(x) * 2

    x = torch.randn(4, 16)
    compiled = torch.compile(outer, backend="eager", fullgraph=True)
    with compilation_counter.expect(num_models_seen=0, num_dispatched_calls=0):
        torch.testing.assert_close(compiled(x), mlp_eager(inner, x) * 2, rtol=1e-5, atol=1e-5)
    assert inner.compiled_codes == []


def test_compile_once_function(level):
    @compile_once
    def scaled_softmax(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        """Softmax of x * scale."""
        return torch.softmax(x * scale, dim=-1)

    assert scaled_softmax.__doc__ == "Softmax of x * scale."
    assert scaled_softmax.__name__ == "scaled_softmax"
    assert list(inspect.signature(scaled_softmax).parameters) == ["x", "scale"]
    with level(2):
        with compilation_counter.expect(num_graphs_seen=1, num_dispatched_calls=2):
            for n in (5, 2, 9):
                x = torch.randn(n, 7)
                torch.testing.assert_close(scaled_softmax(x), torch.softmax(x * 2.0, dim=-1))


def test_compile_once_method_one_capture_per_instance(level):
    class Scaler:
        def __init__(self, k):
            self.k = k

        @compile_once(dynamic_arg_dims={"x": 0})
        def apply(self, x):
            """Multiply by k."""
            return x * self.k + 1

    assert Scaler.apply.__doc__ == "Multiply by k."
    with level(2):
        a, b = Scaler(2.0), Scaler(-3.0)
        with compilation_counter.expect(num_graphs_seen=2, num_codes_captured=2, num_dispatched_calls=2):
            x = torch.randn(4, 3)
            torch.testing.assert_close(a.apply(x), x * 2 + 1)
            torch.testing.assert_close(b.apply(x), x * -3 + 1)
            y = torch.randn(6, 3)
            torch.testing.assert_close(a.apply(y), y * 2 + 1)
            torch.testing.assert_close(b.apply(y), y * -3 + 1)
    assert len(dispatcher_of(a, "apply").compiled_codes) == 1
    assert dispatcher_of(a, "apply") is not dispatcher_of(b, "apply")


@pytest.mark.parametrize("lvl", [0, 1])
def test_compile_once_low_levels(level, lvl):
    @compile_once
    def f(x):
        return x + 1

    with level(lvl):
        # Level 0 never reaches Dynamo; level 1 traces once (dim 0 dynamic) and keeps Dynamo's guards.
        with compilation_counter.expect(num_graphs_seen=lvl, num_dispatched_calls=0):
            for n in (3, 4):
                torch.testing.assert_close(f(torch.zeros(n)), torch.ones(n))


def test_compile_once_rejects_non_functions():
    with pytest.raises(TypeError, match="Python function"):
        compile_once(torch.relu)
