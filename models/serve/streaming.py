"""A streamed request's server-sent events: the chunks of its ``n`` completions as each one's text grows.

Each completion is a stream of its own (:meth:`.bridge.AsyncLLM.stream`), all started at once; a chunk goes out
for whichever shows more text first, with its ``index``. ``data: [DONE]`` ends the events. A client that leaves
cancels every completion's stream, which aborts its sequence and frees its cache blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from .bridge import AsyncLLM
from .protocol import RequestError, chat_chunk, error_body, usage

logger = logging.getLogger(__name__)

__all__ = ["event", "stream_response", "whole_chat_stream"]

Chunk = Callable[..., dict[str, Any]]  # chunk(text, finish_reason, usage=None, index=0)


def event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def stream_response(engine: AsyncLLM, jobs: list[tuple[Any, Any]], n: int, chunk: Chunk, include_usage: bool,
                          first: Callable[[int], dict[str, Any]] | None,
                          refusal: Callable[[Exception], RequestError]) -> StreamingResponse:
    """The events of the request's completions (``jobs``: each one's prompt and params, each prompt's ``n`` in a
    row; a choice's index is its place there); ``first(index)``: a chunk each opens with (chat's role, an echoed
    prompt). Errors making the request are ``refusal(error)``, a 400 before the 200 and its headers."""
    streams = [engine.stream(prompt, params) for prompt, params in jobs]
    firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
    failed = next((e for e in firsts if isinstance(e, BaseException)), None)
    if failed is not None:
        await _close(streams)
        if isinstance(failed, (ValueError, TypeError)):  # the prompt's, or the output constraint's
            raise refusal(failed) from None
        raise failed
    return StreamingResponse(_events(streams, firsts, n, chunk, include_usage, first), media_type="text/event-stream")


async def _events(streams: list[AsyncIterator[Any]], firsts: list[Any], n: int, chunk: Chunk, include_usage: bool,
                  first: Callable[[int], dict[str, Any]] | None) -> AsyncIterator[str]:
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def follow(i: int, stream: AsyncIterator[Any], out: Any) -> None:
        try:
            while True:
                queue.put_nowait((i, out, None))
                if out.finish_reason is not None:
                    return
                out = await anext(stream)
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(follow(i, s, out)) for i, (s, out) in enumerate(zip(streams, firsts))]
    sent, finals = [0] * len(streams), [None] * len(streams)
    try:
        for i in range(len(streams) if first is not None else 0):
            yield event(first(i))
        while any(out is None for out in finals):
            i, out, error = await queue.get()
            if error is not None:
                raise error
            if len(out.text) > sent[i] or out.finish_reason is not None:
                yield event(chunk(out.text[sent[i]:], out.finish_reason, None, i))
                sent[i] = len(out.text)
            if out.finish_reason is not None:
                finals[i] = out
        if include_usage:
            yield event(chunk("", None, usage(finals, n)))
    except Exception as e:  # after the 200: the error goes in the stream
        logger.exception("stream failed")
        yield event(error_body(str(e), type="internal_error"))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close(streams)  # a client that left: its sequences are aborted and freed
    yield "data: [DONE]\n\n"


async def _close(streams: list[AsyncIterator[Any]]) -> None:
    for stream in streams:
        await stream.aclose()


def whole_chat_stream(body: dict[str, Any], include_usage: bool) -> StreamingResponse:
    """A chat completion already whole (``body``, as ``chat_response`` makes it) as the events of a streamed one: each
    choice's role, then its content or its tool calls in one delta, then its finish reason; the usage if asked. For
    tool calls, which are known only once the output is whole."""
    rid, model = body["id"], body["model"]

    def events() -> Any:
        for c in body["choices"]:
            message, i = c["message"], c["index"]
            yield event(chat_chunk(rid, model, {"role": "assistant", "content": ""}, None, index=i))
            calls = message.get("tool_calls")
            delta = ({"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]} if calls
                     else {"content": message["content"]})
            yield event(chat_chunk(rid, model, delta, None, index=i))
            yield event(chat_chunk(rid, model, {}, c["finish_reason"], index=i))
        if include_usage:
            yield event(chat_chunk(rid, model, {}, None, body["usage"]))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
