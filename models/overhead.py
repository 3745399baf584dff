"""What one call costs: stock Dynamo's guards against dynamo-once's dispatch.

Models of 1, 4, 16, 64 small layers (``relu(x * w + b)``, each with its own
two parameters, so stock Dynamo guards 2 tensors per layer), compiled by
Inductor into one fused kernel: every mechanism runs the same compiled code
and the graph itself costs little, so what differs is the dispatch around it.
Per-call µs for:

- eager: the module's own ``__call__``;
- stock: ``torch.compile`` with its guards, evaluated on every call;
- skip_guard_eval_unsafe: ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``;
- guard_filter_fn: ``guard_filter_fn=torch.compiler.skip_all_guards_unsafe``;
- dynamo-once swap: a subclass using the ``dispatch_to_code`` swap contract;
- dynamo-once fast: the default ``__call__`` (with its per-call input check);
- dynamo-once fast, no check: ``check_inputs=False``;
- floor: a direct call of the function built from the captured code.

Usage: ``dynamo-once overhead [--device cuda] [--layers 1,4,16,64] [--out DIR]`` (writes into the
current directory unless ``--out`` says otherwise), or ``python -m benchmarks.guard_overhead
--out benchmarks/results`` (prints only without ``--out``).
"""

from __future__ import annotations

import argparse
import gc
import time
import types
from collections.abc import Callable

import torch

from dispatcher import CompilationConfig, TorchCompileWrapperWithCustomDispatcher, compat, set_compilation_config

from . import reporting

HIDDEN = 16
MECHANISMS = [
    "eager",
    "stock torch.compile",
    "skip_guard_eval_unsafe",
    "guard_filter_fn",
    "dynamo-once swap",
    "dynamo-once fast",
    "dynamo-once fast, no check",
    "floor",
]


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(HIDDEN) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(HIDDEN) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x * self.weight + self.bias)


class Stack(TorchCompileWrapperWithCustomDispatcher, torch.nn.Module):
    def __init__(self, n_layers: int):
        torch.nn.Module.__init__(self)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(n_layers))
        TorchCompileWrapperWithCustomDispatcher.__init__(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SwapStack(Stack):
    """Dispatches with the ``__code__`` swap contract instead of the fast path."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.compiled_codes:
            return super().__call__(x)
        with self.dispatch_to_code(0):
            return self.forward(x)


def _time_all(cases: dict[str, Callable[[], object]], device: torch.device, calls: int,
              repeats: int) -> dict[str, float]:
    """Best mean µs per call of each case; repeats are interleaved across cases so drift hits all alike."""
    for fn in cases.values():
        for _ in range(max(20, calls // 5)):
            fn()
    best = dict.fromkeys(cases, float("inf"))
    gc.disable()
    try:
        for _ in range(repeats):
            for name, fn in cases.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                best[name] = min(best[name], (time.perf_counter() - t0) / calls * 1e6)
    finally:
        gc.enable()
    return best


def measure(n_layers: int, device: torch.device, calls: int, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.randn(8, HIDDEN, device=device)
    # No CUDA graphs: stock torch.compile has none here either; this measures dispatch alone.
    with set_compilation_config(CompilationConfig(level=3, use_cudagraph=False)):
        ours = Stack(n_layers).to(device)
        swap = SwapStack(n_layers).to(device)
    with set_compilation_config(CompilationConfig(level=3, check_inputs=False, use_cudagraph=False)):
        ours_nocheck = Stack(n_layers).to(device)
    swap.load_state_dict(ours.state_dict())
    ours_nocheck.load_state_dict(ours.state_dict())
    eager = ours  # nn.Module.__call__ of the same weights runs plain eager
    stock = torch.compile(eager.forward)
    filtered = torch.compile(eager.forward,
                             options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe})

    with torch.no_grad():
        expected = torch.nn.Module.__call__(eager, x)
        for m in (ours, swap, ours_nocheck):
            torch.testing.assert_close(m(x), expected)
        torch.testing.assert_close(stock(x), expected)
        torch.testing.assert_close(filtered(x), expected)
        floor_fn = types.FunctionType(ours.compiled_codes[0], Stack.forward.__globals__, "forward")
        torch.testing.assert_close(floor_fn(ours, x), expected)

        cases: dict[str, Callable[[], object]] = {
            "eager": lambda: torch.nn.Module.__call__(eager, x),
            "stock torch.compile": lambda: stock(x),
            "guard_filter_fn": lambda: filtered(x),
            "dynamo-once swap": lambda: swap(x),
            "dynamo-once fast": lambda: ours(x),
            "dynamo-once fast, no check": lambda: ours_nocheck(x),
            "floor": lambda: floor_fn(ours, x),
        }
        results = _time_all(cases, device, calls, repeats)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            results.update(_time_all({"skip_guard_eval_unsafe": lambda: stock(x)}, device, calls, repeats))
    return results


def run(device: str = "cpu", layers: list[int] | None = None, calls: int = 500, repeats: int = 15,
        out_dir: str | None = None) -> list[dict[str, object]]:
    dev = torch.device(device)
    layers = layers or [1, 4, 16, 64]
    rows: list[dict[str, object]] = []
    for n in layers:
        compat.reset()
        # Deep stacks: ~150 us a call on a slow host, where 1-2% jitter is the size of the 2 us target;
        # twice the repeats for the minimum over them.
        res = measure(n, dev, calls, repeats * (2 if n >= 64 else 1))
        floor = res["floor"]
        stock_over = res["stock torch.compile"] - floor
        for mech in MECHANISMS:
            over = res[mech] - floor
            rows.append({
                "layers": n,
                "mechanism": mech,
                "us_per_call": round(res[mech], 2),
                "overhead_over_floor_us": round(over, 2),
                "stock_overhead_ratio": round(stock_over / over, 1) if mech != "floor" and over > 0.05 else "",
            })
    name = f"guard_overhead_{dev.type}"
    reporting.write_results(
        name, rows,
        title=f"Per-call dispatch overhead ({dev.type}), Inductor, input [8, {HIDDEN}]",
        out_dir=out_dir,
        notes=[
            "overhead_over_floor_us: µs per call minus the direct call of the function built from the "
            "captured code; stock_overhead_ratio: stock torch.compile's overhead / this mechanism's.",
            "Targets: dynamo-once fast within 2 µs of the floor at every depth; >= 10x less overhead "
            "than stock torch.compile at 64 layers.",
        ],
        device=dev,
    )
    reporting.plot_lines(
        name, rows, x="layers", y="us_per_call", series="mechanism", out_dir=out_dir, logx=True,
        title=f"µs per call vs layers ({reporting.device_name(dev)}, torch {torch.__version__})",
        xlabel="layers", ylabel="µs per call",
    )
    return rows


def main(argv: list[str] | None = None, default_out: str | None = None) -> None:
    """The command line; ``default_out``: where results go without ``--out`` (None: printed only)."""
    p = argparse.ArgumentParser(prog="dynamo-once overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--layers", default="1,4,16,64", help="comma-separated depths (default 1,4,16,64)")
    p.add_argument("--calls", type=int, default=500, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=15)
    where = "the current directory" if default_out == "." else "none: print only"
    p.add_argument("--out", default=default_out, help=f"results directory (default: {where})")
    a = p.parse_args(argv)
    try:
        layers = [int(v) for v in a.layers.split(",")]
    except ValueError:
        p.error(f"--layers: expected comma-separated integers, e.g. 1,4,16,64; got {a.layers!r}")
    if a.device not in ("cpu", "cuda") or (a.device == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device: expected cpu or cuda (with a GPU present); got {a.device!r}")
    run(a.device, layers, a.calls, a.repeats, a.out)
