"""Spawned processes of the two-GPU tensor-parallel tests (module level, so that spawn can import them)."""

import datetime
import os

import torch
import torch.distributed as dist

TOKENS = [1, 7, 64, 512]  # x 4096 bf16: 8 KiB .. 4 MiB
HIDDEN = 4096


def _input(rank: int, tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + tokens)
    return torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)


def symmetric_all_reduce_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Each algorithm (NCCL, one-shot, two-shot) eagerly and replayed in a CUDA graph, against the sum of the
    ranks' inputs; writes ``out_dir/rank<r>.pt`` with the max errors, or raises."""
    from models.parallel import init_tensor_parallel
    from models.parallel.symmetric import AllReduceLimits, enable
    from models.parallel.worker import NVLS_OFF

    os.environ.update(NVLS_OFF)
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    state = init_tensor_parallel(rank, world_size, "nccl", store, 120)
    name = state.group_name
    errors = {}
    for algorithm, limits in [("nccl", AllReduceLimits()), ("one_shot", AllReduceLimits(1 << 30, 0)),
                              ("two_shot", AllReduceLimits(0, 1 << 30))]:
        symm = enable(name, AllReduceLimits(*([8 << 20] * 2)), torch.device("cuda", rank))
        symm.limits = limits  # one buffer, each algorithm in turn
        for tokens in TOKENS:
            assert limits.choose(tokens * HIDDEN * 2) == algorithm
            expected = sum(_input(r, tokens).float() for r in range(world_size)).cuda()
            x = _input(rank, tokens).cuda()
            eager = torch.ops.dynamo_once.all_reduce(x, name)
            graph, static = torch.cuda.CUDAGraph(), x.clone()
            torch.ops.dynamo_once.all_reduce(static, name)  # warm-up outside the capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                replayed = torch.ops.dynamo_once.all_reduce(static, name)
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            errors[(algorithm, tokens)] = max((eager.float() - expected).abs().max().item(),
                                              (replayed.float() - expected).abs().max().item())
    torch.save(errors, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
