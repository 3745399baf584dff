"""``IncrementalDetokenizer``: a sequence's text, grown a token at a time, and its stop strings.

Decoding each new token alone is wrong twice over: a byte-level BPE piece may hold part of a multi-byte
UTF-8 character (``"é"`` is two bytes, which may be two tokens), and SentencePiece drops a token's leading
space when it is decoded first. So, as vLLM and text-generation-inference do, the tokens are decoded in a
short window: ``prefix`` (already turned into text, decoded again for context) and what came after; the
new text is what the window's decode adds to the prefix's. While the window's text ends in U+FFFD (an
incomplete character) nothing is added: the next token may complete it. The window starts with up to
:data:`CONTEXT` prompt tokens. Special tokens are skipped (vLLM's default ``skip_special_tokens``).

A stop string is looked for in the text each token adds (with the end of the text before it, as it may
span tokens); the text is cut before it. Until the sequence ends, :attr:`visible` holds back the last
``len(longest stop) - 1`` characters, which may be the start of a stop string (a stream never shows text
that a stop string later takes back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["CONTEXT", "IncrementalDetokenizer"]

#: Prompt tokens decoded before the first generated one (SentencePiece's leading space needs one; vLLM: 5).
CONTEXT = 5


class IncrementalDetokenizer:
    """The generated text of one sequence.

    Args:
        tokenizer: a ``transformers`` tokenizer (``decode``).
        prompt: the prompt's token ids (the last :data:`CONTEXT` start the decode window).
        stop: the stop strings.
    """

    def __init__(self, tokenizer: Any, prompt: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self._ids = list(prompt[-CONTEXT:])
        self._prefix = 0  # the window: _ids[_prefix:]; _ids[_prefix:_read] is already text
        self._read = len(self._ids)
        self.stop = list(stop)
        self._holdback = max(map(len, self.stop), default=1) - 1
        self.text = ""
        #: ``(text, finished)``, replaced whole (one assignment): a reader on another thread sees a pair
        #: that belongs together.
        self.snapshot: tuple[str, bool] = ("", False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token: int, find_stop: bool = True) -> str | None:
        """Take a generated token; the stop string it completes, if any (the text is then cut before it).
        ``find_stop`` False (before ``min_tokens``): the text grows, no stop string is looked for."""
        self._ids.append(token)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            self.snapshot = (self.text, False)
            return None  # nothing yet, or an incomplete character that the next token may complete
        self._prefix, self._read = self._read, len(self._ids)
        return self._extend(new_text[len(prefix_text):], find_stop)

    def finish(self) -> None:
        """The sequence ended without a stop string: the window's rest becomes text, an incomplete
        character's bytes included (as U+FFFD, as a whole decode gives them)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        self._extend(new_text[len(prefix_text):])
        self.snapshot = (self.text, True)

    def _extend(self, delta: str, find_stop: bool = True) -> str | None:
        start = max(0, len(self.text) - self._holdback)  # a stop string may begin in the text before
        self.text += delta
        found = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0] if find_stop else []
        if found:
            i, stop = min(found)
            self.text = self.text[:i]
            self.snapshot = (self.text, True)
            return stop
        self.snapshot = (self.text, False)
        return None

    @property
    def visible(self) -> str:
        """The text a stream may show now: all of it once ended, else without the last characters that
        could begin a stop string."""
        text, finished = self.snapshot
        return text if finished or not self._holdback else text[:max(0, len(text) - self._holdback)]
