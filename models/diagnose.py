"""``diagnose``: the recommended check, automated. Run levels 0, 1, 2 (and 3) on the same input and compare.

Every level runs the same batch (prompts of different lengths, so that steps
mix prefill and decode and the token count varies from step to step) and is
fed the same tokens, the greedy choices of level 0 (teacher forcing: one
early difference does not derail the comparison of every later step). The
logits of every step are compared pairwise:

- 1 differs from 0: torch.compile itself computes something else (a bug to report);
- 2 differs from 1: the model cannot be captured as one static graph (a branch
  on a size, a Python value read at trace time); level 1 re-traced, level 2
  ran the first trace;
- all agree: levels 3/4 (Inductor) are safe to try; 3 vs 2 shows Inductor's
  numerical difference.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dispatcher import CompilationLevel, compilation_counter

from .engine import LLM

logger = logging.getLogger(__name__)

__all__ = ["DiagnoseReport", "LevelResult", "diagnose", "DEFAULT_PROMPTS"]

#: lengths 7, 2, 13, 1, 5: with ``max_num_tokens=16`` the steps mix prefill and decode
DEFAULT_PROMPTS = [[3, 17, 91, 4, 55, 23, 8], [100, 2], [7, 7, 31, 64, 12, 90, 41, 33, 5, 19, 77, 120, 1], [42],
                   [9, 8, 7, 6, 5]]


@dataclasses.dataclass
class LevelResult:
    level: CompilationLevel
    compile_time_s: float
    """The warm-up forward: Dynamo trace and backend compile at levels >= 1."""
    median_step_s: float
    """Median latency of a decode-only step (forward + sampling)."""
    recompiles: int
    logits: list[torch.Tensor]
    """Per step, ``[B, vocab]``; sequences in prompt order."""


@dataclasses.dataclass
class DiagnoseReport:
    results: dict[int, LevelResult]
    max_diff: dict[tuple[int, int], float]
    tolerance: float

    def agree(self, a: int, b: int) -> bool:
        return self.max_diff[(a, b)] <= self.tolerance

    def verdict(self) -> list[str]:
        lines = []
        if (0, 1) in self.max_diff and not self.agree(0, 1):
            lines.append("level 1 differs from level 0: torch.compile computes something else than eager "
                         "(a torch.compile bug; report it with this model).")
        if (1, 2) in self.max_diff and not self.agree(1, 2):
            lines.append("level 2 differs from level 1: the model cannot be captured as one static graph (a branch "
                         "on the token count or a Python value read at trace time). Run it at level 1, or remove "
                         "the branch; DYNAMO_ONCE_DEBUG=1 names the failing shape guard.")
        if (2, 3) in self.max_diff and not self.agree(2, 3):
            lines.append("level 3 differs from level 2 beyond the tolerance: Inductor's numerics (or a bug in a "
                         "fused kernel).")
        if not self.max_diff:
            ran = ", ".join(str(lv) for lv in self.results) or "none"
            lines.append(f"compared nothing: fewer than two distinct levels ran (levels run: {ran}); give at least "
                         "two, e.g. --levels 0,1,2,3 (TORCH_COMPILE_DISABLE=1 runs every level as level 0).")
        elif not lines:
            lines.append("all levels agree: levels 3/4 (Inductor) are safe to try.")
        return lines

    def format(self) -> str:
        rows = [f"{'level':<26} {'compile (s)':>11} {'step (ms)':>10} {'recompiles':>10}"]
        for r in self.results.values():
            rows.append(f"{int(r.level)} {r.level.name:<24} {r.compile_time_s:>11.2f} {r.median_step_s * 1e3:>10.2f} "
                        f"{r.recompiles:>10}")
        rows.append("")
        rows.append(f"max |logits difference| over every step (tolerance {self.tolerance:g}):")
        for (a, b), d in self.max_diff.items():
            rows.append(f"  {a} vs {b}: {d:.3g}  {'agree' if d <= self.tolerance else 'DIFFER'}")
        rows.append("")
        return "\n".join(rows + self.verdict())


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max().item() for x, y in zip(a, b)), default=0.0)


def diagnose(model: str | Callable[[], nn.Module], levels: Sequence[int] = (0, 1, 2, 3),
             prompts: Sequence[Sequence[int]] | None = None, max_new_tokens: int = 6, max_num_tokens: int = 16,
             tolerance: float | None = None, dtype: torch.dtype | str | None = None,
             device: torch.device | str | None = None, **llm_kwargs) -> DiagnoseReport:
    """Run ``model`` at each level on the same batch; compare the logits of every step.

    Args:
        model: a name or path (loaded anew per level: same weights), or a factory
            called under each level's config.
        levels: which to run, in order; the first is the reference whose greedy
            tokens every level is fed.
        prompts: default :data:`DEFAULT_PROMPTS` (clipped to the vocabulary).
        max_num_tokens: per-step token budget; small, so prefill and decode share steps.
        tolerance: on ``max |logits difference|``; default 1e-3 in fp32, 5e-2 otherwise.

    Raises:
        ValueError: fewer than two distinct levels (nothing to compare). A level that ran as another
            (``TORCH_COMPILE_DISABLE=1``: every level as 0) counts once; a report with nothing compared says so.
    """
    levels = list(dict.fromkeys(int(CompilationLevel.parse(lv)) for lv in levels))
    if len(levels) < 2:
        raise ValueError(f"levels {levels}: fewer than two distinct levels, so it would compare nothing; "
                         "give at least two, e.g. 0,1,2,3")
    results: dict[int, LevelResult] = {}
    forced: dict[tuple[int, int], int] = {}
    model_dtype = None
    for lv in levels:
        before = compilation_counter.num_recompiles
        llm = LLM(model, level=lv, max_num_tokens=max_num_tokens, dtype=dtype, device=device, **llm_kwargs)
        model_dtype = llm.dtype
        batch = [list(p) for p in (prompts or DEFAULT_PROMPTS)]
        batch = [[t % llm.vocab_size for t in p] for p in batch]
        steps: list[torch.Tensor] = []
        reference = not forced

        def choose(seqs, logits, steps=steps, reference=reference):
            order = sorted(range(len(seqs)), key=lambda i: seqs[i].index)
            steps.append(logits[order].cpu())
            out = []
            for s, row in zip(seqs, logits):
                key = (s.index, s.num_generated)
                if reference:
                    forced[key] = int(row.argmax())
                out.append(forced[key])
            return out

        llm.run(batch, max_new_tokens, choose)
        if int(llm.level) in results:  # TORCH_COMPILE_DISABLE=1 ran this level as level 0 (with a warning)
            del llm
            continue
        results[int(llm.level)] = LevelResult(CompilationLevel(int(llm.level)), llm.compile_time_s, llm.stats.median_decode_step_s,
                                  compilation_counter.num_recompiles - before, steps)
        logger.info("diagnose: level %d done", lv)
        del llm
    if tolerance is None:
        tolerance = 1e-3 if model_dtype == torch.float32 else 5e-2
    pairs = [(a, b) for a, b in ((0, 1), (1, 2), (0, 2), (2, 3), (3, 4)) if a in results and b in results]
    first = next(iter(results))
    pairs += [(first, lv) for lv in results if lv != first and not any(lv in p for p in pairs)]  # e.g. 0,3
    max_diff = {(a, b): _max_diff(results[a].logits, results[b].logits) for a, b in pairs}
    return DiagnoseReport(results, max_diff, tolerance)
