"""``TorchCompileWrapperWithCustomDispatcher``: trace once, then run the captured bytecode.

On the first call Dynamo traces ``forward`` (``fullgraph=True``). A bytecode
hook, registered only for the duration of that call, receives Dynamo's
``(original_code, transformed_code)`` and keeps the transformed code for this
instance. Later calls run that code directly: it takes the same arguments and
has the same free variables as ``forward`` (Dynamo guarantees it), so a
function object built from it once stands in for ``forward`` with no guard
evaluation and nothing shared mutated per call.

Ownership of a captured code is decided without walking Dynamo's frames: each
instance traces its own copy of ``forward.__code__`` (Dynamo's cache lives on
the code object, so two instances never share cache entries), and the hook
only accepts codes compiled on the thread that registered it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import aot, compat, compile_cache, envs
from .backends import RecordingBackend
from .config import CompilationConfig, CompilationLevel, get_compilation_config
from .counters import compilation_counter
from .debug import InputChecker, ShapeGuardChecker, dump_captured_code
from .errors import GraphBreakError, RecompileError

logger = logging.getLogger(__name__)

__all__ = ["TorchCompileWrapperWithCustomDispatcher", "CompiledCallable"]

_UNBOUND = object()
_NO_AOT = object()  # _do_aot_call: no AOT forward ran (none, or unusable): trace
# The wrapper's own attributes, which change with its state: not model state an AOT forward depends on.
_WRAPPER_STATE = frozenset({"compile_cache", "compiled_codes", "aot_status", "compiled_callable", "compilation_config",
                            "compilation_level", "original_code_object", "use_custom_dispatcher"})
# Bound once: the fast path calls torch's flag directly (Dynamo folds it to True while tracing) and
# only then pays for the per-thread check of compat.is_compiling (one Python frame less per call).
_torch_is_compiling = torch.compiler.is_compiling
_tracing_on_this_thread = compat.tracing_on_this_thread
# Serializes traces by dynamo-once instances. Dynamo is not safe for concurrent traces: while one
# thread traces under FakeTensorMode, a frame arriving on another thread can be marked "skip"
# for good (torch's global in-a-dispatch-mode flag), and that instance would never be captured.
_TRACE_LOCK = threading.RLock()
# Guards the swap of a shared function's __code__ (dispatch_to_code), per function.
_swap_locks: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_swap_locks_lock = threading.Lock()


def _swap_lock(fn: Any) -> threading.RLock:
    with _swap_locks_lock:
        lock = _swap_locks.get(fn)
        if lock is None:
            lock = _swap_locks[fn] = threading.RLock()
        return lock


@contextlib.contextmanager
def _swapped_code(fn: types.FunctionType, code: types.CodeType) -> Iterator[None]:
    """Within the block ``fn`` runs ``code``; serialized per function and always undone."""
    with _swap_lock(fn):
        previous = fn.__code__
        fn.__code__ = code
        try:
            yield
        finally:
            fn.__code__ = previous


class CompiledCallable:
    """``wrapper.compiled_callable``: what calls before (or instead of) dispatching go through.

    Wraps the callable a subclass passed (or the ``torch.compile`` the wrapper built) so that
    however a subclass calls it, from the default ``__call__`` or its own, a trace of ``forward``
    is captured into this instance's ``compiled_codes`` in compile order. At level 0 it runs
    ``forward`` eagerly; at level 1 it calls the wrapped callable as is (stock torch.compile).
    The wrapped callable is ``__wrapped__``.
    """

    __slots__ = ("_owner", "__wrapped__", "_swap_code")

    def __init__(self, owner: TorchCompileWrapperWithCustomDispatcher, inner: Callable[..., Any] | None,
                 swap_code: bool):
        self._owner = owner
        self.__wrapped__ = inner
        self._swap_code = swap_code

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._do_compiled_call(self.__wrapped__, self._swap_code, args, kwargs)

    def __repr__(self) -> str:
        return f"CompiledCallable({self._owner._do_name}, {self.__wrapped__!r})"


def _function_from_code(template: types.FunctionType, code: types.CodeType) -> types.FunctionType:
    """A function like ``template`` (globals, defaults, closure) whose body is ``code``."""
    fn = types.FunctionType(code, template.__globals__, template.__name__, template.__defaults__,
                            template.__closure__)
    fn.__kwdefaults__ = template.__kwdefaults__
    fn.__qualname__ = template.__qualname__
    return fn


def _find_in_chain(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kind):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class TorchCompileWrapperWithCustomDispatcher:
    """Mixin: compile ``forward`` once with Dynamo, then dispatch the captured bytecode.

    Subclasses define ``forward``. The default ``__call__`` goes through
    ``compiled_callable`` until a code is captured (always, below level 2) and
    then runs ``compiled_codes[0]`` directly. A subclass may override
    ``__call__`` to choose among several captured codes, either with
    ``dispatch_to_code(i)`` (swaps ``type(self).forward.__code__`` for the
    duration of a ``with`` block) or with :meth:`dispatch_fn`. Whatever a
    subclass does with ``self.compiled_callable`` (a :class:`CompiledCallable`
    around the callable given, or the one built here), each trace Dynamo makes
    of ``forward`` during the call is appended to this instance's
    ``compiled_codes``, in compile order; no private call is needed.

    Args:
        compiled_callable: what to call until a code is captured; by default
            ``torch.compile`` of this instance's ``forward`` with the level's
            backend and ``fullgraph=True``. A callable given here compiles
            ``forward``'s code, which all instances share: while it runs, this
            instance's private copy stands in for it, so each instance traces and
            captures its own codes (no ``torch._dynamo.reset()`` needed between instances).
        compilation_level: overrides ``get_compilation_config().level``.
    """

    def __init__(self, compiled_callable: Callable[..., Any] | None = None,
                 compilation_level: int | CompilationLevel | None = None):
        self._do_setup(type(self).forward, self, compiled_callable, compilation_level,
                       getattr(type(self), "_dynamo_once_dynamic_arg_dims", None))

    # ------------------------------------------------------------------ setup
    def _do_setup(self, function: Any, bound_to: Any, compiled_callable: Callable[..., Any] | None,
                  compilation_level: int | CompilationLevel | None,
                  dynamic_arg_dims: dict[str, list[int]] | None,
                  config: CompilationConfig | None = None) -> None:
        config = get_compilation_config() if config is None else config
        level = config.level if compilation_level is None else CompilationLevel.parse(compilation_level)
        function = inspect.unwrap(function)
        if not isinstance(function, types.FunctionType):
            raise TypeError(f"dynamo-once can only compile Python functions; got {function!r}")
        self.compilation_config = config
        self.compilation_level = level
        self.original_code_object: types.CodeType = function.__code__
        self.compiled_codes: list[types.CodeType] = []
        self.use_custom_dispatcher: bool = level >= CompilationLevel.DYNAMO_ONCE and config.use_bytecode_hook
        self._do_function = function
        # object.__setattr__: an nn.Module would register the module it is bound to (itself) as a child.
        object.__setattr__(self, "_do_bound", bound_to)
        self._do_name = function.__qualname__
        self._do_signature = inspect.signature(function)
        self._do_dynamic_arg_dims = dynamic_arg_dims
        self._do_fast: Callable[..., Any] | None = None  # set once a code is captured
        self._do_check: Callable[[tuple, dict], None] | None = None
        self._do_traced = False
        self._do_capture_lock = threading.Lock()
        self._do_dispatch_fns: list[Callable[..., Any]] = []
        self._do_input_checker: InputChecker | None = None
        self._do_backend: RecordingBackend | None = None
        #: Levels 3-4: this model's entry in the compile cache (``dispatcher.compile_cache``), set at the first
        #: call; None before it, below level 3, with the cache off, or with a key factor that cannot be hashed.
        self.compile_cache: compile_cache.CacheEntry | None = None
        self._do_cache_opened = False
        #: Levels 3-4: the AOT forward of the compile cache (``dispatcher.aot``): ``"loaded"`` (the first call ran
        #: it, no Dynamo trace), ``"saved"`` (traced, and written), ``"miss"`` (none in the cache: traced),
        #: ``"mismatch"`` (one traced for other arguments or model attributes), ``"corrupt"`` (unusable: a
        #: warning), ``"unsupported"`` (this trace cannot be written down), or ``"off"``.
        self.aot_status = "off"
        self._do_dynamic: dict[str, list[int]] = {}
        # Each instance traces its own copy of the code: Dynamo's cache is keyed by code identity.
        self._do_traced_code = self.original_code_object.replace()
        traced_fn = _function_from_code(function, self._do_traced_code)
        target = traced_fn if bound_to is _UNBOUND else types.MethodType(traced_fn, bound_to)
        given = compiled_callable is not None
        if compiled_callable is None and level >= CompilationLevel.DYNAMO_AS_IS:
            self._do_backend = RecordingBackend(config, level, self._do_name)
            options = None
            if level >= CompilationLevel.DYNAMO_ONCE and not config.use_bytecode_hook:
                options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
            fullgraph = config.fullgraph if level >= CompilationLevel.DYNAMO_ONCE else False
            compiled_callable = torch.compile(target, backend=self._do_backend, fullgraph=fullgraph,
                                              dynamic=False, options=options)
        # What a subclass calls: any trace it makes of forward is captured into compiled_codes.
        self.compiled_callable = CompiledCallable(self, compiled_callable, swap_code=given)

    # ------------------------------------------------------------ the hook
    def bytecode_hook(self, old_code: types.CodeType, new_code: types.CodeType) -> None:
        """Keep ``new_code`` if Dynamo produced it from this instance's ``forward``."""
        if old_code is not self._do_traced_code and old_code is not self.original_code_object:
            return
        with self._do_capture_lock:
            if self.compiled_codes and not self.use_custom_dispatcher:
                if self._do_backend is None:  # our backend already counted this trace
                    compilation_counter.add("num_recompiles")
                raise RecompileError(
                    f"{self._do_name}: Dynamo is tracing it again after its first trace, but level "
                    f"{self.compilation_level.name} with use_bytecode_hook=False dropped every guard, so "
                    f"a recompile means the first graph was used for a call it was not valid for."
                )
            self.compiled_codes.append(new_code)
            compilation_counter.add("num_codes_captured")
            index = len(self.compiled_codes) - 1
        logger.debug("%s: captured code #%d", self._do_name, index)
        path = self.compilation_config.debug_dump_path
        if path:
            graphs = self._do_backend.graphs[-1:] if self._do_backend else []
            dump_captured_code(path, self._do_name, index, new_code, graphs)

    @contextlib.contextmanager
    def _capturing(self, swap_code: bool) -> Iterator[None]:
        """Register a bytecode hook for this instance for the duration of one compiled call.

        Held by at most one thread at a time (see ``_TRACE_LOCK``). ``swap_code``: a callable the
        subclass compiled itself traces ``forward``'s own code, which every instance shares; for the
        call, ``forward`` runs this instance's copy instead, so that Dynamo's cache and this trace
        belong to this instance (restored when the call returns or raises).
        """
        ref = weakref.ref(self)
        thread = threading.get_ident()
        codes = (self._do_traced_code, self.original_code_object)

        def hook(old_code: types.CodeType, new_code: types.CodeType) -> None:
            if threading.get_ident() != thread or (old_code is not codes[0] and old_code is not codes[1]):
                return None
            owner = ref()
            if owner is not None:
                owner.bytecode_hook(old_code, new_code)
            return None

        with _TRACE_LOCK, (_swapped_code(self._do_function, self._do_traced_code) if swap_code
                           else contextlib.nullcontext()):
            with compat.compile_lock():
                handle = compat.register_bytecode_hook(hook)
            try:
                yield
            finally:
                with compat.compile_lock():
                    handle.remove()

    def _do_compiled_call(self, inner: Callable[..., Any], swap_code: bool, args: tuple, kwargs: dict) -> Any:
        """A call of ``compiled_callable``: eager at level 0 (and inside an outer trace), else ``inner``
        with this instance's bytecode hook registered.

        The first call marks the dynamic dims when the wrapper built ``inner`` (``dynamic=False``: the
        marks are all that is dynamic); a callable the subclass compiled itself keeps its own choice
        of what is dynamic (its ``torch.compile`` arguments, its own ``mark_dynamic`` calls).
        """
        level = self.compilation_level
        if level == CompilationLevel.NO_COMPILATION or compat.is_compiling():
            return self._do_eager(args, kwargs)
        if not self._do_traced and not swap_code:
            self._do_prepare_first_call(args, kwargs)
        if level == CompilationLevel.DYNAMO_AS_IS:
            return inner(*args, **kwargs)
        try:
            entry = self._do_open_cache(args, kwargs)
            with self._capturing(swap_code), compile_cache.first_compile(entry):
                spec = self._do_aot_spec(entry, args, kwargs)  # before the call: what it specializes on
                out = _NO_AOT if spec is None else self._do_aot_call(entry, spec, args, kwargs)
                if out is _NO_AOT:
                    out = inner(*args, **kwargs)
                    if spec is not None:
                        self._do_save_aot(entry, spec)
                return out
        except Exception as e:
            recompile = _find_in_chain(e, RecompileError)
            if recompile is not None:
                raise recompile from e
            if compat.graph_break_in_chain(e) is not None:
                raise GraphBreakError(
                    f"{self._do_name} cannot be captured as one graph, which level "
                    f"{level.name} requires (fullgraph=True). Remove the graph break below, or run it "
                    f"at level 1 (DYNAMO_AS_IS).\n{e}"
                ) from e
            raise

    def _do_open_cache(self, args: tuple, kwargs: dict) -> compile_cache.CacheEntry | None:
        """Levels 3-4, before the first trace: this model's compile-cache entry (once; None after that)."""
        backend = self._do_backend
        if self._do_cache_opened or backend is None or backend.piecewise is None or backend.graphs:
            return None
        self._do_cache_opened = True
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if isinstance(self._do_bound, torch.nn.Module):
            tensors += list(self._do_bound.parameters())[:1]
        self.compile_cache = compile_cache.open_entry(
            self._do_name, self.compilation_config, self.compilation_level, backend.options, self._do_bound,
            self._do_function, self.original_code_object, tensors)
        return self.compile_cache

    # ------------------------------------------------------------ the AOT forward
    def _do_aot_spec(self, entry: compile_cache.CacheEntry | None, args: tuple,
                     kwargs: dict) -> tuple[list[tuple], list[tuple]] | None:
        """What the first call's trace is specialized on: the arguments (``aot.call_spec``) and the model's plain
        attributes (``aot.module_state``), where the AOT forward applies: a cache entry, ``DYNAMO_ONCE_AOT`` on,
        bytecode dispatch, not debug mode (whose shape guards need Dynamo's ShapeEnv); None elsewhere."""
        if entry is None or not envs.aot_enabled() or not self.use_custom_dispatcher or self.compilation_config.debug:
            return None
        return (aot.call_spec(self._do_signature, self._do_bound is not _UNBOUND, args, kwargs, self._do_dynamic),
                aot.module_state(self._do_bound, _WRAPPER_STATE))

    def _do_aot_call(self, entry: compile_cache.CacheEntry, spec: tuple[list[tuple], list[tuple]], args: tuple,
                     kwargs: dict) -> Any:
        """The first call through the entry's AOT forward, no Dynamo trace; ``_NO_AOT`` where there is none or
        it cannot be used (a warning for a damaged one), and the caller traces."""
        try:
            payload = entry.read_aot()
            if payload is None:
                self.aot_status = "miss"
                return _NO_AOT
            forward = aot.load(payload, self._do_function, *spec)
            forward.install(self._do_function, self._do_backend.compile_aot)
        except aot.Mismatch as e:
            logger.info("%s: AOT forward not used (%s); tracing", self._do_name, e)
            self.aot_status = "mismatch"
            return _NO_AOT
        except Exception as e:  # ArtifactError, unpickling, marshal, a graph this torch cannot rebuild
            logger.warning("%s: AOT forward %s unusable (%s); tracing and rewriting it", self._do_name,
                           entry.aot_path, e)
            self.aot_status = "corrupt"
            return _NO_AOT
        self.compiled_codes.append(forward.code)
        try:
            out = self.dispatch_fn(0)(*args, **kwargs)
        except Exception as e:
            forward.uninstall(self._do_function)
            self.compiled_codes.clear()
            self._do_dispatch_fns.clear()
            self._do_backend.graphs.clear()
            logger.warning("%s: AOT forward %s failed (%s: %s); tracing and rewriting it", self._do_name,
                           entry.aot_path, type(e).__name__, e)
            self.aot_status = "corrupt"
            return _NO_AOT
        compilation_counter.add("num_aot_loads")
        self.aot_status = "loaded"
        logger.info("%s: AOT forward loaded from %s: no Dynamo trace", self._do_name, entry.aot_path)
        return out

    def _do_save_aot(self, entry: compile_cache.CacheEntry, spec: tuple[list[tuple], list[tuple]]) -> None:
        """After the first trace: write the entry's AOT forward (under the entry's lock)."""
        backend = self._do_backend
        if not self.compiled_codes or not backend.graphs:
            return
        payload = aot.capture(self._do_function, self.compiled_codes[0], backend.graphs[0], backend.static_indices,
                              *spec)
        if payload is None:
            self.aot_status = "unsupported"
            return
        try:
            entry.write_aot(payload)
            self.aot_status = "saved"
        except OSError as e:
            logger.warning("%s: AOT forward not written: %s", self._do_name, e)

    def save_compile_cache(self) -> bool:
        """Levels 3-4: write this model's compile-cache entry again if a compile since the last write (or the
        load) missed Inductor's cache, e.g. the per-size compiles of a CUDA-graph capture. Returns whether it
        wrote. The first call writes by itself; ``models.LLM`` calls this once its graphs are captured."""
        return False if self.compile_cache is None else self.compile_cache.save_locked()

    @property
    def backend_compile_s(self) -> float:
        """Seconds the backend spent on the traced graphs (Inductor compiles of the pieces, cache hits included;
        not the per-size compiles made later)."""
        return 0.0 if self._do_backend is None else self._do_backend.compile_s

    # --------------------------------------------------------- dispatching
    def dispatch_fn(self, index: int) -> Callable[..., Any]:
        """A callable running ``compiled_codes[index]`` with this instance bound, built once per code."""
        while len(self._do_dispatch_fns) <= index < len(self.compiled_codes):
            code = self.compiled_codes[len(self._do_dispatch_fns)]
            fn = _function_from_code(self._do_function, code)
            self._do_dispatch_fns.append(fn if self._do_bound is _UNBOUND else types.MethodType(fn, self._do_bound))
        return self._do_dispatch_fns[index]

    @contextlib.contextmanager
    def dispatch_to_code(self, index: int) -> Iterator[None]:
        """Within the block, ``forward`` runs ``compiled_codes[index]`` (the ``__code__`` swap contract).

        The swap mutates the class's function, so it is serialized per function
        and always undone, also when the block raises.
        """
        with _swapped_code(self._do_function, self.compiled_codes[index]):
            yield

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fast = self._do_fast
        if fast is not None and not (_torch_is_compiling() and _tracing_on_this_thread()):
            check = self._do_check
            if check is not None:
                check(args, kwargs)
            compilation_counter.num_dispatched_calls += 1
            return fast(*args, **kwargs)
        return self._do_slow_call(args, kwargs)

    def _do_eager(self, args: tuple, kwargs: dict) -> Any:
        if isinstance(self._do_bound, torch.nn.Module) and self._do_function is type(self._do_bound).forward:
            return torch.nn.Module.__call__(self._do_bound, *args, **kwargs)
        if self._do_bound is _UNBOUND:
            return self._do_function(*args, **kwargs)
        return self._do_function(self._do_bound, *args, **kwargs)

    def _do_slow_call(self, args: tuple, kwargs: dict) -> Any:
        level = self.compilation_level
        if level == CompilationLevel.NO_COMPILATION or compat.is_compiling():
            return self._do_eager(args, kwargs)
        first = not self._do_traced
        if first:
            self._do_prepare_first_call(args, kwargs)
        elif self._do_check is not None:
            self._do_check(args, kwargs)
        out = self.compiled_callable(*args, **kwargs)
        if first and level >= CompilationLevel.DYNAMO_ONCE:
            self._do_finish_first_call()
        return out

    def _do_prepare_first_call(self, args: tuple, kwargs: dict) -> None:
        """Mark dynamic dims and record what the trace will be valid for (once)."""
        if self._do_traced:
            return
        self._do_traced = True
        compilation_counter.add("num_models_seen")
        skip_first = self._do_bound is not _UNBOUND
        full = (None, *args) if skip_first else args
        try:
            bound = self._do_signature.bind(*full, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self._do_name}: {e}") from None
        dims = self._do_dynamic_arg_dims
        dynamic: dict[str, list[int]] = {}
        for name, value in bound.arguments.items():
            if not isinstance(value, torch.Tensor):
                continue
            want = [0] if dims is None else dims.get(name)
            if not want:
                continue
            ndim = value.dim()
            norm = []
            for d in want:
                if not -ndim <= d < ndim:
                    raise ValueError(
                        f"{self._do_name}: dynamic_arg_dims[{name!r}] has dim {d}, but the argument is "
                        f"{ndim}-d (shape {tuple(value.shape)})"
                    )
                d %= ndim
                if value.shape[d] < 2 and self.compilation_level >= CompilationLevel.DYNAMO_ONCE:
                    # Dynamo specializes sizes 0 and 1 even on a marked dim: the one trace would
                    # then hold only for that size (an Inductor kernel asserts it, eager ops may not).
                    raise ValueError(
                        f"{self._do_name}: the first call traces the graph that every later call runs, "
                        f"but dynamic dim {d} of argument {name!r} has size {value.shape[d]}, which "
                        f"Dynamo specializes to a constant. Make the first call with a size >= 2 there."
                    )
                norm.append(d)
            compat.mark_dynamic(value, norm)
            dynamic[name] = norm
        self._do_dynamic = dynamic
        if self.compilation_level >= CompilationLevel.DYNAMO_ONCE and self.compilation_config.check_inputs:
            self._do_input_checker = InputChecker(self._do_name, self._do_signature, skip_first, args, kwargs,
                                                  dynamic)
            self._do_check = self._do_input_checker._fast
        logger.debug("%s: first call at level %s, dynamic dims %s", self._do_name,
                     self.compilation_level.name, dynamic)

    def _do_finish_first_call(self) -> None:
        if not self.use_custom_dispatcher:
            return
        if not self.compiled_codes:
            logger.warning(
                "%s: Dynamo produced no code for forward (it may have skipped the frame); calls keep "
                "going through torch.compile with its guards", self._do_name)
            return
        checks = [self._do_input_checker._fast] if self._do_input_checker is not None else []
        if self.compilation_config.debug:
            checks.append(self._do_shape_guard_check())
        if not checks:
            self._do_check = None
        elif len(checks) == 1:
            self._do_check = checks[0]
        else:
            def check(args: tuple, kwargs: dict, _checks=tuple(checks)) -> None:
                for c in _checks:
                    c(args, kwargs)
            self._do_check = check
        self._do_fast = self.dispatch_fn(0)

    def _do_shape_guard_check(self) -> Callable[[tuple, dict], None]:
        shape_env = self._do_backend.shape_envs[0] if self._do_backend and self._do_backend.shape_envs else None
        if shape_env is None:
            logger.warning("%s: debug mode has no ShapeEnv for this trace; shape guards are not checked",
                           self._do_name)
            return lambda args, kwargs: None
        checker = ShapeGuardChecker(self._do_name, self._do_signature, shape_env)
        logger.debug("%s: debug mode checks %d shape guard(s)", self._do_name, len(checker.guards))
        if self._do_bound is _UNBOUND:
            return checker
        bound = self._do_bound
        return lambda args, kwargs: checker((bound, *args), kwargs)

    @property
    def num_dynamic_sizes(self) -> int | None:
        """Levels 3-4: how many dynamic sizes the trace has (None before the trace, and below level 3).

        Per-size compiles and CUDA graphs need exactly one (the token count); with more, the pieces run
        their symbolic compile and a PIECEWISE capture raises.
        """
        backend = self._do_backend
        piecewise = None if backend is None else backend.piecewise
        return None if piecewise is None else piecewise.num_dynamic_sizes

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must define forward")
