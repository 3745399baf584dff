"""``RequestSampler``: each sequence sampled by its own ``SamplingParams``, a whole step's rows at once.

All on the device, in one pass over ``[B, vocab]``: the penalties, logit biases and ``min_tokens``' ban where rows
ask for them (:mod:`.logits_adjust`), logits / temperature (greedy rows take the argmax of those logits instead),
top-k and top-p on the logits sorted once (a stable sort: among equal logits the lowest id ranks first, so
``top_k=1`` is exactly greedy), min-p, then a draw by the exponential race,
``argmax(probs / q)`` with ``q ~ Exp(1)`` (as vLLM: one kernel for the batch, no ``multinomial``).

Seeds: a request with a seed draws its row of ``q`` from its own ``torch.Generator`` (on the model's
device, seeded once), ``vocab`` numbers per generated token. What it draws depends only on its seed and
its own token count, never on which other sequences share its steps. Unseeded rows draw from torch's
global generator.

The per-row parameters are host lists made into device tensors once per batch: a step with the same
sequences in the same order as the last (most decode steps) reuses them.
"""

from __future__ import annotations

import dataclasses

import torch

from .logits_adjust import LogitsAdjust
from .sequence import Seq

__all__ = ["RequestSampler", "logprobs_of"]


@dataclasses.dataclass
class _Rows:
    """One batch's per-row parameters on the device (None: no row uses that mask)."""

    seqs: list[Seq]
    all_greedy: bool
    greedy: torch.Tensor | None  # [B] bool
    temperature: torch.Tensor  # [B], 1 for greedy rows
    top_k: torch.Tensor | None  # [B] int64, 2**62 for rows without
    top_p: torch.Tensor | None  # [B], 2 for rows without (never reached by a cumulative sum)
    min_p: torch.Tensor | None  # [B]
    seeded: list[tuple[int, torch.Generator]]
    unseeded: bool  # some sampled row draws from the global generator
    num_logprobs: int | None  # the most top logprobs a row asks for
    adjusts: bool  # some row has a penalty, a logit bias or min_tokens
    adjust: LogitsAdjust | None = None  # made at the batch's first call (it needs the vocabulary's size)


class RequestSampler:
    """The sampler (see :mod:`.sampling`) of every sequence given ``SamplingParams`` (``seq.params``, and
    ``seq.generator`` when seeded); it records the logprobs rows ask for in ``seq.logprob_rows``."""

    on_device = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rows: _Rows | None = None

    def __call__(self, seqs: list[Seq], logits: torch.Tensor, bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """``bitmask``: int32 ``[B, ceil(vocab / 32)]`` on the logits' device, bit ``t % 32`` of word ``t // 32`` set
        where row may draw token ``t`` (structured outputs); the others are masked after the penalties."""
        rows = self._rows
        if rows is None or rows.seqs != seqs:  # Seq compares by identity
            rows = self._rows = self._batch(seqs)
        with torch.inference_mode():  # the logits are inference tensors; masks write in place
            x = logits
            if rows.adjusts or bitmask is not None:
                x = logits.to(torch.float32, copy=True)  # the raw logits stay as they are, for the logprobs
            if rows.adjusts:
                if rows.adjust is None:
                    rows.adjust = LogitsAdjust(seqs, logits.shape[-1], logits.device)
                rows.adjust.apply(x)
            if bitmask is not None:
                x.masked_fill_(~_allowed(bitmask, x.shape[-1]), float("-inf"))
            if rows.all_greedy:  # in the model's dtype: converting is exact, so the argmax is the same
                tokens = x.argmax(dim=-1)
            else:
                tokens = self._draw(x, rows)
            if rows.adjust is not None:
                rows.adjust.count(tokens)
            if rows.num_logprobs is not None:
                self._record_logprobs(seqs, logits, tokens, rows.num_logprobs)
        return tokens

    def _batch(self, seqs: list[Seq]) -> _Rows:
        params = [s.params for s in seqs]

        def tensor(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        greedy = [p.temperature == 0 for p in params]
        any_k = any(p.top_k is not None for p in params)
        any_p = any(p.top_p < 1 for p in params)
        any_min_p = any(p.min_p > 0 for p in params)
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return _Rows(
            seqs=list(seqs), all_greedy=all(greedy),
            greedy=tensor(greedy, torch.bool) if any(greedy) else None,
            temperature=tensor([p.temperature or 1.0 for p in params]),
            top_k=tensor([p.top_k or (1 << 62) for p in params], torch.int64) if any_k else None,
            top_p=tensor([p.top_p if p.top_p < 1 else 2.0 for p in params]) if any_p else None,
            min_p=tensor([p.min_p for p in params]) if any_min_p else None,
            seeded=[(i, s.generator) for i, s in enumerate(seqs) if s.generator is not None and not greedy[i]],
            unseeded=any(s.generator is None and not g for s, g in zip(seqs, greedy)),
            num_logprobs=max(asked) if asked else None,
            adjusts=any(p.penalized or p.min_tokens or p.logit_bias for p in params))

    @staticmethod
    def _draw(logits: torch.Tensor, rows: _Rows) -> torch.Tensor:
        x = logits.float() / rows.temperature[:, None]  # [B, vocab] fp32, a new tensor
        if rows.top_k is not None or rows.top_p is not None:
            ranked, order = x.sort(dim=-1, descending=True, stable=True)
            if rows.top_k is not None:
                rank = torch.arange(x.shape[-1], device=x.device)
                ranked.masked_fill_(rank >= rows.top_k[:, None], float("-inf"))
            if rows.top_p is not None:  # on the probabilities top-k left; the first token always stays
                p = ranked.softmax(dim=-1)
                ranked.masked_fill_(p.cumsum(dim=-1) - p > rows.top_p[:, None], float("-inf"))
            x = torch.empty_like(x).scatter_(-1, order, ranked)
        if rows.min_p is not None:
            p = x.softmax(dim=-1)
            x.masked_fill_(p < rows.min_p[:, None] * p.amax(dim=-1, keepdim=True), float("-inf"))
        probs = x.softmax(dim=-1)
        q = torch.empty_like(probs)
        if rows.unseeded:
            q.exponential_()  # every row; the seeded ones are drawn again below
        for i, generator in rows.seeded:
            q[i].exponential_(generator=generator)
        # q = 0 has probability ~2^-24 a number; 0 / 0 would be NaN, which argmax takes for the largest.
        tokens = probs.div_(q.clamp_(min=torch.finfo(q.dtype).tiny)).argmax(dim=-1)
        if rows.greedy is not None:
            tokens = torch.where(rows.greedy, logits.argmax(dim=-1), tokens)
        return tokens

    @staticmethod
    def _record_logprobs(seqs: list[Seq], logits: torch.Tensor, tokens: torch.Tensor, n: int) -> None:
        """Each asking row's ``[1 + n]`` logprobs (its token's, then the top ``n``), left on the device
        until the output is built (no sync in the step)."""
        logprobs = logits.float().log_softmax(dim=-1)
        values = logprobs.gather(-1, tokens[:, None])
        ids = tokens[:, None]
        if n:
            top = logprobs.topk(n, dim=-1)
            values, ids = torch.cat([values, top.values], dim=-1), torch.cat([ids, top.indices], dim=-1)
        for i, seq in enumerate(seqs):
            if seq.params.logprobs is not None:
                seq.logprob_rows.append((values, ids, i))


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The packed ``bitmask`` ``[B, words]`` as bools ``[B, vocab]``."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab].bool()


def logprobs_of(seq: Seq) -> list[dict[int, float]]:
    """``seq``'s recorded logprobs on the host: per generated token ``{id: logprob}``, its own token's first,
    then its ``params.logprobs`` most likely (one device-to-host copy per step's tensors)."""
    k = 1 + seq.params.logprobs
    host: dict[int, tuple[list[list[float]], list[list[int]]]] = {}
    out = []
    for values, ids, row in seq.logprob_rows[:seq.num_generated]:  # async: a step past the end is dropped
        if id(values) not in host:
            host[id(values)] = (values.tolist(), ids.tolist())
        v, i = host[id(values)]
        out.append({tok: lp for tok, lp in zip(i[row][:k], v[row][:k])})
    return out
