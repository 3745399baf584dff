"""The ``quant_gemm`` pass on W8A8 Llama checkpoints with static activation scales (fp8; int8 left alone), at level 3.

A quantized layer quantizes four inputs; three come from a kernel of the same piece (the norms', the SiLU-and-mul's),
which Inductor writes quantized itself. The fourth, o_proj's, is the attention's output: an input of its piece, so
its quantization is a kernel of its own. The pass puts ``static_quant_scaled_mm`` (the GEMM quantizing as it loads) in
place of that pair only: one a layer. Every compile runs in a fresh Inductor cache (a graph loaded from the FX graph
cache runs no pass).
"""

import pytest
import torch

import ops
from dispatcher import CompilationConfig, compat
from dispatcher.passes import PassConfig, pass_counter
from models import LLM

from models_testing import PROMPTS, save_hf_llama
from pass_testing import counted_after
from quant_testing import FLIP_ATOL, cuda_prefill_logits, prefill_logits, save_quantized

D = torch.ops.dynamo_once
SCHEMES = {"fp8-static": (D.static_scaled_fp8_quant.default, D.fp8_scaled_mm.default)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            hf = save_hf_llama(tmp_path_factory.mktemp("hf"), num_hidden_layers=2)
            path = tmp_path_factory.mktemp(name)
            save_quantized(path, hf, name, PROMPTS)
            cache[name] = str(path)
        return cache[name]

    return get


@pytest.fixture
def op_path(monkeypatch):
    """The modules call their ops on the CPU too, as they do on CUDA (the ops run their references)."""
    for cls in (ops.RMSNorm, ops.SiluAndMul, ops.QuantFP8, ops.QuantInt8):
        monkeypatch.setattr(cls, "forward_cpu", cls.forward_cuda)


def run(path, custom_ops, passes, **kwargs):
    torch._dynamo.reset()
    cfg = CompilationConfig(level=3, custom_ops=custom_ops, use_cudagraph=False, pass_config=passes)
    with compat.fresh_inductor_cache(), pass_counter.record() as counts, counted_after("quant_gemm") as after:
        llm = LLM(path, max_num_tokens=32, compilation_config=cfg, **kwargs)
        logits = prefill_logits(llm, PROMPTS)
    return logits, counts, dict(after)


@pytest.mark.parametrize("custom_ops", [[], ["all"]], ids=["native", "ops"])
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_o_proj_quantization_moves_into_its_gemm(checkpoint, op_path, name, custom_ops):
    """One rewrite a layer, o_proj's: its quantization (native code or the op) and GEMM become one op; the other
    GEMMs keep theirs. On the CPU the op runs the same references: the logits are the unfused graph's."""
    quant, gemm = SCHEMES[name]
    unfused, _, before = run(checkpoint(name), custom_ops, "none")
    fused, counts, after = run(checkpoint(name), custom_ops, "none,+quant_gemm")
    assert counts.matches["quant_gemm"] == 2  # one a layer, each in its own piece
    assert after[D.static_quant_scaled_mm.default] == 2
    assert after[gemm] == before[gemm] - 2 == 2 * 3  # qkv, gate-up and down a layer
    if custom_ops:  # the op kept opaque: the qkv, gate-up and down inputs' quantizations (a kernel writes them)
        assert after[quant] == 2 * 3
    assert torch.equal(fused, unfused)


def test_int8_is_left_alone(checkpoint):
    """int8 is not matched: its GEMV quantizing as it loads would cost more than the kernel it saves."""
    _, counts, after = run(checkpoint("int8-static"), [], "none,+quant_gemm")
    assert counts.runs["quant_gemm"] == 3 and not counts.matches["quant_gemm"]
    assert D.static_quant_scaled_mm.default not in after


def test_quant_gemm_is_off_by_default_and_switched_by_name():
    assert not PassConfig().enabled("quant_gemm")
    assert PassConfig.parse("+quant_gemm").enabled("quant_gemm")


def test_a_bf16_model_traces_no_pattern(tmp_path):
    """The pass runs on every piece of a bf16 model and finds nothing (its patterns all hold a W8A8 GEMM)."""

    torch._dynamo.reset()
    cfg = CompilationConfig(level=3, use_cudagraph=False, pass_config="none,+quant_gemm")
    with compat.fresh_inductor_cache(), pass_counter.record() as counts:
        save_hf_llama(tmp_path, num_hidden_layers=2)
        LLM(str(tmp_path), max_num_tokens=32, compilation_config=cfg)
    assert counts.runs["quant_gemm"] == 3 and not counts.matches["quant_gemm"]


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_cuda_o_proj_gemm_quantizes_its_input(checkpoint, name):
    """On the GPU, custom ops off, CUDA graphs on: the fused op's values are the quantization op's and the GEMM's
    (tests/ops/test_static_quant_scaled_mm.py: bit for bit at one token), so the logits are the unfused graph's up to what
    Inductor's native quantization and the op's may round apart (flips bounded as in test_quantized's CUDA test)."""
    (ref, _, _), (out, counts, llm) = (cuda_prefill_logits(checkpoint(name), p) for p in ("none", "none,+quant_gemm"))
    tokens = llm.generate(PROMPTS[:1], max_new_tokens=4)  # the decode steps' graphs, whose GEMV quantizes as it loads
    assert counts.matches["quant_gemm"] >= 2
    assert tokens
    diff = (out - ref).abs()
    assert diff.max() <= FLIP_ATOL, f"max |diff| {diff.max():.3g}"
