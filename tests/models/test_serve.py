"""``dynamo-once serve``: a live server (uvicorn in a thread, an ephemeral port on 127.0.0.1) over the tiny
text Llama of text_testing at level 0, driven by the official ``openai`` client and by raw HTTP; offline
``LLM.generate`` / ``LLM.chat`` / ``LLM.stream_outputs`` as the oracle."""

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from models import LLM, SamplingParams

from text_testing import save_text_llama

pytest.importorskip("transformers")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
try:  # the openai client's HTTP library: httpx2 in its recent releases, httpx before
    import httpx2 as httpx
except ImportError:
    httpx = pytest.importorskip("httpx")

MODEL = "tiny-text-llama"
API_KEY = "sk-test"
PROMPTS = ["hello world", "The quick brown", "Café crème", "Stop"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_llama")
    save_text_llama(path)
    return LLM(str(path), level=0, max_num_tokens=32, max_num_seqs=8)


def start_server(app):
    """uvicorn serving ``app`` in a daemon thread on a free port; (base url, server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


@pytest.fixture(scope="module")
def server(llm):
    from models.serve.app import build_app

    url, srv = start_server(build_app(llm, MODEL, api_key=API_KEY, max_body_bytes=4096))
    yield url
    srv.should_exit = True


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, route, body, key=API_KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server}/v1/{route}", json=body, headers=headers, timeout=60)


def free_blocks_when_idle(llm, expected, timeout=10):
    """Wait until the engine's free cache blocks are back to ``expected`` (an abort lands between steps)."""
    deadline = time.monotonic() + timeout
    while llm.kv_cache.num_free_blocks != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return llm.kv_cache.num_free_blocks


# ------------------------------------------------------------------ the routes, against the offline engine
def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_equals_generate(llm, client):
    expected = llm.generate(PROMPTS[0], greedy())[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=12)
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason
    n_prompt, n_new = len(expected.prompt_token_ids), len(expected.token_ids)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (
        n_prompt, n_new, n_prompt + n_new)


def test_completion_sampling_fields(llm, client):
    params = dict(temperature=0.8, top_p=0.9, max_tokens=8, seed=3)
    extensions = dict(top_k=20, min_p=0.05)
    expected = llm.generate(PROMPTS[1], SamplingParams(stop=["zz"], **params, **extensions))[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], stop=["zz"], extra_body=extensions, **params)
    assert got.choices[0].text == expected.text  # the seed: the same draw in any batch


def test_completion_of_several_prompts(llm, server, client):
    """A list of prompts (text or token ids): each prompt's n choices in order, index i * n + j, as
    ``LLM.generate`` gives them; usage counts each prompt once; streamed and echoed alike; past max_num_seqs a 400."""
    kw = dict(temperature=0.9, max_tokens=6, seed=2)
    expected = llm.generate(PROMPTS[:3], SamplingParams(n=2, **kw))
    got = client.completions.create(model=MODEL, prompt=PROMPTS[:3], n=2, **kw)
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == [c.text for o in expected for c in o.outputs]
    assert got.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert got.usage.completion_tokens == sum(len(c.token_ids) for o in expected for c in o.outputs)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:2]]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert [c.text for c in by_ids.choices] == [p + o.text for p, o in zip(PROMPTS[:2], llm.generate(PROMPTS[:2],
                                                                                                   greedy(4)))]
    texts = ["", "", ""]
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[:3], stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [o.text for o in llm.generate(PROMPTS[:3], SamplingParams(**kw))]
    r = post(server, "completions", {"model": MODEL, "prompt": PROMPTS[:3], "n": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_completion_token_ids_and_logprobs(llm, client):
    ids = llm.tokenizer.encode(PROMPTS[2])
    expected = llm.generate({"prompt_token_ids": ids}, greedy(4, logprobs=2))[0]
    got = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=4, logprobs=2)
    lp = got.choices[0].logprobs
    assert got.choices[0].text == expected.text
    assert lp.token_logprobs == pytest.approx([row[t] for row, t in zip(expected.logprobs, expected.token_ids)])
    # keyed by token text: two byte tokens that both decode to U+FFFD share a key
    assert [len(row) for row in lp.top_logprobs] == [len({llm.tokenizer.decode([t]) for t in row})
                                                      for row in expected.logprobs]


def test_chat_equals_llm_chat(llm, client):
    expected = llm.chat(CHAT, greedy())[0]
    got = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    assert got.choices[0].message.content == expected.text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.token_ids)


def test_chat_logprobs(llm, client):
    expected = llm.chat(CHAT, greedy(3, logprobs=2))[0]
    got = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=3, logprobs=True,
                                         top_logprobs=2)
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([r[t] for r, t in zip(expected.logprobs,
                                                                                expected.token_ids)])
    assert all(len(c.top_logprobs) == 2 for c in content)


# ------------------------------------------------------------------ streaming
def test_completion_stream_equals_non_streamed(llm, client):
    # 48 tokens: the engine thread may run several steps before the server's loop wakes (a chunk then carries their
    # text together; with 16, on a loaded 2-core machine, all of them once: two chunks)
    expected = llm.generate(PROMPTS[0], greedy(48, ignore_eos=True))[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=48,
                                            extra_body={"ignore_eos": True}, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 2  # it streamed
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 48


def test_chat_stream_equals_chat(llm, client):
    expected = llm.chat(CHAT, greedy())[0]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=12,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_stream_is_server_sent_events_ending_in_done(server):
    body = {"model": MODEL, "prompt": PROMPTS[3], "temperature": 0, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert json.loads(events[0][6:])["object"] == "text_completion"


# ------------------------------------------------------------------ concurrency and disconnects
def test_concurrent_clients_each_get_their_own_result(llm, client, monkeypatch):
    expected = [out.text for out in llm.generate(PROMPTS, greedy(10, ignore_eos=True))]
    results, errors = [None] * 4, []

    def ask(i):
        try:
            if i % 2:
                stream = client.completions.create(model=MODEL, prompt=PROMPTS[i], temperature=0, max_tokens=10,
                                                   extra_body={"ignore_eos": True}, stream=True)
                results[i] = "".join(c.choices[0].text for c in stream if c.choices)
            else:
                results[i] = client.completions.create(model=MODEL, prompt=PROMPTS[i], temperature=0, max_tokens=10,
                                                       extra_body={"ignore_eos": True}).choices[0].text
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    batch_sizes = []
    execute = llm._engine._execute

    def counting(batch, *args, **kwargs):
        batch_sizes.append(len(batch))
        return execute(batch, *args, **kwargs)

    monkeypatch.setattr(llm._engine, "_execute", counting)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert results == expected
    # continuous batching: the requests shared steps (alone, each takes 10: one prefill + 9 decodes)
    assert max(batch_sizes) > 1 and len(batch_sizes) < 4 * 10


def test_64_concurrent_requests_share_one_decode_batch(llm):
    """64 non-streamed requests at once (openai.AsyncOpenAI, a task each) all run together: the engine's
    decode batch reaches 64 (a pool of fewer threads, or requests taken one after another, would not)."""
    from models.serve.app import build_app

    n, max_tokens = 64, 240  # long enough for the first request to outlast the last one's arrival
    llm64 = LLM(llm.model_name, level=0, max_num_tokens=64, max_num_seqs=n, num_cache_tokens=n * 256)
    url, srv = start_server(build_app(llm64, MODEL))
    free = llm64.kv_cache.num_free_blocks
    prompts = [[3 + i % 50, 4, 5, 6] for i in range(n)]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(ac.completions.create(
                model=MODEL, prompt=p, temperature=0, max_tokens=max_tokens, extra_body={"ignore_eos": True})
                for p in prompts))

    try:
        outs = asyncio.run(run())
    finally:
        srv.should_exit = True
    assert [o.usage.completion_tokens for o in outs] == [max_tokens] * n
    assert llm64.stats.max_decode_batch == n
    assert llm64.kv_cache.num_free_blocks == free
    expected = llm64.generate([{"prompt_token_ids": p} for p in prompts[:3]], greedy(max_tokens, ignore_eos=True))
    assert [o.choices[0].text for o in outs[:3]] == [e.text for e in expected]


def test_offline_callers_share_the_engine_with_the_server(llm, client):
    """LLM.generate on other threads while the server's requests run: whoever runs a step runs everyone's,
    and each gets its own result (the server's requests ended in another caller's steps included)."""
    expected = [out.text for out in llm.generate(PROMPTS, greedy(24, ignore_eos=True))]
    offline, errors = [None] * 2, []

    def generate(i):
        try:
            offline[i] = [o.text for o in llm.generate(PROMPTS, greedy(24, ignore_eos=True))]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    served = [client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=24,
                                        extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    for t in threads:
        t.join(60)
    assert not errors
    assert served == expected and offline == [expected, expected]


def test_a_cancelled_request_frees_its_sequence(llm):
    """A request whose coroutine is cancelled (a handler the server cancels) is aborted between two steps."""
    from models.serve.bridge import AsyncLLM

    free = llm.kv_cache.num_free_blocks
    engine = AsyncLLM(llm)

    async def run():
        task = asyncio.ensure_future(engine.generate(PROMPTS[0], greedy(240, ignore_eos=True)))
        while not llm.engine.scheduler.running:  # admitted: it holds its blocks
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        while llm.kv_cache.num_free_blocks != free:
            await asyncio.sleep(0.005)
        assert llm.stats.num_generated < 240  # aborted, not run to its end
        return await engine.generate(PROMPTS[1], greedy(6))

    try:
        out = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        engine.shutdown()
    assert out.text == llm.generate(PROMPTS[1], greedy(6))[0].text


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_mid_stream_frees_the_sequence(llm, server, client, n):
    """A client that leaves a stream: its sequence (each of its ``n`` completions') ends and frees its blocks."""
    free = llm.kv_cache.num_free_blocks
    body = {"model": MODEL, "prompt": PROMPTS[0], "temperature": 0, "max_tokens": 200, "ignore_eos": True,
            "stream": True, "n": n}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # it runs; then the client leaves
    assert free_blocks_when_idle(llm, free) == free
    assert llm.stats.num_generated < n * 200  # ended early, not run to max_tokens (the request's steps' stats)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], temperature=0, max_tokens=6)
    assert got.choices[0].text == llm.generate(PROMPTS[1], greedy(6))[0].text


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("route, body, status, param", [
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "hi", "n": 9}, 400, "n"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "top_k": "many"}, 400, "top_k"),
    ("completions", {"prompt": "hi", "frequency_penalty": 3}, 400, "frequency_penalty"),
    ("chat/completions", {"messages": CHAT, "presence_penalty": -2.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 4}, 400, "min_tokens"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "hi " * 600, "max_tokens": 1}, 400, "prompt"),
    ("completions", {"prompt": [10**6]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 10**6}, 400, "max_tokens"),
    ("completions", {}, 400, "prompt"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": CHAT, "n": 30}, 400, "n"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "stream": True}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 1, "stream": True}, 400, "logprobs"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": CHAT, "model": "gpt-4"}, 404, "model"),
])
def test_bad_request_gets_the_error_shape(server, route, body, status, param):
    r = post(server, route, {"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


def test_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError, match="n must be at most 8"):
        client.completions.create(model=MODEL, prompt="hi", n=9)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)


def test_bad_json_wrong_key_and_oversized_body(server):
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=10,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    for key in ("wrong", None):
        r = post(server, "completions", {"model": MODEL, "prompt": "hi"}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = post(server, "completions", {"model": MODEL, "prompt": "x" * 5000})
    assert r.status_code == 413 and "error" in r.json()
    assert httpx.get(f"{server}/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 404


# ------------------------------------------------------------------ the command
def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "models.cli", "serve", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_serves_on_localhost(llm, tmp_path):
    """The command end to end: port 0 (a free one, printed), 127.0.0.1 by default, the key from the
    environment, the model's id its path."""
    path = llm.model_name
    env = {**os.environ, "DYNAMO_ONCE_API_KEY": "sk-env", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "models.cli", "serve", "--model", path, "--port", "0",
                             "--level", "0", "--max-num-tokens", "32", "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()
        match = re.search(r"on http://(127\.0\.0\.1):(\d+)/v1", line)
        assert match, line
        url = f"http://127.0.0.1:{match.group(2)}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-env", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [path]
        got = client.completions.create(model=path, prompt=PROMPTS[0], temperature=0, max_tokens=6)
        assert got.choices[0].text == llm.generate(PROMPTS[0], greedy(6))[0].text
        assert httpx.get(f"{url}/v1/models").status_code == 401
    finally:
        proc.terminate()
        proc.wait(30)


def test_cli_bad_checkpoint_is_one_line(tmp_path):
    r = run_cli("--model", str(tmp_path / "missing"), "--port", "0")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("dynamo-once serve: ")


def test_cli_help():
    r = run_cli("--help")
    assert r.returncode == 0 and "--host" in r.stdout and "127.0.0.1" in r.stdout


@pytest.mark.parametrize("port", ["http", "70000"])
def test_cli_bad_port_is_one_line(port):
    r = run_cli("--model", "unused", "--port", port)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"dynamo-once serve: --port must be an integer in [0, 65535]; got {port!r}"]


def test_a_failed_step_is_a_500_in_the_error_shape(llm, server, monkeypatch):
    """The forward fails in the step that admits the prompt: a 500 in the error shape, the blocks the step
    took back, the next request served."""
    free = llm.kv_cache.num_free_blocks

    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(llm._engine, "_execute", fail)
    r = post(server, "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 500 and "injected" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert free_blocks_when_idle(llm, free) == free
    assert post(server, "completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_response_ids_are_unique_and_make_no_system_call(monkeypatch):
    """A request's id reads no ``os.urandom`` (a system call on the event loop, whose GIL hand-back waits for
    the engine thread's step); ids stay unique and in OpenAI's shape."""
    from models.serve import protocol

    def no_urandom(n):
        raise AssertionError("new_id read os.urandom")

    monkeypatch.setattr(os, "urandom", no_urandom)
    ids = [protocol.new_id("cmpl") for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids)


def test_engine_thread_reads_non_streamed_requests_only_when_a_sequence_ended():
    """After a step that ended no sequence, the engine thread looks at its streams alone: 64 non-streamed
    requests are not read (each read of ``done`` was ~10 us a step on the engine's critical path); after one
    that ended some, it notifies exactly the ended ones."""
    import types

    from models.serve.engine_thread import EngineThread

    reads = []

    class Req:
        def __init__(self, i):
            self.i, self.ended, self.seq = i, False, object()

        @property
        def done(self):
            reads.append(self.i)
            return self.ended

        visible_text = ""

    scheduler = types.SimpleNamespace(stats=types.SimpleNamespace(num_steps=0), num_ended=0)
    engine = types.SimpleNamespace(scheduler=scheduler, stepping=False, submit=lambda seqs: None,
                                   abort=lambda seqs: None, run_until=lambda done: time.sleep(0.01))
    loop = asyncio.new_event_loop()
    thread = EngineThread(engine, loop)
    notified = []
    try:
        requests = [Req(i) for i in range(64)]
        for r in requests:
            thread.add(r, lambda i=r.i: notified.append(i), stream=False)
        streamed = Req(64)
        thread.add(streamed, lambda: notified.append(64), stream=True)
        thread._between_steps()  # the first look after the adds: every request
        assert sorted(set(reads)) == list(range(65))
        reads.clear()
        scheduler.stats.num_steps += 1  # a step that ended none: the stream alone
        thread._between_steps()
        assert reads == [64]
        reads.clear()
        requests[3].ended = requests[7].ended = True
        scheduler.stats.num_steps += 1
        scheduler.num_ended += 2  # a step that ended two: all of them, the two notified
        thread._between_steps()
        assert sorted(set(reads)) == list(range(65))
        loop.run_until_complete(asyncio.sleep(0.01))
        assert notified == [3, 7]
        reads.clear()
        scheduler.stats.num_steps += 1
        thread._between_steps()
        assert reads == [64]
    finally:
        thread.close()
        thread._thread.join(5)
        loop.close()


def test_step_hook_wraps_every_step_on_the_thread_that_runs_it(llm, client):
    """``EngineLoop.step_hook`` runs each step exactly once, on its thread: the served request's steps on the
    engine thread, offline ``LLM.generate``'s on the caller's; one hook call per ``Scheduler.step`` (the CPU
    steps are synchronous: one per ``stats.num_steps``)."""
    calls = []

    def hook(step):
        calls.append(threading.current_thread().name)
        step()

    llm.engine.step_hook = hook
    try:
        out = client.completions.create(model=MODEL, prompt=[3, 4, 5], temperature=0, max_tokens=6,
                                        extra_body={"ignore_eos": True})
        served = list(calls)
        calls.clear()
        llm.generate([{"prompt_token_ids": [3, 4, 5]}], greedy(6, ignore_eos=True))
    finally:
        llm.engine.step_hook = None
    assert out.usage.completion_tokens == 6
    assert served == ["dynamo-once-engine"] * len(served) and len(served) >= 6
    assert calls == [threading.current_thread().name] * llm.stats.num_steps


def test_bodies_are_the_bytes_fastapi_writes_for_the_dict(server):
    """Non-streamed bodies go out pre-serialized (no jsonable_encoder walk): byte for byte what FastAPI wrote
    for the returned dict (its encoder, then JSONResponse: compact, UTF-8 unescaped), logprobs and non-ASCII
    text included; application/json."""
    from fastapi.encoders import jsonable_encoder
    from fastapi.responses import JSONResponse

    asks = [("completions", {"model": MODEL, "prompt": "Café crème", "max_tokens": 5, "temperature": 0,
                             "logprobs": 2}),
            ("chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4, "temperature": 0,
                                  "logprobs": True, "top_logprobs": 2})]
    for route, body in asks:
        r = post(server, route, body)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert r.content == JSONResponse(jsonable_encoder(json.loads(r.content))).body
    r = httpx.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.content == JSONResponse(jsonable_encoder(r.json())).body and r.json()["data"][0]["id"] == MODEL
