"""Levels 3-4: split the Dynamo graph at the splitting ops, compile each piece with Inductor.

Each piece between splitting ops is compiled once for a symbolic token count
and once more, lazily, for each size in ``compile_sizes``; the splitting ops
(attention) run eagerly between pieces. With CUDA graphs on, each piece is
captured once per size in ``cudagraph_capture_sizes`` (first call at a size:
warm-up, second: capture, then replay), all in one memory pool; other sizes
run the compiled pieces without graphs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from . import compat
from .config import CompilationConfig, CompilationLevel
from .counters import compilation_counter
from .cuda_graph import capturing_full_graph

logger = logging.getLogger(__name__)

__all__ = ["PiecewiseBackend", "split_graph", "SplitItem", "PiecewisePiece"]


def _op_name(target: Any) -> str | None:
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name
    return getattr(target, "_qualified_op_name", None)  # OpOverloadPacket


@dataclass
class SplitItem:
    name: str
    index: int
    is_splitting_op: bool
    graph: torch.fx.GraphModule


def split_graph(gm: torch.fx.GraphModule, splitting_ops: list[str]) -> tuple[torch.fx.GraphModule, list[SplitItem]]:
    """Split ``gm`` so that every call of a splitting op is a submodule of its own, in graph order."""
    from torch.fx.passes.split_module import split_module

    ops = set(splitting_ops)
    sub_id = 0
    node_to_sub: dict[torch.fx.Node, int] = {}
    split_ids: set[int] = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and _op_name(node.target) in ops:
            sub_id += 1
            node_to_sub[node] = sub_id
            split_ids.add(sub_id)
            sub_id += 1
        else:
            node_to_sub[node] = sub_id
    split_gm = split_module(gm, None, lambda n: node_to_sub[n], keep_original_order=True)
    items = []
    for name, mod in split_gm.named_children():
        index = int(name.rsplit("_", 1)[1])
        items.append(SplitItem(name, index, index in split_ids, mod))
    items.sort(key=lambda it: it.index)
    return split_gm, items


def _returns_tuple(gm: torch.fx.GraphModule) -> bool:
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


def _compile_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any]) -> Callable[..., Any]:
    """Inductor-compile one piece; a piece returning a single value keeps returning it unwrapped."""
    if _returns_tuple(gm):
        compiled = compat.inductor_compile(gm, example_inputs, options)
    else:
        wrapped = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
        (output,) = (n for n in wrapped.graph.nodes if n.op == "output")
        output.args = ((output.args[0],),)
        wrapped.recompile()
        inner = compat.inductor_compile(wrapped, example_inputs, options)

        def compiled(*args: Any) -> Any:
            return inner(*args)[0]

    compilation_counter.add("num_backend_compilations")
    return compiled


def _find_size(fake_args: list[Any], symbol: Any) -> tuple[int, int | None] | None:
    """Where a piece's runtime token count is: ``(arg, None)`` for a SymInt argument, ``(arg, dim)`` for a
    tensor dim of that symbol; None when the piece does not depend on it."""
    if symbol is None:
        return None
    for i, a in enumerate(fake_args):
        if isinstance(a, torch.SymInt) and a.node.expr == symbol:
            return i, None
    for i, a in enumerate(fake_args):
        if isinstance(a, torch.Tensor):
            for d, s in enumerate(a.shape):
                if isinstance(s, torch.SymInt) and s.node.expr == symbol:
                    return i, d
    return None


class PiecewisePiece:
    """Runs one compiled piece: the symbolic-shape compile, per-size compiles, per-size CUDA graphs."""

    def __init__(self, name: str, graph: torch.fx.GraphModule, fake_args: list[Any], size_symbol: Any,
                 config: CompilationConfig, options: dict[str, Any], pool: Any, static_ptrs: set[int]):
        self.name = name
        self.graph = graph
        self.config = config
        self.options = options
        self.pool = pool
        self.static_ptrs = static_ptrs
        self.input_names = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
        t0 = time.perf_counter()
        self.symbolic = _compile_inductor(graph, fake_args, options)
        logger.debug("%s: compiled for a symbolic token count in %.2fs", name, time.perf_counter() - t0)
        self.size_at = _find_size(fake_args, size_symbol)
        self.compile_sizes = set(config.compile_sizes) if self.size_at is not None else set()
        self.capture_sizes = (set(config.cudagraph_capture_sizes)
                              if self.size_at is not None and pool is not None else set())
        self.by_size: dict[int, Callable[..., Any]] = {}
        self.graphs: dict[int, Any] = {}
        self.warmed: set[int] = set()
        # Nothing per size (the common CPU case): the split graph can call the symbolic compile directly.
        self.trivial = not self.compile_sizes and not self.capture_sizes

    def runtime_size(self, args: tuple[Any, ...]) -> int | None:
        if self.size_at is None:
            return None
        i, d = self.size_at
        return int(args[i]) if d is None else args[i].shape[d]

    def __call__(self, *args: Any) -> Any:
        size = self.runtime_size(args)
        if size is None or (size not in self.compile_sizes and size not in self.capture_sizes):
            return self.symbolic(*args)
        fn = self.by_size.get(size)
        if fn is None:
            if size in self.compile_sizes:
                t0 = time.perf_counter()
                fn = _compile_inductor(self.graph, list(args), self.options)
                logger.debug("%s: compiled for %d tokens in %.2fs", self.name, size, time.perf_counter() - t0)
            else:
                fn = self.symbolic
            self.by_size[size] = fn
        if size not in self.capture_sizes or capturing_full_graph():
            return fn(*args)
        graph = self.graphs.get(size)
        if graph is not None:
            return graph.replay(args)
        if size not in self.warmed:
            self.warmed.add(size)
            return fn(*args)
        from .cuda_graph import CapturedGraph

        graph = CapturedGraph(f"{self.name}[{size} tokens]", fn, args, self.pool, self.input_names,
                              self.static_ptrs, self.config.debug)
        self.graphs[size] = graph
        return graph.output


class _CompileInterpreter(torch.fx.Interpreter):
    """Runs the split graph on fake inputs; compiles each piece with its (symbolic) fake arguments."""

    def __init__(self, split_gm: torch.fx.GraphModule, make_piece: Callable[[str, list[Any]], Any],
                 pieces: set[str]):
        super().__init__(split_gm)
        self.make_piece = make_piece
        self.pieces = pieces

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        out = super().call_module(target, args, kwargs)
        if target in self.pieces:
            self.module.__dict__[target] = self.make_piece(target, list(args))
        return out


class PiecewiseBackend:
    """The Dynamo backend of levels 3-4: split, compile the pieces, return the split graph."""

    def __init__(self, config: CompilationConfig, level: CompilationLevel, options: dict[str, Any], owner: str):
        self.config = config
        self.level = level
        self.options = options
        self.owner = owner
        self.split_gm: torch.fx.GraphModule | None = None
        self.items: list[SplitItem] = []
        self.pieces: dict[str, PiecewisePiece] = {}
        self.size_symbol: Any = None  # the one dynamic size (token count) of the traced graph, if there is one
        self.pool = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        t0 = time.perf_counter()
        split_gm, items = split_graph(gm, self.config.splitting_ops)
        compilation_counter.add("num_piecewise_graphs_seen", len(items))
        capturable = {it.name for it in items if not it.is_splitting_op}
        compilation_counter.add("num_piecewise_capturable_graphs_seen", len(capturable))
        use_graphs = self.config.use_cudagraph and self.config.cudagraph_mode != "none" and torch.cuda.is_available()
        if len(items) == 1 and not items[0].is_splitting_op and not use_graphs and not self.config.compile_sizes:
            # No split point and nothing per size: one Inductor compile of the whole graph, called
            # directly (no split module around it: one frame and one pass of every argument less a call).
            self.split_gm, self.items = split_gm, items
            compiled = _compile_inductor(gm, example_inputs, self.options)
            logger.info("%s: 1 piece (no splitting op) in %.1fs", self.owner, time.perf_counter() - t0)
            return compiled
        if use_graphs and self.pool is None:
            from .cuda_graph import CUDAGraphPool

            self.pool = CUDAGraphPool()
        fake_mode = compat.fake_mode_of(example_inputs)
        fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        # The dynamic sizes are the symbols of tensor shapes. Not of storage offsets: a view at a
        # nonzero offset (the runner's input_ids and positions are rows of one buffer) gets a symbolic
        # offset as soon as one of its dims is dynamic, and Dynamo passes it as a SymInt argument.
        symbols = set()
        for a in fake_args:
            if isinstance(a, torch.Tensor):
                for s in a.shape:
                    if isinstance(s, torch.SymInt):
                        symbols |= s.node.expr.free_symbols
        size_symbol = next(iter(symbols)) if len(symbols) == 1 else None
        self.size_symbol = size_symbol
        if len(symbols) > 1:
            logger.warning("%s: %d dynamic sizes; per-size compiles and CUDA graphs are off (one is supported)",
                           self.owner, len(symbols))
        # Parameters and buffers: graph inputs that never move between calls.
        static_ptrs = {t.data_ptr() for t in example_inputs if isinstance(t, torch.Tensor) and compat.is_static_input(t)}

        def make_piece(name: str, args: list[Any]) -> Callable[..., Any]:
            piece = PiecewisePiece(f"{self.owner}:{name}", getattr(split_gm, name), args, size_symbol,
                                   self.config, self.options, self.pool if use_graphs else None, static_ptrs)
            self.pieces[name] = piece
            return piece.symbolic if piece.trivial else piece

        with fake_mode, compat.python_dispatcher():
            _CompileInterpreter(split_gm, make_piece, capturable).run(*fake_args)
        self.split_gm, self.items = split_gm, items
        logger.info("%s: %d pieces (%d compiled) in %.1fs", self.owner, len(items), len(capturable),
                    time.perf_counter() - t0)
        # The generated forward, not Module.__call__: its hook handling costs ~1.5 µs a call.
        forward = split_gm.forward
        if not use_graphs:
            return forward
        pool = self.pool

        def run(*args: Any) -> Any:
            out = forward(*args)
            # A graph's outputs are overwritten by its next replay: hand the caller its own copy.
            if isinstance(out, (tuple, list)):
                return type(out)(o.clone() if isinstance(o, torch.Tensor) and o.data_ptr() in pool.output_ptrs
                                 else o for o in out)
            return out

        return run
