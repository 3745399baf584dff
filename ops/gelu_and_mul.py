"""GELU-and-multiply, the gated activation of Gemma's MLP: ``[..., 2d] -> [..., d]``.

``gelu_and_mul_ref`` is the definition: ``gelu(x[..., :d], approximate) *
x[..., d:]`` with ``approximate`` ``"none"`` (erf) or ``"tanh"`` (Gemma's
``gelu_pytorch_tanh``), computed in fp32 and cast back once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dispatcher.passes.native_forms import register_native_form

from .triton_utils import triton_op, use_triton
from .custom_op import CustomOp
from .silu_and_mul import GELU, GELU_TANH, launch_act_and_mul

__all__ = ["gelu_and_mul", "GeluAndMul", "gelu_and_mul_ref"]

_APPROXIMATE = ("none", "tanh")


def _launch_gelu_and_mul(x: torch.Tensor, approximate: str, config: tuple[int, int, int] | None = None,
                         pdl: bool | None = None) -> torch.Tensor:
    return launch_act_and_mul(x, GELU_TANH if approximate == "tanh" else GELU, config, pdl)


@triton_op("dynamo_once::gelu_and_mul", mutates_args=())
def _gelu_and_mul_op(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"gelu_and_mul: approximate must be one of {_APPROXIMATE}; got {approximate!r}")
    if not use_triton(x):
        return gelu_and_mul_ref(x, approximate)
    return _launch_gelu_and_mul(x, approximate)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` for ``x: [..., 2d]``; ``approximate`` is ``"none"`` or ``"tanh"``."""
    return torch.ops.dynamo_once.gelu_and_mul(x, approximate)


@CustomOp.register("gelu_and_mul")
class GeluAndMul(CustomOp):
    """``forward(x: [..., 2d]) -> [..., d]``: ``gelu(gate, approximate) * up``."""

    def __init__(self, approximate: str = "none") -> None:
        if approximate not in _APPROXIMATE:
            raise ValueError(f"GeluAndMul: approximate must be one of {_APPROXIMATE}; got {approximate!r}")
        super().__init__()
        self.approximate = approximate

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul_ref(x, self.approximate)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_and_mul(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


def gelu_and_mul_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The fp32 reference, cast back to ``x.dtype``."""
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.gelu(xf[..., :d], approximate=approximate) * xf[..., d:]).to(x.dtype).contiguous()


register_native_form("gelu_and_mul", gelu_and_mul_ref)
