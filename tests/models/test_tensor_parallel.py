"""Tensor parallelism (models.parallel): TP=2 over gloo on the CPU (two processes: this one as rank 0 and a
spawned worker) against TP=1 (levels 0/2/3, async scheduling, the CLI, the HTTP server); the collectives as
single graph nodes; per-rank checkpoint slices; worker failures reported as errors naming the rank, and no
process outliving its group; bad sizes and unsupported models refused; the all-reduce choice by size. The
two-GPU tests (NCCL with CUDA graphs, symmetric memory) are marked cuda and need two GPUs."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from dispatcher import compat, CompilationConfig, compilation_counter, set_compilation_config
from models import BUILTIN_MODELS, LLM, CheckpointError, ForwardContext, SamplingParams, attention_layers, set_forward_context
from models.loader import build_model, init_random_weights, load_model, load_weights, read_config, _weight_files
from models.parallel import TensorParallelState, init_tensor_parallel, destroy_tensor_parallel, use_tensor_parallel
from models.parallel import executor
from models.parallel.executor import _REPORT_WAIT_S, WorkerError
from models.parallel import symmetric
from models.parallel.linear import RowParallelLinear
from models.parallel.symmetric import AllReduceLimits, limits_from_env

from models_testing import LLAMA3_SCALING, PROMPTS, save_hf_gemma2, save_hf_llama
from pass_testing import counted_after

NEW_TOKENS = 6
# Odd vocabulary: the last rank's slice is padded (64 + 63 rows); biases on QKV, o, gate-up, down.
LLAMA_OVERRIDES = dict(vocab_size=127, attention_bias=True, mlp_bias=True, rope_scaling=LLAMA3_SCALING)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_llama")
    save_hf_llama(path, **LLAMA_OVERRIDES)
    return str(path)


@pytest.fixture(scope="module")
def gemma2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_gemma2")
    save_hf_gemma2(path)  # tied embeddings: the LM head is the vocab-parallel embedding's slice
    return str(path)


def _greedy(path, level, tp, **kwargs):
    llm = LLM(path, level=level, max_num_tokens=16, max_num_seqs=4, tensor_parallel_size=tp, **kwargs)
    try:
        return llm.generate(PROMPTS, NEW_TOKENS)  # chunked prefill: 16-token steps, prompts and decodes mixed
    finally:
        llm.close()


@pytest.mark.parametrize("level", [0, 2, 3])
@pytest.mark.parametrize("model", ["llama", "gemma2"])
def test_tp2_greedy_equals_tp1(model, level, request):
    path = request.getfixturevalue(f"{model}_dir")
    expected = _greedy(path, level, 1)
    t0 = time.perf_counter()
    assert _greedy(path, level, 2) == expected
    assert time.perf_counter() - t0 < 120


@pytest.mark.parametrize("level", [0, 2])
def test_tp2_async_scheduling(level, llama_dir):
    """Async scheduling: each decode step's input ids are rank 0's sampled tokens, broadcast to rank 1 (on
    the CPU async scheduling is off unless asked for)."""
    assert _greedy(llama_dir, level, 2, async_scheduling=True) == _greedy(llama_dir, level, 1)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tp2_preemption_equals_one_rank(async_scheduling, llama_dir):
    """A cache too small for every sequence at once: rank 0 grows and preempts, the workers patch their block tables
    as rank 0's (the staged patches); the tokens are one rank's with a roomy cache."""
    prompts = [[(11 * i + 5 * j) % 120 + 2 for j in range(18 + i % 3)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    roomy = LLM(llama_dir, level=0, max_num_tokens=32, max_num_seqs=6)
    expected = roomy.generate(prompts, params)
    llm = LLM(llama_dir, level=0, max_num_tokens=32, max_num_seqs=6, num_cache_tokens=112, tensor_parallel_size=2,
              async_scheduling=async_scheduling)
    try:
        outs = llm.generate(prompts, params)
        assert llm.stats.num_preemptions > 0
        assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
        for o, e in zip(outs, expected):  # a stale block-table row on rank 1 moves them by ~1e-2
            assert all(abs(a[t] - b[t]) < 1e-4 for a, b in zip(o.logprobs, e.logprobs) for t in a)
    finally:
        llm.close()


# ------------------------------------------------------------------ one process: shards, graph structure
def _rank(rank, world_size=2, group_name=None):
    """Build as ``rank`` of ``world_size`` without a group (collectives are the identity)."""
    return use_tensor_parallel(TensorParallelState(rank, world_size, group_name, None))


@pytest.mark.parametrize("source", ["checkpoint", "built-in"])
def test_each_rank_holds_its_slices(source, llama_dir):
    """Rank r's parameters are its slices of the TP=1 model's (checkpoint: read as slices; built-in: the same
    random draws as TP=1, sliced)."""
    def build():
        if source == "built-in":
            return load_model("tiny-llama")
        model = build_model(read_config(llama_dir), where=llama_dir)
        load_weights(model, _weight_files(llama_dir), progress=False)
        return model

    full = dict(build().named_parameters())
    for rank in range(2):
        with _rank(rank):
            shard = build()
        modules = dict(shard.named_modules())
        for name, param in shard.named_parameters():
            module = modules[name.rpartition(".")[0]]
            whole = not hasattr(module, "tp_shard") or (isinstance(module, RowParallelLinear) and name.endswith("bias"))
            # norms and row-parallel biases are whole on every rank; column-parallel biases sliced as the rows
            expected = full[name] if whole else module.tp_shard(full[name])
            torch.testing.assert_close(param, expected, rtol=0, atol=0, msg=f"rank {rank}: {name}")


@pytest.fixture
def one_rank_group():
    """A gloo group of this process alone: its all-reduce is the identity, but a real collective op."""
    store = dist.HashStore()
    state = init_tensor_parallel(0, 1, "gloo", store, 60)
    yield state.group_name
    destroy_tensor_parallel(state)


def test_all_reduce_is_one_graph_node_at_level_3(one_rank_group):
    """Built as rank 0 of 2 over a one-rank group: the 5 all-reduces (embedding; o_proj and down_proj of 2
    layers) stay one node each in the post-grad graphs, and the piecewise split is at attention only."""
    ids, pos = torch.arange(8), torch.arange(8)
    # A fresh Inductor cache: a cached compile would not run the counting pass.
    with compat.fresh_inductor_cache(), counted_after("noop") as counts:  # the pass is the model's when built in the block
        with set_compilation_config(CompilationConfig(level=3)), _rank(0, 2, one_rank_group):
            model = build_model(BUILTIN_MODELS["tiny-llama"], where="tiny-llama")
        init_random_weights(model)
        with compilation_counter.expect(num_piecewise_capturable_graphs_seen=3, num_piecewise_graphs_seen=5), \
                set_forward_context(ForwardContext(attention_layers(model), None)), torch.inference_mode():
            model(ids, pos)
    all_reduce = torch.ops.dynamo_once.all_reduce.default
    assert counts[all_reduce] == 5, counts


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("kind, step, reported", [("exit", 2, "its process exited with code 3"),
                                                  ("raise", 0, "RuntimeError: injected fault at step 0")])
def test_worker_failure_is_an_error_naming_the_rank(kind, step, reported, monkeypatch, llama_dir):
    """Rank 1 dies (or raises) inside a step while rank 0 waits in a collective: the caller gets a WorkerError
    naming rank 1 at once (gloo's connection closes), the group is shut down, and later calls say so."""
    monkeypatch.setattr(executor, "WORKER_FAULT", (kind, 1, step))
    llm = LLM(llama_dir, level=0, max_num_tokens=16, tensor_parallel_size=2)
    procs = list(llm._tp._procs)
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match=f"tensor-parallel worker rank 1 failed: .*{reported}") as info:
        llm.generate(PROMPTS, NEW_TOKENS)
    assert info.value.rank == 1
    assert time.perf_counter() - t0 < _REPORT_WAIT_S + 10  # no hang
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(WorkerError, match="shut down after an earlier failure"):
        llm.generate(PROMPTS, 1)
    assert not dist.is_initialized()  # rank 0 left the group: a new tensor-parallel LLM may start
    llm.close()  # again: nothing left to do


def test_close_stops_the_workers(llama_dir):
    llm = LLM(llama_dir, level=0, max_num_tokens=16, tensor_parallel_size=2)
    procs = list(llm._tp._procs)
    assert all(p.is_alive() for p in procs)
    llm.close()
    assert not any(p.is_alive() for p in procs) and [p.exitcode for p in procs] == [0]
    assert not dist.is_initialized()
    assert LLM(llama_dir, level=0, max_num_tokens=16).generate(PROMPTS[:1], 2)  # an unsharded model after it


#: NCCL's leaving, emulated on gloo (a sitecustomize for the worker, the same patch in this process): the
#: communicator's destroy (in destroy_process_group since torch 2.6) is an intra-node collective of all ranks.
COLLECTIVE_DESTROY = """\
import torch.distributed as dist

_destroy = dist.destroy_process_group


def destroy_process_group(group=None):
    if group is None and dist.is_initialized():
        dist.barrier()  # every rank of the group leaves together, as ncclCommDestroy
    _destroy(group)


dist.destroy_process_group = destroy_process_group
"""


def test_prefill_of_the_compile_size_then_close_with_a_collective_leave(tmp_path, monkeypatch):
    """Issue 17's ``tp_decode --sp`` run: compiled for exactly the prefill's N tokens (level 3, the fused-add
    pass), N-token steps at most, an N-token prompt in a cache of N + 16 tokens, then close(). Leaving the group
    is a collective here, as on NCCL: rank 0 must leave while the worker does, not after waiting for its exit
    (which waited for rank 0: terminated after the close's 10 s, then rank 0's own leave hung on NCCL)."""
    n = 64
    (tmp_path / "sitecustomize.py").write_text(COLLECTIVE_DESTROY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    destroy = dist.destroy_process_group

    def collective_destroy(group=None):
        if group is None and dist.is_initialized():
            dist.barrier()
        destroy(group)

    monkeypatch.setattr(dist, "destroy_process_group", collective_destroy)
    config = CompilationConfig(level=3, pass_config="+fused_add_rms_norm", compile_sizes=[n])
    llm = LLM("tiny-llama", tensor_parallel_size=2, max_num_tokens=n, max_num_seqs=1, num_cache_tokens=n + 16,
              compilation_config=config)
    procs = list(llm._tp._procs)
    prompt = [(3 * j) % 100 + 1 for j in range(n)]
    try:
        out = llm.generate([prompt], 1)
    finally:
        t0 = time.perf_counter()
        llm.close()
        close_s = time.perf_counter() - t0
    expected = LLM("tiny-llama", level=0, max_num_tokens=n, max_num_seqs=1).generate([prompt], 1)
    assert out == expected
    assert [p.exitcode for p in procs] == [0]  # left the group and exited by itself, not terminated
    assert close_s < executor._CLOSE_S / 2, close_s
    assert not dist.is_initialized()


def test_worker_killed_between_steps(llama_dir):
    llm = LLM(llama_dir, level=0, max_num_tokens=16, tensor_parallel_size=2)
    (proc,) = llm._tp._procs
    proc.kill()
    proc.join()
    with pytest.raises(WorkerError, match="tensor-parallel worker rank 1 failed: its process exited with code -9"):
        llm.generate(PROMPTS, 2)
    assert not dist.is_initialized()


def test_garbage_collected_llm_stops_its_workers(llama_dir):
    """``del`` of a tensor-parallel LLM stops its workers when it is collected (its reference cycles wait for
    the collector: ``close()`` is immediate)."""
    import gc

    llm = LLM(llama_dir, level=0, max_num_tokens=16, tensor_parallel_size=2)
    procs = list(llm._tp._procs)
    del llm
    gc.collect()
    assert not any(p.is_alive() for p in procs) and not dist.is_initialized()


def test_workers_end_with_a_killed_caller(tmp_path):
    """The caller dies (SIGKILL: no atexit, no finalizer): its workers end too, they never outlive it."""
    import os
    import subprocess
    import sys

    code = ("import os, signal, sys\nfrom models import LLM\n"
            "llm = LLM('tiny-llama', level=0, max_num_tokens=16, tensor_parallel_size=2)\n"
            "print(*[p.pid for p in llm._tp._procs], flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 1, run.stderr

    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 20
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(running, pids))


@pytest.mark.parametrize("size", [0, -1, 1.5, "2", True, None])
def test_bad_size_is_refused(size):
    with pytest.raises(ValueError, match=rf"LLM: tensor_parallel_size must be a positive int; got {size!r}"):
        LLM("tiny-llama", tensor_parallel_size=size)


@pytest.mark.parametrize("size, field", [(3, "num_attention_heads: 4"), (4, "num_key_value_heads: 2")])
def test_size_must_divide_the_heads(size, field):
    """Each rank holds whole query and KV heads (tiny-llama: 4 heads, 2 KV heads): refused before any worker
    starts, naming the field."""
    with pytest.raises(CheckpointError, match=rf"tiny-llama: {field} is not divisible by tensor_parallel_size={size}"):
        LLM("tiny-llama", tensor_parallel_size=size)


@pytest.mark.parametrize("kwargs, message", [
    (dict(model="tiny-llama-fp8"), "is quantized \\(quantization_config\\); W8A8 layers are not sharded yet"),
    (dict(model="tiny-llava"), "LlavaForConditionalGeneration is not sharded here"),
    (dict(model="tiny-llama", device="cuda"), "one GPU a rank, but"),
    (dict(model="tiny-llama", device="cuda:1"), "rank r runs on GPU r .* got device='cuda:1'"),
])
def test_unsupported_is_refused(kwargs, message):
    if kwargs.get("device") == "cuda" and torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs are visible")
    if kwargs.get("device") == "cuda:1" and torch.cuda.device_count() < 2:
        pytest.skip("fewer than two GPUs: refused for their count first")
    with pytest.raises(ValueError, match=f"LLM: tensor_parallel_size=2.*{message}"):
        LLM(**kwargs, tensor_parallel_size=2)


def test_plugins_of_the_caller_are_named(caplog):
    """A plugin pass registered in the caller does not reach the spawned workers: said, naming it."""
    with counted_after("noop"), pytest.raises(CheckpointError):  # refused after the warning (3 ranks, 4 heads)
        LLM("tiny-llama", tensor_parallel_size=3)
    assert "pass count_after_noop set through dispatcher.plugins in this process do(es) not reach the worker " \
           "processes" in caplog.text


def test_model_object_is_refused():
    model = load_model("tiny-llama")
    with pytest.raises(ValueError, match="needs a checkpoint directory or a built-in name as model .* got "
                                         "LlamaForCausalLM"):
        LLM(model, tensor_parallel_size=2)


def test_second_group_in_one_process_is_refused(one_rank_group):
    with pytest.raises(RuntimeError, match="already has a torch.distributed default group"):
        LLM("tiny-llama", tensor_parallel_size=2)


def test_cli_generate(capsys):
    from models.cli import main

    argv = ["generate", "--model", "tiny-llama", "--level", "0", "--device", "cpu", "--random-prompts",
            "--num-prompts", "2", "--max-tokens", "3"]
    assert main(argv + ["--tensor-parallel-size", "2"]) == 0
    sharded = capsys.readouterr().out
    assert main(argv) == 0
    assert sharded.split("\n\n")[0] == capsys.readouterr().out.split("\n\n")[0]  # the same tokens
    assert main(argv + ["--tensor-parallel-size", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynamo-once generate: tiny-llama: num_attention_heads: 4 is not divisible by "
                          "tensor_parallel_size=3") and err.count("\n") == 1, err


def test_serve_concurrent_requests(tmp_path):
    """The HTTP server's pool threads take turns at a tensor-parallel engine's steps: concurrent completions
    equal the unsharded engine's."""
    import threading

    from text_testing import save_text_llama

    serve = pytest.importorskip("test_serve")  # its server helper (skipped without fastapi, uvicorn, openai)
    from models import SamplingParams
    from models.serve.app import build_app

    save_text_llama(tmp_path)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.text for o in LLM(str(tmp_path), level=0, max_num_tokens=32).generate(serve.PROMPTS, params)]
    llm = LLM(str(tmp_path), level=0, max_num_tokens=32, tensor_parallel_size=2)
    url, server = serve.start_server(build_app(llm, "m", api_key=None, max_body_bytes=4096))
    texts = [None] * len(serve.PROMPTS)

    def ask(i):
        body = dict(model="m", prompt=serve.PROMPTS[i], temperature=0, max_tokens=8, ignore_eos=True)
        texts[i] = serve.httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(serve.PROMPTS))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        server.should_exit = True
        llm.close()
    assert texts == expected and all(expected)


# ------------------------------------------------------------------ the all-reduce choice
def test_limits_choose_by_size():
    limits = AllReduceLimits(one_shot_max_bytes=64 << 10, two_shot_max_bytes=4 << 20)
    assert [limits.choose(n) for n in (1, 64 << 10, (64 << 10) + 1, 4 << 20, (4 << 20) + 1)] == [
        "one_shot", "one_shot", "two_shot", "two_shot", "nccl"]
    assert AllReduceLimits().choose(1) == "nccl"  # the default: NCCL always
    assert AllReduceLimits(0, 1024).choose(8) == "two_shot"


@pytest.mark.parametrize("value, expected", [("256,4096", AllReduceLimits(256 << 10, 4096 << 10)),
                                             (" 0 , 512 ", AllReduceLimits(0, 512 << 10)), ("", None), ("0,0", None)])
def test_limits_from_env(value, expected, monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE", value)
    assert limits_from_env() == expected


@pytest.mark.parametrize("value", ["256", "a,b", "1,2,3", "-1,5", "1.5,2"])
def test_bad_limits_name_the_variable(value, monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE", value)
    with pytest.raises(ValueError, match=rf"DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE={value!r}: expected two sizes in KiB"):
        limits_from_env()


def test_symmetric_memory_needs_cuda(one_rank_group, monkeypatch):
    with pytest.raises(ValueError, match="symmetric memory needs CUDA tensors; the group's device is cpu"):
        symmetric.enable(one_rank_group, AllReduceLimits(1024, 0), torch.device("cpu"))
    monkeypatch.setenv("DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE", "256,4096")
    assert symmetric.enable_from_env(one_rank_group, "cpu") is None  # gloo groups take their own all-reduce


def test_all_reduce_asks_the_choice(one_rank_group, monkeypatch):
    """``dynamo_once::all_reduce`` takes the group's symmetric path when it answers, else the group's own."""
    x = torch.randn(4, 8)
    answer = {}
    monkeypatch.setitem(symmetric._enabled, one_rank_group, lambda t: answer.get("out"))
    torch.testing.assert_close(torch.ops.dynamo_once.all_reduce(x, one_rank_group), x)  # None: gloo
    answer["out"] = torch.full_like(x, 7.0)
    assert torch.equal(torch.ops.dynamo_once.all_reduce(x, one_rank_group), answer["out"])


def test_all_reduce_opcheck(one_rank_group):
    torch.library.opcheck(torch.ops.dynamo_once.all_reduce.default, (torch.randn(3, 8), one_rank_group))
    torch.library.opcheck(torch.ops.dynamo_once.all_gather.default, (torch.randn(3, 8), -1, one_rank_group))


def test_importing_the_package_registers_its_collectives():
    """A spawned worker imports only ``models.parallel``: the collective ops must exist then (a fresh process,
    as the two-GPU tests' workers start)."""
    code = ("import torch, models.parallel\n"
            "for op in ('all_reduce', 'all_gather', 'reduce_scatter', 'rank_shard', 'matmul_reduce_scatter',"
            " 'all_gather_matmul'):\n"
            "    getattr(torch.ops.dynamo_once, op)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))), timeout=120)


# ------------------------------------------------------------------ two GPUs
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_symmetric_all_reduce_two_gpus(tmp_path):
    """NCCL, one-shot and two-shot all-reduces of 1-512 tokens x 4096 (bf16), eager and replayed in a CUDA
    graph, each equal to the sum of the two ranks' inputs (two bf16 addends: one rounding, whichever sums)."""
    import socket

    import torch.multiprocessing as mp

    from tp_testing import TOKENS, symmetric_all_reduce_worker

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(symmetric_all_reduce_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        assert set(errors) == {(a, t) for a in ("nccl", "one_shot", "two_shot") for t in TOKENS}
        assert max(errors.values()) <= 2 ** -7 * 8, errors  # one bf16 rounding of sums |x| < 8
@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("model", ["llama", "gemma2"])
def test_tp2_nccl_with_cuda_graphs_equals_tp1(model, request):
    """Level 3 on two GPUs: NCCL collectives inside the piecewise and whole-step CUDA graphs (fp32: no
    near-ties between the two reduction orders)."""
    path = request.getfixturevalue(f"{model}_dir")
    kwargs = dict(level=3, max_num_tokens=32, max_num_seqs=8, device="cuda", dtype="float32")
    out = {}
    for tp in (1, 2):
        llm = LLM(path, **kwargs, tensor_parallel_size=tp)
        try:
            assert llm.cuda_graphs is not None and llm.full_sizes and llm.piece_sizes
            out[tp] = llm.generate(PROMPTS, 12)
        finally:
            llm.close()
    assert out[2] == out[1]
