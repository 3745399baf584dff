"""``PassConfig``: which of the library's post-grad graph passes run at levels 3-4.

A leaf module (it imports nothing from the package) so that ``dispatcher.envs``
can parse ``DYNAMO_ONCE_PASSES`` into it without importing the config that reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["PassConfig"]


#: Each pass's default: off but ``gemm_act_quant``'s, ``gated_linear``'s and ``small_m_linear``'s. Measured on the H200 (README "Graph passes"; Llama 3 8B bf16, fp8 and int8 decode
#: and a 2048-token prefill at level 3): against native code with no pass (Inductor fuses the add, the norm and
#: the quantization itself), the custom ops with every pass were slower for fp8 at every batch size and for int8
#: but at batch 1, 0.7-1.8% faster for bf16 at batch 1-32 (about the runs' noise) and slower at 128, and the
#: quantization passes, which keep the Triton ops opaque, slowed the fp8 prefill by 45%.
#: ``act_quant``'s native per-token patterns (custom ops off) were within 0.4% of native code at int8 decode batch
#: 1-128 and a 2048-token prefill (``benchmarks/results/act_quant_native_*``): off too.
#: ``gemm_act_quant``: on. With native code otherwise (the default), in two H200 runs of the 8B decode step
#: (README "Graph passes", ``benchmarks/results/passes_{gated_,}decode_*``): int8 1.1-2.3% / 3.5-3.6% / 1.3-2.1%
#: faster at batch 1 / 8 / 32 and within 0.8% at 128, fp8 0-0.8% faster at 1, 8 and 128 and 2.9% faster at 32 in
#: the second run (the first, with the gated form at 17-32 tokens, now the unfused pair, had it 2.2% slower);
#: a 2048-token prefill within 1.5%. A graph without a W8A8 GEMM never traces its patterns.
#: ``DYNAMO_ONCE_PASSES`` (e.g. ``all``) or ``PassConfig(...)`` turns them on. A W8A8 checkpoint's model on CUDA turns
#: on ``noop``, ``fused_add_rms_norm``, ``rms_norm_quant`` and ``act_quant`` with the custom ops where they are left
#: at this default (``models.compile_defaults``: with the library's kernels launched with PDL, measured faster).
#: ``native_ops``: off until measured (written for the fp8 8B's batch-128 step, where native code led by 1.0-1.7%).
#: ``sequence_parallel``: off until measured (issue 17: a 2048-token prefill at TP=2 against plain TP=2).
#: ``gated_linear``: on. Measured on an H100 only (no H200 was lent; ``benchmarks/results/gatedlin_*_h100*``), the bf16
#: decode step with it against level 3 without: Llama-3.2-1B at batch 1 20.5 / 50.7 / 31.1 µs faster in three of four
#: runs (12.2 slower in the fourth; ~2% of 1109-1131 µs), Llama-3-8B 12.5-57.2 µs faster in all four (~0.6%); at
#: batch 8, with the unfused activation launched without PDL, 7.0 / 3.5 µs slower (0.5% / 0.06%: within the
#: level-3 runs' own 1341-1351 spread); a 2048-token prefill within that machine's noise (its two level-3 runs of the
#: 1B differ by 46%). ``rope_linear``: off. With it too the batch-1 steps were no faster (1B 1092.3 against 1088.5
#: µs, 8B 5509.4 against 5464.6) and batch 8 1.5-1.7% slower (``gatedlin_decode_*_h100_v2.md``).
#: ``quant_gemm``: off. On the H200 the quantizing GEMV made the fp8 8B's batch-1 step slower: 2713.2 against
#: 2683.6 µs with native code, 2716.9 against 2662.6 with the custom ops and every other pass
#: (``benchmarks/results/quant_gemm_decode_llama-3-8b-fp8.md``); at more tokens it runs the same two kernels.
#: ``norm_linear``: off until measured (written with no GPU lent: the residual add and norm before each QKV and
#: gate-up GEMV of a bf16 decode step at one token, 2 of its ~8 kernels a layer, run in that GEMV's programs).
#: ``small_m_linear``: on; with the M = 1 rows of the unrolled GEMV it made the H200's bf16 decode step at batch 1
#: 7% (8B) and 13% (1B) faster, batch 8 2-4%, and a 2048-token prefill no slower (README "Decode kernels",
#: ``benchmarks/results/small_m_linear_default_ab.md``); before those rows the 8B was 1.0-1.4% slower with it.
DEFAULT_ON: dict[str, bool] = {"noop": False, "fused_add_rms_norm": False, "rms_norm_quant": False,
                               "act_quant": False, "gemm_act_quant": True, "quant_gemm": False,
                               "sequence_parallel": False,
                               "gated_linear": True, "rope_linear": False, "small_m_linear": True, "norm_linear": False,
                               "native_ops": False}


@dataclasses.dataclass(frozen=True)
class PassConfig:
    """One field per pass of ``dispatcher.passes``, in the order they run: True on, False off, None the
    pass's default (:data:`DEFAULT_ON`; a pass that is on still runs only where the ops it produces are
    registered). The passes run at levels 3-4 only.

    Passes added by a plugin (``dispatcher.plugins.add_post_grad_pass``) run while added; this switch
    does not name them.
    """

    noop: bool | None = None
    """Remove views, reshapes and slices to the shape they already have: they hide patterns from the fusions."""
    fused_add_rms_norm: bool | None = None
    """A residual add followed by an RMSNorm of the sum -> one ``dynamo_once::fused_add_rms_norm`` (or Gemma's)."""
    rms_norm_quant: bool | None = None
    """RMSNorm (plain or fused-add) + fp8 / int8 quantization (static or per token) -> one fused op. Keeps the
    library's Triton ops opaque in the compile (see ``dispatcher.passes.quant_fusion``)."""
    act_quant: bool | None = None
    """SiLU- / GELU-and-mul + fp8 / int8 quantization -> one fused op. Keeps the Triton ops opaque, as above;
    with the custom ops off it also matches the native form of a per-token quantization (see
    ``dispatcher.passes.quant_fusion``)."""
    gemm_act_quant: bool | None = None
    """A W8A8 gate-up GEMM + the SiLU-and-mul and static or per-token quantization of its output -> one op whose
    GEMM computes the activation and the quantization (static) or the rows' amax (per token) in its epilogue, at the
    token counts where that measured faster (see ``dispatcher.passes.gemm_act_quant``; matches the native forms,
    and with the custom ops on ``act_quant``'s fused op, so there it needs ``act_quant`` too)."""
    quant_gemm: bool | None = None
    """A static fp8 quantization of a graph input (a piece's: the attention's output) + the W8A8 GEMM reading it ->
    ``dynamo_once::static_quant_scaled_mm``, whose GEMV quantizes as it loads at one token (see
    ``dispatcher.passes.quant_gemm``; matches the native forms, and the quantization op with the custom ops on)."""
    sequence_parallel: bool | None = None
    """Tensor parallel: all-reduce + fused-add RMSNorm -> reduce-scatter, the norm on this rank's tokens,
    all-gather, the GEMMs fused with their collectives, in per-size compiles of at least
    ``DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS`` tokens (see ``dispatcher.passes.sequence_parallel``; matches
    the fused-add op: with native code, also turn on ``fused_add_rms_norm``)."""
    gated_linear: bool | None = None
    """bf16 / fp16 gate-up GEMM + SiLU-and-mul -> ``dynamo_once::gated_linear``: one small-M kernel with the
    activation in its epilogue at the decode sizes ``ops.small_m_gemm.GATED_ROWS`` covers, the unfused pair elsewhere
    (see ``dispatcher.passes.gated_linear``; before ``small_m_linear``, which would take the GEMM)."""
    rope_linear: bool | None = None
    """bf16 / fp16 merged QKV GEMM + the rotary embedding of its q and k -> ``dynamo_once::rope_linear``: one GEMV with
    the rotation in its epilogue at one token, the GEMM and the rotary kernel in place elsewhere (see
    ``dispatcher.passes.rope_linear``; before ``small_m_linear``, which would take the GEMM)."""
    small_m_linear: bool | None = None
    """bf16 / fp16 linear layers' GEMMs -> ``dynamo_once::linear``: the library's small-M Triton GEMM at decode
    sizes (M <= 16) on the shapes where it is faster than cuBLAS, cuBLAS elsewhere (see
    ``dispatcher.passes.small_m_linear``)."""
    norm_linear: bool | None = None
    """A residual add + RMSNorm + the bf16 / fp16 linear op reading it (``small_m_linear``'s or ``gated_linear``'s) ->
    ``dynamo_once::norm_linear``: one GEMV at one token that adds and normalizes its activation row itself, the
    fused-add norm op and the linear op elsewhere (see ``dispatcher.passes.norm_linear``; after the passes making
    the linear ops)."""

    native_ops: bool | None = None
    """Compiles of more than ``DYNAMO_ONCE_NATIVE_OPS_ABOVE`` tokens: every library op with a registered native form
    (the norms, activations, quantizations, and the fused ops the passes above made) -> that form, which Inductor
    fuses itself (see ``dispatcher.passes.native_ops``); smaller and symbolic compiles keep the ops. Runs last."""

    def __post_init__(self) -> None:
        for name in self.names():
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"PassConfig.{name}: expected True, False or None; got {value!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The library's passes, in the order they run."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def enabled(self, name: str) -> bool:
        """Whether pass ``name`` runs: its setting, else its default."""
        value = self.switch(name)
        return DEFAULT_ON[name] if value is None else value

    def switch(self, name: str) -> bool | None:
        """The setting of pass ``name`` (None: its default)."""
        if name not in self.names():
            raise ValueError(f"PassConfig: unknown pass {name!r}; the passes are: {', '.join(self.names())}")
        return getattr(self, name)

    def token_string(self) -> str:
        """The settings as switch tokens, e.g. ``"-noop,+fused_add_rms_norm"`` (empty: every default)."""
        return ",".join(("+" if v else "-") + n for n in self.names() if (v := getattr(self, n)) is not None)

    @classmethod
    def parse(cls, tokens: str | Sequence[str]) -> PassConfig:
        """A config from switch tokens: ``all`` / ``none`` (every pass on / off), then ``+name`` / ``-name``
        (one pass on / off); passes not named keep their default. ``tokens`` may be one comma-separated string.

        Raises:
            ValueError: both ``all`` and ``none``, or either twice; a pass both ``+`` and ``-``; an unknown
                pass; a token that is none of ``all``, ``none``, ``+name``, ``-name``.
        """
        if isinstance(tokens, str):
            tokens = tokens.split(",")
        names = cls.names()
        allowed = f"'all', 'none', '+name' or '-name' (comma-separated) with a name among: {', '.join(names)}"
        base: str | None = None
        settings: dict[str, bool] = {}
        for raw in tokens:
            tok = raw.strip()
            if not tok:
                continue
            if tok in ("all", "none"):
                if base is not None:
                    raise ValueError(f"{tok!r} after {base!r}: give one of 'all' and 'none', once; expected {allowed}")
                base = tok
                continue
            sign, name = tok[:1], tok[1:]
            if sign not in ("+", "-") or name not in names:
                raise ValueError(f"bad token {raw.strip()!r}; expected {allowed}")
            if settings.get(name, sign == "+") != (sign == "+"):
                raise ValueError(f"pass {name!r} is both enabled ('+') and disabled ('-')")
            settings[name] = sign == "+"
        if base is not None:
            settings = {n: settings.get(n, base == "all") for n in names}
        return cls(**settings)
