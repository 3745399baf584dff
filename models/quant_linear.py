"""W8A8 linear layers: 8-bit weights (fp8 e4m3 or int8) with fp32 scales, activations quantized per call.

``y = (q(x) @ W^T) * a_scale * w_scale + b``, one GEMM op (``ops.fp8_scaled_mm`` / ``ops.int8_scaled_mm``,
opaque to Inductor) after the activation quantization, which goes through the ``CustomOp`` modules
(``QuantFP8`` / ``QuantInt8``) so the per-op switch applies to it.

Merged projections (QKV, gate-up) are one GEMM over shards that the checkpoint quantized separately:

- per-channel weight scales concatenate, one per output row;
- per-tensor weight scales differ between shards. They are not averaged or taken from one shard (wrong
  for the others): at load time each shard is requantized to the largest shard scale,
  ``q' = quant(q * s_i / s_max)``, and the layer keeps one scale, so the GEMM keeps the per-tensor
  layout, the fast one (Llama 3 8B on the H200 at M=1: per-tensor 2.43 ms, row-wise 4.02 ms, bf16
  4.12 ms). A shard with a smaller scale loses the low bits its own scale had kept (at most half a unit of
  the new grid per weight); a shard at the max scale is bit-exact. vLLM does the same.
- static ``input_scale``: all shards read the same input, so one scale, the largest over the shards
  (nothing the calibration saw in any shard is clipped).
"""

from __future__ import annotations

import torch
from torch import nn

import ops

from .layers import MergedLinear
from .quantization import QuantizationConfig, QuantizationError, QuantScheme

__all__ = ["QuantLinear", "QuantMergedLinear", "make_linear", "make_merged_linear", "quantize_weight",
           "BUILTIN_INPUT_SCALE"]

#: Static input scale of the random built-ins: activations up to |x| = 8 (RMS-normed inputs have unit RMS)
#: without clipping. Random weights have no calibration to take it from.
BUILTIN_INPUT_SCALE = 8.0 / 448.0


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _act_quant(scheme: QuantScheme) -> nn.Module:
    if scheme.kind == "fp8":
        if scheme.act_per_token:
            return ops.QuantFP8(static=False, per_token=True)
        return ops.QuantFP8(static=scheme.act_static)
    return ops.QuantInt8(static=scheme.act_static)


class QuantLinear(nn.Module):
    """A linear layer with 8-bit weights; ``forward(x [T, in]) -> [T, out]`` in ``x``'s dtype.

    Parameters (checkpoint names): ``weight [out, in]`` fp8 / int8; ``weight_scale`` fp32, ``[out]`` per
    channel (``[out, 1]`` in the checkpoint) or ``[1]`` per tensor; ``input_scale [1]`` fp32 for static
    activations; ``bias [out]`` in the model's dtype.
    """

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False,
                 shard_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.shard_sizes = list(shard_sizes or [out_features])
        # Per-tensor scales hold one entry per shard until process_weights_after_loading merges them.
        n = len(self.shard_sizes)
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=scheme.dtype))
        self.weight_scale = _frozen(torch.empty(out_features if scheme.weight_per_channel else n, dtype=torch.float32))
        self.input_scale = _frozen(torch.empty(n, dtype=torch.float32)) if scheme.act_static else None
        self.bias = _frozen(torch.empty(out_features)) if bias else None
        self.quant_input = _act_quant(scheme)
        self.scaled_mm = ops.fp8_scaled_mm if scheme.kind == "fp8" else ops.int8_scaled_mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            q, a_scale = self.quant_input(x, self.input_scale)  # a_scale: [1]
        else:
            q, a_scale = self.quant_input(x)  # a_scale: [1] or [T, 1]
        return self.scaled_mm(q, self.weight, a_scale, self.weight_scale, x.dtype, self.bias)  # [T, out]

    def _shard_names(self) -> list[str | None]:
        return [None]

    def checkpoint_rows(self, leaf: str) -> list[tuple[str | None, int, tuple[int, ...]]]:
        """The loader's protocol (see :func:`models.loader.checkpoint_layout`): per shard, ``(HF name or None,
        first row of our parameter, checkpoint shape)``."""
        rows, row = [], 0
        for i, (name, size) in enumerate(zip(self._shard_names(), self.shard_sizes)):
            if leaf == "weight":
                rows.append((name, row, (size, self.in_features)))
            elif leaf == "bias":
                rows.append((name, row, (size,)))
            elif leaf == "weight_scale" and self.scheme.weight_per_channel:
                rows.append((name, row, (size, 1)))
            else:  # a per-tensor weight_scale or input_scale: one entry per shard
                rows.append((name, i, (1,)))
            row += size
        return rows

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """One per-tensor weight scale and one input scale over the shards (see the module docstring)."""
        if self.input_scale is not None and self.input_scale.numel() > 1:
            self.input_scale = _frozen(self.input_scale.amax().reshape(1))
        scales = self.weight_scale
        if self.scheme.weight_per_channel or scales.numel() == 1:
            return
        s_max = scales.amax().reshape(1)
        row = 0
        for i, size in enumerate(self.shard_sizes):
            if scales[i] != s_max[0]:
                shard = self.weight[row:row + size]
                shard.copy_(_quantize_static(shard.float() * scales[i], s_max, self.scheme))
            row += size
        self.weight_scale = _frozen(s_max)

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor, input_scale: float = BUILTIN_INPUT_SCALE) -> None:
        """Set the layer from float weights ``[out, in]`` (random built-ins): quantized per the scheme, on
        ``weight``'s device; static layers get ``input_scale``."""
        q, scale = quantize_weight(weight, self.scheme)
        self.weight.copy_(q)
        self.weight_scale.copy_(scale.reshape(-1).expand(self.weight_scale.shape))
        if self.input_scale is not None:
            self.input_scale.fill_(input_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"


class QuantMergedLinear(QuantLinear):
    """:class:`models.layers.MergedLinear` quantized: shards stacked on the output dim, one GEMM."""

    def __init__(self, in_features: int, shard_sizes: list[int], shard_names: list[str], scheme: QuantScheme,
                 bias: bool = False) -> None:
        if len(shard_sizes) != len(shard_names):
            raise ValueError(f"QuantMergedLinear: {len(shard_sizes)} sizes for {len(shard_names)} names")
        super().__init__(in_features, sum(shard_sizes), scheme, bias=bias, shard_sizes=shard_sizes)
        self.shard_names = list(shard_names)

    def _shard_names(self) -> list[str | None]:
        return list(self.shard_names)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", shards=" + ", ".join(
            f"{n}:{s}" for n, s in zip(self.shard_names, self.shard_sizes))


def _quantize_static(x: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    if scheme.kind == "fp8":
        return ops.static_scaled_fp8_quant_ref(x, scale)
    return ops.static_scaled_int8_quant_ref(x, scale)


def quantize_weight(weight: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of float weights ``[out, in]`` per the scheme, with the ops' reference rounding: per
    channel a scale per row (``[out, 1]``: per-token quantization of the rows), else one (``[1]``)."""
    if scheme.weight_per_channel:
        if scheme.kind == "fp8":
            return ops.dynamic_per_token_scaled_fp8_quant_ref(weight)
        return ops.dynamic_scaled_int8_quant_ref(weight)
    if scheme.kind == "fp8":
        return ops.dynamic_scaled_fp8_quant_ref(weight)
    amax = weight.abs().amax().float().reshape(1)
    scale = (amax / torch.full_like(amax, 127.0)).clamp(min=1e-12)
    return _quantize_static(weight, scale, scheme), scale


def make_linear(in_features: int, out_features: int, bias: bool, quant: QuantizationConfig | None,
                name: str) -> nn.Module:
    """``nn.Linear``, or a :class:`QuantLinear` when ``quant`` quantizes the HF layer ``name``."""
    scheme = quant.scheme_for(name) if quant is not None else None
    if scheme is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return QuantLinear(in_features, out_features, scheme, bias=bias)


def make_merged_linear(in_features: int, shard_sizes: list[int], shard_names: list[str], bias: bool,
                       quant: QuantizationConfig | None, prefix: str) -> nn.Module:
    """:class:`MergedLinear`, or a :class:`QuantMergedLinear` when ``quant`` quantizes the shards
    ``<prefix>.<shard name>``.

    Raises:
        QuantizationError: the shards are quantized differently (or some not at all): one GEMM cannot mix them.
    """
    schemes = [quant.scheme_for(f"{prefix}.{n}") if quant is not None else None for n in shard_names]
    if len(set(schemes)) > 1:
        found = ", ".join(f"{prefix}.{n}: {s.describe() if s else 'not quantized'}" for n, s in zip(shard_names, schemes))
        raise QuantizationError(f"quantization_config: the shards of one merged projection must be quantized "
                                f"alike (they run as one GEMM); got {found}")
    if schemes[0] is None:
        return MergedLinear(in_features, shard_sizes, shard_names, bias=bias)
    return QuantMergedLinear(in_features, shard_sizes, shard_names, schemes[0], bias=bias)
