"""``SamplingParams.prompt_logprobs`` against transformers (levels 0 and 3, prompts in chunks, beside prefix
caching), and the server's ``echo`` (with ``logprobs``: what evaluation harnesses ask for a loglikelihood)."""

import pytest
import torch

from models import LLM, SamplingParams

from text_testing import save_text_llama

transformers = pytest.importorskip("transformers")

TEXT = "hello world, the quick brown fox"


@pytest.fixture(scope="module")
def text_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt_logprobs_llama")
    return (str(path), *save_text_llama(path))


def reference(hf, ids):
    """transformers' log-probability of each prompt token after the first, given the ones before it."""
    with torch.no_grad():
        logprobs = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)], logprobs


@pytest.mark.parametrize("level, kw", [(0, {}), (3, {}), (0, dict(max_num_tokens=4)),
                                       (0, dict(enable_prefix_caching=True))])
def test_prompt_logprobs_match_transformers(text_llama, level, kw):
    path, hf, tok = text_llama
    llm = LLM(path, level=level, **{"max_num_tokens": 32, **kw})
    ids = tok.encode(TEXT)
    expected, logprobs = reference(hf, ids)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    for _ in range(2):  # the second time, with prefix caching, the prompt is cached: asking computes it anyway
        out = llm.generate({"prompt_token_ids": ids}, params)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        got = [row[t] for row, t in zip(out.prompt_logprobs[1:], ids[1:])]
        assert got == pytest.approx(expected, abs=1e-4)
        assert out.num_cached_tokens == 0
    top = logprobs[2].topk(3)
    row = out.prompt_logprobs[3]  # the third token's: its own, then the 3 most likely after 3 tokens
    assert set(top.indices.tolist()) <= set(row) and len(row) <= 4
    assert [row[i] for i in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=2))[0].prompt_logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 1.5])
def test_prompt_logprobs_errors_name_the_field(value):
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an int in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)


def test_server_echo(text_llama):
    """``echo``: the prompt's text before the completion's; with ``logprobs``, the prompt's tokens and their
    logprobs first (the first token's null), as OpenAI's legacy completions."""
    openai = pytest.importorskip("openai")
    from models.serve.app import build_app

    from test_serve import start_server

    path, hf, tok = text_llama
    llm = LLM(path, level=0, max_num_tokens=32)
    url, server = start_server(build_app(llm, "m"))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="m", prompt=TEXT, max_tokens=1, temperature=0, echo=True, logprobs=1)
        ids = tok.encode(TEXT)
        completion = llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=1))[0]
        choice = got.choices[0]
        assert choice.text == TEXT + completion.text
        assert choice.logprobs.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
        expected, _ = reference(hf, ids)
        assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:len(ids)] == pytest.approx(expected, abs=1e-4)
        assert len(choice.logprobs.token_logprobs) == len(ids) + 1
        plain = client.completions.create(model="m", prompt=TEXT, max_tokens=4, temperature=0, echo=True)
        assert plain.choices[0].text == TEXT + llm.generate(TEXT, SamplingParams(temperature=0, max_tokens=4))[0].text
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt=TEXT, max_tokens=4, temperature=0, echo=True, stream=True))
        assert streamed == plain.choices[0].text
    finally:
        server.should_exit = True


@pytest.mark.cuda
def test_on_the_gpu_prompt_logprobs_match_transformers(text_llama):
    """Level 3 on the GPU (the prompt's piecewise forward, in 8-token chunks): fp32 within 1e-3 of transformers'
    fp32 on the CPU."""
    path, hf, tok = text_llama
    llm = LLM(path, level=3, device="cuda", dtype=torch.float32, max_num_tokens=8)
    ids = tok.encode(TEXT)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    expected, _ = reference(hf, ids)
    assert [row[t] for row, t in zip(out.prompt_logprobs[1:], ids[1:])] == pytest.approx(expected, abs=1e-3)
