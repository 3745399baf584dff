"""The KV-cache scales of a checkpoint with an fp8 ``kv_cache_scheme`` (compressed-tensors).

Such a checkpoint stores ``k_scale`` and ``v_scale`` (fp32, ``[1]`` or ``[]``) on each attention module
(``model.layers.N.self_attn``): the cache holds ``k / k_scale`` and ``v / v_scale`` in fp8 e4m3
(``ops.kv_quant``). :func:`register_kv_scales` gives the model's attention module those two parameters,
so that the loader checks and reads them as any other tensor; :func:`apply_kv_scales`, after loading,
hands their values to the layer's :class:`~models.attention.Attention` (host floats, passed to every
launch). A model without the scheme has neither parameter, and a checkpoint that stores them anyway is
refused by the loader as holding unexpected tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .quantization import QuantizationConfig

__all__ = ["apply_kv_scales", "register_kv_scales"]


def register_kv_scales(module: nn.Module, quant: QuantizationConfig | None) -> None:
    """``module.k_scale`` and ``module.v_scale`` (fp32 ``[1]``, 1 until loaded) when ``quant`` has an fp8 KV
    cache; nothing otherwise."""
    if quant is None or not quant.kv_cache:
        return
    for name in ("k_scale", "v_scale"):
        module.register_parameter(name, nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False))


def apply_kv_scales(module: nn.Module, attn: Attention) -> None:
    """``attn``'s scales from ``module``'s loaded parameters (see :func:`register_kv_scales`), if it has them."""
    k_scale, v_scale = getattr(module, "k_scale", None), getattr(module, "v_scale", None)
    if k_scale is not None and v_scale is not None:
        attn.set_kv_scales(k_scale.item(), v_scale.item())
