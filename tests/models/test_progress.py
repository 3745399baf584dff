"""``LLM.generate(..., use_tqdm=True)`` and ``LLM.chat(..., use_tqdm=True)``, vLLM's keyword: a progress bar."""

from models import LLM, SamplingParams


def test_use_tqdm_shows_the_prompts_processed(capsys):
    """A bar on stderr reaching every prompt, with the output tokens a second; nothing without it (the default)."""
    llm = LLM("tiny-llama", level=0, device="cpu", max_num_tokens=64, enable_prefix_caching=False)
    ps, params = [[3, 4, 5], [6, 7], [8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert llm.generate(ps, params, use_tqdm=True) == llm.generate(ps, params)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "tok/s" in err
    assert llm.generate(ps, 4, use_tqdm=True) == llm.generate(ps, 4)  # the token-id way too
    assert "3/3" in capsys.readouterr().err
    llm.generate(ps, params)
    assert capsys.readouterr().err == ""
