"""Prefix caching (``LLM(enable_prefix_caching=True)``, the default): a prompt that starts with an earlier prompt's tokens takes their cached
keys and values (whole blocks) and computes only the rest; the tokens are those of an LLM without the cache, on the
CPU (fp32) at levels 0 and 3, with async scheduling, with tensor parallelism, under a cache small enough to evict,
and for a prompt cached whole. The counts: ``stats.num_cached_tokens``, ``RequestOutput.num_cached_tokens``, the server's
``usage.prompt_tokens_details.cached_tokens``."""

import random

import pytest
import torch

from models import LLM, SamplingParams

BLOCK = 16
PREFIX = [(7 * i) % 120 + 2 for i in range(40)]  # 2 whole blocks and 8 tokens of a third


def make(level=0, **kw):
    return LLM("tiny-llama", level=level, device="cpu", **kw)


@pytest.fixture(scope="module")
def plain():
    return make(enable_prefix_caching=False)


def prompts_sharing(prefix, tails):
    return [prefix + tail for tail in tails]


@pytest.mark.parametrize("level", [0, 3])
def test_later_prompts_take_the_shared_prefix_from_the_cache(plain, level):
    """One sequence a step: each prompt after the first finds the prefix's 2 whole blocks cached."""
    prompts = prompts_sharing(PREFIX, [[50, 51, 52], [60, 61], [70]])
    llm = make(level, enable_prefix_caching=True, max_num_seqs=1)
    assert llm.generate(prompts, 8) == plain.generate(prompts, 8)
    assert llm.stats.num_cached_tokens == 2 * 2 * BLOCK
    # A second call: every prompt's blocks are cached now (the third block too: prompt + generated tokens)
    assert llm.generate(prompts, 8) == plain.generate(prompts, 8)
    assert llm.stats.num_cached_tokens == 3 * 2 * BLOCK


def test_a_prompt_waits_a_step_for_the_prefix_another_computes(plain):
    """All four would fit the first step; the three after the first wait for its 3 blocks of the shared prefix and
    take them from the cache the step after (computing them four times over instead is what it saves)."""
    prompts = prompts_sharing([(5 * i) % 110 + 3 for i in range(3 * BLOCK)], [[50 + i, 3, 4] for i in range(4)])
    llm = make(enable_prefix_caching=True, max_num_tokens=256)
    assert llm.generate(prompts, 6) == plain.generate(prompts, 6)
    assert llm.stats.num_cached_tokens == 3 * 3 * BLOCK
    others = prompts_sharing(list(range(3, 3 + 3 * BLOCK)), [[9], [10]])  # prompts of another prefix: no wait
    fresh = make(enable_prefix_caching=True, max_num_tokens=256)
    fresh.generate([prompts[0], others[0]], 2)
    assert fresh.stats.num_steps == 2 and fresh.stats.num_cached_tokens == 0


def test_async_scheduling_caches_the_blocks_its_steps_filled(plain):
    prompts = prompts_sharing(PREFIX, [[50], [51, 52, 53]])
    llm = make(enable_prefix_caching=True, async_scheduling=True, max_num_seqs=1)
    expected = plain.generate(prompts, 24)
    assert llm.generate(prompts, 24) == expected
    # The first prompt's 41 + 24 tokens filled 4 blocks, the last of them in its decode steps
    assert llm.generate([prompts[0] + expected[0][:23]], 4) == plain.generate([prompts[0] + expected[0][:23]], 4)
    assert llm.stats.num_cached_tokens == 3 * BLOCK


def test_a_block_after_another_prefix_is_not_a_hit(plain):
    """The same 16 tokens in the second block, after another first block: other keys and values, no hit."""
    same = list(range(30, 30 + BLOCK))
    prompts = [list(range(1, 1 + BLOCK)) + same + [5], list(range(100, 100 + BLOCK)) + same + [5]]
    llm = make(enable_prefix_caching=True, max_num_seqs=1)
    assert llm.generate(prompts, 4) == plain.generate(prompts, 4)
    assert llm.stats.num_cached_tokens == 0


def test_a_prompt_cached_whole_computes_its_last_block_for_its_logits(plain):
    prompt = PREFIX[:2 * BLOCK]
    llm = make(enable_prefix_caching=True)
    first = llm.generate([prompt], 6)
    assert llm.generate([prompt], 6) == first == plain.generate([prompt], 6)
    assert llm.stats.num_cached_tokens == BLOCK  # at most prompt_len - 1 tokens: the first block only


def test_a_small_cache_evicts_and_stays_right(plain):
    """8 blocks of cache, sequences of 2-4 blocks with shared and fresh prefixes: cached blocks are evicted for new
    tokens (least recently released first), never while a sequence holds them."""
    rng = random.Random(0)
    heads = [[rng.randrange(2, 120) for _ in range(2 * BLOCK)] for _ in range(3)]
    prompts = [rng.choice(heads) + [rng.randrange(2, 120) for _ in range(rng.randrange(1, 20))] for _ in range(12)]
    llm = make(enable_prefix_caching=True, num_cache_tokens=8 * BLOCK, max_num_tokens=64, max_num_seqs=2)
    assert llm.generate(prompts, 6) == plain.generate(prompts, 6)
    assert 0 < llm.stats.num_cached_tokens < sum(len(p) for p in prompts)
    assert llm.kv_cache.num_free_blocks == llm.kv_cache.num_blocks  # every block back: free, or cached and evictable


def test_a_block_a_running_sequence_holds_is_never_evicted(plain):
    """A (33 tokens, 30 new) runs; B takes A's 2 cached blocks, ends, releases them; C (5 blocks) then needs more
    than the cache's truly free blocks and must wait for A: evicting A's blocks would overwrite what A attends to."""
    a = PREFIX[:2 * BLOCK + 1]
    b, c = a + [90], [(5 * i) % 110 + 3 for i in range(70)]
    llm = make(enable_prefix_caching=True, num_cache_tokens=8 * BLOCK, max_num_tokens=len(a), max_num_seqs=2)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (30, 2, 2)]
    outs = llm.generate([a, b, c], params)
    assert [o.num_cached_tokens for o in outs[:2]] == [0, 2 * BLOCK]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate([a, b, c], params)]


@pytest.mark.slow
def test_tensor_parallel_ranks_attend_to_the_blocks_rank_0_found(plain):
    """Rank 0's scheduler finds the cached blocks; each rank's step reads them from its own shard of the cache."""
    prompts = prompts_sharing(PREFIX, [[50], [60, 61]])
    llm = make(enable_prefix_caching=True, max_num_seqs=1, tensor_parallel_size=2)
    try:
        assert llm.generate(prompts, 6) == plain.generate(prompts, 6)
        assert llm.stats.num_cached_tokens == 2 * BLOCK
    finally:
        llm.close()


def test_request_outputs_count_their_cached_tokens():
    llm = make(enable_prefix_caching=True, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=4)
    outs = llm.generate(prompts_sharing(PREFIX, [[9], [10, 11]]), params)
    assert [o.num_cached_tokens for o in outs] == [0, 2 * BLOCK]
    assert llm.stats.num_cached_tokens == 2 * BLOCK


def test_reset_forgets_every_block(plain):
    prompts = prompts_sharing(PREFIX, [[9], [10]])
    llm = make(enable_prefix_caching=True, max_num_seqs=1)
    llm.generate(prompts, 4)
    cached = len(llm.kv_cache.prefix)
    assert cached >= 2 and llm.reset_prefix_cache() == cached
    assert len(llm.kv_cache.prefix) == 0 and llm.kv_cache.num_free_blocks == llm.kv_cache.num_blocks
    assert llm.generate(prompts[:1], 4) == plain.generate(prompts[:1], 4)
    assert llm.stats.num_cached_tokens == 0  # computed again
    assert plain.reset_prefix_cache() == 0


def test_on_by_default_and_off_when_asked(plain):
    prompts = prompts_sharing(PREFIX, [[9], [10]])
    default = make(max_num_seqs=1)
    assert default.generate(prompts, 4) == plain.generate(prompts, 4)
    assert default.stats.num_cached_tokens == 2 * BLOCK
    plain.generate(prompts, 4)
    plain.generate(prompts, 4)
    assert plain.stats.num_cached_tokens == 0 and plain.kv_cache.prefix is None


def test_prompts_with_images_are_never_cached():
    """An image's placeholder tokens are the same for every image: such a prompt neither finds nor leaves blocks."""
    import torch

    llm = LLM("tiny-llava", level=0, device="cpu", enable_prefix_caching=True)
    size = llm.model.config.vision_config.image_size
    image = torch.randn(3, size, size, generator=torch.Generator().manual_seed(0))  # pixel values
    prompt = {"prompt_token_ids": [1, 5, 6] + [llm.model.config.image_token_index] + list(range(20, 60)),
              "multi_modal_data": {"image": image}}
    params = SamplingParams(temperature=0, max_tokens=3)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.token_ids == first.token_ids and second.num_cached_tokens == 0
    assert len(llm.kv_cache.prefix) == 0


def test_cli_generate_caches_unless_told_not_to(capsys):
    from models.cli import main

    assert main(["generate", "--model", "tiny-llama", "--device", "cpu", "--level", "0", "--random-prompts",
                 "--num-prompts", "2", "--max-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "[1] prompt" in out and "prompt tokens from the prefix cache" in out
    assert main(["generate", "--model", "tiny-llama", "--device", "cpu", "--level", "0", "--random-prompts",
                 "--num-prompts", "2", "--max-tokens", "2", "--no-enable-prefix-caching"]) == 0
    assert "prefix cache" not in capsys.readouterr().out


def test_served_usage_counts_the_cached_prompt_tokens(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from text_testing import save_text_llama
    from models.serve.app import build_app
    from test_serve import start_server

    save_text_llama(tmp_path)
    llm = LLM(str(tmp_path), level=0, device="cpu", enable_prefix_caching=True)
    url, server = start_server(build_app(llm, "m", api_key=None, max_body_bytes=1 << 16))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        prompt = "the quick brown fox jumps over the lazy dog " * 6
        first = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=4)
        second = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=4)
    finally:
        server.should_exit = True
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    n = first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK > 0
    assert second.choices[0].text == first.choices[0].text


def gpu_prefix_runs(device, dtype):
    """Six prompts of a 5-block prefix, admitted together and prefilled in 64-token chunks, without and with the
    cache (the five after the first wait a step, then read the first's blocks): both runs' outputs."""
    prompts = prompts_sharing([(5 * i) % 110 + 3 for i in range(5 * BLOCK)], [[50 + i, 3 + i] for i in range(6)])
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3)
    kw = dict(level=3, device=device, dtype=dtype, max_num_tokens=64)
    plain_outs = LLM("tiny-llama", **kw).generate(prompts, params)
    cached = LLM("tiny-llama", enable_prefix_caching=True, **kw)
    outs = cached.generate(prompts, params)
    assert cached.stats.num_cached_tokens == 5 * 5 * BLOCK
    return plain_outs, outs


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_a_cached_prefix_gives_the_uncached_distribution(dtype):
    """The Triton prefill reads the cached blocks as context: the first token's log-probabilities are those of the
    run without the cache, within the dtype's rounding (the keys and values were computed at another batch size):
    fp32 1e-4; bf16 2**-5, a few units of bf16's 2**-8 relative step at the logits' scale. fp32: the same tokens."""
    plain_outs, outs = gpu_prefix_runs("cuda", dtype)
    tol = 1e-4 if dtype == torch.float32 else 2 ** -5
    for o, p in zip(outs, plain_outs):
        first = p.token_ids[0]
        assert first in o.logprobs[0] and abs(o.logprobs[0][first] - p.logprobs[0][first]) <= tol
    if dtype == torch.float32:
        assert [o.token_ids for o in outs] == [p.token_ids for p in plain_outs]
