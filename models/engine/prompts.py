"""What a caller may pass as prompts to :meth:`LLM.generate`, made uniform: :class:`Prompt` (text, ids, images).

A prompt is a string (tokenized by the checkpoint's tokenizer, special tokens added as it says, e.g. a
BOS), a list of token ids, or a dict as vLLM takes it: ``{"prompt": str}`` or ``{"prompt_token_ids":
[...]}``, with ``"multi_modal_data": {"image": image or [images]}`` for a model that takes images.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Prompt", "is_text_call", "parse_prompts"]

_DICT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data"}


@dataclasses.dataclass
class Prompt:
    """One prompt: its text (None for token ids), its token ids, its images (None: none)."""

    text: str | None
    token_ids: list[int]
    images: Any = None


def _is_ids(p: Any) -> bool:
    return isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in p)


def is_text_call(prompts: Any) -> bool:
    """Whether ``prompts`` holds a string or a dict (else token-id lists: the older, ids-only call)."""
    if isinstance(prompts, (str, dict)):
        return True
    return isinstance(prompts, Sequence) and any(isinstance(p, (str, dict)) for p in prompts)


def parse_prompts(prompts: Any, images: Sequence[Any] | None,
                  encode: Callable[[str, str], list[int]]) -> list[Prompt]:
    """``prompts`` (one prompt or a list of them) as :class:`Prompt` objects.

    Args:
        images: one entry per prompt (None or its images), or None.
        encode: ``encode(text, where)``, the tokenizer (it raises when the model has none).

    Raises:
        ValueError / TypeError: a prompt of no known form, a dict with other keys, images given twice.
    """
    if isinstance(prompts, (str, dict)) or (_is_ids(prompts) and prompts):
        prompts = [prompts]  # one prompt (a list of ints is one token-id prompt: an int is no prompt)
    if not isinstance(prompts, Sequence):
        raise TypeError(f"generate: prompts must be a string, a list of token ids, a dict or a list of those; "
                        f"got {type(prompts).__name__}")
    if images is not None and len(images) != len(prompts):
        raise ValueError(f"generate: images must have one entry (None or images) per prompt: "
                         f"{len(prompts)} prompts, {len(images)} entries")
    out = []
    for i, p in enumerate(prompts):
        where = f"generate: prompt {i}"
        prompt = _parse_one(p, where, encode)
        if images is not None and images[i] is not None:
            if prompt.images is not None:
                raise ValueError(f"{where}: images given both in multi_modal_data and in images=")
            prompt.images = images[i]
        out.append(prompt)
    return out


def _parse_one(p: Any, where: str, encode: Callable[[str, str], list[int]]) -> Prompt:
    if isinstance(p, str):
        return Prompt(p, encode(p, where))
    if _is_ids(p):
        return Prompt(None, list(p))
    if not isinstance(p, dict):
        raise TypeError(f"{where}: expected a string, a list of token ids or a dict; got {type(p).__name__}")
    extra = set(p) - _DICT_KEYS
    if extra or ("prompt" in p) == ("prompt_token_ids" in p):
        raise ValueError(f"{where}: a dict prompt has 'prompt' (a string) or 'prompt_token_ids' (a list of "
                         f"ints), and optionally 'multi_modal_data'; got keys {sorted(p)}")
    if "prompt" in p:
        if not isinstance(p["prompt"], str):
            raise TypeError(f"{where}: 'prompt' must be a string; got {type(p['prompt']).__name__}")
        prompt = Prompt(p["prompt"], encode(p["prompt"], where))
    else:
        if not _is_ids(p["prompt_token_ids"]):
            raise TypeError(f"{where}: 'prompt_token_ids' must be a list of ints")
        prompt = Prompt(None, list(p["prompt_token_ids"]))
    data = p.get("multi_modal_data")
    if data is not None:
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError(f"{where}: multi_modal_data takes {{'image': image or [images]}}; got {data!r:.80}")
        prompt.images = data.get("image")
    return prompt
