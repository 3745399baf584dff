"""``ops.linear``: ``x @ weight.T (+ bias)`` for bf16 / fp16, the small-M Triton GEMM at decode sizes, cuBLAS elsewhere.

At decode sizes a linear layer's GEMM is a read of its weight, and cuBLAS's kernels for ``M <= 32`` leave bandwidth
unused on some of Llama's shapes (measured on the H200, ``benchmarks.gemm``: the 8B's o_proj 11.3 µs ours against
13.3 µs cuBLAS). This op is what the ``small_m_linear`` graph pass (``dispatcher.passes``) puts in place of a
compiled graph's ``mm(x, weight.T)`` / ``addmm(bias, x, weight.T)``: an opaque op, so that the choice is made at
run time on the concrete M (a level-3 graph serves every token count):

- CUDA, M <= ``ops.small_m_gemm.triton_max_m(x.dtype)`` (128), a config in ``ops.small_m_gemm.SMALL_M_TABLE`` for
  the shape, ``x`` with unit column stride and ``weight`` contiguous, ``DYNAMO_ONCE_SMALL_M_GEMM`` not 0:
  :func:`ops.small_m_mm` (fp32 sums in its own order, one rounding; a bias is added in fp32 before it);
- anything else: ``torch.nn.functional.linear``, the very call the graph made before the rewrite (bit for bit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .small_m_gemm import SmallMConfig, runtime_config, small_m_mm, small_m_operands, triton_max_m

__all__ = ["LINEAR_DTYPES", "linear", "linear_uses_small_m"]

#: The dtypes ``ops.linear`` takes (the small-M kernel's float operands).
LINEAR_DTYPES = (torch.bfloat16, torch.float16)


def _config(x: torch.Tensor, weight: torch.Tensor) -> SmallMConfig | None:
    """The small-M kernel's config for these operands, or None: ``F.linear``. M first: a prefill pays one test."""
    max_m = triton_max_m(x.dtype)
    return runtime_config(x, weight, max_m) if small_m_operands(x, weight, max_m) else None


def linear_uses_small_m(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` runs these operands on the small-M Triton GEMM (else ``F.linear``)."""
    return _config(x, weight) is not None


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dtype not in LINEAR_DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"linear: x and weight must both be bfloat16 or float16; got {x.dtype} and {weight.dtype}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x must be [M, K] and weight [N, K]; got {list(x.shape)} and {list(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0] or bias.dtype != x.dtype):
        raise ValueError(f"linear: bias must be [N] = [{weight.shape[0]}] in {x.dtype}; got "
                         f"{list(bias.shape)} in {bias.dtype}")


def _linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    # The arguments were checked when the graph was traced (the fake kernel) or by linear(); small_m_mm checks
    # what its kernel relies on.
    config = _config(x, weight)
    return F.linear(x, weight, bias) if config is None else small_m_mm(x, weight, bias, config)


def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, weight, bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


# Registered with torch.library.Library directly, as models.attention's op: a compiled graph calls it eagerly for
# every linear layer whatever the size (a 2048-token prefill too), and torch.library.custom_op's Python layers cost
# ~4-8 µs more a call on the CPU machine (22 against 18 µs for a 32 x 16 GEMM; F.linear alone 16).
# One kernel for every device (CompositeExplicitAutograd); inference only: no autograd formula.
_lib = torch.library.Library("dynamo_once", "FRAGMENT")  # kept alive: the registrations live as long as it
_lib.define("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor")
_lib.impl("linear", _linear_impl, "CompositeExplicitAutograd")
torch.library.register_fake("dynamo_once::linear", _linear_fake, lib=_lib)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in ``x``'s dtype, ``[M, N]``: the small-M Triton GEMM where it is faster (see the
    module docstring), else ``F.linear``.

    Args:
        x: ``bfloat16`` or ``float16 [M, K]``; weight: the same dtype, ``[N, K]`` (nn.Linear's layout).
        bias: None or ``[N]`` in ``x``'s dtype.
    Raises:
        TypeError: another dtype. ValueError: another shape.
    """
    _check(x, weight, bias)
    return torch.ops.dynamo_once.linear(x, weight, bias)
