"""Reference models (Llama, Gemma 2, Llava), checkpoint loading, the paged-attention op, the ``LLM`` runner
and its text API (``SamplingParams``, ``RequestOutput``)."""

# Imported on first use (PEP 562), so `import models` (and `dynamo-once --help`) does not import torch.
_LAZY = {
    "Attention": ".attention",
    "attention": ".attention",
    "attention_native": ".attention",
    "write_kv_cache": ".attention",
    "AttentionMetadata": ".forward_context",
    "ForwardContext": ".forward_context",
    "get_forward_context": ".forward_context",
    "set_forward_context": ".forward_context",
    "KVCache": ".engine.kv_cache",
    "attention_layers": ".engine.kv_cache",
    "Gemma2Config": ".gemma2",
    "Gemma2ForCausalLM": ".gemma2",
    "Gemma2Model": ".gemma2",
    "LlamaConfig": ".llama",
    "LlamaForCausalLM": ".llama",
    "LlamaModel": ".llama",
    "CheckpointError": ".loader",
    "load_model": ".loader",
    "supported_architectures": ".loader",
    "QuantLinear": ".quant_linear",
    "QuantMergedLinear": ".quant_linear",
    "QuantizationConfig": ".quantization",
    "QuantScheme": ".quantization",
    "parse_quantization_config": ".quantization",
    "BUILTIN_MODELS": ".registry",
    "SamplingParams": ".sampling_params",
    "StructuredOutputsParams": ".structured_outputs",
    "LLM": ".engine",
    "GenerateStats": ".engine",
    "RequestOutput": ".engine",
}

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
    "StructuredOutputsParams",
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


def __getattr__(name: str) -> object:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
