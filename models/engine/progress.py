"""``LLM.generate(..., use_tqdm=True)``: a progress bar over a call's sequences, updated between engine steps."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .sequence import Seq

__all__ = ["progress"]


@contextmanager
def progress(done: Callable[[], bool], seqs: list[Seq]) -> Iterator[Callable[[], bool]]:
    """``done`` (a :meth:`EngineLoop.run_until` condition over ``seqs``) that also moves a ``tqdm`` bar: the
    sequences ended so far, and the output tokens a second since the call began. Closed on leaving."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(seqs), desc="Processed prompts", unit="seq", dynamic_ncols=True)
    t0 = time.perf_counter()

    def moved() -> bool:
        finished = done()
        ended = sum(1 for s in seqs if s.done)
        if ended != bar.n:
            tokens = sum(s.num_generated for s in seqs)
            bar.set_postfix_str(f"output {tokens / max(time.perf_counter() - t0, 1e-9):.1f} tok/s", refresh=False)
            bar.update(ended - bar.n)
        return finished

    try:
        yield moved
    finally:
        bar.close()
