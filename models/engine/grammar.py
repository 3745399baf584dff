"""Structured outputs in the engine: each constrained sequence's grammar matcher (``xgrammar``) masks the tokens its
output may not take next, step by step.

A request's ``StructuredOutputsParams`` compile once against the checkpoint's tokenizer (:class:`Grammars`; the
compiler caches what it compiled), when the request is made. Its sequence gets a matcher and the
:class:`StructuredSampler`: before each draw the matchers fill a bitmask of the allowed tokens (on the host), the
request sampler draws from the logits with the others masked (after the penalties), and each drawn token advances
its matcher. The next mask needs that token on the host, so a step holding a constrained sequence is never launched
ahead of the last one's tokens (the sampler does not sample "on the device" for async scheduling). Where the
constraint is met, only the end-of-sequence tokens are allowed: the output ends there.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..structured_outputs import StructuredOutputsParams
from .request_sampler import RequestSampler
from .sequence import Seq

__all__ = ["Grammars", "StructuredOutputError", "StructuredSampler"]


class StructuredOutputError(ValueError):
    """A request's ``structured_outputs`` that cannot be compiled (a bad schema, regex or grammar)."""


class Grammars:
    """Compiles ``StructuredOutputsParams`` for one tokenizer and vocabulary (``xgrammar``, imported on first use).

    Args:
        tokenizer: the checkpoint's ``transformers`` tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's).
        stop_token_ids: the end-of-sequence tokens that end a constrained output.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        try:
            import xgrammar
        except ImportError as e:
            raise StructuredOutputError("generate: structured_outputs need the xgrammar package (pip install "
                                        "xgrammar, or pip install -e '.[structured]')") from e
        self.xgr = xgrammar
        self.vocab_size = vocab_size
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgrammar.GrammarCompiler(info)

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params``; one it cannot compile is a ``ValueError`` naming the field."""
        kind = params.kind
        try:
            if kind == "json":
                return self.compiler.compile_json_schema(json.dumps(params.json), any_whitespace=False)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return self.compiler.compile_regex(params.regex)
            if kind == "choice":
                return self.compiler.compile_grammar("root ::= " + " | ".join(map(_ebnf_literal, params.choice)))
            return self.compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as e:  # xgrammar's errors for a bad schema, regex or grammar
            raise StructuredOutputError(f"generate: structured_outputs.{kind} cannot be compiled: {e}") from None

    def matcher(self, params: StructuredOutputsParams) -> Any:
        return self.xgr.GrammarMatcher(self.compile(params))


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes, which the grammar's literals read)."""
    return json.dumps(text, ensure_ascii=False)


class StructuredSampler:
    """The sampler of constrained sequences (``seq.grammar`` set): the request sampler's draw within each one's
    allowed tokens; host token ids (each advances its sequence's matcher)."""

    on_device = False

    def __init__(self, device: torch.device, grammars: Grammars) -> None:
        self.grammars = grammars
        self.inner = RequestSampler(device)
        self._bitmask: torch.Tensor | None = None

    def __call__(self, seqs: list[Seq], logits: torch.Tensor) -> list[int]:
        xgr = self.grammars.xgr
        if self._bitmask is None or self._bitmask.shape[0] < len(seqs):
            self._bitmask = xgr.allocate_token_bitmask(max(len(seqs), 8), self.grammars.vocab_size)
        bitmask = self._bitmask[:len(seqs)]
        for i, seq in enumerate(seqs):
            seq.grammar.fill_next_token_bitmask(bitmask, i)
        tokens = self.inner(seqs, logits, bitmask=bitmask.to(logits.device, non_blocking=True)).tolist()
        for seq, token in zip(seqs, tokens):
            if not seq.grammar.is_terminated():
                seq.grammar.accept_token(token)
        return tokens
