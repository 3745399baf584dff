"""The OpenAI-compatible HTTP app: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``; and vLLM's
``/health``, ``/version``, ``/tokenize``, ``/detokenize``, ``/reset_prefix_cache`` (:mod:`.utility_routes`).

Built by :func:`build_app` around one :class:`models.LLM` (the model is fixed at start: no request names
a path). ``stream: true`` answers server-sent events, ``data: {chunk}\\n\\n`` ... ``data: [DONE]\\n\\n``.
A body that is not streamed is returned as a :class:`JSONResponse` of plain ``dict``/``list``/``str``/number
values: the same bytes FastAPI writes for a returned ``dict`` (``json.dumps``, compact, UTF-8), without
its ``jsonable_encoder`` walk of every value first (~20 us a completion, on the event loop, whose time
during a step can delay the engine thread's next one: both take the GIL). Every refusal is OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}``: a bad field 400, an unknown model 404, a missing
or wrong API key 401, a body over ``max_body_bytes`` 413.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..engine.grammar import StructuredOutputError
from .bridge import AsyncLLM
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    new_id,
)
from .streaming import stream_response, whole_chat_stream
from .metrics import server_metrics
from .utility_routes import OPEN_PATHS, add_utility_routes

logger = logging.getLogger(__name__)

__all__ = ["build_app"]

#: The largest request body taken (1 MiB: ~250k tokens of text; an image-free API has no use for more).
MAX_BODY_BYTES = 1 << 20


def build_app(llm: Any, model_name: str, api_key: str | None = None,
              max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The app serving ``llm`` under ``model_name``.

    Args:
        llm: a :class:`models.LLM` with a tokenizer.
        model_name: the model's id in ``/v1/models``; a request naming another gets a 404.
        api_key: when set, every route but ``/health`` and ``/version`` wants ``Authorization: Bearer <api_key>``
            (else 401).
        max_body_bytes: larger request bodies get a 413.
    """
    engine = AsyncLLM(llm, metrics=server_metrics(llm, model_name))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()

    app = FastAPI(title="dynamo-once", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=max_body_bytes)
    _add_error_handlers(app)
    add_utility_routes(app, engine, model_name)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "dynamo-once",
                "max_model_len": llm.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        _check(req, model_name, llm)
        jobs = []  # (prompt, one completion's params): each prompt's n completions in a row
        for prompt in req.prompts(llm.max_num_seqs):
            max_tokens = _max_tokens(req.max_tokens, _room(llm, _num_tokens(llm, prompt)))
            # echo with logprobs: the prompt's tokens' logprobs too (their forward's)
            params = req.sampling_params(max_tokens, req.logprobs, req.logprobs if req.echo else None)
            jobs += [(prompt, one) for one in params.completions()]
        rid = new_id("cmpl")
        echoes = [_prompt_text(llm, prompt) for prompt, _ in jobs] if req.echo else None
        if req.stream:
            chunk = functools.partial(completion_chunk, rid, model_name)
            first = None if echoes is None else (
                lambda index: completion_chunk(rid, model_name, echoes[index], None, index=index))
            return await stream_response(engine, jobs, req.n, chunk, _include_usage(req), first,
                                         functools.partial(request_error, req=req))
        outs = await _generate(engine, jobs, req)
        return JSONResponse(completion_response(rid, model_name, outs, llm.tokenizer, req.n, echoes))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Any:
        _check(req, model_name, llm)
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        tools = req.template_tools()
        try:
            prompt = engine.chat_prompt(messages, tools=tools, **req.template_options())
        except ValueError as e:
            raise RequestError(str(e), param="messages") from None
        top = req.top_logprobs_count()
        asked = next((m for m in (req.max_completion_tokens, req.max_tokens) if m is not None), None)
        max_tokens = _max_tokens(asked, _room(llm, len(prompt["prompt_token_ids"])))
        params = req.sampling_params(max_tokens, top)
        rid = new_id("chatcmpl")
        if req.stream and tools is None:
            def chunk(text: str, finish: str | None, use: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
                return chat_chunk(rid, model_name, {"content": text}, finish, use, index)

            def first(index: int) -> dict[str, Any]:
                return chat_chunk(rid, model_name, {"role": "assistant", "content": ""}, None, index=index)
            jobs = [(prompt, one) for one in params.completions()]
            return await stream_response(engine, jobs, req.n, chunk, _include_usage(req), first,
                                         functools.partial(request_error, req=req))
        outs = await _generate(engine, [(prompt, one) for one in params.completions()], req)
        body = chat_response(rid, model_name, outs, llm.tokenizer, top or 0, req)
        # With tools, a stream is sent once the output is whole: its tool calls are known only then.
        return whole_chat_stream(body, _include_usage(req)) if req.stream else JSONResponse(body)

    return app


def _check(req: Any, model_name: str, llm: Any) -> None:
    if req.model is not None and req.model != model_name:
        raise RequestError(f"model {req.model!r} does not exist; this server serves {model_name!r}", status=404,
                           param="model", code="model_not_found")
    req.check_common(llm.max_num_seqs, llm.vocab_size)
    if req.stream and req.logprobs not in (None, False):
        raise RequestError("logprobs with stream: true is not supported (ask without streaming)", param="logprobs")


def _num_tokens(llm: Any, prompt: str | dict[str, list[int]]) -> int:
    return len(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else len(llm.tokenizer.encode(prompt))


def _room(llm: Any, num_prompt_tokens: int) -> int:
    """``max_tokens`` when a request leaves it out: what the context and the cache leave after the prompt
    (at least 1: a prompt that fills them is refused by the engine, with the reason)."""
    cache_tokens = llm.kv_cache.num_blocks * llm.kv_cache.block_size
    return max(1, min(llm.max_model_len, cache_tokens) - num_prompt_tokens)


def _max_tokens(asked: int | None, room: int) -> int:
    """``max_tokens`` as asked (``SamplingParams`` checks it is >= 1), else the room left; past the room a 400
    naming it (a prompt that leaves no room at all is the engine's 400, naming the prompt)."""
    if asked is None:
        return room
    if isinstance(asked, int) and asked > room > 1:
        raise RequestError(f"max_tokens={asked} is past the context: the prompt leaves room for {room} tokens",
                           param="max_tokens")
    return asked


def _prompt_text(llm: Any, prompt: str | dict[str, list[int]]) -> str:
    """A completion prompt as text (token ids decoded), for ``echo``."""
    if isinstance(prompt, str):
        return prompt
    return llm.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=True,
                                clean_up_tokenization_spaces=False)


def _include_usage(req: Any) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


async def _generate(engine: AsyncLLM, jobs: list[tuple[Any, Any]], req: Any) -> list[Any]:
    """The final outputs of the request's completions (``jobs``: each one's prompt and params), run at once."""
    try:
        return list(await asyncio.gather(*(engine.generate(prompt, params) for prompt, params in jobs)))
    except (ValueError, TypeError) as e:
        raise request_error(e, req) from None


def request_error(e: Exception, req: Any) -> RequestError:
    """The 400 of an error making the request: its output constraint's (naming the field that gave it), else its
    prompt's (too long, empty, ids out of the vocabulary)."""
    param = req.structured()[1] if isinstance(e, StructuredOutputError) else "prompt"
    return RequestError(str(e).removeprefix("generate: "), param=param)


class _Guard:
    """ASGI middleware (not ``@app.middleware``, whose wrapping of streamed responses hides a client's
    disconnect): the API key and the body size, before any route runs."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            refusal = None
            if (self.expected is not None and scope["path"] not in OPEN_PATHS
                    and not secrets.compare_digest(headers.get(b"authorization", b""), self.expected)):
                refusal = JSONResponse(error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                                  code="invalid_api_key"), status_code=401)
            elif not headers.get(b"content-length", b"0").isdigit() or int(
                    headers.get(b"content-length", b"0")) > self.max_body_bytes:
                refusal = JSONResponse(error_body(f"request body over {self.max_body_bytes} bytes (or a bad "
                                                  "Content-Length)"), status_code=413)
            if refusal is not None:
                return await refusal(scope, receive, send)
        await self.app(scope, receive, send)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> JSONResponse:  # a bug or a failed step, not the request
        logger.exception("request failed")
        return JSONResponse(error_body(f"internal error: {e!r}", "internal_error"), status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)
