"""Choosing the next tokens: each sequence's sampler, a step's samplers together, and the tokens' way to the host.

Every sequence has a sampler: the per-request one of ``SamplingParams`` (:mod:`.request_sampler`), the
one-temperature sampler of a token-id :meth:`LLM.generate` call (:func:`make_sampler`), or the host
``choose`` of :meth:`LLM.run` (:class:`ChooserSampler`). A step may hold sequences of several calls (one
engine, callers on several threads): :func:`sample` gives each sampler its rows.

On the synchronous path a step's tokens are host ints at once (``.tolist()`` syncs). With async scheduling
a decode-only step's tokens stay on the device, as the next step's input ids, while an asynchronous copy
brings them to one of two alternating host buffers, read one step late.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from .sequence import Chooser, Seq

__all__ = ["ChooserSampler", "PendingStep", "SampledTokens", "Sampler", "make_sampler", "sample"]


class Sampler(Protocol):
    """Picks the next token of each of a step's sequences (all of them this sampler's) from their logits
    ``[B, vocab]`` in the model's dtype: device token ids ``[B]`` if ``on_device``, else host ints."""

    on_device: bool

    def __call__(self, seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor | list[int]: ...


class _CallSampler:
    on_device = True

    def __init__(self, temperature: float, top_k: int | None, generator: torch.Generator) -> None:
        self.temperature, self.top_k, self.generator = temperature, top_k, generator

    def __call__(self, seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:  # in the model's dtype: converting is exact, so the argmax is the same
            return logits.argmax(dim=-1)
        scaled = logits.float() / self.temperature
        if self.top_k is not None:
            kth = scaled.topk(min(self.top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)


def make_sampler(temperature: float, top_k: int | None, generator: torch.Generator) -> Sampler:
    """One call's sampler (token-id :meth:`LLM.generate`): greedy for ``temperature`` 0 (argmax, ties to the
    lowest id, as ``transformers``), else a draw from ``softmax(logits / temperature)`` with ``generator``
    (one for the call's sequences, in step order), among the ``top_k`` most likely tokens if given."""
    return _CallSampler(temperature, top_k, generator)


class ChooserSampler:
    """:meth:`LLM.run`'s ``choose(seqs, logits)``, given fp32 logits; its tokens are host ints."""

    on_device = False

    def __init__(self, choose: Chooser) -> None:
        self.choose = choose

    def __call__(self, seqs: list[Seq], logits: torch.Tensor) -> list[int]:
        return self.choose(seqs, logits.float())


def sample(seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor | list[int]:
    """The next token of each of ``seqs`` (rows of ``logits``), each sampler given its own rows in order:
    device ids ``[B]`` when every sampler is on the device, else host ints."""
    first = seqs[0].sampler
    if all(s.sampler is first for s in seqs):  # one caller's step: no split
        return first(seqs, logits)
    groups: dict[int, tuple[Sampler, list[int]]] = {}
    for i, s in enumerate(seqs):
        groups.setdefault(id(s.sampler), (s.sampler, []))[1].append(i)
    parts = [(rows, sampler([seqs[i] for i in rows], logits[rows])) for sampler, rows in groups.values()]
    if all(isinstance(tokens, torch.Tensor) for _, tokens in parts):
        out = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        for rows, tokens in parts:
            out[torch.tensor(rows, device=logits.device)] = tokens
        return out
    host = [0] * len(seqs)
    for rows, tokens in parts:
        for i, t in zip(rows, tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens):
            host[i] = int(t)
    return host


@dataclasses.dataclass(eq=False)
class PendingStep:
    """A decode-only step whose sampled tokens are on the device, on their way to a host buffer."""

    seqs: list[Seq]
    tokens: torch.Tensor  # [B] int64, on the device: the next step's input ids
    host: torch.Tensor  # [B] int64 (pinned on CUDA), filled by an asynchronous copy
    copied: Any  # torch.cuda.Event recorded after that copy; None on the CPU
    t0: float  # when the step was launched


class SampledTokens:
    """Two host buffers for sampled tokens, alternating: one step's are read while the next's arrive."""

    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self._host = [torch.zeros(max_num_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self._slot = 0

    def copy_to_host(self, seqs: list[Seq], tokens: torch.Tensor, t0: float) -> PendingStep:
        """Start copying a step's sampled ``tokens`` (device) to the next of the two host buffers."""
        self._slot ^= 1
        host = self._host[self._slot][:len(seqs)]
        host.copy_(tokens, non_blocking=True)
        copied = self._events[self._slot]
        if copied is not None:
            copied.record()
        return PendingStep(seqs, tokens, host, copied, t0)
