"""Each version-dependent path of dispatcher.compat."""

import types

import torch

from dispatcher import compat


def test_version_parsed():
    assert compat.TORCH_VERSION >= (2, 11)
    assert compat._parse_version("2.11.0+cu130") == (2, 11)
    assert compat._parse_version("2.13.0.dev20260101") == (2, 13)


def test_source_name_method_and_property():
    class Old:
        def name(self):
            return "L['x'].size()[0]"

    class New:
        name = "L['x'].size()[0]"

    assert compat.source_name(Old()) == compat.source_name(New()) == "L['x'].size()[0]"


def test_bytecode_hook_registration_roundtrip():
    seen = []

    def hook(old, new):
        seen.append((old, new))

    before = len(compat.bytecode_hooks())
    with compat.compile_lock():
        handle = compat.register_bytecode_hook(hook)
    try:
        def f(x):
            return x + 1

        torch.compile(f, backend="eager")(torch.ones(2))
        assert seen and seen[0][0] is f.__code__ and isinstance(seen[0][1], types.CodeType)
    finally:
        handle.remove()
    assert len(compat.bytecode_hooks()) == before


def test_current_shape_env_inside_backend_only():
    envs = []

    def backend(gm, example_inputs):
        envs.append(compat.current_shape_env())
        return gm.forward

    assert compat.current_shape_env() is None
    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(3))
    assert envs and envs[0] is not None and hasattr(envs[0], "guards")


def test_is_graph_break():
    try:
        torch.compile(lambda x: print(x) or x, backend="eager", fullgraph=True)(torch.ones(1))
    except Exception as e:  # noqa: BLE001
        assert compat.is_graph_break(e)
    else:  # pragma: no cover
        raise AssertionError("print did not break the graph")
    assert not compat.is_graph_break(ValueError("x"))


def test_tensor_guards_check_sizes_dtype_device_not_dynamic_dims():
    x = torch.randn(8, 16)
    check = compat.tensor_guards([x], [[0]])
    assert check is not None  # every supported torch has TensorGuards
    assert check(torch.randn(3, 16)) and check(x)
    assert not check(torch.randn(3, 17))
    assert not check(torch.randn(3, 16, dtype=torch.float64))
    assert not check(torch.randn(3, 16, device="meta"))
    assert not check(None)


def test_graph_break_found_anywhere_in_the_chain():
    try:
        torch.compile(lambda x: print(x) or x, backend="eager", fullgraph=True)(torch.ones(1))
    except Exception as e:  # noqa: BLE001
        brk = e
    try:
        try:
            raise brk
        except Exception as inner:
            raise RuntimeError("a backend failed") from inner
    except RuntimeError as outer:
        assert compat.graph_break_in_chain(outer) is brk
    assert compat.graph_break_in_chain(RuntimeError("plain")) is None


def test_inductor_compile_and_lookup_backend_compile_a_graph():
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    x = torch.randn(5)
    eager_fn = compat.lookup_backend("eager")(gm, [x])
    torch.testing.assert_close(eager_fn(x), torch.relu(x) * 2)
    compiled = compat.inductor_compile(gm, [x], {})
    out = compiled(x)
    torch.testing.assert_close(out[0] if isinstance(out, (tuple, list)) else out, torch.relu(x) * 2)


def test_fake_mode_of_finds_the_traces_mode_or_makes_one():
    modes = []

    def backend(gm, example_inputs):
        modes.append(compat.fake_mode_of(example_inputs))
        with modes[-1], compat.python_dispatcher():
            fakes = [modes[-1].from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
            out = gm(*fakes)[0]
            assert isinstance(out.shape[0], torch.SymInt)  # ran on the trace's symbolic sizes
        return gm.forward

    x = torch.randn(6, 2)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(lambda x: (x * 2,), backend=backend)(x)
    assert modes[0] is not None and modes[0].shape_env is not None  # the trace's own, with its symbols
    assert compat.fake_mode_of([torch.ones(1)]) is not None  # real tensors: a new mode


def test_is_static_input_parameters_and_flagged_buffers():
    lin = torch.nn.Linear(2, 2)
    assert compat.is_static_input(lin.weight)
    assert not compat.is_static_input(torch.ones(2))
    seen = []

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.ones(3))

        def forward(self, x):
            return x + self.b

    def backend(gm, example_inputs):
        seen.extend(compat.is_static_input(t) for t in example_inputs if isinstance(t, torch.Tensor))
        return gm.forward

    torch.compile(M(), backend=backend)(torch.ones(3))
    assert sorted(seen) == [False, True]  # the input moves; the module's buffer is flagged static
