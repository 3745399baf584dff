"""The quantization fusions (``rms_norm_quant``, ``act_quant``) on W8A8 Llama checkpoints at level 3.

A quantized Llama layer quantizes three inputs that an op of its own has just written: the input norm's
(QKV), the post-attention norm's (gate-up), the SiLU-and-mul's (down); the fourth, o_proj's, is the
attention's output. With the custom ops on, each norm, activation and quantization is one op, and the
passes fuse the first three pairs: per layer 2 ``rms_norm_quant`` rewrites (layer 0's input norm has no
residual to add: the plain norm; the others the fused-add one) and 1 ``act_quant``; o_proj's quantization
stays. On the CPU a module calls its op only when its ``forward_cpu`` does what ``forward_cuda`` does
(the ops then run their fp32 references), as the fixture sets up. Every compile runs in a fresh Inductor
cache: a graph loaded from the FX graph cache runs no pass.
"""

import pytest
import torch

import ops
from dispatcher import CompilationConfig, compat
from dispatcher.passes import ActQuantPass, GemmActQuantPass, RMSNormQuantPass, pass_counter
from models import LLM

from models_testing import PROMPTS, save_hf_llama
from pass_testing import counted_after
from quant_testing import FLIP_ATOL, assert_logits_match, cuda_prefill_logits, prefill_logits, save_quantized

D = torch.ops.dynamo_once
# scheme -> (its quantization op, the fused ops the passes make of it with a norm, a fused-add norm, SiLU)
SCHEMES = {
    "fp8-static": (D.static_scaled_fp8_quant, "static"),
    "fp8-dynamic-token": (D.dynamic_per_token_scaled_fp8_quant, "dynamic"),
    "int8-static": (D.static_scaled_int8_quant, "static"),
    "int8-dynamic-token": (D.dynamic_scaled_int8_quant, "dynamic"),
}
UNQUANTIZED_DOWN = {"fp8-dynamic-token": 1}  # its checkpoint leaves layer 1's down_proj in bf16 (quant_testing)


def fused_ops(kind):
    return (getattr(D, f"rms_norm_{kind}_quant").default, getattr(D, f"fused_add_rms_norm_{kind}_quant").default,
            getattr(D, f"act_and_mul_{kind}_quant").default)


@pytest.fixture
def after():
    """Call targets' counts of the graphs after the last quant fusion, over every piece."""
    with counted_after("act_quant") as counts:
        yield counts


@pytest.fixture
def op_path(monkeypatch):
    """The modules call their ops on the CPU too, as they do on CUDA (the ops run their references)."""
    for cls in (ops.RMSNorm, ops.SiluAndMul, ops.QuantFP8, ops.QuantInt8):
        monkeypatch.setattr(cls, "forward_cpu", cls.forward_cuda)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(scheme, layers) -> a tiny W8A8 Llama checkpoint's directory."""
    cache = {}

    def get(name, layers=2):
        if (name, layers) not in cache:
            hf = save_hf_llama(tmp_path_factory.mktemp(f"hf{layers}"), num_hidden_layers=layers)
            path = tmp_path_factory.mktemp(f"{name}_{layers}")
            save_quantized(path, hf, name, PROMPTS)
            cache[name, layers] = str(path)
        return cache[name, layers]

    return get


def run(path, passes, opaque=False):
    """Prefill logits of PROMPTS at level 3, every custom op on, and the passes' counts. ``opaque``: keep the
    library's ops opaque without the passes too (which is what the passes' compiles do), to count them."""
    cfg = CompilationConfig(level=3, custom_ops=["all"], use_cudagraph=False, pass_config=passes)
    with compat.fresh_inductor_cache(), compat.triton_ops_decomposed(not opaque), pass_counter.record() as counts:
        llm = LLM(path, max_num_tokens=32, compilation_config=cfg)
        logits = prefill_logits(llm, PROMPTS)
    return logits, counts


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_fusions_replace_every_norm_and_activation_quant(checkpoint, op_path, after, name):
    """Per layer: 2 norm + quant and 1 SiLU + quant fused; only o_proj's quantization left. The logits are
    those of the unfused graph (the fused ops' values are the unfused ops'; the rest differs in fp32 rounding
    only: the reference's tolerances apply)."""
    torch._dynamo.reset()
    unfused, _ = run(checkpoint(name), "none", opaque=True)
    counted_unfused = dict(after)
    after.clear()
    torch._dynamo.reset()
    fused, counts = run(checkpoint(name), "all")
    quant, kind = SCHEMES[name]
    norm_quant, add_norm_quant, act_quant = fused_ops(kind)
    layers, plain_down = 2, 2 - UNQUANTIZED_DOWN.get(name, 0)
    assert counted_unfused[quant.default] == 3 * layers + plain_down  # qkv, o, gate-up per layer; down
    assert counts.matches["rms_norm_quant"] == 2 * layers and counts.matches["act_quant"] == plain_down
    assert after[norm_quant] == 1 and after[add_norm_quant] == 2 * layers - 1 and after[act_quant] == plain_down
    assert after[quant.default] == layers  # o_proj's
    assert after[D.rms_norm.default] == 0 and after[D.silu_and_mul.default] == layers - plain_down
    assert after[D.fused_add_rms_norm.default] == 1  # the final norm: the LM head is not quantized
    # After the passes, every Triton op left (the fused ones too) is decomposed into its kernels, as without
    # passes: Inductor launches them from its code, not through the dispatcher (the GEMM is an opaque op).
    triton_ops = {name.replace("::", ".") for name in compat.triton_op_names("dynamo_once")}
    left = sum(n for t, n in after.items() if str(t).rsplit(".", 1)[0] in triton_ops)
    # gemm_act_quant takes each fused activation + quant with its gate-up GEMM (an op, not a Triton op)
    assert counts.matches["gemm_act_quant"] == plain_down
    # quant_gemm takes o_proj's static fp8 quantization with its GEMM (an op, not a Triton op); fp8-static only
    taken = counts.matches["quant_gemm"]
    assert taken == (layers if name == "fp8-static" else 0)
    assert counts.matches["decompose_triton_ops"] == left - plain_down - taken == 4 * layers + 1 - plain_down - taken
    # 2 norms, o_proj, SiLU; the last norm
    assert_logits_match(fused, unfused)


@pytest.mark.parametrize("layers", [1, 2])
def test_match_counts_follow_the_layers(checkpoint, op_path, layers):
    """2 norm and 1 activation fusions a layer. From 3 layers on, the pieces between two middle attention
    layers are one graph, which Inductor's caches compile (and the passes rewrite) once: these layer counts
    are those where every compiled piece is distinct."""
    torch._dynamo.reset()
    _, counts = run(checkpoint("int8-static", layers), "none,+rms_norm_quant,+act_quant")
    assert counts.matches["rms_norm_quant"] == 2 * layers and counts.matches["act_quant"] == layers, counts


def test_native_ops_are_left_to_inductor(checkpoint, after):
    """Custom ops off (level 3's default): the norms and quantizations are plain torch code that Inductor
    fuses itself; the passes find no op to match and the library's ops stay out of the graph."""
    torch._dynamo.reset()
    cfg = CompilationConfig(level=3, use_cudagraph=False, pass_config="none,+rms_norm_quant,+act_quant")
    with compat.fresh_inductor_cache(), pass_counter.record() as counts:
        LLM(checkpoint("fp8-static"), max_num_tokens=32, compilation_config=cfg)
    assert counts.runs["rms_norm_quant"] == counts.runs["act_quant"] == 3  # one per piece
    assert not counts.matches["rms_norm_quant"] and not counts.matches["act_quant"]
    library_ops = {str(t) for t in after if str(t).startswith("dynamo_once.")}
    assert library_ops == {"dynamo_once.fp8_scaled_mm.default"}  # the GEMM: an op whatever the switch


def native_run(path, passes, **kwargs):
    """Prefill logits of PROMPTS at level 3 with the custom ops off (the default but for a W8A8 checkpoint on CUDA,
    models.compile_defaults), and the passes' counts."""
    torch._dynamo.reset()
    cfg = CompilationConfig(level=3, custom_ops=["none"], use_cudagraph=False, pass_config=passes)
    with compat.fresh_inductor_cache(), pass_counter.record() as counts:
        llm = LLM(path, max_num_tokens=32, compilation_config=cfg, **kwargs)
        logits = prefill_logits(llm, PROMPTS)
    return logits, counts


@pytest.mark.parametrize("name", ["int8-dynamic-token", "fp8-dynamic-token"])
def test_native_per_token_activation_quant_is_fused(checkpoint, after, name):
    """Custom ops off: a per-token quantization of the SiLU-and-mul's output is plain torch code (the modules'
    native forms, ``dispatcher.passes.native_forms``), whose row amax Inductor computes in reduction kernels of
    their own; ``act_quant`` matches that form and puts the fused op in its place, one per quantized down_proj,
    with the unfused graph's logits. Nothing else is rewritten: the norms' quantizations stay Inductor's."""
    unfused, _ = native_run(checkpoint(name), "none")
    after.clear()
    fused, counts = native_run(checkpoint(name), "none,+act_quant")
    plain_down = 2 - UNQUANTIZED_DOWN.get(name, 0)
    assert counts.matches["act_quant"] == plain_down
    # Decomposed after the passes (on the CPU into the op's reference), as every library Triton op in a graph is.
    assert counts.matches["decompose_triton_ops"] == plain_down
    assert after[D.act_and_mul_dynamic_quant.default] == plain_down
    assert not any(str(t).startswith("dynamo_once.rms_norm") for t in after)
    assert_logits_match(fused, unfused)


# custom ops on: gemm_act_quant takes act_quant's fused op; off: the native forms, without act_quant
GATED_MODES = {"ops": (["all"], "none,+act_quant,+gemm_act_quant"), "native": ([], "none,+gemm_act_quant")}


@pytest.mark.parametrize("name,mode", [(name, "native") for name in sorted(SCHEMES)]
                         + [("int8-dynamic-token", "ops"), ("fp8-static", "ops")])
def test_gate_up_gemm_takes_the_activation_quant(checkpoint, op_path, name, mode):
    """``gemm_act_quant``: the gate-up GEMM, SiLU-and-mul and the quantization of its output (static or per token),
    with the custom ops on and off -> one ``gated_scaled_mm_*_quant`` a quantized MLP, no GEMM, activation or
    quantization op left for it, and the unfused graph's logits (on the CPU the op runs the same references)."""
    custom_ops, passes = GATED_MODES[mode]
    outs = {}
    for p in ("none", passes):
        torch._dynamo.reset()
        cfg = CompilationConfig(level=3, custom_ops=custom_ops, use_cudagraph=False, pass_config=p)
        with compat.fresh_inductor_cache(), pass_counter.record() as counts, counted_after("gemm_act_quant") as after:
            llm = LLM(checkpoint(name), max_num_tokens=32, compilation_config=cfg)
            outs[p] = prefill_logits(llm, PROMPTS)
    plain_down = 2 - UNQUANTIZED_DOWN.get(name, 0)
    assert counts.matches["gemm_act_quant"] == plain_down
    kind = SCHEMES[name][1]
    assert after[getattr(D, f"gated_scaled_mm_{kind}_quant").default] == plain_down
    assert after[getattr(D, f"act_and_mul_{kind}_quant").default] == 0
    gemm = D.int8_scaled_mm.default if name.startswith("int8") else D.fp8_scaled_mm.default
    # 3 a layer: qkv, o and down; or, where down_proj is not quantized (no quantization to take), gate-up
    assert after[gemm] == 3 * 2
    assert torch.equal(outs[passes], outs["none"])


def test_bf16_gate_up_gemm_takes_the_activation_quant(checkpoint):
    """A bf16 model, custom ops off (how the built-in fp8 8B runs): ``gemm_act_quant`` takes each layer's native
    gate-up + SiLU-and-mul + static fp8 quant as Inductor's joint-graph rewrites leave it (torch 2.11 drops the
    SiLU-and-mul's cast back to bf16 before the quantization's cast to fp32; 2.13 keeps it), and the logits stay
    those of the unfused graph up to that rounding."""
    outs = {}
    for p in ("none", "none,+gemm_act_quant"):
        torch._dynamo.reset()
        cfg = CompilationConfig(level=3, use_cudagraph=False, pass_config=p)
        with compat.fresh_inductor_cache(), pass_counter.record() as counts:
            llm = LLM(checkpoint("fp8-static"), max_num_tokens=32, compilation_config=cfg, dtype=torch.bfloat16)
            outs[p] = prefill_logits(llm, PROMPTS).float()
    assert counts.matches["gemm_act_quant"] == 2
    diff = (outs["none,+gemm_act_quant"] - outs["none"]).abs()
    assert diff.max() <= FLIP_ATOL, f"max |diff| {diff.max():.3g}"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["int8-dynamic-token", "fp8-static"])
def test_cuda_gate_up_gemm_takes_the_activation_quant(checkpoint, name):
    """On the GPU, custom ops off, CUDA graphs on: the gated GEMM's values are the GEMM's and the fused activation
    quant's (int8: bit for bit, test_gated_quant.py), so the logits are those of ``act_quant`` (the same fused
    activation quant, after the GEMM op), up to what Inductor's other kernels fused otherwise may flip (bounded as
    in test_quantized's CUDA test). fp8-static: the built-in fp8 models' scheme, whose native form the pass must
    take on the GPU too (an H200 profile of the 8B's default step showed its gate-up unfused)."""
    (ref, _, _), (out, counts, _) = (cuda_prefill_logits(checkpoint(name), p)
                                      for p in ("none,+act_quant", "none,+gemm_act_quant"))
    assert counts.matches["gemm_act_quant"] >= 2  # both layers' gate-up, in every compile
    diff = (out - ref).abs()
    assert diff.max() <= FLIP_ATOL, f"max |diff| {diff.max():.3g}"  # Inductor's other kernels may fuse otherwise


def test_gate_up_gemm_with_ops_needs_act_quant(checkpoint, op_path):
    """With the custom ops on, ``gemm_act_quant`` matches ``act_quant``'s fused op: without it, nothing."""
    torch._dynamo.reset()
    _, counts = run(checkpoint("int8-dynamic-token"), "none,+gemm_act_quant")
    assert counts.runs["gemm_act_quant"] == 3 and not counts.matches["gemm_act_quant"]


@pytest.mark.parametrize("name", ["int8-static", "fp8-static"])
def test_native_static_activation_quant_is_left_to_inductor(checkpoint, name):
    """A static quantization's native form needs no reduction: Inductor fuses it into the activation's kernel
    itself, and ``act_quant`` leaves it."""
    _, counts = native_run(checkpoint(name), "none,+act_quant")
    assert counts.runs["act_quant"] == 3 and not counts.matches["act_quant"]


@pytest.mark.cuda
def test_cuda_native_per_token_activation_quant(checkpoint):
    """On the GPU (CUDA graphs off): the fused kernel in place of Inductor's native per-token quantization gives
    the native graph's logits (an activation an ulp apart can round to an int8 step apart: flips bounded as in
    test_quantized's CUDA test)."""
    outs = {}
    for passes in ("none", "none,+act_quant"):
        outs[passes], counts = native_run(checkpoint("int8-dynamic-token"), passes, device="cuda",
                                          dtype=torch.bfloat16)
    assert counts.matches["act_quant"] >= 2  # both layers' down_proj, in every compile
    diff = (outs["none,+act_quant"].cpu() - outs["none"].cpu()).abs()
    assert diff.max() <= FLIP_ATOL, f"max |diff| {diff.max():.3g}"


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_cuda_fused_kernels_match_the_unfused_ops(checkpoint, name):
    """On the GPU, with CUDA graphs: the fused Triton kernels (the norm's arithmetic, then the quantization's)
    give the unfused kernels' logits, and every norm and activation quantization is fused in every compile."""
    outs = {}
    for passes in ("none", "all"):
        torch._dynamo.reset()
        cfg = CompilationConfig(level=3, custom_ops=["all"], pass_config=passes)
        with compat.fresh_inductor_cache(), pass_counter.record() as counts:
            llm = LLM(checkpoint(name), max_num_tokens=32, compilation_config=cfg, device="cuda", dtype=torch.bfloat16)
            outs[passes] = prefill_logits(llm, PROMPTS).cpu()
    compiles = counts.runs["manager"] / 3  # 3 pieces a compile (symbolic, then any per-size compile)
    plain_down = 2 - UNQUANTIZED_DOWN.get(name, 0)
    assert counts.matches["rms_norm_quant"] == 4 * compiles and counts.matches["act_quant"] == plain_down * compiles
    # bf16, as models run. The fused norm's launch config (concrete rows at run time) may order the sum of squares
    # otherwise than the unfused kernel Inductor launched (symbolic rows): normed values an ulp apart can round to
    # 8-bit values a step apart (fp8: 2**-3 relative), flips bounded as in test_quantized's CUDA test.
    diff = (outs["all"] - outs["none"]).abs()
    assert diff.max() <= FLIP_ATOL, f"max |diff| {diff.max():.3g}"
    rel = (outs["all"] - outs["none"]).norm(dim=-1) / outs["none"].norm(dim=-1)
    assert rel.max() <= 0.1, f"relative difference of the logits per sequence: {rel.tolist()}"


def test_patterns_trace_under_a_bf16_default_dtype():
    """The loader builds a model (and with it the pass manager) under the model's default dtype: the patterns'
    example scales stay fp32, as the quantization ops require."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        for cls in (RMSNormQuantPass, ActQuantPass, GemmActQuantPass):
            p = cls()
            p.prepare()
            # norms: 2 x 2 forms x 4 quants; acts: 3 x 4 as ops, and 3 x 2 per-token quants x 2 dtypes native;
            # gate-up GEMMs: 2 operand dtypes x 3 output dtypes x 4 quants x (native, act_quant's op)
            assert p.num_patterns == {"rms_norm_quant": 16, "act_quant": 24, "gemm_act_quant": 48}[p.name]
    finally:
        torch.set_default_dtype(previous)
