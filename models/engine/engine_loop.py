"""``EngineLoop``: one engine, callers on any threads; each caller's sequences join the running batch.

Every request (each :meth:`LLM.generate`, :meth:`LLM.chat`, :meth:`LLM.run` call, each stream) submits
its sequences to the one :class:`.scheduler.Scheduler`, then runs steps until its own sequences have
ended. Steps are taken in turns: one thread at a time runs a step, and a step advances every sequence in
the engine, whoever submitted it, so concurrent callers share batches (continuous batching) instead of
queueing behind each other, and no thread is started. A caller whose sequences ended in another
caller's step returns as soon as that step is over. A step that raises ends every sequence in the engine
with that error: the caller that ran it gets the exception, the others a ``RuntimeError`` from it.

Without concurrent callers this is a plain loop over :meth:`Scheduler.step` (a lock and a condition
check a step, ~1 us).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .scheduler import Execute, Scheduler
from .sequence import Seq
from .stats import GenerateStats

__all__ = ["EngineLoop"]


class EngineLoop:
    """Turns at running :meth:`Scheduler.step` for callers on several threads.

    Args:
        scheduler: the engine's batching state.
        execute: one step's forward (:meth:`LLM._execute`).
        on_idle: called (between steps) when no sequence is left in the engine.
    """

    def __init__(self, scheduler: Scheduler, execute: Execute, on_idle: Callable[[], None]) -> None:
        self.scheduler = scheduler
        self._execute = execute
        self._on_idle = on_idle
        self._lock = threading.Lock()
        # Threads waiting for a step to end: (their condition, its Condition on _lock). After a step only
        # those whose condition now holds wake, and, when the thread that ran it leaves, one more to take
        # the turn: with 64 callers, a step wakes the few that finished, not all 64 (whose wake-ups, each
        # taking the GIL, delayed the next step).
        self._waiters: list[tuple[Callable[[], bool], threading.Condition]] = []
        self._busy = False  # a thread is running a step
        self._incoming: list[Seq] = []  # submitted, to be added to the scheduler before the next step
        self._t_start = 0.0
        #: Runs each step, on the thread that runs it, as ``step_hook(step)``: it must call the zero-argument
        #: ``step`` exactly once and let its exception through. For measurements around a step (e.g.
        #: ``benchmarks.serve_steps``: wall and thread CPU times); None, the default, costs nothing.
        self.step_hook: Callable[[Callable[[], None]], None] | None = None

    @property
    def num_incoming(self) -> int:
        """Sequences submitted and not yet handed to the scheduler (before the next step)."""
        return len(self._incoming)

    @property
    def stepping(self) -> bool:
        """A step is running now (a condition checked now may see it half done)."""
        return self._busy

    def _idle(self) -> bool:
        return not self._busy and not self._incoming and not self.scheduler.has_unfinished

    def submit(self, seqs: list[Seq]) -> None:
        """Queue ``seqs`` for the next step. Into an idle engine, this starts new ``scheduler.stats``
        (the stats of one call when calls do not overlap)."""
        with self._lock:
            if self._idle():
                self.scheduler.stats = GenerateStats()
                self._t_start = time.perf_counter()
            self._incoming.extend(seqs)

    def _wait(self, ready: Callable[[], bool]) -> None:
        """With ``_lock`` held: sleep until a step ends with ``ready()``, or with this thread handed the turn
        (no step running)."""
        entry = (ready, threading.Condition(self._lock))
        self._waiters.append(entry)
        try:
            while self._busy and not ready():
                entry[1].wait()
        finally:
            self._waiters.remove(entry)

    def _wake(self, stepper_done: bool) -> None:
        """With ``_lock`` held, after a step: wake the waiters whose condition holds; if the thread that ran
        the step is leaving, also the first other waiter, which runs the next one."""
        handed = not stepper_done
        for ready, cond in self._waiters:
            if ready():
                cond.notify()
            elif not handed:
                cond.notify()
                handed = True

    def run_until(self, done: Callable[[], bool]) -> None:
        """Run steps, in turn with other threads, until ``done()`` (checked between steps)."""
        while True:
            with self._lock:
                if self._busy and not done():
                    self._wait(done)
                if done():
                    return
                if self._incoming:
                    self.scheduler.add(self._incoming)
                    self._incoming = []
                if not self.scheduler.has_unfinished:
                    raise RuntimeError("EngineLoop: waiting on sequences that were never submitted")
                self._busy = True
            try:
                if self.step_hook is None:
                    self.scheduler.step(self._execute)
                else:
                    self.step_hook(lambda: self.scheduler.step(self._execute))
            except BaseException as e:
                with self._lock:
                    self.scheduler.fail(e)
                raise
            finally:
                with self._lock:
                    self._busy = False
                    self.scheduler.stats.total_s = time.perf_counter() - self._t_start
                    if self._idle():
                        self._on_idle()
                    self._wake(done())

    def between_steps(self, fn: Callable[[], object]) -> object:
        """``fn()`` with no step running (it waits for the one running to end), its result."""
        with self._lock:
            if self._busy:
                self._wait(lambda: not self._busy)
            return fn()

    def abort(self, seqs: list[Seq]) -> None:
        """End ``seqs`` (those not ended yet: ``finish_reason`` "abort") between two steps."""
        with self._lock:
            if self._busy:
                self._wait(lambda: not self._busy)
            gone = {id(s) for s in seqs}
            for seq in self._incoming:
                if id(seq) in gone and not seq.done:
                    seq.finish_reason = "abort"  # never reached the scheduler
            self._incoming = [s for s in self._incoming if id(s) not in gone]
            self.scheduler.abort(seqs)
            if self._idle():
                self._on_idle()
            self._wake(True)
