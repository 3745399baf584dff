"""``native_ops``: in compiles of more tokens than ``DYNAMO_ONCE_NATIVE_OPS_ABOVE`` the library's ops (and the fused
ops the quantization passes made of them) go back to their native forms, which Inductor fuses; smaller and
symbolic compiles keep them. On a tiny W8A8 Llama at level 3, custom ops on, the modules calling their ops on the
CPU as on CUDA (the ops run their references). The prompts' prefill is one 23-token step: ``compile_sizes=[23]``
gives it a compile of its own."""

import collections

import pytest
import torch

import ops
from dispatcher import CompilationConfig, compat, plugins
from dispatcher.passes import GraphPass, pass_counter
from dispatcher.passes.native_forms import registered_native_forms
from models import LLM

from models_testing import PROMPTS
from quant_testing import FLIP_ATOL, assert_logits_match, prefill_logits, tiny_quantized

STEP = sum(len(p) for p in PROMPTS)  # 23
FUSIONS = "+noop,+fused_add_rms_norm,+rms_norm_quant,+act_quant"


class CountBySize(GraphPass):
    """The ``dynamo_once`` ops of every graph, by compile size, at the end of the library's passes."""

    name = "count_by_size"

    def __init__(self):
        self.counts = collections.defaultdict(collections.Counter)

    def __call__(self, graph, size):
        self.counts[size].update(n.target._schema.name.split("::")[1] for n in graph.nodes if n.op == "call_function"
                                 and isinstance(n.target, torch._ops.OpOverload)
                                 and n.target._schema.name.startswith("dynamo_once::"))
        return 0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_quantized(tmp_path_factory, "fp8-static")


@pytest.fixture
def ops_on_cpu(monkeypatch):
    for cls in (ops.RMSNorm, ops.SiluAndMul, ops.QuantFP8, ops.QuantInt8):
        monkeypatch.setattr(cls, "forward_cpu", cls.forward_cuda)


def run(path, custom_ops, passes):
    torch._dynamo.reset()
    counter = CountBySize()
    cfg = CompilationConfig(level=3, custom_ops=custom_ops, use_cudagraph=False, compile_sizes=[STEP],
                            pass_config=passes)
    plugins.add_post_grad_pass(counter, after="native_ops")
    try:
        with compat.fresh_inductor_cache(), pass_counter.record() as counts:
            logits = prefill_logits(LLM(path, max_num_tokens=32, compilation_config=cfg), PROMPTS)
    finally:
        plugins.remove_post_grad_pass(counter.name)
    return logits, counter.counts, counts


@pytest.mark.parametrize("above", [STEP - 1, STEP])
def test_native_ops_put_native_code_back_above_the_threshold(checkpoint, ops_on_cpu, monkeypatch, above):
    monkeypatch.setenv("DYNAMO_ONCE_NATIVE_OPS_ABOVE", str(above))
    ref, _, _ = run(checkpoint, ["none"], "")
    got, by_size, counts = run(checkpoint, ["all"], FUSIONS + ",+native_ops")
    native = set(registered_native_forms())
    kept = {op: n for op, n in by_size[None].items() if op in native}
    # the symbolic compile keeps the library's kernels: a norm + quant before QKV and gate-up in each of the 2
    # layers, o_proj's quantization in each, the final norm (the activation + quant went into the gate-up GEMM)
    assert sum(n for op, n in kept.items() if op.endswith("rms_norm_static_quant")) == 4
    assert kept["static_scaled_fp8_quant"] == 2 and sum(kept.values()) == 7
    left = {op: n for op, n in by_size[STEP].items() if op in native}
    if above < STEP:  # the 23-token compile runs native code: no op with a native form is left
        assert not left and counts.matches["native_ops"] == 7
        assert counts.runs["native_ops"] == 3  # each piece of the 23-token compile
    else:
        assert left == kept and not counts.runs["native_ops"]
    assert_logits_match(got, ref)  # native code's logits


def test_native_ops_above_must_be_a_token_count(checkpoint, monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_NATIVE_OPS_ABOVE", "many")
    with pytest.raises(ValueError, match="DYNAMO_ONCE_NATIVE_OPS_ABOVE='many': expected a non-negative integer"):
        run(checkpoint, ["all"], "+native_ops")


@pytest.mark.parametrize("sizes,warned", [([], True), ([STEP], True), ([STEP, STEP + 1], False)])
def test_native_ops_without_a_compile_size_above_the_threshold_says_it_does_nothing(checkpoint, monkeypatch,
                                                                                   caplog, sizes, warned):
    monkeypatch.setenv("DYNAMO_ONCE_NATIVE_OPS_ABOVE", str(STEP))
    torch._dynamo.reset()
    cfg = CompilationConfig(level=3, use_cudagraph=False, compile_sizes=sizes, pass_config="+native_ops")
    with caplog.at_level("WARNING", logger="dispatcher.backends"):
        prefill_logits(LLM(checkpoint, max_num_tokens=32, compilation_config=cfg), PROMPTS[:1])
    said = [r.getMessage() for r in caplog.records if "native_ops" in r.getMessage()]
    assert bool(said) == warned
    if warned:
        assert f"DYNAMO_ONCE_NATIVE_OPS_ABOVE={STEP}" in said[0] and "compile_sizes" in said[0]


@pytest.mark.cuda
def test_cuda_native_ops_run_native_code_above_the_threshold(checkpoint, monkeypatch):
    """On the GPU, bf16, the W8A8 default (custom ops and quant fusions) + ``native_ops`` below the prefill step's
    size: that compile is native code's (no library op with a native form left), so the logits are native code's
    up to Inductor's own choices (flips bounded as in test_quantized's CUDA test)."""
    monkeypatch.setenv("DYNAMO_ONCE_NATIVE_OPS_ABOVE", str(STEP - 1))
    kw = dict(max_num_tokens=32, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for custom_ops, passes in ((["none"], ""), ([], "+native_ops")):
        torch._dynamo.reset()
        cfg = CompilationConfig(level=3, custom_ops=custom_ops, use_cudagraph=False, compile_sizes=[STEP],
                                pass_config=passes)
        with compat.fresh_inductor_cache(), pass_counter.record() as counts:
            outs[passes] = prefill_logits(LLM(checkpoint, compilation_config=cfg, **kw), PROMPTS).cpu()
    assert counts.matches["native_ops"] == 7 and counts.matches["rms_norm_quant"] >= 4
    diff = (outs["+native_ops"] - outs[""]).abs()
    assert diff.max() <= FLIP_ATOL, f"max |diff| {diff.max():.3g}"
