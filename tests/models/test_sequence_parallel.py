"""The sequence-parallel pass (``dispatcher.passes.sequence_parallel``) at TP=2 over gloo on the CPU (this process
as rank 0, a spawned worker as rank 1): its rewrites and op counts on the tiny Llama, its outputs against the
same TP=2 model without it, greedy tokens against TP=1 with biases on every projection; the size gate; the
collective ops it makes. The counts are rank 0's (the counting plugin pass runs in this process only).

Why the outputs are equal, not close, on the CPU: the reduce-scatter sums the same two partial products as
the all-reduce (two addends: one rounding, whichever order); the fused add and the norm are row-wise, so a
rank's 8 rows come out as among all 16; every GEMM reads the same full rows (the CPU's fused ops are the
plain GEMM and collective). On CUDA torch's fused ops cut the GEMMs into one product per rank's block, so
there the values may differ by the GEMMs' rounding (greedy tokens are what the two-GPU run compares).
"""

import pytest
import torch
import torch.distributed as dist

from dispatcher import CompilationConfig, compat, envs
from dispatcher.passes import SequenceParallelPass, build_pass_manager, PassConfig, pass_counter
from models import LLM
from models.parallel import async_tp as _registers_ops  # noqa: F401  (the fused GEMM + collective ops)
from models.parallel import destroy_tensor_parallel, init_tensor_parallel

from models_testing import PROMPTS, save_hf_llama
from pass_testing import counted_after

SIZE = 16  # the compile size rewritten: the chunked prefill's 16-token steps
FIRST_STEP = [list(range(3, 13)), list(range(20, 26))]  # 10 + 6 tokens: one 16-token step, then 2-token decodes
WITHOUT, WITH = "none,+fused_add_rms_norm", "none,+fused_add_rms_norm,+sequence_parallel"
_op = lambda name: getattr(torch.ops.dynamo_once, name).default  # noqa: E731


@pytest.fixture
def sp_env(monkeypatch):
    """Rewrite from 16 tokens; no compile cache (every graph compiled, so every pass runs and is counted). The
    spawned worker inherits the environment."""
    monkeypatch.setenv("DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS", str(SIZE))
    monkeypatch.setenv("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", "1")


def _run(model, passes, prompts, steps, tp=2, **fields):
    """Every step's logits (each step fed token 7), the passes' counts, and the call targets after the pass."""
    cfg = CompilationConfig(level=3, use_cudagraph=False, pass_config=passes, compile_sizes=[SIZE], **fields)
    out = []

    def choose(seqs, step_logits):
        out.append(step_logits.clone())
        return [7] * len(seqs)

    with compat.fresh_inductor_cache(), pass_counter.record() as counts, counted_after("sequence_parallel") as after:
        llm = LLM(model, max_num_tokens=SIZE, max_num_seqs=4, compilation_config=cfg, tensor_parallel_size=tp)
        try:
            llm.run(prompts, steps, choose)
        finally:
            llm.close()
    return torch.cat(out), counts, after


@pytest.mark.slow
@pytest.mark.parametrize("split", [True, False], ids=["pieces", "one-graph"])
def test_rewrite_counts_and_outputs(sp_env, split):
    """Tiny Llama (2 layers, no biases), TP=2: the 4 all-reduce + fused-add norm sites of the 16-token compile
    (layer 0 after attention, layer 1 before and after it, the final norm) are rewritten; the embedding's
    all-reduce (a plain norm follows) and the symbolic compile's 5 keep theirs. Split at attention (3 pieces),
    the residual is sliced where a piece begins and gathered where the middle one ends; as one graph
    (``splitting_ops=[]``) it is sliced once, after the embedding, and never gathered: the chain reduce-scatter ->
    norm on the shard -> all-gather + GEMM runs from layer to layer, the final norm's output gathered. Logits
    equal to the unrewritten model's (module docstring)."""
    fields = {} if split else {"splitting_ops": []}
    base, base_counts, _ = _run("tiny-llama", WITHOUT, FIRST_STEP, 3, **fields)
    logits, counts, after = _run("tiny-llama", WITH, FIRST_STEP, 3, **fields)
    graphs = 3 if split else 1
    assert base_counts.matches["fused_add_rms_norm"] == counts.matches["fused_add_rms_norm"] == 2 * 4
    assert counts.matches["sequence_parallel"] == 4 and counts.runs["sequence_parallel"] == graphs
    assert counts.skipped["sequence_parallel"] == graphs  # the symbolic compile's
    expected = {
        "all_reduce": 5 + 1,  # symbolic; the 16-token compile's embedding
        "reduce_scatter": 0,  # each fused with its GEMM (o_proj, down_proj):
        "matmul_reduce_scatter": 4,
        "all_gather_matmul": 3,  # the normed rows into gate-up (2) and layer 1's QKV
        # the final norm's output (and the residual leaving the middle piece for attention)
        "all_gather": 2 if split else 1,
        "rank_shard": 2 if split else 1,  # the residual entering each piece after attention (after the embedding)
        "fused_add_rms_norm": 2 * 4,
    }
    assert {name: after[_op(name)] for name in expected} == expected
    torch.testing.assert_close(logits, base, rtol=0, atol=0)


@pytest.mark.slow
def test_tp2_greedy_with_the_pass_equals_tp1(sp_env, tmp_path):
    """A Llama with biases on QKV, o, gate-up and down (the all-reduce's output plus the bias, the form with a
    bias): TP=2 with the pass greedy-equal to TP=1, chunked prefill's 16-token steps rewritten."""
    save_hf_llama(tmp_path, vocab_size=127, attention_bias=True, mlp_bias=True)
    kwargs = dict(max_num_tokens=SIZE, max_num_seqs=4, level=3)
    expected = _greedy(str(tmp_path), 1, WITHOUT, **kwargs)
    with compat.fresh_inductor_cache(), pass_counter.record() as counts:  # every compile runs its passes
        assert _greedy(str(tmp_path), 2, WITH, **kwargs) == expected
    assert counts.matches["sequence_parallel"] >= 4


def _greedy(path, tp, passes, **kwargs):
    cfg = CompilationConfig(level=3, use_cudagraph=False, pass_config=passes, compile_sizes=[SIZE])
    llm = LLM(path, compilation_config=cfg, tensor_parallel_size=tp, **kwargs)
    try:
        return llm.generate(PROMPTS, 6)
    finally:
        llm.close()


@pytest.mark.slow
def test_small_sizes_keep_the_all_reduce(monkeypatch):
    """Below the threshold (the 16-token compile under a threshold of 32) nothing is rewritten."""
    monkeypatch.setenv("DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS", "32")
    monkeypatch.setenv("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", "1")
    _, counts, after = _run("tiny-llama", WITH, FIRST_STEP, 2)
    assert counts.matches["sequence_parallel"] == 0 and counts.skipped["sequence_parallel"] == 6
    assert after[_op("all_reduce")] == 2 * 5 and after[_op("reduce_scatter")] == 0


def test_size_gate():
    p = SequenceParallelPass(min_tokens=64)
    assert [p.is_applicable(s) for s in (None, 1, 63, 64, 2048)] == [False, False, False, True, True]
    assert p.with_min_tokens(8).is_applicable(8) and not p.is_applicable(8)
    assert p.with_min_tokens(8).uuid() != p.uuid()  # Inductor's cache never mixes the thresholds


def test_min_tokens_reach_the_manager(monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS", "4096")
    from dispatcher.backends import inductor_options
    from dispatcher.config import CompilationLevel

    manager = inductor_options(CompilationConfig(pass_config="+sequence_parallel"), CompilationLevel.INDUCTOR)[
        compat.POST_GRAD_PASS_OPTION]
    (sp,) = [p for p in manager.passes if p.name == "sequence_parallel"]
    assert sp.min_tokens == 4096
    assert envs.SEQUENCE_PARALLEL_MIN_TOKENS == SequenceParallelPass().min_tokens
    assert not PassConfig().enabled("sequence_parallel")  # off by default
    assert "sequence_parallel" not in [p.name for p in build_pass_manager(PassConfig()).passes]


@pytest.mark.parametrize("name, value, message", [
    ("DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS", "0", "expected a positive integer"),
    ("DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS", "2k", "expected a positive integer"),
    ("DYNAMO_ONCE_ASYNC_TP", "maybe", "is not a boolean"),
])
def test_bad_values_name_the_variable(name, value, message, monkeypatch):
    monkeypatch.setenv(name, value)
    reader = envs.sequence_parallel_min_tokens if "MIN_TOKENS" in name else envs.async_tp
    with pytest.raises(ValueError, match=f"{name}='{value}'.*{message}|{name}='{value}' {message}"):
        reader()


@pytest.fixture
def one_rank_group():
    state = init_tensor_parallel(0, 1, "gloo", dist.HashStore(), 60)
    yield state.group_name
    destroy_tensor_parallel(state)


def test_collective_ops(one_rank_group):
    """On one rank each op is its local part: the reduce-scatter and the shard are the input, the fused ops the
    GEMM; opcheck checks their fake implementations and schemas."""
    g = one_rank_group
    x, a, b = torch.randn(4, 8), torch.randn(4, 6), torch.randn(6, 8)
    ops = torch.ops.dynamo_once
    assert torch.equal(ops.reduce_scatter(x, 0, g), x) and torch.equal(ops.rank_shard(x, 0, g), x)
    torch.testing.assert_close(ops.matmul_reduce_scatter(a, b, g), a @ b, rtol=0, atol=0)
    torch.testing.assert_close(ops.all_gather_matmul(a, b, g), a @ b, rtol=0, atol=0)
    for op, args in [(ops.reduce_scatter, (x, 0, g)), (ops.rank_shard, (x, 0, g)),
                     (ops.matmul_reduce_scatter, (a, b, g)), (ops.all_gather_matmul, (a, b, g))]:
        torch.library.opcheck(op.default, args)


def test_blocks_must_divide_the_rows():
    """Checked before any communication: a rank count that does not divide the rows is an error."""
    from models.parallel.communication import _blocks

    assert _blocks(torch.empty(6, 8), 0, 2) == 3
    with pytest.raises(ValueError, match=r"dim 0 of a \(3, 8\) tensor is not divisible by the group's 2 ranks"):
        _blocks(torch.empty(3, 8), 0, 2)


# ------------------------------------------------------------------ two GPUs
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_nccl_with_the_pass_equals_tp1(monkeypatch, tmp_path):
    """Two GPUs, level 3 with CUDA graphs (decode sizes keep the all-reduce), a 288-token prefill step (above
    the capture sizes: run as compiled, not replayed) rewritten, through torch's fused symmetric-memory GEMM +
    collective ops (DYNAMO_ONCE_ASYNC_TP=1) and through the plain GEMM and NCCL collective (0): greedy tokens
    equal to TP=1's. fp32: no near-ties between the GEMMs' roundings (the fused ops cut the GEMM per rank)."""
    monkeypatch.setenv("DYNAMO_ONCE_SEQUENCE_PARALLEL_MIN_TOKENS", "288")
    monkeypatch.setenv("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", "1")
    save_hf_llama(tmp_path)
    prompts = [[(5 * i + 3 * j) % 120 + 1 for j in range(72)] for i in range(4)]  # one 288-token step
    out, rewrites = {}, {}
    for tp, passes, async_tp in [(1, WITHOUT, "1"), (2, WITH, "1"), (2, WITH, "0")]:
        monkeypatch.setenv("DYNAMO_ONCE_ASYNC_TP", async_tp)  # read by the workers' ops: spawned after this
        cfg = CompilationConfig(level=3, pass_config=passes, compile_sizes=[288])
        with compat.fresh_inductor_cache(), pass_counter.record() as counts:  # every compile runs its passes
            llm = LLM(str(tmp_path), compilation_config=cfg, tensor_parallel_size=tp, max_num_tokens=288,
                      max_num_seqs=8, device="cuda", dtype="float32")
            try:
                out[tp, async_tp] = llm.generate(prompts, 8)
            finally:
                llm.close()
        rewrites[tp, async_tp] = counts.matches["sequence_parallel"]
    assert rewrites == {(1, "1"): 0, (2, "1"): 4, (2, "0"): 4}
    assert out[2, "1"] == out[1, "1"] and out[2, "0"] == out[1, "1"]
