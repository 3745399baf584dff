"""A tensor-parallel worker process: rank r of the group, running every step the caller sends.

Spawned by :class:`.executor.TensorParallelExecutor`. It joins the group, builds its runner (the ``LLM``
class, with the caller's arguments, under ``use_tensor_parallel``: its model is rank r's shard, its KV
cache holds its KV heads), which warms up and compiles (and captures CUDA graphs) in step with the caller,
then says "ready" and serves steps until the caller sends None or its pipe closes. An exception is sent to
the caller (its traceback), then the process exits at once: its collectives' peers fail instead of waiting.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import sys
import threading
import traceback
from typing import Any

import torch
import torch.distributed as dist

from dispatcher import envs

from .state import destroy_tensor_parallel, init_tensor_parallel, use_tensor_parallel
from .symmetric import enable_from_env as enable_symmetric

__all__ = ["NVLS_OFF", "WorkerSpec", "format_exception", "run_step", "worker_main"]

#: NVLink multicast (NVLS) off in every process of the group: NCCL's NVLS algorithms, torch's symmetric
#: memory and NVSHMEM would otherwise use multimem operations.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass
class WorkerSpec:
    """What a worker process needs (pickled to it): its rank, where the group meets, how to build its
    ``runner`` (the ``LLM`` class, called with ``kwargs`` under the group)."""

    rank: int
    world_size: int
    port: int
    backend: str
    device_type: str
    timeout_s: float
    runner: type
    kwargs: dict[str, Any]
    fault: tuple[str, int] | None = None  # (kind, step) of WORKER_FAULT for this rank


def format_exception() -> str:
    """The current exception as a worker reports it: its traceback's last 40 lines."""
    return "".join(traceback.format_exc().splitlines(keepends=True)[-40:])


def _setup_process(spec: WorkerSpec) -> None:
    os.environ.update(NVLS_OFF)
    # Each rank its own compile-cache directory: ranks of one model have one key, and the entry's lock is held
    # over the first call, collectives included (one rank would wait for the lock, the other for it).
    if not envs.compile_cache_disabled():
        cache = os.path.join(envs.cache_dir(), f"tp{spec.world_size}-rank{spec.rank}")
        os.makedirs(cache, exist_ok=True)
        os.environ["DYNAMO_ONCE_CACHE_DIR"] = cache
    if spec.device_type == "cuda":
        torch.cuda.set_device(spec.rank)


def worker_main(spec: WorkerSpec, conn: Any) -> None:
    """The process's entry point (spawn): join, build, serve; exits with 1 after reporting an exception."""
    threading.Thread(target=_exit_with_parent, name="dynamo-once-tp-parent", daemon=True).start()
    try:
        _setup_process(spec)
        store = dist.TCPStore("127.0.0.1", spec.port, spec.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        state = init_tensor_parallel(spec.rank, spec.world_size, spec.backend, store, spec.timeout_s)
        enable_symmetric(state.group_name, spec.device_type)  # with the caller's, a collective
        with use_tensor_parallel(state):
            runner = spec.runner(**spec.kwargs)
        conn.send(("ready", ""))
        _serve(runner, conn, spec)
    except BaseException:  # noqa: BLE001 - everything goes to the caller
        try:
            conn.send(("error", format_exception()))
        finally:
            sys.stderr.flush()
            os._exit(1)  # at once: no teardown that could wait on the group's other ranks
    destroy_tensor_parallel(state)  # asked to stop: a normal exit (the compile workers' pools shut down)


def _exit_with_parent() -> None:
    """A worker never outlives the caller (killed, or stuck): its process ends when the caller's does."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()
        os._exit(2)


def _serve(runner: Any, conn: Any, spec: WorkerSpec) -> None:
    step = 0
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the caller is gone
            return
        if message is None:
            return
        if spec.fault is not None and spec.fault[1] == step:
            _inject(spec.fault[0], step)
        run_step(runner, message)
        step += 1


def _inject(kind: str, step: int) -> None:
    """The test hook (``executor.WORKER_FAULT``)."""
    if kind == "exit":
        os._exit(3)
    raise RuntimeError(f"injected fault at step {step}")


def run_step(runner: Any, message: tuple) -> None:
    """One step from the caller (:func:`.executor.step_message`): stage its inputs into ``runner``'s buffers,
    then run its forward as the caller does (the logits, all-gathered, are dropped)."""
    _, (ids, pos, slots, starts, lens, rows, patch), full_graph, num_seqs, num_tokens, t, b, num_decodes, device_ids = \
        message
    inputs = runner.input_batch
    inputs.stage(ids, pos, slots, starts, lens, None if rows is None else torch.tensor(rows, dtype=torch.int32),
                 None, patch)
    if device_ids:  # async scheduling: the ids rank 0 sampled, broadcast over its staged placeholders
        dist.broadcast(inputs.input_ids[:b], src=0)
    md = None
    if not full_graph:  # as InputBatch.prepare builds it
        md = inputs.metadata(num_seqs, num_tokens, num_decodes, starts, lens)
    runner._forward_step(full_graph, num_seqs, num_tokens, t, b, [], md)
