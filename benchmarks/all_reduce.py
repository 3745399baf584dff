"""All-reduce latency inside CUDA graphs (issue 17): NCCL against torch symmetric memory's one-shot and
two-shot kernels, for the messages a tensor-parallel decoder sends (T tokens x hidden, bf16).

Two ranks (one process a GPU, NCCL, NVLink multicast off); for each T and algorithm, a CUDA graph of
``--calls`` all-reduces is captured and replayed (median of 10 replays, per all-reduce, rank 0's clock).
Each algorithm's result is checked against NCCL's before it is timed. The winner per size is what
``DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE="ONE_SHOT_KIB,TWO_SHOT_KIB"`` should say (models.parallel.symmetric).

Usage: ``python -m benchmarks.all_reduce [--tokens 1,2,...,512] [--hidden 4096] [--out DIR]`` (two GPUs).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
from typing import Any

import torch

from benchmarks import common

ALGORITHMS = ("nccl", "one_shot", "two_shot")


def _graph_us(fn: Any, calls: int) -> float:
    """µs per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (median of 10 replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture (NCCL sets up its channels here)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.distributed.barrier()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def plot(rows: list[dict[str, Any]], out_dir: str | None, name: str = "all_reduce") -> str | None:
    """``<name>.png``: µs per all-reduce against tokens (log-log), one line per algorithm."""
    lines = [dict(tokens=int(r["tokens"]), algorithm=alg, us=float(r[f"{alg}_us"])) for alg in ALGORITHMS for r in rows
             if r.get(f"{alg}_us") not in ("", None)]
    hidden = rows[0]["hidden"] if rows else "?"
    return common.plot_lines(name, lines, x="tokens", y="us", series="algorithm", logx=True, logy=True,
                             out_dir=out_dir, title=f"All-reduce inside CUDA graphs, 2 GPUs (bf16 [tokens, {hidden}])",
                             xlabel="tokens", ylabel="µs per all-reduce")


def _rank(rank: int, port: int, tokens: list[int], hidden: int, calls: int, out: str | None) -> None:
    import torch.distributed as dist

    from models.parallel.state import init_tensor_parallel
    from models.parallel.symmetric import AllReduceLimits, SymmetricAllReduce

    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    state = init_tensor_parallel(rank, 2, "nccl", store, 120.0)
    dev = torch.device("cuda", rank)
    biggest = max(tokens) * hidden * 2
    one = SymmetricAllReduce(state.group_name, AllReduceLimits(biggest, 0), dev)
    two = SymmetricAllReduce(state.group_name, AllReduceLimits(0, biggest), dev)
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden, dtype=torch.bfloat16, device=dev, generator=torch.Generator(dev).manual_seed(rank))
        nccl_out = x.clone()

        def nccl(x: torch.Tensor = x, buf: torch.Tensor = nccl_out) -> None:
            buf.copy_(x)
            dist.all_reduce(buf)

        nccl()
        fns = {"nccl": nccl, "one_shot": lambda x=x: one(x), "two_shot": lambda x=x: two(x)}
        for name in ("one_shot", "two_shot"):
            torch.testing.assert_close(fns[name](), nccl_out, rtol=0, atol=0.05)
        us = {name: _graph_us(fn, calls) for name, fn in fns.items()}
        rows.append(dict(tokens=t, hidden=hidden, kib=t * hidden * 2 // 1024,
                         **{f"{k}_us": round(v, 2) for k, v in us.items()}, best=min(us, key=us.get)))
        if rank == 0:
            print(rows[-1], flush=True)
    if rank == 0:
        common.write_results("all_reduce", rows, device=dev, out_dir=out,
                             title="All-reduce inside CUDA graphs, 2 GPUs: NCCL vs symmetric memory",
                             notes=[f"bf16 [tokens, {hidden}] summed over 2 ranks; a CUDA graph of {calls} "
                                    "all-reduces, median of 10 replays, per all-reduce, rank 0",
                                    "NVLink multicast off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1)"])
        plot(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--calls", type=int, default=32, help="all-reduces in one captured graph")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens: expected comma-separated integers; got {a.tokens!r}")
    if torch.cuda.device_count() < 2:
        p.error(f"the all-reduce benchmark needs two GPUs; {torch.cuda.device_count()} visible")
    from models.parallel.worker import NVLS_OFF

    os.environ.update(NVLS_OFF)  # NVLink multicast off, inherited by the spawned ranks
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, tokens, a.hidden, a.calls, a.out), nprocs=2, join=True)


if __name__ == "__main__":
    main()
