"""``AsyncLLM``: the event loop's side of :class:`models.LLM`; engine steps never run on the loop.

Each request runs on a thread of a pool (as many threads as the engine takes sequences a step): a streamed
one iterates :meth:`LLM.stream_outputs`, any other calls :meth:`LLM.generate`. The threads share the one engine loop (:mod:`models.engine.engine_loop`):
whichever holds the turn runs a step for every sequence in the engine, so a request that arrives joins the
running batch at the next step (continuous batching) and none waits for another to end. Each streamed output
is handed to the request's coroutine through ``loop.call_soon_threadsafe`` onto an ``asyncio.Queue``.

A streamed request's coroutine that stops listening (the client disconnected, the response task was
cancelled) sets its request's ``cancelled`` event; its thread closes the stream at its next output, which
aborts the sequence between two steps and frees its cache blocks. A request that is not streamed runs to its
end (at most ``max_tokens``): its client gets nothing before then, so nothing tells that it left.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams

__all__ = ["AsyncLLM"]

_END = object()


class AsyncLLM:
    """Stream :class:`RequestOutput`s of an :class:`LLM` into coroutines.

    Args:
        llm: the engine (with a tokenizer).
        max_workers: threads iterating requests (default ``llm.max_num_seqs``: more could not share a step;
            requests past it wait for a thread, as they would wait for a place in the batch).
    """

    def __init__(self, llm: Any, max_workers: int | None = None) -> None:
        self.llm = llm
        self._pool = ThreadPoolExecutor(max_workers or llm.max_num_seqs, thread_name_prefix="dynamo-once-request")

    def chat_prompt(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The conversation through the tokenizer's chat template, as :meth:`LLM.chat` renders it."""
        tok = self.llm.tokenizer
        if getattr(tok, "chat_template", None) is None:
            raise ValueError(f"the tokenizer of {self.llm.model_name} has no chat template")
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes the special tokens (BOS) itself.
        return {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}

    async def stream(self, prompt: Any, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs as :meth:`LLM.stream_outputs` gives them (the last one final).

        Raises:
            ValueError: a prompt the engine refuses (too long, empty, bad ids), before anything is yielded.
        """
        loop = asyncio.get_running_loop()
        outputs = self.llm.stream_outputs(prompt, params)  # checks the prompt here: a ValueError is the caller's 400
        queue: asyncio.Queue[Any] = asyncio.Queue()
        cancelled = threading.Event()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop closed (server shut down): nobody is listening
                cancelled.set()

        def work() -> None:
            try:
                for out in outputs:
                    if cancelled.is_set():
                        break
                    put(out)
            except BaseException as e:  # a failed step: the coroutine raises it
                put(e)
            finally:
                outputs.close()  # early: aborts the sequence, frees its blocks
                put(_END)

        self._pool.submit(work)
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()

    async def generate(self, prompt: Any, params: SamplingParams) -> RequestOutput:
        """The request's final output: :meth:`LLM.generate` on a thread of the pool, which sleeps until its
        sequence ends (no output per token, no wake-up per step).

        Raises:
            ValueError: a prompt the engine refuses (too long, empty, bad ids).
        """
        (out,) = await asyncio.wrap_future(self._pool.submit(self.llm.generate, [prompt], params))
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
