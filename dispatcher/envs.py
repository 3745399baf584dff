"""Every ``DYNAMO_ONCE_*`` environment variable, parsed and validated here only.

A bad value raises ``ValueError`` naming the variable, the value given and
what is allowed. Values are read at call time (not import time) so tests and
users can change them between configurations.
"""

from __future__ import annotations

import os

from .levels import CompilationLevel
from .passes.pass_config import PassConfig

__all__ = [
    "ENV_VARS",
    "api_key",
    "compile_level",
    "custom_ops",
    "debug",
    "debug_dump_path",
    "use_bytecode_hook",
    "torch_compile_disabled",
    "pdl",
    "small_m_gemm",
    "prefill_writes_kv",
    "unified_attention",
    "mixed_decode_fused",
    "warm_attention",
    "passes",
    "cache_dir",
    "compile_cache_disabled",
    "aot_enabled",
    "sequence_parallel_min_tokens",
    "native_ops_above",
    "compile_sizes",
    "async_tp",
]

#: name -> one-line description; the CLI and README list these.
ENV_VARS: dict[str, str] = {
    "DYNAMO_ONCE_COMPILE_LEVEL": "compilation level: 0-4 or a level name (any case)",
    "DYNAMO_ONCE_CUSTOM_OPS": 'per-op switch, e.g. "+rms_norm,-silu_and_mul", "all", "none"',
    "DYNAMO_ONCE_USE_BYTECODE_HOOK": "1: dispatch captured bytecode (default); 0: stay in Dynamo, drop guards",
    "DYNAMO_ONCE_DEBUG": "1: check shape guards and CUDA-graph input addresses on every call",
    "DYNAMO_ONCE_DEBUG_DUMP_PATH": "directory for dumps of captured code (disassembly, source, FX graph)",
    "DYNAMO_ONCE_PDL": "1 (default): latency-bound Triton ops, and at levels 3-4 Inductor's kernels, launch with "
                       "programmatic dependent launch (Hopper+); 0: off",
    "DYNAMO_ONCE_PASSES": 'levels 3-4 graph passes, e.g. "+fused_add_rms_norm,-noop", "all", "none"',
    "DYNAMO_ONCE_COMPILE_SIZES": 'levels 3-4: token counts that also get a compile of their own, e.g. "128,256" '
                                 "(CompilationConfig.compile_sizes; default none: one compile serves every size)",
    "DYNAMO_ONCE_SMALL_M_GEMM": "1 (default): the W8A8 GEMMs use the Triton small-M kernel at small M on CUDA; 0: cuBLAS",
    "DYNAMO_ONCE_FP8_FAST_ACCUM": "0 (default): cuBLAS's fp8 GEMMs promote their sums to fp32 as they go; 1: fast "
                                  "accumulation (the tensor cores' own accumulator: less precise; on the H200 no "
                                  "faster for Llama-3-8B's shapes)",
    "DYNAMO_ONCE_PREFILL_WRITES_KV": "1 (default): in the split form of a step with a prompt, the paged prefill kernel "
                                     "writes the new keys and values itself (no cache-write launch); 0: a separate "
                                     "cache-write launch",
    "DYNAMO_ONCE_UNIFIED_ATTENTION": "1 (default): a step with a prompt (at most 8 decodes, none longer than 1024 tokens or it) "
                                     "attends in one launch a layer, the prefill kernel over every sequence; 0: "
                                     "split-KV decode and prefill launched apart",
    "DYNAMO_ONCE_MIXED_DECODE_FUSED": "1 (default): in a step with a prompt, the split-KV decode kernel writes the decodes' "
                                      "keys and values and merges its splits itself, whatever its config; 0: as its "
                                      "config (chosen for the whole-step graphs)",
    "DYNAMO_ONCE_WARM_ATTENTION": "1 (default): at start-up, with CUDA graphs, the engine launches the eager "
                                  "attention over every step layout, so that its Triton kernels compile then, not "
                                  "while serving; 0: they compile at first use",
    "DYNAMO_ONCE_CACHE_DIR": "the library's cache directory (default ~/.cache/dynamo_once); the compile cache is in compile/",
    "DYNAMO_ONCE_DISABLE_COMPILE_CACHE": "1: levels 3-4 neither read nor write the compile cache; 0 (default): they do",
    "DYNAMO_ONCE_AOT": "1 (default): a warm start rebuilds the traced forward from the compile cache, no Dynamo trace; 0: it traces",
    "DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE": "tensor parallel on CUDA: 'ONE_SHOT_KIB,TWO_SHOT_KIB', the largest all-reduce (KiB) "
                                       "taking symmetric memory's one-shot / two-shot kernel (unset: NCCL always)",
    "DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS": "tensor parallel, pass sequence_parallel: the smallest compile size (tokens) "
                                                "it rewrites (default 1024; smaller sizes keep the all-reduce)",
    "DYNAMO_ONCE_NATIVE_OPS_ABOVE": "pass native_ops: compiles of more tokens than this put the library's ops back in "
                                    "their native forms (default 64)",
    "DYNAMO_ONCE_ASYNC_TP": "1 (default): the sequence-parallel GEMMs on CUDA overlap their reduce-scatter / all-gather "
                            "(torch symm_mem's fused ops); 0: the plain GEMM, then the NCCL collective",
    "DYNAMO_ONCE_API_KEY": "dynamo-once serve: require 'Authorization: Bearer <key>' (as --api-key); unset or empty: none",
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None else value.strip()


def parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; expected one of 0, 1 (or true/false, yes/no, on/off)")


def _bool(name: str, default: bool) -> bool:
    value = _get(name)
    return default if value is None else parse_bool(name, value)


def torch_compile_disabled() -> bool:
    """``TORCH_COMPILE_DISABLE=1`` (torch's own switch) means level 0."""
    return _bool("TORCH_COMPILE_DISABLE", False)


def compile_level() -> int | None:
    """``DYNAMO_ONCE_COMPILE_LEVEL`` as an int 0-4, or None when unset."""
    value = _get("DYNAMO_ONCE_COMPILE_LEVEL")
    if value is None or value == "":
        return None
    try:
        return int(CompilationLevel.parse(value))
    except ValueError as e:
        raise ValueError(f"DYNAMO_ONCE_COMPILE_LEVEL={value!r}: {e}") from None


def custom_ops() -> list[str] | None:
    """``DYNAMO_ONCE_CUSTOM_OPS`` split on commas; syntax is checked by ``ops.custom_op``."""
    value = _get("DYNAMO_ONCE_CUSTOM_OPS")
    if value is None:
        return None
    return [tok.strip() for tok in value.split(",") if tok.strip()]


def compile_sizes() -> list[int] | None:
    """``DYNAMO_ONCE_COMPILE_SIZES``: comma-separated positive token counts; None when unset or empty."""
    value = _get("DYNAMO_ONCE_COMPILE_SIZES")
    if value is None or not value.strip():
        return None
    tokens = [tok.strip() for tok in value.split(",")]
    if not all(tok.isdigit() and int(tok) >= 1 for tok in tokens):
        raise ValueError(f"DYNAMO_ONCE_COMPILE_SIZES={value!r}: expected comma-separated positive integers (tokens), "
                         "e.g. '128,256'")
    return [int(tok) for tok in tokens]


def use_bytecode_hook() -> bool:
    return _bool("DYNAMO_ONCE_USE_BYTECODE_HOOK", True)


def debug() -> bool:
    return _bool("DYNAMO_ONCE_DEBUG", False)


def debug_dump_path() -> str | None:
    value = _get("DYNAMO_ONCE_DEBUG_DUMP_PATH")
    return value or None


def pdl() -> bool:
    return _bool("DYNAMO_ONCE_PDL", True)


def prefill_writes_kv() -> bool:
    """``DYNAMO_ONCE_PREFILL_WRITES_KV``: the default of ``models.attention.PREFILL_WRITES_KV`` (read when that
    module is imported): the prefill kernel writes the new keys and values itself. On by default."""
    return _bool("DYNAMO_ONCE_PREFILL_WRITES_KV", True)


def unified_attention() -> bool:
    """``DYNAMO_ONCE_UNIFIED_ATTENTION``: the default of ``models.attention.UNIFIED_ATTENTION`` (read when that
    module is imported): a step with a prompt attends in one launch a layer. On by default."""
    return _bool("DYNAMO_ONCE_UNIFIED_ATTENTION", True)


def mixed_decode_fused() -> bool:
    """``DYNAMO_ONCE_MIXED_DECODE_FUSED``: the default of ``models.forward_context.MIXED_DECODE_FUSED`` (read when
    that module is imported): a step with a prompt has its decode kernel write and merge itself. On by default."""
    return _bool("DYNAMO_ONCE_MIXED_DECODE_FUSED", True)


def warm_attention() -> bool:
    """``DYNAMO_ONCE_WARM_ATTENTION``: whether ``models.engine.graphs.StepGraphs.setup`` launches the eager attention
    over every step layout at start-up (its kernels compiled then: 17-25 s with an empty Triton cache on an H100,
    0.1 s with it warm). On by default."""
    return _bool("DYNAMO_ONCE_WARM_ATTENTION", True)


def api_key() -> str | None:
    """``DYNAMO_ONCE_API_KEY``: the bearer token ``dynamo-once serve`` wants when no ``--api-key`` is given."""
    return _get("DYNAMO_ONCE_API_KEY") or None


def small_m_gemm() -> bool:
    """``DYNAMO_ONCE_SMALL_M_GEMM``: whether ``ops.int8_scaled_mm`` / ``ops.fp8_scaled_mm`` take the Triton small-M
    GEMM where its table has a config (read at every call: the ops are opaque, so also under torch.compile)."""
    return _bool("DYNAMO_ONCE_SMALL_M_GEMM", True)


def fp8_fast_accum() -> bool:
    """``DYNAMO_ONCE_FP8_FAST_ACCUM``: whether ``ops.fp8_scaled_mm``'s cuBLAS path asks ``torch._scaled_mm`` for fast
    accumulation (read at every call, as :func:`small_m_gemm`). Off by default."""
    return _bool("DYNAMO_ONCE_FP8_FAST_ACCUM", False)


def passes() -> PassConfig | None:
    """``DYNAMO_ONCE_PASSES`` as a :class:`~dispatcher.passes.PassConfig`, or None when unset."""
    value = _get("DYNAMO_ONCE_PASSES")
    if value is None:
        return None
    try:
        return PassConfig.parse(value)
    except ValueError as e:
        raise ValueError(f"DYNAMO_ONCE_PASSES={value!r}: {e}") from None


def cache_dir() -> str:
    """``DYNAMO_ONCE_CACHE_DIR`` (absolute, ``~`` expanded), else ``~/.cache/dynamo_once``; not created here."""
    value = _get("DYNAMO_ONCE_CACHE_DIR")
    if value is None or value == "":
        return os.path.join(os.path.expanduser("~"), ".cache", "dynamo_once")
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"DYNAMO_ONCE_CACHE_DIR={value!r} is not a directory; expected a directory path "
                         f"(created if missing)")
    return path


def compile_cache_disabled() -> bool:
    return _bool("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", False)


def aot_enabled() -> bool:
    """``DYNAMO_ONCE_AOT`` (default on): the compile cache also keeps, and a warm start loads, the AOT forward."""
    return _bool("DYNAMO_ONCE_AOT", True)


def symm_mem_all_reduce() -> tuple[int, int] | None:
    """``DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE`` as ``(one_shot_max_kib, two_shot_max_kib)``, None when unset or empty."""
    value = _get("DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE")
    if value is None or value.strip() == "":
        return None
    parts = [p.strip() for p in value.split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE={value!r}: expected two sizes in KiB, "
                         f"'ONE_SHOT_MAX,TWO_SHOT_MAX' (e.g. '256,4096'; 0 turns one kernel off)")
    return int(parts[0]), int(parts[1])


#: ``DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS``'s default: above the CUDA-graph capture sizes (decode keeps the
#: all-reduce), at the prefill sizes where the rewrite is meant to pay (issue 17 measures 2048).
SEQUENCE_PARALLEL_MIN_TOKENS = 1024  # dispatcher.passes.sequence_parallel.DEFAULT_MIN_TOKENS


def _token_count(name: str, default: int, minimum: int) -> int:
    """A token-count variable: ``default`` when unset or empty, else an integer >= ``minimum`` (0 or 1)."""
    value = _get(name)
    if value is None or value == "":
        return default
    if not value.isdigit() or int(value) < minimum:
        kind = "a positive" if minimum == 1 else "a non-negative"
        raise ValueError(f"{name}={value!r}: expected {kind} integer (tokens), e.g. '{default}'")
    return int(value)


def sequence_parallel_min_tokens() -> int:
    """``DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS``: the smallest compile size the sequence-parallel pass rewrites."""
    return _token_count("DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS", SEQUENCE_PARALLEL_MIN_TOKENS, 1)


#: ``DYNAMO_ONCE_NATIVE_OPS_ABOVE``'s default: the decode sizes where the fp8 8B's step measured faster with the
#: library's kernels reach 32 tokens, native code led at 128 (README "Graph passes"); 64 between, not measured.
NATIVE_OPS_ABOVE = 64


def native_ops_above() -> int:
    """``DYNAMO_ONCE_NATIVE_OPS_ABOVE``: pass ``native_ops`` rewrites compiles of more tokens than this."""
    return _token_count("DYNAMO_ONCE_NATIVE_OPS_ABOVE", NATIVE_OPS_ABOVE, 0)


def async_tp() -> bool:
    """``DYNAMO_ONCE_ASYNC_TP``: whether the sequence-parallel GEMM + collective ops take torch's fused symmetric-memory
    kernels on CUDA (read at every call: the ops are opaque)."""
    return _bool("DYNAMO_ONCE_ASYNC_TP", True)
