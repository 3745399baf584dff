"""The paged decode attention kernel's launch configurations: :class:`DecodeConfig` and the rule table that
picks one per decode batch (:data:`DECODE_TABLE`, :func:`decode_config`).

A decode step captured in a CUDA graph per batch size must launch the same grid at every replay, whatever the
sequences' lengths then are, so a rule looks at nothing but the batch size (and the head size, which is the
model's): the split count, tile and launch options come from the number of sequences alone.

``benchmarks.attention --sweep`` times candidate configs on Llama-3-8B's decode shapes (32 query heads, 8 KV
heads, head size 128, bf16 KV, 16-token pages) at batch 1, 8, 32 and 128 and contexts 512-4096, and prints the
best config per batch as table rows: editing :data:`DECODE_TABLE` with them is all a retune takes.
"""

from __future__ import annotations

import dataclasses

from .triton_utils import cdiv, next_power_of_2

__all__ = ["DecodeConfig", "DecodeRule", "DECODE_TABLE", "DECODE_TABLE_FP8", "decode_config", "config_fields"]


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """One launch configuration of the split-KV decode kernel (``ops.paged_attention``).

    Attributes:
        num_splits: programs per (sequence, KV head), each over a contiguous share of the sequence's pages; a
            power of two (the merge kernel reduces over them in one block). None: from ``waves``.
        waves: with ``num_splits`` None, splits so that the split kernel's programs (``batch x KV heads x
            splits``) cover about ``waves`` times the SMs, rounded up to a power of two, at most ``max_splits``.
        max_splits: the ``waves`` rule's ceiling.
        BLOCK_N: tokens a loop step (at least one page: the plan raises it to the page size).
        num_warps, num_stages: the split kernel's launch options (Triton's defaults are 4 and 3). Below 5 stages
            Triton 3.6 gives the loop's K and V tiles one shared-memory buffer each (the block-table load their
            addresses come from takes the first stages), 5-6 two, 7 three; the deeper forms were no faster alone
            at batch 32 x 512 tokens nor in the 8B's step (results/attention_variants_stages_h100.md,
            gemm_step_ab_attn_stages_h100_summary.md).
        merge_warps: the merge kernel's warps (one program per sequence and query head).
        heads_first: the split kernel's grid is (KV heads, sequences, splits) instead of (sequences, KV heads,
            splits): programs launched together then read the same tokens' rows of every KV head (adjacent in the
            cache) rather than the same head of different sequences. A runtime flag: no compile of its own.
        fused_merge: with more than one split, no merge kernel: the last split of each (sequence, KV head) to
            finish merges them (an arrival counter in the plan's workspace, reset by that program); one launch
            instead of two. Off, or with no counters to use (a CUDA-graph capture that would have to allocate
            them): the merge kernel.
        fused_write: the decode kernel also writes the decode sequences' new keys and values to the cache (the
            caller's separate cache-write launch then covers the other tokens only; none in a decode-only step),
            when the caller passes them (``paged_decode_launch``'s ``new_kv``).
        convert_v: over an fp8 cache (on a GPU), each value tile converted to fp16 as loaded, by an opaque
            ``cvt`` (``ops.kv_quant.f16_from_e4m3``), before the shared-memory round trip the MMA's transposed
            operand takes: Triton otherwise converts after it and gathers the fp8 tile a byte at a time. In sm_90
            code compiled on the CPU that takes the minimal kernel's loop from 5.96 to 9.68 cache elements a warp
            instruction (bf16's: 9.67; ``benchmarks.attention_instructions``). On in :data:`DECODE_TABLE_FP8`'s rows
            for 2-128 sequences: on the H200 the sweep's fastest config had it at every batch-8 to batch-128 shape.
            The same values either way (the instruction Triton's conversion emits).
        pdl: launch the split kernel with programmatic dependent launch where :class:`~ops.paged_attention.DecodePlan`
            allows it (``ops.triton_utils.pdl_available``, and a grid of at most two programs an SM, all resident
            at once): its programs wait for the kernel before them, then let the next one launch. In a decode step
            that hides the launch latency of the attention kernel and of the o projection's GEMV after it
            (``DYNAMO_ONCE_PDL=0`` turns PDL off everywhere).
        preload: with ``fused_write`` (where no slot the kernel reads is written in the step before it), each
            program loads its split's first chunk of K and V, with the sequence's length and block-table entries,
            before it waits for the kernel before (with ``pdl``), so that their latency overlaps that kernel's end
            rather than following it. Without ``fused_write``, nothing: the cache-write launch before the kernel
            writes the new token's slot, which the first chunk may hold. The same results. Off in every row: on an
            H100 it made the 1B's level-3 step at batch 1 3% slower (results/gemm_step_ab_preload_1b_h100.md).

    Both fusions are off in the dataclass and on in :data:`DECODE_TABLE`'s rows up to 8 sequences, where the sweep
    of the current kernels measured them fastest, the write up to 32; not above: measured on the H200 (llama-3-8b,
    level-3 whole-step graph, context 512, ``benchmarks.kernel_profile``) an earlier fused write made the split kernel 112 µs a layer
    at batch 128 against 72 without it; the current one, on the row above 32 sequences, made the 8B's step 2.98% /
    0.88% slower at batch 64 / 128 on an H100 (results/gemm_step_ab_attn_fused_write_b128_h100_summary.md). The one
    row above 32 with the write fused is Llama-3.2-1B's 64-size heads' at 65-128 sequences, the d64 sweep's pick.
    """

    num_splits: int | None = None
    waves: int = 2
    max_splits: int = 32
    BLOCK_N: int = 64
    num_warps: int = 4
    num_stages: int = 3
    merge_warps: int = 4
    heads_first: bool = False
    fused_merge: bool = False
    fused_write: bool = False
    convert_v: bool = False
    pdl: bool = True
    preload: bool = False

    def __post_init__(self) -> None:
        for name in ("max_splits", "BLOCK_N", "num_warps", "merge_warps") + (("num_splits",) if self.num_splits else ()):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"DecodeConfig: {name} must be a power of two; got {v}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"DecodeConfig: num_splits must be a power of two or None; got {self.num_splits}")
        if self.waves < 1 or self.num_stages < 1:
            raise ValueError(f"DecodeConfig: waves and num_stages must be >= 1; got {self}")

    def splits(self, num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
        """Splits per sequence for a batch of ``num_seqs`` on a device of ``num_sms`` SMs."""
        if self.num_splits is not None:
            return self.num_splits
        want = cdiv(self.waves * num_sms, max(num_seqs * num_kv_heads, 1))
        return max(1, min(self.max_splits, next_power_of_2(want)))


@dataclasses.dataclass(frozen=True)
class DecodeRule:
    """One row of :data:`DECODE_TABLE`: decode batches of at most ``max_seqs`` sequences with heads of at most
    ``max_head_size`` take ``config``."""

    max_seqs: int
    max_head_size: int
    config: DecodeConfig


_ANY = 1 << 30
_C, _R = DecodeConfig, DecodeRule
#: The rule for more than 32 sequences (head sizes up to 128; Llama-3.2-1B's 64-size heads at 33-64 too).
_B128 = _C(waves=1, BLOCK_N=64, num_warps=4, num_stages=3, heads_first=True)
#: The first rule that fits wins. Head sizes up to 128: ``benchmarks.attention --sweep``'s suggested rows, measured
#: on the H200 (torch 2.11, Triton 3.6; results/attention_sweep_best.md: Llama-3-8B's heads, contexts 512-4096; the
#: comments: µs at contexts 512 and 4096, this row / the rule before the table: two waves of programs, 64-token
#: steps, 4 warps, 3 stages). Batches 9-32 and above 32 take one wave (one split from 17 sequences on), as the
#: sweep's 1-split picks at 32 and 128 do. Larger heads (Gemma 2's 256): the rule before the table, untuned.
DECODE_TABLE: tuple[DecodeRule, ...] = (
    # Batches up to 8: one launch a layer (fused merge and write). The sweep with the fused forms
    # (results/attention_sweep_fused_best.md) found a fused form fastest at every batch-1 and batch-8 shape, 1.02-1.31x
    # the unfused row's time; these rows are its picks at 1024 tokens (batch 1: 7.57 µs against 8.58) and 512 (batch 8:
    # 11.38 against 12.91). Measured after (results/attention.md against attention_before_fused_rows.md): batch 1
    # 6.72 / 14.27 µs at 512 / 4096 tokens against 8.01 / 15.87; batch 8 11.47 / 45.5 against 12.93 / 43.3. One launch
    # instead of three also saves two kernel nodes a layer in a whole-step graph and two launches' host time a layer
    # on the piecewise path.
    _R(1, 128, _C(num_splits=16, BLOCK_N=64, num_warps=4, num_stages=2, fused_merge=True, fused_write=True)),
    # Llama-3.2-1B's heads (64): batches 2-8 take 64-token steps (results/attention_sweep_best_d64.md, ``--head-size
    # 64``: 8.91 / 11.37 µs at contexts 512 / 1024 against the 128-size row's 9.65 / 13.22); batch 1 keeps the row
    # above (its 6.0 / 6.66 µs were the sweep's fastest there).
    _R(8, 64, _C(num_splits=8, BLOCK_N=64, num_warps=4, num_stages=2, fused_merge=True, fused_write=True)),
    _R(8, 128, _C(num_splits=8, BLOCK_N=32, num_warps=4, num_stages=2, fused_merge=True, fused_write=True)),
    # Batches 9-32 write the decodes' keys and values in the decode kernel too (fused_write: one launch a layer, two
    # with a split merge kernel at 9-16): the fused sweep's pick at 512 and 1024 tokens (24.66 / 41.5 µs against the
    # table's 25.03 / 41.97, results/attention_sweep_fused_best.md).
    _R(32, 128, _C(waves=1, BLOCK_N=128, num_warps=4, num_stages=3, heads_first=True, fused_write=True)),
    # Llama-3.2-1B's heads (64) at 65-128 sequences: 32-token steps on 2 warps, one split, the write fused, the
    # d64 sweep's pick at batch 128 (results/attention_sweep_best_d64_b32_128_h100.md: 52.05 µs at 512 tokens against
    # the 128-size row's 63.34, attention_d64_before_b128_row_h100.md; 1.004x the fastest on average over 512-4096).
    # The 1B's step at batch 128 2095.1 / 2137.9 µs against 2350.1 / 2350.0, at 64 slower (1752.9 / 1777.6 against
    # 1699.9 / 1690.2; H100, results/gemm_step_ab_1b_both_h100.md), so 33-64 keep the 128-size row (repeated here).
    # At 9-32 the sweep's pick was the 128-size row's tile (and no faster in the step: variant attn,
    # gemm_step_ab_1b_narrow_attn_h100.md).
    _R(64, 64, _B128),
    _R(128, 64, _C(num_splits=1, BLOCK_N=32, num_warps=2, num_stages=3, fused_write=True)),
    _R(_ANY, 128, _B128),  # b128: 72.74 / 72.74, 489.86 / 493.12
    _R(_ANY, _ANY, _C(waves=2, BLOCK_N=32, num_warps=4, num_stages=3)),
)
#: The rules for an fp8 cache (``ops.kv_quant``: half the bytes a token, fp16 dots): ``benchmarks.attention
#: --kv-cache-dtype fp8 --sweep``'s suggested rows at batch 8, 32 and 128, every one with ``convert_v``
#: (results/attention_sweep_best_kvfp8_convert_v.md; comments: µs at contexts 512 and 4096, this row / the rows
#: before, which converted after the shared-memory round trip: that file's table_us; every candidate's µs:
#: results/attention_sweep_kvfp8_convert_v.csv). Converting each value tile as loaded took 8-22% off (most at
#: batch 128 and long contexts). The kernel still does not read an fp8 cache at its bytes' speed: 59-71% of the
#: copy bandwidth at batch 128 in that sweep (48-57% with the rows before: results/attention_kvfp8_before_convert_v.md;
#: its bf16 reads: 85-92%). Batch 1: the bf16 row (the sweep's two batch-1 shapes disagreed on ``convert_v``).
DECODE_TABLE_FP8: tuple[DecodeRule, ...] = (
    DECODE_TABLE[0],
    _R(8, 128, _C(num_splits=4, BLOCK_N=128, num_warps=4, num_stages=3, fused_merge=True, fused_write=True,
                  convert_v=True)),  # 10.05 / 36.3, 11.4 / 39.44
    _R(32, 128, _C(waves=1, BLOCK_N=128, num_warps=4, num_stages=3,
                   convert_v=True)),  # b32: 20.16 / 112.96, 22.1 / 133.47
    _R(_ANY, 128, _C(waves=1, BLOCK_N=64, num_warps=2, num_stages=3, fused_merge=True, fused_write=True,
                     convert_v=True)),  # b128: 55.17 / 363.46, 66.53 / 466.3
    DECODE_TABLE[-1],
)
del _C, _R, _B128


def decode_config(num_seqs: int, head_size: int, kv_fp8: bool = False) -> DecodeConfig:
    """The table's config for a decode batch of ``num_seqs`` sequences and heads of ``head_size``; ``kv_fp8``: of
    :data:`DECODE_TABLE_FP8`, for an fp8 cache."""
    for rule in DECODE_TABLE_FP8 if kv_fp8 else DECODE_TABLE:
        if num_seqs <= rule.max_seqs and head_size <= rule.max_head_size:
            return rule.config
    return DecodeConfig()  # past every row (the table's last row covers everything): the dataclass's defaults


def config_fields(text: str) -> dict[str, int | bool | None]:
    """``FIELD=VALUE,...`` (a benchmark's command line: ``BLOCK_N=64,num_stages=4``) as :class:`DecodeConfig` fields:
    integers, a bool field 0 or 1, ``none`` where the field may be None. ValueError naming the item and ``text``."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(DecodeConfig)}
    pairs = [item.partition("=") for item in text.split(",")]
    if not text or any(not sep for _, sep, _ in pairs):
        raise ValueError(f"DecodeConfig fields must be FIELD=VALUE, comma-separated; got {text!r}")
    fields: dict[str, int | bool | None] = {}
    for name, _, value in pairs:
        if name not in kinds:
            raise ValueError(f"a DecodeConfig field must be one of {', '.join(kinds)}; got {name!r} in {text!r}")
        if kinds[name] == "bool":
            if value not in ("0", "1"):
                raise ValueError(f"DecodeConfig's {name} must be 0 or 1; got {value!r} in {text!r}")
            fields[name] = value == "1"
        elif value == "none" and "None" in kinds[name]:
            fields[name] = None
        elif value.isdigit():
            fields[name] = int(value)
        else:
            raise ValueError(f"DecodeConfig's {name} must be a non-negative integer; got {value!r} in {text!r}")
    return fields
