"""Llama against transformers: prefill logits and 16 greedy tokens at levels 0-3; mixed batches; sampling."""

import pytest
import torch

from dispatcher import (
    CompilationConfig,
    CompilationLevel,
    TorchCompileWrapperWithCustomDispatcher,
    compilation_counter,
    set_compilation_config,
)
from models import LLM, LlamaForCausalLM, load_model
from models.engine.graphs import check_one_dynamic_size

from models_testing import PROMPTS, hf_greedy, hf_last_logits, prefill_logits, save_hf_llama

TOLERANCES = {torch.float32: dict(rtol=1e-4, atol=1e-4)}  # measured: 3e-6 at level 0, Inductor adds ~1e-6


@pytest.fixture(scope="module")
def hf_reference(hf_llama_dir):
    path, hf = hf_llama_dir
    return path, hf_last_logits(hf, PROMPTS), hf_greedy(hf, PROMPTS, 16)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_parity_with_transformers(hf_reference, level):
    path, ref_logits, ref_tokens = hf_reference
    llm = LLM(path, level=level, max_num_tokens=32)
    assert isinstance(llm.model, LlamaForCausalLM) and int(llm.level) == level
    for got, ref in zip(prefill_logits(llm, PROMPTS), ref_logits):
        torch.testing.assert_close(got, ref, **TOLERANCES[torch.float32])
    assert llm.generate(PROMPTS, max_new_tokens=16) == ref_tokens


def test_tied_embeddings_parity(tmp_path):
    hf = save_hf_llama(tmp_path, tie_word_embeddings=True, num_key_value_heads=4)
    model = load_model(str(tmp_path))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    llm = LLM(model, max_num_tokens=32)
    assert llm.generate(PROMPTS[:2], max_new_tokens=8) == hf_greedy(hf, PROMPTS[:2], 8)


def test_mixed_batches_match_each_sequence_alone(hf_reference):
    path, _, ref_tokens = hf_reference
    # 16 tokens a step: prompts of 7, 2, 13, 1 cannot all prefill at once, so later steps hold
    # decodes of the first sequences next to the prefill of the others.
    llm = LLM(path, level=2, max_num_tokens=16)
    together = llm.generate(PROMPTS, max_new_tokens=16)
    assert llm.stats.num_mixed_steps >= 1
    alone = [llm.generate([p], max_new_tokens=16)[0] for p in PROMPTS]
    assert together == alone == ref_tokens
    logits_together = prefill_logits(llm, PROMPTS)
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(logits_together[i], prefill_logits(llm, [p])[0], rtol=1e-5, atol=1e-5)


def test_sequences_joining_and_leaving_the_batch(hf_reference):
    """Two sequences at a time, four prompts, an end-of-sequence token that stops them at different
    steps: as one leaves, the next takes its place. (The runner reuses the device block table only while
    a step has the last table's sequences, in order.)"""
    path, _, ref_tokens = hf_reference
    eos = ref_tokens[0][3]

    def until_eos(tokens):
        return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens

    expected = [until_eos(t) for t in ref_tokens]
    assert len({len(t) for t in expected}) > 1  # they do leave at different steps
    llm = LLM(path, level=0, max_num_tokens=32, max_num_seqs=2)
    assert llm.generate(PROMPTS, max_new_tokens=16, eos_token_id=eos) == expected
    assert llm.generate(PROMPTS[::-1], max_new_tokens=16, eos_token_id=eos) == expected[::-1]


def test_steps_padded_to_capture_sizes_give_the_same_tokens(hf_reference):
    """On CUDA, a step is padded up to the next capture size: dummy decode sequences (one token at position 0
    in a reserved block), or padding tokens of no sequence that write that block. Forced on the CPU
    (the same step code, no graphs), padded steps give the tokens of unpadded ones."""
    path, _, ref_tokens = hf_reference
    llm = LLM(path, level=0, max_num_tokens=32, max_num_seqs=8)
    llm.piece_sizes = [1, 2, 4, 8, 16, 32]  # what llm.graphs.setup sets on CUDA
    llm.pad_block = llm.kv_cache.allocate(1)[0]
    plans = []
    padding = llm.graphs.padding
    llm.graphs.padding = lambda b, t, nd, images: plans.append(((b, t), padding(b, t, nd, images))) or plans[-1][1]
    # Prompts of 7, 2, 13 and 1 tokens: a prefill step of 23 tokens pads to 32; decode steps of 3 sequences to 4.
    assert llm.generate(PROMPTS, max_new_tokens=16) == ref_tokens
    assert llm.generate(PROMPTS[:3], max_new_tokens=8) == [t[:8] for t in ref_tokens[:3]]
    assert ((4, 23), (False, 0, 9)) in plans and ((3, 3), (False, 1, 0)) in plans
    # With whole-step graphs (sizes up to max_num_seqs) a decode-only step pads to one of those.
    llm.full_sizes = [1, 2, 4, 8]
    assert padding(3, 3, 3, False) == (True, 1, 0) and padding(8, 8, 8, False) == (True, 0, 0)
    assert padding(4, 23, 2, False) == (False, 0, 9)  # mixed: padding tokens
    assert padding(4, 40, 2, False) == (False, 0, 0)  # above the largest size: no graph, no padding
    assert padding(1, 7, 0, True) == (False, 0, 0)  # a prompt with images: no graph


@pytest.mark.parametrize("level", [0, 3])
def test_async_scheduling_gives_the_same_tokens(hf_reference, level):
    """Decode steps launched before the last step's tokens are read (input ids from the device): the same
    greedy tokens, with sequences ending on an end-of-sequence token (one step late: its extra token is
    dropped) and waiting for admission (two at a time); sampling stays reproducible for a seed."""
    path, _, ref_tokens = hf_reference
    llm = LLM(path, level=level, max_num_tokens=32, max_num_seqs=2, async_scheduling=True)
    assert llm.generate(PROMPTS, max_new_tokens=16) == ref_tokens
    assert llm.stats.num_overlapped_steps > 0 and llm.stats.num_generated == 16 * len(PROMPTS)
    eos = ref_tokens[0][3]
    expected = [t[:t.index(eos) + 1] if eos in t else t for t in ref_tokens]
    assert llm.generate(PROMPTS, max_new_tokens=16, eos_token_id=eos) == expected
    assert llm.stats.num_generated == sum(map(len, expected))
    # All four at once: decode steps overlap from the first, so a sequence's end-of-sequence token is read
    # after its next step was launched.
    together = LLM(path, level=level, max_num_tokens=32, max_num_seqs=4, async_scheduling=True)
    assert together.generate(PROMPTS, max_new_tokens=16, eos_token_id=eos) == expected
    assert together.stats.num_overlapped_steps >= 14
    sampled = llm.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=3)
    assert sampled == llm.generate(PROMPTS, max_new_tokens=8, temperature=1.0, seed=3)
    # The steps padded as for CUDA graphs (forced on the CPU): dummies next to device-sourced ids.
    llm.piece_sizes, llm.pad_block = [1, 2, 4, 8, 16, 32], llm.kv_cache.allocate(1)[0]
    assert llm.generate(PROMPTS[:3], max_new_tokens=16) == ref_tokens[:3]


def test_level2_runs_captured_code_for_every_step(hf_reference):
    path = hf_reference[0]
    with compilation_counter.expect(num_graphs_seen=1, num_codes_captured=1, num_recompiles=0):
        llm = LLM(path, level=2, max_num_tokens=16)
        before = compilation_counter.num_dispatched_calls
        llm.generate(PROMPTS, max_new_tokens=4)
    assert compilation_counter.num_dispatched_calls - before == llm.stats.num_steps


def test_level3_runner_compiles_per_size(hf_reference):
    """The runner's inputs are views of one buffer (symbolic storage offsets): still one dynamic size,
    so a step of a compile size gets its own Inductor compile of each piece, once."""
    path, _, ref_tokens = hf_reference
    cfg = CompilationConfig(level=3, use_cudagraph=False, compile_sizes=[1])
    llm = LLM(path, max_num_tokens=32, compilation_config=cfg)
    compiled = [m for m in llm.model.modules() if isinstance(m, TorchCompileWrapperWithCustomDispatcher)]
    assert [w.num_dynamic_sizes for w in compiled] == [1]
    # tiny-llama: 2 attention ops between 3 compiled pieces; batch-1 decodes are size 1: each piece once more
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=3):
        assert llm.generate(PROMPTS[:1], max_new_tokens=16) == ref_tokens[:1]
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0):  # compiled once, kept
        assert llm.generate(PROMPTS[:1], max_new_tokens=16) == ref_tokens[:1]


def test_runner_refuses_a_step_traced_with_two_dynamic_sizes():
    """Had the runner's inputs given the traced step a second dynamic size, pieces would silently lose their
    per-size compiles and CUDA graphs: the engine raises instead (checked on real level-3 traces)."""
    from dispatcher import support_torch_compile

    @support_torch_compile
    class TwoSizes(torch.nn.Module):
        def __init__(self, related: bool = False):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.related = related

        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            if self.related:  # as in a real model: the two sizes are the same token count
                return self.lin(input_ids) + self.lin(positions)
            return self.lin(input_ids) + self.lin(positions).sum(0)  # no relation between the two sizes

    cfg = CompilationConfig(level=3, use_cudagraph=False)
    with set_compilation_config(cfg):
        two, one = TwoSizes(), TwoSizes(related=True)
    two(torch.randn(6, 8), torch.randn(3, 8))
    one(torch.randn(6, 8), torch.randn(6, 8))
    with pytest.raises(RuntimeError, match="TwoSizes.forward was traced with 2 dynamic sizes"):
        check_one_dynamic_size([two])
    check_one_dynamic_size([one])  # one size: fine
    with set_compilation_config(CompilationConfig(level=2)):
        level2 = TwoSizes()
    level2(torch.randn(6, 8), torch.randn(3, 8))
    check_one_dynamic_size([level2])  # levels 0-2: nothing to check


def test_run_hands_fp32_logits_and_greedy_generate_agrees_in_bf16():
    """generate's greedy choice takes the argmax in the model's dtype (no fp32 copy of the logits); run's
    chooser still gets fp32 logits; the tokens are the same."""
    llm = LLM("tiny-llama", level=0, dtype=torch.bfloat16, max_num_tokens=32)
    seen = []

    def choose(seqs, logits):
        seen.append(logits.dtype)
        return logits.argmax(dim=-1).tolist()

    via_run = llm.run(PROMPTS, 6, choose)
    assert set(seen) == {torch.float32}
    assert llm.generate(PROMPTS, max_new_tokens=6) == via_run


@pytest.mark.parametrize("level", [0, 3])
def test_hooks_on_the_lm_head_run(level):
    """The head is a module called as one: a forward hook on ``lm_head`` (a logit bias, a probe) sees and may
    replace every step's logits, at every level."""
    llm = LLM("tiny-llama", level=level, max_num_tokens=32)
    banned = llm.generate(PROMPTS, 1)[0][0]

    def ban(module, args, logits):
        logits[:, banned] = float("-inf")
        return logits

    handle = llm.model.lm_head.register_forward_hook(ban)
    try:
        assert all(banned not in tokens for tokens in llm.generate(PROMPTS, 6))
    finally:
        handle.remove()
    assert llm.generate(PROMPTS, 1)[0][0] == banned


def test_sampling_is_reproducible_and_seeded():
    llm = LLM("tiny-llama", level=0, max_num_tokens=32)
    a = llm.generate(PROMPTS, 12, temperature=1.0, seed=1)
    assert llm.generate(PROMPTS, 12, temperature=1.0, seed=1) == a
    assert llm.generate(PROMPTS, 12, temperature=1.0, seed=2) != a
    top1 = llm.generate(PROMPTS, 12, temperature=1.0, top_k=1, seed=3)
    assert top1 == llm.generate(PROMPTS, 12)  # top-1 sampling is greedy


def test_pad_block_is_outside_the_budget():
    """The pad block that CUDA-graph steps' padding writes to comes on top of num_cache_tokens (issue 17: taken
    from it, a 2048-token prompt and its new token in a 2064-token cache passed generate's check, then never
    fitted the free blocks)."""
    from models.engine.graphs import StepGraphs
    from models.engine.kv_cache import KVCache

    llm = LLM("tiny-llama", level=0, max_num_tokens=16, num_cache_tokens=64, block_size=16)
    assert llm.kv_cache.pad_block is None  # no CUDA graphs on the CPU
    cache = KVCache(llm.layers, 2064, 16, pad_block=True)
    assert (cache.num_blocks, cache.num_free_blocks, cache.pad_block) == (129, 129, 129)
    assert all(t.shape[1] == 130 for t in cache.tensors.values())
    config = CompilationConfig(level=3, use_cudagraph=True, cudagraph_mode="full_and_piecewise")
    assert StepGraphs.captures(torch.device("cuda"), CompilationLevel.INDUCTOR, config)
    assert not StepGraphs.captures(torch.device("cpu"), CompilationLevel.INDUCTOR, config)
    assert not StepGraphs.captures(torch.device("cuda"), CompilationLevel.INDUCTOR,
                                   CompilationConfig(level=3, cudagraph_mode="none"))


def test_kv_cache_budget_and_prompt_errors():
    llm = LLM("tiny-llama", level=0, max_num_tokens=16, num_cache_tokens=64, block_size=16)
    assert llm.kv_cache.num_blocks == 4
    # 4 blocks: the sequences take turns, each holding its blocks until done, and all finish.
    out = llm.generate([[1] * 10, [2] * 12, [3] * 9], max_new_tokens=8)
    assert [len(o) for o in out] == [8, 8, 8] and llm.kv_cache.num_free_blocks == 4
    whole = LLM("tiny-llama", level=0, max_num_tokens=16, num_cache_tokens=64, block_size=16, chunked_prefill=False)
    with pytest.raises(ValueError, match=r"17 tokens, more than max_num_tokens=16 \(chunked_prefill=False\)"):
        whole.generate([[1] * 17])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 128\)"):
        llm.generate([[1, 500]])
    with pytest.raises(ValueError, match="KV cache of 64 tokens"):
        llm.generate([[1] * 10], max_new_tokens=60)


@pytest.mark.parametrize("level", [0, 2, 3])
def test_chunked_prefill_matches_transformers(hf_reference, level):
    """A step budget of 5 tokens: every prompt longer than that is prefilled over several steps, each
    chunk attending to the cached ones, sharing steps with decodes; logits and tokens as transformers."""
    path, ref_logits, ref_tokens = hf_reference
    assert max(len(p) for p in PROMPTS) > 5
    llm = LLM(path, level=level, max_num_tokens=5, max_num_seqs=4)
    for got, ref in zip(prefill_logits(llm, PROMPTS), ref_logits):
        torch.testing.assert_close(got, ref, **TOLERANCES[torch.float32])
    assert llm.generate(PROMPTS, max_new_tokens=16) == ref_tokens
    assert llm.stats.num_mixed_steps >= 1


def test_chunked_prefill_steps_and_sampling_rng():
    """A 40-token prompt in steps of 16: chunks of 16, 16 and 8, then its first token. Partial chunks draw
    no sample: with both prompts ready in the same step either way (the 7-token one joins the last
    chunk), seeded sampling draws the same numbers as with the whole prompt in one step."""
    chunked = LLM("tiny-llama", level=0, max_num_tokens=16)
    whole = LLM("tiny-llama", level=0, max_num_tokens=64)
    prompt = [(5 * i) % 128 for i in range(40)]
    out = chunked.generate([prompt], max_new_tokens=4)
    assert chunked.stats.num_steps == 3 + 3  # 3 prefill chunks (the last also samples), 3 decodes
    assert out == whole.generate([prompt], max_new_tokens=4)
    a = chunked.generate([prompt, prompt[:7]], max_new_tokens=6, temperature=1.0, seed=5)
    b = whole.generate([prompt, prompt[:7]], max_new_tokens=6, temperature=1.0, seed=5)
    assert a == b


@pytest.mark.cuda
@pytest.mark.parametrize("level", [0, 2, 3])
def test_cuda_matches_cpu(level):
    """fp32 on the GPU (Triton decode kernel, custom ops) against the CPU reference path."""
    cpu = LLM("tiny-llama", level=0, max_num_tokens=32)
    gpu = LLM("tiny-llama", level=level, max_num_tokens=32, device="cuda")
    prompts = PROMPTS + [[5] * 20, [6] * 3]
    assert gpu.generate(prompts, 16) == cpu.generate(prompts, 16)
    for a, b in zip(prefill_logits(gpu, prompts), prefill_logits(cpu, prompts)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
def test_cuda_bf16_llama_decode_batches():
    llm = LLM("tiny-llama", level=2, max_num_tokens=512, max_num_seqs=256, dtype="bfloat16", device="cuda")
    prompts = [[(7 * i + j) % 128 for j in range(1 + i % 13)] for i in range(256)]
    out = llm.generate(prompts, 8)
    assert all(len(o) == 8 for o in out)
    ref = LLM("tiny-llama", level=0, max_num_tokens=512, max_num_seqs=256, dtype="bfloat16", device="cpu")
    same = sum(a == b for a, b in zip(out, ref.generate(prompts, 8)))
    assert same >= 0.9 * len(prompts)  # bf16: an occasional near-tie may flip


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 32])
def test_cuda_bf16_logits_take_the_small_m_gemm_at_decode_sizes(rows, monkeypatch):
    """The lm_head's GEMM runs on the small-M Triton kernel at decode batch sizes (it is outside the compiled
    forward, where the small_m_linear pass does not reach), within bf16 rounding of cuBLAS: at M = 1 for any shape
    (the unrolled GEMV's rows), cuBLAS at 32 rows for a shape the table leaves to it there (the tiny model's
    64 -> 128 lm_head: the M = 17-32 rows are the 8B's, N >= 4096)."""
    import importlib

    import torch.nn.functional as F
    linear_module = importlib.import_module("ops.linear")
    calls, launcher = [], linear_module.small_m_mm

    def spy(a, *args, **kwargs):
        calls.append(a.shape[0])
        return launcher(a, *args, **kwargs)

    monkeypatch.setattr(linear_module, "small_m_mm", spy)
    llm = LLM("tiny-llama", level=0, max_num_tokens=32, dtype="bfloat16", device="cuda")
    hidden = torch.randn(rows, llm.model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    logits = llm.model.compute_logits(hidden)
    assert calls == ([rows] if rows <= 16 else [])
    torch.testing.assert_close(logits.float(), F.linear(hidden, llm.model.lm_head.weight).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("level", [0, 3])
def test_del_frees_the_llm_without_a_garbage_collection(level):
    """No reference cycle through the engine: `del llm` frees the model and its KV cache at once (as users
    free GPU memory between models), not at the next collection."""
    import gc
    import weakref

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        llm = LLM("tiny-llama", level=level, max_num_tokens=32)
        llm.generate([[1, 2, 3]], max_new_tokens=2)
        alive = weakref.ref(llm)
        del llm
        assert alive() is None
    finally:
        if enabled:
            gc.enable()
