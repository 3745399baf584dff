"""``LLM.startup``: how long each phase of a model's start-up took, and whether its compile was cached."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dispatcher import TorchCompileWrapperWithCustomDispatcher

logger = logging.getLogger(__name__)

__all__ = ["StartupReport", "process_age_s"]


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class StartupReport:
    """Seconds by phase of an ``LLM``'s start-up (``LLM.startup``), logged at INFO once it is built.

    Attributes:
        import_s: process start to ``LLM(...)``: the interpreter, imports, and whatever the caller did first
            (None where the process's start time is unknown).
        load_s: building the model and loading its weights.
        trace_s: the warm-up forward less the compile: Dynamo's trace (or the AOT forward's load), split and the
            first run.
        trace: ``"dynamo"`` (Dynamo traced forward), ``"aot"`` (the compile cache's AOT forward ran instead: no
            trace), ``"off"`` (level 0: nothing compiled), or a mix, e.g. ``"aot+dynamo"``.
        compile_s: Inductor's compiles of the pieces (cache hits included) and loading the compile cache.
        compile_cache: ``"hit"``, ``"miss"``, ``"corrupt"`` (a cache file that could not be used), ``"off"``
            (disabled, below level 3, or a model whose key cannot be computed), or a mix, e.g. ``"hit+miss"``.
        capture_s: CUDA-graph capture (with the compiles it triggers).
        ready_s: process start to the end of the constructor (None as import_s).
        first_token_s: process start to the first token of the first ``generate`` (None until then).
    """

    import_s: float | None = None
    load_s: float = 0.0
    trace_s: float = 0.0
    trace: str = "off"
    compile_s: float = 0.0
    compile_cache: str = "off"
    capture_s: float = 0.0
    ready_s: float | None = None
    first_token_s: float | None = None

    def finish(self, compiled: Sequence[TorchCompileWrapperWithCustomDispatcher], load_s: float, warm_up_s: float,
               capture_s: float) -> None:
        """At the end of the constructor: write the compile cache again if the capture compiled anything new,
        split the warm-up into trace and compile, and log the phases."""
        for m in compiled:
            m.save_compile_cache()
        entries = [m.compile_cache for m in compiled if m.compile_cache is not None]
        self.load_s, self.capture_s = load_s, capture_s
        self.compile_s = sum(m.backend_compile_s for m in compiled) + sum(e.load_s for e in entries)
        self.trace_s = max(0.0, warm_up_s - self.compile_s)
        self.compile_cache = "+".join(sorted({e.status for e in entries})) or "off"
        self.trace = "+".join(sorted({"aot" if m.aot_status == "loaded" else "dynamo" for m in compiled
                                      if m.compilation_level > 0})) or "off"
        self.ready_s = process_age_s()
        logger.info("LLM start-up: %s", self.format())

    def first_token(self, execute: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``execute`` that sets ``first_token_s`` when its first call's logits are ready."""
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            logits = execute(*args, **kwargs)
            if self.first_token_s is None:
                if logits.is_cuda:
                    torch.cuda.synchronize(logits.device)
                self.first_token_s = process_age_s()
            return logits
        return run

    def format(self) -> str:
        def s(v: float | None) -> str:
            return "?" if v is None else f"{v:.2f}s"
        trace = "skipped: AOT forward loaded" if self.trace == "aot" else self.trace
        return (f"import {s(self.import_s)}, load {s(self.load_s)}, trace {s(self.trace_s)} ({trace}), compile "
                f"{s(self.compile_s)} (cache {self.compile_cache}), capture {s(self.capture_s)}; ready at "
                f"{s(self.ready_s)}, first token at {s(self.first_token_s)}")
