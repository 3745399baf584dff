"""Cache blocks on demand and preemption: a sequence gets its prompt's blocks at admission and one more block
whenever its next token needs it; when the cache has none, the most recently admitted running sequences give theirs
back and compute their tokens again later. Outputs equal those of a cache large enough for everything (fp32, CPU);
sequences whose ``max_tokens`` would fill the cache still run together."""

import pytest

from models import LLM, SamplingParams


def prompts(n, length=20):
    return [[(13 * i + 7 * j) % 120 + 3 for j in range(length - i % 3)] for i in range(n)]


def make(num_cache_tokens, level=0, max_num_tokens=64, **kw):
    return LLM("tiny-llama", level=level, device="cpu", max_num_tokens=max_num_tokens, max_num_seqs=8,
               num_cache_tokens=num_cache_tokens, **kw)


@pytest.fixture(scope="module")
def roomy():
    return make(8192, enable_prefix_caching=False)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_small_cache_preempts_and_gives_the_same_tokens(roomy, async_scheduling, prefix_caching):
    small = make(128, async_scheduling=async_scheduling, enable_prefix_caching=prefix_caching)
    ps, params = prompts(6), greedy(40)
    outs = small.generate(ps, params)
    assert small.stats.num_preemptions > 0  # 6 x ~60 tokens in a 128-token cache
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(ps, params)]
    assert small.kv_cache.num_free_blocks == small.kv_cache.num_blocks  # every block back


def test_at_level_3_too(roomy):
    small = make(128, level=3)
    ps, params = prompts(5), greedy(30)
    outs = small.generate(ps, params)
    assert small.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(ps, params)]


def test_long_max_tokens_no_longer_serialize_the_requests(roomy):
    """Blocks for ``prompt + max_tokens`` at admission ran one such request at a time (a chat request without
    ``max_tokens`` gets the whole room left); on demand, they decode together."""
    small = make(256, enable_prefix_caching=False)
    ps = prompts(4, length=8)
    params = greedy(256 - 8)  # each may fill the whole cache
    outs = small.generate(ps, SamplingParams(temperature=0, max_tokens=256 - 8, stop_token_ids=[], ignore_eos=True))
    assert small.stats.max_decode_batch == 4
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(ps, params)]


def test_sampling_state_survives_a_preemption(roomy):
    """Seeded draws, penalties, logprobs and prompt logprobs go on where they were (the recompute samples nothing
    twice and records no prompt logprob twice)."""
    params = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=40, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1, presence_penalty=0.5, repetition_penalty=1.2)
    ps = prompts(6)
    small = make(128, enable_prefix_caching=False)
    outs, ref = small.generate(ps, params), roomy.generate(ps, params)
    assert small.stats.num_preemptions > 0
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert len(o.prompt_logprobs) == len(r.prompt_logprobs) == len(o.prompt_token_ids)
        for got, want in zip(o.prompt_logprobs[1:] + o.logprobs, r.prompt_logprobs[1:] + r.logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t] - want[t]) < 1e-4 for t in got)


def test_without_chunked_prefill_a_preempted_sequence_longer_than_a_step_is_computed_in_chunks(roomy):
    """Its prompt fits a step (the rule without chunked prefill); prompt + generated tokens may not: they follow in
    chunks rather than never fitting."""
    small = make(128, max_num_tokens=32, chunked_prefill=False, enable_prefix_caching=False)
    ps, params = prompts(6), greedy(40)
    outs = small.generate(ps, params)
    assert small.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy.generate(ps, params)]


def test_prompts_with_images_are_preempted_and_computed_again():
    """A prompt with images is prefilled whole (its image embedded again at the recompute); the tokens it generated
    before may follow in chunks."""
    import torch

    roomy = LLM("tiny-llava", level=0, device="cpu", max_num_tokens=64, enable_prefix_caching=False)
    config = roomy.model.config
    size = config.vision_config.image_size
    requests = [{"prompt_token_ids": [1, 5 + i, 6] + [config.image_token_index] + list(range(20, 30 + i)),
                 "multi_modal_data": {"image": torch.randn(3, size, size, generator=torch.Generator().manual_seed(i))}}
                for i in range(4)]
    params = greedy(40)
    ref = roomy.generate(requests, params)
    longest = max(len(o.prompt_token_ids) for o in ref) + 40
    small = LLM("tiny-llava", level=0, device="cpu", max_num_tokens=64, num_cache_tokens=2 * longest + 16)
    outs = small.generate(requests, params)
    assert small.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_a_cache_too_small_for_one_request_is_refused_before_it_runs():
    small = make(64, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="num_cache_tokens"):
        small.generate(prompts(1), greedy(60))


@pytest.mark.cuda
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_on_the_gpu_with_cuda_graphs(async_scheduling):
    """Level 3 on CUDA (whole-step graphs for decodes, the piecewise path for mixed steps), fp32: the block-table
    patches land in the persistent table the graphs read (staged through pinned memory), and the tokens and
    logprobs are a roomy cache's."""
    import torch

    ps, params = prompts(6), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    kw = dict(level=3, device="cuda", dtype=torch.float32, max_num_tokens=64, max_num_seqs=8,
              enable_prefix_caching=False, async_scheduling=async_scheduling)
    ref = LLM("tiny-llama", **kw).generate(ps, params)
    small = LLM("tiny-llama", num_cache_tokens=128, **kw)
    outs = small.generate(ps, params)
    assert small.stats.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for o, r in zip(outs, ref):
        assert all(abs(a[t] - b[t]) < 1e-4 for a, b in zip(o.logprobs, r.logprobs) for t in a)
