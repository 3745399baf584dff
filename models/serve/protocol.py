"""The OpenAI API's request bodies (pydantic) and the response objects the server writes.

Requests are checked twice: their shape here (types; a field the server does not implement is refused
rather than silently ignored), their values by :class:`models.SamplingParams`. Either failure is a 400
in OpenAI's error shape (:func:`error_body`) naming the field.
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..structured_outputs import StructuredOutputsParams
from .tools import ToolChoice, ToolDef, template_tools, tool_constraint, tool_message

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "RequestError", "chat_chunk",
           "chat_response", "completion_chunk", "completion_response", "error_body", "usage"]


class RequestError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(BaseModel):
    """The fields both endpoints share; ``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``,
    ``repetition_penalty``, ``min_tokens``: vLLM's extensions."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | ...: ...}
    guided_json: dict[str, Any] | str | None = None  # vLLM's older spellings
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None

    def check_common(self, max_n: int, vocab_size: int) -> None:
        """What ``SamplingParams`` cannot check: ``n`` against the engine's ``max_num_seqs``, ``logit_bias``' ids
        against the vocabulary."""
        if isinstance(self.n, int) and self.n > max_n:
            raise RequestError(f"n must be at most {max_n} (the server's max_num_seqs); got {self.n}", param="n")
        outside = [k for k in self.logit_bias or () if k.isdigit() and int(k) >= vocab_size]
        if outside:
            raise RequestError(f"logit_bias: token ids must be below the vocabulary's {vocab_size}; got {outside[:5]}",
                               param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options applies with stream: true", param="stream_options")

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's output constraint and the field that gave it (at most one field may)."""
        guided = {k.removeprefix("guided_"): getattr(self, k) for k in
                  ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if getattr(self, k) is not None}
        fmt = self.response_format
        asked = {name: value for name, value in [
            ("response_format", None if fmt is None or fmt.type == "text" else fmt),
            ("structured_outputs", self.structured_outputs), ("guided_*", guided or None)] if value is not None}
        if len(asked) > 1:
            raise RequestError(f"give one of response_format, structured_outputs, guided_*; got {', '.join(asked)}",
                               param=next(iter(asked)))
        if not asked:
            return None, None
        (field, value), = asked.items()
        try:
            if field == "response_format":
                if value.type == "json_object":
                    return StructuredOutputsParams(json_object=True), field
                if value.json_schema is None or value.json_schema.json_schema is None:
                    raise RequestError("response_format: json_schema needs json_schema.schema", param=field)
                return StructuredOutputsParams(json=value.json_schema.json_schema), field
            return StructuredOutputsParams(**value), field
        except (TypeError, ValueError) as e:  # an unknown key, no constraint or two, a bad value
            raise RequestError(f"{field}: {str(e).removeprefix('StructuredOutputsParams: ')}", param=field) from None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's :class:`SamplingParams`; a bad value is a 400 naming its field."""
        structured, _ = self.structured()
        try:
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  min_p=self.min_p, max_tokens=max_tokens, stop=self.stop,
                                  stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                                  seed=self.seed, logprobs=logprobs, n=self.n,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                                  logit_bias=self.logit_bias, structured_outputs=structured,
                                  prompt_logprobs=prompt_logprobs)
        except ValueError as e:  # "SamplingParams: NAME must be ..."
            message = str(e).removeprefix("SamplingParams: ")
            raise RequestError(message, param=message.split(" ", 1)[0]) from None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt (a string or token ids) or a list of them; the choices are each prompt's
    ``n`` completions in order (index ``i * n + j``)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self, max_prompts: int) -> list[str | dict[str, list[int]]]:
        """The request's prompts (at most ``max_prompts``), each a string or ``{"prompt_token_ids": [...]}``."""
        prompt = self.prompt
        many = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if not 1 <= len(many) * max(self.n, 1) <= max_prompts:  # n < 1: SamplingParams' 400, naming n
            raise RequestError(f"prompt: 1 to {max_prompts} prompts times n (the server's max_num_seqs); got "
                               f"{len(many)} x {self.n}", param="prompt")
        return [{"prompt_token_ids": p} if isinstance(p, list) else p for p in many]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the chat template may read them
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text: a list of parts must be text parts (``{"type": "text", "text": ...}``)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if not all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in self.content):
            raise RequestError("messages: only text content parts are supported", param="messages")
        return "".join(p["text"] for p in self.content)


def _tools_call(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` of :mod:`.tools`; its ``ValueError`` ("FIELD: ...") a 400 naming the field."""
    try:
        return fn(*args)
    except ValueError as e:
        raise RequestError(str(e), param=str(e).split(":", 1)[0]) from None


def template_options(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool,
                     chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's template fields, checked, as ``apply_chat_template`` keywords (the template's variables included)."""
    if continue_final_message and add_generation_prompt:
        raise RequestError("continue_final_message: the last message is continued, so add_generation_prompt "
                           "must be false", param="continue_final_message")
    if continue_final_message and messages[-1].role != "assistant":
        raise RequestError(f"continue_final_message: the last message must be the assistant's; got "
                           f"{messages[-1].role!r}", param="continue_final_message")
    reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize"}
    clash = sorted(reserved & set(chat_template_kwargs or ()))
    if clash:
        raise RequestError(f"chat_template_kwargs: {clash} are set by the request's own fields",
                           param="chat_template_kwargs")
    return {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message}


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: a conversation through the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: one call at most
    # vLLM's extensions: how the template renders the conversation
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict[str, Any]:
        """What the chat template is called with besides the messages and tools."""
        return template_options(self.messages, self.add_generation_prompt, self.continue_final_message,
                                self.chat_template_kwargs)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template shows the model (none with ``tool_choice: "none"``)."""
        return _tools_call(template_tools, self.tools, self.tool_choice)

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """As the other fields', or the constraint of a named or ``"required"`` ``tool_choice`` (not both)."""
        constraint = _tools_call(tool_constraint, self.tools, self.tool_choice, self.parallel_tool_calls is not False)
        base, field = super().structured()
        if constraint is None:
            return base, field
        if base is not None:
            raise RequestError(f"tool_choice constrains the output to a tool call; give no {field} with it",
                               param="tool_choice")
        return constraint, "tool_choice"

    def message(self, out: RequestOutput, rid: str) -> tuple[dict[str, Any], str | None]:
        """A completion's assistant message (content, or tool calls) and finish reason."""
        content, calls = tool_message(out.text, rid, self.tools, self.tool_choice, self.parallel_tool_calls is not False)
        if calls is None:
            return {"role": "assistant", "content": content}, out.finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    def top_logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


#: ``new_id``'s parts: 64 random bits drawn once a process, then a counter. ``uuid4()`` a request read
#: ``os.urandom``, a system call that lets go of the GIL on the event loop; while the engine thread runs a
#: step, taking the GIL back waits for it (up to ``sys.getswitchinterval()``, 5 ms): it was the loop's
#: largest cost after ``epoll`` (0.16 ms a request, tiny-llama on 2 CPU cores).
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNT = itertools.count()


def new_id(prefix: str) -> str:
    """A response id unique to this server process (random across processes), as OpenAI's: ``cmpl-<hex>``."""
    return f"{prefix}-{_ID_PREFIX}{next(_ID_COUNT):016x}"


def usage(outs: list[RequestOutput], n: int = 1) -> dict[str, Any]:
    """OpenAI's usage counts of a request's completions, each prompt's ``n`` in a row (each prompt counted once,
    the completions' tokens summed); ``prompt_tokens_details.cached_tokens``: the prompt tokens the prefix cache
    held (of each prompt, the most any of its completions found)."""
    groups = [outs[i:i + n] for i in range(0, len(outs), n)]
    prompt, completion = sum(len(g[0].prompt_token_ids) for g in groups), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(max(o.num_cached_tokens for o in g) for g in groups)}}


def _token(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)


def completion_logprobs(out: RequestOutput, tokenizer: Any, echo: bool = False) -> dict[str, Any] | None:
    """The legacy completions shape: per token its text, its logprob and the top ones by text; with ``echo``, the
    prompt's tokens first (the first one's logprob and top ones null, as OpenAI's)."""
    if out.logprobs is None:
        return None
    ids, rows = out.token_ids[:len(out.logprobs)], list(out.logprobs)
    if echo:
        ids, rows = list(out.prompt_token_ids) + ids, list(out.prompt_logprobs) + rows
    tokens = [_token(tokenizer, t) for t in ids]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [None if row is None else row[t] for row, t in zip(rows, ids)],
            "top_logprobs": [None if row is None else {_token(tokenizer, i): lp for i, lp in row.items()}
                             for row in rows],
            "text_offset": offsets}


def chat_logprobs(out: RequestOutput, tokenizer: Any, top: int) -> dict[str, Any] | None:
    """The chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    if out.logprobs is None:
        return None

    def entry(token: int, lp: float) -> dict[str, Any]:
        text = _token(tokenizer, token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    content = []
    for row, token in zip(out.logprobs, out.token_ids):
        ranked = sorted(row.items(), key=lambda kv: -kv[1])[:top]  # the row: its own token first, then the top
        content.append({**entry(token, row[token]), "top_logprobs": [entry(i, lp) for i, lp in ranked]})
    return {"content": content}


def completion_response(rid: str, model: str, outs: list[RequestOutput], tokenizer: Any, n: int,
                        echoes: list[str] | None = None) -> dict[str, Any]:
    """``echoes``: each choice's prompt text, put before its text (and its tokens before the logprobs')."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": (echoes[i] if echoes else "") + out.text,
                         "logprobs": completion_logprobs(out, tokenizer, echoes is not None),
                         "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
                        for i, out in enumerate(outs)],
            "usage": usage(outs, n)}


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None,
                     usage: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    choices = [] if usage is not None else [{"index": index, "text": text, "logprobs": None,
                                             "finish_reason": finish_reason}]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}


def chat_response(rid: str, model: str, outs: list[RequestOutput], tokenizer: Any, top: int,
                  req: ChatCompletionRequest) -> dict[str, Any]:
    choices = []
    for i, out in enumerate(outs):
        message, finish = req.message(out, f"{rid}-{i}")
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(out, tokenizer, top),
                        "finish_reason": finish, "stop_reason": out.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outs, len(outs))}  # one prompt's completions


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish_reason: str | None,
               usage: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    choices = [] if usage is not None else [{"index": index, "delta": delta, "logprobs": None,
                                             "finish_reason": finish_reason}]
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage}

