"""What every Triton launcher shares: optional Triton, ``triton_op``, size helpers and the PDL switch.

A public module: the op modules import from it, and so does :mod:`models` (``cdiv``).

CI and most development machines have no Triton (and no GPU). There every op
must still import, register ``torch.ops.dynamo_once.<name>`` and run its fp32
reference, so the kernel modules can define their ``@triton.jit`` functions
unconditionally: without Triton, ``triton.jit`` below returns the Python
function unchanged (it is never launched) and ``tl.constexpr`` is a plain
annotation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dispatcher import envs

logger = logging.getLogger(__name__)

__all__ = [
    "HAS_TRITON",
    "triton",
    "tl",
    "triton_op",
    "use_triton",
    "next_power_of_2",
    "cdiv",
    "known_int",
    "needs_int64",
    "SMALL_ELEMENTS",
    "pdl_launch",
    "pdl_args",
]

#: At most this many elements (16 tokens x 8192) an op is launch-latency bound: on the H200 it moves
#: <= 512 KiB of bf16, < 0.15 us at 4.2 TB/s against ~1.3 us per CUDA-graph kernel node. Such sizes get
#: latency configs (few warps, many small programs) when their size is known (see ``known_int``).
SMALL_ELEMENTS = 16 * 8192

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: the reference implementations serve every device
    HAS_TRITON = False

    class _TritonPlaceholder:
        """Just enough of ``triton`` for the kernel modules to import."""

        __version__ = None

        @staticmethod
        def jit(fn: Callable | None = None, **_: Any) -> Callable:
            return fn if fn is not None else (lambda f: f)

    class _LanguagePlaceholder:
        constexpr = "constexpr"

    triton = _TritonPlaceholder()  # type: ignore[assignment]
    tl = _LanguagePlaceholder()  # type: ignore[assignment]


def next_power_of_2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: Any, b: Any) -> Any:
    """Ceiling division that keeps a SymInt symbolic (no guard on its value)."""
    return (a + b - 1) // b


def known_int(n: Any) -> int | None:
    """``n`` as an int when its value is known without a guard, else None.

    Known: in eager mode and in static-shape compiles (``dynamic=False``, or the
    dispatcher's per-size compiles). Unknown: a symbolic token count, where
    branching on its value would guard on it (a recompile at the next size),
    so the launchers then use their size-independent configs.
    """
    if isinstance(n, int):
        return n
    from torch.fx.experimental.symbolic_shapes import is_concrete_int

    return int(n) if is_concrete_int(n) else None


def needs_int64(*extents: Any) -> bool:
    """Whether an offset up to ``sum(extents)`` elements may overflow int32 (always, for a symbolic extent).

    int32 offsets save the 64-bit multiply-adds per address, which matter only on the short,
    latency-bound path, but are free everywhere they fit.
    """
    total = 0
    for e in extents:
        v = known_int(e)
        if v is None:
            return True
        total += abs(v)
    return total >= 2**31


def triton_op(name: str, *, mutates_args: str | Iterable[str]) -> Callable[[Callable], Any]:
    """``torch.library.triton_op`` when Triton imports, else an opaque ``custom_op``.

    With Triton, torch.compile decomposes the op into its body, so Inductor
    sees the Triton kernel and fake tensors come from tracing the body. Without
    it, the body (which then only runs the reference) is the eager kernel for
    every device and, traced on fake tensors, the fake implementation: the
    output shapes are defined in one place either way.
    """

    def dec(fn: Callable) -> Any:
        if HAS_TRITON:
            return torch.library.triton_op(name, fn, mutates_args=mutates_args)
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        op.register_fake(fn)
        return op

    return dec


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op body launches its Triton kernel for ``x`` (else: the reference).

    Decided by the device only, which Dynamo treats as static, so the branch
    adds no shape guard. Fake tensors report the device they stand for.
    """
    return HAS_TRITON and x.device.type == "cuda"


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def pdl_launch(x: torch.Tensor, n: int | None) -> bool:
    """Whether a kernel on ``x`` covering ``n`` elements (None: not known without a guard) launches with
    programmatic dependent launch (PDL).

    With PDL (Hopper and newer) a kernel may be launched while the one before it on the stream still
    runs: its programs start, then wait (``gdc_wait``, before any global memory access) for that
    kernel's end, and each signals (``gdc_launch_dependents``) that the next may launch in turn. That
    hides a launch's latency, the larger part of a call at <= 16 tokens (~1.2 us a CUDA-graph kernel
    node on the H200); FlashInfer's norm and activation kernels do the same on Hopper.

    Only for latency-bound launches (``n <= SMALL_ELEMENTS``, one wave of programs): on a large grid, the
    next kernel's early programs would hold SM slots the running one still needs. Only in eager mode (CUDA
    graph capture included) on a real CUDA tensor: under torch.compile, Inductor launches the kernel
    itself. ``DYNAMO_ONCE_PDL=0`` turns it off.
    """
    if n is None or n > SMALL_ELEMENTS or type(x) is not torch.Tensor or x.device.type != "cuda" \
            or torch.compiler.is_compiling():
        return False
    return envs.pdl() and _has_pdl(x.device.index if x.device.index is not None else torch.cuda.current_device())


def pdl_args(pdl: bool) -> dict[str, bool]:
    """A kernel's ``PDL`` constexpr and, when on, the launch option that goes with it."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
