"""``SamplingParams.prompt_logprobs``: the log-probability of each prompt token given the tokens before it (and
the most likely tokens there), from the prompt's own forward, as vLLM's ``RequestOutput.prompt_logprobs``.

A step that computes prompt tokens of a sequence that asks for them takes the hidden states of those tokens through
the LM head (one ``[n, vocab]`` log-softmax a chunk, left on the device until the output is built). A prompt's
cached prefix would have no forward, so a sequence that asks is never given one (:meth:`KVCache.cached_prefix`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .sequence import Seq

__all__ = ["prompt_logprobs_of", "record_prompt_logprobs", "wants_prompt_logprobs"]


def wants_prompt_logprobs(seq: Seq) -> bool:
    params = seq.params
    return params is not None and getattr(params, "prompt_logprobs", None) is not None


def record_prompt_logprobs(batch: list[tuple[Seq, int]], num_decodes: int, hidden: torch.Tensor,
                           compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """For each prompt chunk of ``batch`` (after its ``num_decodes`` decodes) whose sequence asks: the
    log-probabilities of the prompt tokens after the chunk's tokens, from ``hidden`` ``[T, hidden]``."""
    start = num_decodes
    for seq, n in batch[num_decodes:]:
        first, start = seq.num_computed, start + n
        if not wants_prompt_logprobs(seq):
            continue
        k = min(n, seq.prompt_len - 1 - first)  # the last prompt token's next is the first generated one
        # A preempted sequence computes its prompt again: the rows recorded before are kept, not recorded twice.
        skip = max(0, sum(len(v) for v, _ in seq.prompt_logprob_rows) - first) if seq.num_preempted else 0
        first, k = first + skip, k - skip
        if k <= 0:
            continue
        logprobs = compute_logits(hidden[start - n + skip:start - n + skip + k]).float().log_softmax(dim=-1)
        targets = torch.tensor(seq.tokens[first + 1:first + 1 + k], device=logprobs.device)
        values, ids = logprobs.gather(-1, targets[:, None]), targets[:, None]
        top = seq.params.prompt_logprobs
        if top:
            best = logprobs.topk(top, dim=-1)
            values, ids = torch.cat([values, best.values], dim=-1), torch.cat([ids, best.indices], dim=-1)
        seq.prompt_logprob_rows.append((values, ids))


def prompt_logprobs_of(seq: Seq) -> list[dict[int, float] | None]:
    """Per prompt token ``{id: logprob}`` (its own first, then the ``prompt_logprobs`` most likely), None for the
    first token, which has no tokens before it."""
    out: list[dict[int, float] | None] = [None]
    for values, ids in seq.prompt_logprob_rows:
        for v, i in zip(values.tolist(), ids.tolist()):
            out.append(dict(zip(i, v)))
    return out
