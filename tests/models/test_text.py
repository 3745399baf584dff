"""The text API of ``LLM`` through its public calls: a real tokenizer (a byte-level BPE trained in the test)
beside tiny checkpoints, ``SamplingParams`` and its errors, stopping (EOS from generation_config.json or
config.json, stop tokens, stop strings over two tokens, max_tokens), per-request seeds in any batch,
masks, logprobs, streaming over split UTF-8 characters, chat templates, threads, the CLI;
``transformers`` as the oracle.

Two checkpoints: a random tiny Llama (text against ``transformers`` greedy generate) and a "chain" Llama
whose greedy next token is fixed (text_testing.save_chain_llama), so the model writes chosen tokens:
"hello" -> "é😀 lazy dog, stop here" </s>, with "é" and "😀" one byte a token."""

import json
import math
import os
import re
import threading

import pytest
import torch

from dispatcher import CompilationConfig
from models import LLM, RequestOutput, SamplingParams
from models.cli import main

from text_testing import byte_token, build_tokenizer, save_chain_llama, save_text_llama, save_text_llava, with_files

transformers = pytest.importorskip("transformers")

TEXT_PROMPTS = ["hello world", "The quick brown", "Café crème", "Stop"]
CHAIN_TEXT = "é😀 lazy dog, stop here"


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def text_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("text_llama")
    hf, tok = save_text_llama(path)
    return str(path), hf, tok


@pytest.fixture(scope="module")
def llm(text_llama):
    return LLM(text_llama[0], level=0, max_num_tokens=32)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """(checkpoint path, the chain's token ids after the prompt "hello")."""
    tok = build_tokenizer()
    ids = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    emoji = [byte_token(tok, b) for b in "😀".encode()]
    tokens = [ids("hello")[-1], byte_token(tok, 0xC3), byte_token(tok, 0xA9), *emoji,
              *ids(" lazy dog, stop here"), tok.eos_token_id]
    assert len(set(tokens)) == len(tokens) and tok.decode(tokens[1:], skip_special_tokens=True) == CHAIN_TEXT
    path = tmp_path_factory.mktemp("chain_llama")
    save_chain_llama(path, tokens)
    return str(path), tokens[1:]


@pytest.fixture(scope="module")
def chain_llm(chain):
    return LLM(chain[0], level=0, max_num_tokens=32)


def hf_generate(hf, ids, max_new_tokens):
    """transformers' greedy generate, stopping at the checkpoint's EOS (its generation_config)."""
    with torch.no_grad():
        x = torch.tensor([ids])
        out = hf.generate(x, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones_like(x))
    return out[0, len(ids):].tolist()


# ------------------------------------------------------------------ text against transformers
@pytest.mark.parametrize("level", [0, 3])
def test_text_matches_transformers_greedy(text_llama, level):
    path, hf, tok = text_llama
    # level 3: Inductor on the CPU, no CUDA graphs
    config = CompilationConfig(level=level, use_cudagraph=False)
    llm = LLM(path, max_num_tokens=32, compilation_config=config)
    outs = llm.generate(TEXT_PROMPTS, greedy(12))
    assert all(isinstance(o, RequestOutput) for o in outs)
    for prompt, out in zip(TEXT_PROMPTS, outs):
        ids = tok(prompt).input_ids
        assert ids[0] == tok.bos_token_id and out.prompt == prompt and out.prompt_token_ids == ids
        ref = hf_generate(hf, ids, 12)
        assert out.token_ids == ref
        assert out.text == tok.decode(ref, skip_special_tokens=True)
        assert out.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
    # A single string; token ids the text way (text decoded too, prompt None); the token-id way unchanged.
    (one,) = llm.generate(TEXT_PROMPTS[0], greedy(12))
    assert one == outs[0]
    ids = tok(TEXT_PROMPTS[1]).input_ids
    (by_ids,) = llm.generate([ids], greedy(12))
    assert by_ids.prompt is None and by_ids.text == outs[1].text
    n = len(outs[1].token_ids)
    assert llm.generate([ids], 12)[0][:n] == outs[1].token_ids  # the token-id way: never stops at EOS


def test_token_id_call_keeps_its_results(text_llama, llm):
    """generate(ids, max_new_tokens, ...) still returns lists of ids, never stopping at the checkpoint's EOS."""
    tok = text_llama[2]
    ids = [tok(p).input_ids for p in TEXT_PROMPTS]
    out = llm.generate(ids, max_new_tokens=6)
    assert out == llm.generate(ids, 6) and all(isinstance(o, list) and len(o) == 6 for o in out)
    assert [o.token_ids[:6] for o in llm.generate(ids, greedy(6, ignore_eos=True))] == out


# ------------------------------------------------------------------ SamplingParams
BAD_PARAMS = [
    ("temperature", float("nan"), "a finite number >= 0"), ("temperature", -0.5, "a finite number >= 0"),
    ("temperature", float("inf"), "a finite number >= 0"), ("temperature", "1", "a number"),
    ("top_p", 0.0, r"a number in \(0, 1\]"), ("top_p", 1.5, r"a number in \(0, 1\]"),
    ("top_p", float("nan"), r"a number in \(0, 1\]"),
    ("top_k", 0, "an int >= 1, or None or -1 for all tokens"), ("top_k", -2, "an int >= 1"), ("top_k", 2.5, "an int"),
    ("top_k", True, "an int"),
    ("min_p", -0.1, r"a number in \[0, 1\]"), ("min_p", 1.5, r"a number in \[0, 1\]"),
    ("max_tokens", 0, "an int >= 1"), ("max_tokens", 2.0, "an int >= 1"),
    ("stop", [""], "a non-empty string or a list of them"), ("stop", 5, "a non-empty string"),
    ("stop_token_ids", [-1], "a list of token ids"), ("stop_token_ids", "12", "a list of token ids"),
    ("ignore_eos", 1, "a bool"), ("seed", 1.5, "an int or None"),
    ("logprobs", -1, r"None or an int in \[0, 20\]"), ("logprobs", 21, r"None or an int in \[0, 20\]"),
]


@pytest.mark.parametrize("field,value,expected", BAD_PARAMS, ids=[f"{f}={v!r}" for f, v, _ in BAD_PARAMS])
def test_sampling_params_errors_name_the_field(field, value, expected):
    with pytest.raises(ValueError, match=rf"^SamplingParams: {field} must be {expected}.*; got {re.escape(repr(value))}$"):
        SamplingParams(**{field: value})


def test_sampling_params_defaults_and_spellings():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.stop, p.stop_token_ids, p.seed,
            p.logprobs, p.ignore_eos) == (1.0, 1.0, None, 0.0, 16, [], [], None, None, False)  # vLLM's
    assert SamplingParams(top_k=-1).top_k is None and SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1).temperature == 1.0


def test_call_errors(text_llama, llm):
    with pytest.raises(TypeError, match="generate: max_new_tokens apply to token-id prompts without sampling_params"):
        llm.generate(["hello"], max_new_tokens=4)
    with pytest.raises(TypeError, match="temperature, seed apply to token-id prompts"):
        llm.generate([[1, 2]], greedy(), temperature=1.0, seed=3)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(), greedy()])
    with pytest.raises(ValueError, match="prompt 1: a dict prompt has 'prompt'.*got keys \\['text'\\]"):
        llm.generate(["a", {"text": "b"}])
    with pytest.raises(TypeError, match="prompt 0: expected a string, a list of token ids or a dict; got float"):
        llm.generate([1.5], greedy())
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        llm.generate("hello", greedy(300))


def test_builtin_model_has_no_tokenizer():
    llm = LLM("tiny-llama", level=0, max_num_tokens=32)
    assert llm.tokenizer is None
    for call in (lambda: llm.generate("hello"), lambda: llm.generate([{"prompt": "hi"}], greedy()),
                 lambda: llm.chat([{"role": "user", "content": "hi"}]), lambda: llm.generate_stream("hi")):
        with pytest.raises(ValueError, match="model 'tiny-llama' has no tokenizer .*pass token ids instead"):
            call()
    with pytest.raises(ValueError, match="stop strings are matched on the text.*no tokenizer"):
        llm.generate([[1, 2, 3]], greedy(stop=["x"]))
    (out,) = llm.generate([[1, 2, 3]], greedy(6))  # token ids still work, the text way too
    assert out.text is None and out.token_ids == llm.generate([[1, 2, 3]], 6)[0]


# ------------------------------------------------------------------ stopping
def test_eos_from_generation_config_and_ignore_eos(chain, chain_llm):
    path, tokens = chain
    (out,) = chain_llm.generate("hello", greedy(30))
    assert out.token_ids == tokens and out.text == CHAIN_TEXT  # EOS (generation_config: 2) kept in ids only
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    (out,) = chain_llm.generate("hello", greedy(len(tokens) + 3, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == len(tokens) + 3
    assert out.token_ids[:len(tokens)] == tokens


def test_eos_list_in_generation_config_else_config_json(chain, tmp_path):
    path, tokens = chain
    # generation_config.json's eos_token_id, a list, wins over config.json's
    listed = with_files(path, tmp_path / "listed", {"generation_config.json": {"eos_token_id": [tokens[3], 2]}})
    (out,) = LLM(listed, level=0, max_num_tokens=32).generate("hello", greedy(30))
    assert out.token_ids == tokens[:4] and (out.finish_reason, out.stop_reason) == ("stop", None)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    fallback = with_files(path, tmp_path / "fallback", {"generation_config.json": None,
                                                         "config.json": {**config, "eos_token_id": tokens[7]}})
    llm = LLM(fallback, level=0, max_num_tokens=32)
    assert llm.eos_token_ids == {tokens[7]}
    (out,) = llm.generate("hello", greedy(30))
    assert out.token_ids == tokens[:8] and out.text == "é😀 laz" and out.finish_reason == "stop"


def test_stop_tokens_strings_and_length(chain, chain_llm):
    path, tokens = chain
    tok = chain_llm.tokenizer
    y, do = tok.convert_tokens_to_ids("y"), tok.convert_tokens_to_ids("Ġdo")
    # "y do" spans the tokens "y" and " do": the text stops before it, the ids at the token completing it
    assert tok.decode([y]) == "y" and tok.decode([do]) == " do"
    outs = chain_llm.generate(["hello"] * 5, [
        greedy(30, stop=["y do"]), greedy(30, stop=["here", "dog"]), greedy(30, stop_token_ids=[do]),
        greedy(3), greedy(30, stop=["é"])])
    assert outs[0].text == "é😀 laz" and outs[0].token_ids == tokens[:tokens.index(do) + 1]
    assert (outs[0].finish_reason, outs[0].stop_reason) == ("stop", "y do")
    assert outs[1].text == "é😀 lazy " and outs[1].stop_reason == "dog"  # the earliest of the two
    assert outs[2].token_ids == tokens[:tokens.index(do) + 1] and outs[2].text == "é😀 lazy"  # stop token: no text
    assert (outs[2].finish_reason, outs[2].stop_reason) == ("stop", do)
    # max_tokens in the middle of "😀": ids as generated, the text as transformers decodes them
    assert outs[3].token_ids == tokens[:3] and outs[3].finish_reason == "length" and outs[3].stop_reason is None
    assert outs[3].text == tok.decode(tokens[:3]) == "é\ufffd"
    assert outs[4].text == "" and outs[4].token_ids == tokens[:2]


def test_stopping_with_async_scheduling(chain, chain_llm):
    """Decode steps launched before the last tokens are read: a sequence that stops (stop string, stop token,
    EOS) in the step read late shows no token past its stop; the others go on in the same batch."""
    path, tokens = chain
    do = chain_llm.tokenizer.convert_tokens_to_ids("Ġdo")
    params = [greedy(30, stop=["y do"]), greedy(30, stop_token_ids=[do]), greedy(30), greedy(5),
              greedy(30, ignore_eos=True, stop=["here"])]
    sync = chain_llm.generate(["hello"] * 5, params)
    for max_num_seqs in (2, 8):
        llm = LLM(path, level=0, max_num_tokens=32, max_num_seqs=max_num_seqs, async_scheduling=True)
        assert llm.generate(["hello"] * 5, params) == sync
        assert llm.stats.num_overlapped_steps > 0
        assert llm.kv_cache.num_free_blocks == llm.kv_cache.num_blocks


# ------------------------------------------------------------------ sampling
def test_seeds_reproducible_in_any_batch(text_llama, llm):
    """A seeded request draws from its own generator: the same tokens alone, among other requests (seeded,
    unseeded, greedy, with masks), with prompts chunked over steps, and with async scheduling."""
    path = text_llama[0]
    mine = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    masked = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=11, max_tokens=10, ignore_eos=True)
    alone = llm.generate(["hello world"], mine)[0].token_ids
    alone_masked = llm.generate(["The quick brown"], masked)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0), greedy()]
    chunked = LLM(path, level=0, max_num_tokens=4, max_num_seqs=3)
    overlapped = LLM(path, level=0, max_num_tokens=32, async_scheduling=True)
    for engine in (llm, chunked, overlapped):
        outs = engine.generate(["Café", "hello world", "Stop", "The quick brown", "hello"],
                               [others[0], mine, others[1], masked, others[2]])
        assert outs[1].token_ids == alone and outs[3].token_ids == alone_masked
    assert llm.generate(["hello world"], SamplingParams(temperature=1.0, seed=8, max_tokens=10,
                                                        ignore_eos=True))[0].token_ids != alone


def test_masks(text_llama, llm):
    """top_k=1, a tiny top_p and min_p=1 keep only the most likely token: greedy; every token a top-k
    request samples is among the k most likely (its logprobs list them)."""
    prompts = TEXT_PROMPTS
    ref = [o.token_ids for o in llm.generate(prompts, greedy(10, ignore_eos=True))]
    for only_top in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        params = SamplingParams(temperature=1.5, max_tokens=10, ignore_eos=True, seed=0, **only_top)
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref, only_top
    outs = llm.generate(prompts, SamplingParams(temperature=5.0, top_k=3, logprobs=3, max_tokens=10, seed=0))
    for out in outs:
        for token, lps in zip(out.token_ids, out.logprobs):
            assert list(lps)[0] == token and len(lps) == 3  # its own entry is one of the top 3


def test_logprobs_against_transformers(text_llama, llm):
    path, hf, tok = text_llama
    ids = tok("hello world").input_ids
    (out,) = llm.generate("hello world", greedy(4, logprobs=2, ignore_eos=True))
    assert len(out.logprobs) == 4
    with torch.no_grad():
        ref = hf(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    for token, lps, row in zip(out.token_ids, out.logprobs, ref):
        top = row.topk(2)
        assert list(lps) == [token] + [i for i in top.indices.tolist() if i != token]  # greedy: its token is the top 1
        for i, lp in lps.items():
            assert math.isclose(lp, row[i].item(), abs_tol=1e-4)


# ------------------------------------------------------------------ streaming
def test_stream_whole_characters(chain, chain_llm):
    """"é" and "😀" come one byte a token: no U+FFFD ever, each yielded whole once complete."""
    pieces = list(chain_llm.generate_stream("hello", greedy(30)))
    assert "".join(pieces) == CHAIN_TEXT == chain_llm.generate("hello", greedy(30))[0].text
    assert pieces[:2] == ["é", "😀"] and not any("\ufffd" in p for p in pieces)
    # With a stop string: text that may begin it is held back, never taken back
    pieces = list(chain_llm.generate_stream("hello", greedy(30, stop=["y do"])))
    assert "".join(pieces) == "é😀 laz" and not any("y" in p for p in pieces)


def test_stream_matches_generate_and_frees_on_close(text_llama, llm):
    for prompt in TEXT_PROMPTS:
        (out,) = llm.generate(prompt, greedy(12))
        assert "".join(llm.generate_stream(prompt, greedy(12))) == out.text
    stream = llm.generate_stream("hello world", greedy(50, ignore_eos=True))
    next(stream)
    stream.close()  # ends the request: its cache blocks come back
    assert llm.kv_cache.num_free_blocks == llm.kv_cache.num_blocks


# ------------------------------------------------------------------ chat
def test_chat_applies_the_template(text_llama, llm):
    tok = text_llama[2]
    conversations = [[{"role": "user", "content": "hello"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick"}]]
    outs = llm.chat(conversations, greedy(8))
    for conversation, out in zip(conversations, outs):
        ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert out.prompt_token_ids == ids and out.prompt.endswith("<|assistant|>")
        assert out.prompt_token_ids.count(tok.bos_token_id) == 1  # the template's BOS only
        (by_ids,) = llm.generate([{"prompt_token_ids": ids}], greedy(8))
        assert (by_ids.token_ids, by_ids.text) == (out.token_ids, out.text)
    (again,) = llm.chat(conversations[0], greedy(8))  # one conversation (its prompt's blocks now cached)
    assert (again.prompt, again.token_ids, again.text) == (outs[0].prompt, outs[0].token_ids, outs[0].text)


# ------------------------------------------------------------------ threads
def test_threads_share_one_llm(text_llama):
    """4 threads x different prompts (and calls: text, token ids, streams) on one LLM, 3 calls each: each
    gets what its prompt gives alone."""
    path, _, tok = text_llama
    llm = LLM(path, level=2, max_num_tokens=32, max_num_seqs=8)
    expected = {p: llm.generate(p, greedy(10))[0] for p in TEXT_PROMPTS}
    ids = tok(TEXT_PROMPTS[3]).input_ids
    expected_ids = llm.generate([ids], 10)[0]
    calls = [lambda: llm.generate(TEXT_PROMPTS[0], greedy(10))[0] == expected[TEXT_PROMPTS[0]],
             lambda: llm.generate(TEXT_PROMPTS[1:3], greedy(10)) == [expected[p] for p in TEXT_PROMPTS[1:3]],
             lambda: "".join(llm.generate_stream(TEXT_PROMPTS[2], greedy(10))) == expected[TEXT_PROMPTS[2]].text,
             lambda: llm.generate([ids], 10)[0] == expected_ids]
    barrier = threading.Barrier(len(calls))
    results, errors = [], []

    def worker(call):
        try:
            barrier.wait()
            results.extend(call() for _ in range(3))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 12 and all(results)
    assert llm.kv_cache.num_free_blocks == llm.kv_cache.num_blocks


def test_a_failing_step_fails_its_batch_and_leaves_the_engine_clean(text_llama, llm):
    """A run() chooser that raises: its caller gets the exception; a request of another thread in that batch
    gets a RuntimeError from it (or, had it not joined yet, its tokens); the engine is clean afterwards."""
    expected = llm.generate("hello world", greedy(40, ignore_eos=True))[0]
    started = threading.Event()

    def choose(seqs, logits):
        if seqs[0].num_generated == 3:
            started.wait(timeout=30)
            raise KeyError("chooser")
        return logits.argmax(dim=-1).tolist()

    other = []

    def request():
        started.set()
        try:
            other.append(llm.generate("hello world", greedy(40, ignore_eos=True))[0])
        except (RuntimeError, KeyError) as e:
            other.append(e)

    def from_the_chooser(e):
        """The chooser's KeyError itself (this thread ran the step) or the RuntimeError chained to it."""
        return (isinstance(e, KeyError) and "chooser" in str(e)) or \
            ("a step failed" in str(e) and isinstance(e.__cause__, KeyError))

    thread = threading.Thread(target=request)
    thread.start()
    # Either thread may run the failing step: whichever did gets the KeyError, the other the RuntimeError.
    with pytest.raises((KeyError, RuntimeError)) as raised:
        llm.run([[1, 5, 9]], 8, choose)
    thread.join(timeout=60)
    assert from_the_chooser(raised.value)
    assert other[0] == expected or from_the_chooser(other[0])
    assert llm.kv_cache.num_free_blocks == llm.kv_cache.num_blocks
    assert llm.generate("hello world", greedy(40, ignore_eos=True))[0] == expected


def test_gemma2_text_matches_transformers(tmp_path):
    from models_testing import save_hf_gemma2

    tok = build_tokenizer()
    hf = save_hf_gemma2(tmp_path, vocab_size=len(tok), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), level=0, max_num_tokens=32)
    for prompt, out in zip(TEXT_PROMPTS, llm.generate(TEXT_PROMPTS, greedy(10))):
        ref = hf_generate(hf, tok(prompt).input_ids, 10)
        assert out.token_ids == ref and out.text == tok.decode(ref, skip_special_tokens=True)


# ------------------------------------------------------------------ CLI
def test_cli_prompt(text_llama, llm, capsys):
    path = text_llama[0]
    assert main(["generate", "--model", path, "--prompt", "hello world", "--max-tokens", "8", "--level", "0",
                 "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out == llm.generate("hello world", greedy(8))[0].text + "\n"
    assert "tokens/s" in captured.err
    assert main(["generate", "--model", path, "--prompt", "hello", "--chat", "--max-tokens", "4", "--level", "0",
                 "--device", "cpu", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5", "--seed", "3"]) == 0
    chat = llm.chat([{"role": "user", "content": "hello"}],
                    SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=4))[0]
    assert capsys.readouterr().out == chat.text + "\n"


def test_cli_prompt_errors_in_one_line(capsys):
    assert main(["generate", "--model", "tiny-llama", "--prompt", "hello", "--level", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("dynamo-once generate: LLM.generate_stream: model 'tiny-llama' has no tokenizer")
    assert main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--top-p", "0", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == "dynamo-once generate: SamplingParams: top_p must be a number in (0, 1]; got 0.0\n"


# ------------------------------------------------------------------ Llava
def test_llava_text_and_raw_images_match_transformers(tmp_path):
    """A prompt with one <image> (expanded for the caller) and a PIL image or a uint8 array, resized, cropped
    and normalized as preprocessor_config.json says: LlavaProcessor + transformers generate as the oracle."""
    import numpy as np
    from PIL import Image

    from models.image_processing import load_image_processor

    hf, tok, processor = save_text_llava(tmp_path)
    llm = LLM(str(tmp_path), level=0, max_num_tokens=64)
    prompt = "USER: <image>\nhello world"
    rng = np.random.RandomState(0)
    array = rng.randint(0, 256, (30, 50, 3), dtype=np.uint8)  # wider than high: resized to 28 x 46, cropped
    pil = Image.fromarray(rng.randint(0, 256, (60, 40, 3), dtype=np.uint8))
    for image in (pil, array):
        enc = processor(text=prompt, images=image if image is pil else Image.fromarray(image), return_tensors="pt")
        with torch.no_grad():
            ref = hf.generate(**enc, max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, enc["input_ids"].shape[1]:].tolist()
        (out,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, greedy(8, ignore_eos=True))
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()  # <image> -> 4 image tokens, as HF's processor
        assert out.token_ids == ref and out.text == tok.decode(ref, skip_special_tokens=True)
    # images= beside prompts (one without), and the same image as pixel values
    pixels = processor.image_processor(pil, return_tensors="pt")["pixel_values"][0]
    a, b = llm.generate([prompt, "hello world"], greedy(8, ignore_eos=True), images=[pil, None])
    assert llm.generate([{"prompt": prompt, "multi_modal_data": {"image": pixels}}], greedy(8, ignore_eos=True))[0] == a
    assert b == llm.generate("hello world", greedy(8, ignore_eos=True))[0]
    # Without transformers' processor: CLIP's steps from the config fields, the same pixels
    torch.testing.assert_close(load_image_processor(str(tmp_path), use_transformers=False)([pil, array]),
                               processor.image_processor([pil, Image.fromarray(array)], return_tensors="pt")["pixel_values"],
                               rtol=0, atol=1e-6)
    builtin = LLM("tiny-llava", level=0, max_num_tokens=32)  # random weights: no preprocessor_config.json
    with pytest.raises(ValueError, match="prompt 0: raw images .* need the checkpoint's preprocessor_config.json"):
        builtin.generate([[1, builtin.model.config.image_token_index]], greedy(), images=[pil])
