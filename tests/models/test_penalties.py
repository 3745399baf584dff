"""``SamplingParams``' penalties (repetition, frequency, presence), ``min_tokens`` and ``n``: greedy tokens against
references (transformers' repetition penalty; the frequency and presence penalties written out over
``LLM.run``'s logits), in mixed batches, with async scheduling and chunked prompts; the server's fields."""

import pytest
import torch

from models import LLM, SamplingParams

from text_testing import save_chain_llama, save_text_llama

transformers = pytest.importorskip("transformers")

PROMPTS = ["hello world", "The quick brown", "Café crème"]


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def text_llama(tmp_path_factory):
    """(path, transformers model, tokenizer) of a tiny random Llama with a real tokenizer."""
    path = tmp_path_factory.mktemp("penalty_llama")
    return (str(path), *save_text_llama(path))


@pytest.fixture(scope="module")
def llm(text_llama):
    return LLM(text_llama[0], level=0, max_num_tokens=32)


def test_repetition_penalty_matches_transformers(text_llama, llm):
    """transformers' ``repetition_penalty`` (every token of the prompt and of the output so far) in greedy
    ``generate``: the same tokens; and they differ from the unpenalized ones."""
    _, hf, tok = text_llama
    for prompt in PROMPTS:
        # The prompt and its own greedy continuation: tokens the model would repeat, in the prompt
        ids = tok.encode(prompt)
        ids += llm.generate({"prompt_token_ids": ids}, greedy(ignore_eos=True))[0].token_ids
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, repetition_penalty=1.8,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        got = llm.generate({"prompt_token_ids": ids}, greedy(repetition_penalty=1.8, ignore_eos=True))[0]
        assert got.token_ids == ref
    plain = [o.token_ids for o in llm.generate(PROMPTS, greedy(ignore_eos=True))]
    assert plain != [o.token_ids for o in llm.generate(PROMPTS, greedy(repetition_penalty=1.8, ignore_eos=True))]


def reference(llm, prompts, max_tokens, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy tokens with OpenAI's presence and frequency penalties on the generated tokens (and CTRL's
    repetition penalty on every token seen), written out per row over ``LLM.run``'s fp32 logits."""
    def choose(seqs, logits):
        out = []
        for seq, row in zip(seqs, logits.cpu()):
            generated = torch.tensor(seq.tokens[seq.prompt_len:], dtype=torch.int64)
            counts = torch.bincount(generated, minlength=row.shape[0]).float()
            seen = torch.zeros(row.shape[0], dtype=torch.bool)
            seen[torch.tensor(seq.tokens)] = True
            row = torch.where(seen, torch.where(row > 0, row / repetition, row * repetition), row)
            out.append(int((row - frequency * counts - presence * (counts > 0).float()).argmax()))
        return out
    return llm.run(prompts, max_tokens, choose)


@pytest.mark.parametrize("presence, frequency", [(1.5, 0.0), (0.0, 0.7), (-0.5, 1.2)])
def test_presence_and_frequency_penalties_match_the_reference(llm, presence, frequency):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = reference(llm, ids, 20, presence, frequency)
    params = greedy(20, presence_penalty=presence, frequency_penalty=frequency, ignore_eos=True)
    assert [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], params)] == expected
    # top_k=1 samples exactly the greedy token: the penalties come before the draw's masks too
    sampled = SamplingParams(temperature=0.7, top_k=1, max_tokens=20, presence_penalty=presence,
                             frequency_penalty=frequency, ignore_eos=True)
    assert [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], sampled)] == expected


@pytest.mark.cuda
def test_on_the_gpu_penalties_match_the_reference(text_llama):
    """Level 3 on the GPU (CUDA graphs, async scheduling): the penalized rows' counts kept on the device."""
    llm = LLM(text_llama[0], level=3, device="cuda", dtype=torch.float32, max_num_tokens=32)
    assert llm.async_scheduling
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = reference(llm, ids, 20, presence=0.5, frequency=0.7, repetition=1.3)
    params = greedy(20, presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3, ignore_eos=True)
    assert [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], params)] == expected
    assert llm.stats.num_overlapped_steps > 0


def test_penalized_and_plain_rows_share_a_batch(text_llama, llm):
    """Each row as it is alone, in one batch, with prompts chunked over steps and with async scheduling (the
    counts of a step's tokens added on the device before the host reads them)."""
    params = [greedy(ignore_eos=True), greedy(frequency_penalty=1.0, ignore_eos=True),
              greedy(repetition_penalty=1.5, presence_penalty=0.5, ignore_eos=True)]
    alone = [llm.generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == alone
    for kw in (dict(max_num_tokens=8), dict(async_scheduling=True)):
        other = LLM(text_llama[0], level=0, **{"max_num_tokens": 32, **kw})
        assert [o.token_ids for o in other.generate(PROMPTS, params)] == alone
        if kw.get("async_scheduling"):
            assert other.stats.num_overlapped_steps > 0


def test_logit_bias(llm):
    """+100 all but forces a token; a bias moves the greedy choice as adding it to the logits does; a row's bias
    stays its own in a shared batch; an id outside the vocabulary is refused naming ``logit_bias``."""
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    forced = llm.generate({"prompt_token_ids": ids[0]}, greedy(6, logit_bias={42: 100}))[0]
    assert forced.token_ids == [42] * 6
    plain = llm.generate([{"prompt_token_ids": p} for p in ids], greedy(8))
    bias = {plain[0].token_ids[0]: -100.0, plain[0].token_ids[1]: 3.5, 7: 2.0}

    def choose(seqs, logits):
        shift = torch.zeros(logits.shape[-1])
        for t, b in bias.items():
            shift[t] = b
        return (logits.cpu() + shift).argmax(dim=-1).tolist()
    expected = llm.run(ids[:1], 8, choose)[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], [greedy(8, logit_bias=bias), greedy(8), greedy(8)])
    assert outs[0].token_ids == expected != plain[0].token_ids
    assert [o.token_ids for o in outs[1:]] == [o.token_ids for o in plain[1:]]
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 320\); got 320"):
        llm.generate("hi", greedy(logit_bias={320: 1}))


def test_logprobs_stay_those_of_the_raw_logits(llm):
    plain = llm.generate(PROMPTS[0], greedy(4, logprobs=2, ignore_eos=True))[0]
    penalized = llm.generate(PROMPTS[0], greedy(4, logprobs=2, ignore_eos=True, frequency_penalty=2))[0]
    first = plain.token_ids[0]
    assert penalized.logprobs[0][first] == pytest.approx(plain.logprobs[0][first], abs=1e-6)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A checkpoint whose greedy continuation of "hello" is a fixed chain of tokens ending in EOS."""
    from text_testing import build_tokenizer

    tok = build_tokenizer()
    ids = tok.encode(" lazy dog, stop here", add_special_tokens=False)
    tokens = [tok.encode("hello", add_special_tokens=False)[-1], *ids, tok.eos_token_id]
    path = tmp_path_factory.mktemp("chain_llama")
    save_chain_llama(path, tokens)
    return str(path), tokens[1:]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_holds_back_every_stop(chain, async_scheduling):
    """Before ``min_tokens`` tokens neither EOS (its logit masked), a stop token nor a stop string ends the
    request; after them each does."""
    path, tokens = chain
    llm = LLM(path, level=0, max_num_tokens=32, async_scheduling=async_scheduling)
    eos = tokens[-1]
    plain = llm.generate("hello", greedy(30))[0]
    assert plain.token_ids == tokens and plain.finish_reason == "stop"
    n = len(tokens) + 3
    late = llm.generate("hello", greedy(30, min_tokens=n))[0]
    assert late.token_ids[:len(tokens) - 1] == tokens[:-1] and eos not in late.token_ids[:n]
    assert len(late.token_ids) >= n
    stop_tok = tokens[2]
    outs = llm.generate(["hello"] * 3, [greedy(30, stop_token_ids=[stop_tok], min_tokens=2),
                                        greedy(30, stop_token_ids=[stop_tok], min_tokens=3),
                                        greedy(30, stop=["dog"], min_tokens=len(tokens) - 1)])
    assert outs[0].token_ids == tokens[:3] and outs[0].stop_reason == stop_tok  # the 3rd token: past min_tokens
    assert stop_tok not in outs[1].token_ids[:3] and len(outs[1].token_ids) > 3
    assert "dog" in outs[2].text and outs[2].stop_reason != "dog"  # the stop string came before min_tokens
    assert llm.kv_cache.num_free_blocks == llm.kv_cache.num_blocks


def test_n_completions(llm, text_llama):
    """``n`` completions of each prompt: seeded, completion i is the one-completion request seeded seed + i;
    greedy, all alike; with prefix caching the prompt's whole blocks are computed once."""
    params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=11, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], params)
    assert len(outs) == 2 and all(len(o.outputs) == 3 for o in outs)
    assert [c.index for c in outs[0].outputs] == [0, 1, 2] and outs[0].outputs[0] is outs[0]
    for out, prompt in zip(outs, PROMPTS):
        alone = [llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=8, seed=11 + i, ignore_eos=True))[0]
                 for i in range(3)]
        assert [c.token_ids for c in out.outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    cached = LLM(text_llama[0], level=0, max_num_tokens=64, enable_prefix_caching=True)
    prompt = {"prompt_token_ids": list(range(3, 3 + 40))}  # 2 whole blocks and 8 tokens
    out = cached.generate(prompt, greedy(4, n=4, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    assert [c.num_cached_tokens for c in out.outputs] == [0, 32, 32, 32]


def test_one_completion_calls_refuse_n(llm):
    for call in (llm.stream_outputs, llm.generate_stream, llm.add_request):
        with pytest.raises(ValueError, match=r"SamplingParams.n must be 1 .*got 2"):
            call("hi", SamplingParams(n=2))


@pytest.mark.parametrize("field, value, expected", [
    ("presence_penalty", 2.5, r"presence_penalty must be a number in \[-2, 2\]"),
    ("frequency_penalty", "1", "frequency_penalty must be a number"),
    ("repetition_penalty", 0.0, r"repetition_penalty must be a finite number > 0"),
    ("repetition_penalty", float("inf"), r"repetition_penalty must be a finite number > 0"),
    ("min_tokens", 17, r"min_tokens must be an int in \[0, max_tokens=16\]"),
    ("min_tokens", -1, "min_tokens must be an int"),
    ("n", 0, "n must be an int >= 1"),
    ("n", 2.0, "n must be an int >= 1"),
    ("logit_bias", {5: 101}, r"logit_bias must be biases in \[-100, 100\] \(token 5\); got 101"),
    ("logit_bias", {"x": 1}, "logit_bias must be token ids"),
    ("logit_bias", [5], "logit_bias must be a dict"),
])
def test_params_errors_name_the_field(field, value, expected):
    with pytest.raises(ValueError, match=expected):
        SamplingParams(**{field: value})


def test_server_takes_penalties_min_tokens_and_n(llm):
    """The OpenAI fields (``presence_penalty``, ``frequency_penalty``, ``n``) and vLLM's (``repetition_penalty``,
    ``min_tokens``) give what ``LLM.generate`` gives; streamed, each of the ``n`` choices' text."""
    openai = pytest.importorskip("openai")
    from models.serve.app import build_app

    from test_serve import start_server

    url, server = start_server(build_app(llm, "m"))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        kw = dict(temperature=0.9, max_tokens=10, seed=5, presence_penalty=0.8, frequency_penalty=0.4)
        extra = dict(repetition_penalty=1.3, min_tokens=4, ignore_eos=True)
        expected = llm.generate(PROMPTS[0], SamplingParams(n=3, **kw, **extra))[0]
        got = client.completions.create(model="m", prompt=PROMPTS[0], n=3, extra_body=extra, **kw)
        assert [c.text for c in got.choices] == [c.text for c in expected.outputs]
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert got.usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)
        texts = ["", "", ""]
        for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    n=3, stream=True, extra_body=extra, **kw):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(n=3, **kw, **extra))[0]
        assert texts == [c.text for c in chat.outputs]
        # logit_bias: OpenAI's JSON keys are strings
        token = llm.tokenizer.convert_tokens_to_ids("a")
        biased = client.completions.create(model="m", prompt="hi", max_tokens=4, temperature=0,
                                           logit_bias={str(token): 100})
        assert biased.choices[0].text == "aaaa"
        with pytest.raises(openai.BadRequestError, match="logit_bias: token ids must be below"):
            client.completions.create(model="m", prompt="hi", logit_bias={"100000": 5})
    finally:
        server.should_exit = True


@pytest.mark.slow
def test_tensor_parallel_samples_as_one_rank(text_llama, llm):
    """Two ranks (rank 0 samples): penalties, logit bias, min_tokens and n as on one; prompt_logprobs refused
    (the vocabulary-parallel LM head runs on every rank, the prompt's logits on rank 0 alone)."""
    params = [greedy(10, frequency_penalty=1.0, repetition_penalty=1.3), greedy(6, logit_bias={42: 5.0}, min_tokens=3),
              SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=4, presence_penalty=0.5)]
    tp = LLM(text_llama[0], level=0, max_num_tokens=32, tensor_parallel_size=2)
    try:
        got = tp.generate(PROMPTS, params)
        assert [[c.token_ids for c in o.outputs] for o in got] == [
            [c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)]
        with pytest.raises(ValueError, match="prompt_logprobs are not supported with tensor_parallel_size > 1"):
            tp.generate("hi", greedy(2, prompt_logprobs=1))
    finally:
        tp.close()
