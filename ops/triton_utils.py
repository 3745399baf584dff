"""What every Triton launcher shares: optional Triton, ``triton_op``, size helpers and the PDL switch.

A public module: the op modules import from it, and so does :mod:`models` (``cdiv``).

CI and most development machines have no Triton (and no GPU). There every op
must still import, register ``torch.ops.dynamo_once.<name>`` and run its fp32
reference, so the kernel modules can define their ``@triton.jit`` functions
unconditionally: without Triton, ``triton.jit`` below returns the Python
function unchanged (it is never launched) and ``tl.constexpr`` is a plain
annotation.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dispatcher import compat, envs

logger = logging.getLogger(__name__)

__all__ = [
    "HAS_TRITON",
    "triton",
    "tl",
    "triton_op",
    "use_triton",
    "next_power_of_2",
    "cdiv",
    "known_int",
    "needs_int64",
    "SMALL_ELEMENTS",
    "pdl_launch",
    "pdl_available",
    "pdl_args",
    "FastLaunch",
    "BoundLaunch",
    "Slot",
    "specialization_key",
    "tma_descriptor",
]

#: At most this many elements (16 tokens x 8192) an op is launch-latency bound: on the H200 it moves
#: <= 512 KiB of bf16, < 0.15 us at 4.2 TB/s against ~1.3 us per CUDA-graph kernel node. Such sizes get
#: latency configs (few warps, many small programs) when their size is known (see ``known_int``).
SMALL_ELEMENTS = 16 * 8192

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: the reference implementations serve every device
    HAS_TRITON = False

    class _TritonPlaceholder:
        """Just enough of ``triton`` for the kernel modules to import."""

        __version__ = None

        @staticmethod
        def jit(fn: Callable | None = None, **_: Any) -> Callable:
            return fn if fn is not None else (lambda f: f)

    class _LanguagePlaceholder:
        constexpr = "constexpr"

    triton = _TritonPlaceholder()  # type: ignore[assignment]
    tl = _LanguagePlaceholder()  # type: ignore[assignment]

try:  # host-side tensor descriptors (Triton 3.4 and newer)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: Any, b: Any) -> Any:
    """Ceiling division that keeps a SymInt symbolic (no guard on its value)."""
    return (a + b - 1) // b


def known_int(n: Any) -> int | None:
    """``n`` as an int when its value is known without a guard, else None.

    Known: in eager mode and in static-shape compiles (``dynamic=False``, or the
    dispatcher's per-size compiles). Unknown: a symbolic token count, where
    branching on its value would guard on it (a recompile at the next size),
    so the launchers then use their size-independent configs.
    """
    if isinstance(n, int):
        return n
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return int(n) if is_concrete_int(n) else None


def needs_int64(*extents: Any) -> bool:
    """Whether an offset up to ``sum(extents)`` elements may overflow int32 (always, for a symbolic extent).

    int32 offsets save the 64-bit multiply-adds per address, which matter only on the short,
    latency-bound path, but are free everywhere they fit.
    """
    total = 0
    for e in extents:
        v = known_int(e)
        if v is None:
            return True
        total += abs(v)
    return total >= 2**31


def triton_op(name: str, *, mutates_args: str | Iterable[str]) -> Callable[[Callable], Any]:
    """``torch.library.triton_op`` when Triton imports, else an opaque ``custom_op``.

    With Triton, torch.compile decomposes the op into its body, so Inductor
    sees the Triton kernel and fake tensors come from tracing the body. Without
    it, the body (which then only runs the reference) is the eager kernel for
    every device and, traced on fake tensors, the fake implementation: the
    output shapes are defined in one place either way.
    """

    def dec(fn: Callable) -> Any:
        if HAS_TRITON:
            return torch.library.triton_op(name, fn, mutates_args=mutates_args)
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.register_fake(fn)
        return op

    return dec


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op body launches its Triton kernel for ``x`` (else: the reference).

    Decided by the device only, which Dynamo treats as static, so the branch
    adds no shape guard. Fake tensors report the device they stand for.
    """
    return HAS_TRITON and x.device.type == "cuda"


@functools.cache
def _hopper_or_newer(device_index: int) -> bool:
    """Whether a CUDA device has Hopper's launch and copy features (PDL, the tensor memory accelerator)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def _device_index(x: torch.Tensor) -> int:
    return x.device.index if x.device.index is not None else torch.cuda.current_device()


def pdl_launch(x: torch.Tensor, n: int | None) -> bool:
    """Whether a kernel on ``x`` covering ``n`` elements (None: not known without a guard) launches with
    programmatic dependent launch (PDL).

    With PDL (Hopper and newer) a kernel may be launched while the one before it on the stream still
    runs: its programs start, then wait (``gdc_wait``, before any global memory access) for that
    kernel's end, and each signals (``gdc_launch_dependents``) that the next may launch in turn. That
    hides a launch's latency, the larger part of a call at <= 16 tokens (~1.2 us a CUDA-graph kernel
    node on the H200); FlashInfer's norm and activation kernels do the same on Hopper.

    Eager (CUDA-graph capture included): only for latency-bound launches (``n <= SMALL_ELEMENTS``, one wave of
    programs): on a large grid, the next kernel's early programs would hold SM slots the running one still needs.
    Traced for an Inductor compile (the op inlined into its kernels, which Inductor launches): whenever Inductor's
    own PDL option is on in that compile, whatever the size, as Inductor launches its own kernels
    (:func:`pdl_available`). ``DYNAMO_ONCE_PDL=0`` turns it off.
    """
    return _pdl_possible(x) and _pdl_launch(x, n, _traced(x))


def _pdl_launch(x: torch.Tensor, n: int | None, traced: bool) -> bool:
    return (traced or (n is not None and n <= SMALL_ELEMENTS)) and _pdl_available(x, traced)


def pdl_available(x: torch.Tensor) -> bool:
    """Whether a kernel on ``x`` may launch with PDL at all (``pdl_launch`` without its size limit): a CUDA tensor of
    a Hopper or newer GPU, ``DYNAMO_ONCE_PDL`` not 0; eager (CUDA-graph capture included), or traced while Inductor
    compiles with its PDL option on (level 3 sets it): Inductor then launches the kernel, with PDL through
    ``dispatcher.compat.launch_user_kernels_with_pdl``, where it runs the op as its Triton kernels."""
    return _pdl_possible(x) and _pdl_available(x, _traced(x))


def _pdl_possible(x: torch.Tensor) -> bool:
    """The checks of :func:`pdl_available` that need no traced test: a CUDA tensor, ``DYNAMO_ONCE_PDL`` not 0."""
    return x.device.type == "cuda" and envs.pdl()


def _pdl_available(x: torch.Tensor, traced: bool) -> bool:
    """:func:`pdl_available`'s rule past :func:`_pdl_possible`, which every caller tests first (once a launch)."""
    if traced and not compat.inductor_pdl_enabled():
        return False
    if not _hopper_or_newer(_device_index(x)):
        return False
    if traced:  # False where Inductor could not take the PDL form: the plain one then
        return compat.launch_user_kernels_with_pdl(__package__ or __name__.rpartition(".")[0])
    return True


def _traced(x: torch.Tensor) -> bool:
    """Whether ``x`` is traced (a fake or functional tensor, or Dynamo tracing) rather than real data."""
    return not compat.is_real_tensor(x) or torch.compiler.is_compiling()


def tma_descriptor(t: torch.Tensor, block_shape: list[int]) -> Any:
    """A tensor descriptor of the 2-D ``t`` (unit column stride) for a kernel to read ``block_shape`` tiles of it
    with Hopper's tensor memory accelerator (``desc.load``), or None where it cannot: no descriptor support in this
    Triton, a CUDA device before Hopper, a base or row stride not 16-byte aligned. On CPU tensors (Triton's
    interpreter) a descriptor whenever the alignment holds, so that the interpreted tests run the TMA form."""
    if TensorDescriptor is None or t.dim() != 2 or t.stride(1) != 1:
        return None
    if t.device.type == "cuda" and not _hopper_or_newer(_device_index(t)):
        return None
    if t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
        return None
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], list(block_shape))


_NO_PDL, _PDL_TRACED, _PDL_EAGER = {"PDL": False}, {"PDL": True}, {"PDL": True, "launch_pdl": True}


def pdl_args(pdl: bool | None, x: torch.Tensor, n: int | None = None, *, any_size: bool = False) -> dict[str, bool]:
    """A kernel's ``PDL`` constexpr and, eager and on, the launch option that goes with it (traced, ``x`` a traced
    tensor, Inductor launches the kernel and gives it the option: ``pdl_available``); unpack it into the launch.

    ``pdl`` None: decided here, by :func:`pdl_launch`'s rule for a kernel covering ``n`` elements or, ``any_size``,
    :func:`pdl_available`'s; whether ``x`` is traced is then asked once a launch, not twice.
    """
    if pdl is None:
        if not _pdl_possible(x):  # no traced test where PDL is off anyway
            return _NO_PDL
        traced = _traced(x)
        pdl = _pdl_available(x, traced) if any_size else _pdl_launch(x, n, traced)
    elif pdl:
        traced = _traced(x)
    if not pdl:
        return _NO_PDL
    return _PDL_TRACED if traced else _PDL_EAGER


# ------------------------------------------------------------ fast launches
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def specialization_key(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """What Triton specializes a kernel on among its runtime (non-constexpr) ``args``; None: an argument of
    a kind the fast launch does not handle (the normal launch then serves the call).

    Triton 3.x compiles one kernel per: tensor dtype and whether its address is 16-byte aligned; int
    width class (i32 / i64 / u64), whether it equals 1 (then a constant) or is divisible by 16; floats
    and bools by type only. Two argument lists with equal keys (and equal constexprs and options) get
    the same compiled kernel, so the key may be finer than Triton's but never coarser.
    """
    found = key_and_launch_args(args)
    return None if found is None else found[0]


def key_and_launch_args(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[Any]] | None:
    """:func:`specialization_key` of ``args``, and ``args`` with every tensor replaced by its address.

    Triton's C launcher takes a pointer argument as an int as it is; a tensor costs it a Python method call
    (``data_ptr``) and a driver query (``cuPointerGetAttribute``, to validate the address) per argument per
    launch. The key reads each tensor's address anyway, so the launch gets the int.
    """
    key: list[Any] = []
    put = key.append
    launch_args: list[Any] = []
    arg = launch_args.append
    for a in args:
        t = type(a)
        if t is int:
            if a == 1:
                put(1)
            else:
                put((3 if a % 16 == 0 else 2) + (0 if _I32_MIN <= a <= _I32_MAX else 2 if a < 2**63 else 4))
            arg(a)
        elif t is float:
            put(0)
            arg(a)
        elif isinstance(a, torch.Tensor):
            ptr = a.data_ptr()
            put(a.dtype)
            put(ptr % 16 == 0)
            arg(ptr)
        elif t is bool or a is None:
            put(a)
            arg(a)
        else:
            return None
    return tuple(key), launch_args


class FastLaunch:
    """A Triton kernel launched through its compiled launcher, skipping ``JITFunction.run`` after the first call.

    ``FastLaunch(kernel)(grid, *args, **constexprs_and_options)`` is ``kernel[grid](*args, **kw)``: the grid a
    tuple, the runtime arguments positionally in the kernel's order, constexprs and launch options
    (``num_warps``, ...) by keyword. ``kernel[grid](...)`` re-binds the arguments, re-derives their specialization, rebuilds the
    options and the launch metadata, and calls the (empty) launch hooks: tens of µs of Python a launch on
    the H200's host, three launches per attention layer per step on the piecewise path. Here the first
    launch of a specialization (:func:`specialization_key` of the arguments, the keywords, the device)
    goes through ``kernel.run`` as usual, which compiles (or loads) the kernel and returns it; later ones
    call that compiled kernel's C launcher directly with the same arguments, each tensor as its address
    (:func:`key_and_launch_args`).

    The normal launch serves every call the fast path cannot: Triton's interpreter (``TRITON_INTERPRET=1``:
    the kernel is no ``JITFunction``), launch or pre-run hooks set (a profiler such as proton), an argument
    of another kind (tuples, tensor descriptors), a runtime argument given by keyword, or a Triton whose
    internals differ (any attribute missing: logged at debug level). A kernel that needs scratch memory is
    launched through its compiled launcher's Python wrapper (which allocates it), the others through the C
    entry point itself.
    Like ``kernel.run`` it launches on the current device's current stream (CUDA-graph capture included).
    It does not re-check the kernel's global variables (``kernel.run`` refuses a changed one): kernels
    launched this way read constexpr globals only.

    ``FastLaunch.enabled = False`` sends every launch through ``kernel[grid]`` (to measure the difference).
    """

    enabled = True

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._entries: dict[Any, tuple | None] = {}
        self._device: Callable[[], int] | None = None  # the current device and stream getters, resolved once
        self._stream: Callable[[int], int] | None = None
        self._runtime: Any = None  # triton.knobs.runtime (the launch hooks)
        self.fast_launches = 0  # how many calls the fast path served (tests)
        # BoundLaunch's launch layouts, by its shape and per-call specialization (layout / keep_layout)
        self._layouts: dict[tuple, tuple] = {}
        jit = getattr(getattr(triton, "runtime", None), "JITFunction", None)
        self._usable = HAS_TRITON and jit is not None and isinstance(kernel, jit)

    def __call__(self, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if not (self._usable and FastLaunch.enabled and type(grid) is tuple):  # a callable grid: run() calls it
            self.kernel[grid](*args, **kwargs)
            return
        self.launch_entry(grid, args, kwargs)

    def launch_entry(self, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple | None:
        """Launch (as ``__call__``, the grid a tuple) and return the entry that served it: ``(launch, fixed,
        tail)`` (the fast path, for these arguments' specialization) or None (the normal launch served it, and
        serves this specialization while no hook is set). :class:`BoundLaunch` keeps it."""
        if self._device is None:
            self._resolve()
        device = self._device()
        found = key_and_launch_args(args)
        key = (device, found[0], tuple(kwargs.items())) if found is not None else None
        try:
            entry = self._entries.get(key, False) if key is not None and not _hooks_set(self._runtime) else None
        except TypeError:  # an unhashable constexpr
            key = entry = None
        if not entry:  # unseen (False), or served by the normal launch (None)
            compiled = self.kernel.run(*args, grid=grid, warmup=False, **kwargs)
            if entry is False:
                entry = self._entries[key] = self._entry(compiled, len(args), kwargs)
                return entry
            return None
        launch, fixed, tail = entry
        n = len(grid)
        launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._stream(device), *fixed, *found[1], *tail)
        self.fast_launches += 1
        return entry

    def target(self) -> tuple[int, int] | None:
        """``(device, stream)`` a fast launch goes to now: the current device and its current stream, as
        :meth:`launch_entry` reads them per launch; None when launches must take the normal way (``FastLaunch.enabled``
        False, a kernel the fast path never serves, launch hooks set). A caller issuing several launches back to back
        (the attention op: two or three a call) reads it once and passes it to each :class:`BoundLaunch` call: valid
        until the current device or stream changes (CUDA-graph capture switches the stream: never keep it longer)."""
        if not (self._usable and FastLaunch.enabled):
            return None
        if self._device is None:
            self._resolve()
        if _hooks_set(self._runtime):
            return None
        device = self._device()
        return device, self._stream(device)

    _MAX_LAYOUTS = 256  # shapes x specializations of one kernel: a handful in practice; start over past this

    def layout(self, key: tuple, shape: tuple | None) -> tuple | None:
        """The launch layout a :class:`BoundLaunch` of this ``shape`` (its bound values' specialization, argument
        order, constexprs and options) kept for the per-call specialization ``key`` (:meth:`keep_layout`); None: none
        kept, or no shape (an unhashable constexpr)."""
        return None if shape is None else self._layouts.get((key, shape))

    def keep_layout(self, key: tuple, shape: tuple | None, layout: tuple) -> tuple:
        """Keep ``layout`` (``BoundLaunch._launch_layout`` of the entry the fast path served ``key`` with) for
        :meth:`layout`; returns it."""
        if shape is not None:
            if len(self._layouts) >= self._MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[(key, shape)] = layout
        return layout

    def bind(self, grid: tuple[int, ...], args: Iterable[Any], **kwargs: Any) -> BoundLaunch:
        """A :class:`BoundLaunch` of this kernel: ``grid``, ``kwargs`` and the arguments that are not
        :class:`Slot` fixed; the slots given at each call."""
        return BoundLaunch(self, grid, tuple(args), kwargs)

    def _resolve(self) -> None:
        from triton import knobs
        from triton.runtime import driver

        self._runtime = knobs.runtime
        self._device = compat.cuda_device_getter(driver.active.get_current_device)
        self._stream = driver.active.get_current_stream

    def _entry(self, compiled: Any, num_args: int, kwargs: dict[str, Any]) -> tuple | None:
        """``(launch, fixed leading arguments, constexpr tail)`` of a compiled kernel, or None (normal launch)."""
        try:
            params = self.kernel.params
            if self.kernel.pre_run_hooks:  # run() calls them before every launch
                return None
            if any(p.is_constexpr for p in params[:num_args]):
                return None  # a constexpr passed positionally: its value is not in the key
            tail = []
            for p in params[num_args:]:
                if p.name in kwargs and p.is_constexpr:
                    tail.append(kwargs[p.name])
                elif p.name not in kwargs and p.has_default:
                    tail.append(p.default)
                else:
                    return None  # a runtime argument by keyword (its value would be frozen), or missing
            if hasattr(compiled, "result"):  # an asynchronous compile's future
                return None
            launcher = compiled.run
            function, packed = compiled.function, compiled.packed_metadata
            if function is None:
                return None
            # The C launch itself when the launcher would only pass it no scratch memory (Triton 3.6's
            # CudaLauncher.__call__: two closures and two checks a launch); else the launcher.
            raw = getattr(launcher, "launch", None)
            if raw is not None and not getattr(launcher, "global_scratch_size", 1) \
                    and not getattr(launcher, "profile_scratch_size", 1):
                fixed = (function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, packed,
                         None, None, None)
                return raw, fixed, tuple(tail)
            return launcher, (function, packed, None, None, None), tuple(tail)
        except Exception:  # noqa: BLE001 - another Triton's internals: keep the normal launch
            logger.debug("FastLaunch(%s): no fast path, normal launches", self.kernel, exc_info=True)
            return None


_data_ptr = torch.Tensor.data_ptr
_dtype = operator.attrgetter("dtype")
_ALIGN = (15).__and__  # an address's offset from a 16-byte boundary (0: aligned), as Triton's divisibility by 16


def _hooks_set(runtime: Any) -> bool:
    """Whether Triton's launch hooks (``triton.knobs.runtime``) are set, by a profiler: launches must then go
    through ``kernel.run``, which calls them."""
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    # Triton 3.6: HookChain objects, empty unless a hook was added; earlier: None or a callable.
    return bool(getattr(enter, "calls", enter)) or bool(getattr(exit_, "calls", exit_))


class Slot:
    """A placeholder in :meth:`FastLaunch.bind`'s arguments: per-call tensor ``index`` (``Slot.tensor(i)``) or
    scalar ``index`` (``Slot.scalar(i)``) of :meth:`BoundLaunch.__call__`; one may fill several positions."""

    __slots__ = ("is_tensor", "index")

    def __init__(self, is_tensor: bool, index: int) -> None:
        self.is_tensor, self.index = is_tensor, index

    @staticmethod
    def tensor(index: int) -> Slot:
        return _slot(True, index)

    @staticmethod
    def scalar(index: int) -> Slot:
        return _slot(False, index)


@functools.cache
def _slot(is_tensor: bool, index: int) -> Slot:
    """One :class:`Slot` per kind and index, made once (binders ask for a few dozen a step; a slot is never
    changed)."""
    return Slot(is_tensor, index)


class _Recording(threading.local):
    """This thread's recorder: a list while ``ops.launch_program.recording`` runs, to which every
    :class:`BoundLaunch` call appends ``(bound, tensors, scalars, target)`` before launching as usual."""

    calls: list[tuple] | None = None


_RECORDING = _Recording()


class BoundLaunch:
    """One kernel launched many times with the same grid, constexprs and most arguments, the others per call.

    A caller that launches a kernel once per layer of a step with arguments that mostly do not change between
    layers (a decode plan's block table, grids, scratch, constexprs) binds them once (:meth:`FastLaunch.bind`) and
    passes only the per-layer ones: ``bound(tensors, scalars)``, two tuples, filling the :class:`Slot` positions.
    A call then computes the specialization of its per-call values only: each tensor's dtype and 16-byte
    alignment, as :func:`specialization_key` (the fixed arguments' part was taken at the bind), and each scalar's
    value and type (finer than Triton's key, never coarser; the scalars a caller passes, strides, scale, window,
    are the same for every layer in practice). Its first call of a specialization goes through
    :meth:`FastLaunch.launch_entry` with the whole argument list (compiling, or the normal launch wherever
    ``FastLaunch`` would take it, which then serves that specialization); later ones call the compiled launcher
    with the fixed arguments' addresses and the per-call ones put in the kernel's order by one ``itemgetter``
    (per specialization: its whole argument list, grid and compiled kernel's values included, from one tuple).
    Launch hooks set, or ``FastLaunch.enabled`` False: every call goes through ``FastLaunch`` whole.
    """

    _MAX_ENTRIES = 64  # per-call values that keep changing (none should): start over rather than grow

    def __init__(self, fast: FastLaunch, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fast, self.grid, self.args, self.kwargs = fast, grid, args, kwargs
        # The launcher's arguments are itemgetter(order) of (fixed launch values, tensor addresses, scalars): one
        # pass (built once a step per kernel on the attention op's path, whose host time counts).
        fixed_vals, slots = [], []
        n_tensors = 0
        for a in args:
            if type(a) is Slot:
                slots.append(a)
                if a.is_tensor and a.index >= n_tensors:
                    n_tensors = a.index + 1
            else:
                fixed_vals.append(a)
        n_fixed, f = len(fixed_vals), -1
        order = [n_fixed + a.index + (0 if a.is_tensor else n_tensors) if type(a) is Slot else (f := f + 1)
                 for a in args]
        found = key_and_launch_args(tuple(fixed_vals))
        self._fixed = tuple(found[1]) if found is not None else None  # None: an argument FastLaunch never serves
        self._order = tuple(order)  # the kernel's arguments as indices into (fixed values, tensor addresses, scalars)
        self._n_tensors = n_tensors
        # What, besides the per-call values, decides the compiled kernel and the launcher's argument layout: bound
        # launches of one kernel that share it (a step's, and the next step's of another grid or table) share the
        # layout FastLaunch.layouts keeps, instead of each working it out at its first call.
        self._shape = (found[0], self._order, n_tensors, tuple(kwargs.items())) if found is not None else None
        try:
            hash(self._shape)
        except TypeError:  # an unhashable constexpr (the normal launch serves it): no layout to share
            self._shape = None
        self._fast_path = fast._usable and self._fixed is not None
        n = len(grid)
        self._grid3 = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1)
        self._entries: dict[tuple, tuple | None] = {}

    def full_args(self, tensors: tuple[Any, ...], scalars: tuple[Any, ...]) -> tuple[Any, ...]:
        """The kernel's whole positional argument list for these per-call values."""
        return tuple((tensors if a.is_tensor else scalars)[a.index] if isinstance(a, Slot) else a for a in self.args)

    def __call__(self, tensors: tuple[torch.Tensor, ...], scalars: tuple[Any, ...] = (),
                 target: tuple[int, int] | None = None) -> None:
        """Launch with these per-call values. ``target``: :meth:`FastLaunch.target` read by the caller for this and
        the launches issued with it (None: read here)."""
        fast = self.fast
        if not self._fast_path or (target is None and (target := fast.target()) is None):
            if (recorder := _RECORDING.calls) is not None:  # no fast path: a LaunchProgram recorded cannot replay it
                recorder.append((self, tensors, None, scalars, None))
            fast(self.grid, *self.full_args(tensors, scalars), **self.kwargs)  # the normal launch, or FastLaunch's
            return
        ptrs = tuple(map(_data_ptr, tensors))
        # map over C callables, flattened: ~0.15 µs a launch less than a tuple of each kind built by comprehension
        key = (target[0], scalars, *map(_dtype, tensors), *map(_ALIGN, ptrs), *map(type, scalars))
        if (recorder := _RECORDING.calls) is not None:  # a LaunchProgram being recorded (ops.launch_program)
            recorder.append((self, tensors, ptrs, scalars, key))
        entry = self._entries.get(key, False)
        if not entry:
            if entry is None:  # the normal launch serves this specialization
                fast(self.grid, *self.full_args(tensors, scalars), **self.kwargs)
                return
            # unseen: the kernel's launch layout for this specialization, or the whole launch, which tells it
            if len(self._entries) >= self._MAX_ENTRIES:
                self._entries.clear()
            layout = fast.layout(key, self._shape)
            if layout is None:  # the whole launch (it launches); None: the normal launch serves this specialization
                served = fast.launch_entry(self.grid, self.full_args(tensors, scalars), self.kwargs)
                self._entries[key] = None if served is None else self._launch_plan(
                    fast.keep_layout(key, self._shape, self._launch_layout(served)))
                return
            entry = self._entries[key] = self._launch_plan(layout)
        launch, const, order = entry[:3]
        launch(*order(const + (target[1],) + ptrs + scalars))
        fast.fast_launches += 1

    def fast_entry(self, key: tuple | None) -> tuple | None:
        """The fast path's entry for a specialization ``key`` (as a :func:`ops.launch_program.recording` records it):
        ``(launch, const, order, stream_pos, tensor_pos)`` (see ``_launch_plan``); None when the normal launch serves
        it, or it was never launched."""
        return self._entries.get(key) or None if key is not None else None

    def _launch_layout(self, entry: tuple) -> tuple[Callable, tuple, tuple, Callable, int, tuple[tuple[int, int], ...]]:
        """``(launch, fixed, tail, order, stream_pos, tensor_pos)`` of a :meth:`FastLaunch.launch_entry` entry
        ``(launch, fixed, tail)``: what :meth:`_launch_plan` needs besides this bound launch's grid and bound values,
        the same for every bound launch of this kernel with this :attr:`_shape` and specialization."""
        launch, fixed, tail = entry
        n_bound = len(self._fixed)
        lead = 3 + len(fixed)
        n = lead + n_bound + len(tail)  # the length of _launch_plan's const
        # (fixed values, addresses, scalars) index i: a bound value at lead + i, a per-call one after the stream
        args = [lead + i if i < n_bound else n + 1 + i - n_bound for i in self._order]
        idx = [0, 1, 2, n, *range(3, lead), *args, *range(lead + n_bound, n)]
        tensor_pos = tuple((p, i - n - 1) for p, i in enumerate(idx) if n < i and i - n - 1 < self._n_tensors)
        return launch, tuple(fixed), tuple(tail), operator.itemgetter(*idx), idx.index(n), tensor_pos

    def _launch_plan(self, layout: tuple) -> tuple[Callable, tuple[Any, ...], Callable, int, tuple[tuple[int, int], ...]]:
        """``(launch, const, order, stream_pos, tensor_pos)`` of a :meth:`_launch_layout`: the launcher's whole
        argument list is ``order(const + (stream,) + tensor addresses + scalars)``, ``const`` the grid, the compiled
        kernel's leading values, the bound arguments' and the constexpr tail; in that list the stream is at
        ``stream_pos`` and per-call tensor ``i``'s address at each ``p`` of ``tensor_pos``'s ``(p, i)`` (what
        ``ops.launch_program.LaunchProgram`` replays)."""
        launch, fixed, tail, order, stream_pos, tensor_pos = layout
        return launch, self._grid3 + fixed + self._fixed + tail, order, stream_pos, tensor_pos
