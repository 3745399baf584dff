"""Safety checks of guard-free dispatch, debug mode, dumps and graph-break errors."""

import os

import pytest
import torch

from dispatcher import (
    GraphBreakError,
    compat,
    InputMismatchError,
    ShapeGuardError,
    compilation_counter,
    compile_once,
    support_torch_compile,
)


@support_torch_compile
class Branchy(torch.nn.Module):
    """Valid as one graph only for x.shape[0] >= 4 or only for < 4: not capturable for all sizes."""

    def forward(self, x: torch.Tensor, mode: str = "add", bias: torch.Tensor | None = None) -> torch.Tensor:
        y = x + 1 if x.shape[0] >= 4 else x - 1
        if mode == "double":
            y = y * 2
        return y if bias is None else y + bias


@pytest.fixture(params=["cpp", "python"])
def tensor_check_path(request, monkeypatch):
    """The input check runs through Dynamo's C++ TensorGuards, or (where missing) in Python."""
    if request.param == "python":
        monkeypatch.setattr(compat, "tensor_guards", lambda tensors, dynamic: None)
    return request.param


@pytest.mark.parametrize(
    "given, fragment",
    [
        (torch.zeros(5, 3, 1), "traced as a 2-d torch.float32 tensor on cpu with shape (*, 3)"),
        (torch.zeros(5, 3, dtype=torch.float64), "this call gives a 2-d torch.float64 tensor"),
        (torch.zeros(5, 4), "shape (5, 4)"),
        (torch.zeros(5, 3, device="meta"), "tensor on meta"),
        ([1.0, 2.0], "this call gives a list"),
    ],
)
def test_input_mismatch_names_argument_traced_and_given(level, given, fragment, tensor_check_path):
    with level(2):
        m = Branchy()
    m(torch.zeros(6, 3))
    with pytest.raises(InputMismatchError) as e:
        m(given)
    msg = str(e.value)
    assert "Branchy.forward: argument 'x'" in msg and fragment in msg


def test_constants_and_none_are_checked(level, tensor_check_path):
    with level(2):
        m = Branchy()
    x = torch.zeros(6, 3)
    m(x, "add")
    with pytest.raises(InputMismatchError, match=r"argument 'mode' was traced with the constant 'add'.*str 'double'"):
        m(x, "double")
    with pytest.raises(InputMismatchError, match=r"argument 'bias' was traced with None.*tensor"):
        m(x, bias=torch.ones(3))
    with pytest.raises(TypeError, match="unexpected keyword argument 'nope'"):
        m(x, nope=1)
    # The same call spelled differently (keyword instead of position) passes.
    torch.testing.assert_close(m(x=x, mode="add"), x + 1)


def test_check_inputs_off(level):
    with level(2, check_inputs=False):
        m = Branchy()
    m(torch.zeros(6, 3))
    with compilation_counter.expect(num_dispatched_calls=1):
        m(torch.zeros(6, 3, dtype=torch.float64))  # unchecked: the user took responsibility


def test_without_debug_a_stale_branch_runs_as_documented(level):
    with level(2):
        m = Branchy()
    m(torch.zeros(4, 3))
    # Traced with 4 rows (the x + 1 branch); 3 rows would take x - 1 in eager, but the capture runs x + 1.
    torch.testing.assert_close(m(torch.zeros(3, 3)), torch.ones(3, 3))


def test_debug_mode_raises_on_failing_shape_guard(level):
    with level(2, debug=True):
        m = Branchy()
    m(torch.zeros(4, 3))
    torch.testing.assert_close(m(torch.zeros(9, 3)), torch.ones(9, 3))  # guard s0 >= 4 holds
    with pytest.raises(ShapeGuardError) as e:
        m(torch.zeros(3, 3))
    msg = str(e.value)
    assert ">= 4" in msg and "L['x'].size()[0] = 3" in msg and "Branchy.forward" in msg


def test_debug_mode_from_environment(monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_LEVEL", "2")
    monkeypatch.setenv("DYNAMO_ONCE_DEBUG", "1")
    m = Branchy()
    m(torch.zeros(4, 3))
    with pytest.raises(ShapeGuardError):
        m(torch.zeros(2, 3))


def test_debug_mode_accepts_decode_size_one(level):
    @compile_once
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(0) * 2

    with level(2, debug=True):
        f(torch.ones(5, 2))
        torch.testing.assert_close(f(torch.ones(1, 2)), torch.full((1, 2), 2.0))


def test_dump_path_writes_disassembly_source_and_graph(level, tmp_path):
    with level(2, debug_dump_path=str(tmp_path)):
        m = Branchy()
    m(torch.zeros(4, 3))
    (out,) = [tmp_path / d for d in os.listdir(tmp_path)]
    files = sorted(os.listdir(out))
    assert files == ["fx_graph_0.py", "transformed_code.dis.txt", "transformed_code.py"]
    dis_text = (out / "transformed_code.dis.txt").read_text()
    assert "__compiled_fn" in dis_text and "calls compiled graphs: __compiled_fn" in dis_text
    assert "class GraphModule" in (out / "fx_graph_0.py").read_text()
    src = (out / "transformed_code.py").read_text()
    assert "__compiled_fn" in src or "depyf" in src


def test_dump_path_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DYNAMO_ONCE_COMPILE_LEVEL", "2")
    monkeypatch.setenv("DYNAMO_ONCE_DEBUG_DUMP_PATH", str(tmp_path / "dumps"))
    Branchy()(torch.zeros(4, 3))
    assert len(os.listdir(tmp_path / "dumps")) == 1


def test_graph_break_error_says_where_and_why(level):
    @support_torch_compile
    class Breaks(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            print("side effect")  # a graph break
            return y + 1

    with level(2):
        m = Breaks()
    with pytest.raises(GraphBreakError) as e:
        m(torch.zeros(4, 3))
    msg = str(e.value)
    assert "Breaks.forward cannot be captured as one graph" in msg
    assert "print" in msg and "test_debug.py" in msg


def test_graph_break_allowed_at_level_1(level):
    @support_torch_compile
    class Breaks(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            torch._dynamo.graph_break()
            return y + 1

    with level(1):
        m = Breaks()
    torch.testing.assert_close(m(torch.zeros(4, 3)), torch.ones(4, 3))


def test_counter_expect_reports_mismatch():
    with pytest.raises(AssertionError, match=r"num_graphs_seen: got \+0, expected \+1"):
        with compilation_counter.expect(num_graphs_seen=1):
            pass
    with pytest.raises(ValueError, match="unknown counter"):
        with compilation_counter.expect(num_bogus=1):
            pass
