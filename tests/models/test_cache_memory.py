"""``LLM(gpu_memory_utilization=u)``: the KV cache sized from the GPU's memory (models.engine.cache_memory).

On any machine: the argument's contract (a share in (0, 1], not with ``num_cache_tokens``, one rank, a CUDA
device), each a ValueError naming it before the model loads, and the server's flag as a one-line error. On a GPU:
the cache takes what ``u`` leaves (more for a larger share), the process stays within its share after serving, and
the tokens are those of a cache sized by hand.
"""

import gc
import subprocess
import sys

import pytest
import torch

from models import LLM, SamplingParams


@pytest.mark.parametrize("value", [0, -0.5, 1.5, True, "0.9", float("nan")])
def test_a_share_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match=rf"gpu_memory_utilization must be a number in \(0, 1\].*got {value!r}"):
        LLM("tiny-llama", gpu_memory_utilization=value)


def test_it_sizes_the_cache_so_num_cache_tokens_is_refused_beside_it():
    with pytest.raises(ValueError, match="pass num_cache_tokens or gpu_memory_utilization, not both.*got 4096 and 0.5"):
        LLM("tiny-llama", num_cache_tokens=4096, gpu_memory_utilization=0.5)


def test_tensor_parallel_ranks_need_num_cache_tokens():
    with pytest.raises(ValueError, match="with tensor_parallel_size=2 pass num_cache_tokens"):
        LLM("tiny-llama", tensor_parallel_size=2, gpu_memory_utilization=0.5)


def test_a_cpu_model_needs_num_cache_tokens():
    with pytest.raises(ValueError, match="from a CUDA device's memory; device='cpu': pass num_cache_tokens"):
        LLM("tiny-llama", device="cpu", gpu_memory_utilization=0.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests below size a cache on the GPU")
def test_without_a_gpu_it_says_so():
    with pytest.raises(ValueError, match="no CUDA device here: pass num_cache_tokens"):
        LLM("tiny-llama", gpu_memory_utilization=0.5)


def test_the_server_flag_is_a_one_line_error():
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    r = subprocess.run([sys.executable, "-m", "models.cli", "serve", "--model", "tiny-llama", "--port", "0",
                        "--device", "cpu", "--gpu-memory-utilization", "1.5"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "dynamo-once serve: LLM: gpu_memory_utilization must be a number in (0, 1] (the share of the GPU's memory "
        "this process may take); got 1.5"]


@pytest.mark.cuda
@pytest.mark.parametrize("level", [0, 3])
def test_on_the_gpu_the_cache_takes_what_the_share_leaves(level):
    """Two shares, each a number of GiB above what the device holds just before the LLM is built, a GiB apart: the
    larger gets the larger cache; this process's torch memory after a generate is within its share; greedy tokens
    equal a hand-sized cache's. (Other test processes may share the GPU, so the device-wide figures are not
    asserted.)"""
    device = torch.device("cuda")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 100 + 3 for j in range(12 + i)] for i in range(6)]
    got = {}
    for extra in (2, 3):
        gc.collect()  # the LLM before (reference cycles) and its cache gone, their blocks back to the device
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        share = min(1.0, (total - free + (extra << 30)) / total)
        llm = LLM("tiny-llama", level=level, device="cuda", dtype=torch.float32, max_num_tokens=256,
                  gpu_memory_utilization=share)
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize(device)
        cache = sum(t.numel() * t.element_size() for t in llm.kv_cache.tensors.values())
        assert 0 < cache and torch.cuda.memory_reserved(device) <= share * total
        got[extra] = (cache, [o.token_ids for o in outs])
        del llm, outs
        torch.cuda.empty_cache()
    assert got[3][0] > got[2][0]
    ref = LLM("tiny-llama", level=level, device="cuda", dtype=torch.float32, max_num_tokens=256,
              num_cache_tokens=8192).generate(prompts, params)
    assert got[2][1] == got[3][1] == [o.token_ids for o in ref]


@pytest.mark.cuda
def test_on_the_gpu_too_small_a_share_names_the_figures():
    with pytest.raises(RuntimeError, match=r"gpu_memory_utilization=1e-06 leaves 0.00 GiB for the KV cache.*raise "
                                           r"gpu_memory_utilization, lower max_num_tokens, or pass num_cache_tokens"):
        LLM("tiny-llama", device="cuda", gpu_memory_utilization=1e-6)


class _Layer:
    num_kv_heads, head_size = 8, 64


def test_the_budget_rule(monkeypatch):
    """The arithmetic of models.engine.cache_memory on a device whose memory figures are given: what the share
    leaves after memory outside torch, torch's allocations, twice the activation peak and the sampler's room, in
    whole blocks of a token's bytes over every layer; too little names the figures."""
    from models.engine import cache_memory

    gib = 1 << 30
    figures = dict(free=50 * gib, total=80 * gib, allocated=16 * gib, reserved=20 * gib)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (figures["free"], figures["total"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: figures["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: figures["reserved"])
    layers = {f"l{i}": _Layer() for i in range(4)}  # 4 x 2 x 8 x 64 x 2 bytes = 8 KiB a token in bf16
    profile = cache_memory.MemoryProfile(allocated_before=16 * gib, peak=18 * gib)
    args = (layers, torch.bfloat16, 16, 64, 1000, 256, torch.device("cuda"))
    tokens = cache_memory.cache_tokens_for_memory(0.9, profile, *args)
    outside = 80 * gib - 50 * gib - 20 * gib  # 10 GiB: the context, libraries, other processes
    budget = int(0.9 * 80 * gib) - outside - 16 * gib - 2 * 2 * gib - 4 * 64 * 1000 * 4
    assert tokens == budget // (8192 * 16) * 16 and tokens % 16 == 0
    assert cache_memory.cache_tokens_for_memory(0.95, profile, *args) > tokens  # a larger share, a larger cache
    with pytest.raises(RuntimeError, match=r"gpu_memory_utilization=0.3 leaves 0.00 GiB for the KV cache, 0 tokens, "
                                           r"fewer than the 256 one step needs: of 80.00 GiB, 10.00 are in use outside "
                                           r"torch, 16.00 allocated \(weights, buffers\), 2.00 the largest step's"):
        cache_memory.cache_tokens_for_memory(0.3, profile, *args)
