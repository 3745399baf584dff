"""A checkpoint's tokenizer and end-of-sequence tokens.

The tokenizer is the checkpoint directory's own (``tokenizer.json`` / ``tokenizer_config.json`` /
``tokenizer.model``), loaded with ``transformers.AutoTokenizer``, imported only then: token ids need no
tokenizer, and ``transformers`` is an optional dependency (``pip install dynamo-once[text]``). Built-in
models (random weights) have none.

End-of-sequence tokens, as vLLM and ``transformers.generate`` take them: ``eos_token_id`` (an id or a
list) of ``generation_config.json``, else of ``config.json`` (or its ``text_config``), else the tokenizer's.
"""

from __future__ import annotations

import os
from typing import Any

from .loader import CheckpointError, read_json_object

__all__ = ["TOKENIZER_FILES", "eos_token_ids", "load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: str) -> Any | None:
    """The tokenizer of checkpoint directory ``path``; None when it holds none of :data:`TOKENIZER_FILES`.

    Raises:
        ImportError: ``transformers`` is not installed (the message says how to install it).
        CheckpointError: the files are there but do not load.
    """
    if not os.path.isdir(path) or not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError(f"{path} has a tokenizer; loading it needs the 'transformers' package "
                          "(pip install transformers, or pip install dynamo-once[text])") from None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for a broken tokenizer
        raise CheckpointError(f"{path}: cannot load its tokenizer: {type(e).__name__}: {e}") from None


def eos_token_ids(model: str, tokenizer: Any = None) -> frozenset[int]:
    """The end-of-sequence ids of checkpoint directory or built-in name ``model`` (empty: none known).

    Raises:
        CheckpointError: an ``eos_token_id`` that is not an id or a list of ids, naming the file.
    """
    from .registry import BUILTIN_MODELS

    sources: list[tuple[str, dict[str, Any]]] = []
    if os.path.isdir(model):
        for name in ("generation_config.json", "config.json"):
            file = os.path.join(model, name)
            if os.path.isfile(file):
                sources.append((file, read_json_object(file)))
    elif model in BUILTIN_MODELS:
        sources.append((model, BUILTIN_MODELS[model]))
    for where, config in sources:
        text_config = config.get("text_config")
        value = config.get("eos_token_id")
        if value is None and isinstance(text_config, dict):  # Llava: the language model's
            value = text_config.get("eos_token_id")
        if value is not None:
            return _ids(value, where)
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset([int(eos)])


def _ids(value: Any, where: str) -> frozenset[int]:
    values = value if isinstance(value, list) else [value]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{where}: eos_token_id must be a token id or a list of them; got {value!r}")
    return frozenset(values)
