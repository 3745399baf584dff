"""Launch configs of the quant kernels as a compiled graph runs them: a symbolic token count, no PDL (issue 13).

At level 3 one graph serves every token count, so a Triton op's launch config is chosen without knowing it
(``known_int`` None: the bandwidth config), and Inductor launches the kernel without programmatic dependent
launch. At one decode token that config may put a whole row on one SM. For each kernel the graph passes put
in (RMSNorm + static fp8 quant, with and without the residual add; the fused-add norm + per-token int8 quant;
SiLU-and-mul + static quant) and the plain static quant, at 1 / 8 / 32 / 128 / 2048 tokens (hidden 4096,
intermediate 14336, bf16 in), this times:

- each candidate config, launched eagerly without PDL (the graph's launch);
- ``compiled op``: the op itself in a ``torch.compile`` graph with the token dim dynamic (first call at 2048
  tokens, as the model's), to check that the eager launch of the default config stands for it;
- ``inductor``: ``torch.compile`` of the reference, token dim dynamic: the native code the passes replace.

All of one cell timed together (``common.bench_gpu_interleaved``: CUDA graphs of many calls, replayed in turn),
inputs rotated over copies larger than the L2. ``vs_inductor``: inductor's µs / this row's (> 1: faster).

With ``--out``, also ``compiled_op_launch_<op>.txt``: how Inductor launches the compiled op's kernel (its
``triton_meta``: argument types, divisibility hints, constants; the ``.run`` call's arguments), to set against the
eager launch (a compiled op slower than its own kernel launched eagerly had its float argument typed fp64 there).

Usage: ``python -m benchmarks.fused_quant_configs [--tokens 1,8,32,128,2048] [--ops NAME,...] [--out DIR]``
(CUDA).
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable

import torch

import ops
from benchmarks import bench_ops, common
from dispatcher import compat

HIDDEN, INTERMEDIATE, EPS = 4096, 14336, 1e-6
FP8 = ops.FP8_DTYPE
norm_quant = importlib.import_module("ops.norm_quant")
act_quant = importlib.import_module("ops.act_quant")
quant_fp8 = importlib.import_module("ops.quant_fp8")
act_mod = importlib.import_module("ops.silu_and_mul")


def _norm_candidates(dynamic: bool = False) -> list[tuple]:
    """``((BLOCK_N, ROWS, num_warps), col_split)``: one row a program, warps and (static scale) column splits swept."""
    return [((HIDDEN, 1, w), s) for w in (4, 8, 16) for s in ((1,) if dynamic else (1, 2, 4, 8))]


def _act_candidates() -> list[tuple]:
    return [(b, 1, w) for b in (512, 1024, 2048, 4096) for w in (2, 4, 8, 16) if 2 <= b // (32 * w) <= 32]


def _quant_candidates() -> list[tuple]:
    return [(b, w) for b in (256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8) if 1 <= b // (32 * w) <= 16]


def _cases(t: int, device: str) -> dict[str, tuple]:
    """name -> (args, reference, eager launch of a candidate, candidates, the symbolic default, bytes moved)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(t, HIDDEN, generator=g, device=device, dtype=torch.bfloat16)
    r = torch.randn(t, HIDDEN, generator=g, device=device, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(HIDDEN, generator=g, device=device, dtype=torch.bfloat16)
    gu = torch.randn(t, 2 * INTERMEDIATE, generator=g, device=device, dtype=torch.bfloat16)
    s = torch.tensor([0.05], device=device)
    norm_default = (norm_quant.norm_quant_config(HIDDEN, 2, None), norm_quant.norm_quant_col_split(HIDDEN, None, False))
    dyn_default = (norm_quant.norm_quant_config(HIDDEN, 2, None), norm_quant.norm_quant_col_split(HIDDEN, None, True))

    def norm(residual: bool) -> Callable:
        return lambda c, *a: norm_quant._launch_rms_norm_quant(
            a[0], a[1] if residual else None, a[-2], EPS, a[-1], FP8, False, c[0], False, col_split=c[1])

    def dyn_norm(c, x, r, w):  # int8 per token, as the int8 built-ins' norms
        return norm_quant._launch_rms_norm_quant(x, r, w, EPS, None, torch.int8, False, c[0], False, col_split=c[1])

    return {
        "rms_norm_static_quant": ((x, w, s), lambda x, w, s: ops.rms_norm_static_quant_ref(x, w, EPS, s, FP8),
                                  lambda x, w, s: ops.rms_norm_static_quant(x, w, EPS, s, FP8), norm(False),
                                  _norm_candidates(), norm_default, t * HIDDEN * 3),
        "fused_add_rms_norm_static_quant": (
            (x, r, w, s), lambda x, r, w, s: ops.fused_add_rms_norm_static_quant_ref(x, r, w, EPS, s, FP8),
            lambda x, r, w, s: ops.fused_add_rms_norm_static_quant(x, r, w, EPS, s, FP8), norm(True),
            _norm_candidates(), norm_default, t * HIDDEN * 7),
        "fused_add_rms_norm_dynamic_quant": (
            (x, r, w), lambda x, r, w: ops.fused_add_rms_norm_dynamic_quant_ref(x, r, w, EPS, torch.int8),
            lambda x, r, w: ops.fused_add_rms_norm_dynamic_quant(x, r, w, EPS, torch.int8), dyn_norm,
            _norm_candidates(dynamic=True), dyn_default, t * HIDDEN * 7),
        "silu_and_mul_static_quant": (
            (gu, s), lambda gu, s: ops.act_and_mul_static_quant_ref(gu, s, "silu", FP8),
            lambda gu, s: ops.act_and_mul_static_quant(gu, s, "silu", FP8),
            lambda c, gu, s: act_quant._launch_act_and_mul_quant(gu, s, "silu", FP8, c, False),
            _act_candidates(), act_mod.act_and_mul_config(INTERMEDIATE, 2, None), t * INTERMEDIATE * 5),
        "static_scaled_fp8_quant": (
            (x, s), ops.static_scaled_fp8_quant_ref, ops.static_scaled_fp8_quant,
            lambda c, x, s: quant_fp8._launch_static_fp8_quant(x, s, c, False),
            _quant_candidates(), quant_fp8.static_fp8_quant_config(None, 2), t * HIDDEN * 3),
    }


def _unfused(name: str, args: tuple) -> torch.Tensor | tuple:
    """The norm ops' unfused Triton sequence (``rms_norm``'s kernel, then the quantization's): the fused kernel's
    values bit for bit at ``rms_norm``'s tiles (the reference sums the squares in another order)."""
    if name == "fused_add_rms_norm_dynamic_quant":
        x, r, w = args
        normed, res = ops.fused_add_rms_norm(x, r, w, EPS)
        return (*ops.dynamic_scaled_int8_quant(normed), res)
    if name.startswith("fused_add"):
        x, r, w, s = args
        normed, res = ops.fused_add_rms_norm(x, r, w, EPS)
        return ops.static_scaled_fp8_quant(normed, s), res
    x, w, s = args
    return ops.static_scaled_fp8_quant(ops.rms_norm(x, w, EPS), s)


def _dynamic_compile(fn: Callable, args_at: Callable[[int], tuple], code: list[str] | None = None) -> Callable:
    """``torch.compile(fn)`` with the token dim dynamic, first called at 2048 tokens (as the model's first call).
    ``code``: gets the source of every module Inductor generated for it."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    big = args_at(2048)
    torch._dynamo.mark_dynamic(big[0], 0)
    if len(big) > 2 and big[1].dim() == 2:
        torch._dynamo.mark_dynamic(big[1], 0)
    if code is None:
        compiled(*big)
    else:
        code += compat.inductor_code(lambda: compiled(*big))[1]
    return compiled


def _write_launches(name: str, sources: list[str], out_dir: str) -> None:
    """``compiled_op_launch_<name>.txt``: the lines of the compiled op's code that say how Inductor launches its
    kernels (each kernel's ``triton_meta``: argument types, divisibility, constants; ``inductor_meta``; the
    ``.run(...)`` calls with their arguments), to set against the eager launch's specializations."""
    keep = [line.strip() for src in sources for line in src.splitlines()
            if "triton_meta=" in line or "inductor_meta=" in line or ".run(" in line]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"compiled_op_launch_{name}.txt"), "w") as f:
        f.write(common.env_header("cuda") + "\n" + "\n".join(keep) + "\n")


def _same(a, b) -> bool:
    """Bit for bit, output by output (a launcher's None outputs, the ones the op does not return, dropped)."""
    outs = tuple(o for o in (a if isinstance(a, tuple) else (a,)) if o is not None)
    exps = b if isinstance(b, tuple) else (b,)
    return all(torch.equal(o.view(torch.uint8), e.view(torch.uint8)) if o.dtype == FP8 else torch.equal(o, e)
               for o, e in zip(outs, exps, strict=True))


def measure(tokens: list[int], device: str, names: list[str] | None = None, out_dir: str | None = None) -> list[dict]:
    """Rows of every op in ``names`` (default: all) at each token count; with ``out_dir``, each compiled op's
    launches too (:func:`_write_launches`)."""
    rows = []
    known = list(_cases(1, device))
    unknown = sorted(set(names or ()) - set(known))
    if unknown:
        raise ValueError(f"--ops: expected names among {known}; got {unknown}")
    for name in names or known:
        case_at = lambda t, name=name: _cases(t, device)[name]  # noqa: E731
        _, ref, op, _, _, _, _ = case_at(1)
        inductor = _dynamic_compile(ref, lambda t: case_at(t)[0])
        sources: list[str] = []
        compiled_op = _dynamic_compile(op, lambda t: case_at(t)[0], sources)
        if out_dir:
            _write_launches(name, sources, out_dir)
        for t in tokens:
            args, ref, _, launch, candidates, default, nbytes = case_at(t)
            expected = _unfused(name, args) if "norm" in name else ref(*args)
            fns: dict[str, Callable] = {"inductor": inductor, "compiled op": compiled_op}
            correct = {"inductor": "", "compiled op": _same(compiled_op(*args), expected)}
            for cfg in dict.fromkeys([default, *candidates]):
                correct[str(cfg)] = _same(launch(cfg, *args), expected)
                fns[str(cfg)] = lambda *a, cfg=cfg, launch=launch: launch(cfg, *a)
            arg_sets = bench_ops._arg_sets(args, nbytes)
            times = common.bench_gpu_interleaved({k: common.rotating(f, arg_sets) for k, f in fns.items()},
                                                 graph_iters=64 if t <= 32 else 8, rounds=30 if t <= 32 else 10)
            for label, us in times.items():
                rows.append({"op": name, "tokens": t, "config": label, "us": round(us, 3),
                             "vs_inductor": round(times["inductor"] / us, 3), "default": label == str(default),
                             "correct": correct[label]})
                print(rows[-1], flush=True)
    return rows


def _plot(rows: list[dict], out_dir: str) -> None:
    """µs against tokens per op: inductor, the compiled op (today's default), and the candidate fastest on
    average at <= 32 tokens (relative to inductor)."""
    keep = []
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        small = {}
        for r in mine:
            if r["tokens"] <= 32 and r["config"] not in ("inductor", "compiled op"):
                small.setdefault(r["config"], []).append(r["vs_inductor"])
        best = max(small, key=lambda c: sum(small[c]) / len(small[c])) if small else None
        keep += [dict(r, series="best " + r["config"] if r["config"] == best else r["config"]) for r in mine
                 if r["config"] in ("inductor", "compiled op", best)]
    common.plot_panels("fused_quant_configs", keep, x="tokens", y="us", series="series", panel="op", logx=True,
                       logy=True, title="quant kernels at a symbolic token count", ylabel="us a call",
                       out_dir=out_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,8,32,128,2048")
    p.add_argument("--ops", default="", help="comma-separated op names to time (default: every op)")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fused_quant_configs: needs a CUDA GPU (the configs are GPU launch configs)")
    names = [n for n in args.ops.split(",") if n] or None
    # One compile serves every token count, 1 included (Dynamo would specialize size 1), as at level 3.
    import torch.fx.experimental._config as fx_config

    if hasattr(fx_config, "backed_size_oblivious"):
        fx_config.backed_size_oblivious = True
    print(common.env_header("cuda"), flush=True)
    try:
        rows = measure([int(t) for t in args.tokens.split(",")], "cuda", names, args.out)
    except ValueError as e:
        raise SystemExit(f"fused_quant_configs: {e}") from None
    if args.out:
        _plot(rows, args.out)
        common.write_results("fused_quant_configs", rows, out_dir=args.out,
                             title="Quant kernels' launch configs at a symbolic token count (no PDL)",
                             notes=["config: norm ((BLOCK_N, ROWS, warps), col_split); act (BLOCK_D, ROWS, warps); "
                                    "quant (BLOCK, warps); default: the config a compiled graph launches today",
                                    "compiled op: the op in a dynamic-shape torch.compile graph; inductor: "
                                    "torch.compile of the reference (native code), dynamic",
                                    "vs_inductor: inductor us / this row's us; correct: bit for bit the reference (norm ops: the unfused Triton "
                                    "ops, rms_norm's 8-warp row then the quantization; tiles on other warp counts sum "
                                    "the squares in another order)"])


if __name__ == "__main__":
    main()
