"""ops.launch_program: launches recorded from BoundLaunch calls, replayed with other tensors' addresses, give the
C launcher exactly the arguments the bound launches would; anything the program cannot replay faithfully (a
launch the fast path did not serve, a temporary tensor) builds no program.

On the CPU no Triton kernel runs outside the interpreter: the launches go to the stand-in compiled launcher of
``test_fast_launch`` (a real JITFunction whose ``run`` and C launcher record their calls)."""

import threading

import pytest
import torch

from ops.launch_program import LaunchProgram, recording
from ops.triton_utils import Slot

from ops_testing import fake_jit as _fake_jit

triton = pytest.importorskip("triton")


def _two_launches(monkeypatch):
    """Two bound launches of the stand-in kernel, ``(x, n)`` and ``(y, n)`` per call, as a caller's step."""
    fast, runs, launcher = _fake_jit(monkeypatch)
    first = fast.bind((4, 2), (Slot.tensor(0), Slot.scalar(0)), BLOCK=128)
    second = fast.bind((8,), (Slot.tensor(0), Slot.scalar(0)), BLOCK=64)

    def step(x, y, n=32, target=(0, 777)):
        first((x,), (n,), target)
        second((y,), (n,), target)

    return fast, runs, launcher, step


def test_replay_passes_the_launcher_what_the_bound_launches_would(monkeypatch):
    fast, runs, launcher, step = _two_launches(monkeypatch)
    x, y = torch.zeros(64), torch.zeros(32)
    step(x, y)  # compiles (through run), then the bound launches take their fast path
    with recording() as calls:
        step(x, y)
    assert len(calls) == 2 and len(launcher.calls) == 2
    program = LaunchProgram.build(calls, (x, y))
    assert program is not None and program.num_launches == 2
    x2, y2 = torch.zeros(64), torch.zeros(32)
    launcher.calls.clear()
    step(x2, y2, target=(0, 555))
    expected = list(launcher.calls)
    launcher.calls.clear()
    before = fast.fast_launches
    program(555, (x2.data_ptr(), y2.data_ptr()))
    assert launcher.calls == expected and fast.fast_launches == before + 2
    assert expected[0][3] == 555 and expected[0][-3] == x2.data_ptr()  # the stream and the new addresses
    assert expected[1][-3] == y2.data_ptr() and expected[1][-2] == 32
    assert len(runs) == 2  # each kernel compiled once, at the first step: nothing since


def test_no_program_for_what_a_replay_would_get_wrong(monkeypatch):
    fast, runs, launcher, step = _two_launches(monkeypatch)
    x, y = torch.zeros(64), torch.zeros(32)
    step(x, y)
    with recording() as calls:
        step(x, y)
    assert LaunchProgram.build(calls, (x,)) is None  # y is neither the caller's nor a constant: a temporary, say
    assert LaunchProgram.build(calls, (x,), constants=(y,)) is not None  # y the same tensor at every replay
    with recording() as calls:
        step(x[1:], y)  # a new specialization: the first launch compiles through run, not the fast path
    assert LaunchProgram.build(calls, (x[1:], y)) is None


def test_recording_is_this_threads_and_not_reentrant(monkeypatch):
    fast, runs, launcher, step = _two_launches(monkeypatch)
    x, y = torch.zeros(64), torch.zeros(32)
    step(x, y)
    with recording() as calls:
        other = threading.Thread(target=step, args=(x, y))
        other.start()
        other.join()
        assert calls == []  # another thread's launches are not this recording's
        with pytest.raises(RuntimeError, match="already recording"):
            with recording():
                pass
    with recording() as again:  # ended: a new one starts empty
        step(x, y)
    assert len(again) == 2
