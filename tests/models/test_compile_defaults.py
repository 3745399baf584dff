"""A W8A8 checkpoint's compilation defaults (``models.compile_defaults``): at levels 3-4 on CUDA the custom ops and
the quantization fusions, the configuration measured fastest; a config that chooses, another device, another
level and an unquantized checkpoint keep the config as given."""

import json
import os

import pytest
import torch

from dispatcher import CompilationConfig, compat
from dispatcher.passes import pass_counter
from models import LLM
from models.compile_defaults import QUANTIZED_CUSTOM_OPS, QUANTIZED_PASSES, QUANTIZED_SIZED_PASSES, checkpoint_defaults
from models.quantization import parse_quantization_config

from models_testing import PROMPTS
from quant_testing import FLIP_ATOL, cuda_prefill_logits, prefill_logits, tiny_quantized


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    return tiny_quantized(tmp_path_factory, "fp8-static")


@pytest.fixture(scope="module")
def w8a8(fp8_checkpoint):
    with open(os.path.join(fp8_checkpoint, "config.json")) as f:
        return parse_quantization_config(json.load(f))


def test_a_w8a8_checkpoint_on_cuda_gets_the_custom_ops_and_the_quant_fusions(w8a8):
    given = CompilationConfig(level=3, use_cudagraph=False)
    chosen = checkpoint_defaults(given, w8a8, "cuda")
    assert chosen.custom_ops == ["all", "-rotary_embedding"] == list(QUANTIZED_CUSTOM_OPS)
    assert all(chosen.pass_config.enabled(name) for name in QUANTIZED_PASSES)
    assert {"rms_norm_quant", "act_quant"} <= set(QUANTIZED_PASSES)
    # every other pass keeps its default; the given config is not changed
    others = [n for n in chosen.pass_config.names() if n not in QUANTIZED_PASSES]
    assert [chosen.pass_config.switch(n) for n in others] == [None] * len(others)
    assert given.custom_ops == [] and given.pass_config.token_string() == ""
    assert checkpoint_defaults(given, w8a8, torch.device("cuda", 1)).custom_ops == list(QUANTIZED_CUSTOM_OPS)
    assert checkpoint_defaults(CompilationConfig(level=4, use_cudagraph=False), w8a8, "cuda").custom_ops


@pytest.mark.parametrize("sizes,above,on", [([128], None, True), ([8, 64], None, False), ([], None, False),
                                             ([32], "16", True), ([128], "128", False)])
def test_native_ops_joins_the_defaults_with_a_compile_size_above_its_threshold(w8a8, monkeypatch, sizes, above, on):
    """``native_ops`` (native code in the compiles above ``DYNAMO_ONCE_NATIVE_OPS_ABOVE`` tokens, default 64) is on
    where ``compile_sizes`` gives it a size to act in, and off (it would do nothing, and say so) elsewhere."""
    if above is not None:
        monkeypatch.setenv("DYNAMO_ONCE_NATIVE_OPS_ABOVE", above)
    chosen = checkpoint_defaults(CompilationConfig(level=3, compile_sizes=sizes, use_cudagraph=False), w8a8, "cuda")
    assert QUANTIZED_SIZED_PASSES == ("native_ops",)
    assert chosen.pass_config.enabled("native_ops") is on
    assert all(chosen.pass_config.enabled(name) for name in QUANTIZED_PASSES)


def test_native_ops_switched_off_stays_off_with_a_large_compile_size(w8a8):
    given = CompilationConfig(level=3, compile_sizes=[128], pass_config="-native_ops", use_cudagraph=False)
    chosen = checkpoint_defaults(given, w8a8, "cuda")
    assert not chosen.pass_config.enabled("native_ops") and chosen.pass_config.enabled("rms_norm_quant")


def test_a_config_that_chooses_keeps_its_choice(w8a8):
    ops_set = CompilationConfig(level=3, custom_ops=["none"], use_cudagraph=False)
    assert checkpoint_defaults(ops_set, w8a8, "cuda") is ops_set
    pass_off = CompilationConfig(level=3, use_cudagraph=False, pass_config="-rms_norm_quant")
    chosen = checkpoint_defaults(pass_off, w8a8, "cuda")
    assert chosen.custom_ops == list(QUANTIZED_CUSTOM_OPS)
    assert not chosen.pass_config.enabled("rms_norm_quant") and chosen.pass_config.enabled("act_quant")


@pytest.mark.parametrize("level,device", [(3, "cpu"), (3, None), (2, "cuda"), (0, "cuda")])
def test_no_defaults_off_cuda_or_below_level_3(w8a8, level, device):
    given = CompilationConfig(level=level, use_cudagraph=False)
    assert checkpoint_defaults(given, w8a8, device) is given


def test_an_unquantized_checkpoint_keeps_native_code():
    given = CompilationConfig(level=3, use_cudagraph=False)
    assert checkpoint_defaults(given, None, "cuda") is given


@pytest.mark.cuda
def test_cuda_llm_runs_a_w8a8_checkpoint_with_the_fused_kernels(fp8_checkpoint):
    """``LLM`` on the GPU at level 3 with no custom-op switch: the fused norm / activation quantizations run (every
    norm's and activation's quantization fused in every compile), and the logits are those of the same custom ops
    unfused up to the roundings the fused kernels may flip (bounded as in test_quant_fusion's CUDA test); the
    default's logits against the fp32 reference of the quantized math: test_quantized's CUDA test.

    Not against native code: in bf16, torch 2.11's Inductor drops the norm's and the activation's cast back to bf16
    before the quantization's cast to fp32 (its ``pointless_convert`` rewrite), so native code quantizes other
    values than the modules (~1 in 16 fp8 values, those within a bf16 ulp of an fp8 rounding boundary, a step
    apart), and no bound follows from the formats: on an H100 the largest logit difference was 0.625, the
    relative one per sequence 0.06-0.14 (a tiny random model amplifies a flipped step)."""
    unfused, _, _ = cuda_prefill_logits(fp8_checkpoint, "none", custom_ops=QUANTIZED_CUSTOM_OPS)
    torch._dynamo.reset()
    with compat.fresh_inductor_cache(), pass_counter.record() as counts:
        llm = LLM(fp8_checkpoint, max_num_tokens=32, compilation_config=CompilationConfig(level=3), device="cuda",
                  dtype=torch.bfloat16)
        got = prefill_logits(llm, PROMPTS).cpu()
    assert llm.compilation_config.custom_ops == list(QUANTIZED_CUSTOM_OPS)
    compiles = counts.runs["manager"] / 3  # 3 pieces a compile
    assert counts.matches["rms_norm_quant"] == 4 * compiles and counts.matches["act_quant"] == 2 * compiles
    diff = (got - unfused).abs()
    assert diff.max() <= FLIP_ATOL, f"max |diff| {diff.max():.3g}"
    assert len(llm.generate(PROMPTS[:1], max_new_tokens=4)[0]) == 4
