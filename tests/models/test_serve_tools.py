"""Tool calling in ``/v1/chat/completions`` through the openai client: the tools reach the chat template; with
``tool_choice`` "auto" a whole JSON tool call in the output comes back as ``tool_calls``; a named tool or "required"
constrains the output to the call's JSON; "none" shows no tools. The model is a "chain" checkpoint whose greedy
output after the prompt is one added token: the JSON text of a call."""

import json

import pytest

from models import LLM

from test_serve import httpx, start_server  # noqa: I001 - skips without the serving extras

from text_testing import CHAT_TEMPLATE, build_tokenizer, save_chain_llama

pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
#: The template shows the tools as JSON before the conversation
TEMPLATE = "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}" + CHAT_TEMPLATE
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "hello there"}]


def serve_writer(path, call):
    """A server whose model's greedy answer to ASK is ``call`` (one added token), then EOS."""
    tok = build_tokenizer()
    tok.add_tokens([call])
    tok.chat_template = TEMPLATE
    last = prompt_ids(tok, ASK)[-1]
    save_chain_llama(path, [last, tok.convert_tokens_to_ids(call), tok.eos_token_id], tok, max_position_embeddings=1024)
    llm = LLM(str(path), level=0, max_num_tokens=64)
    from models.serve.app import build_app

    url, server = start_server(build_app(llm, "m"))
    return url, server, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60), llm


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    url, server, client, llm = serve_writer(tmp_path_factory.mktemp("tool_llama"), CALL)
    yield url, client, llm
    server.should_exit = True


def test_hermes_blocks_are_calls_too(tmp_path):
    hermes = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
              '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    _, server, client, _ = serve_writer(tmp_path, hermes)
    try:
        calls = ask(client, tools=[WEATHER, TIME]).message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", {"city": "Rome"}), ("get_time", {})]
        one = ask(client, tools=[WEATHER, TIME], parallel_tool_calls=False).message.tool_calls
        assert [c.function.name for c in one] == ["get_weather"]
    finally:
        server.should_exit = True


def prompt_ids(tok, messages, **kw):
    """The chat prompt's token ids, as the server computes them."""
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw),
                      add_special_tokens=False)


def ask(client, **kw):
    return client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=40, **kw).choices[0]


def test_auto_returns_the_call_the_model_wrote(served):
    _, client, llm = served
    assert llm.chat(ASK)[0].text == CALL  # what the model writes
    choice = ask(client, tools=[WEATHER, TIME])
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_call_of_no_given_tool_stays_content(served):
    _, client, _ = served
    choice = ask(client, tools=[TIME])
    assert choice.message.content == CALL and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_the_template_sees_the_tools_unless_none(served):
    url, _, llm = served
    body = {"model": "m", "messages": ASK, "max_tokens": 1, "tools": [WEATHER]}
    shown = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).json()["usage"]["prompt_tokens"]
    hidden = httpx.post(f"{url}/v1/chat/completions", json={**body, "tool_choice": "none"},
                        timeout=30).json()["usage"]["prompt_tokens"]
    plain, with_tools = len(prompt_ids(llm.tokenizer, ASK)), len(prompt_ids(llm.tokenizer, ASK, tools=[WEATHER]))
    assert hidden == plain and shown == with_tools > plain


def test_none_returns_the_text(served):
    _, client, _ = served
    choice = ask(client, tools=[WEATHER], tool_choice="none")
    assert choice.message.content is not None and not choice.message.tool_calls


def test_a_named_tool_constrains_the_arguments(served):
    _, client, _ = served
    choice = ask(client, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None


def test_required_constrains_the_output_to_calls(served):
    """``parallel_tool_calls: false``: one call (the array's length bounded; a random model may add items)."""
    _, client, _ = served
    choice = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=120,
                                            tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time")
        assert call.function.name != "get_weather" or args["city"] in ("Paris", "Rome")


def test_streamed_tool_calls_come_whole(served):
    _, client, _ = served
    chunks = list(client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=40,
                                                 tools=[WEATHER], stream=True, stream_options={"include_usage": True}))
    calls = [c for ch in chunks for choice in ch.choices for c in choice.delta.tool_calls or ()]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert [choice.finish_reason for ch in chunks for choice in ch.choices if choice.finish_reason] == ["tool_calls"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}, "tools.0.function.bogus"),
])
def test_bad_tool_fields_name_themselves(served, body, param):
    url, _, _ = served
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": ASK, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
