"""Per engine step, served against offline: where the host time of ``benchmarks.serve --step-profile`` goes.

Issue 14: at 64 clients the engine is busy longer served than offline with the same steps and the same
median decode step. The suspect is the GIL: the HTTP event loop (uvicorn's thread, in the engine's process)
parses the arrival burst and writes the response burst while the engine thread runs steps, and every
switch of the GIL to the loop (``sys.getswitchinterval()``, 5 ms) can hold back the engine thread's next
launch. :class:`StepProfile` wraps every step through :attr:`EngineLoop.step_hook` and records, per step:

- its wall time and the stepping thread's CPU time (``time.thread_time()``): ``wall - cpu`` is time the
  thread did not run, waiting for the GIL or for the device (a synchronizing read: the same served and
  offline, so the difference between the two is the GIL's);
- the event loop thread's CPU time during the step and during the gap after it
  (``time.pthread_getcpuclockid`` of the loop's thread: its CPU clock, read from the engine's thread);
- the gap to the next step (the engine thread's own work between steps, and its waits).

:func:`summary` sums them by phase: ``arrival`` (the steps that started before the last request reached
the engine), ``end`` (those that started after the first step that ended a request: the responses' burst),
``middle`` (the rest), and ``all``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks import common

__all__ = ["COLUMNS", "NOTES", "Step", "StepProfile", "plot", "summary"]

PHASES = ("arrival", "middle", "end", "all")
COLUMNS = ["model", "concurrency", "side", "phase", "steps", "wall_ms", "cpu_ms", "wait_ms", "median_step_ms",
           "gap_ms", "loop_step_ms", "loop_gap_ms", "loop_us_per_req"]
NOTES = [
    "per engine step (the last served batch, the last offline run of the same requests): wall_ms = sum of "
    "step wall times, cpu_ms = the stepping thread's CPU time in them, wait_ms = wall - cpu (not running: the "
    "GIL or a device sync), gap_ms = sum of the gaps to the next step, loop_step_ms / loop_gap_ms = the HTTP "
    "event loop thread's CPU time during the steps / the gaps",
    "loop_us_per_req (served, all): the event loop thread's CPU time over every served batch of the concurrency "
    "(the connections' warm-up batch too) per request",
    "phases: arrival = steps started before the last request reached the engine; end = steps started after "
    "the first step that ended a request; middle = the rest; all = every step",
]


@dataclass
class Step:
    """One step: start (``time.perf_counter``), wall and stepping-thread CPU seconds, the loop thread's CPU
    clock at its start and end (0 without a loop thread), requests it ended."""

    t0: float
    wall: float
    cpu: float
    loop0: float
    loop1: float
    ended: int


class StepProfile:
    """Records every step of ``engine`` (an :class:`EngineLoop`, ``LLM.engine``) until :meth:`close`.

    Args:
        engine: the engine whose :attr:`step_hook` this takes (it must be free).
        loop_thread: ``threading.Thread.ident`` of the event loop's thread, or None (no loop CPU).
    """

    def __init__(self, engine: Any, loop_thread: int | None) -> None:
        if engine.step_hook is not None:
            raise RuntimeError("StepProfile: the engine already has a step_hook")
        self._engine = engine
        self._clock = None if loop_thread is None else time.pthread_getcpuclockid(loop_thread)
        self.steps: list[Step] = []
        engine.step_hook = self._hook

    def loop_cpu(self) -> float:
        """The event loop thread's CPU seconds so far (0 without one)."""
        return 0.0 if self._clock is None else time.clock_gettime(self._clock)

    def _hook(self, step: Callable[[], None]) -> None:
        scheduler = self._engine.scheduler
        ended, loop0, cpu0, t0 = scheduler.num_ended, self.loop_cpu(), time.thread_time(), time.perf_counter()
        try:
            step()
        finally:
            t1, cpu1, loop1 = time.perf_counter(), time.thread_time(), self.loop_cpu()
            self.steps.append(Step(t0, t1 - t0, cpu1 - cpu0, loop0, loop1, scheduler.num_ended - ended))

    def take(self) -> list[Step]:
        """The steps recorded since the last take (then forgotten)."""
        steps, self.steps = self.steps, []
        return steps

    def close(self) -> None:
        self._engine.step_hook = None


def phase_of(steps: list[Step], last_arrival: float | None) -> list[str]:
    """Each step's phase (see the module): ``last_arrival`` (perf_counter) None: every request was in before
    the first step (offline)."""
    first_end = next((s.t0 + s.wall for s in steps if s.ended), float("inf"))
    return ["arrival" if last_arrival is not None and s.t0 < last_arrival else
            "end" if s.t0 >= first_end else "middle" for s in steps]


def summary(steps: list[Step], last_arrival: float | None, **keys: Any) -> list[dict[str, Any]]:
    """One row a phase of ``steps`` (one run's, in order): ``keys`` (model, concurrency, side) first."""
    gaps = [b.t0 - (a.t0 + a.wall) for a, b in zip(steps, steps[1:])] + [0.0]
    loop_gaps = [b.loop0 - a.loop1 for a, b in zip(steps, steps[1:])] + [0.0]
    phases = phase_of(steps, last_arrival)
    rows = []
    for phase in PHASES:
        idx = [i for i, p in enumerate(phases) if phase in ("all", p)]
        walls = [steps[i].wall for i in idx]
        ms = lambda xs: round(sum(xs) * 1e3, 2)  # noqa: E731
        rows.append(dict(**keys, phase=phase, steps=len(idx), wall_ms=ms(walls), cpu_ms=ms(steps[i].cpu for i in idx),
                         wait_ms=ms(steps[i].wall - steps[i].cpu for i in idx),
                         median_step_ms=round(statistics.median(walls) * 1e3, 3) if walls else 0.0,
                         gap_ms=ms(gaps[i] for i in idx),
                         loop_step_ms=ms(steps[i].loop1 - steps[i].loop0 for i in idx),
                         loop_gap_ms=ms(loop_gaps[i] for i in idx)))
    return rows


#: what :func:`plot` draws per phase: the stepping thread's time not running in steps, the loop's CPU in them and
#: between them
PLOTTED = {"wait_ms": "engine wait", "loop_step_ms": "loop CPU in steps", "loop_gap_ms": "loop CPU in gaps"}


def plot(name: str, rows: list[dict[str, Any]], out_dir: str | None) -> str | None:
    """``<name>.png``: per phase (``all`` left out), the engine thread's wait and the event loop's CPU in ms, served
    against offline; a panel per model and concurrency."""
    lines = [dict(run=f"{r['model']}, {r['concurrency']} clients", phase=r["phase"], ms=float(r[key]),
                  line=f"{r['side']}: {what}")
             for r in rows if r["phase"] != "all" for key, what in PLOTTED.items()]
    return common.plot_panels(name, lines, x="phase", y="ms", series="line", panel="run", out_dir=out_dir,
                              title="Engine steps by phase, served against offline: where the engine thread waited "
                                    "and the event loop ran", xlabel="phase", ylabel="ms (sum over the phase's steps)")
