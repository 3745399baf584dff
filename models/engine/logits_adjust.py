"""What a request's ``SamplingParams`` change in its logits before the draw: the penalties on the tokens of its
prompt and of what it generated so far, its ``logit_bias``, and ``min_tokens``' ban on the tokens that would end it.

The counts stay on the device. A batch's penalized rows share one ``[P, vocab]`` int32 table; each sequence's
``token_counts`` is a view of its row, so the next batch (other sequences, another order) gathers them back in one
``stack``. After each draw the sampled tokens are added to the table on the device: a step with async scheduling,
whose tokens reach the host a step late, counts them in time for the next. ``min_tokens`` counts draws the same
way (``seq.num_sampled``, on the host), not the tokens the host has read.
"""

from __future__ import annotations

import torch

from .sequence import Seq

__all__ = ["LogitsAdjust"]


class LogitsAdjust:
    """One batch's adjustments (``seqs``: the batch's rows, in order), made when some row asks for any."""

    def __init__(self, seqs: list[Seq], vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        penalized = [i for i, s in enumerate(seqs) if s.params.penalized]
        self.rows = None if len(penalized) == len(seqs) else torch.tensor(penalized, device=device)
        self.counts = self.in_prompt = None
        self.repetition = self.frequency = self.presence = None
        if penalized:
            self._gather([seqs[i] for i in penalized])
        biased = [(i, t, b) for i, s in enumerate(seqs) if s.params.logit_bias for t, b in s.params.logit_bias.items()]
        self.bias = None if not biased else (
            torch.tensor([i for i, _, _ in biased], device=device), torch.tensor([t for _, t, _ in biased], device=device),
            torch.tensor([b for _, _, b in biased], dtype=torch.float32, device=device))
        self.min_tokens = [(i, s) for i, s in enumerate(seqs) if s.params.min_tokens]
        self._banned_key: tuple[int, ...] = ()
        self._banned: tuple[torch.Tensor, torch.Tensor] | None = None

    def _gather(self, seqs: list[Seq]) -> None:
        """The rows' counts (and prompt tokens, for a repetition penalty) in this batch's tables; each sequence's
        views now point into them."""
        params = [s.params for s in seqs]
        self.counts = torch.stack([self._counts_of(s) for s in seqs])
        for s, row in zip(seqs, self.counts.unbind(0)):
            s.token_counts = row

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]

        if any(p.repetition_penalty != 1 for p in params):
            self.in_prompt = torch.stack([self._prompt_mask_of(s) for s in seqs])
            for s, row in zip(seqs, self.in_prompt.unbind(0)):
                s.prompt_mask = row
            self.repetition = column([p.repetition_penalty for p in params])
        if any(p.frequency_penalty for p in params):
            self.frequency = column([p.frequency_penalty for p in params])
        if any(p.presence_penalty for p in params):
            self.presence = column([p.presence_penalty for p in params])

    def _counts_of(self, seq: Seq) -> torch.Tensor:
        if seq.token_counts is not None:
            return seq.token_counts
        counts = torch.zeros(self.vocab, dtype=torch.int32, device=self.device)
        generated = seq.tokens[seq.prompt_len:]
        if generated:
            ids = torch.tensor(generated, device=self.device)
            counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        return counts

    def _prompt_mask_of(self, seq: Seq) -> torch.Tensor:
        if seq.prompt_mask is not None:
            return seq.prompt_mask
        mask = torch.zeros(self.vocab, dtype=torch.bool, device=self.device)
        mask[torch.tensor(seq.tokens[:seq.prompt_len], device=self.device)] = True
        return mask

    def apply(self, x: torch.Tensor) -> None:
        """Adjust the batch's fp32 logits ``x`` ``[B, vocab]`` in place."""
        if self.counts is not None:
            sub = x if self.rows is None else x[self.rows]
            seen = self.counts > 0
            if self.repetition is not None:  # CTRL's penalty on every token seen, the prompt's too
                scaled = torch.where(sub > 0, sub / self.repetition, sub * self.repetition)
                sub = torch.where(seen | self.in_prompt, scaled, sub)
            if self.frequency is not None:
                sub = sub - self.frequency * self.counts
            if self.presence is not None:
                sub = sub - self.presence * seen
            if self.rows is None:
                x.copy_(sub)
            else:
                x.index_copy_(0, self.rows, sub)
        if self.bias is not None:
            rows, ids, bias = self.bias
            x.index_put_((rows, ids), bias, accumulate=True)
        banned = self._banned_now()
        if banned is not None:
            x.index_put_(banned, torch.tensor(float("-inf"), device=x.device))

    def _banned_now(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, token ids) of the end-of-sequence and stop tokens of the rows short of their ``min_tokens``."""
        short = [(i, s) for i, s in self.min_tokens if s.num_sampled < s.params.min_tokens]
        key = tuple(i for i, _ in short)
        if key != self._banned_key:
            pairs = [(i, t) for i, s in short for t in sorted(s.eos_token_ids | s.stop_token_ids)]
            self._banned = None if not pairs else tuple(
                torch.tensor(column, device=self.device) for column in zip(*pairs))
            self._banned_key = key
        return self._banned if key else None

    def count(self, tokens: torch.Tensor) -> None:
        """Add a draw's ``tokens`` ``[B]`` (on the device) to the penalized rows' counts; one more draw for each row
        with ``min_tokens``."""
        for _, seq in self.min_tokens:
            seq.num_sampled += 1
        if self.counts is not None:
            drawn = tokens if self.rows is None else tokens[self.rows]
            self.counts.scatter_add_(1, drawn[:, None].to(torch.int64),
                                     torch.ones(drawn.shape[0], 1, dtype=torch.int32, device=self.device))
