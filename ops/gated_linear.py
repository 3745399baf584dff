"""``ops.gated_linear``: a bf16 / fp16 MLP's gate-up projection and its SiLU-and-mul, ``silu_and_mul(x @ weight.T)``.

In a Llama MLP the gate-up GEMM writes ``[T, 2D]`` that one activation kernel reads back to write ``[T, D]``. At a
decode step's token count the GEMM is a read of its weight, and the activation a launch of its own (~1-2 µs a
layer in a CUDA graph, most of it the launch). This op is what the ``gated_linear`` graph pass
(``dispatcher.passes``) puts in place of that pair: an opaque op deciding at run time, on the concrete M:

- CUDA, an M ``ops.small_m_gemm.GATED_ROWS`` has a config for (bf16 / fp16: M = 1), ``x`` with unit column stride
  and ``weight`` contiguous, ``DYNAMO_ONCE_SMALL_M_GEMM`` not 0: the small-M GEMM's gated form
  (:func:`ops.small_m_gemm.small_m_gated_mm`), whose epilogue computes SiLU(gate) * up (one kernel, the ``[T, 2D]``
  output never written);
- anything else: the unfused pair, ``ops.linear`` then ``ops.silu_and_mul``'s kernel, launched without PDL (on the
  CPU their references).

Values: the GEMM's output rounded to ``x``'s dtype, then SiLU(gate) * up in fp32, rounded once: the unfused ops'
arithmetic (the gated GEMM's fp32 sums in its own order, as ``ops.linear``'s small-M kernel's are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import linear
from .silu_and_mul import SILU, launch_act_and_mul, silu_and_mul_ref
from .small_m_gemm import SmallMConfig, gated_runtime_config, small_m_gated_mm, small_m_operands, triton_max_m
from .triton_utils import use_triton

__all__ = ["GATED_LINEAR_DTYPES", "gated_linear", "gated_linear_ref", "gated_linear_uses_small_m"]

#: The dtypes ``ops.gated_linear`` takes.
GATED_LINEAR_DTYPES = (torch.bfloat16, torch.float16)


def _config(x: torch.Tensor, weight: torch.Tensor) -> SmallMConfig | None:
    """The gated form's config for these operands, or None: the unfused pair. M first: a prefill pays one test."""
    return gated_runtime_config(x, weight) if small_m_operands(x, weight) else None


def gated_linear_uses_small_m(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gated_linear` runs these operands as one gated small-M kernel (else the unfused pair)."""
    return _config(x, weight) is not None


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dtype not in GATED_LINEAR_DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"gated_linear: x and weight must both be bfloat16 or float16; got {x.dtype} and "
                        f"{weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"gated_linear: x must be [M, K] and weight [2D, K]; got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    if weight.shape[0] % 2:
        raise ValueError(f"gated_linear: weight must be [gate; up], [2D, K] with an even number of rows; got "
                         f"{list(weight.shape)}")


def _gated_linear_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Checked when the graph was traced (the fake kernel) or by gated_linear(); small_m_gated_mm checks what its
    # kernel relies on.
    config = _config(x, weight)
    if config is not None:
        return small_m_gated_mm(x, weight, config)
    # ops.linear where its small-M table may apply; a prefill's GEMM straight to cuBLAS (the same call)
    h = linear(x, weight) if x.shape[0] <= triton_max_m(x.dtype) else F.linear(x, weight)
    # ops.silu_and_mul's kernel without PDL, as Inductor launches the activation it replaces: launched early, it
    # let the down projection's small-M GEMM launch early too, and the H100's batch-8 step of Llama-3.2-1B took
    # 3.5% longer (results/gatedlin_kernel_profile_1b_h100.md; with DYNAMO_ONCE_PDL=0 no slower).
    # Launched directly (this op runs eagerly, never traced: its fake kernel stands for it in a graph).
    return launch_act_and_mul(h, SILU, pdl=False, direct=True) if use_triton(h) else silu_and_mul_ref(h)


def _gated_linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check(x, weight)
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


# Registered with torch.library.Library directly, as ops.linear: a compiled graph calls it eagerly every step.
# One kernel for every device (CompositeExplicitAutograd); inference only.
_lib = torch.library.Library("dynamo_once", "FRAGMENT")  # kept alive: the registrations live as long as it
_lib.define("gated_linear(Tensor x, Tensor weight) -> Tensor")
_lib.impl("gated_linear", _gated_linear_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dynamo_once::gated_linear", _gated_linear_fake, lib=_lib)


def gated_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ weight.T = [gate, up]``, ``[M, D]`` in ``x``'s dtype: one gated small-M kernel
    where :data:`ops.small_m_gemm.GATED_ROWS` has a config (see the module docstring), else ``ops.linear`` then
    ``ops.silu_and_mul``.

    Args:
        x: ``bfloat16`` or ``float16 [M, K]``; weight: the same dtype, ``[2D, K]`` (the gate rows, then the up rows:
            a merged gate-up projection's nn.Linear weight).
    Raises:
        TypeError: another dtype. ValueError: another shape, or an odd number of weight rows.
    """
    _check(x, weight)
    return torch.ops.dynamo_once.gated_linear(x, weight)


def gated_linear_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: ``F.linear`` in ``x``'s dtype, then :func:`ops.silu_and_mul_ref` (fp32, one rounding)."""
    return silu_and_mul_ref(F.linear(x, weight))
