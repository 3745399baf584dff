"""The OpenAI-compatible server against offline ``LLM.generate`` on the same ``models.LLM`` (issue 14).

For each model (built-in random weights, level 3), the server runs in the LLM's process (uvicorn in a
thread, 127.0.0.1, an ephemeral port) and the official ``openai`` client (``AsyncOpenAI``, in processes of
their own, ``--clients-per-proc`` clients each, as a load generator runs) drives ``/v1/completions`` with
token-id prompts of ``--prompt-len`` random tokens and ``ignore_eos`` (the vLLM extension the server
takes), so every request generates exactly ``--max-tokens`` tokens:

- concurrency 1: time per output token of a streamed request, (last token's arrival - first token's) /
  (tokens after the first chunk), median over ``--repeats`` requests, against the median decode step of
  ``LLM.generate`` on the same request;
- concurrency C (``--concurrency``, default 16, 64): C requests (asyncio tasks) released together, output
  tokens/s = all their tokens / (last response - release), against ``LLM.generate`` of the same C
  requests as one list (tokens / its wall time). Where the last batch's time went: its requests' arrivals
  at the engine after the release (``arrive_ms``), the engine's busy time from the first (``engine_ms``),
  the last step to the last response (``tail_ms``); its steps, mixed and overlapped steps, median decode
  step and largest decode batch against offline's.

Built-in models have no tokenizer, and the server streams text: the LLM gets :class:`IdTokenizer`, which
writes token ``i`` as ``" i"`` (the offline runs detokenize with it too, so both sides pay the same).
``ratio`` is served / offline (ms per token: at most 1.05 is the target; tokens/s: at least 0.9).
``--step-profile`` adds, per concurrency > 1, the engine's steps served against offline by phase (arrivals,
middle, responses): wall and CPU time of the stepping thread, the event loop thread's CPU, the gaps
(:mod:`benchmarks.serve_steps`; ``serve_steps.csv`` and ``.png``).
Usage: ``python -m benchmarks.serve [--models llama-3.2-1b,llama-3-8b] [--step-profile] [--out DIR]``; ``--quick``
runs tiny-llama on the CPU at concurrency 1 and 4 to check the harness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from benchmarks import common, serve_steps

TARGETS = {"ms/token": 1.05, "tokens/s": 0.9}  # served / offline: at most (latency), at least (throughput)


class IdTokenizer:
    """A stand-in tokenizer for random-weight models: token ``i`` decodes to ``" i"``; no text way in."""

    eos_token_id = None
    chat_template = None

    def encode(self, text: str, **_: Any) -> list[int]:
        raise ValueError("IdTokenizer: send token ids")

    def decode(self, ids: Any, **_: Any) -> str:
        return "".join(f" {int(i)}" for i in ids)


def start_server(llm: Any, model_name: str,
                 arrivals: list[float] | None = None) -> tuple[str, Any, threading.Thread]:
    """uvicorn serving ``llm`` in a daemon thread on a free port of 127.0.0.1; (base url, server, the thread:
    the event loop's). With ``arrivals``, the time each non-streamed request reaches the engine is appended
    to it. uvicorn picks its loop and HTTP parser (``auto``: uvloop and httptools when installed, as
    ``dynamo-once serve`` does)."""
    import uvicorn

    from models.serve.app import build_app

    app = build_app(llm, model_name)
    if arrivals is not None:
        engine = app.state.engine
        generate = engine.generate

        async def timed(*args: Any, **kwargs: Any) -> Any:
            arrivals.append(time.perf_counter())
            return await generate(*args, **kwargs)

        engine.generate = timed
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="serve-loop", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start in 60 s")
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", server, thread


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


async def _stream_one(client: Any, model: str, prompt: list[int], max_tokens: int) -> float:
    """One streamed request: ms per output token after the first chunk (each token is one word). The server sends
    what a step added since its last chunk, so a client that lags gets several tokens a chunk; if the whole output
    came in one chunk (a loaded CPU), ms per token from the request's start instead (prefill included)."""
    start = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    first = last = None
    after_first = tokens = 0
    async for chunk in stream:
        if not chunk.choices or not chunk.choices[0].text:
            continue
        n = len(chunk.choices[0].text.split())
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            after_first += n
        last, tokens = now, tokens + n
    if tokens != max_tokens:
        raise RuntimeError(f"a streamed request gave {tokens} tokens, not {max_tokens}")
    if after_first == 0:
        return (last - start) / tokens * 1e3
    return (last - first) / after_first * 1e3


async def _batch(client: Any, model: str, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """All of ``batch`` at once, one request each (not streamed): their output tokens and the time the last
    response came (``time.perf_counter``: CLOCK_MONOTONIC, one clock for every process of the machine)."""
    async def one(prompt: list[int]) -> int:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    counts = await asyncio.gather(*(one(p) for p in batch))
    if sum(counts) != max_tokens * len(batch):
        raise RuntimeError(f"{len(batch)} requests gave {sum(counts)} tokens, not {max_tokens * len(batch)}")
    return dict(tokens=sum(counts), done=time.perf_counter())


async def _client_run(job: dict[str, Any]) -> None:
    """Per batch: say ``ready``, read the release time (a line of stdin), wait for it, run the batch, print
    its result (a JSON line)."""
    import openai

    # The client's connection pool (1000 by default) lets every request of a batch run at once.
    async with openai.AsyncOpenAI(base_url=job["url"], api_key="none", max_retries=0, timeout=600) as client:
        for b in job["batches"]:
            print("ready", flush=True)
            release = float(sys.stdin.readline())
            await asyncio.sleep(max(0.0, release - time.perf_counter()))
            if job["stream"]:
                result: Any = await _stream_one(client, job["model"], b[0], job["max_tokens"])
            else:
                result = await _batch(client, job["model"], b, job["max_tokens"]) if b else None
            print(json.dumps(result), flush=True)


def client_main() -> None:
    """A clients' process: a JSON job on the first line of stdin (see :func:`_client_run`)."""
    asyncio.run(_client_run(json.loads(sys.stdin.readline())))


def split_cpus(server_cpus: int | None) -> tuple[set[int] | None, set[int] | None]:
    """Pin this (the server's) process to its first ``server_cpus`` CPUs and return ``(server's, clients')``;
    ``(None, None)``: no split (``server_cpus`` 0, or None with fewer than 4 CPUs to split).

    The load generator must not take the server's cores: at 64 clients the clients' processes parse 64
    responses at once, and on shared cores the OS preempted the engine thread between and inside the last
    steps (H200, 64 client processes and the server on 8 cores: the responses' 17 steps took 77 ms against 35
    offline, 38 ms of it with the engine thread off the CPU, and 62 ms of gaps between them, while the event loop
    used 14 ms), a cost of the benchmark's machine that a server whose clients are elsewhere does not pay.
    Default (None): a quarter of the CPUs, at least 2.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if server_cpus == 0 or (server_cpus is None and len(cpus) < 4):
        return None, None
    n = max(2, len(cpus) // 4) if server_cpus is None else server_cpus
    if not 0 < n < len(cpus):
        raise ValueError(f"--server-cpus: expected 0 (no split) or 1..{len(cpus) - 1} of this process's "
                         f"{len(cpus)} CPUs, got {server_cpus}")
    server, clients = set(cpus[:n]), set(cpus[n:])
    os.sched_setaffinity(0, server)
    return server, clients


def run_clients(url: str, model: str, batches: list[list[list[int]]], max_tokens: int, stream: bool,
                per_proc: int = 0, cpus: set[int] | None = None) -> list[tuple[float, float]]:
    """The requests from other processes, one ``asyncio`` task a request, ``per_proc`` requests a process (0:
    one process for all). Each batch is released to every process at once; per batch: (streamed ms per token
    (one prompt a batch) or output tokens/s, the release time).

    As a load generator runs: the clients' HTTP and JSON work stays off the server's interpreter. One process
    a client by default, as users are: the ``openai`` client spends ~3-4 ms of CPU building a request of 128
    token ids (its typed transform walks every id), and one event loop builds all of its tasks' requests
    before the first is whole on the wire (a task yields between its headers and its body). With 8 clients a
    process (the old default) the server got the first request's headers 4 ms after the release but its body
    at 19 ms, behind seven other users' builds (tiny-llama, 2 CPU cores; the H200 run's first arrival, 20-29
    ms, is that wait): time no user sees, whose own request costs one build. The release stays the moment
    every client starts its request, so each user's own build is still counted.
    """
    size = max(len(b) for b in batches)
    procs = 1 if stream or not per_proc else -(-size // per_proc)
    children = [subprocess.Popen([sys.executable, "-m", "benchmarks.serve", "--client"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    if cpus:  # ``cpus``: the clients' own CPUs (split_cpus)
        for child in children:
            os.sched_setaffinity(child.pid, cpus)
    results = []
    try:
        for i, child in enumerate(children):
            job = dict(url=url, model=model, batches=[b[i::procs] for b in batches], max_tokens=max_tokens,
                       stream=stream)
            child.stdin.write(json.dumps(job) + "\n")
            child.stdin.flush()
        for b in batches:
            for child in children:
                if child.stdout.readline().strip() != "ready":
                    raise RuntimeError("a clients' process failed (its stderr is above)")
            release = time.perf_counter() + 0.05
            for child in children:
                child.stdin.write(f"{release}\n")
                child.stdin.flush()
            got = [json.loads(child.stdout.readline()) for child in children]
            if stream:
                results.append((got[0], release))
            else:
                done = [g for g in got if g is not None]
                wall = max(g["done"] for g in done) - release
                results.append((sum(g["tokens"] for g in done) / wall, release))
    finally:
        for child in children:
            child.stdin.close()
            if child.wait(60) != 0:
                raise RuntimeError(f"a clients' process failed (rc {child.returncode})")
    return results


def offline(llm: Any, batch: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """``LLM.generate`` of ``batch``: (median decode step in ms, output tokens/s over the call's wall time)."""
    wall = common.generate_exactly(llm, batch, max_tokens)
    return llm.stats.median_decode_step_s * 1e3, max_tokens * len(batch) / wall


COLUMNS = ["model", "concurrency", "metric", "served", "offline", "ratio", "target", "arrive_ms", "engine_ms",
           "tail_ms", "steps", "mixed", "overlapped", "decode_ms", "max_batch"]


def row(model: str, concurrency: int, metric: str, served: float, off: float, **where: Any) -> dict[str, Any]:
    ratio = served / off
    ok = ratio <= TARGETS[metric] if metric == "ms/token" else ratio >= TARGETS[metric]
    r = dict(model=model, concurrency=concurrency, metric=metric, served=round(served, 3),
             offline=round(off, 3), ratio=round(ratio, 3), target=("PASS" if ok else "MISS"), **where)
    print(r, flush=True)
    return r


def bench_model(name: str, a: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                step_rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Every measurement of one model: one LLM, one server over it; offline and served runs alternate. With
    ``step_rows`` (``--step-profile``), each concurrency's per-step summary (:mod:`.serve_steps`) is appended."""
    from models import LLM

    cmax = max(a.concurrency)
    llm = LLM(name, level=a.level, max_num_tokens=max(512, cmax), max_num_seqs=cmax, dtype=dtype,
              device=device, num_cache_tokens=cmax * (a.prompt_len + a.max_tokens + 32), tokenizer=IdTokenizer(),
              enable_prefix_caching=False)  # every concurrency serves the same prompts
    arrivals: list[float] = []
    url, server, loop_thread = start_server(llm, name, arrivals)
    profile = None if step_rows is None else serve_steps.StepProfile(llm.engine, loop_thread.ident)
    rows = []
    try:
        one = prompts(a.repeats, a.prompt_len, llm.vocab_size, seed=1)
        offline(llm, one[:1], a.max_tokens)  # warm-up, both sides
        run_clients(url, name, [one[:1]], a.max_tokens, stream=True, cpus=a.client_cpu_set)
        off = statistics.median(offline(llm, [p], a.max_tokens)[0] for p in one)
        srv = statistics.median(t for t, _ in run_clients(url, name, [[p] for p in one], a.max_tokens, stream=True,
                                                          cpus=a.client_cpu_set))
        rows.append(row(name, 1, "ms/token", srv, off))
        for c in a.concurrency:
            if c == 1:
                continue
            rows.append(concurrent(llm, name, url, c, a, arrivals, profile, step_rows))
    finally:
        server.should_exit = True
        if profile is not None:
            profile.close()
    del llm
    return rows


def concurrent(llm: Any, name: str, url: str, c: int, a: argparse.Namespace, arrivals: list[float],
               profile: serve_steps.StepProfile | None, step_rows: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Concurrency ``c``: offline runs, then served batches (the first warms the clients' connections); the
    medians' row. With ``profile``, the steps of the last offline run and the last served batch, summarized
    into ``step_rows``."""
    batch = prompts(c, a.prompt_len, llm.vocab_size, seed=c)
    offline(llm, batch, a.max_tokens)  # warm-up: this batch size's graphs
    speeds = []
    for _ in range(a.batch_repeats):
        if profile is not None:
            profile.take()  # the last run's steps only
        speeds.append(offline(llm, batch, a.max_tokens)[1])
    off_stats = llm.stats
    off_steps = profile.take() if profile is not None else []
    loop_cpu = profile.loop_cpu() if profile is not None else 0.0
    runs = run_clients(url, name, [batch] * (a.batch_repeats + 1), a.max_tokens, False, a.clients_per_proc,
                       a.client_cpu_set)
    release = runs[-1][1]
    where = breakdown(llm.stats, off_stats, [t - release for t in arrivals[-c:]], c * a.max_tokens / runs[-1][0])
    if profile is not None:
        served_steps = [s for s in profile.take() if s.t0 >= release]
        step_rows += serve_steps.summary(off_steps, None, model=name, concurrency=c, side="offline")
        step_rows += serve_steps.summary(served_steps, max(arrivals[-c:]), model=name, concurrency=c, side="served")
        step_rows[-1]["loop_us_per_req"] = round((profile.loop_cpu() - loop_cpu) / (c * len(runs)) * 1e6, 1)
    return row(name, c, "tokens/s", statistics.median(t for t, _ in runs[1:]), statistics.median(speeds), **where)


def breakdown(served: Any, off: Any, arrivals: list[float], wall: float) -> dict[str, Any]:
    """Where the last served batch's time went (seconds since its release, in ms): its requests' arrivals at
    the engine (first-last), the engine's busy time from the first, from the last step to the last response;
    its steps, mixed (prefill + decode) steps, overlapped (async) steps, median decode step and largest decode
    batch against the last offline run's."""
    engine_end = min(arrivals) + served.total_s
    return dict(arrive_ms=f"{min(arrivals) * 1e3:.1f}-{max(arrivals) * 1e3:.1f}",
                engine_ms=round(served.total_s * 1e3, 1), tail_ms=round((wall - engine_end) * 1e3, 1),
                steps=f"{served.num_steps}/{off.num_steps}", mixed=f"{served.num_mixed_steps}/{off.num_mixed_steps}",
                overlapped=f"{served.num_overlapped_steps}/{off.num_overlapped_steps}",
                decode_ms=f"{served.median_decode_step_s * 1e3:.3f}/{off.median_decode_step_s * 1e3:.3f}",
                max_batch=f"{served.max_decode_batch}/{off.max_decode_batch}")


def save(rows: list[dict[str, Any]], a: argparse.Namespace, device: torch.device, tag: str) -> None:
    common.write_results(
        f"serve{tag}", rows, COLUMNS, title="OpenAI-compatible server against offline LLM.generate", device=device,
        out_dir=a.out,
        notes=[f"prompts of {a.prompt_len} random token ids, {a.max_tokens} output tokens each (ignore_eos), "
               f"greedy; level {a.level}; server in the LLM's process on 127.0.0.1, the clients in others "
               f"(openai.AsyncOpenAI, one asyncio task a request, {a.clients_per_proc or 'all'} a process); "
               f"{a.cpu_note}; GIL switch interval {sys.getswitchinterval() * 1e3:g} ms",
               "ms/token (concurrency 1): served = streamed (last token - first token) / tokens after the first "
               "(the whole output in one chunk: from the request's start); "
               f"offline = LLM.generate's median decode step; median of {a.repeats} requests; target ratio <= 1.05",
               f"tokens/s: all clients released together; offline = LLM.generate of the same requests as one list; "
               f"median of {a.batch_repeats}; target ratio >= 0.9",
               "the last batch: arrive_ms = its requests' arrivals at the engine (ms after the release, first-last), "
               "engine_ms = the engine's busy time from the first, tail_ms = its last step to the last response; "
               "steps, mixed (prefill + decode) steps, overlapped (async) steps, median decode step, largest decode "
               "batch: served/offline"])
    speed = [dict(model=r["model"], concurrency=r["concurrency"],
                  pct=round(100 * (1 / r["ratio"] if r["metric"] == "ms/token" else r["ratio"]), 1)) for r in rows]
    common.plot_lines(f"serve{tag}", speed, x="concurrency", y="pct", series="model", logx=True, out_dir=a.out,
                      title=f"Served speed as % of offline ({common.device_name(device)})",
                      xlabel="concurrent clients", ylabel="% of offline (1: per token; else tokens/s)",
                      hlines={"target c=1": 100 / TARGETS["ms/token"], "target c>1": 100 * TARGETS["tokens/s"]})


def quick_defaults(a: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--quick``: concurrency 1 and 4, 16-token prompts, 8 tokens, 2 and 1 repeats, unless given."""
    for key, quick in dict(concurrency="1,4", prompt_len=16, max_tokens=8, repeats=2, batch_repeats=1).items():
        if getattr(a, key) == parser.get_default(key):
            setattr(a, key, quick)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama-3.2-1b,llama-3-8b")
    p.add_argument("--concurrency", default="1,16,64", help="client counts; 1 measures ms per token")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="requests at concurrency 1 (median)")
    p.add_argument("--batch-repeats", type=int, default=3, help="runs at each concurrency > 1 (median)")
    p.add_argument("--level", type=int, default=3)
    p.add_argument("--clients-per-proc", type=int, default=1,
                   help="clients a load-generating process runs (0: all in one process; see run_clients)")
    p.add_argument("--quick", action="store_true", help="tiny-llama on the CPU, concurrency 1 and 4")
    p.add_argument("--step-profile", action="store_true",
                   help="per engine step at each concurrency > 1: wall, engine and event-loop CPU, gaps, by phase, "
                        "served against offline (benchmarks/serve_steps.py; serve_steps*.csv and .png with --out)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval in the server's process (seconds; default: the interpreter's, 0.005): "
                        "how long the engine thread may wait for the GIL held by the event loop's thread")
    p.add_argument("--server-cpus", type=int, default=None,
                   help="CPUs the server's process keeps, the clients' processes taking the others (default: a quarter, "
                        "at least 2; 0: no split, as on a machine with fewer than 4)")
    p.add_argument("--out", default=None)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.client:
        client_main()
        return []
    if a.switch_interval is not None:
        if not a.switch_interval > 0:
            p.error(f"--switch-interval: expected seconds > 0, got {a.switch_interval}")
        sys.setswitchinterval(a.switch_interval)
    try:
        server_cpus, a.client_cpu_set = split_cpus(a.server_cpus)
    except ValueError as e:
        p.error(str(e))
    a.cpu_note = ("server and clients on the same CPUs" if server_cpus is None else
                  f"server on {len(server_cpus)} CPUs, the clients' processes on the other {len(a.client_cpu_set)}")
    if a.quick:
        quick_defaults(a, p)
    a.concurrency = sorted({1, *(int(c) for c in a.concurrency.split(","))})
    if a.quick:
        device, dtype, names = torch.device("cpu"), torch.float32, ["tiny-llama"]
    else:
        device, dtype, names = torch.device("cuda"), torch.bfloat16, a.models.split(",")
    rows: list[dict[str, Any]] = []
    step_rows: list[dict[str, Any]] | None = [] if a.step_profile else None
    tag = "_quick" if a.quick else ""
    for name in names:
        rows += bench_model(name, a, device, dtype, step_rows)
        save(rows, a, device, tag)  # after every model: a run cut short keeps what it measured
        if step_rows is not None:
            common.write_results(f"serve_steps{tag}", step_rows, serve_steps.COLUMNS, device=device, out_dir=a.out,
                                 title="Engine steps served against offline, by phase", notes=serve_steps.NOTES)
            serve_steps.plot(f"serve_steps{tag}", step_rows, a.out)
    return rows


if __name__ == "__main__":
    main()
