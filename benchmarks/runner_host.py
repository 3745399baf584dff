"""Host time of one ``models.LLM.generate`` decode step, with the model's work taken out.

Every decode step of ``LLM.generate`` ends in a host sync (its sampled tokens are host ints),
so the host work before the next step's forward (scheduling, building and staging the step's
inputs, the block table, sampling) is time the GPU sits idle. This measures that work alone: the
model is replaced by a stub that returns zeros of the right shapes, on the CPU, at several batch
sizes (prompts of 16 tokens, 64 new tokens; median decode step).

Usage: ``python -m benchmarks.runner_host [--batches 1,8,32,128,256] [--out DIR] [--compare-with DIR]
[--prefix-caching]``; ``--compare-with`` also measures the ``models`` package of another checkout (e.g. an older
commit's ``git worktree``), in a subprocess, as a second series; ``--prefix-caching`` this checkout's runner with
``enable_prefix_caching=True`` too (16-token prompts: no prompt finds a cached block, every full block is keyed:
what the cache costs a workload that shares nothing).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn

from benchmarks import common


class _StubModel(nn.Module):
    """Zeros of the shapes the runner expects: hidden ``[T, 1]`` and logits ``[B, vocab]``."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, embeds: Any = None) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], self.vocab_size)


def measure(batches: list[int], new_tokens: int = 64, prompt_len: int = 16, repeats: int = 3,
            label: str = "this checkout", prefix_caching: bool = False) -> list[dict[str, Any]]:
    """One row per batch size: the median decode step's host µs, best of ``repeats`` runs."""
    from models import LLM

    max_b = max(batches)
    llm = LLM("tiny-llama", level=0, max_num_tokens=max(512, max_b * prompt_len), max_num_seqs=max_b,
              num_cache_tokens=max_b * (prompt_len + new_tokens + 16), device="cpu",
              enable_prefix_caching=prefix_caching)
    llm.model = _StubModel(llm.vocab_size)
    rows = []
    for b in batches:
        prompts = [[(7 * i + j) % (llm.vocab_size - 1) + 1 for j in range(prompt_len)] for i in range(b)]
        llm.generate(prompts, 4)  # warm-up
        steps, loops = zip(*(_decode_step_times(llm, prompts, new_tokens) for _ in range(repeats)))
        step, loop = min(steps), min(loops)
        rows.append(dict(runner=label, batch=b, host_us_per_decode_step=round(step * 1e6, 1),
                         host_us_per_sequence=round(step * 1e6 / b, 2),
                         loop_us_per_decode_step=round(loop * 1e6, 1)))
        print(rows[-1], flush=True)
    return rows


def run(batches: list[int], new_tokens: int = 64, prompt_len: int = 16, repeats: int = 3,
        out_dir: str | None = None, compare_with: str | None = None,
        prefix_caching: bool = False) -> list[dict[str, Any]]:
    rows = measure(batches, new_tokens, prompt_len, repeats)
    if prefix_caching:
        rows += measure(batches, new_tokens, prompt_len, repeats, "prefix caching on", prefix_caching=True)
    if compare_with:
        rows += _measure_elsewhere(compare_with, batches, new_tokens, prompt_len, repeats)
    common.write_results("runner_host", rows, title="Host time of one LLM.generate decode step (model stubbed)",
                         device="cpu", out_dir=out_dir,
                         notes=[f"{prompt_len}-token prompts, {new_tokens} new tokens, greedy; best of {repeats} runs",
                                "host_us_per_decode_step: the median decode step as LLM.stats times it (inputs, "
                                "forward, sampling); loop_us_per_decode_step: the whole scheduling loop a decode "
                                f"step (from a {new_tokens}- and a 4-token run)",
                                "the model is a stub returning zeros: what is left is the runner's scheduling, "
                                "input staging, block table and sampling"])
    common.plot_lines("runner_host", rows, x="batch", y="loop_us_per_decode_step", series="runner", logx=True,
                      out_dir=out_dir,
                      title="LLM.generate: host time of the loop a decode step (model stubbed, CPU)",
                      xlabel="batch (sequences)", ylabel="µs per step")
    return rows


def _measure_elsewhere(checkout: str, batches: list[int], new_tokens: int, prompt_len: int,
                       repeats: int) -> list[dict[str, Any]]:
    """:func:`measure` with another checkout's ``models`` (and ``dispatcher``, ``ops``) first on the path."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    import tempfile

    checkout = os.path.abspath(checkout)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rev = subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    label = f"commit {rev.stdout.strip()}" if rev.returncode == 0 else os.path.basename(checkout.rstrip("/"))
    code = ("import json, os, sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "import models; "
            "assert os.path.dirname(os.path.dirname(os.path.abspath(models.__file__))) == sys.argv[2], models.__file__; "
            "from benchmarks.runner_host import measure; "
            "print(json.dumps(measure(json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), "
            "int(sys.argv[6]), sys.argv[7])))")
    # The other checkout's packages shadow this one's; this file's measure() comes from a copy of this
    # package put first on the path.
    with tempfile.TemporaryDirectory() as script_dir:
        os.makedirs(os.path.join(script_dir, "benchmarks"))
        for name in ("__init__.py", "common.py", "runner_host.py"):
            shutil.copy(os.path.join(here, "benchmarks", name), os.path.join(script_dir, "benchmarks", name))
        out = subprocess.run([sys.executable, "-c", code, script_dir, checkout, json.dumps(batches), str(new_tokens),
                              str(prompt_len), str(repeats), label], capture_output=True, text=True, check=False,
                             env=dict(os.environ, PYTHONPATH=""))
    if out.returncode != 0:
        raise RuntimeError(f"runner_host: measuring {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _decode_step_times(llm: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(median decode step as ``LLM.stats`` times it: the step's inputs, forward and sampling; the whole
    scheduling loop per decode step, bookkeeping included: from two runs that differ in decode steps only)."""
    llm.generate(prompts, new_tokens)
    long = llm.stats
    llm.generate(prompts, 4)
    short = llm.stats
    return long.median_decode_step_s, (long.total_s - short.total_s) / (long.num_steps - short.num_steps)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,32,128,256")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--compare-with", default=None, help="another checkout whose runner to measure too")
    p.add_argument("--prefix-caching", action="store_true", help="this runner with prefix caching on too")
    a = p.parse_args(argv)
    run([int(b) for b in a.batches.split(",")], new_tokens=a.new_tokens, out_dir=a.out, compare_with=a.compare_with,
        prefix_caching=a.prefix_caching)


if __name__ == "__main__":
    main()
