"""Where one eager ``dynamo_once::attention`` call's host µs go (issue 18), layer by layer of the call.

``benchmarks.attention_host`` times a step's calls as a whole; this one peels the call: for one step shape it
times, in loops of ``--calls`` back-to-back calls (no synchronization; the median of ``--repeats`` loops, each from
an idle GPU), each layer of what the piecewise path runs per layer:

- ``step_first``: the first call of a step (a fresh metadata object: it builds the step's plan and bound launches);
- ``eager_impl``: ``models.attention._attention_impl``, as the split graph calls it between pieces;
- ``forward_impl``: ``Attention.forward_impl`` (no forward-context lookup);
- ``attention_cuda``: the CUDA implementation with every argument given;
- ``program``: the step's recorded launches (:class:`ops.launch_program.LaunchProgram`) replayed alone, as every
  call after a step's first makes them;
- ``bound_launches``: the first call's :class:`ops.triton_utils.BoundLaunch` calls alone, as it made them;
- ``raw_launches``: the compiled kernels' C launchers alone, with the arguments those bound launches passed;
- ``null_launch``: one launch of an empty one-argument Triton kernel through its C launcher: the floor of any
  Triton launch from Python on this host.

Each row is µs per attention call (``null_launch``: per launch); ``launches`` is how many kernels a call launches.
Usage: ``python -m benchmarks.attention_host_breakdown [--models llama-3-8b,llama-3.2-1b] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import common
from benchmarks.attention_host import MixedStep, piecewise_step
import models.attention as attention_module
from models import ForwardContext, set_forward_context
from ops.triton_utils import BoundLaunch

try:
    import triton
    import triton.language as tl
except ImportError:  # the benchmark needs a GPU, and so Triton; importable without them
    triton = None

if triton is not None:
    @triton.jit
    def _empty_kernel(x_ptr, BLOCK: tl.constexpr):  # noqa: ARG001 - empty: the launch alone is timed
        pass


def _loop_us(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the host µs per call of ``calls`` back-to-back calls, each loop from an idle GPU."""
    fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def _record_launches(call: Callable[[], Any]) -> tuple[list[tuple], list[tuple]]:
    """Run ``call`` once, recording each BoundLaunch call ``(bound, tensors, scalars, target)`` it makes; then
    make those calls again, recording each C launch ``(launch, args)`` they make (their compiled entries wrapped
    for that one pass)."""
    bound_calls: list[tuple] = []
    original = BoundLaunch.__call__

    def recording(self: BoundLaunch, tensors: tuple, scalars: tuple = (), target: Any = None) -> None:
        bound_calls.append((self, tensors, scalars, target))
        original(self, tensors, scalars, target)

    BoundLaunch.__call__ = recording
    try:
        call()
    finally:
        BoundLaunch.__call__ = original
    raw_calls: list[tuple] = []
    for bound, tensors, scalars, target in bound_calls:
        saved = dict(bound._entries)
        for key, entry in saved.items():
            if entry:
                launch = entry[0]
                bound._entries[key] = ((lambda *a, _l=launch: (raw_calls.append((_l, a)), _l(*a))[1]), *entry[1:])
        try:
            bound(tensors, scalars, target)
        finally:
            bound._entries.update(saved)
    return bound_calls, raw_calls


def _null_launch() -> Callable[[], Any]:
    """One empty Triton kernel's C launch with one pointer argument, as BoundLaunch's fast path makes it."""
    x = torch.empty(16, device="cuda")
    compiled = _empty_kernel[(1,)](x, BLOCK=16)
    launcher = compiled.run
    args = (1, 1, 1, torch.cuda.current_stream().cuda_stream, compiled.function, launcher.launch_cooperative_grid,
            launcher.launch_pdl, None, None, compiled.packed_metadata, None, None, None, x.data_ptr(), 16)  # BLOCK last
    raw = launcher.launch
    return lambda: raw(*args)


def breakdown(s: MixedStep, calls: int, repeats: int) -> dict[str, float]:
    """The µs per call of each layer of one attention call of step ``s`` (the table's ``what`` column)."""
    layer, q, k, v = s.layer, s.q, s.k, s.v
    impl = attention_module._attention_impl
    rows: dict[str, float] = {}
    with torch.inference_mode():
        for _ in range(3):
            s.step()  # compiles and warms every launch of the step
        firsts = []
        for _ in range(repeats * 4):
            md = dataclasses.replace(s.md)
            torch.cuda.synchronize()
            with set_forward_context(ForwardContext({"attn": layer}, md)), piecewise_step():
                t0 = time.perf_counter()
                impl(q, k, v, "attn")
                firsts.append((time.perf_counter() - t0) * 1e6)
        rows["step_first"] = statistics.median(firsts)
        md = dataclasses.replace(s.md)
        out = layer.piecewise_rows(q.shape[0])  # as a piecewise step passes it
        with set_forward_context(ForwardContext({"attn": layer}, md)), piecewise_step():
            rows["eager_impl"] = _loop_us(lambda: impl(q, k, v, "attn"), calls, repeats)
            rows["forward_impl"] = _loop_us(lambda: layer.forward_impl(q, k, v, md, out=out), calls, repeats)
            cache, args = layer.kv_cache, (layer.num_heads, layer.head_size, layer.scale, None, None)
            direct = attention_module.attention_cuda
            rows["attention_cuda"] = _loop_us(lambda: direct(q, k, v, cache, md, *args, out=out), calls, repeats)
            call = next(iter(md.layer_calls.values()))  # the step's state: its recorded launches (LaunchProgram)
            target = call.fast.target()
            addresses = (q.data_ptr(), k.data_ptr(), v.data_ptr(), cache.data_ptr(), out.data_ptr())
            rows["program"] = _loop_us(lambda: call.program(target[1], addresses), calls, repeats) \
                if call.program is not None else float("nan")
            # a new step's first call: the bound launches it makes (before it has a program)
            bound_calls, raw_calls = _record_launches(
                lambda: direct(q, k, v, cache, dataclasses.replace(s.md), *args, out=out))

            def bound() -> None:
                for b, tensors, scalars, at in bound_calls:
                    b(tensors, scalars, at)

            def raw() -> None:
                for launch, launch_args in raw_calls:
                    launch(*launch_args)

            rows["bound_launches"] = _loop_us(bound, calls, repeats)
            rows["raw_launches"] = _loop_us(raw, calls, repeats) if raw_calls else float("nan")
            rows["launches"] = len(raw_calls)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b,llama-3.2-1b")
    p.add_argument("--shapes", default="1:0,32:0,128:0,1:512,8:512,32:512,128:512",
                   help="decodes:prefill pairs, comma-separated (prefill 0: a decode-only step)")
    p.add_argument("--context", type=int, default=512, help="cached tokens per decode sequence")
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per timed loop")
    p.add_argument("--repeats", type=int, default=15, help="timed loops; the median is reported")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the attention op's CUDA path needs a GPU (torch.cuda.is_available() is False)")
    try:
        shapes = [tuple(int(x) for x in pair.split(":")) for pair in a.shapes.split(",")]
        if any(len(pair) != 2 for pair in shapes):
            raise ValueError
    except ValueError:
        p.error(f"--shapes: expected decodes:prefill pairs such as 1:0,8:512; got {a.shapes!r}")
    device, rows = torch.device("cuda"), []
    null_us = _loop_us(_null_launch(), a.calls, a.repeats)
    for name in a.models.split(","):
        for decodes, prefill in shapes:
            s = MixedStep(name, decodes, prefill, a.context, device, torch.bfloat16)
            found = breakdown(s, a.calls, a.repeats)
            rows.append(dict(model=name, decodes=decodes, prefill=prefill, launches=int(found.pop("launches")),
                             **{k: round(v, 2) for k, v in found.items()}, null_launch=round(null_us, 2)))
            print(rows[-1], flush=True)
            del s
    common.write_results("attention_host_breakdown", rows, device=device, out_dir=a.out,
                         title="One eager dynamo_once::attention call's host time, layer by layer",
                         notes=[f"bf16 paged cache, 16-token blocks; decodes of {a.context} cached tokens; prefill: "
                                "one prompt of that many tokens (0: none); the step's form as the defaults choose it",
                                f"µs per attention call (null_launch: per launch), median of {a.repeats} loops of "
                                f"{a.calls} back-to-back calls, no sync in a loop, each loop from an idle GPU; as in "
                                "a piecewise step, the output in the layer's persistent buffer",
                                "step_first: the first call of a step (builds the step's plan); eager_impl: "
                                "_attention_impl, as between pieces; forward_impl; attention_cuda; program: the step's "
                                "recorded launches replayed alone (every call after the first); bound_launches: "
                                "the first call's BoundLaunch calls alone; raw_launches: their C launchers alone; null_launch: an "
                                "empty one-argument Triton kernel's C launcher; each includes the ones after it"])
    parts = {"context lookup": ("eager_impl", "forward_impl"), "forward_impl": ("forward_impl", "attention_cuda"),
             "attention_cuda": ("attention_cuda", "program"), "program": ("program", "raw_launches"),
             "C launchers": ("raw_launches", None)}
    bars = [dict(model=r["model"], shape=f"{r['decodes']}+{r['prefill']}",
                 **{part: max(r[hi] - (r[lo] if lo else 0.0), 0.0) for part, (hi, lo) in parts.items()}) for r in rows]
    common.plot_stacked_bars("attention_host_breakdown", bars, label=("model", "shape"), parts=list(parts),
                             out_dir=a.out, ylabel="host µs per call (decodes+prompt tokens)",
                             title="One eager attention call's host µs, by layer of the call (after the step's first)")
    return rows


if __name__ == "__main__":
    main()
