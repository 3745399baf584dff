"""``StructuredOutputsParams``: what a request's output must be, a JSON schema, any JSON object, a regular
expression, one of several strings, or a grammar (as vLLM's ``SamplingParams.structured_outputs``).

Checked when made (exactly one constraint, of the right type); compiled against the checkpoint's tokenizer when the
request is made (:mod:`models.engine.grammar`, with ``xgrammar``), where a schema, regex or grammar it cannot
compile is a ``ValueError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import json as json_lib
from typing import Any

__all__ = ["StructuredOutputsParams"]

_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output text; the output ends (with the end-of-sequence token) where the
    constraint is met.

    Args:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value it accepts, on one line
            (``", "`` and ``": "`` between items, no other whitespace outside strings).
        json_object: True: the output is any JSON object (on one line, as above).
        regex: the output matches this regular expression, whole.
        choice: the output is one of these strings.
        grammar: an EBNF grammar (xgrammar's / llama.cpp's GBNF form, ``root ::= ...``).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [f for f in _FIELDS if getattr(self, f) not in (None, False)]
        if len(given) != 1:
            _refuse("exactly one of json, json_object, regex, choice, grammar", given or "none")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json_lib.loads(self.json))
            except ValueError as e:
                _refuse("json as a JSON schema (a dict or its JSON text)", f"text that is not JSON ({e})")
        if self.json is not None and not isinstance(self.json, dict):
            _refuse("json as a JSON schema (a dict or its JSON text)", self.json)
        if self.json_object not in (None, True, False):
            _refuse("json_object as a bool", self.json_object)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _refuse(f"{name} as a non-empty string", value)
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                _refuse("choice as a non-empty list of non-empty strings", self.choice)
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        """The field that is set."""
        return next(f for f in _FIELDS if getattr(self, f) not in (None, False))


def _refuse(expected: str, given: object) -> None:
    raise ValueError(f"StructuredOutputsParams: expected {expected}; got {given!r}")
