"""vLLM's chat-template fields in ``/v1/chat/completions`` and ``LLM.chat``: ``add_generation_prompt``,
``continue_final_message`` (the answer goes on from the assistant's last message) and ``chat_template_kwargs`` (the
template's own variables), each the prompt transformers' ``apply_chat_template`` renders with them, and the greedy
completion of that prompt."""

import pytest

from models import LLM, SamplingParams

from test_serve import httpx, start_server  # noqa: I001 - skips without the serving extras

from text_testing import CHAT_TEMPLATE, build_tokenizer, save_text_llama

TEMPLATE = "{% if hint %}<|hint|>{{ hint }}\n{% endif %}" + CHAT_TEMPLATE
USER = {"role": "user", "content": "hello there"}
PARTIAL = {"role": "assistant", "content": "The quick"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("template_llama")
    tok = build_tokenizer()
    tok.chat_template = TEMPLATE
    save_text_llama(path, tok)
    llm = LLM(str(path), level=0, max_num_tokens=64)
    from models.serve.app import build_app

    url, server = start_server(build_app(llm, "m"))
    yield url, llm
    server.should_exit = True


def chat(url, **body):
    return httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "temperature": 0, "max_tokens": 6, **body},
                      timeout=60)


def expected(llm, messages, **kw):
    """The prompt's ids as transformers renders it, and their greedy completion."""
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6))[0]
    return len(ids), out.text


@pytest.mark.parametrize("fields, kw", [
    ({"continue_final_message": True, "add_generation_prompt": False},
     {"continue_final_message": True, "add_generation_prompt": False}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    ({"chat_template_kwargs": {"hint": "be brief"}}, {"hint": "be brief", "add_generation_prompt": True}),
])
def test_the_prompt_is_the_templates_with_the_fields(served, fields, kw):
    url, llm = served
    messages = [USER, PARTIAL] if fields.get("continue_final_message") else [USER]
    r = chat(url, messages=messages, **fields)
    assert r.status_code == 200, r.text
    n, text = expected(llm, messages, **kw)
    assert r.json()["usage"]["prompt_tokens"] == n and r.json()["choices"][0]["message"]["content"] == text
    plain = chat(url, messages=messages if not fields.get("continue_final_message") else [USER])
    assert plain.json()["usage"]["prompt_tokens"] != n  # the fields changed the prompt


@pytest.mark.parametrize("fields, messages", [
    ({"continue_final_message": True}, [USER, PARTIAL]),  # add_generation_prompt defaults to true
    ({"continue_final_message": True, "add_generation_prompt": False}, [USER]),  # nothing of the assistant's
    ({"chat_template_kwargs": {"tools": []}}, [USER]),
])
def test_contradictions_name_the_field(served, fields, messages):
    url, _ = served
    r = chat(url, messages=messages, **fields)
    param = "chat_template_kwargs" if "chat_template_kwargs" in fields else "continue_final_message"
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_llm_chat_takes_the_same_fields(served):
    _, llm = served
    params = SamplingParams(temperature=0, max_tokens=6)
    (out,) = llm.chat([USER, PARTIAL], params, add_generation_prompt=False, continue_final_message=True)
    assert (len(out.prompt_token_ids), out.text) == expected(llm, [USER, PARTIAL], add_generation_prompt=False,
                                                              continue_final_message=True)
    (out,) = llm.chat([USER], params, chat_template_kwargs={"hint": "be brief"})
    assert (len(out.prompt_token_ids), out.text) == expected(llm, [USER], hint="be brief", add_generation_prompt=True)
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat([USER, PARTIAL], params, continue_final_message=True)


def test_tokenize_renders_the_same(served):
    url, llm = served
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for body, kw in [({"continue_final_message": True, "add_generation_prompt": False},
                      {"continue_final_message": True, "add_generation_prompt": False}),
                     ({"chat_template_kwargs": {"hint": "be brief"}}, {"hint": "be brief", "add_generation_prompt": True}),
                     ({"tools": tools}, {"tools": tools, "add_generation_prompt": True})]:
        messages = [USER, PARTIAL] if body.get("continue_final_message") else [USER]
        r = httpx.post(f"{url}/tokenize", json={"messages": messages, **body}, timeout=30)
        text = llm.tokenizer.apply_chat_template(messages, tokenize=False, **kw)
        assert r.status_code == 200 and r.json()["tokens"] == llm.tokenizer.encode(text, add_special_tokens=False)
    r = httpx.post(f"{url}/tokenize", json={"messages": [USER], "continue_final_message": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
