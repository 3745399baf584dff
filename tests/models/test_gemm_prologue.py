"""The ``gemm_prologue`` pass on W8A8 Llama checkpoints at level 3: each linear layer's producer (norm + quant,
activation + quant, the quantization alone) and its GEMM become one ``ops.prologue_gemm`` op.

Per layer, after ``rms_norm_quant`` and ``act_quant``: QKV's norm (layer 0: plain, else fused-add), o_proj's
quantization, gate-up's fused-add norm and, with a static scale, down's SiLU-and-mul; a per-token SiLU-and-mul
stays with its GEMM (the op does not fuse it). As in test_quant_fusion.py the modules call their ops on the CPU
(the ops run their references) and every compile has a fresh Inductor cache.
"""

import pytest
import torch
from test_quant_fusion import SCHEMES, UNQUANTIZED_DOWN, checkpoint, op_path, run  # noqa: F401 (fixtures)

from dispatcher import CompilationConfig, compat
from dispatcher.passes import GemmProloguePass, PassConfig, build_pass_manager, pass_counter
from models import LLM

from pass_testing import counted_after
from quant_testing import assert_logits_match, prefill_logits
from models_testing import PROMPTS

D = torch.ops.dynamo_once
GEMMS = {"fp8": D.fp8_scaled_mm.default, "int8": D.int8_scaled_mm.default}


@pytest.fixture
def after():
    with counted_after("gemm_prologue") as counts:
        yield counts


def _expected(name, layers=2):
    """(fused ops a graph holds after the pass, GEMMs left unfused)."""
    static = SCHEMES[name][1] == "static"
    quantized_down = layers - UNQUANTIZED_DOWN.get(name, 0)
    fused = {D.rms_norm_quant_mm.default: 1, D.fused_add_rms_norm_quant_mm.default: 2 * layers - 1,
             D.quant_mm.default: layers, D.act_and_mul_quant_mm.default: quantized_down if static else 0}
    return fused, 0 if static else quantized_down


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_producer_moves_into_its_gemm(checkpoint, op_path, after, name):
    """Counts after the pass, every piece: the fused ops above, no quantization op left but a per-token SiLU's,
    and the logits of the graph without the pass."""
    torch._dynamo.reset()
    unfused, _ = run(checkpoint(name), "all,-gemm_prologue")
    torch._dynamo.reset()
    after.clear()
    fused, counts = run(checkpoint(name), "all")
    expected, gemms_left = _expected(name)
    assert {op: after[op] for op in expected} == expected
    assert after[GEMMS[name.split("-")[0]]] == gemms_left
    assert counts.matches["gemm_prologue"] == sum(expected.values())
    quant, kind = SCHEMES[name]
    assert after[quant.default] == 0
    assert after[getattr(D, f"fused_add_rms_norm_{kind}_quant").default] == 0
    assert_logits_match(fused, unfused)


def test_compiles_past_the_fused_range_keep_the_producers(checkpoint, op_path):
    """A compile of more than 16 tokens is left alone (its kernels stay Inductor's to launch); the symbolic
    compile and one of 8 tokens are rewritten."""
    torch._dynamo.reset()
    path = checkpoint("fp8-static")
    cfg = CompilationConfig(level=3, custom_ops=["all"], use_cudagraph=False, pass_config="all",
                            compile_sizes=[8, 32])
    with compat.fresh_inductor_cache(), compat.triton_ops_decomposed(True), pass_counter.record() as counts:
        llm = LLM(path, max_num_tokens=32, compilation_config=cfg)
        prefill_logits(llm, [list(range(3, 11)), list(range(3, 35))])  # steps of 8 and 32 tokens
    per_compile = sum(_expected("fp8-static")[0].values())
    pieces = 3
    assert counts.matches["gemm_prologue"] == 2 * per_compile
    assert counts.skipped["gemm_prologue"] == pieces  # the 32-token compile's
    assert GemmProloguePass().is_applicable(None) and GemmProloguePass().is_applicable(16)
    assert not GemmProloguePass().is_applicable(17)


def test_the_pass_enters_the_cache_key():
    on = build_pass_manager(PassConfig.parse("none,+gemm_prologue"))
    off = build_pass_manager(PassConfig.parse("none"))
    assert "gemm_prologue" in [p.name for p in on.active_passes()]
    assert on.uuid() != off.uuid()


def test_patterns_trace():
    p = GemmProloguePass()
    p.prepare()
    # per quant op and GEMM output dtype: 2 norms x 2 (Llama, Gemma) + the quantization; static also 3 activations
    assert p.num_patterns == 3 * (2 * (4 + 1) + 2 * (4 + 1 + 3))
