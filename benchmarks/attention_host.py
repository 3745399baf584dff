"""Host time of one ``dynamo_once::attention`` call on a mixed step (issue 18: target <= 25 µs), made as the
piecewise path makes it (the op's eager function, ``plugins.set_splitting_op_eager_impl``, not the dispatcher).

On the piecewise path (a step mixing prefill and decode) the attention op runs eagerly between the
pieces' CUDA-graph replays, once per layer: its host time, not its GPU time, sets the step's pace when
it is the larger. For each model's attention shape (bf16 paged cache, 16-token blocks) and B decode
sequences of ``--context`` cached tokens, plus one ``--prefill``-token prompt (0: decodes only), this
times a step's worth of calls (one per layer of the model, a fresh metadata object per step, as the
runner builds one: the first call gets the step's decode plan and launches, the others reuse them; ``plan``:
``built`` anew, ``cached`` from a recent step's, or ``inherited`` from the last step's, see :meth:`MixedStep.step`):

The calls are made as inside a piecewise step (the op writes into the layer's persistent output buffer).

- ``host_us``: host time per call. The calls of one step are issued back to back with no synchronization
  and timed with ``time.perf_counter`` (a step's few hundred launches never fill the GPU's queue, so the
  host never waits for the GPU); the median over ``--steps`` steps, each started on an idle GPU;
- ``gpu_us``: GPU time per call (CUDA events around a step), for the ratio;
- ``launch``: ``fast`` (``ops.triton_utils.FastLaunch``, the default) or ``triton`` (every kernel through
  ``kernel[grid](...)``, ``FastLaunch.enabled = False``), to see what the launch path costs;
- ``form``, on a step with a prompt: ``unified`` (``models.attention.UNIFIED_ATTENTION``: one launch a layer where
  the step fits it) or ``split`` (cache write, split-KV decode, prefill), the A/B of that switch.

Usage: ``python -m benchmarks.attention_host [--models llama-3-8b,llama-3.2-1b] [--out DIR]``; ``--cprofile``
profiles the first shape given instead (``--models llama-3-8b --batches 1 --prefill 512 --cprofile``);
``--quick`` runs tiny-llama's shape on the CPU (the native path) to check the harness.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks import common
import models.attention as attention_module
import models.forward_context as forward_context
from dispatcher import plugins
from dispatcher.cuda_graph import thread_state
from models import Attention, AttentionMetadata, ForwardContext, KVCache, set_forward_context
from models.registry import BUILTIN_MODELS
from ops.paged_attention import DecodeWorkspace
from ops.triton_utils import FastLaunch

BLOCK = 16
#: How a timed step gets its plans and launches (:meth:`MixedStep.step`).
PLANS = ("built", "cached", "inherited")
UNIFIED_DEFAULT = attention_module.UNIFIED_ATTENTION  # restored after each measurement
MIXED_FUSED_DEFAULT = forward_context.MIXED_DECODE_FUSED
FORMS = ("unified", "split", "split_config")


def attention_shape(name: str) -> tuple[int, int, int, int]:
    """``(Hq, Hkv, D, layers)`` of a built-in model's attention."""
    cfg = BUILTIN_MODELS[name]
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return heads, cfg["num_key_value_heads"], cfg.get("head_dim", cfg["hidden_size"] // heads), cfg["num_hidden_layers"]


class MixedStep:
    """One attention layer with its paged cache, and a step of ``batch`` decodes (``context`` cached tokens
    each, first) and one ``prefill``-token prompt, in persistent buffers as the runner keeps them."""

    def __init__(self, name: str, batch: int, prefill: int, context: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        heads, kv_heads, head, self.num_layers = attention_shape(name)
        per_seq = -(-(context + 1) // BLOCK)
        prompt_blocks = -(-prefill // BLOCK)
        num_blocks = batch * per_seq + prompt_blocks
        self.layer = Attention(heads, head, head**-0.5, kv_heads, "attn")
        KVCache({"attn": self.layer}, num_blocks * BLOCK, BLOCK, dtype=dtype, device=device)
        g = torch.Generator().manual_seed(0)
        self.layer.kv_cache.copy_(torch.randn(self.layer.kv_cache.shape, generator=g).to(dtype))
        width = max(per_seq, prompt_blocks)
        table = torch.zeros(batch + (prefill > 0), width, dtype=torch.int32)
        slots, starts, lens = [], [0], []
        for i in range(batch):
            table[i, :per_seq] = torch.arange(i * per_seq, (i + 1) * per_seq)
            slots.append(int(table[i, context // BLOCK]) * BLOCK + context % BLOCK)
            starts.append(starts[-1] + 1)
            lens.append(context + 1)
        if prefill:
            table[batch, :prompt_blocks] = torch.arange(batch * per_seq, batch * per_seq + prompt_blocks)
            slots += [int(table[batch, p // BLOCK]) * BLOCK + p % BLOCK for p in range(prefill)]
            starts.append(starts[-1] + prefill)
            lens.append(prefill)
        t = starts[-1]
        # q, k, v as a model has them: column slices of one qkv projection (strided rows).
        qkv = torch.randn(t, (heads + 2 * kv_heads) * head, generator=g).to(dtype).to(device)
        self.q, self.k, self.v = qkv.split([heads * head, kv_heads * head, kv_heads * head], -1)
        # As in a piecewise step: the op writes into the layer's persistent output buffer (no allocation a call)
        self.layer.piecewise_out = torch.empty(t, heads * head, dtype=dtype, device=device)
        self.md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_table=table.to(device),
            num_decodes=batch, query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens),
            workspace=DecodeWorkspace(batch))
        self.last: AttentionMetadata | None = None  # the last step's metadata

    def step(self, plan: str = "built", marks: list[float] | None = None) -> None:
        """One step's calls, one per layer, under a fresh metadata object, each as the piecewise path's split graph
        makes it: the op's eager function where one is set (``plugins.set_splitting_op_eager_impl``, as
        ``models.attention`` does), else the op. ``marks``: ``time.perf_counter()`` is appended after each call.

        ``plan`` (see :data:`PLANS`): ``built``, the first call builds the step's plans, bound launches and launch
        program anew (a layout never seen: the workspace's cache of recent steps' emptied before, by :meth:`forget`);
        ``cached``, it takes them from that cache (``AttentionMetadata.inherit`` without the last step: a layout
        seen some steps ago); ``inherited``, the metadata takes them over from the last step's
        (``AttentionMetadata.inherit``, the engine's consecutive steps of one shape)."""
        md = dataclasses.replace(self.md)
        taken = plan != "built" and md.inherit(self.last if plan == "inherited" else None)
        if marks is not None and plan != "built" and not taken:  # a timed step (a warm-up one registers its layout)
            raise RuntimeError(f"attention_host: the step did not take over the {plan} plans")
        self.last = md
        q, k, v = self.q, self.k, self.v
        op = plugins.get_splitting_op_eager_impl("dynamo_once::attention") or torch.ops.dynamo_once.attention
        with set_forward_context(ForwardContext({"attn": self.layer}, md)), piecewise_step():
            for _ in range(self.num_layers):
                op(q, k, v, "attn")
                if marks is not None:
                    marks.append(time.perf_counter())


    def forget(self, plan: str) -> None:
        """Before a ``built`` step (:meth:`step`), outside what is timed: empty the workspace's cache of recent
        steps' plans and launches (what ``AttentionMetadata.launch_cache`` gives), so that the step builds anew."""
        if plan == "built":
            self.md.workspace.launches.clear()
            self.last = None  # its plans and launches freed here, not inside the step


@contextlib.contextmanager
def piecewise_step() -> Iterator[None]:
    """As inside a piecewise step's replay (``dispatcher.cuda_graph.thread_state.step`` set): the attention op
    writes its output into its layer's ``piecewise_out`` buffer."""
    previous = thread_state.step
    thread_state.step = _PIECEWISE
    try:
        yield
    finally:
        thread_state.step = previous


_PIECEWISE = object()  # stands for the running piecewise step (the op only checks that one runs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class StepTimes:
    """Medians over a run's steps, µs: ``host`` per call (the whole step over its calls), ``first`` the step's
    first call (with what the step sets up before it: metadata, forward context), ``later`` per call after it;
    ``gpu`` per call (CUDA events around a step of the same plan mode), None on the CPU."""

    host: float
    first: float
    later: float
    gpu: float | None


def time_step(s: MixedStep, device: torch.device, steps: int, plan: str) -> StepTimes:
    """:class:`StepTimes` over ``steps`` steps (``plan``: see :meth:`MixedStep.step`)."""
    with torch.inference_mode():
        for _ in range(3):  # compiles, plans, allocator warm; the layout in the cache of recent steps
            s.step(plan)
        host, first, later, gpu = [], [], [], []
        for _ in range(steps):
            s.forget(plan)
            _sync(device)
            marks = [time.perf_counter()]
            s.step(plan, marks)
            host.append((marks[-1] - marks[0]) * 1e6 / s.num_layers)
            first.append((marks[1] - marks[0]) * 1e6)
            later.append((marks[-1] - marks[1]) * 1e6 / max(s.num_layers - 1, 1))
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.forget(plan)
                start.record()
                s.step(plan)
                end.record()
                end.synchronize()
                gpu.append(start.elapsed_time(end) * 1e3 / s.num_layers)
    return StepTimes(statistics.median(host), statistics.median(first), statistics.median(later),
                     statistics.median(gpu) if gpu else None)


def profile_calls(s: MixedStep, device: torch.device, steps: int, out_dir: str | None, rows: int = 40,
                  plan: str = "built") -> str:
    """cProfile over ``steps`` steps of ``s`` (the fast launch path; ``plan``: see :meth:`MixedStep.step`): the
    functions by their own time, as text (``attention_host_profile.txt`` under ``out_dir``). Where a call's host µs
    go on the GPU's host: Python, the bound launches, the C launcher."""
    import cProfile
    import io
    import pstats

    with torch.inference_mode():
        for _ in range(3):
            s.step()
        _sync(device)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            s.forget(plan)
            s.step(plan)
        prof.disable()
        _sync(device)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    text = f"{steps} steps x {s.num_layers} calls, plans {plan}\n" + buf.getvalue()
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "attention_host_profile.txt"), "w") as f:
            f.write(text)
    return text


def measure(names: list[str], batches: list[int], prefills: list[int], context: int, device: torch.device,
            dtype: torch.dtype, steps: int, launches: list[str], forms: list[str],
            plans: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in names:
        for prefill in prefills:
            for b in batches:
                s = MixedStep(name, b, prefill, context, device, dtype)
                for form, launch, plan in ((f, la, pl) for f in (forms if prefill else forms[:1]) for la in launches
                                           for pl in plans):
                    FastLaunch.enabled = launch == "fast"
                    attention_module.UNIFIED_ATTENTION = form == "unified"
                    forward_context.MIXED_DECODE_FUSED = form != "split_config"
                    try:
                        t = time_step(s, device, steps, plan)
                    finally:
                        FastLaunch.enabled = True
                        attention_module.UNIFIED_ATTENTION = UNIFIED_DEFAULT
                        forward_context.MIXED_DECODE_FUSED = MIXED_FUSED_DEFAULT
                    rows.append(dict(model=name, decodes=b, prefill=prefill, form=form if prefill else "",
                                     launch=launch, plan=plan, host_us=round(t.host, 1),
                                     first_call_us=round(t.first, 1), later_call_us=round(t.later, 1),
                                     gpu_us=None if t.gpu is None else round(t.gpu, 1),
                                     host_over_gpu=None if not t.gpu else round(t.host / t.gpu, 2)))
                    print(rows[-1], flush=True)
                del s
    return rows


def plot(name: str, rows: list[dict[str, Any]], out_dir: str | None) -> str | None:
    """``<name>.png``: host and GPU µs per call against the decode batch, a panel per model, a line per launch
    path, prompt and clock (no GPU line on the CPU)."""
    lines = [dict(model=r["model"], decodes=int(r["decodes"]), us=float(r[f"{clock}_us"]),
                  line=f"{r['launch']}, {r['plan']}{', ' + r['form'] if r.get('form') else ''}, prefill "
                       f"{r['prefill']}: {clock}")
             for r in rows for clock in ("host", "gpu") if r.get(f"{clock}_us") not in ("", None)]
    return common.plot_panels(name, lines, x="decodes", y="us", series="line", panel="model", logx=True,
                              out_dir=out_dir, title="dynamo_once::attention on a mixed step: host µs against GPU "
                                                     "µs per call (host above GPU: the host sets the pace)",
                              xlabel="decode sequences", ylabel="µs per call")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="llama-3-8b,llama-3.2-1b")
    p.add_argument("--batches", default="1,8,32,128", help="decode sequences per step")
    p.add_argument("--prefill", default="512,0", help="prompt tokens in the step (0: decodes only), comma-separated")
    p.add_argument("--context", type=int, default=512, help="cached tokens per decode sequence")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--launches", default="fast", help="fast (FastLaunch) and/or triton (kernel[grid])")
    p.add_argument("--forms", default="unified,split",
                   help="with a prompt: unified (models.attention.UNIFIED_ATTENTION on: one launch a layer where the "
                        "step fits it), split (off) and/or split_config (off, and the decode kernel's write and merge "
                        "as its config: models.forward_context.MIXED_DECODE_FUSED off); decode-only steps take the "
                        "first")
    p.add_argument("--plans", default=",".join(PLANS),
                   help="built (each step builds its plans and launches: a layout never seen), cached (taken from the "
                        "workspace's cache of recent steps': a layout seen before, not the last step's) and/or "
                        "inherited (taken over from the last step's: AttentionMetadata.inherit, as the engine's "
                        "consecutive steps of one shape)")
    p.add_argument("--quick", action="store_true", help="tiny-llama's shape on the CPU, to check the harness")
    p.add_argument("--cprofile", action="store_true",
                   help="instead of the table: cProfile the first model, batch and prefill given (the fast path), "
                        "functions by own time (attention_host_profile.txt with --out)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.quick:
        device, dtype, names, batches, prefills, context, steps = (torch.device("cpu"), torch.float32, ["tiny-llama"],
                                                                   [1, 4], [32, 0], 32, 3)
        launches = ["fast"]
    else:
        if not torch.cuda.is_available():
            p.error("the attention op's CUDA path needs a GPU (torch.cuda.is_available() is False); --quick runs "
                    "the harness on the CPU")
        device, dtype, names = torch.device("cuda"), torch.bfloat16, a.models.split(",")
        try:
            batches, prefills = [int(b) for b in a.batches.split(",")], [int(n) for n in a.prefill.split(",")]
        except ValueError:
            p.error(f"--batches, --prefill: expected comma-separated integers; got {a.batches!r}, {a.prefill!r}")
        context, steps, launches = a.context, a.steps, a.launches.split(",")
    forms, plans = a.forms.split(","), a.plans.split(",")
    if not forms or not set(forms) <= set(FORMS) or not set(launches) <= {"fast", "triton"}:
        p.error(f"--forms: expected some of {', '.join(FORMS)}, --launches: fast and/or triton; got {a.forms!r}, "
                f"{a.launches!r}")
    if not plans or not set(plans) <= set(PLANS):
        p.error(f"--plans: expected some of {', '.join(PLANS)}; got {a.plans!r}")
    if a.cprofile:
        print(profile_calls(MixedStep(names[0], batches[0], prefills[0], context, device, dtype), device, steps, a.out,
                            plan=plans[0]))
        return []
    rows = measure(names, batches, prefills, context, device, dtype, steps, launches, forms, plans)
    stem = "attention_host" + ("_quick" if a.quick else "")
    common.write_results(stem, rows, device=device, out_dir=a.out,
                         title="Host time of one dynamo_once::attention call (eager, as on the piecewise path)",
                         notes=[f"B decodes of {context} cached tokens each, plus one prompt of `prefill` tokens "
                                "(0: none); bf16 paged cache, 16-token blocks; one call per layer of the model a "
                                "step, a fresh metadata object per step",
                                "plan: built = the step's first call builds its plans, bound launches and launch "
                                "program (a layout never seen: the workspace's cache of recent steps' emptied "
                                "first); cached = it takes them from that cache (ops.launch_cache: a layout seen "
                                "before, not the last step's); inherited = the metadata takes them over from the "
                                "last step's (AttentionMetadata.inherit, as the engine's consecutive steps of one "
                                "shape)",
                                "host_us: a step's calls back to back, no sync, perf_counter, per call (median of "
                                f"{steps} steps, each from an idle GPU); first_call_us: the step's first call, with "
                                "the step's setup before it (metadata, forward context); later_call_us: per call "
                                "after it; gpu_us: CUDA events around a step of the same plan, per call",
                                "launch: fast = ops.triton_utils.FastLaunch (default), triton = kernel[grid](...)",
                                "form (steps with a prompt): unified = one launch of ops.paged_prefill_triton for "
                                "every sequence, writing the new keys and values (models.attention.UNIFIED_ATTENTION, "
                                "where the step fits it: at most UNIFIED_MAX_DECODES decodes); split = split-KV "
                                "decode and prefill of the prompt, the new keys and values written by one of them "
                                f"(models.attention.PREFILL_WRITES_KV={attention_module.PREFILL_WRITES_KV}; off: "
                                "a cache-write launch too), the decode kernel writing and merging itself "
                                "(models.forward_context.MIXED_DECODE_FUSED); split_config = split with the decode "
                                "kernel's write and merge as its config says (a cache-write or merge launch too where "
                                "it fuses neither)",
                                "calls as in a piecewise step: the output into the layer's persistent buffer; after "
                                "a step's first call, the others replay its launches (ops.launch_program)"])
    plot(stem, rows, a.out)
    return rows


if __name__ == "__main__":
    main()
