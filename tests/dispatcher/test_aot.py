"""``dispatcher.graph_io`` and ``dispatcher.aot``: a Dynamo graph written down and rebuilt without Dynamo, and what
an AOT artifact refuses. (A second process loading one: tests/models/test_compile_cache.py.)"""

import inspect
import operator
import pickle

import pytest
import torch

from dispatcher import aot, compat, graph_io


def _trace(fn, *args, dynamic_dims=((0,),)):
    """The graph Dynamo hands a backend for ``fn(*args)`` (dims in ``dynamic_dims`` marked dynamic)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for a, dims in zip(args, dynamic_dims):
        compat.mark_dynamic(a, list(dims))
    compat.reset()
    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return graphs[0]


def f(x, w):
    y = torch.nn.functional.linear(x, w).relu()
    return (y * 2.0, y.shape[0] + 1, torch.cat([y, y[:1]])[operator.index(1):])


def test_graph_round_trip_without_dynamo():
    w = torch.randn(4, 3)
    gm = _trace(f, torch.randn(5, 3), w, dynamic_dims=((0,), ()))
    data = pickle.loads(pickle.dumps(graph_io.graph_to_data(gm)))  # plain data
    rebuilt, fakes = graph_io.graph_from_data(data)
    assert [(n.op, n.name, n.target, n.type) for n in rebuilt.graph.nodes] == \
        [(n.op, n.name, n.target, n.type) for n in gm.graph.nodes]
    old = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
    assert [str(getattr(v, "shape", v)) for v in fakes] == [str(getattr(v, "shape", v)) for v in old]
    assert any(isinstance(v, torch.Tensor) and isinstance(v.shape[0], torch.SymInt) for v in fakes)
    x = torch.randn(7, 3)  # another size of the dynamic dim
    real = [x.shape[0] if isinstance(v, torch.SymInt) else x if isinstance(v.shape[0], torch.SymInt) else w
            for v in old]
    for a, b in zip(rebuilt(*real), gm(*real)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def g(x, w, v):
    return (x @ w).relu() + 1.0, (x @ v).relu() - 1.0


def test_rebuilt_example_values_shared_by_description_but_not_inputs():
    """Intermediate nodes of one description share one fake tensor (the rebuild of a 32-layer graph makes a few
    dozen, not thousands); each placeholder keeps its own, and every value keeps its node's shape and strides."""
    w = torch.randn(3, 3)
    gm = _trace(g, torch.randn(5, 3), w, w.clone(), dynamic_dims=((0,), (), ()))
    rebuilt, fakes = graph_io.graph_from_data(graph_io.graph_to_data(gm))
    tensors = [f for f in fakes if isinstance(f, torch.Tensor)]
    assert len({id(f) for f in tensors}) == len(tensors) == 3
    for old, new in zip(gm.graph.nodes, rebuilt.graph.nodes):
        a, b = old.meta.get("example_value"), new.meta.get("example_value")
        if isinstance(a, torch.Tensor):
            assert (str(a.shape), str(a.stride()), a.dtype) == (str(b.shape), str(b.stride()), b.dtype)
    inner = {}
    for node in rebuilt.graph.nodes:
        v = node.meta.get("example_value")
        if node.op != "placeholder" and isinstance(v, torch.Tensor):
            inner.setdefault((str(v.shape), str(v.stride()), v.dtype), set()).add(id(v))
    assert inner and all(len(ids) == 1 for ids in inner.values())
    assert sum(1 for n in rebuilt.graph.nodes if n.op != "placeholder"
               and isinstance(n.meta.get("example_value"), torch.Tensor)) > len(inner)


def test_graph_with_module_state_is_unsupported():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 4))  # get_attr / call_module nodes
    with pytest.raises(graph_io.Unsupported):
        graph_io.graph_to_data(gm)


def test_a_symbol_named_otherwise_is_refused():
    mode = compat.new_fake_mode()
    with pytest.raises(compat.SymbolNameMismatch):
        compat.make_symint(mode, "s99999", "L['x'].size()[0]", 8)


def test_call_spec_and_module_state():
    sig = inspect.signature(lambda x, n=3: None)
    a = aot.call_spec(sig, False, (torch.zeros(4, 2),), {}, {"x": [0]})
    assert a == [("x", "tensor", "torch.float32", "cpu", [None, 2], False), ("n", "const", "3")]
    assert aot.call_spec(sig, False, (torch.zeros(9, 2),), {}, {"x": [0]}) == a  # the dynamic dim is free
    assert aot.call_spec(sig, False, (torch.zeros(4, 3),), {}, {"x": [0]}) != a
    assert aot.call_spec(sig, False, (torch.zeros(4, 2),), {"n": 4}, {"x": [0]}) != a
    m = torch.nn.Sequential(torch.nn.LayerNorm(4))
    state = aot.module_state(m)
    assert ("0", "eps", repr(1e-5)) in state
    m[0].eps = 1e-6
    assert aot.module_state(m) != state


def test_unloadable_payloads_raise():
    fn = f
    with pytest.raises(pickle.UnpicklingError):  # no classes or functions in an artifact
        aot.load(pickle.dumps(torch.nn.Linear), fn, [], [])
    with pytest.raises(ValueError):
        aot.load(pickle.dumps({"format": -1}), fn, [], [])
    with pytest.raises(ValueError):
        aot.load(pickle.dumps({"format": aot.FORMAT}), fn, [], [])


def test_quick_graph_captures_restores_what_it_stubs():
    import gc

    collect, empty = gc.collect, torch.cuda.empty_cache
    with compat.quick_graph_captures():
        assert gc.collect() == 0 and torch.cuda.empty_cache() is None
        assert gc.collect is not collect and torch.cuda.empty_cache is not empty
    assert gc.collect is collect and torch.cuda.empty_cache is empty
