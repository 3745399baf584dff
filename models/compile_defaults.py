"""The compilation defaults a checkpoint asks for: W8A8 (fp8 / int8) linear layers on a CUDA device.

At levels 3-4 a model runs native code by default: its custom ops are off and Inductor fuses the norms,
activations and quantizations itself (``ops.custom_op``). For a W8A8 checkpoint the library's fused kernels
measured faster (README "Graph passes", ``benchmarks/results/recommended_decode_*``): the custom ops on (but
the rotary embedding: Inductor fuses it as well, and without its op the fp8 step at 128 tokens lost less to native
code in an H100 run) and the passes that fuse them with the quantizations (``dispatcher.passes``: ``rms_norm_quant``, ``act_quant``, with
``fused_add_rms_norm`` and ``noop`` that expose their patterns). Those become the defaults of such a model
built on a CUDA device, where they were measured; on the CPU the defaults stay native code. A config with a
``compile_sizes`` entry above ``DYNAMO_ONCE_NATIVE_OPS_ABOVE`` also gets ``native_ops`` (native code, which Inductor
fuses itself, in those sizes' compiles: the fp8 step at 128 tokens within 0.2% of native code's, 1.1% faster than
without it on an H100, ``benchmarks/results/nativeops_sized_decode_*``); without such a size the pass would do
nothing.

Only what the config leaves at its default is filled in: a config that sets ``custom_ops`` (or
``DYNAMO_ONCE_CUSTOM_OPS``) is used as given, and a pass switched either way keeps its switch.
"""

from __future__ import annotations

import dataclasses
import logging
import torch

from dispatcher import CompilationConfig, CompilationLevel
from dispatcher.passes.native_ops import acts_in_any as native_ops_acts

from .quantization import QuantizationConfig

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZED_CUSTOM_OPS", "QUANTIZED_PASSES", "QUANTIZED_SIZED_PASSES", "checkpoint_defaults"]

#: The custom-op switch a W8A8 checkpoint's model gets at levels 3-4 on CUDA when the config sets none.
QUANTIZED_CUSTOM_OPS: tuple[str, ...] = ("all", "-rotary_embedding")
#: The passes it turns on where the config leaves their switch at the default.
QUANTIZED_PASSES: tuple[str, ...] = ("noop", "fused_add_rms_norm", "rms_norm_quant", "act_quant")
#: And where ``compile_sizes`` has a size above ``DYNAMO_ONCE_NATIVE_OPS_ABOVE`` (the sizes the pass rewrites).
QUANTIZED_SIZED_PASSES: tuple[str, ...] = ("native_ops",)


def checkpoint_defaults(config: CompilationConfig, quantization: QuantizationConfig | None,
                        device: torch.device | str | None) -> CompilationConfig:
    """The config a model of this checkpoint is built under: ``config`` itself, or for a W8A8 checkpoint
    (``quantization``: its parsed ``quantization_config`` with quantized layers) at levels 3-4 on a CUDA
    device with ``custom_ops`` unset, a copy with :data:`QUANTIZED_CUSTOM_OPS` and the passes of
    :data:`QUANTIZED_PASSES` that are at their default turned on (and :data:`QUANTIZED_SIZED_PASSES` where a compile
    size is above ``DYNAMO_ONCE_NATIVE_OPS_ABOVE``)."""
    quantized = quantization is not None and bool(quantization.groups)
    if (not quantized or config.custom_ops or config.level < CompilationLevel.INDUCTOR
            or torch.device(device if device is not None else "cpu").type != "cuda"):
        return config
    passes = config.pass_config
    names = QUANTIZED_PASSES + (QUANTIZED_SIZED_PASSES if native_ops_acts(config.compile_sizes) else ())
    switches = {name: True for name in names if passes.switch(name) is None}
    chosen = dataclasses.replace(config, custom_ops=list(QUANTIZED_CUSTOM_OPS),
                                 pass_config=dataclasses.replace(passes, **switches))
    logger.info("W8A8 checkpoint at level %d on CUDA: custom ops %s, passes %s on (the measured fastest; set "
                "custom_ops or DYNAMO_ONCE_CUSTOM_OPS to choose yourself)", int(config.level),
                ",".join(QUANTIZED_CUSTOM_OPS), ",".join(sorted(switches)))
    return chosen
