"""The server's routes besides the OpenAI API (vLLM's): ``/health`` and ``/version`` without the API key,
``/tokenize`` and ``/detokenize`` against the checkpoint's tokenizer and chat template, ``/reset_prefix_cache``."""

import time

import pytest

from models import LLM, SamplingParams

from test_serve import API_KEY, MODEL, httpx, start_server  # noqa: I001 - skips without the serving extras

from text_testing import save_text_llama

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_utility_llama")
    save_text_llama(path)
    return LLM(str(path), level=0, max_num_tokens=32, max_num_seqs=4)


@pytest.fixture(scope="module")
def served(llm):
    from models.serve.app import build_app

    app = build_app(llm, MODEL, api_key=API_KEY)
    url, srv = start_server(app)
    yield url, app
    srv.should_exit = True


def test_health_and_version_need_no_key_and_the_rest_does(served):
    url, _ = served
    r = httpx.get(f"{url}/health", timeout=10)
    assert r.status_code == 200 and r.content == b""
    r = httpx.get(f"{url}/version", timeout=10)
    assert r.status_code == 200 and isinstance(r.json()["version"], str) and r.json()["version"]
    for route, body in (("tokenize", {"prompt": "hi"}), ("detokenize", {"tokens": [1]}), ("reset_prefix_cache", {})):
        r = httpx.post(f"{url}/{route}", json=body, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", route


def test_tokenize_is_the_tokenizer_and_the_chat_template(llm, served):
    url, _ = served
    tok = llm.tokenizer
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hello world"}, headers=AUTH, timeout=10)
    assert r.status_code == 200
    assert r.json() == {"count": len(tok.encode("hello world")), "max_model_len": llm.max_model_len,
                        "tokens": list(tok.encode("hello world"))}
    r = httpx.post(f"{url}/tokenize", json={"prompt": "hello world", "add_special_tokens": False}, headers=AUTH,
                   timeout=10)
    assert r.json()["tokens"] == list(tok.encode("hello world", add_special_tokens=False))
    # A conversation: the prompt /v1/chat/completions and LLM.chat compute
    (out,) = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=1))
    r = httpx.post(f"{url}/tokenize", json={"messages": CHAT}, headers=AUTH, timeout=10)
    assert r.json()["tokens"] == out.prompt_token_ids
    r = httpx.post(f"{url}/tokenize", json={"messages": CHAT, "add_generation_prompt": False}, headers=AUTH,
                   timeout=10)
    without = r.json()["tokens"]
    assert len(without) < len(out.prompt_token_ids) and out.prompt_token_ids[:len(without)] == without


def test_detokenize_inverts_tokenize(llm, served):
    url, _ = served
    ids = httpx.post(f"{url}/tokenize", json={"prompt": "Café crème", "add_special_tokens": False}, headers=AUTH,
                     timeout=10).json()["tokens"]
    r = httpx.post(f"{url}/detokenize", json={"tokens": ids}, headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.json() == {"prompt": "Café crème"}


@pytest.mark.parametrize("route, body, status, param", [
    ("tokenize", {"prompt": "hi", "messages": CHAT}, 400, "prompt"),
    ("tokenize", {}, 400, "prompt"),
    ("tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("tokenize", {"prompt": "hi", "extra": 1}, 400, "extra"),
    ("tokenize", {"messages": []}, 400, "messages"),
    ("detokenize", {"tokens": [1, 10 ** 9]}, 400, "tokens"),
    ("detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_requests_name_the_field(served, route, body, status, param):
    url, _ = served
    r = httpx.post(f"{url}/{route}", json=body, headers=AUTH, timeout=10)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.json()


def test_reset_prefix_cache_frees_the_cached_blocks(llm, served):
    url, _ = served
    prompt = list(range(3, 3 + 40))  # two whole 16-token blocks and a part
    for _ in range(2):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                       headers=AUTH, timeout=60)
        assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # the second found the first's
    r = httpx.post(f"{url}/reset_prefix_cache", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["freed_blocks"] >= 2
    assert httpx.post(f"{url}/reset_prefix_cache", headers=AUTH, timeout=30).json() == {"freed_blocks": 0}
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
                   headers=AUTH, timeout=60)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed again


def test_health_is_503_once_the_engine_has_stopped(llm):
    from models.serve.app import build_app

    app = build_app(llm, MODEL)
    url, srv = start_server(app)
    try:
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=60)
        assert r.status_code == 200 and httpx.get(f"{url}/health", timeout=10).status_code == 200
        app.state.engine.shutdown()  # what the server's shutdown does
        deadline = time.monotonic() + 10
        while (r := httpx.get(f"{url}/health", timeout=10)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    finally:
        srv.should_exit = True


def scrape(url):
    """``/metrics`` (no key) as {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_the_requests_tokens_and_latencies(llm, served):
    pytest.importorskip("prometheus_client")
    url, _ = served
    before = scrape(url)
    prompt = [5, 6, 7, 8, 9]
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                   "ignore_eos": True}, headers=AUTH, timeout=60)
    assert r.status_code == 200
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "prompt": "hello world", "max_tokens": 4, "ignore_eos": True,
                            "stream": True}) as s:
        assert s.status_code == 200 and "[DONE]" in "".join(s.iter_text())
    after = scrape(url)

    def grew(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    streamed_prompt = len(llm.tokenizer.encode("hello world"))
    assert grew("dynamo_once:prompt_tokens_total") == len(prompt) + streamed_prompt
    assert grew("dynamo_once:generation_tokens_total") == 3 + 4
    assert grew("dynamo_once:request_success_total", (("finished_reason", "length"),)) == 2
    assert grew("dynamo_once:e2e_request_latency_seconds_count") == 2
    assert grew("dynamo_once:e2e_request_latency_seconds_sum") > 0
    assert grew("dynamo_once:time_to_first_token_seconds_count") == 1  # the streamed one
    assert after[("dynamo_once:num_requests_running", ())] == 0  # both ended
    assert after[("dynamo_once:num_requests_waiting", ())] == 0
    assert 0.0 <= after[("dynamo_once:kv_cache_usage_perc", ())] < 1.0
    assert after[("dynamo_once:num_preemptions_total", ())] == llm.scheduler.num_preemptions


def test_metrics_count_preemptions(tmp_path):
    """Concurrent requests in a cache too small for all of them: the scrape counts the preemptions."""
    import concurrent.futures

    from models.serve.app import build_app

    save_text_llama(tmp_path)
    small = LLM(str(tmp_path), level=0, max_num_tokens=32, max_num_seqs=4, num_cache_tokens=96,
                enable_prefix_caching=False)
    url, srv = start_server(build_app(small, MODEL))
    try:
        def ask(i):
            return httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": [3 + i] * 20, "max_tokens": 40, "ignore_eos": True}).status_code
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(ask, range(4))) == [200] * 4
        assert scrape(url)[("dynamo_once:num_preemptions_total", ())] == small.scheduler.num_preemptions > 0
    finally:
        srv.should_exit = True
