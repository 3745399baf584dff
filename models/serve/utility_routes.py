"""The server's routes besides the OpenAI API, as vLLM's server has them.

- ``GET /health``: 200 while the engine can take requests, 503 (with the reason) once its thread has ended;
  with an API key set it still needs none (a load balancer's or Kubernetes' probe has no key).
- ``GET /version``: ``{"version": ...}``, the installed package's; no key either.
- ``GET /metrics``: Prometheus' text format (:mod:`.metrics`); no key either (a scraper has none).
- ``POST /tokenize``: a prompt (``{"prompt": text, "add_special_tokens": true}``) or a conversation (``{"messages":
  [...]}``, through the chat template as ``/v1/chat/completions`` renders it, with its ``add_generation_prompt``,
  ``continue_final_message``, ``chat_template_kwargs`` and ``tools``) to
  ``{"count", "max_model_len", "tokens"}``.
- ``POST /detokenize``: ``{"tokens": [ids]}`` to ``{"prompt": text}``; an id outside the vocabulary is a 400
  naming ``tokens``.
- ``POST /reset_prefix_cache``: forget every cached prefix block (between two steps; running requests keep
  theirs); ``{"freed_blocks": n}``. For a cold-cache measurement, or after the weights changed.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from .bridge import AsyncLLM
from .protocol import ChatMessage, RequestError, error_body, template_options
from .tools import ToolDef

__all__ = ["OPEN_PATHS", "DetokenizeRequest", "TokenizeRequest", "add_utility_routes"]

#: Routes an API key does not guard (probes and scrapers have none).
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDef] | None = None

    def token_ids(self, engine: AsyncLLM) -> list[int]:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("tokenize: give exactly one of prompt and messages", param="prompt")
        if self.prompt is not None:
            return list(engine.llm.tokenizer.encode(self.prompt, add_special_tokens=self.add_special_tokens))
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in self.messages]
        options = template_options(self.messages, self.add_generation_prompt, self.continue_final_message,
                                   self.chat_template_kwargs)
        tools = None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]
        try:
            return engine.chat_prompt(messages, tools=tools, **options)["prompt_token_ids"]
        except ValueError as e:
            raise RequestError(str(e), param="messages") from None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def package_version() -> str:
    """The installed ``dynamo-once``'s version; ``"unknown"`` for a checkout run from its directory."""
    try:
        return importlib.metadata.version("dynamo-once")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_utility_routes(app: FastAPI, engine: AsyncLLM, model_name: str) -> None:
    """Add the routes above to ``app``, serving ``engine`` under ``model_name``."""
    llm = engine.llm

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise RequestError(f"model {name!r} does not exist; this server serves {model_name!r}", status=404,
                               param="model", code="model_not_found")

    @app.get("/health")
    async def health() -> Response:
        problem = engine.problem()
        if problem is None:
            return Response(status_code=200)
        return JSONResponse(error_body(problem, "service_unavailable"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine.metrics is None:
            return JSONResponse(error_body("/metrics needs prometheus_client (pip install -e '.[serve]')",
                                           "not_implemented"), status_code=501)
        body, content_type = engine.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": package_version()})

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        check_model(req.model)
        ids = req.token_ids(engine)
        return JSONResponse({"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < llm.vocab_size), None)
        if bad is not None:
            raise RequestError(f"tokens: ids must be in [0, {llm.vocab_size}); got {bad}", param="tokens")
        return JSONResponse({"prompt": llm.tokenizer.decode(req.tokens)})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        # Between two steps of the engine thread: wait for it off the event loop.
        freed = await asyncio.get_running_loop().run_in_executor(None, llm.reset_prefix_cache)
        return JSONResponse({"freed_blocks": freed})
