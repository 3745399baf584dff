"""``AsyncLLM``: the event loop's side of :class:`models.LLM`; engine steps never run on the loop.

A request is checked on the loop (:meth:`LLM.add_request`: a bad prompt raises there, the caller's 400) and
submitted to the engine, whose steps one thread runs (:class:`.engine_thread.EngineThread`): a request that
arrives joins the running batch at the next step (continuous batching), none waits for another to end, and
after each step the thread wakes the loop once for every request the step ended (and every stream it showed
more text of). A request whose coroutine stops awaiting it (a streamed client that disconnected, a
cancelled handler) is aborted between two steps, freeing its cache blocks. A request that is not streamed
gets nothing before its end: a client that leaves it is noticed only if the server cancels its handler.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from .engine_thread import EngineThread, Follow

__all__ = ["AsyncLLM"]


class AsyncLLM:
    """Requests of an :class:`LLM` as coroutines.

    Args:
        llm: the engine (with a tokenizer).
        metrics: told each streamed request's first chunk and each request's end (``.metrics.ServerMetrics``).
    """

    def __init__(self, llm: Any, metrics: Any = None) -> None:
        self.llm = llm
        self.metrics = metrics
        self._thread: EngineThread | None = None  # started by the first request, on its loop

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **options: Any) -> dict[str, Any]:
        """The conversation through the tokenizer's chat template, as :meth:`LLM.chat` renders it (without the
        assistant's header when ``add_generation_prompt`` is False; with ``tools`` shown as the template shows
        them; ``options``: more of ``apply_chat_template``'s keywords and the template's variables)."""
        extra = options if tools is None else {**options, "tools": tools}
        prompt = self.llm.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        return {"prompt_token_ids": prompt.token_ids}

    def problem(self) -> str | None:
        """Why the engine cannot take requests (its thread has ended, or the server is shutting down); None
        while it can (its thread starts with the first request)."""
        if self._thread is not None and not self._thread.alive():
            return "the engine thread has ended"
        return None

    def _engine_thread(self) -> EngineThread:
        """The engine thread of the running loop (a new loop, e.g. a server started again: a new thread; the
        old loop's requests, which nobody can await any more, are aborted)."""
        loop = asyncio.get_running_loop()
        if self._thread is None or self._thread.loop is not loop:
            self.shutdown()
            self._thread = EngineThread(self.llm.engine, loop)
        return self._thread

    async def stream(self, prompt: Any, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs as :meth:`LLM.stream_outputs` gives them (the last one final).

        Raises:
            ValueError: a prompt the engine refuses (too long, empty, bad ids), before anything is yielded.
        """
        arrival = time.perf_counter()
        request = self.llm.add_request(prompt, params)
        thread = self._engine_thread()
        ready = asyncio.Event()
        follow = thread.add(request, ready.set, stream=True)
        shown = 0
        try:
            while True:
                await ready.wait()
                ready.clear()
                done = request.done  # read before the text: once ended, the text read after it is final
                _raise_failed(request, follow)
                if done:
                    out = request.output()
                    if not shown and out.text and self.metrics is not None:  # its first text comes with its end
                        self.metrics.first_output(time.perf_counter() - arrival)
                    yield self._ended(out, arrival)
                    return
                text = request.visible_text
                if len(text) > shown:
                    if not shown and self.metrics is not None:
                        self.metrics.first_output(time.perf_counter() - arrival)
                    shown = len(text)
                    yield request.partial_output(text)
        finally:
            if not request.done:
                thread.cancel(request)

    async def generate(self, prompt: Any, params: SamplingParams) -> RequestOutput:
        """The request's final output (:meth:`LLM.generate`'s), awaited with no wake-up before its end.

        Raises:
            ValueError: a prompt the engine refuses (too long, empty, bad ids).
        """
        arrival = time.perf_counter()
        request = self.llm.add_request(prompt, params)
        thread = self._engine_thread()
        ended = asyncio.get_running_loop().create_future()
        follow = thread.add(request, lambda: ended.done() or ended.set_result(None), stream=False)
        try:
            await ended
        finally:
            if not request.done:  # cancelled while waiting
                thread.cancel(request)
        _raise_failed(request, follow)
        return self._ended(request.output(), arrival)

    def _ended(self, out: RequestOutput, arrival: float) -> RequestOutput:
        if self.metrics is not None:
            self.metrics.ended(out, time.perf_counter() - arrival)
        return out

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.close()


def _raise_failed(request: Any, follow: Follow) -> None:
    error = request.error or follow.failed
    if error is not None:
        raise RuntimeError(f"LLM: a step failed: {error!r}") from error
