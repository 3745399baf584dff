"""``GenerateStats``: the timing of the last ``LLM.generate``, filled in by the scheduler."""

from __future__ import annotations

import dataclasses

__all__ = ["GenerateStats"]


@dataclasses.dataclass
class GenerateStats:
    """Timing of the last :meth:`LLM.generate`; a step is one forward + sampling."""

    num_steps: int = 0
    num_mixed_steps: int = 0
    """Steps holding both decode and prefill sequences."""
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    decode_step_times_s: list[float] = dataclasses.field(default_factory=list)
    """Steps with decode sequences only."""
    mixed_step_times_s: list[float] = dataclasses.field(default_factory=list)
    """Steps holding both decode and prefill sequences (the piecewise path at level 3)."""
    num_generated: int = 0
    max_decode_batch: int = 0
    """The most sequences in one decode-only step (all requests in flight together reach it)."""
    num_overlapped_steps: int = 0
    """Decode steps launched before the last step's tokens were read (``async_scheduling``)."""
    total_s: float = 0.0
    num_preemptions: int = 0
    """Running sequences whose cache blocks were taken back for others' new tokens, to be computed again."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (``LLM(prefix_caching=True)``): their keys and values not computed."""

    @property
    def median_decode_step_s(self) -> float:
        times = sorted(self.decode_step_times_s or self.step_times_s)
        return times[len(times) // 2] if times else float("nan")
