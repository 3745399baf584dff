"""``EngineThread``: one thread runs the engine's steps for the event loop's requests and, after each step,
hands the loop every request the step ended (or, streamed, showed more text of) in one call.

The engine (:class:`models.engine.engine_loop.EngineLoop`) runs steps for whoever waits on it. Before, each
request had a thread of its own waiting in :meth:`LLM.generate`: at 64 clients, 64 threads woke as their
requests ended, each taking the GIL from the thread running the steps, each posting to the loop on its own,
and the turn to run steps passed from thread to thread as their requests ended. Here the requests are
:class:`models.engine.request.Request` objects read between steps on this one thread; the loop wakes once a
step. A request that stops being awaited (the client left) is aborted between two steps, freeing its
blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["EngineThread"]

logger = logging.getLogger(__name__)


class Follow:
    """A request the thread follows: ``notify()`` (on the loop) after a step that ended it or, ``stream``,
    made its visible text longer; ``failed``: an engine error that ended it outside a step."""

    __slots__ = ("request", "notify", "stream", "shown", "failed")

    def __init__(self, request: Any, notify: Callable[[], None], stream: bool) -> None:
        self.request, self.notify, self.stream = request, notify, stream
        self.shown = 0
        self.failed: BaseException | None = None


class EngineThread:
    """Steps of ``engine`` for the requests of ``loop``, on a daemon thread, until :meth:`close`.

    Args:
        engine: the :class:`LLM`'s engine (:attr:`LLM.engine`).
        loop: the event loop the notifications run on.
    """

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._engine, self.loop = engine, loop
        self._cv = threading.Condition()
        self._follows: dict[int, Follow] = {}  # by id(request); under _cv
        self._streams: dict[int, Follow] = {}  # the streamed ones of _follows, looked at after every step
        # scheduler.num_ended when _follows was last looked at in full (-1: look again): a non-streamed
        # request changes only when it ends, so a step that ended none looks at the streams alone (64
        # non-streamed requests: ~10 us a step of reading each one's `done`, on the engine's critical path).
        self._ended = -1
        self._cancelled: list[Any] = []  # sequences to abort before the next step; under _cv
        self._closed = False
        self._seen: tuple[int, int] | None = None  # (stats, steps) at the last look: a step since?
        self._thread = threading.Thread(target=self._run, name="dynamo-once-engine", daemon=True)
        self._thread.start()

    def add(self, request: Any, notify: Callable[[], None], stream: bool) -> Follow:
        """Submit ``request`` (from :meth:`LLM.add_request`) and follow it."""
        follow = Follow(request, notify, stream)
        self._engine.submit([request.seq])  # first: a request followed is always in the engine
        with self._cv:
            self._follows[id(request)] = follow
            if stream:
                self._streams[id(request)] = follow
            self._seen, self._ended = None, -1
            self._cv.notify()
        return follow

    def cancel(self, request: Any) -> None:
        """Stop following ``request``; not ended, it is aborted (its blocks freed) before the next step."""
        with self._cv:
            self._follows.pop(id(request), None)
            self._streams.pop(id(request), None)
            if not request.done:
                self._cancelled.append(request.seq)
                self._cv.notify()

    def alive(self) -> bool:
        """Whether the thread still runs steps (not closed, not ended)."""
        return self._thread.is_alive() and not self._closed

    def close(self) -> None:
        """Abort what is followed and end the thread (after the step running now)."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._follows or self._cancelled or self._closed):
                    self._cv.wait()
                aborts, self._cancelled = self._cancelled, []
                if self._closed:
                    aborts += [f.request.seq for f in self._follows.values()]
                    self._follows.clear()
                    self._streams.clear()
            if aborts:
                self._engine.abort(aborts)
            if self._closed:
                return
            try:
                self._engine.run_until(self._between_steps)
            except BaseException as e:  # noqa: BLE001 - a failed step: its requests carry the error
                logger.debug("engine step failed: %r", e)
                self._fail_rest(e)

    def _between_steps(self) -> bool:
        """``run_until``'s condition, checked between steps (on whichever thread ran the step): notify what
        the last step changed; True (back to :meth:`_run`) when nothing is followed or an abort waits."""
        scheduler = self._engine.scheduler
        stats, ended = scheduler.stats, scheduler.num_ended
        seen = (id(stats), stats.num_steps)
        with self._cv:
            if seen != self._seen or ended != self._ended:  # a step appended tokens (or ended some) since
                # the last look (a launch alone appends none). Checked while another caller's step runs, it
                # may have appended to some requests only: look again after it.
                stepping = self._engine.stepping
                self._seen = None if stepping else seen
                follows = self._follows if ended != self._ended else self._streams
                self._ended = -1 if stepping else ended
                self._deliver(list(follows.values()))
            return not self._follows or bool(self._cancelled) or self._closed

    def _deliver(self, follows: list[Follow]) -> None:
        """With ``_cv`` held: notify, in one call onto the loop, each of ``follows`` that ended (no longer
        followed then) or, streamed, shows more text."""
        ready = []
        for f in follows:
            if f.request.done:
                ready.append(f.notify)
                del self._follows[id(f.request)]
                self._streams.pop(id(f.request), None)
            elif f.stream and len(f.request.visible_text) > f.shown:
                f.shown = len(f.request.visible_text)
                ready.append(f.notify)
        if ready:
            with contextlib.suppress(RuntimeError):  # the loop closed (the server shut down): nobody listens
                self.loop.call_soon_threadsafe(_call_all, ready)

    def _fail_rest(self, error: BaseException) -> None:
        """After ``run_until`` raised: the requests the failed step ended are notified; any it did not end
        (an error outside a step) are aborted and end with ``error``."""
        with self._cv:
            rest = [f for f in self._follows.values() if not f.request.done]
            for f in rest:
                f.failed = error
                del self._follows[id(f.request)]
                self._streams.pop(id(f.request), None)
            self._seen, self._ended = None, -1
            self._deliver(list(self._follows.values()))
        if rest:
            self._engine.abort([f.request.seq for f in rest])
            with contextlib.suppress(RuntimeError):  # the loop closed
                self.loop.call_soon_threadsafe(_call_all, [f.notify for f in rest])


def _call_all(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()
