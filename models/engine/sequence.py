"""``Seq``: one prompt's state while the engine runs it (its tokens, cache blocks, progress, how it stops)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Chooser", "Seq"]


@dataclasses.dataclass(eq=False)  # compared by identity (the input batch's block-table reuse)
class Seq:
    """A prompt and the tokens generated after it: what :meth:`LLM.run`'s ``choose`` gets.

    ``sampler`` picks its tokens (:mod:`.sampling`); ``params`` are its ``SamplingParams`` when it was
    asked for with them, and ``generator`` its own seeded generator. It ends (``finish_reason`` set, by
    :meth:`append`) on a token of ``eos_token_ids`` or ``stop_token_ids``, a stop string of its
    ``detokenizer``, or ``max_new_tokens`` tokens.
    """

    index: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    images: Any = None  # the model's prepare_images() of this prompt's images, used at its prefill
    sampler: Any = None
    params: Any = None
    generator: torch.Generator | None = None
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    detokenizer: Any = None  # an IncrementalDetokenizer: the text and the stop strings
    finish_reason: str | None = None  # "stop", "length", "abort"; set once, when it ends
    stop_reason: int | str | None = None
    logprob_rows: list[tuple[torch.Tensor, torch.Tensor, int]] = dataclasses.field(default_factory=list)
    prompt_logprob_rows: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    error: BaseException | None = None  # the exception of a step that failed it
    # Prefix caching (KVCache.cached_prefix / cache_computed): prompt tokens found cached at admission, whole
    # blocks cached so far, and the prefix-cache id of the last of them (.prefix_cache.ROOT: none)
    num_cached: int = 0
    num_keyed: int = 0
    prefix_id: int = 0
    # SamplingParams.min_tokens: no stop before this many generated tokens. The request sampler's state
    # (.logits_adjust): its draws so far (counted with min_tokens only), and on the device the generated tokens'
    # counts and the prompt's tokens (with a penalty only)
    min_tokens: int = 0
    num_sampled: int = 0
    token_counts: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    grammar: Any = None  # structured outputs: its xgrammar matcher (.grammar.StructuredSampler advances it)
    # Preemption (Scheduler): the tokens to compute before the next sample (the prompt's; after a preemption every
    # token known then, whose keys and values were freed), and how often it was preempted
    prefill_len: int = -1
    num_preempted: int = 0

    def __post_init__(self) -> None:
        if self.prefill_len < 0:
            self.prefill_len = self.prompt_len

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def append(self, token: int) -> bool:
        """Add a generated token; True when it ends the sequence (``finish_reason`` then set).

        A stop token stays out of the text (as vLLM's); a stop string is cut from it by the detokenizer.
        """
        self.tokens.append(token)
        if len(self.tokens) - self.prompt_len <= self.min_tokens:  # too early to stop but at max_tokens
            if self.detokenizer is not None:
                self.detokenizer.add(token, find_stop=False)
            if len(self.tokens) - self.prompt_len >= self.max_new_tokens:
                self._end("length", None)
        elif token in self.eos_token_ids:
            self._end("stop", None)
        elif token in self.stop_token_ids:
            self._end("stop", token)
        elif self.detokenizer is not None and (stop := self.detokenizer.add(token)) is not None:
            self.stop_reason, self.finish_reason = stop, "stop"
        elif len(self.tokens) - self.prompt_len >= self.max_new_tokens:
            self._end("length", None)
        return self.finish_reason is not None

    def _end(self, reason: str, stop_reason: int | None) -> None:
        if self.detokenizer is not None:
            self.detokenizer.finish()
        self.stop_reason = stop_reason
        self.finish_reason = reason  # last: a reader that sees it set sees the final text


Chooser = Callable[[list[Seq], torch.Tensor], list[int]]
"""``choose(seqs, logits)``: the next token of each of a step's sequences, from their logits ``[B, vocab]``."""
