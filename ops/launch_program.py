"""A recorded sequence of :class:`~ops.triton_utils.BoundLaunch` calls, replayed with new tensor addresses.

The attention op launches the same one to three kernels for every layer of a step, with the same grids,
constexprs and scalars (strides, scale), and only the layer's tensors (q, k, v, its cache, the output) different.
A :class:`~ops.triton_utils.BoundLaunch` call already skips Triton's Python launch path; it still computes, per
launch, its tensors' addresses, the specialization key of its per-call values and the launcher's argument tuple.
A :class:`LaunchProgram`, recorded from one call's launches (:func:`recording`), keeps each launch's whole
argument list with the call's tensors' positions marked, so that a later call with the same specialization (the
caller checks it once for all its launches: dtypes, alignment, scalars, device) costs one list copy, a few
assignments and the C launch, per kernel.

Usage::

    with recording() as calls:
        ...  # the bound launches, as usual
    program = LaunchProgram.build(calls, tensors=(q, k, v, cache, out), constants=(slots,))
    ...
    program(stream, (q.data_ptr(), k.data_ptr(), v.data_ptr(), cache.data_ptr(), out.data_ptr()))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .triton_utils import _RECORDING

__all__ = ["LaunchProgram", "recording"]


@contextlib.contextmanager
def recording() -> Iterator[list[tuple]]:
    """Collect this thread's :class:`~ops.triton_utils.BoundLaunch` calls made inside the block (they launch as
    usual) into the list yielded, for :meth:`LaunchProgram.build`: ``(bound, tensors, addresses, scalars, key)``
    each, the key of the specialization it launched (None: no fast path). Not reentrant."""
    if _RECORDING.calls is not None:
        raise RuntimeError("ops.launch_program.recording: already recording in this thread")
    calls: list[tuple] = []
    _RECORDING.calls = calls
    try:
        yield calls
    finally:
        _RECORDING.calls = None


class LaunchProgram:
    """Launches recorded by :func:`recording`, replayed by ``program(stream, addresses)``: each launch's C launcher
    called with its recorded arguments, the stream and the addresses of the caller's tensors (in the order given to
    :meth:`build`) put in their places. The caller guarantees that a replay's specialization equals the recorded
    call's (the same dtypes, 16-byte alignment of every address, scalars and device): nothing is checked here."""

    __slots__ = ("_steps", "num_launches")

    def __init__(self, steps: list[tuple[Any, list[Any], int, tuple[tuple[int, int], ...], Any]]) -> None:
        self._steps = steps
        self.num_launches = len(steps)

    @classmethod
    def build(cls, calls: list[tuple], tensors: tuple[torch.Tensor, ...],
              constants: tuple[torch.Tensor, ...] = ()) -> LaunchProgram | None:
        """The program of ``calls`` (from :func:`recording`), whose per-call tensors are among ``tensors`` (their
        addresses given at each replay, in this order) or ``constants`` (the same tensor at every replay: its
        address recorded). None when a call did not take the fast path or passed a tensor that is neither (a
        temporary, say, whose address would be stale)."""
        index = {id(t): j for j, t in enumerate(tensors)}
        constant = {id(t) for t in constants}
        steps = []
        for bound, btensors, ptrs, scalars, key in calls:
            entry = bound.fast_entry(key)
            if entry is None:  # the normal launch served it (or no fast path at all)
                return None
            launch, const, order, stream_pos, tensor_pos = entry
            places = []
            for pos, k in tensor_pos:
                t = btensors[k]
                j = index.get(id(t))
                if j is not None:
                    places.append((pos, j))
                elif id(t) not in constant:
                    return None
            steps.append((launch, list(order(const + (0,) + ptrs + scalars)), stream_pos, tuple(places), bound.fast))
        return cls(steps)

    def __call__(self, stream: int, addresses: tuple[int, ...]) -> None:
        for launch, template, stream_pos, places, fast in self._steps:
            args = template.copy()
            args[stream_pos] = stream
            for pos, j in places:
                args[pos] = addresses[j]
            launch(*args)
            fast.fast_launches += 1
