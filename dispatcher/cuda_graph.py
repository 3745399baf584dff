"""CUDA-graph capture and replay of one compiled piece, per token count.

Inputs of a captured graph must sit at the addresses it was captured with.
At capture each tensor input is sorted into one of three kinds:

- parameters and buffers that do not move (``nn.Parameter``, or flagged static
  by the caller): used in place; debug mode checks at every replay that they
  are still at the captured address (a reassigned ``layer.weight`` is caught);
- outputs of graphs captured earlier in the same pool (the previous piece):
  used in place, they are static by construction;
- views of persistent buffers declared with :func:`mark_static_buffers` (a
  runner's inputs): used in place; every replay checks the address;
- anything else (model inputs, the eager splitting op's output): copied into
  a buffer owned by the graph before each replay, unless it already is that
  buffer (a runner that writes into persistent inputs pays no copy).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .counters import compilation_counter
from .errors import DynamoOnceError

logger = logging.getLogger(__name__)

__all__ = ["CUDAGraphPool", "CapturedGraph", "CUDAGraphAddressError", "FullGraphs", "capture_sizes",
           "capturing_full_graph", "mark_static_buffers"]

_full_capture = threading.local()


def capturing_full_graph() -> bool:
    """Whether a whole-step graph is being captured on this thread (pieces then skip their own graphs)."""
    return getattr(_full_capture, "active", False)


class CUDAGraphAddressError(DynamoOnceError):
    """Debug mode: a static input of a captured CUDA graph is no longer at its captured address."""


_static_storages: set[int] = set()


def mark_static_buffers(*tensors: torch.Tensor) -> None:
    """Declare persistent buffers (a runner's inputs and metadata) that graphs may read in place.

    A graph input that is a view of one is not copied before replay; every replay checks that
    the view is still at its captured address (a view at another offset would be read stale).
    """
    for t in tensors:
        _static_storages.add(t.untyped_storage().data_ptr())


class CUDAGraphPool:
    """One memory pool shared by every graph of a model, and the addresses of the graphs' outputs."""

    def __init__(self) -> None:
        self.handle = torch.cuda.graph_pool_handle()
        self.output_ptrs: set[int] = set()


_VIEW_MOVED = ("It is a view of a persistent buffer: pass views that start where the captured ones did "
               "(e.g. buffer[:n]).")
_PARAMETER_MOVED = ("A parameter was replaced after capture (e.g. `layer.weight = new`)? Copy into it instead "
                    "(`layer.weight.data.copy_(new)`), or rebuild the model.")


class CapturedGraph:
    def __init__(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...], pool: CUDAGraphPool,
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
            elif a.untyped_storage().data_ptr() in _static_storages:
                self.address_checks.append((i, ptr, name, _VIEW_MOVED))
            elif ptr in pool.output_ptrs:
                pass
            else:
                static_args[i] = a.clone()
                self.copy_idx.append(i)
        self.static_args = static_args
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool.handle):
            out = fn(*static_args)
        self.output = out
        for t in _tensors(out):
            pool.output_ptrs.add(t.data_ptr())
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


def capture_sizes(capture: Callable[[int], Any], sizes: Iterable[int], desc: str = "capturing CUDA graphs") -> float:
    """Call ``capture(size)`` for each size, largest first, with a progress bar; returns seconds taken.

    Largest first: the pool is sized by the first captures and smaller graphs reuse its memory.
    """
    from tqdm.auto import tqdm

    sizes = sorted(set(sizes), reverse=True)
    t0 = time.perf_counter()
    for size in tqdm(sizes, desc=desc, unit="size"):
        capture(size)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    logger.info("captured CUDA graphs for %d sizes in %.1fs", len(sizes), dt)
    return dt


class FullGraphs:
    """Whole-step CUDA graphs, one per key (e.g. a padded decode batch size), attention included.

    ``fn`` must read its inputs from, and leave its outputs in, persistent
    buffers (the runner's), and launch no host syncs. While a step is
    captured, piecewise pieces run their compiled code without their own
    graphs (graphs cannot nest). Captures share one pool.
    """

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Any, tuple[torch.cuda.CUDAGraph, Any]] = {}

    def __contains__(self, key: Any) -> bool:
        return key in self.graphs

    def capture(self, key: Any, fn: Callable[[], Any], warmup: int = 1) -> Any:
        for _ in range(warmup):
            with self._bypass_pieces():
                fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with self._bypass_pieces(), torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs[key] = (graph, out)
        compilation_counter.add("num_cudagraph_captured")
        graph.replay()  # capture ran nothing: make the returned output real
        return out

    def replay(self, key: Any) -> Any:
        graph, out = self.graphs[key]
        graph.replay()
        return out

    @staticmethod
    @contextlib.contextmanager
    def _bypass_pieces() -> Iterator[None]:
        previous = capturing_full_graph()
        _full_capture.active = True
        try:
            yield
        finally:
            _full_capture.active = previous
