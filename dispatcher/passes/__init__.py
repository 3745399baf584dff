"""Inductor post-grad graph passes: the manager, its cache key, and the library's rewrites.

At levels 3-4 every Inductor compile runs a :class:`PostGradPassManager` on its post-grad graph.
The library's passes are switched by ``CompilationConfig.pass_config`` (:class:`PassConfig`) and
``DYNAMO_ONCE_PASSES``; a plugin adds its own with ``dispatcher.plugins.add_post_grad_pass``.
:data:`pass_counter` counts what they did.
"""

from .counters import PassCounter, PassCounts, pass_counter
from .fused_add_rms_norm import FusedAddRMSNormPass
from .gated_linear import GatedLinearPass
from .gemm_act_quant import GemmActQuantPass
from .graph_pass import GraphPass
from .manager import PostGradPassManager, build_pass_manager, builtin_passes, compile_context, with_compile_size
from .native_ops import NativeOpsPass
from .noop_elimination import NoOpEliminationPass
from .norm_linear import NormLinearPass
from .pass_config import PassConfig
from .pattern_pass import PatternPass
from .quant_fusion import ActQuantPass, RMSNormQuantPass
from .quant_gemm import QuantGemmPass
from .rope_linear import RopeLinearPass
from .sequence_parallel import SequenceParallelPass
from .small_m_linear import SmallMLinearPass

__all__ = [
    "ActQuantPass",
    "FusedAddRMSNormPass",
    "GatedLinearPass",
    "GemmActQuantPass",
    "GraphPass",
    "NativeOpsPass",
    "NoOpEliminationPass",
    "NormLinearPass",
    "PassConfig",
    "PassCounter",
    "PassCounts",
    "PatternPass",
    "PostGradPassManager",
    "QuantGemmPass",
    "RMSNormQuantPass",
    "RopeLinearPass",
    "SequenceParallelPass",
    "SmallMLinearPass",
    "build_pass_manager",
    "builtin_passes",
    "compile_context",
    "pass_counter",
    "with_compile_size",
]
