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
