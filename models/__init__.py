"""Reference models (Llama, Gemma 2, Llava), checkpoint loading, the paged-attention op, the ``LLM`` runner
and its text API (``SamplingParams``, ``RequestOutput``)."""

from .attention import Attention, attention, attention_native, write_kv_cache
from .forward_context import AttentionMetadata, ForwardContext, get_forward_context, set_forward_context
from .engine.kv_cache import KVCache, attention_layers
from .gemma2 import Gemma2Config, Gemma2ForCausalLM, Gemma2Model
from .llama import LlamaConfig, LlamaForCausalLM, LlamaModel
from .loader import CheckpointError, load_model, supported_architectures
from .quant_linear import QuantLinear, QuantMergedLinear
from .quantization import QuantizationConfig, QuantScheme, parse_quantization_config
from .registry import BUILTIN_MODELS
from .sampling_params import SamplingParams
from .engine import LLM, GenerateStats, RequestOutput

__all__ = [
    "Attention",
    "AttentionMetadata",
    "BUILTIN_MODELS",
    "CheckpointError",
    "ForwardContext",
    "Gemma2Config",
    "Gemma2ForCausalLM",
    "Gemma2Model",
    "GenerateStats",
    "KVCache",
    "LLM",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaModel",
    "QuantLinear",
    "QuantMergedLinear",
    "QuantScheme",
    "QuantizationConfig",
    "RequestOutput",
    "SamplingParams",
    "attention",
    "attention_layers",
    "attention_native",
    "get_forward_context",
    "load_model",
    "parse_quantization_config",
    "set_forward_context",
    "supported_architectures",
    "write_kv_cache",
]
