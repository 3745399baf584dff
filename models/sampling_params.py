"""``SamplingParams``: how one request is sampled and when it stops, checked when it is made.

The fields and defaults of vLLM's ``SamplingParams`` that :class:`models.LLM` implements. Sampling applies,
in order: the penalties (``repetition_penalty``, then ``frequency_penalty`` and ``presence_penalty``) and
``min_tokens``' ban on stopping tokens to the logits, then ``temperature`` (0: greedy, of the penalized logits),
``top_k``, ``top_p`` (on the probabilities left by top-k), ``min_p`` (against the most likely token left). A
request stops at the first of: an end-of-sequence token of the checkpoint (``generation_config.json``, else
``config.json``; not with ``ignore_eos``), one of ``stop_token_ids``, one of the ``stop`` strings in the generated
text (none of these before ``min_tokens`` tokens), ``max_tokens`` tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NoReturn

from .structured_outputs import StructuredOutputsParams

__all__ = ["MAX_LOGPROBS", "SamplingParams"]

#: The most top logprobs a request may ask for per generated token (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20


@dataclasses.dataclass
class SamplingParams:
    """Sampling and stopping of one request.

    Args:
        temperature: 0 for greedy (argmax, ties to the lowest id, as ``transformers``); else the logits are
            divided by it before the masks and the draw.
        top_p: keep the most likely tokens whose probabilities sum to ``top_p`` (at least one), in (0, 1].
        top_k: keep the ``top_k`` most likely tokens; None or -1 (vLLM's spelling): all. 0 is refused
            (vLLM 0 and -1 both mean off; one spelling of "off" besides None is less surprising).
        min_p: drop tokens less likely than ``min_p`` times the most likely one, in [0, 1].
        max_tokens: the most tokens generated, >= 1.
        stop: a string or strings that end generation when the generated text contains one; the returned
            text stops before it.
        stop_token_ids: token ids that end generation (the token is kept in ``token_ids``).
        ignore_eos: do not stop at the checkpoint's end-of-sequence token(s).
        seed: this request's own generator: the same seed and prompt give the same tokens in any batch.
            None: torch's global generator (``torch.manual_seed`` makes a run repeatable).
        logprobs: for each generated token, the log-probabilities of it and of the ``logprobs`` most likely
            tokens (from the model's raw logits, before penalties, temperature and masks); None: none.
        n: completions of the prompt, each sampled on its own (``RequestOutput.outputs``); >= 1. With a
            ``seed``, completion ``i`` draws from ``seed + i``.
        presence_penalty: subtracted from the logit of every token generated so far, in [-2, 2] (OpenAI's).
        frequency_penalty: subtracted from each token's logit once per time it was generated, in [-2, 2].
        repetition_penalty: every token of the prompt or generated so far has its logit divided by it where
            positive, multiplied where negative (> 1 discourages repeats; 1: off), > 0 (CTRL's, as vLLM).
        min_tokens: no end-of-sequence token, stop token or stop string ends the request before this many
            tokens (the tokens' logits are masked until then); in [0, max_tokens].
        logit_bias: ``{token id: bias}`` added to those tokens' logits at every step, each bias in [-100, 100]
            (OpenAI's; -100 in effect bans a token, 100 all but forces it); ids are checked against the
            vocabulary when the request is made.
        prompt_logprobs: for each prompt token after the first, the log-probabilities of it and of the
            ``prompt_logprobs`` most likely tokens there, given the tokens before it (``RequestOutput.prompt_logprobs``;
            such a prompt is computed whole, never taken from the prefix cache; not with tensor parallelism);
            None: none.
        structured_outputs: a :class:`models.StructuredOutputsParams` the output must follow (a JSON schema,
            any JSON object, a regex, a choice, a grammar); it ends with the end-of-sequence token where the
            constraint is met (so not with ``ignore_eos``). Needs the checkpoint's tokenizer and ``xgrammar``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.temperature = _real("temperature", self.temperature)
        if math.isnan(self.temperature) or not 0 <= self.temperature < math.inf:
            _refuse("temperature", "a finite number >= 0 (0: greedy)", self.temperature)
        self.top_p = _real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:  # NaN fails it too
            _refuse("top_p", "a number in (0, 1]", self.top_p)
        self.min_p = _real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            _refuse("min_p", "a number in [0, 1]", self.min_p)
        if self.top_k is not None:
            if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
                _refuse("top_k", "an int >= 1, or None or -1 for all tokens", self.top_k)
            self.top_k = None if self.top_k == -1 else int(self.top_k)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _refuse("max_tokens", "an int >= 1", self.max_tokens)
        self._check_penalties()
        self.logit_bias = self._bias(self.logit_bias)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                _refuse("structured_outputs", "a StructuredOutputsParams or None", self.structured_outputs)
            if self.ignore_eos:
                _refuse("ignore_eos", "False with structured_outputs (the output ends with EOS where the "
                        "constraint is met)", self.ignore_eos)
        if not _is_int(self.n) or self.n < 1:
            _refuse("n", "an int >= 1", self.n)
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _refuse("min_tokens", f"an int in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        if self.seed is not None and not _is_int(self.seed):
            _refuse("seed", "an int or None", self.seed)
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _refuse("logprobs", f"None or an int in [0, {MAX_LOGPROBS}]", self.logprobs)
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            _refuse("prompt_logprobs", f"None or an int in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        if not isinstance(self.ignore_eos, bool):
            _refuse("ignore_eos", "a bool", self.ignore_eos)
        self.stop = self._stop_strings(self.stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) or not all(
                _is_int(t) and t >= 0 for t in ids):
            _refuse("stop_token_ids", "a list of token ids (ints >= 0)", self.stop_token_ids)
        self.stop_token_ids = [int(t) for t in ids]

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2 <= value <= 2:
                _refuse(name, "a number in [-2, 2]", value)
            setattr(self, name, value)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty < math.inf:
            _refuse("repetition_penalty", "a finite number > 0 (1: off)", self.repetition_penalty)

    @staticmethod
    def _bias(bias: object) -> dict[int, float] | None:
        """``logit_bias`` with int ids (JSON gives its keys as strings) and float biases; None when empty."""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            _refuse("logit_bias", "a dict of token id -> bias", bias)
        out = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.isdigit() else key
            if not _is_int(token) or token < 0:
                _refuse("logit_bias", "token ids (ints >= 0) as keys", key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                _refuse("logit_bias", f"biases in [-100, 100] (token {token})", value)
            out[int(token)] = float(value)
        return out or None

    def completions(self) -> list[SamplingParams]:
        """The ``n`` completions' own params (``n`` 1; completion ``i`` seeded with ``seed + i``)."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @staticmethod
    def _stop_strings(stop: str | Sequence[str] | None) -> list[str]:
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
            _refuse("stop", "a non-empty string or a list of them", stop)
        return list(stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _refuse(name, "a number", value)
    return float(value)


def _refuse(name: str, expected: str, given: object) -> NoReturn:
    raise ValueError(f"SamplingParams: {name} must be {expected}; got {given!r}")
