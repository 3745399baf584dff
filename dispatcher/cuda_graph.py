"""CUDA graphs of a model's steps: one capture/replay mechanism keyed by (mode, size).

Nothing is captured implicitly. The caller (a runner) owns a :class:`CUDAGraphs`,
captures the sizes it will replay at start-up, and declares each step's mode::

    graphs = CUDAGraphs()
    graphs.mark_static(input_ids, positions)         # persistent inputs, read in place
    graphs.capture([1, 2, 4, 8], CUDAGraphMode.PIECEWISE, step)
    graphs.capture([1, 2, 4], CUDAGraphMode.FULL, decode_step, prepare=dummy_decodes)
    out = graphs.run(CUDAGraphMode.FULL, 4, decode_step)   # per step

Three modes (:class:`CUDAGraphMode`): NONE runs the compiled pieces; PIECEWISE
replays, in each compiled piece (``dispatcher.piecewise``), that piece's graph
for its token count, the splitting ops (attention) running eagerly between
them; FULL replays one graph of the whole step, splitting ops included. Pieces
find the PIECEWISE step on a thread-local (:data:`thread_state`), set only by
:meth:`CUDAGraphs.run` and :meth:`CUDAGraphs.capture`; with none set they run
their compiled code, no graphs.

Inputs of a captured piece must sit at the addresses it was captured with.
At capture each tensor input is sorted into one of four kinds:

- parameters and buffers that do not move (``nn.Parameter``, or flagged static
  by Dynamo): used in place; debug mode checks at every replay that they are
  still at the captured address (a reassigned ``layer.weight`` is caught);
- outputs of graphs captured earlier in the same pool (the previous piece):
  used in place, they are static by construction;
- views of persistent buffers declared with :meth:`CUDAGraphs.mark_static` (a
  runner's inputs): used in place; every replay checks the address;
- anything else (model inputs, the eager splitting op's output): copied into
  a buffer owned by the graph before each replay, unless it already is that
  buffer (a runner that writes into persistent inputs pays no copy).

A compiled model's outputs that live in the pool (the last piece's) are cloned
before the caller gets them (``dispatcher.piecewise``), so a later replay does
not overwrite them. A FULL step's output is the graph's own buffer in the pool:
read it (or launch what reads it) before the next step with graphs of the same
CUDAGraphs, whose replay may overwrite it.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import compat
from .counters import compilation_counter
from .errors import DynamoOnceError

logger = logging.getLogger(__name__)

__all__ = ["CUDAGraphMode", "CUDAGraphs", "CapturedGraph", "CUDAGraphAddressError", "CUDAGraphCaptureError",
           "CUDAGraphNotCapturedError", "thread_state"]


class CUDAGraphMode(enum.Enum):
    """How a step runs; the caller declares it with :meth:`CUDAGraphs.run`."""

    NONE = "none"
    """No CUDA graphs: the compiled pieces run, splitting ops eagerly between them (any size)."""
    PIECEWISE = "piecewise"
    """Each compiled piece replays its graph for the step's size; splitting ops (attention) run eagerly."""
    FULL = "full"
    """One graph of the whole step, splitting ops included; its inputs and outputs are persistent buffers."""


_NONE, _PIECEWISE, _FULL = CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL


class CUDAGraphAddressError(DynamoOnceError):
    """A static input of a captured CUDA graph is no longer at its captured address."""


class CUDAGraphNotCapturedError(DynamoOnceError, LookupError):
    """:meth:`CUDAGraphs.run` of a (mode, size) that was never captured."""


class CUDAGraphCaptureError(DynamoOnceError):
    """A capture that produced no graph (e.g. a PIECEWISE step in which no compiled piece could capture)."""


class _ThreadState(threading.local):
    step: _PiecewiseStep | None = None
    """The PIECEWISE step running on this thread; None: pieces run their compiled code, no graphs."""


thread_state = _ThreadState()
"""Per thread: ``thread_state.step``, set only by :meth:`CUDAGraphs.run` and :meth:`CUDAGraphs.capture`."""


class _PiecewiseStep(dict):
    """The piece graphs of one size, ``{piece: CapturedGraph}``: what a PIECEWISE step at that size replays.

    A dict itself, so that a piece's hit is one lookup (``step.get(piece)``); ``miss`` does the rest.
    """

    def __init__(self, owner: CUDAGraphs, size: int):
        super().__init__()
        self.owner = owner
        self.size = size
        self.capturing = False

    def miss(self, piece: Any, size: int, args: tuple[Any, ...]) -> Any:
        """``piece`` (a ``PiecewisePiece``) has no graph in this step: its graph at another runtime size,
        a capture (capture mode), or its compiled code."""
        owner = self.owner
        table = self if size == self.size else owner._tables.get(size)
        graph = None if table is None else table.get(piece)
        if graph is not None:
            return graph.replay(args)
        fn = piece.code_for(size, args)
        if not self.capturing or not piece.graphs_on:
            return fn(*args)
        return owner._capture_piece(piece, size, fn, args)


def _mode_error(mode: Any, where: str) -> TypeError:
    return TypeError(f"CUDAGraphs.{where}: mode must be a CUDAGraphMode (NONE, PIECEWISE or FULL); got {mode!r}")


def _check_mode(mode: Any, where: str) -> CUDAGraphMode:
    if not isinstance(mode, CUDAGraphMode):
        raise _mode_error(mode, where)
    return mode


def _is_size(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _check_sizes(sizes: Any) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
        raise TypeError(f"CUDAGraphs.capture: sizes must be an iterable of positive ints; got {sizes!r}")
    sizes = list(sizes)
    bad = [n for n in sizes if not _is_size(n)]
    if bad:
        raise ValueError(f"CUDAGraphs.capture: sizes must be positive ints; got {bad!r} in {sizes!r}")
    return sorted(set(sizes), reverse=True)


class CUDAGraphs:
    """Every CUDA graph of one model (one memory pool), keyed by (mode, size).

    Capture at start-up with :meth:`capture`, then run each step with
    :meth:`run`; pick a step's mode with ``(mode, size) in graphs``. Captures
    and runs of one object happen on one thread at a time.
    """

    def __init__(self) -> None:
        self._pool: Any = None  # created at the first capture: constructing needs no CUDA
        self.output_ptrs: set[int] = set()
        """Addresses of the piece graphs' outputs: read in place by later pieces, cloned for the caller."""
        self.static_storages: set[int] = set()
        """Storages of the buffers passed to :meth:`mark_static`."""
        self._tables: dict[int, _PiecewiseStep] = {}  # every size a piece captured at
        self._steps: dict[int, _PiecewiseStep] = {}  # the sizes the caller captured for PIECEWISE
        self._full: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}

    # ---------------------------------------------------------------- queries
    def sizes(self, mode: CUDAGraphMode) -> list[int]:
        """The sizes captured for ``mode``, ascending (NONE captures nothing: it runs every size)."""
        mode = _check_mode(mode, "sizes")
        return sorted(self._steps if mode is _PIECEWISE else self._full if mode is _FULL else ())

    def __contains__(self, key: Any) -> bool:
        """``(mode, size) in graphs``: :meth:`run` can run it (NONE: any positive int size)."""
        if not isinstance(key, tuple) or len(key) != 2:
            raise TypeError(f"CUDAGraphs: membership is tested with a (mode, size) pair; got {key!r}")
        mode, size = key
        mode = _check_mode(mode, "__contains__")
        if mode is _PIECEWISE:
            return size in self._steps
        if mode is _FULL:
            return size in self._full
        return _is_size(size)

    def mark_static(self, *tensors: torch.Tensor) -> None:
        """Declare persistent buffers (a runner's inputs and metadata) that graphs read in place.

        A piece's input that is a view of one is not copied before replay; every replay checks that
        the view is still at its captured address (a view at another offset would be read stale).
        """
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"CUDAGraphs.mark_static: expected tensors; got {type(t).__name__}")
            self.static_storages.add(t.untyped_storage().data_ptr())

    # -------------------------------------------------------------- the step
    def run(self, mode: CUDAGraphMode, size: int, fn: Callable[[int], Any]) -> Any:
        """Run one step of ``size`` (tokens, or sequences for a FULL decode step) in ``mode``.

        NONE: ``fn(size)``, no graphs. PIECEWISE: ``fn(size)``, each compiled piece replaying its graph for
        its size. FULL: replays the whole-step graph of ``size`` and returns the output captured with it;
        ``fn`` is not called, and the output lives in the pool: a later step with graphs may overwrite it.

        Raises:
            CUDAGraphNotCapturedError: ``(mode, size)`` (PIECEWISE or FULL) was never captured.
        """
        # On a decode step's hot path: a dict lookup and, for PIECEWISE, a thread-local set and reset (one call).
        if mode is _FULL:
            entry = self._full.get(size)
            if entry is None:
                raise self._not_captured(mode, size)
            entry[0].replay()
            return entry[1]
        if mode is _PIECEWISE:
            step = self._steps.get(size)
            if step is None:
                raise self._not_captured(mode, size)
            return self._run_in(step, fn, size)
        if mode is _NONE:
            if not _is_size(size):
                raise ValueError(f"CUDAGraphs.run: size must be a positive int; got {size!r}")
            return self._run_in(None, fn, size)
        raise _mode_error(mode, "run")

    @staticmethod
    def _run_in(step: _PiecewiseStep | None, fn: Callable[[int], Any], size: int) -> Any:
        previous = thread_state.step
        thread_state.step = step
        try:
            return fn(size)
        finally:
            thread_state.step = previous

    def _not_captured(self, mode: CUDAGraphMode, size: Any) -> Exception:
        if not _is_size(size):
            return ValueError(f"CUDAGraphs.run: size must be a positive int; got {size!r}")
        return CUDAGraphNotCapturedError(
            f"CUDAGraphs.run: no CUDA graph captured for ({mode.name}, {size}); {mode.name} sizes captured: "
            f"{self.sizes(mode)}. Capture it first, or run the step with CUDAGraphMode.NONE.")

    # ------------------------------------------------------------- capturing
    def capture(self, sizes: Iterable[int], mode: CUDAGraphMode, fn: Callable[[int], Any],
                prepare: Callable[[int], Any] | None = None) -> float:
        """Capture ``fn(size)`` in ``mode`` for each size, largest first (the pool is sized by the first
        captures, smaller graphs reuse its memory), with a progress bar; returns seconds taken.

        For each size: ``prepare(size)`` if given, one warm-up ``fn(size)`` with mode NONE (per-size
        Inductor compiles and autotuning happen there), then the capture. PIECEWISE: ``fn(size)`` runs with
        this object's step in capture mode, and every compiled piece it calls captures its graph for its
        size into this pool. FULL: ``fn(size)`` is captured whole (pieces run their compiled code inside
        it); it must read its inputs from, and leave its outputs in, persistent buffers, and not sync with
        the host. Sizes already captured for ``mode`` are skipped.

        Raises:
            CUDAGraphCaptureError: a PIECEWISE capture in which no piece captured a graph for its size.
        """
        mode = _check_mode(mode, "capture")
        if mode is _NONE:
            raise ValueError("CUDAGraphs.capture: mode NONE runs without graphs; capture PIECEWISE or FULL")
        sizes = _check_sizes(sizes)
        for name, f in (("fn", fn), ("prepare", prepare)):
            if not callable(f) and not (name == "prepare" and f is None):
                raise TypeError(f"CUDAGraphs.capture: {name} must be callable; got {f!r}")
        if not torch.cuda.is_available():
            raise RuntimeError("CUDAGraphs.capture: CUDA graphs need a CUDA device (torch.cuda.is_available() "
                               "is False); run steps with CUDAGraphMode.NONE")
        from tqdm.auto import tqdm

        todo = [n for n in sizes if (mode, n) not in self]
        t0 = time.perf_counter()
        torch.cuda.empty_cache()  # once, not at every capture (compat.quick_graph_captures)
        with compat.quick_graph_captures():
            for size in tqdm(todo, desc=f"capturing CUDA graphs ({mode.name.lower()})", unit="size"):
                if prepare is not None:
                    prepare(size)
                self._run_in(None, fn, size)  # warm-up
                if mode is _PIECEWISE:
                    self._capture_piecewise(size, fn)
                else:
                    self._capture_full(size, fn)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        logger.info("captured %s CUDA graphs for %d sizes in %.1fs", mode.name, len(todo), dt)
        return dt

    def _pool_handle(self) -> Any:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def _table(self, size: int) -> _PiecewiseStep:
        """The piece graphs captured at ``size`` (made empty on first use)."""
        step = self._tables.get(size)
        if step is None:
            step = self._tables[size] = _PiecewiseStep(self, size)
        return step

    def _capture_piecewise(self, size: int, fn: Callable[[int], Any]) -> None:
        step = self._table(size)
        step.capturing = True
        try:
            self._run_in(step, fn, size)
        finally:
            step.capturing = False
        if not step:
            raise CUDAGraphCaptureError(
                f"CUDAGraphs.capture: PIECEWISE at size {size} captured no graph: no compiled piece that fn("
                f"{size}) ran saw {size} tokens. A model must be compiled at level >= 3 on CUDA with CUDA graphs "
                f"on (use_cudagraph, cudagraph_mode != 'none'), traced with exactly one dynamic size (see its "
                f"num_dynamic_sizes), and fn({size}) must run it on {size} tokens (not more than its inputs hold).")
        self._steps[size] = step

    def _capture_full(self, size: int, fn: Callable[[int], Any]) -> None:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool_handle()):
            out = self._run_in(None, fn, size)  # pieces run their compiled code inside: graphs do not nest
        self._full[size] = (graph, out)
        compilation_counter.add("num_cudagraph_captured")
        graph.replay()  # capture ran nothing: make the output real

    def _capture_piece(self, piece: Any, size: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        step = self._table(size)
        graph = CapturedGraph(f"{piece.name}[{size} tokens]", fn, args, self, piece.input_names,
                              piece.static_ptrs, piece.config.debug)
        step[piece] = graph
        return graph.output


_VIEW_MOVED = ("It is a view of a persistent buffer: pass views that start where the captured ones did "
               "(e.g. buffer[:n]).")
_PARAMETER_MOVED = ("A parameter was replaced after capture (e.g. `layer.weight = new`)? Copy into it instead "
                    "(`layer.weight.data.copy_(new)`), or rebuild the model.")


class CapturedGraph:
    """One piece's CUDA graph at one size, in the pool of ``owner``; captured (and run once) on construction."""

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], owner: CUDAGraphs,
                 input_names: list[str], static_ptrs: set[int], debug: bool):
        self.name = name
        self.copy_idx: list[int] = []
        static_args = list(args)
        # (arg, captured address, name, why it moved): views of persistent buffers always, parameters in
        # debug mode; a mismatch raises CUDAGraphAddressError.
        self.address_checks: list[tuple[int, int, str, str]] = []
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                continue
            ptr = a.data_ptr()
            name = input_names[i] if i < len(input_names) else f"arg{i}"
            if isinstance(a, torch.nn.Parameter) or ptr in static_ptrs:
                if debug:
                    self.address_checks.append((i, ptr, name, _PARAMETER_MOVED))
            elif a.untyped_storage().data_ptr() in owner.static_storages:
                self.address_checks.append((i, ptr, name, _VIEW_MOVED))
            elif ptr in owner.output_ptrs:
                pass
            else:
                static_args[i] = a.clone()
                self.copy_idx.append(i)
        self.static_args = static_args
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=owner._pool_handle()):
            out = fn(*static_args)
        self.output = out
        for t in _tensors(out):
            owner.output_ptrs.add(t.data_ptr())
        compilation_counter.add("num_cudagraph_captured")
        # Capture records kernels without running them: replay once so this call's output is real
        # (an eager splitting op after this piece reads it right away).
        self.graph.replay()

    def replay(self, args: tuple[Any, ...]) -> Any:
        static = self.static_args
        for i in self.copy_idx:
            a, s = args[i], static[i]
            if a.data_ptr() != s.data_ptr():
                s.copy_(a)
        for i, ptr, name, why in self.address_checks:
            if args[i].data_ptr() != ptr:
                raise CUDAGraphAddressError(
                    f"{self.name}: input '{name}' is at address {args[i].data_ptr():#x}, but the CUDA graph "
                    f"was captured reading it at {ptr:#x}; replaying would read stale memory. {why}")
        self.graph.replay()
        return self.output


def _tensors(out: Any) -> Iterable[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
