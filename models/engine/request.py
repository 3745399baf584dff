"""``Request``: one text-way request (its sequence and prompt) for a caller that drives the engine itself.

:meth:`LLM.add_request` checks the prompt and makes one; the caller submits ``request.seq`` to
:attr:`LLM.engine` (an :class:`.engine_loop.EngineLoop`), runs steps (``engine.run_until``) and reads the
request between them: the HTTP server's engine thread does, delivering every request a step advanced at
once instead of a thread a request (:mod:`models.serve.engine_thread`).
"""

from __future__ import annotations

import dataclasses

from .outputs import RequestOutput
from .prompt_logprobs import prompt_logprobs_of, wants_prompt_logprobs
from .prompts import Prompt
from .request_sampler import logprobs_of
from .sequence import Seq

__all__ = ["Request", "final_output"]


def final_output(seq: Seq, prompt: Prompt) -> RequestOutput:
    """An ended sequence's output (what :meth:`LLM.generate` returns for it)."""
    return RequestOutput(
        prompt=prompt.text, prompt_token_ids=seq.tokens[:seq.prompt_len],
        text=seq.detokenizer.text if seq.detokenizer is not None else None,
        token_ids=seq.tokens[seq.prompt_len:], finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
        logprobs=logprobs_of(seq) if seq.params.logprobs is not None else None, num_cached_tokens=seq.num_cached,
        prompt_logprobs=prompt_logprobs_of(seq) if wants_prompt_logprobs(seq) else None)


@dataclasses.dataclass(eq=False)
class Request:
    """A request's sequence and prompt. Read from any thread: ``done`` first, then the text (once ended,
    the text read after it is final)."""

    seq: Seq
    prompt: Prompt

    @property
    def done(self) -> bool:
        """Ended: a stop, ``max_tokens``, an abort, or a failed step (then ``error``)."""
        return self.seq.done

    @property
    def error(self) -> BaseException | None:
        """The exception of the step that failed it (None: none failed)."""
        return self.seq.error

    @property
    def visible_text(self) -> str:
        """The text a stream may show now (see :attr:`.detokenizer.IncrementalDetokenizer.visible`)."""
        return self.seq.detokenizer.visible

    def partial_output(self, text: str) -> RequestOutput:
        """The request so far, showing ``text`` (``finish_reason`` None): an item of a stream."""
        seq = self.seq
        return RequestOutput(self.prompt.text, seq.tokens[:seq.prompt_len], text, seq.tokens[seq.prompt_len:], None,
                             num_cached_tokens=seq.num_cached)

    def output(self) -> RequestOutput:
        """The ended request's output, as :meth:`LLM.generate` returns it."""
        return final_output(self.seq, self.prompt)
