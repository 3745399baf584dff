"""``RequestOutput``: what :meth:`LLM.generate` and :meth:`LLM.chat` return for one request called the text way."""

from __future__ import annotations

import dataclasses

__all__ = ["RequestOutput"]


@dataclasses.dataclass
class RequestOutput:
    """One request's prompt and completion.

    Args:
        prompt: the prompt's text (for :meth:`LLM.chat`: the rendered chat template); None for token ids.
        prompt_token_ids: the prompt as the model saw it (tokenized, image tokens expanded).
        text: the generated text, without a matched stop string; None when the model has no tokenizer.
        token_ids: the generated tokens, the end-of-sequence or stop token included.
        finish_reason: ``"stop"`` (end-of-sequence token, a stop token or a stop string) or ``"length"``
            (``max_tokens``); None in the items of :meth:`LLM.stream_outputs` but its last.
        stop_reason: what stopped it: the stop string or the stop token id; None for the checkpoint's
            end-of-sequence token and for ``"length"`` (as vLLM).
        logprobs: with ``SamplingParams.logprobs``: per generated token, ``{token id: log-probability}`` of
            that token and of the most likely ones.
        num_cached_tokens: prompt tokens whose keys and values came from the prefix cache
            (``LLM(enable_prefix_caching=True)``), not computed; 0 otherwise.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt token ``{token id: log-probability}``
            of that token and of the most likely ones given the tokens before it; None for the first token.
        index: which of the request's completions this is (``SamplingParams.n``), from 0.
        completions: with ``n`` > 1, every completion of the request in order (this object, the first, too);
            read them as :attr:`outputs`.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    index: int = 0
    completions: list[RequestOutput] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def outputs(self) -> list[RequestOutput]:
        """The request's completions, as vLLM's ``output.outputs[i].text``: ``[self]`` for one; with
        ``SamplingParams.n`` > 1 all ``n`` (``outputs[0]`` is this object)."""
        return self.completions or [self]
