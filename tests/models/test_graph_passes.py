"""The post-grad passes on the reference Llama (the tiny-llama built-in: 2 layers, hidden 64) at level 3.

The Llama fuses each residual add into the next norm itself (``RMSNorm(x, residual)``), so the pass
finds either that fused op, which it leaves alone, or the fused op's native form (custom ops off, or
on the CPU, where a custom op's module runs its native code), which is the add and the norm it fuses.
Every compile runs in a fresh Inductor cache: a graph loaded from the FX graph cache runs no pass.
"""

import pytest
import torch

import ops
from dispatcher import CompilationConfig, PassConfig, compat
from dispatcher.passes import pass_counter
from models import LLM

from pass_testing import counted_after

PROMPTS = [[3, 17, 91, 4, 55, 23, 8], [100, 2], [42]]
FUSED = torch.ops.dynamo_once.fused_add_rms_norm.default
RSQRT = torch.ops.aten.rsqrt.default
PIECES = 3  # 2 attention ops between 3 compiled pieces
FUSED_ADD_NORMS = 4  # layer 0 after attention, layer 1 before and after it, the final norm
# Tolerances, as a fraction of the largest logit. fp32: a fused norm (on the CPU the op's fp32 reference) and
# Inductor's code of the same norm differ only in the order of the sum over the 64 squares, at most 64
# roundings of 2**-24 relative per norm; 5 norms, and the layers between them pass such differences on
# unamplified (weights ~ 1 / sqrt(fan-in)): 5 * 64 * 2**-24 = 1.9e-5 (measured: 2.1e-7). bf16: the same fp32
# values, but each of the 5 norms may then round its output one bf16 ulp (2**-7 relative at most) the other
# way: 5 * 2**-7 = 3.9e-2 (measured: 6.7e-3).
# The passes under test (the quant fusions, also in "all", would keep the norm ops opaque: test_quant_fusion.py).
FUSED_ADD_PASSES = "none,+noop,+fused_add_rms_norm"
TOLERANCE = {torch.float32: 5 * 64 * 2**-24, torch.bfloat16: 5 * 2**-7}


def logits(passes, custom_ops="none", op_path=False, opaque=False, dtype=torch.float32, monkeypatch=None):
    """Every step's logits of a 3-prompt run (each step fed token 7, whatever the logits), and the passes'
    counts. ``op_path``: the norm modules call their ops, as they do on CUDA (not their native code)."""
    if op_path:
        monkeypatch.setattr(ops.RMSNorm, "forward_cpu", ops.RMSNorm.forward_cuda)
    cfg = CompilationConfig(level=3, custom_ops=[custom_ops], use_cudagraph=False, pass_config=passes)
    steps = []

    def choose(seqs, step_logits):
        steps.append(step_logits.clone())
        return [7] * len(seqs)

    with compat.fresh_inductor_cache(), compat.triton_ops_decomposed(not opaque), pass_counter.record() as counts:
        llm = LLM("tiny-llama", max_num_tokens=16, compilation_config=cfg, dtype=dtype)
        llm.run(PROMPTS, 3, choose)
    return torch.cat(steps), counts


@pytest.fixture
def after():
    """Call targets' counts of the graphs after the fused-add pass, over every piece."""
    with counted_after("fused_add_rms_norm") as counts:
        yield counts


@pytest.fixture(scope="module")
def pass_free():
    """dtype -> the logits with every pass off (custom ops off); set up before any test's plugin pass."""
    out = {}
    for dtype in TOLERANCE:
        torch._dynamo.reset()
        out[dtype], counts = logits("none", dtype=dtype)
        assert counts.runs["manager"] == PIECES and not counts.matches  # the manager runs, with no pass
    return out


def assert_close(got, ref, dtype):
    """``got`` and ``ref`` (fp32 logits of a model in ``dtype``) within ``TOLERANCE[dtype]`` of the largest."""
    torch.testing.assert_close(got, ref, rtol=0, atol=TOLERANCE[dtype] * ref.abs().max().item())


@pytest.mark.parametrize("opaque, matches", [(True, 0), (False, FUSED_ADD_NORMS)])
def test_llama_calling_the_fused_op(pass_free, after, monkeypatch, opaque, matches):
    """Custom ops on, the norms calling ``dynamo_once::fused_add_rms_norm``. Kept opaque (as without Triton;
    on CUDA, Triton decomposes the op into its kernel, which no pattern matches either), the pass finds
    nothing to fuse. Decomposed on the CPU, the op's body is its reference, the add and the norm the pass
    fuses back into the op."""
    out, counts = logits(FUSED_ADD_PASSES, custom_ops="all", op_path=True, opaque=opaque, monkeypatch=monkeypatch)
    assert counts.runs["manager"] == counts.runs["fused_add_rms_norm"] == PIECES
    assert counts.matches["fused_add_rms_norm"] == matches
    # the 4 fused norms, and layer 0's norm of the embeddings: the op (opaque) or its reference's rsqrt
    assert after[FUSED] == FUSED_ADD_NORMS
    assert after[torch.ops.dynamo_once.rms_norm.default] == int(opaque) and after[RSQRT] == int(not opaque)
    assert_close(out, pass_free[torch.float32], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_native_norms_are_fused(pass_free, after, dtype):
    """Custom ops off (level 3's default): the norms' native code, the add and the norm apart (fp32: an
    ``addmm`` of the residual on the CPU; bf16: the add of fp32 upcasts)."""
    out, counts = logits(FUSED_ADD_PASSES, dtype=dtype)
    assert counts.matches["fused_add_rms_norm"] == FUSED_ADD_NORMS
    assert after[FUSED] == FUSED_ADD_NORMS and after[RSQRT] == 1  # left: layer 0's norm of the embeddings
    assert_close(out, pass_free[dtype], dtype)


LINEAR = torch.ops.dynamo_once.linear.default
LINEARS = 8  # 2 layers x (qkv, o, gate_up, down); the lm_head runs outside the compiled graph


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_linears_take_the_small_m_op(pass_free, dtype):
    """bf16: every linear layer's GEMM becomes ``dynamo_once::linear`` (on the CPU it is ``F.linear``: the same
    logits bit for bit); fp32, which the op does not take, keeps its GEMMs."""
    with counted_after("small_m_linear") as after:
        out, counts = logits("none,+small_m_linear", dtype=dtype)
    assert counts.runs["small_m_linear"] == PIECES
    expected = LINEARS if dtype == torch.bfloat16 else 0
    assert counts.matches["small_m_linear"] == after[LINEAR] == expected
    assert after[torch.ops.aten.mm.default] + after[torch.ops.aten.addmm.default] == LINEARS - expected
    assert torch.equal(out, pass_free[dtype])


def cuda_logits(passes, prompts):
    """Every step's logits (fp32, on the CPU) of a bf16 tiny-llama on the GPU at level 3 (whole-step graphs for the
    decode steps) with ``passes``, each step fed token 7, and the passes' match counts."""
    torch._dynamo.reset()
    cfg = CompilationConfig(level=3, pass_config=passes)
    steps = []

    def choose(seqs, step_logits):
        steps.append(step_logits.float().cpu())
        return [7] * len(seqs)

    with compat.fresh_inductor_cache(), pass_counter.record() as counts:
        llm = LLM("tiny-llama", max_num_tokens=64, compilation_config=cfg, dtype=torch.bfloat16, device="cuda")
        llm.run(prompts, 4, choose)
    return torch.cat(steps), counts.matches


@pytest.mark.cuda
def test_llama_small_m_linear_on_cuda():
    """On the GPU the steps' GEMMs run the small-M kernel at decode sizes (whole-step graphs) and cuBLAS for the
    prompts: the logits within the bf16 tolerance of the pass-free model's."""
    (ref, none), (out, matched) = (cuda_logits(p, PROMPTS) for p in ("none", "none,+small_m_linear"))
    assert none["small_m_linear"] == 0 and matched["small_m_linear"] >= LINEARS
    assert_close(out, ref, torch.bfloat16)


GATED = torch.ops.dynamo_once.gated_linear.default
GATE_UPS = 2  # one a layer
ROPE = torch.ops.dynamo_once.rope_linear.default
QKVS = 2  # one a layer


def test_llama_gate_up_and_activation_take_the_gated_op(pass_free):
    """Custom ops off: bf16's gate-up GEMM and the native SiLU-and-mul after it become ``dynamo_once::gated_linear``
    (on the CPU, ``F.linear`` then the activation's reference: within the bf16 tolerance of Inductor's code for the
    pair)."""
    with counted_after("gated_linear") as after:
        out, counts = logits("none,+gated_linear", dtype=torch.bfloat16)
    assert counts.runs["gated_linear"] == PIECES
    assert counts.matches["gated_linear"] == after[GATED] == GATE_UPS
    assert after[torch.ops.aten.mm.default] + after[torch.ops.aten.addmm.default] == LINEARS - GATE_UPS
    assert_close(out, pass_free[torch.bfloat16], torch.bfloat16)


def test_bf16_llama_takes_the_gated_op_by_default(pass_free):
    """The default passes (``PassConfig()``): a bf16 Llama's gate-up and activation become the gated op, its QKV stays
    a GEMM (``rope_linear`` is off by default), and the logits stay within the bf16 tolerance of the pass-free ones."""
    with counted_after("gated_linear") as after:
        out, counts = logits(PassConfig(), dtype=torch.bfloat16)
    assert counts.matches["gated_linear"] == after[GATED] == GATE_UPS
    assert not counts.runs["rope_linear"] and not after[ROPE]
    assert_close(out, pass_free[torch.bfloat16], torch.bfloat16)


def test_llama_qkv_and_rotary_take_the_rope_op(pass_free):
    """Custom ops off: bf16's QKV GEMM and the rotary module's native form on its q and k become
    ``dynamo_once::rope_linear`` (on the CPU, ``F.linear`` then the rotary reference: within the bf16 tolerance of
    Inductor's code for the pair), and no rotary op is left (the first stage rewrites only what the second fuses)."""
    with counted_after("rope_linear") as after:
        out, counts = logits("none,+rope_linear", dtype=torch.bfloat16)
    assert counts.runs["rope_linear"] == PIECES
    assert counts.matches["rope_linear"] == after[ROPE] == QKVS
    assert after[torch.ops.aten.mm.default] + after[torch.ops.aten.addmm.default] == LINEARS - QKVS
    assert after[torch.ops.dynamo_once.rotary_embedding.default] == 0
    assert_close(out, pass_free[torch.bfloat16], torch.bfloat16)


def test_llama_fp32_keeps_what_the_bf16_fusions_take(pass_free):
    """fp32, which neither op takes: both passes run and rewrite nothing; the same logits bit for bit."""
    with counted_after("rope_linear") as after:
        out, counts = logits("none,+gated_linear,+rope_linear", dtype=torch.float32)
    assert counts.runs["gated_linear"] == counts.runs["rope_linear"] == PIECES
    assert not counts.matches["gated_linear"] and not counts.matches["rope_linear"]
    assert after[GATED] == after[ROPE] == after[torch.ops.dynamo_once.rotary_embedding.default] == 0
    assert torch.equal(out, pass_free[torch.float32])


def test_llama_calling_the_ops_takes_the_fused_ops(pass_free, monkeypatch):
    """Custom ops on, the layers calling ``dynamo_once::rotary_embedding`` and ``silu_and_mul`` (kept opaque while
    the passes are on), with the small-M linear pass too: each layer's QKV GEMM and its rotary become the rope op,
    its gate-up and activation the gated op, and the remaining GEMMs the small-M linear."""
    monkeypatch.setattr(ops.RotaryEmbedding, "forward_cpu", ops.RotaryEmbedding.forward_cuda)
    monkeypatch.setattr(ops.SiluAndMul, "forward_cpu", ops.SiluAndMul.forward_cuda)
    with counted_after("small_m_linear") as after:
        out, counts = logits("none,+gated_linear,+rope_linear,+small_m_linear", custom_ops="all", opaque=True,
                             dtype=torch.bfloat16)
    assert counts.matches["rope_linear"] == after[ROPE] == QKVS
    assert counts.matches["gated_linear"] == after[GATED] == GATE_UPS
    assert after[torch.ops.dynamo_once.linear.default] == LINEARS - QKVS - GATE_UPS
    assert after[torch.ops.dynamo_once.rotary_embedding.default] == after[torch.ops.dynamo_once.silu_and_mul.default] == 0
    assert after[torch.ops.aten.mm.default] == 0
    assert_close(out, pass_free[torch.bfloat16], torch.bfloat16)


@pytest.mark.cuda
def test_llama_gated_and_rope_linear_on_cuda():
    """On the GPU the decode steps' gate-up and QKV GEMMs take the fused kernels at one token (whole-step graphs),
    the unfused pairs elsewhere: the logits within the bf16 tolerance of the pass-free model's."""
    prompts = [[5, 9, 2]]  # one sequence: its decode steps are one token
    (ref, none), (out, matched) = (cuda_logits(p, prompts) for p in ("none", "none,+gated_linear,+rope_linear"))
    assert none["gated_linear"] == none["rope_linear"] == 0
    assert matched["gated_linear"] >= GATE_UPS and matched["rope_linear"] >= QKVS
    assert_close(out, ref, torch.bfloat16)


NORM_LINEAR = torch.ops.dynamo_once.norm_linear.default
# layer 0's gate-up and layer 1's QKV and gate-up; layer 0's QKV reads the embeddings' norm (no add), the final
# norm's output leaves the graph (the LM head runs outside it)
NORM_LINEARS = 3


@pytest.mark.parametrize("fused_add", [False, True], ids=["native", "fused-add-op"])
def test_llama_add_norm_and_linear_take_the_norm_linear_op(pass_free, fused_add):
    """bf16, after the linear passes: each residual add + norm whose output a linear op reads becomes
    ``dynamo_once::norm_linear`` (on the CPU, the fused-add norm's reference then ``F.linear`` / the gated
    reference: within the bf16 tolerance of Inductor's code), from the norm's native code or, with
    ``fused_add_rms_norm`` first, from its op."""
    passes = "none,+gated_linear,+small_m_linear,+norm_linear" + (",+fused_add_rms_norm" if fused_add else "")
    with counted_after("norm_linear") as after:
        out, counts = logits(passes, dtype=torch.bfloat16)
    assert counts.runs["norm_linear"] == PIECES
    assert counts.matches["norm_linear"] == after[NORM_LINEAR] == NORM_LINEARS
    assert after[GATED] == 0 and after[LINEAR] == LINEARS - GATE_UPS - 1  # layer 0's QKV, the o and down GEMMs
    # left: the norm of the embeddings and the final one (native, or the final one the fused-add op)
    assert after[RSQRT] == (1 if fused_add else 2) and after[FUSED] == int(fused_add)
    assert_close(out, pass_free[torch.bfloat16], torch.bfloat16)


def test_llama_calling_the_norm_op_takes_the_norm_linear_op(pass_free, monkeypatch):
    """Custom ops on, the norms calling ``dynamo_once::fused_add_rms_norm`` (kept opaque while the pass is on, as on
    CUDA): the pass takes the op's output and the linear op reading it, without ``fused_add_rms_norm``'s pass."""
    with counted_after("norm_linear") as after:
        out, counts = logits("none,+gated_linear,+small_m_linear,+norm_linear", custom_ops="all", op_path=True,
                             opaque=True, dtype=torch.bfloat16, monkeypatch=monkeypatch)
    assert counts.matches["norm_linear"] == after[NORM_LINEAR] == NORM_LINEARS
    assert after[FUSED] == 1 and after[GATED] == 0  # left: the final norm
    assert_close(out, pass_free[torch.bfloat16], torch.bfloat16)


def test_llama_norm_linear_needs_the_linear_ops(pass_free):
    """Without the passes making the linear ops the pass finds nothing (and fp32, which they leave alone, neither):
    the same logits bit for bit."""
    for dtype, passes in ((torch.bfloat16, "none,+norm_linear"), (torch.float32, "none,+small_m_linear,+norm_linear")):
        out, counts = logits(passes, dtype=dtype)
        assert not counts.matches["norm_linear"]
        assert torch.equal(out, pass_free[dtype])


@pytest.mark.cuda
def test_llama_norm_linear_on_cuda():
    """On the GPU the decode steps' QKV and gate-up GEMVs take the fused kernel at one token (whole-step graphs), the
    unfused ops elsewhere: the logits within the bf16 tolerance of the pass-free model's."""
    prompts = [[5, 9, 2]]  # one sequence: its decode steps are one token
    (ref, none), (out, matched) = (cuda_logits(p, prompts) for p in ("none", "none,+gated_linear,+small_m_linear,"
                                                                               "+norm_linear"))
    assert none["norm_linear"] == 0 and matched["norm_linear"] >= NORM_LINEARS
    assert_close(out, ref, torch.bfloat16)
