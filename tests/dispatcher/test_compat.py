"""Each version-dependent path of dispatcher.compat."""

import functools
import types

import pytest
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


class _Recorder(compat.custom_graph_pass_class()):
    """A post-grad pass that keeps the call targets of each graph it is given."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph):
        self.graphs.append([n.target for n in graph.nodes if n.op == "call_function"])

    def uuid(self):
        return None  # no FX graph cache: every compile runs the pass


def test_post_grad_pass_option_gets_the_aten_graph():
    rec = _Recorder()
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    compat.inductor_compile(gm, [torch.randn(5)], {compat.POST_GRAD_PASS_OPTION: rec})
    assert rec.graphs == [[torch.ops.aten.relu.default, torch.ops.aten.mul.Tensor]]


def test_register_replacement_rewrites_each_match_with_a_scalar_argument():
    def search(x, c):
        return torch.relu(x) * c

    def replace(x, c):
        return torch.clamp_min(x, 0.0) * c

    patterns = compat.pattern_matcher_pass("test_relu_scale")
    compat.register_replacement(search, replace, [torch.empty(4), 0.5], patterns, {"c": 0.5},
                                extra_check=lambda match: match.kwargs["x"].meta["val"].dim() == 1)
    gm = compat.trace_inference_graph(lambda x, y: (torch.relu(x) * 3.0, torch.relu(y) * 3.0),
                                      [torch.randn(4), torch.randn(2, 2)])
    assert patterns.apply(gm.graph) == 1  # the 2-D input is refused by extra_check
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.clamp_min.default) == 1 and targets.count(torch.ops.aten.relu.default) == 1
    gm.recompile()
    x, y = torch.randn(4), torch.randn(2, 2)
    for got, want in zip(gm(x, y), (torch.relu(x) * 3.0, torch.relu(y) * 3.0)):
        torch.testing.assert_close(got, want)


def test_statically_equal_decides_without_a_guard():
    seen = []

    def backend(gm, example_inputs):
        mode = compat.fake_mode_of(example_inputs)
        (x,) = [mode.from_tensor(t) for t in example_inputs if isinstance(t, torch.Tensor)]
        env = mode.shape_env
        guards = len(env.guards)
        seen.append((compat.statically_equal(x.shape, x.shape), compat.statically_equal(x.shape, (6, 3)),
                     compat.statically_equal(x.shape[1:], (3,)), compat.statically_equal(x.shape, (6,))))
        assert len(env.guards) == guards
        return gm.forward

    x = torch.randn(6, 3)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(lambda x: x * 2, backend=backend)(x)
    # a symbolic size equals itself; 6 is one value it may take, not all: unknown, so False
    assert seen == [(True, False, True, False)]


def test_fresh_inductor_cache_and_cache_counts():
    def f(x):
        return torch.sin(x) + 1

    x = torch.randn(7)
    with compat.fresh_inductor_cache():
        hits, misses = compat.fx_graph_cache_counts()
        torch.compile(f, backend="inductor")(x)
        assert compat.fx_graph_cache_counts() == (hits, misses + 1)  # an empty cache
        torch._dynamo.reset()
        torch.compile(f, backend="inductor")(x)
        assert compat.fx_graph_cache_counts() == (hits + 1, misses + 1)


@functools.cache
def _twice_op():
    @torch.library.triton_op("dynamo_once_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2  # a body without a kernel: decomposed, it is one aten.mul

    return twice


def test_triton_ops_decomposed_switch():
    pytest.importorskip("triton")
    _twice_op()

    def targets(decomposed):
        rec = _Recorder()
        torch._dynamo.reset()
        with compat.triton_ops_decomposed(decomposed):
            torch.compile(lambda x: torch.ops.dynamo_once_test.twice(x) + 1, backend="inductor",
                          options={compat.POST_GRAD_PASS_OPTION: rec})(torch.randn(3))
        return rec.graphs[0]

    assert targets(True) == [torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor]
    assert targets(False) == [torch.ops.dynamo_once_test.twice.default, torch.ops.aten.add.Tensor]


def test_is_real_tensor_sees_through_functionalize_and_fakes():
    """A body traced by ``compat.decompose_triton_ops`` (``torch.func.functionalize``) must not take its inputs
    for real tensors (a launch option such as PDL would be traced into the graph): the functionalize wrapper is
    a plain ``torch.Tensor`` to ``type()``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []
    torch.func.functionalize(lambda t: seen.append(compat.is_real_tensor(t)) or t.clone())(torch.randn(3))
    with FakeTensorMode():
        fake = torch.empty(3)
    assert compat.is_real_tensor(torch.randn(3)) and seen == [False] and not compat.is_real_tensor(fake)


def test_inductor_emits_a_user_kernels_triton_meta_as_the_pdl_hook_expects():
    """``launch_user_kernels_with_pdl`` rewrites the ``triton_meta={...}`` of the ``user_autotune`` decorator Inductor
    writes for a user-defined kernel and passes to ``define_kernel``: a torch that writes it otherwise fails here."""
    import inspect
    import re

    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    define = PythonWrapperCodegen.define_user_defined_triton_kernel
    source = inspect.getsource(getattr(define, "__wrapped__", define))
    # torch 2.11 / 2.13: {triton_meta!r}; 2.14: {sanitized_triton_meta!r} (Enums made printable): a dict's repr either way
    assert re.search(r"triton_meta=\{\w*triton_meta!r\}", source) and "self.define_kernel(" in source
    assert source.count(compat._PDL_META) == 1


def _stub_define(self, kernel, configs, kwargs, *rest):
    """Inductor's codegen of a user kernel, as far as the hook sees it: one define_kernel call, then the metas."""
    meta = {"constants": {"PDL": kwargs.get("PDL")}}
    self.define_kernel("k_0", f"@user_autotune(configs=[], triton_meta={meta!r}, filename=__file__)\n", "# meta")
    return "k_0", meta, {}, []


def _kernel_of(module: str):
    fn = types.FunctionType(compile("def f(): pass", module, "exec").co_consts[0], {"__name__": module})
    return types.SimpleNamespace(fn=types.SimpleNamespace(fn=fn))  # a JITFunction's .fn, under an Autotuner's


@pytest.mark.parametrize("module,pdl,inductor_pdl,expected", [
    ("ops.norm_quant", True, True, True), ("ops.norm_quant", False, True, False),
    ("ops.norm_quant", True, False, False), ("someone_else.kernels", True, True, False),
])
def test_user_kernels_of_a_registered_package_launch_with_pdl(monkeypatch, module, pdl, inductor_pdl, expected):
    import torch._inductor.config as inductor_config
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    monkeypatch.setattr(PythonWrapperCodegen, "define_user_defined_triton_kernel", _stub_define)
    compat.launch_user_kernels_with_pdl("ops")
    compat.launch_user_kernels_with_pdl("ops")  # idempotent: one wrapper
    define = PythonWrapperCodegen.define_user_defined_triton_kernel
    assert define.__wrapped__ is _stub_define
    class Wrapper:
        def __init__(self):
            self.codes = []

        def define_kernel(self, name, code, metadata):
            self.codes.append(code)

    wrapper = Wrapper()
    monkeypatch.setattr(inductor_config.triton, "enable_pdl", inductor_pdl, raising=False)
    _, triton_meta, _, _ = define(wrapper, _kernel_of(module), [], {"PDL": pdl}, [], [], [[1]])
    assert ("triton_meta={'launch_pdl': True, 'constants'" in wrapper.codes[0]) is expected
    assert triton_meta.get("launch_pdl", False) is expected
    assert "define_kernel" not in vars(wrapper)  # the class's method again


@pytest.mark.parametrize("module,pdl,analyzed_pdl", [
    ("ops.norm_quant", True, False), ("ops.norm_quant", False, False), ("someone_else.kernels", True, True),
])
def test_inductor_analyzes_a_registered_kernels_pdl_form_as_its_plain_form(monkeypatch, module, pdl, analyzed_pdl):
    """Inductor's TTIR analysis of a user kernel's reads and writes does not know the PDL form's inline assembly (it
    took every tensor as written, and the compile then failed): the hook hands it the kernel's ``PDL`` off form."""
    from torch._higher_order_ops import triton_kernel_wrap

    name = next(n for n in compat._ACCESS_ANALYSES if hasattr(triton_kernel_wrap, n))  # a torch without one fails
    seen = []
    monkeypatch.setattr(triton_kernel_wrap, name, lambda kernel, kwargs, tma: seen.append(kwargs) or ["out"])
    assert compat.launch_user_kernels_with_pdl("ops") and compat.launch_user_kernels_with_pdl("ops")
    analyze = getattr(triton_kernel_wrap, name)
    assert not getattr(analyze.__wrapped__, "_dynamo_once_pdl", False)  # one wrapper
    kwargs = {"x_ptr": object(), "PDL": pdl}
    assert analyze(_kernel_of(module), kwargs, {}) == ["out"]
    assert seen == [{**kwargs, "PDL": analyzed_pdl}] and kwargs["PDL"] is pdl  # the caller's kwargs untouched
