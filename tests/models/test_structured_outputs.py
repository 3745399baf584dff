"""``SamplingParams.structured_outputs``: outputs that follow a JSON schema, any JSON object, a regex, a choice or
an EBNF grammar (xgrammar), greedy and sampled, at levels 0 and 3, beside unconstrained rows; the errors; the
server's ``response_format`` and vLLM's fields."""

import json
import re

import pytest
import torch

from models import LLM, SamplingParams, StructuredOutputsParams

from text_testing import save_text_llama

pytest.importorskip("xgrammar")
pytest.importorskip("transformers")

PROMPTS = ["hello world", "The quick brown", "Café crème", "Stop"]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured_llama")
    save_text_llama(path)
    return str(path)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, level=0, max_num_tokens=32)


def constrained(so, **kw):
    return SamplingParams(**{"temperature": 0, "max_tokens": 60, "structured_outputs": so, **kw})


def assert_schema(text):
    value = json.loads(text)
    assert set(value) == {"ok", "color", "n"} and isinstance(value["ok"], bool)
    assert value["color"] in ("red", "green", "blue") and isinstance(value["n"], int) and 0 <= value["n"] <= 99


@pytest.mark.parametrize("level", [0, 3])
def test_json_schema_greedy_and_sampled(path, llm, level):
    runner = llm if level == 0 else LLM(path, level=3, max_num_tokens=32)
    so = StructuredOutputsParams(json=SCHEMA)
    outs = runner.generate(PROMPTS, [constrained(so), constrained(so, temperature=1.0, seed=1),
                                     constrained(so, temperature=0.8, top_p=0.9, seed=2),
                                     constrained(so, temperature=1.0, seed=3, frequency_penalty=1.0)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert_schema(out.text)
    again = StructuredOutputsParams(json=json.dumps(SCHEMA))  # the schema as JSON text: the same constraint
    assert runner.generate(PROMPTS[0], constrained(again))[0].text == outs[0].text


def test_regex_choice_grammar_and_json_object(llm):
    cases = [(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             (StructuredOutputsParams(choice=["yes", "no", 'say "hi"\n']), lambda t: t in ("yes", "no", 'say "hi"\n')),
             (StructuredOutputsParams(grammar='root ::= "a" x x? ".\\n"\nx ::= "b" | "c"'),
              lambda t: re.fullmatch(r"a[bc]{1,2}\.\n", t)),
             ]
    for so, check in cases:
        for sampled in (dict(), dict(temperature=1.0, seed=7)):
            outs = llm.generate(PROMPTS, constrained(so, max_tokens=100, **sampled))
            for out in outs:
                assert out.finish_reason == "stop" and check(out.text), (so.kind, out.text)
    # Any JSON object: from random weights a key (any string) may not end in 100 tokens; those that end parse
    outs = llm.generate(PROMPTS, constrained(StructuredOutputsParams(json_object=True), max_tokens=100))
    assert all(o.text.startswith("{") for o in outs) and any(o.finish_reason == "stop" for o in outs)
    assert all(isinstance(json.loads(o.text), dict) for o in outs if o.finish_reason == "stop")


def test_constrained_and_free_rows_share_a_batch(path, llm):
    """The unconstrained rows as alone; with async scheduling (no step launched ahead while a constrained row
    runs: its next mask needs its last token) both kinds as in the synchronous engine."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [constrained(StructuredOutputsParams(json=SCHEMA)), free, constrained(StructuredOutputsParams(
        choice=["up", "down"])), free]
    outs = llm.generate(PROMPTS, params)
    alone = llm.generate([PROMPTS[1], PROMPTS[3]], free)
    assert [outs[1].token_ids, outs[3].token_ids] == [a.token_ids for a in alone]
    assert_schema(outs[0].text) and outs[2].text in ("up", "down")
    overlapping = LLM(path, level=0, max_num_tokens=32, async_scheduling=True)
    assert [o.token_ids for o in overlapping.generate(PROMPTS, params)] == [o.token_ids for o in outs]
    assert [o.token_ids for o in overlapping.generate([PROMPTS[1], PROMPTS[3]], free)] == [a.token_ids for a in alone]
    assert overlapping.stats.num_overlapped_steps > 0  # without a constrained row, steps overlap again


def test_too_few_tokens_end_by_length(llm):
    out = llm.generate(PROMPTS[0], constrained(StructuredOutputsParams(json=SCHEMA), max_tokens=4))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and out.text.startswith("{")


@pytest.mark.parametrize("kw, expected", [
    (dict(), r"exactly one of json, json_object, regex, choice, grammar; got 'none'"),
    (dict(regex="a", choice=["b"]), r"exactly one of .*; got \['regex', 'choice'\]"),
    (dict(json="{not json"), "json as a JSON schema .*text that is not JSON"),
    (dict(json=[1]), "json as a JSON schema"),
    (dict(choice="yes"), "choice as a non-empty list of non-empty strings"),
    (dict(choice=["a", ""]), "choice as a non-empty list of non-empty strings"),
    (dict(regex=""), "regex as a non-empty string"),
])
def test_params_errors(kw, expected):
    with pytest.raises(ValueError, match=f"StructuredOutputsParams: expected {expected}"):
        StructuredOutputsParams(**kw)


def test_request_errors_name_the_field(llm):
    with pytest.raises(ValueError, match="structured_outputs.regex cannot be compiled"):
        llm.generate("hi", constrained(StructuredOutputsParams(regex="(unclosed")))
    with pytest.raises(ValueError, match="structured_outputs.grammar cannot be compiled"):
        llm.generate("hi", constrained(StructuredOutputsParams(grammar="root ::= undefined_rule")))
    with pytest.raises(ValueError, match="ignore_eos must be False with structured_outputs"):
        constrained(StructuredOutputsParams(json_object=True), ignore_eos=True)
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json_object": True})
    builtin = LLM("tiny-llama", level=0, device="cpu")
    with pytest.raises(ValueError, match="has no tokenizer"):
        builtin.generate([[1, 2, 3]], constrained(StructuredOutputsParams(json_object=True)))


@pytest.mark.cuda
def test_on_the_gpu_outputs_follow_the_schema(path):
    """Level 3 on the GPU (CUDA graphs; async scheduling on, off while a constrained row runs): the mask applied
    to the device's logits."""
    llm = LLM(path, level=3, device="cuda", dtype=torch.float32, max_num_tokens=32)
    so = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate(PROMPTS, [constrained(so), constrained(so, temperature=1.0, seed=1),
                                  SamplingParams(temperature=0, max_tokens=8), constrained(so, temperature=0.7)])
    for i in (0, 1, 3):
        assert outs[i].finish_reason == "stop"
        assert_schema(outs[i].text)


def test_server_response_format_and_vllm_fields(llm):
    openai = pytest.importorskip("openai")
    from models.serve.app import build_app

    from test_serve import httpx, start_server

    url, server = start_server(build_app(llm, "m"))
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
        got = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                             max_tokens=60, response_format=fmt)
        assert_schema(got.choices[0].message.content)
        expected = llm.chat([{"role": "user", "content": "hi"}], constrained(StructuredOutputsParams(json=SCHEMA)))
        assert got.choices[0].message.content == expected[0].text
        obj = client.completions.create(model="m", prompt="hi", max_tokens=80, temperature=0,  # vLLM's extension there
                                        extra_body={"response_format": {"type": "json_object"}})
        expected = llm.generate("hi", constrained(StructuredOutputsParams(json_object=True), max_tokens=80))[0]
        assert obj.choices[0].text == expected.text and obj.choices[0].text.startswith("{")
        for extra in ({"structured_outputs": {"choice": ["left", "right"]}}, {"guided_choice": ["left", "right"]}):
            pick = client.completions.create(model="m", prompt="hi", max_tokens=8, extra_body=extra)
            assert pick.choices[0].text in ("left", "right")
        text = "".join(c.choices[0].text for c in client.completions.create(
            model="m", prompt="hi", max_tokens=20, stream=True, extra_body={"guided_regex": "[a-c]{4}!"}))
        assert re.fullmatch("[a-c]{4}!", text)
        for body, param in [({"guided_regex": "("}, "guided_*"), ({"structured_outputs": {"regex": "a", "json": {}}},
                            "structured_outputs"), ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
                            "response_format"), ({"response_format": {"type": "json_schema"}}, "response_format"),
                            ({"structured_outputs": {"pattern": "a"}}, "structured_outputs")]:
            for stream in (False, True):
                r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "stream": stream, **body}, timeout=30)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    finally:
        server.should_exit = True
