"""Optional Triton: the kernels' decorators and ``triton_op`` whether Triton imports or not.

CI and most development machines have no Triton (and no GPU). There every op
must still import, register ``torch.ops.dynamo_once.<name>`` and run its fp32
reference, so the kernel modules can define their ``@triton.jit`` functions
unconditionally: without Triton, ``triton.jit`` below returns the Python
function unchanged (it is never launched) and ``tl.constexpr`` is a plain
annotation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["HAS_TRITON", "triton", "tl", "triton_op", "use_triton", "next_power_of_2", "cdiv"]

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
