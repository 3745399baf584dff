"""Levels 3-4 in the runner: CUDA graphs captured at start-up, padding, whole-step decode graphs."""

import pytest

from dispatcher import CompilationConfig, CUDAGraphMode, compilation_counter
from models import LLM

pytestmark = pytest.mark.cuda

SIZES = [1, 2, 4, 8, 16]
PIECES = 3  # tiny-llama: 2 layers -> 2 attention ops -> 3 compiled pieces
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [3] * 13, [42]]


def llm(mode, **kw):
    cfg = CompilationConfig(level=3, use_cudagraph=mode != "none", cudagraph_mode=mode,
                            cudagraph_capture_sizes=SIZES)
    return LLM("tiny-llama", max_num_tokens=32, max_num_seqs=8, device="cuda", compilation_config=cfg, **kw)


def test_capture_counts_at_start_up():
    with compilation_counter.expect(num_graphs_seen=1,
                                    # one graph per piece per size (all 5 sizes <= 32 tokens), plus one
                                    # whole-step graph per size that a decode batch can have (<= 8 seqs)
                                    num_cudagraph_captured=PIECES * len(SIZES) + 4):
        m = llm("full_and_piecewise")
    assert m.piece_sizes == SIZES and m.full_sizes == [1, 2, 4, 8]
    assert m.cuda_graphs.sizes(CUDAGraphMode.PIECEWISE) == SIZES
    assert m.cuda_graphs.sizes(CUDAGraphMode.FULL) == [1, 2, 4, 8]
    with compilation_counter.expect(num_cudagraph_captured=PIECES * len(SIZES)):
        p = llm("piecewise")
    assert p.full_sizes == [] and p.cuda_graphs.sizes(CUDAGraphMode.FULL) == []
    assert llm("none").cuda_graphs is None


@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise"])
def test_graphs_give_the_tokens_and_logits_of_eager(mode):
    ref = LLM("tiny-llama", level=0, max_num_tokens=32, max_num_seqs=8, device="cuda")
    m = llm(mode)
    with compilation_counter.expect(num_cudagraph_captured=0, num_graphs_seen=0):
        # Steps of 4 decodes (padded: none), mixed prefill + decode (T padded to 8, 16 or 32 tokens).
        assert m.generate(PROMPTS, 12) == ref.generate(PROMPTS, 12)
        # 3 sequences: decode steps padded to 4 with a dummy sequence.
        assert m.generate(PROMPTS[:3], 6) == ref.generate(PROMPTS[:3], 6)
    assert m.stats.decode_step_times_s


def test_level_3_without_graphs_matches_with_graphs():
    a, b = llm("full_and_piecewise"), llm("none")
    assert a.generate(PROMPTS, 8) == b.generate(PROMPTS, 8)


@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise"])
def test_async_scheduling_with_graphs_gives_the_tokens_of_eager(mode):
    """Decode steps launched from the device's sampled tokens (pinned double buffer, events) over the
    captured graphs: the tokens of synchronous eager steps, also when an end-of-sequence token is read while
    the next step is in flight, and when some sequences stop before others."""
    ref = LLM("tiny-llama", level=0, max_num_tokens=32, max_num_seqs=8, device="cuda")
    m = llm(mode, async_scheduling=True)
    expected = ref.generate(PROMPTS, 12)
    with compilation_counter.expect(num_cudagraph_captured=0, num_graphs_seen=0):
        assert m.generate(PROMPTS, 12) == expected
        assert m.stats.num_overlapped_steps > 0
        eos = expected[0][3]
        assert m.generate(PROMPTS, 12, eos_token_id=eos) == ref.generate(PROMPTS, 12, eos_token_id=eos)
        assert m.generate(PROMPTS[:3], 6) == [t[:6] for t in expected[:3]]  # 3 decodes pad to 4


def test_prompt_of_the_whole_cache_budget_runs_beside_the_pad_block():
    """The pad block (padding tokens' writes) is outside num_cache_tokens: a prompt and its new token of exactly
    the budget run (issue 17: 2048 + 1 tokens in a 2064-token cache could never be scheduled)."""
    m = llm("full_and_piecewise", num_cache_tokens=48)
    assert m.pad_block == m.kv_cache.num_blocks == 3
    assert len(m.generate([[3] * 47], 1)[0]) == 1
    assert m.kv_cache.num_free_blocks == 3


@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise"])
def test_serving_compiles_no_triton_kernel_after_start_up(mode):
    """Start-up launches the eager attention once for every step layout it can take (models.attention.eager_layouts),
    so that steps of any decode count beside prompts and prompt chunks compile no Triton kernel while serving (a
    compile holds its step 0.3-1 s): none of the steps of a generate with every such mix compiles one."""
    from triton import knobs

    m = llm(mode)
    compiled: list[str] = []
    previous = knobs.runtime.jit_cache_hook

    def hook(**kw):
        compiled.append(kw["repr"].split("(")[0])  # the kernel and its options

    knobs.runtime.jit_cache_hook = hook
    try:
        # 19 prompts of 2-58 tokens (the longest in two chunks of at most 32), 8 in flight: steps of 0-7 decodes
        # beside a prompt or chunk, and decode-only steps of 1-8
        prompts = [[(7 * i + j) % 97 + 1 for j in range(2 + 3 * i)] for i in range(19)]
        outs = m.generate(prompts, 9)
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert len(outs) == len(prompts) and m.stats.num_mixed_steps > 0
    assert compiled == []


def test_warm_attention_switch_skips_the_start_up_launches(monkeypatch):
    """``DYNAMO_ONCE_WARM_ATTENTION=0``: no eager attention launches at start-up (their kernels compile at first use);
    the tokens are the same."""
    on = llm("full_and_piecewise")
    monkeypatch.setenv("DYNAMO_ONCE_WARM_ATTENTION", "0")
    off = llm("full_and_piecewise")
    assert on.graphs.eager_warm_s > 0 and off.graphs.eager_warm_s == 0
    assert off.generate(PROMPTS, 6) == on.generate(PROMPTS, 6)
