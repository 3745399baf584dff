"""Tool calling in ``/v1/chat/completions`` (OpenAI's ``tools`` and ``tool_choice``).

The tools go to the chat template (``apply_chat_template(..., tools=...)``: the checkpoint's template says how the
model sees them). What comes back depends on ``tool_choice``:

- a named function (``{"type": "function", "function": {"name": ...}}``): the output is constrained to JSON matching
  that function's ``parameters`` schema (structured outputs, xgrammar) and is returned as one tool call;
- ``"required"``: the output is constrained to a JSON array of at least one ``{"name": ..., "parameters": {...}}``
  (exactly one with ``parallel_tool_calls: false``), each naming one of the tools with arguments matching its
  schema, returned as tool calls;
- ``"auto"`` (the default with tools): the output is free; when it is, whole, a tool call in the JSON form Llama 3.1+
  templates ask for (``{"name": ..., "parameters": {...}}``, or a list of them; ``arguments`` is taken too; an
  optional leading ``<|python_tag|>``), or in Hermes' ``<tool_call>{...}</tool_call>`` blocks, naming tools of the
  request, it is returned as tool calls, else as content;
- ``"none"``: the tools are not shown to the model and nothing is parsed.

A message with tool calls has ``content`` null and ``finish_reason`` ``"tool_calls"``. Errors are ``ValueError``s
naming the field (the protocol makes them 400s).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..structured_outputs import StructuredOutputsParams

__all__ = ["FunctionDef", "NamedToolChoice", "ToolChoice", "ToolDef", "effective_choice", "template_tools",
           "tool_constraint", "tool_message"]

#: What a model may write before a JSON tool call (Llama 3.1's code-interpreter tag).
_PREFIXES = ("<|python_tag|>",)
#: Hermes' tool calls (Hermes-3 Llama fine-tunes): only such blocks, whitespace between them.
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_HERMES = re.compile(r"(?:\s*<tool_call>.*?</tool_call>)+\s*", re.S)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDef


class _Name(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: _Name


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _schema(fn: FunctionDef) -> dict[str, Any]:
    return fn.parameters if fn.parameters is not None else {"type": "object"}


def effective_choice(tools: list[ToolDef] | None, choice: ToolChoice | None) -> ToolChoice | None:
    """``tool_choice`` as it applies (None: no tools in play), checked against ``tools``."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice: needs tools")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique; got {names}")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}; the tools are {names}")
    return "auto" if choice is None else (None if choice == "none" else choice)


def template_tools(tools: list[ToolDef] | None, choice: ToolChoice | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (None: none shown)."""
    if effective_choice(tools, choice) is None:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def tool_constraint(tools: list[ToolDef] | None, choice: ToolChoice | None,
                    parallel: bool = True) -> StructuredOutputsParams | None:
    """The output constraint a named or required ``tool_choice`` puts on the output (None for auto and none);
    ``parallel`` False (``parallel_tool_calls``): one call at most."""
    choice = effective_choice(tools, choice)
    if isinstance(choice, NamedToolChoice):
        (fn,) = [t.function for t in tools if t.function.name == choice.function.name]
        return StructuredOutputsParams(json=_schema(fn))
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": _schema(t.function)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        one = {} if parallel else {"maxItems": 1}
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, **one, "items": {"anyOf": calls}})
    return None


def _call(rid: str, i: int, name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call-{rid}-{i}", "type": "function", "function": {"name": name, "arguments": text}}


def _parse_auto(text: str, names: set[str]) -> list[tuple[str, Any]] | None:
    body = text.strip()
    for prefix in _PREFIXES:
        body = body.removeprefix(prefix).strip()
    tagged = _HERMES.fullmatch(body)
    try:
        if tagged:  # Hermes' form: <tool_call>{...}</tool_call>, one a call
            found = [json.loads(m) for m in _HERMES_CALL.findall(body)]
        else:
            found = json.loads(body)
    except ValueError:
        return None
    calls = found if isinstance(found, list) else [found]
    out = []
    for call in calls:
        if not isinstance(call, dict) or call.get("name") not in names:
            return None
        args = call.get("parameters", call.get("arguments", {}))
        if not isinstance(args, (dict, str)):
            return None
        out.append((call["name"], args))
    return out or None


def tool_message(text: str, rid: str, tools: list[ToolDef] | None, choice: ToolChoice | None,
                 parallel: bool = True) -> tuple[str | None, list[dict[str, Any]] | None]:
    """An assistant output's ``(content, tool_calls)``: the tool calls it makes under ``tool_choice`` (the first only
    when not ``parallel``), or its text."""
    choice = effective_choice(tools, choice)
    if choice is None:
        return text, None
    if isinstance(choice, NamedToolChoice):  # constrained to the arguments' JSON
        return None, [_call(rid, 0, choice.function.name, text)]
    if choice == "required":  # constrained to [{"name", "parameters"}, ...]
        try:
            calls = [(c["name"], c["parameters"]) for c in json.loads(text)]
        except (ValueError, KeyError, TypeError):  # cut short by max_tokens: not whole JSON
            return text, None
    else:
        calls = _parse_auto(text, {t.function.name for t in tools})
        if calls is None:
            return text, None
    return None, [_call(rid, i, name, args) for i, (name, args) in enumerate(calls if parallel else calls[:1])]
