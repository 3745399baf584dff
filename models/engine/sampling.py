"""Choosing the next tokens: greedy or sampled on the device, and the sampled tokens' way to the host.

On the synchronous path a step's tokens are host ints at once (``choose`` syncs). With async scheduling
a decode-only step's tokens stay on the device, as the next step's input ids, while an asynchronous copy
brings them to one of two alternating host buffers, read one step late.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from .sequence import Chooser, Seq

__all__ = ["PendingStep", "SampledTokens", "Sampler", "host_chooser", "make_sampler"]

Sampler = Callable[[torch.Tensor], torch.Tensor]  # logits [B, vocab] -> token ids [B], on the device


def make_sampler(temperature: float, top_k: int | None, generator: torch.Generator) -> Sampler:
    """Greedy for ``temperature`` 0 (argmax, ties to the lowest id, as ``transformers``), else a draw from
    ``softmax(logits / temperature)`` with ``generator``, among the ``top_k`` most likely tokens if given."""

    def sample(logits: torch.Tensor) -> torch.Tensor:
        if temperature == 0:  # in the model's dtype: converting is exact, so the argmax is the same
            return logits.argmax(dim=-1)
        scaled = logits.float() / temperature
        if top_k is not None:
            kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    return sample


def host_chooser(sample: Sampler) -> Chooser:
    """A ``choose`` (see :meth:`LLM.run`) that returns ``sample``'s tokens as host ints."""

    def choose(seqs: list[Seq], logits: torch.Tensor) -> list[int]:
        return sample(logits).tolist()

    return choose


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
