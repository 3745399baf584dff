"""Levels 3-4: split the Dynamo graph at the splitting ops, compile each piece with Inductor.

Each piece between splitting ops is compiled once for a symbolic token count
and once more, lazily, for each size in ``compile_sizes``; the splitting ops
(attention) run eagerly between pieces.

CUDA graphs are captured only when the caller asks for them, through a
``dispatcher.cuda_graph.CUDAGraphs``: in a PIECEWISE step that it runs (or
captures), each piece replays (or captures) its graph for its runtime token
count, and the model's outputs that a graph wrote are cloned for the caller.
Outside such a step, a model on CUDA runs its compiled pieces, no graphs. A
piece that cannot have graphs (no CUDA, ``use_cudagraph=False``,
``cudagraph_mode="none"``, no dependence on the one dynamic size) and has no
per-size compile is called directly by the split graph. A trace with more than
one dynamic size gets neither per-size compiles nor graphs
(``num_dynamic_sizes`` on the backend and the wrapper tells).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from . import compat, plugins
from .config import CompilationConfig, CompilationLevel
from .counters import compilation_counter
from .cuda_graph import thread_state
from .passes import compile_context, with_compile_size
from .piece_replay import MISS, PieceReplay

logger = logging.getLogger(__name__)

__all__ = ["PiecewiseBackend", "split_graph", "SplitItem", "PiecewisePiece", "PieceCompiles", "structure_key"]


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


def _compile_inductor(gm: torch.fx.GraphModule, example_inputs: list[Any], options: dict[str, Any],
                      size: int | None = None) -> Callable[..., Any]:
    """Inductor-compile one piece for ``size`` tokens (None: symbolic), which its post-grad passes see; a piece
    returning a single value keeps returning it unwrapped."""
    options = with_compile_size(options, size)
    if _returns_tuple(gm):
        with compile_context(options):
            compiled = compat.inductor_compile(gm, example_inputs, options)
    else:
        wrapped = torch.fx.GraphModule(gm, gm.graph.__deepcopy__())
        (output,) = (n for n in wrapped.graph.nodes if n.op == "output")
        output.args = ((output.args[0],),)
        wrapped.recompile()
        with compile_context(options):
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


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', None) or getattr(target, '__name__', None) or target!r}"


def _arg_meta(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return f"T{tuple(a.shape)}{a.stride()}{a.storage_offset()}{a.dtype}{a.device}{a.requires_grad}"
    if isinstance(a, torch.SymInt):
        return f"S{a.node.expr}"
    return f"V{type(a).__name__}:{a!r}"


def structure_key(gm: torch.fx.GraphModule, fake_args: list[Any]) -> str | None:
    """Equal for two pieces that compute the same thing from inputs of the same shapes, dtypes and strides
    (a decoder's layers: the pieces differ only in their inputs' names), so that one Inductor compile serves
    both; None for a piece whose code refers to module state (``get_attr``, ``call_module``) or constants that
    are tensors, which no key here could tell apart."""
    index: dict[torch.fx.Node, int] = {}
    parts = [_arg_meta(a) for a in fake_args]
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = len(index)
        consts: list[Any] = []
        args = torch.fx.node.map_aggregate((node.args, node.kwargs), lambda v: consts.append(v) or v)
        if any(isinstance(c, torch.Tensor) for c in consts):
            return None
        args = torch.fx.node.map_arg(args, lambda n: f"%{index[n]}")
        parts.append(f"{node.op}|{'' if node.op == 'placeholder' else _target_name(node.target)}|{args!r}")
    return "\n".join(parts)


class PieceCompiles:
    """One piece structure's Inductor compiles, shared by every piece with that :func:`structure_key`:
    the symbolic-size compile (made at once) and one per size of ``compile_sizes`` (made on first use)."""

    def __init__(self, name: str, graph: torch.fx.GraphModule, fake_args: list[Any], options: dict[str, Any]):
        self.name = name
        self.graph = graph
        self.options = options
        t0 = time.perf_counter()
        self.symbolic = _compile_inductor(graph, fake_args, options)
        logger.debug("%s: compiled for a symbolic token count in %.2fs", name, time.perf_counter() - t0)
        self.by_size: dict[int, Callable[..., Any]] = {}

    def for_size(self, size: int, args: tuple[Any, ...]) -> Callable[..., Any]:
        fn = self.by_size.get(size)
        if fn is None:
            t0 = time.perf_counter()
            fn = self.by_size[size] = _compile_inductor(self.graph, list(args), self.options, size)
            logger.debug("%s: compiled for %d tokens in %.2fs", self.name, size, time.perf_counter() - t0)
        return fn


class PiecewisePiece:
    """Runs one compiled piece: the symbolic-shape compile, per-size compiles, and (in a PIECEWISE step of
    ``dispatcher.cuda_graph.CUDAGraphs``) its CUDA graph for its runtime size."""

    def __init__(self, name: str, graph: torch.fx.GraphModule, compiles: PieceCompiles, fake_args: list[Any],
                 size_symbol: Any, config: CompilationConfig, graphs_on: bool, static_ptrs: set[int]):
        self.name = name
        self.graph = graph
        self.compiles = compiles  # shared with the pieces of the same structure
        self.config = config
        self.static_ptrs = static_ptrs
        # This piece's own inputs (its layer's weights), which the CUDA-graph address checks name.
        self.input_names = [n.name for n in graph.graph.nodes if n.op == "placeholder"]
        self.symbolic = compiles.symbolic
        self.size_at = _find_size(fake_args, size_symbol)
        self.compile_sizes = set(config.compile_sizes) if self.size_at is not None else set()
        # A piece that does not depend on the token count gets no graph (nothing tells its graphs apart).
        self.graphs_on = graphs_on and self.size_at is not None
        # Nothing per size (the common CPU case): the split graph can call the symbolic compile directly.
        self.trivial = not self.compile_sizes and not self.graphs_on

    def runtime_size(self, args: tuple[Any, ...]) -> int | None:
        if self.size_at is None:
            return None
        i, d = self.size_at
        return int(args[i]) if d is None else args[i].shape[d]

    def code_for(self, size: int | None, args: tuple[Any, ...]) -> Callable[..., Any]:
        """The compiled code for ``size``: its own compile for a size in ``compile_sizes`` (made on first
        use, with ``args`` as example inputs, and shared with the pieces of the same structure), else the
        symbolic one."""
        if size not in self.compile_sizes:
            return self.symbolic
        return self.compiles.for_size(size, args)

    def run_compiled(self, *args: Any) -> Any:
        """A call without CUDA graphs (graphs off for this piece)."""
        return self.code_for(self.runtime_size(args), args)(*args)

    def __call__(self, *args: Any) -> Any:
        """A call with graphs on: replay (or capture) in a PIECEWISE step, else the compiled code."""
        i, d = self.size_at
        size = int(args[i]) if d is None else args[i].shape[d]
        step = thread_state.step
        if step is not None:
            # The hot path of a replayed step: one thread-local read and one dict lookup.
            graph = step.get(self)
            if graph is not None and size == step.size:
                return graph.replay(args)
            return step.miss(self, size, args)
        return self.code_for(size, args)(*args)


def _call_splitting_ops_directly(split_gm: torch.fx.GraphModule, items: list[SplitItem]) -> None:
    """The split graph calls each splitting op's submodule through its generated forward (set in the instance's
    ``__dict__``, which ``self.submod_N`` finds first, as the compiled pieces are), not through ``Module.__call__``
    (hook handling) and ``GraphModule``'s wrapped call: ~2 µs of host time a call on the CPU machine, once a layer
    a step on the piecewise path, where the op runs eagerly. Only the graph's own code calls them so: the module
    stays a child (``named_children``, dumps). An op with an eager function (``plugins.set_splitting_op_eager_impl``)
    is called as that function, not through torch's dispatcher."""
    for it in items:
        if not it.is_splitting_op:
            continue
        changed = False
        for node in it.graph.graph.nodes:
            fn = plugins.get_splitting_op_eager_impl(_op_name(node.target)) if node.op == "call_function" else None
            if fn is not None:
                node.target = fn
                changed = True
        if changed:
            it.graph.recompile()
        compat.materialize(it.graph)
        split_gm.__dict__[it.name] = it.graph.forward


class _CompileInterpreter(torch.fx.Interpreter):
    """Runs the split graph on fake inputs; compiles each piece with its (symbolic) fake arguments. A piece of the
    same structure as an earlier one does not run: its outputs are made from that one's (``dispatcher.piece_replay``)."""

    def __init__(self, split_gm: torch.fx.GraphModule, make_piece: Callable[[str, list[Any], str | None], Any],
                 pieces: set[str]):
        super().__init__(split_gm)
        self.make_piece = make_piece
        self.pieces = pieces
        self.replay = PieceReplay()

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target not in self.pieces:
            return super().call_module(target, args, kwargs)
        args = list(args)
        key = structure_key(getattr(self.module, target), args)
        out = MISS if kwargs else self.replay.replay(key)
        if out is MISS:
            out = super().call_module(target, tuple(args), kwargs)
            self.replay.record(key, args, out)
        self.module.__dict__[target] = self.make_piece(target, args, key)
        return out


def _dynamic_symbols(fake_args: list[Any]) -> set[Any]:
    """The dynamic sizes of a trace: the free symbols of its (fake) tensor inputs' shapes.

    Not of storage offsets: a view at a nonzero offset (the runner's input_ids and positions are rows of
    one buffer) gets a symbolic offset as soon as one of its dims is dynamic, and Dynamo passes it as a
    SymInt argument.
    """
    symbols = set()
    for a in fake_args:
        if isinstance(a, torch.Tensor):
            for s in a.shape:
                if isinstance(s, torch.SymInt):
                    symbols |= s.node.expr.free_symbols
    return symbols


def _graphs_possible(config: CompilationConfig, example_inputs: list[Any]) -> bool:
    """Whether the pieces may have CUDA graphs (captured only when a caller asks, through ``CUDAGraphs``):
    graphs not turned off in the config, and the trace's tensors on CUDA."""
    return (config.use_cudagraph and config.cudagraph_mode != "none" and torch.cuda.is_available()
            and any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs))


def _clone_pool_outputs(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` whose outputs are the caller's: in a PIECEWISE step, an output that a piece graph wrote
    (in the pool) is cloned, so that the next replay does not overwrite it."""

    def run(*args: Any) -> Any:
        out = forward(*args)
        step = thread_state.step
        if step is None:
            return out
        ptrs = step.owner.output_ptrs
        if isinstance(out, (tuple, list)):
            return type(out)(o.clone() if isinstance(o, torch.Tensor) and o.data_ptr() in ptrs else o for o in out)
        if isinstance(out, torch.Tensor) and out.data_ptr() in ptrs:
            return out.clone()
        return out

    return run


class PiecewiseBackend:
    """The Dynamo backend of levels 3-4: split, compile the pieces, return the split graph.

    Attributes:
        num_dynamic_sizes: the number of dynamic sizes of the trace (None before it); per-size
            compiles and CUDA graphs need exactly one, the token count.
        num_piece_compiles: the pieces' distinct structures (:func:`structure_key`): a decoder's middle
            pieces, one per layer, share one Inductor compile per size.
        num_pieces_replayed: the pieces whose fake run before the compiles was skipped, their outputs made from an
            earlier piece's of the same structure (``dispatcher.piece_replay``).
    """

    def __init__(self, config: CompilationConfig, level: CompilationLevel, options: dict[str, Any], owner: str):
        self.config = config
        self.level = level
        self.options = options
        self.owner = owner
        self.split_gm: torch.fx.GraphModule | None = None
        self.items: list[SplitItem] = []
        self.pieces: dict[str, PiecewisePiece] = {}
        self.size_symbol: Any = None  # the one dynamic size (token count) of the traced graph, if there is one
        self.num_dynamic_sizes: int | None = None
        self.num_piece_compiles = 0  # distinct piece structures, each compiled once (per size) for all its pieces
        self.num_pieces_replayed = 0  # pieces not run on fake tensors before their compile (piece_replay)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], fake_args: list[Any] | None = None,
                 static: list[int] | None = None) -> Callable[..., Any]:
        """Split ``gm`` and compile its pieces. From Dynamo: ``example_inputs`` (real tensors, SymInts) only.
        From an AOT artifact (``dispatcher.aot``): the first call's real inputs, the trace's fake inputs
        ``fake_args``, and the indices of the static inputs (parameters, buffers)."""
        t0 = time.perf_counter()
        split_gm, items = split_graph(gm, self.config.splitting_ops)
        compilation_counter.add("num_piecewise_graphs_seen", len(items))
        capturable = {it.name for it in items if not it.is_splitting_op}
        compilation_counter.add("num_piecewise_capturable_graphs_seen", len(capturable))
        whole_inputs = example_inputs if fake_args is None else fake_args  # what a one-piece compile gets
        fake_mode = compat.fake_mode_of(whole_inputs)
        if fake_args is None:
            fake_args = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        symbols = _dynamic_symbols(fake_args)
        self.num_dynamic_sizes = len(symbols)
        self.size_symbol = next(iter(symbols)) if len(symbols) == 1 else None
        if len(symbols) > 1:
            logger.warning("%s: %d dynamic sizes; per-size compiles and CUDA graphs are off (one is supported)",
                           self.owner, len(symbols))
        use_graphs = _graphs_possible(self.config, example_inputs)
        if len(items) == 1 and not items[0].is_splitting_op and not use_graphs and not self.config.compile_sizes:
            # No split point and nothing per size: one Inductor compile of the whole graph, called
            # directly (no split module around it: one frame and one pass of every argument less a call).
            self.split_gm, self.items = split_gm, items
            compiled = _compile_inductor(gm, whole_inputs, self.options)
            logger.info("%s: 1 piece (no splitting op) in %.1fs", self.owner, time.perf_counter() - t0)
            return compiled
        if static is None:  # parameters and buffers: graph inputs that never move between calls
            static = [i for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor) and compat.is_static_input(t)]
        static_ptrs = {example_inputs[i].data_ptr() for i in static}
        self._compile_pieces(split_gm, capturable, static_ptrs, fake_mode, fake_args, use_graphs)
        _call_splitting_ops_directly(split_gm, items)
        self.split_gm, self.items = split_gm, items
        logger.info("%s: %d pieces (%d compiled, %d distinct) in %.1fs", self.owner, len(items), len(capturable),
                    self.num_piece_compiles, time.perf_counter() - t0)
        # The generated forward, not Module.__call__: its hook handling costs ~1.5 µs a call. (Under Dynamo, and
        # for an AOT forward, GraphModules are lazy: their forward is _lazy_forward until the code is generated.)
        compat.materialize(split_gm)
        return _clone_pool_outputs(split_gm.forward) if use_graphs else split_gm.forward

    def _compile_pieces(self, split_gm: torch.fx.GraphModule, capturable: set[str], static_ptrs: set[int],
                        fake_mode: Any, fake_args: list[Any], use_graphs: bool) -> None:
        """Compile each piece on its fake (symbolic) arguments; it replaces its submodule in ``split_gm``."""
        shared: dict[str, PieceCompiles] = {}

        def make_piece(name: str, args: list[Any], key: str | None) -> Callable[..., Any]:
            graph = getattr(split_gm, name)
            compiles = shared.get(key) if key is not None else None
            if compiles is None:
                compiles = PieceCompiles(f"{self.owner}:{name}", graph, args, self.options)
                if key is not None:
                    shared[key] = compiles
            piece = PiecewisePiece(f"{self.owner}:{name}", graph, compiles, args, self.size_symbol, self.config,
                                   use_graphs, static_ptrs)
            self.pieces[name] = piece
            if piece.trivial:
                return piece.symbolic
            return piece if piece.graphs_on else piece.run_compiled

        with fake_mode, compat.python_dispatcher():
            interpreter = _CompileInterpreter(split_gm, make_piece, capturable)
            interpreter.run(*fake_args)
        self.num_pieces_replayed = interpreter.replay.replayed
        logger.debug("%s: %d pieces' fake outputs made from an identical piece's, not run", self.owner,
                     self.num_pieces_replayed)
        self.num_piece_compiles = len({id(p.compiles) for p in self.pieces.values()})
