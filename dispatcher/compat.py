"""Every use of Dynamo internals goes through here (torch 2.11 .. 2.13 and later).

Each function names the private API it relies on, so that a torch upgrade
that moves one breaks a single place; tests/dispatcher/test_compat.py covers
each version-dependent path.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

__all__ = [
    "TORCH_VERSION",
    "BytecodeHook",
    "register_bytecode_hook",
    "compile_lock",
    "current_shape_env",
    "source_name",
    "is_graph_break",
    "mark_dynamic",
    "is_compiling",
    "tracing_on_this_thread",
    "graph_break_in_chain",
    "inductor_compile",
    "lookup_backend",
    "fake_mode_of",
    "python_dispatcher",
    "is_static_input",
    "reset",
    "POST_GRAD_PASS_OPTION",
    "inductor_pdl_option",
    "custom_graph_pass_class",
    "pattern_matcher_pass",
    "register_replacement",
    "pattern_expressions",
    "register_graph_pattern",
    "replace_op_calls",
    "replace_match",
    "outside_compile",
    "trace_inference_graph",
    "statically_equal",
    "fresh_inductor_cache",
    "triton_ops_decomposed",
    "fx_graph_cache_counts",
    "save_cache_artifacts",
    "load_cache_artifacts",
    "triton_version",
    "symm_mem_buffer",
    "aot_available",
    "new_fake_mode",
    "symbols_of",
    "make_symint",
    "SymbolNameMismatch",
    "tracing_with",
    "op_name",
    "materialize",
    "quick_graph_captures",
    "dynamo_disable",
]


def _parse_version(v: str) -> tuple[int, int]:
    major, minor = v.split("+")[0].split(".")[:2]
    return int(major), int(minor)


TORCH_VERSION: tuple[int, int] = _parse_version(torch.__version__)

BytecodeHook = Callable[[types.CodeType, types.CodeType], "types.CodeType | None"]


def register_bytecode_hook(hook: BytecodeHook) -> Any:
    """``torch._dynamo.convert_frame.register_bytecode_hook``; returns a RemovableHandle."""
    from torch._dynamo.convert_frame import register_bytecode_hook as _register

    return _register(hook)


@contextlib.contextmanager
def compile_lock() -> Iterator[None]:
    """Dynamo's compile lock (``convert_frame.compile_lock``), held while Dynamo runs bytecode hooks.

    Adding or removing a hook under it means no other thread is iterating
    Dynamo's hook dict at that moment.
    """
    from torch._dynamo import convert_frame

    lock = getattr(convert_frame, "compile_lock", None)
    if lock is None:  # pragma: no cover - every supported torch has it
        yield
        return
    with lock:
        yield


def current_shape_env() -> Any | None:
    """The ShapeEnv of the trace being compiled, from inside a backend (None outside one)."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    if ctx is None or ctx.fake_mode is None:
        return None
    return ctx.fake_mode.shape_env


def source_name(source: Any) -> str:
    """A guard source's Python expression, e.g. ``L['x'].size()[0]``.

    ``Source.name`` is a method up to torch 2.12 and a property from 2.13.
    """
    name = source.name
    return name() if callable(name) else name


def is_graph_break(exc: BaseException) -> bool:
    """Whether ``exc`` is Dynamo refusing to trace (a graph break under fullgraph=True)."""
    from torch._dynamo import exc as dynamo_exc

    return isinstance(exc, (dynamo_exc.Unsupported, dynamo_exc.UserError))


def graph_break_in_chain(exc: BaseException) -> BaseException | None:
    """The first exception in ``exc``'s cause/context chain that is a Dynamo graph break, or None.

    Under ``fullgraph=True`` Dynamo may wrap its ``Unsupported`` in another error (a backend
    failure, a user error), so the whole chain is searched.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        if is_graph_break(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list[Any],
                     options: dict[str, Any]) -> Callable[..., Any]:
    """Inductor's ``torch._inductor.compile_fx.compile_fx`` with ``options`` as config patches."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=options)


def lookup_backend(name: str) -> Callable[..., Any]:
    """A registered Dynamo backend by name (``torch._dynamo.lookup_backend``)."""
    return torch._dynamo.lookup_backend(name)


def fake_mode_of(example_inputs: list[Any]) -> Any:
    """The FakeTensorMode of a backend's example inputs (``torch._guards.detect_fake_mode``), else a new one."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode(example_inputs) or FakeTensorMode()


def python_dispatcher() -> contextlib.AbstractContextManager[None]:
    """``torch._dispatch.python.enable_python_dispatcher``: needed to run a graph with symbolic shapes."""
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher()


def is_static_input(t: torch.Tensor) -> bool:
    """Whether Dynamo passed ``t`` as a graph input that never moves: a parameter, or a buffer Dynamo
    flagged static (``_dynamo_static_input_type``, set on module buffers it lifts)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


def reset() -> None:
    """Drop every compiled frame Dynamo caches (``torch._dynamo.reset``), e.g. between benchmark cases."""
    torch._dynamo.reset()


def mark_dynamic(t: torch.Tensor, dims: list[int]) -> None:
    torch._dynamo.mark_dynamic(t, dims)


@torch._dynamo.assume_constant_result
def tracing_on_this_thread() -> bool:
    """Whether this thread is inside a Dynamo trace (TracingContext and CompileContext are thread-local)."""
    from torch._guards import CompileContext, TracingContext

    return TracingContext.try_get() is not None or CompileContext.try_get() is not None


def is_compiling() -> bool:
    """``torch.compiler.is_compiling()``, but true only on the thread being traced.

    torch's flag is process-wide: while one thread compiles, another thread's
    eager call would see it set (seen on torch 2.13) and take the path meant
    for an outer trace. Dynamo folds both calls to True while tracing.
    """
    return torch.compiler.is_compiling() and tracing_on_this_thread()


def bytecode_hooks() -> list[Any]:
    """The hooks Dynamo will call (``convert_frame._bytecode_hooks``), for leak tests."""
    from torch._dynamo import convert_frame

    return list(getattr(convert_frame, "_bytecode_hooks", {}).values())


def tensor_guards(tensors: list[torch.Tensor], dynamic: list[list[int]]) -> Callable[..., bool] | None:
    """Dynamo's C++ tensor check (``torch._C._dynamo.guards.TensorGuards``), ~0.1 µs a tensor.

    ``check(*tensors)`` is true when each tensor has the example's type,
    dispatch keys (so also requires_grad / inference mode), dtype, device and
    sizes, ``dynamic[i]`` dims excepted; strides are not compared. Returns
    None where this torch lacks it; callers then check in Python.
    """
    try:
        from torch._C._dynamo.guards import TensorGuards

        sizes = [[None if d in dyn else s for d, s in enumerate(t.shape)] for t, dyn in zip(tensors, dynamic)]
        strides = [[None] * t.dim() for t in tensors]
        guards = TensorGuards(*tensors, dynamic_dims_sizes=sizes, dynamic_dims_strides=strides)
        if not guards.check(*tensors):  # pragma: no cover - would mean the API changed meaning
            return None
        return guards.check
    except Exception:  # pragma: no cover - a torch without it, or with another signature
        return None


#: The Inductor option (a config patch) holding the pass run after Inductor's own post-grad passes: a
#: ``CustomGraphPass`` called with the functionalized, normalized aten graph of each compile.
POST_GRAD_PASS_OPTION = "post_grad_custom_post_pass"


def inductor_pdl_option() -> str | None:
    """The Inductor option that launches its Triton kernels with programmatic dependent launch on Hopper and
    newer (``triton.enable_pdl``: each kernel waits for the one before ahead of its first dependent load, and lets
    the next launch after its loads), or None where this torch has none."""
    import torch._inductor.config as inductor_config

    return "triton.enable_pdl" if hasattr(inductor_config.triton, "enable_pdl") else None


def inductor_pdl_enabled() -> bool:
    """Whether Inductor's programmatic dependent launch is on in its current config: during a compile, the option as
    that compile's config patches set it (``inductor_pdl_option``); False where this torch has none."""
    import torch._inductor.config as inductor_config

    return bool(getattr(inductor_config.triton, "enable_pdl", False))


#: Packages whose user-defined Triton kernels ``launch_user_kernels_with_pdl`` takes.
_PDL_KERNEL_PACKAGES: set[str] = set()
_PDL_META = "triton_meta={"


def launch_user_kernels_with_pdl(package: str) -> bool:
    """Have Inductor launch the Triton kernels of ``package``'s modules that it runs as user-defined kernels (a
    ``torch.library.triton_op`` decomposed into its kernels) with programmatic dependent launch, where such a launch
    passes the kernel's ``PDL`` constexpr as True and Inductor's own PDL option is on in the compile.

    Inductor's generated code launches a user kernel with the launch options its ``triton_meta`` holds, and gives
    ``launch_pdl`` to its own kernels only (``wrap_triton`` forwards ``num_warps`` and the like but not it: torch
    2.11-2.14). A kernel with ``PDL`` on waits for the kernel before ahead of any global memory access and lets the next
    launch (the library's kernels' contract), so launched early it is correct, and the kernels on either side of it
    overlap their launches with it as Inductor's own do. Idempotent; applies to compiles from then on.

    Returns whether Inductor can take such kernels: False where its analysis of a user kernel's reads and writes
    cannot be told to read the kernel's plain form (:func:`_analyze_pdl_kernels_as_plain`); the caller then traces
    the plain form."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    if not _analyze_pdl_kernels_as_plain():
        return False
    _PDL_KERNEL_PACKAGES.add(package)
    define = PythonWrapperCodegen.define_user_defined_triton_kernel
    if getattr(define, "_dynamo_once_pdl", False):
        return True

    @functools.wraps(define)
    def define_with_pdl(self: Any, kernel: Any, configs: Any, kwargs: dict[str, Any], *args: Any, **kw: Any) -> Any:
        if not _takes_pdl(kernel, kwargs):
            return define(self, kernel, configs, kwargs, *args, **kw)
        define_kernel, own = self.define_kernel, vars(self).get("define_kernel")

        def with_launch_pdl(name: str, code: str, *a: Any, **k: Any) -> Any:  # the user_autotune decorator's meta
            return define_kernel(name, code.replace(_PDL_META, _PDL_META + "'launch_pdl': True, ", 1), *a, **k)

        self.define_kernel = with_launch_pdl
        try:
            name, triton_meta, inductor_meta, extra = define(self, kernel, configs, kwargs, *args, **kw)
        finally:  # the method as it was (the class's, or one set on the instance)
            if own is None:
                del self.define_kernel
            else:
                self.define_kernel = own
        triton_meta["launch_pdl"] = True
        return name, triton_meta, inductor_meta, extra

    define_with_pdl._dynamo_once_pdl = True  # type: ignore[attr-defined]
    PythonWrapperCodegen.define_user_defined_triton_kernel = define_with_pdl  # type: ignore[method-assign]
    return True


#: The function Inductor analyzes a user kernel's TTIR with, for which tensors it reads and writes: torch 2.11-2.14.
_ACCESS_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")


def _analyze_pdl_kernels_as_plain() -> bool:
    """Have Inductor analyze a registered package's kernel launched with ``PDL`` on as its ``PDL`` off form.

    The PDL form's wait and launch trigger are Triton inline assembly with side effects (``gdc_wait``,
    ``gdc_launch_dependents``), which Inductor's TTIR analysis of a user kernel does not know: it gave up and took
    every tensor argument as written, and a compile with such a kernel then failed in Inductor's scheduler (torch 2.11,
    ``KeyError`` in ``compute_ancestors``). Both forms make the same loads and stores (the PDL form only waits
    before them), so the plain form's analysis is the PDL form's. False where no analysis of a known name exists."""
    from torch._higher_order_ops import triton_kernel_wrap

    for name in _ACCESS_ANALYSES:
        analyze = getattr(triton_kernel_wrap, name, None)
        if analyze is not None:
            break
    else:
        return False
    if getattr(analyze, "_dynamo_once_pdl", False):
        return True

    @functools.wraps(analyze)
    def analyze_plain(kernel: Any, kwargs: dict[str, Any], *args: Any, **kw: Any) -> Any:
        if kwargs.get("PDL") is True and _in_pdl_package(kernel):
            kwargs = {**kwargs, "PDL": False}
        return analyze(kernel, kwargs, *args, **kw)

    analyze_plain._dynamo_once_pdl = True  # type: ignore[attr-defined]
    setattr(triton_kernel_wrap, name, analyze_plain)
    return True


def _takes_pdl(kernel: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a user-defined kernel launch gets ``launch_pdl``: its ``PDL`` constexpr True, the kernel from a
    registered package, Inductor's PDL option on, and the Python wrapper (the C++ one launches otherwise)."""
    import torch._inductor.config as inductor_config

    if kwargs.get("PDL") is not True or not inductor_pdl_enabled() or inductor_config.cpp_wrapper:
        return False
    return _in_pdl_package(kernel)


def _in_pdl_package(kernel: Any) -> bool:
    """Whether a Triton kernel (a JITFunction, or an Autotuner over one) is a registered package's."""
    fn = kernel
    while hasattr(fn, "fn"):  # an Autotuner or a JITFunction, then the Python function
        fn = fn.fn
    module = getattr(fn, "__module__", "") or ""
    return any(module == p or module.startswith(p + ".") for p in _PDL_KERNEL_PACKAGES)


def custom_graph_pass_class() -> type:
    """``torch._inductor.custom_graph_pass.CustomGraphPass``: the base of a post-grad pass that Inductor's
    FX graph cache accepts, keyed on its ``uuid()`` (any other callable bypasses the cache)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def pattern_matcher_pass(name: str) -> Any:
    """An empty ``torch._inductor.pattern_matcher.PatternMatcherPass``; its ``apply(graph)`` rewrites every
    match of the patterns registered into it and returns how many it rewrote."""
    from torch._inductor.pattern_matcher import PatternMatcherPass

    return PatternMatcherPass(pass_name=name)


def register_replacement(search_fn: Callable[..., Any], replace_fn: Callable[..., Any], example_inputs: list[Any],
                         patterns: Any, scalars: dict[str, float] | None = None,
                         extra_check: Callable[[Any], bool] | None = None) -> None:
    """``pattern_matcher.register_replacement`` for inference graphs (traced with ``fwd_only``).

    ``search_fn`` and ``replace_fn`` are traced on ``example_inputs`` into aten graphs (Inductor's
    decompositions, and each ``view`` a ``reshape``, as its post-grad graphs have them: Inductor converts
    every view before its post-grad passes run); the argument names of ``search_fn`` are the match's keys.
    ``scalars`` names the float arguments (value: a stand-in used only to trace) that match any constant in a
    graph and reach ``replace_fn``. ``extra_check(match)`` may refuse a match; its ``match.kwargs`` are the
    matched nodes, whose ``meta["val"]`` are fake tensors.
    """
    from torch._inductor import pattern_matcher
    from torch._inductor.fx_passes.post_grad import remove_noop_ops, view_to_reshape

    casts = _joint_graph_cast_rewrites()

    def trace(fn: Callable[..., Any], args: Any, **kwargs: Any) -> torch.fx.GraphModule:
        gm = pattern_matcher.fwd_only(fn, args, **kwargs)
        # What Inductor's joint-graph rewrites leave of a chain of casts in a model's graph before any post-grad
        # pass sees it: torch 2.11 drops an fp32 -> bf16 -> fp32 round trip (``pointless_convert``), so the native
        # SiLU-and-mul's cast back to bf16 before a quantization is gone there, and must be here too (the
        # fp32 -> fp32 cast left in its place is a no-op, which Inductor removes as well).
        if casts.apply(gm.graph):
            remove_noop_ops(gm.graph)
            gm.graph.eliminate_dead_code()
            gm.recompile()
        view_to_reshape(gm)
        return gm

    pattern_matcher.register_replacement(search_fn, replace_fn, example_inputs, trace, patterns,
                                         extra_check=extra_check or (lambda match: True),
                                         scalar_workaround=scalars or {})


@functools.cache
def _joint_graph_cast_rewrites() -> Any:
    """A pattern pass of Inductor's joint-graph rewrites of cast chains (``pointless_convert``) alone: the other
    joint-graph rewrites are left out of a traced pattern (some trace replacements of their own, which a pattern's
    trace at match time, in the graph's fake mode, cannot)."""
    from torch._inductor.fx_passes import joint_graph
    from torch._inductor.pattern_matcher import PatternMatcherPass

    rewrites = PatternMatcherPass()
    handler = getattr(joint_graph, "pointless_convert", None)
    for key, entries in joint_graph.patterns.patterns.items():
        for entry in entries:
            if handler is not None and getattr(entry, "handler", None) is handler:
                rewrites.patterns[key].append(entry)
    return rewrites


def pattern_expressions() -> types.SimpleNamespace:
    """Inductor's pattern-matcher expressions (``torch._inductor.pattern_matcher``), for a pattern written node by
    node where a traced one cannot capture what its rewrite needs (a traced pattern ignores int arguments, e.g. a
    split's sizes): ``CallFunction(target, *args, _users=n)``, ``KeywordArg(name)`` (matches any argument and passes
    it to the handler by name), ``Ignored()``, ``MultiOutputPattern([...])``."""
    from torch._inductor import pattern_matcher as pm

    return types.SimpleNamespace(CallFunction=pm.CallFunction, KeywordArg=pm.KeywordArg, Ignored=pm.Ignored,
                                 MultiOutputPattern=pm.MultiOutputPattern)


def register_graph_pattern(pattern: Any, patterns: Any, handler: Callable[..., Any],
                           extra_check: Callable[[Any], bool] | None = None) -> None:
    """``pattern_matcher.register_graph_pattern``: ``handler(match, **keyword_args)`` rewrites each match of
    ``pattern`` (in ``patterns``, a ``PatternMatcherPass``) that ``extra_check(match)`` accepts, e.g. with
    :func:`replace_match`; the keyword arguments are the matched nodes, or the values of non-node arguments."""
    from torch._inductor import pattern_matcher

    pattern_matcher.register_graph_pattern(pattern, extra_check=extra_check or (lambda match: True),
                                           pass_dict=patterns)(handler)


def replace_match(match: Any, replace_fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """Replace a match's output nodes, in its pattern's output order, by ``replace_fn``'s results, traced on the
    values of ``args`` (nodes of the graph) as ``register_replacement`` traces a replacement (``Match.replace_by_example``)."""
    match.replace_by_example(replace_fn, list(args))


@contextlib.contextmanager
def outside_compile() -> Iterator[None]:
    """Code that traces its own graphs (patterns) run from inside an Inductor compile, as Inductor's lazily traced
    patterns are (``pattern_matcher.init_once_fakemode``): no tracing context, no active fake mode (real example
    tensors stay real), and Inductor's counters as they were before."""
    from torch._dynamo.utils import counters
    from torch._guards import tracing
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    saved = counters["inductor"].copy()
    try:
        with tracing(None), unset_fake_temporarily():
            yield
    finally:
        counters["inductor"] = saved


def match_output_values(match: Any) -> list[Any]:
    """The values (``meta["val"]``: fake tensors) of a pattern match's output nodes, in the search function's
    return order (None where a node has none)."""
    return [getattr(node, "meta", {}).get("val") for node in match.output_nodes()]


def trace_inference_graph(fn: Callable[..., Any], example_inputs: list[Any]) -> torch.fx.GraphModule:
    """``fn`` traced as ``register_replacement`` traces a pattern (``pattern_matcher.fwd_only``): the aten
    graph Inductor's post-grad passes see for it, for tests of a pass on a graph of its own."""
    from torch._inductor.pattern_matcher import fwd_only

    return fwd_only(fn, example_inputs)


def statically_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two shapes (ints or SymInts) are equal for every value of their symbols
    (``symbolic_shapes.statically_known_true``): False when not known, and no guard is added."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

    return len(a) == len(b) and bool(statically_known_true(sym_eq(tuple(a), tuple(b))))


def fresh_inductor_cache() -> contextlib.AbstractContextManager[Any]:
    """``torch._inductor.utils.fresh_cache`` (``fresh_inductor_cache`` before its rename): Inductor's
    on-disk caches in a temporary directory for the block, so every compile in it compiles."""
    from torch._inductor import utils

    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache
    return fresh()


def inductor_code(fn: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``fn()``'s result and the source of every module Inductor generated while it ran
    (``torch._inductor.utils.run_and_get_code``): what a compile launches, for tests that check its kernels."""
    from torch._inductor.utils import run_and_get_code

    return run_and_get_code(fn)


@contextlib.contextmanager
def triton_ops_decomposed(enabled: bool) -> Iterator[None]:
    """Whether AOTAutograd decomposes ``torch.library.triton_op`` ops into their bodies for the block
    (``torch._functorch.config.decompose_custom_triton_ops``, default True). Off, such an op stays one
    opaque node in the post-grad graph, as a ``custom_op`` without Triton does."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(decompose_custom_triton_ops=enabled):
        yield


def triton_op_names(namespace: str) -> frozenset[str]:
    """``"ns::name"`` of every ``torch.library.triton_op`` registered so far in ``namespace``."""
    from torch._library.triton import triton_ops_to_kernels

    return frozenset(n for n in triton_ops_to_kernels if n.startswith(f"{namespace}::"))


def decompose_triton_ops(graph: torch.fx.Graph, names: frozenset[str]) -> int:
    """Replace each call of a ``torch.library.triton_op`` named in ``names`` in a post-grad ``graph`` by its body
    traced as AOTAutograd decomposes it when ``triton_ops_decomposed`` is on: the op's Triton kernels as
    ``triton_kernel_wrapper_functional`` nodes (and the body's allocations), which Inductor launches from its
    generated code instead of calling the op through the dispatcher. Returns how many calls it replaced."""
    from torch._library.custom_ops import OPDEFS

    # triton_op registers its body as the fake kernel
    return replace_op_calls(graph, {n: OPDEFS[n]._abstract_fn for n in names if n in OPDEFS}, "decompose_triton_ops")


def replace_op_calls(graph: torch.fx.Graph, bodies: dict[str, Callable[..., Any]], name: str) -> int:
    """Replace each call of an op named in ``bodies`` (``"ns::op"``) in a post-grad ``graph`` by ``bodies[op]``
    traced (functionalized) on the call's arguments, with Inductor's pattern matcher (``name``: its pass's name).
    Returns how many calls it replaced."""
    from torch._inductor.pattern_matcher import CallFunctionVarArgs, register_graph_pattern
    from torch.utils import _pytree as pytree

    present = {n.target for n in graph.nodes if n.op == "call_function"
               and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.name in bodies}
    if not present:
        return 0
    patterns = pattern_matcher_pass(name)
    for overload in present:
        body = bodies[overload._schema.name]

        def replace(match: Any, *args: Any, body: Callable[..., Any] = body, **kwargs: Any) -> None:
            flat, spec = pytree.tree_flatten((args, kwargs))

            def run(*flat_args: Any) -> Any:
                a, k = pytree.tree_unflatten(list(flat_args), spec)
                return body(*a, **k)

            def decomposed(*flat_args: Any) -> Any:
                return torch.func.functionalize(run, remove="mutations_and_views")(*flat_args)

            # remove_noop_ops on the body, as Inductor ran it on the rest of the graph: a no-op view of a graph input
            # left in (the rotary op's positions.reshape(-1)) became a copy kernel for the Triton kernel's argument,
            # one more launch a layer (an H200 profile, level 3 with the custom ops on).
            match.replace_by_example(decomposed, flat, run_functional_passes=True)

        register_graph_pattern(CallFunctionVarArgs(overload), pass_dict=patterns)(replace)
    return patterns.apply(graph)


def is_real_tensor(x: torch.Tensor) -> bool:
    """Whether ``x`` holds real data: not a fake tensor, a tensor subclass, or the wrapper ``torch.func.functionalize``
    puts around a traced tensor (a plain ``torch.Tensor`` to ``type()``, so a body traced by
    ``decompose_triton_ops`` would otherwise take it for a real one)."""
    return type(x) is torch.Tensor and not torch._is_functional_tensor(x)


def cuda_device_getter(fallback: Callable[[], int]) -> Callable[[], int]:
    """A getter of the current CUDA device as an int: torch's C one (``torch.cuda.current_device`` without its Python
    wrapper and lazy-init check: ~0.5 µs less a call; a kernel launch on a CUDA tensor means CUDA is initialized), or
    ``fallback`` where this torch lacks it."""
    return getattr(torch._C, "_cuda_getDevice", None) or fallback


def abort_process_groups() -> None:
    """Abort every ``torch.distributed`` group of this process and forget them (the default one too), waiting for
    no other rank: ``distributed_c10d._abort_process_group()`` (torch >= 2.6: the NCCL communicators aborted
    together, in one NCCL group call), else each group's ``abort()`` and then ``destroy_process_group()``."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    abort_all = getattr(distributed_c10d, "_abort_process_group", None)
    if abort_all is not None:
        abort_all()
        return
    for pg in list(distributed_c10d._world.pg_map):
        if hasattr(pg, "abort"):
            pg.abort()
    dist.destroy_process_group()


def fx_graph_cache_counts() -> tuple[int, int]:
    """``(hits, misses)`` of Inductor's FX graph cache so far in this process (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def save_cache_artifacts() -> bytes | None:
    """``torch.compiler.save_cache_artifacts()``: every compile-cache artifact this process recorded so far
    (Inductor's FX graphs, AOTAutograd entries, autotuning results), serialized; None when there is none."""
    result = torch.compiler.save_cache_artifacts()
    return None if result is None else result[0]


def load_cache_artifacts(data: bytes) -> int:
    """``torch.compiler.load_cache_artifacts(data)``: put saved artifacts into this process's on-disk caches,
    so that compiles of the same graphs are FX-graph-cache hits; returns how many artifacts it loaded."""
    info = torch.compiler.load_cache_artifacts(data)
    artifacts = getattr(info, "artifacts", None) or {}
    return sum(len(v) for v in artifacts.values())


def triton_version() -> str:
    """Triton's version, "none" without Triton (a CPU-only torch)."""
    try:
        import triton
    except ImportError:
        return "none"
    return str(getattr(triton, "__version__", "unknown"))


def symm_mem_buffer(nbytes: int, device: torch.device, group_name: str) -> torch.Tensor:
    """A ``uint8`` buffer of ``nbytes`` in torch's symmetric memory, established over the group ``group_name``
    (``torch.distributed._symmetric_memory.empty`` + ``rendezvous``): a collective, every rank of the group
    calls it. torch before 2.9 also wants ``enable_symm_mem_for_group`` (deprecated, a no-op, after)."""
    import warnings

    from torch.distributed import _symmetric_memory as symm_mem

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group_name)
    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    symm_mem.rendezvous(buffer, group_name)
    return buffer


# ------------------------------------------------------------------ the AOT forward (dispatcher.aot)
def aot_available() -> bool:
    """Whether this torch has what rebuilding a traced graph's symbolic inputs needs, without Dynamo:
    ``ShapeEnv.create_symbol`` / ``create_symintnode``, ``FakeTensorMode`` and ``torch._dynamo.source.ConstantSource``."""
    try:
        from torch._dynamo.source import ConstantSource  # noqa: F401
        from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv  # noqa: F401
    except ImportError:  # pragma: no cover - every supported torch has them
        return False
    return all(hasattr(ShapeEnv, a) for a in ("create_symbol", "create_symintnode")) and hasattr(DimDynamic, "DYNAMIC")


def new_fake_mode() -> Any:
    """A ``FakeTensorMode`` with a fresh ``ShapeEnv``: where a rebuilt graph's symbolic inputs live."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv())


def _symbol_hint(shape_env: Any, symbol: Any) -> int:
    values = getattr(shape_env, "backed_var_to_val", None)  # torch 2.13 renamed var_to_val
    if values is None:
        values = shape_env.var_to_val
    return int(values[symbol])


def symbols_of(value: Any) -> tuple[str, list[tuple[str, str, int]]]:
    """A SymInt (or int) as ``(expression, [(symbol, its first source's name, its hint), ...])``."""
    if not isinstance(value, torch.SymInt):
        return str(int(value)), []
    node = value.node
    expr = node.expr  # with the ShapeEnv's replacements applied
    symbols = []
    for s in sorted(expr.free_symbols, key=str):
        sources = node.shape_env.var_to_sources.get(s) or []
        if not sources:
            raise ValueError(f"symbol {s} has no source")
        symbols.append((str(s), source_name(sources[0]), _symbol_hint(node.shape_env, s)))
    return str(expr), symbols


class SymbolNameMismatch(ValueError):
    """A symbol that this torch names otherwise than the torch that traced the graph."""


def make_symint(fake_mode: Any, symbol: str, source: str, hint: int) -> torch.SymInt:
    """A SymInt of a new dynamic symbol of ``fake_mode``'s ShapeEnv, for a source of that name: the symbol
    Dynamo made (its name derives from the source's); ValueError where this torch names it otherwise."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    shape_env = fake_mode.shape_env
    src = ConstantSource(source)
    expr = shape_env.create_symbol(hint, src, dynamic_dim=DimDynamic.DYNAMIC)
    if str(expr) != symbol:
        raise SymbolNameMismatch(f"this torch names the symbol of {source!r} {expr}, the artifact {symbol}")
    return shape_env.create_symintnode(expr, hint=hint, source=src)


@contextlib.contextmanager
def tracing_with(fake_mode: Any) -> Iterator[None]:
    """As Dynamo runs a backend: in a ``torch._guards.TracingContext`` of ``fake_mode``, with the GraphModules
    made in the block lazy (``torch.fx._lazy_graph_module._use_lazy_graph_module``, by Dynamo's
    ``use_lazy_graph_module``) -- their attributes' order enters AOTAutograd's cache key."""
    from torch._guards import TracingContext, tracing
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    lazy = getattr(torch._dynamo.config, "use_lazy_graph_module", True)
    with tracing(TracingContext(fake_mode)), _use_lazy_graph_module(lazy):
        yield


def materialize(gm: torch.fx.GraphModule) -> None:
    """Generate a lazy GraphModule's code now (``_LazyGraphModule.force_recompile``; a no-op for another), so that
    ``gm.forward`` is the generated function, not ``_lazy_forward``, which goes through ``Module.__call__`` on every
    call. (Dynamo does the same for a backend that returns a lazy module's forward.)"""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    _LazyGraphModule.force_recompile(gm)


def storage_key(t: torch.Tensor) -> Any:
    """A hashable key of ``t``'s storage (``StorageWeakRef``; a fake tensor's too): equal for two views of one storage."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def op_name(target: Any) -> str | None:
    """``"ns::name.overload"`` of an ``OpOverload`` (``"ns::name"`` of a packet), None for anything else."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target._schema.name}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def dynamo_disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch._dynamo.disable(fn)``: what Dynamo wraps a compiled graph in, so that no trace enters it."""
    return torch._dynamo.disable(fn)


def process_group_size(group_name: str) -> int | None:
    """The number of ranks of the ``torch.distributed`` group named ``group_name`` in this process
    (``distributed_c10d._resolve_process_group``); None when there is no such group."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed import distributed_c10d

    try:
        return int(distributed_c10d._resolve_process_group(group_name).size())
    except (RuntimeError, ValueError, KeyError):
        return None


def fake_tensor_mode() -> contextlib.AbstractContextManager[Any]:
    """A fresh ``FakeTensorMode``: tensors made in the block have shapes and dtypes but no data, and ops run
    their fake implementations (patterns of collective ops are traced without communicating)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


_symm_mem_groups: set[str] = set()


def symm_mem_fused_ops(group_name: str) -> Any | None:
    """``torch.ops.symm_mem`` with ``fused_matmul_reduce_scatter`` and ``fused_all_gather_matmul``, the group
    ``group_name`` enabled for symmetric memory (``enable_symm_mem_for_group``, which torch before 2.9 wants;
    deprecated, a no-op, after); None where torch has no such ops."""
    import warnings

    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError:
        return None
    ops = torch.ops.symm_mem
    if not (hasattr(ops, "fused_matmul_reduce_scatter") and hasattr(ops, "fused_all_gather_matmul")):
        return None
    if group_name not in _symm_mem_groups:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(group_name)
        _symm_mem_groups.add(group_name)
    return ops


@contextlib.contextmanager
def quick_graph_captures() -> Iterator[None]:
    """For a run of CUDA-graph captures: every ``torch.cuda.graph`` capture starts by emptying the caching
    allocator's and the host allocator's caches (``torch.cuda.empty_cache``, ``torch._C._host_emptyCache``) and,
    where ``torch.compiler.config.force_cudagraph_gc`` is set (always, on older torch), a ``gc.collect()``: a
    synchronizing release of every cached block and a cudaMalloc again for the next, per piece and size. In the
    block they do nothing (vLLM captures the same way); restored after it."""
    import gc
    from unittest import mock

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(torch.cuda, "empty_cache", lambda: None))
        stack.enter_context(mock.patch.object(gc, "collect", lambda generation=2: 0))
        if hasattr(torch._C, "_host_emptyCache"):
            stack.enter_context(mock.patch.object(torch._C, "_host_emptyCache", lambda: None))
        yield
