"""``Seq``: one prompt's state while the engine runs it (its tokens, cache blocks, progress)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Chooser", "Seq"]


@dataclasses.dataclass(eq=False)  # compared by identity (the input batch's block-table reuse)
class Seq:
    """A prompt and the tokens generated after it: what :meth:`LLM.run`'s ``choose`` gets."""

    index: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    images: Any = None  # the model's prepare_images() of this prompt's images, used at its prefill

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


Chooser = Callable[[list[Seq], torch.Tensor], list[int]]
"""``choose(seqs, logits)``: the next token of each of a step's sequences, from their logits ``[B, vocab]``."""
