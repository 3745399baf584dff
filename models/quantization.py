"""W8A8 quantization configs of HF checkpoints: which linear layers are quantized, and how.

``config.json``'s ``quantization_config`` in one of two formats:

- compressed-tensors (``"quant_method": "compressed-tensors"``, what llm-compressor writes: the public
  FP8 / INT8 Llama 3 checkpoints): ``config_groups`` of schemes, each with ``targets`` (``"Linear"``,
  exact module names or ``re:`` regexes), ``weights`` and ``input_activations`` arguments; ``ignore``
  (exact names or ``re:`` regexes, matched from the start of the name). Tensors per quantized linear:
  ``weight`` (F8_E4M3 or I8, ``[out, in]``), ``weight_scale`` (per tensor ``[1]`` or ``[]``, per
  channel ``[out, 1]``), and for static activations ``input_scale`` (``[1]`` or ``[]``).
- AutoFP8 (``"quant_method": "fp8"``, ``"activation_scheme": "static" | "dynamic"``,
  ``ignored_layers``): fp8 weights with per-tensor scales, activations static or dynamic per tensor.

compressed-tensors' ``kv_cache_scheme`` (fp8, static, per tensor, symmetric) makes the KV cache fp8
(``ops.kv_quant``): each attention module's ``k_scale`` and ``v_scale`` (``[1]`` or ``[]``, fp32) are read
into its layer; any other KV-cache scheme is refused.

Everything else (block-wise fp8, 4-bit, asymmetric, group strategies, weight-only, an int8 or per-head
KV cache) is refused by :func:`parse_quantization_config` with a :class:`QuantizationError` that names the
field, what it holds and what is supported.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

__all__ = ["QuantizationError", "QuantScheme", "QuantizationConfig", "parse_quantization_config", "SUPPORTED"]

#: one line for error messages
SUPPORTED = ("8-bit symmetric W8A8: fp8 (e4m3) or int8 weights per tensor or per channel, activations of the "
             "same type static per tensor or dynamic per token (fp8 also dynamic per tensor)")

_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")


class QuantizationError(ValueError):
    """A ``quantization_config`` this library does not run; the message names the field (the loader adds
    the file)."""


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How one linear layer is quantized: 8-bit weights and activations of one type."""

    kind: str
    """``"fp8"`` (``float8_e4m3fn``) or ``"int8"``, weights and activations alike."""
    weight_per_channel: bool
    """One weight scale per output row (``[out, 1]`` in the checkpoint); else one per tensor."""
    act_static: bool
    """Activations quantized with the checkpoint's per-tensor ``input_scale``; else a scale per call."""
    act_per_token: bool = False
    """Dynamic activations: one scale per token (row); else one per tensor (fp8 only)."""

    def __post_init__(self) -> None:
        if self.kind not in ("fp8", "int8"):
            raise ValueError(f"QuantScheme: kind must be 'fp8' or 'int8'; got {self.kind!r}")
        if self.act_static and self.act_per_token:
            raise ValueError("QuantScheme: static activations are per tensor (act_per_token needs act_static=False)")
        if self.kind == "int8" and not self.act_static and not self.act_per_token:
            raise ValueError("QuantScheme: dynamic int8 activations are per token")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kind == "fp8" else torch.int8

    @property
    def safetensors_dtype(self) -> str:
        """The weights' dtype as a safetensors header names it."""
        return "F8_E4M3" if self.kind == "fp8" else "I8"

    def describe(self) -> str:
        acts = "static per tensor" if self.act_static else f"dynamic per {'token' if self.act_per_token else 'tensor'}"
        return f"{self.kind} weights per {'channel' if self.weight_per_channel else 'tensor'}, activations {acts}"


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' rule: ``re:`` prefix = regex matched at the start of the name, else the exact name;
    ``"Linear"`` (a class name) matches every linear layer, which is every layer asked about."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or target == "Linear"


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's quantization: schemes by target, and the layers left in floating point."""

    method: str
    """``"compressed-tensors"`` or ``"fp8"`` (AutoFP8)."""
    groups: tuple[tuple[tuple[str, ...], QuantScheme], ...]
    """``(targets, scheme)`` per config group, in the config's order."""
    ignore: tuple[str, ...] = ()
    kv_cache: bool = False
    """The checkpoint's KV cache is fp8 e4m3 with a static per-tensor ``k_scale`` / ``v_scale`` an attention
    module (compressed-tensors' ``kv_cache_scheme``)."""

    def scheme_for(self, name: str) -> QuantScheme | None:
        """The scheme of the HF linear layer ``name`` (``model.layers.0.self_attn.q_proj``); None: not quantized.

        A group naming the layer exactly wins over one matching it by regex, which wins over ``"Linear"``.
        """
        if any(_matches(name, ign) for ign in self.ignore):
            return None
        for rank in (lambda t: t == name, lambda t: t.startswith("re:") and _matches(name, t), lambda t: t == "Linear"):
            for targets, scheme in self.groups:
                if any(rank(t) for t in targets):
                    return scheme
        return None

    def schemes(self) -> set[QuantScheme]:
        return {scheme for _, scheme in self.groups}


def parse_quantization_config(hf: dict[str, Any]) -> QuantizationConfig | None:
    """The ``quantization_config`` of an HF ``config.json`` dict; None when it has none.

    Raises:
        QuantizationError: an unsupported method or scheme, naming the field, the value and what is supported.
    """
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise QuantizationError(f"quantization_config: expected a JSON object; got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method == "fp8":
        return _parse_autofp8(qc)
    raise QuantizationError(f"quantization_config.quant_method: {method!r} is not supported; supported: "
                            f"'compressed-tensors' and 'fp8' (AutoFP8), {SUPPORTED}")


def _names(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise QuantizationError(f"{field}: expected a list of layer names; got {value!r}")
    return tuple(value)


def _parse_autofp8(qc: dict[str, Any]) -> QuantizationConfig:
    field = "quantization_config"
    block = qc.get("weight_block_size")
    if block is not None:
        raise QuantizationError(f"{field}.weight_block_size: {block!r} (block-wise fp8) is not supported; "
                                f"supported: {SUPPORTED}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("static", "dynamic"):
        raise QuantizationError(f"{field}.activation_scheme: expected 'static' or 'dynamic'; got {scheme!r}")
    if qc.get("kv_cache_quant_method") is not None:
        raise QuantizationError(f"{field}.kv_cache_quant_method: {qc['kv_cache_quant_method']!r} (a quantized "
                                "KV cache) is not supported")
    # AutoFP8's dynamic scheme is a per-tensor scale from each call's activations.
    fp8 = QuantScheme("fp8", weight_per_channel=False, act_static=scheme == "static")
    return QuantizationConfig("fp8", ((("Linear",), fp8),), _names(qc.get("ignored_layers"), f"{field}.ignored_layers"))


def _parse_compressed_tensors(qc: dict[str, Any]) -> QuantizationConfig:
    field = "quantization_config"
    # No format: read as naive-quantized (weights stored in their 8-bit dtype); float weights (compressed-tensors'
    # own default, "fakequant") then fail the loader's dtype check, by tensor name.
    fmt = qc.get("format") or "naive-quantized"
    if qc.get("sparsity_config"):
        raise QuantizationError(f"{field}.sparsity_config: sparse weights are not supported; supported: {SUPPORTED}")
    kv_cache = _kv_cache_scheme(qc.get("kv_cache_scheme"), f"{field}.kv_cache_scheme")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantizationError(f"{field}.config_groups: expected a non-empty object of schemes; got {groups!r}")
    parsed = []
    for name, group in groups.items():
        where = f"{field}.config_groups.{name}"
        if not isinstance(group, dict):
            raise QuantizationError(f"{where}: expected a scheme object (targets, weights, input_activations); got "
                                    f"{group!r} (preset scheme names are not expanded here)")
        group_fmt = group.get("format") or fmt
        if group_fmt not in _FORMATS:
            raise QuantizationError(f"{where}: format {group_fmt!r} is not supported; supported: "
                                    f"{', '.join(_FORMATS)} ({SUPPORTED})")
        targets = _names(group.get("targets"), f"{where}.targets")
        parsed.append((targets, _scheme(group, group_fmt, where)))
    return QuantizationConfig("compressed-tensors", tuple(parsed), _names(qc.get("ignore"), f"{field}.ignore"),
                              kv_cache=kv_cache)


#: one line for the KV cache's error messages
KV_SUPPORTED = "an fp8 (e4m3) KV cache, static per tensor, symmetric"


def _kv_cache_scheme(args: Any, where: str) -> bool:
    """Whether compressed-tensors' ``kv_cache_scheme`` asks for an fp8 cache (None: no scheme); refuses others."""
    if args is None:
        return False
    if not isinstance(args, dict):
        raise QuantizationError(f"{where}: expected quantization arguments; got {args!r}")
    bits, typ = args.get("num_bits", 8), str(args.get("type", "int")).lower()
    strategy, dynamic = str(args.get("strategy") or "tensor").lower(), args.get("dynamic", False)
    if bits != 8 or typ != "float":
        raise QuantizationError(f"{where}: {bits}-bit {typ} KV-cache quantization is not supported; supported: "
                                f"{KV_SUPPORTED}")
    if strategy != "tensor" or dynamic is not False or args.get("symmetric", True) is not True:
        raise QuantizationError(f"{where}: strategy {strategy!r}, dynamic {dynamic!r}, symmetric "
                                f"{args.get('symmetric', True)!r} is not supported; supported: {KV_SUPPORTED}")
    return True


def _scheme(group: dict[str, Any], fmt: str, where: str) -> QuantScheme:
    weights, acts = group.get("weights"), group.get("input_activations")
    if group.get("output_activations") is not None:
        raise QuantizationError(f"{where}.output_activations: quantized outputs are not supported; "
                                f"supported: {SUPPORTED}")
    if not isinstance(weights, dict):
        raise QuantizationError(f"{where}.weights: expected quantization arguments; got {weights!r}")
    if not isinstance(acts, dict):
        raise QuantizationError(f"{where}.input_activations: {acts!r} (weight-only quantization) is not supported; "
                                f"supported: {SUPPORTED}")
    kind, w_strategy, w_dynamic = _args(weights, f"{where}.weights")
    if w_strategy not in ("tensor", "channel") or w_dynamic:
        raise QuantizationError(f"{where}.weights: strategy {w_strategy!r}{' (dynamic)' if w_dynamic else ''} "
                                f"{_what(w_strategy, weights)}is not supported; supported: {SUPPORTED}")
    if fmt != "naive-quantized" and fmt != f"{'float' if kind == 'fp8' else 'int'}-quantized":
        raise QuantizationError(f"{where}: format {fmt!r} does not hold {kind} weights")
    a_kind, a_strategy, a_dynamic = _args(acts, f"{where}.input_activations")
    if a_kind != kind:
        raise QuantizationError(f"{where}: {kind} weights with {a_kind} activations are not supported; "
                                f"supported: {SUPPORTED}")
    ok = (a_strategy == "tensor" and (not a_dynamic or kind == "fp8")) or (a_strategy == "token" and a_dynamic)
    if not ok:
        mode = "dynamic" if a_dynamic else "static"
        raise QuantizationError(f"{where}.input_activations: {mode} strategy {a_strategy!r} "
                                f"{_what(a_strategy, acts)}is not supported for {kind}; supported: {SUPPORTED}")
    return QuantScheme(kind, weight_per_channel=w_strategy == "channel", act_static=not a_dynamic,
                       act_per_token=a_strategy == "token")


def _what(strategy: str, args: dict[str, Any]) -> str:
    if strategy == "block":
        return f"(block-wise, block_structure {args.get('block_structure')}) "
    if strategy == "group":
        return f"(group_size {args.get('group_size')}) "
    return ""


def _args(args: dict[str, Any], where: str) -> tuple[str, str, bool]:
    """``(kind, strategy, dynamic)`` of one compressed-tensors ``QuantizationArgs`` (its defaults: 8-bit int,
    symmetric, static; no strategy means per tensor, or group / channel from ``group_size``)."""
    bits, typ = args.get("num_bits", 8), str(args.get("type", "int")).lower()
    if bits != 8:
        raise QuantizationError(f"{where}.num_bits: {bits!r} ({bits}-bit {typ}) is not supported; supported: {SUPPORTED}")
    if typ not in ("float", "int"):
        raise QuantizationError(f"{where}.type: expected 'float' or 'int'; got {typ!r}")
    if args.get("symmetric", True) is not True:
        raise QuantizationError(f"{where}.symmetric: {args.get('symmetric')!r} (asymmetric, with zero points) is "
                                f"not supported; supported: {SUPPORTED}")
    strategy, group_size = args.get("strategy"), args.get("group_size")
    if strategy is None:
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    dynamic = args.get("dynamic", False)
    if dynamic not in (True, False):
        raise QuantizationError(f"{where}.dynamic: {dynamic!r} is not supported; expected true or false")
    return ("fp8" if typ == "float" else "int8"), str(strategy).lower(), bool(dynamic)
