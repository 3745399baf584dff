"""A mixed step (one prefill chunk plus decodes) on the level-3 piecewise path, against the sum of its parts.

A step that mixes prefill and decode (chunked prefill; a server's steady state) cannot replay a
whole-step CUDA graph: the pieces between attention ops replay their graphs and attention runs eagerly
between them. Its parts can each run their best path alone: the prefill chunk (piecewise too, at its
own size) and the decodes as one whole-step graph. For each model (random bf16 weights, level 3), prompt
chunk of P tokens (a whole prompt) and D decodes of ``--context`` cached tokens, the µs of:

- ``mixed_us``: the mixed step, piecewise (its pieces' graphs captured at its token count, D + P);
- ``prefill_us``: the chunk alone, piecewise; ``decode_us``: the D decodes alone, whole-step graph;
- ``ratio``: ``mixed_us / (prefill_us + decode_us)``: 1.0 when mixing costs nothing beyond its parts;
  above it, the piecewise path's overhead (eager attention's host time, the pieces' replays);
- ``logits_max_diff``: the mixed step's logits against its parts' (the same sequences: only the GEMMs'
  rounding at another M differs), a check that the step computed what it should.

Each step computes the logits of its last token per sequence (decodes' rows and the chunk's last row) and is
timed with a sync after every step (median of ``--iters``). Usage: ``python -m benchmarks.mixed_step
[--models llama-3-8b,llama-3.2-1b] [--prefills 64,512,2048] [--decodes 1,8,32,127] [--out DIR]``; ``--quick``
runs tiny-llama on the CPU without graphs, to check the harness.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch

from benchmarks import common, decode
from dispatcher import CUDAGraphMode, CUDAGraphs
from models import AttentionMetadata, ForwardContext, set_forward_context
from ops.paged_attention import DecodeWorkspace


class MixedHarness:
    """``decode.Harness`` with room for ``max_decodes`` decodes and a ``max_prefill``-token prompt in one step."""

    def __init__(self, name: str, max_decodes: int, max_prefill: int, context: int, device: torch.device,
                 dtype: torch.dtype, capture_sizes: list[int]) -> None:
        per = -(-(context + 1) // 16)  # cache blocks of a decode sequence (Harness: 16-token blocks)
        prompt_blocks = -(-max_prefill // 16)
        extra_rows = 1 + -(-prompt_blocks // per)  # the prompt's block-table row, and its blocks in rows' worth
        cfg = decode.mode_config("level 3", device.type == "cuda", capture_sizes)
        self.h = decode.Harness(name, cfg, max_decodes + extra_rows, context, max_prefill + max_decodes, device, dtype)
        self.base_block = max_decodes * per  # the prompt's blocks follow every decode sequence's
        self.workspace = DecodeWorkspace(max_decodes)  # persistent, as the runner's
        self.rows: torch.Tensor | None = None
        # The decodes' and the prompt's token ids, the same wherever a step puts them.
        vocab = self.h.model.config.vocab_size
        self.decode_ids = torch.randint(0, vocab, (max_decodes,), device=device)
        self.prompt_ids = torch.randint(0, vocab, (max_prefill,), device=device)

    def set_mixed(self, decodes: int, prefill: int) -> None:
        """Decodes as ``Harness.set_decode`` (rows 0..D-1), then a whole prompt of ``prefill`` tokens."""
        h = self.h
        dev, bs, pos = h.device, h.cache.block_size, h.context
        if decodes:
            h.set_decode(decodes)
        t = decodes + prefill
        p = torch.arange(prefill, device=dev)
        h.input_ids[:decodes] = self.decode_ids[:decodes]
        h.input_ids[decodes:t] = self.prompt_ids[:prefill]
        h.positions[decodes:t] = p
        h.slot_mapping[decodes:t] = self.base_block * bs + p
        starts = list(range(decodes + 1)) + [t]
        lens = [pos + 1] * decodes + [prefill]
        h.query_start_loc[: decodes + 2] = torch.tensor(starts, dtype=torch.int32, device=dev)
        h.seq_lens[: decodes + 1] = torch.tensor(lens, dtype=torch.int32, device=dev)
        nblk = -(-prefill // bs)
        h.block_table[decodes, :nblk] = self.base_block + torch.arange(nblk, device=dev, dtype=torch.int32)
        h.md = AttentionMetadata(
            slot_mapping=h.slot_mapping[:t], query_start_loc=h.query_start_loc[: decodes + 2],
            seq_lens=h.seq_lens[: decodes + 1], block_table=h.block_table[: decodes + 1], num_decodes=decodes,
            query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens), workspace=self.workspace)
        h.batch = t
        self.rows = torch.cat([torch.arange(decodes, device=dev), torch.tensor([t - 1], device=dev)])

    def set_decode(self, decodes: int) -> None:
        h = self.h
        h.set_decode(decodes)
        h.input_ids[:decodes] = self.decode_ids[:decodes]
        h.md.workspace = self.workspace
        self.rows = None

    def step(self) -> torch.Tensor:
        """The model on the current step; logits of the last token of each sequence."""
        h = self.h
        if self.rows is None:
            return h.step()
        with set_forward_context(ForwardContext(h.layers, h.md)), torch.inference_mode():
            hidden = h.model(h.input_ids[: h.batch], h.positions[: h.batch])
            return h.model.compute_logits(hidden.index_select(0, self.rows))


def _timed(m: MixedHarness, graphs: CUDAGraphs | None, mode: CUDAGraphMode, size: int,
           iters: int) -> tuple[float, torch.Tensor]:
    """Capture (once per mode and size) and time the current step: ``(median µs, its logits in fp32)``."""
    if graphs is None:
        run = m.step
    else:
        graphs.capture([size], mode, lambda n: m.step())
        run = lambda: graphs.run(mode, size, lambda n: m.step())  # noqa: E731
    us = decode._time(run, m.h.device, iters)
    return us, run().float()


def bench_model(name: str, prefills: list[int], decodes: list[int], context: int, device: torch.device,
                dtype: torch.dtype, iters: int) -> list[dict[str, Any]]:
    cuda = device.type == "cuda"
    sizes = sorted({p + d for p in prefills for d in decodes} | set(prefills) | set(decodes))
    m = MixedHarness(name, max(decodes), max(prefills), context, device, dtype, sizes)
    t0 = time.perf_counter()
    m.h.first_call(max(sizes))
    compile_s = time.perf_counter() - t0
    graphs = CUDAGraphs() if cuda else None
    if graphs is not None:
        m.h.as_the_runner(graphs, max(sizes))  # inputs and attention's outputs read in place, as the runner's
    decode_us, decode_logits = {}, {}
    for d in decodes:
        m.set_decode(d)
        decode_us[d], decode_logits[d] = _timed(m, graphs, CUDAGraphMode.FULL, d, iters)
    rows = []
    for p in prefills:
        m.set_mixed(0, p)
        prefill_us, prefill_logits = _timed(m, graphs, CUDAGraphMode.PIECEWISE, p, iters)
        for d in decodes:
            m.set_mixed(d, p)
            mixed, logits = _timed(m, graphs, CUDAGraphMode.PIECEWISE, p + d, iters)
            # The same sequences as the parts, so the same logits but for the GEMMs' other M (bf16 rounding).
            diff = max((logits[:d] - decode_logits[d]).abs().max().item(), (logits[d:] - prefill_logits).abs().max().item())
            parts = prefill_us + decode_us[d]
            rows.append(dict(model=name, prefill=p, decodes=d, mixed_us=round(mixed, 1), prefill_us=round(prefill_us, 1),
                             decode_us=round(decode_us[d], 1), ratio=round(mixed / parts, 3),
                             logits_max_diff=round(diff, 3), compile_s=round(compile_s, 1)))
            print(rows[-1], flush=True)
    del m, graphs
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return rows


def plot(name: str, rows: list[dict[str, Any]], out_dir: str | None) -> str | None:
    """``<name>.png``: the mixed step's µs against the decodes beside it, and its parts' sum, a panel per prompt
    chunk, a line per model."""
    lines = []
    for r in rows:
        parts = float(r["prefill_us"]) + float(r["decode_us"])
        for us, what in ((float(r["mixed_us"]), "mixed"), (parts, "prefill + decode apart")):
            lines.append(dict(prefill=f"{r['prefill']} tokens", decodes=int(r["decodes"]), us=us,
                              line=f"{r['model']}: {what}"))
    return common.plot_panels(name, lines, x="decodes", y="us", series="line", panel="prefill", logx=True,
                              logy=True, out_dir=out_dir, title="Mixed step (prefill chunk + decodes) against its "
                                                                "parts run apart", xlabel="decode sequences",
                              ylabel="µs per step")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b,llama-3.2-1b")
    p.add_argument("--prefills", default="64,512,2048", help="prompt-chunk tokens, comma-separated")
    p.add_argument("--decodes", default="1,8,32,127", help="decode sequences next to the chunk, comma-separated")
    p.add_argument("--context", type=int, default=512, help="cached tokens per decode sequence")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="tiny-llama on the CPU, no graphs, to check the harness")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.quick:
        device, dtype, names, prefills, decodes, context, iters = (torch.device("cpu"), torch.float32, ["tiny-llama"],
                                                                   [8], [1, 3], 16, 3)
    else:
        if not torch.cuda.is_available():
            p.error("the piecewise path needs a CUDA GPU (torch.cuda.is_available() is False); --quick checks the "
                    "harness on the CPU")
        device, dtype, names = torch.device("cuda"), torch.bfloat16, a.models.split(",")
        try:
            prefills, decodes = [int(v) for v in a.prefills.split(",")], [int(v) for v in a.decodes.split(",")]
        except ValueError:
            p.error(f"--prefills, --decodes: expected comma-separated integers; got {a.prefills!r}, {a.decodes!r}")
        context, iters = a.context, a.iters
    rows: list[dict[str, Any]] = []
    for name in names:
        rows += bench_model(name, prefills, decodes, context, device, dtype, iters)
        stem = "mixed_step" + ("_quick" if a.quick else "")
        common.write_results(stem, rows, device=device, out_dir=a.out,
                             title="Mixed steps (one prefill chunk + decodes), level 3 piecewise, against their parts",
                             notes=[f"decodes of {context} cached tokens each; the chunk is a whole prompt; random "
                                    "bf16 weights; logits of each sequence's last token",
                                    "mixed_us: the step piecewise (graphs captured at its token count); prefill_us: "
                                    "the chunk alone, piecewise; decode_us: the decodes alone, whole-step graph",
                                    "ratio: mixed_us / (prefill_us + decode_us); sync after every step, median of "
                                    f"{iters}"] if not a.quick else ["CPU, no CUDA graphs: a check of the harness"])
        plot(stem, rows, a.out)
    return rows


if __name__ == "__main__":
    main()
