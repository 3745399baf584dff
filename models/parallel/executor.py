"""The caller's side of a tensor-parallel ``LLM``: it starts the workers, joins their group as rank 0, sends
each step's inputs, and turns any worker's failure into a :class:`WorkerError` naming the rank.

Every wait has a deadline: the group's start-up and the workers' ready messages wait at most
:data:`TIMEOUT_S` (each while watching the workers' processes, so a worker that dies is reported at once),
and every collective of the group times out after it. A worker that dies inside a collective makes the
caller's side of it fail at once on gloo (the connection closes); on NCCL a watcher thread aborts the group
when a worker's process ends (``ProcessGroup.abort``), so the collective ends instead of waiting for the
timeout, and the step raises.

The step protocol: the engine stages each step's inputs through ``InputBatch.stage``; the executor records
that call (:meth:`TensorParallelExecutor.attach`) and sends its arguments, with the step's sizes, to every
worker (:func:`step_message`), which stages the same inputs into its own buffers and runs the same forward
(:mod:`.worker`). Logits are all-gathered, so the caller's are the whole vocabulary's.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.connection
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from .state import TensorParallelState, destroy_tensor_parallel, init_tensor_parallel, process_group
from .symmetric import disable as disable_symmetric
from .symmetric import enable_from_env as enable_symmetric
from .worker import NVLS_OFF, WorkerSpec, worker_main

logger = logging.getLogger(__name__)

__all__ = ["TIMEOUT_S", "TensorParallelExecutor", "WorkerError", "step_message"]

#: Seconds any wait of the group may take: start-up, a worker's model build and compile (Llama 3 8B at level 3
#: compiles in under 60 s cold on an H200), and each collective.
TIMEOUT_S = 600.0

#: Test hook: ``(kind, rank, step)`` makes worker ``rank`` fail at its ``step``-th step (0: the first):
#: kind ``"exit"`` ends its process (``os._exit``), ``"raise"`` raises in it. Read when workers start.
WORKER_FAULT: tuple[str, int, int] | None = None

#: How long a failed step waits for the workers' own reports (a worker sends its error before it exits).
_REPORT_WAIT_S = 5.0

#: How long closing waits for the workers to exit (then terminated) and for rank 0 to leave the group.
_CLOSE_S = 10.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed: it raised (its traceback follows) or its process died."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"tensor-parallel worker rank {rank} failed: {message}")
        self.rank = rank


def step_message(staged: tuple, full_graph: bool, num_seqs: int, num_tokens: int, t: int, b: int,
                 num_decodes: int, device_ids: bool = False) -> tuple:
    """One step for the workers: ``InputBatch.stage``'s arguments (the block-table rows as lists, the patches of
    grown rows) and the
    step's sizes (see :meth:`LLM._forward_step`). ``device_ids``: the first ``b`` input ids are broadcast from
    rank 0's device (async scheduling: the last step's sampled tokens, never on the host)."""
    ids, pos, slots, starts, lens, rows, *rest = staged
    patch = rest[1] if len(rest) > 1 else None
    rows = None if rows is None else rows.tolist()
    return ("step", (ids, pos, slots, starts, lens, rows, patch), full_graph, num_seqs, num_tokens, t, b,
            num_decodes, device_ids)


class TensorParallelExecutor:
    """Starts ranks 1..N-1 of a group (spawned processes) and joins it as rank 0.

    Args:
        world_size: the tensor-parallel size N (>= 2).
        runner: the class each worker builds with ``kwargs`` (``LLM``).
        kwargs: its arguments (picklable: a model path or built-in name, sizes, the compilation config).
        device_type: ``"cuda"`` (NCCL; rank r on GPU r) or ``"cpu"`` (gloo).
        timeout_s: the deadline of every wait (:data:`TIMEOUT_S`).

    Raises:
        WorkerError: a worker failed to start (naming its rank); nothing is left running.
    """

    def __init__(self, world_size: int, runner: type, kwargs: dict[str, Any], device_type: str = "cpu",
                 timeout_s: float = TIMEOUT_S) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.backend = "nccl" if device_type == "cuda" else "gloo"
        if self.backend == "nccl":  # as in the workers (they inherit it too): one NCCL configuration for all ranks
            os.environ.update(NVLS_OFF)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._failure: WorkerError | None = None
        self.state: TensorParallelState | None = None
        for rank in range(1, world_size):
            fault = WORKER_FAULT[::2] if WORKER_FAULT is not None and WORKER_FAULT[1] == rank else None
            spec = WorkerSpec(rank, world_size, store.port, self.backend, device_type, timeout_s, runner, kwargs,
                              fault)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, child), name=f"dynamo-once-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _shut_down, self._procs, self._conns, [None])
        try:
            self.state = self._join(store)
        except BaseException:
            self.close()
            raise
        self._finalizer.detach()
        enable_symmetric(self.state.group_name, device_type)  # DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE on CUDA
        # A watcher thread notes a worker whose process ends (and on NCCL aborts the group, so that a collective
        # waiting for it ends instead of hanging until the timeout); closing the pipe's write end stops it.
        self._dead: list[int] = []
        stop_reader, stop_writer = ctx.Pipe(duplex=False)
        group = process_group(self.state.group_name) if self.backend == "nccl" else None
        threading.Thread(target=_watch, args=(self._procs, stop_reader, self._dead, group), daemon=True,
                         name="dynamo-once-tp-watch").start()
        self._finalizer = weakref.finalize(self, _shut_down, self._procs, self._conns, [self.state], stop_writer)
        self._staged: tuple | None = None

    def _join(self, store: dist.Store) -> TensorParallelState:
        """Join the group as rank 0, in a thread, watching the workers: one that dies first is an error now."""
        out: dict[str, Any] = {}

        def join() -> None:
            try:
                out["state"] = init_tensor_parallel(0, self.world_size, self.backend, store, self.timeout_s)
            except BaseException as e:  # reported by the caller's thread
                out["error"] = e

        thread = threading.Thread(target=join, name="dynamo-once-tp-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(0.05)
            self.raise_if_failed()
            if time.monotonic() > deadline:
                raise WorkerError(1, f"the group did not form within {self.timeout_s:.0f}s")
        if "error" in out:
            raise out["error"]
        return out["state"]

    # ------------------------------------------------------------ failures
    def _poll(self, timeout: float) -> WorkerError | None:
        """The first worker failure seen within ``timeout`` seconds: a reported error, or a dead process."""
        waitables = self._conns + [p.sentinel for p in self._procs]
        for ready in multiprocessing.connection.wait(waitables, timeout):
            for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
                if ready is conn:
                    try:
                        kind, text = conn.recv()
                    except (EOFError, OSError):
                        proc.join(1.0)
                        return WorkerError(rank, f"its process exited with code {proc.exitcode} (no error reported)")
                    if kind == "error":
                        return WorkerError(rank, _summary(text))
                elif ready == proc.sentinel:
                    if conn.poll():  # its report came before its exit
                        return self._poll(0)
                    return WorkerError(rank, f"its process exited with code {proc.exitcode} (no error reported)")
        return None

    def raise_if_failed(self) -> None:
        """Raise the first failure of a worker (or an earlier one) seen now; else return."""
        if self._failure is None:
            self._failure = self._poll(0)
        if self._failure is not None:
            raise self._failure

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Around a part that all ranks run together (start-up, a step): an exception in it ends the group (its
        ranks are out of step) and becomes the failing worker's :class:`WorkerError`, when one failed."""
        if self._failure is not None:
            raise WorkerError(self._failure.rank, f"the tensor-parallel group was shut down after an earlier "
                                                  f"failure ({self._failure})")
        self._raise_if_dead()  # between steps
        try:
            yield
        except BaseException as e:
            failure = self._failure or self._poll(_REPORT_WAIT_S)
            self._failure = failure or WorkerError(0, f"{what} failed on rank 0: {e!r}")
            self.close()
            if failure is not None:
                raise failure from e
            raise
        self._raise_if_dead()  # NCCL: its collectives were aborted, this part's results are not to be used

    def _raise_if_dead(self) -> None:
        if self._dead:
            self._failure = self._poll(_REPORT_WAIT_S) or WorkerError(self._dead[0], "its process ended")
            self.close()
            raise self._failure

    # ------------------------------------------------------------ steps
    def attach(self, inputs: Any) -> None:
        """Record each call of ``inputs.stage`` (an ``InputBatch``): the workers stage the same arguments."""
        stage = inputs.stage

        def recorded(*args: Any) -> None:
            self._staged = args
            return stage(*args)

        inputs.stage = recorded

    def send_step(self, input_ids: Any, full_graph: bool, num_seqs: int, num_tokens: int, t: int, b: int,
                  num_decodes: int, device_ids: bool) -> None:
        """Send the step just staged (see :meth:`attach`) to every worker; with ``device_ids`` (async scheduling)
        also broadcast the step's first ``b`` input ids from ``input_ids``, where they already are."""
        self._send(step_message(self._staged, full_graph, num_seqs, num_tokens, t, b, num_decodes, device_ids))
        if device_ids:
            dist.broadcast(input_ids[:b], src=0)  # device to device on NCCL, in stream order: no host sync

    def _send(self, message: Any) -> None:
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send(message)
            except OSError as e:  # a closed pipe: the worker is gone
                raise self._poll(_REPORT_WAIT_S) or WorkerError(rank, f"its pipe is closed ({e})") from None

    def wait_ready(self) -> None:
        """Wait for every worker's "ready" (its model built, warmed up and captured), at most ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            left = deadline - time.monotonic()
            if not multiprocessing.connection.wait([conn, proc.sentinel], max(left, 0)):
                raise WorkerError(rank, f"not ready within {self.timeout_s:.0f}s")
            if not conn.poll():
                raise self._poll(_REPORT_WAIT_S) or WorkerError(rank, f"exited with code {proc.exitcode}")
            kind, text = conn.recv()
            if kind != "ready":
                raise WorkerError(rank, _summary(text))

    def close(self) -> None:
        """Stop the workers (asked first, then terminated) and leave the group; safe to call twice."""
        self._finalizer()


def _watch(procs: list[Any], stop: Any, dead: list[int], group: dist.ProcessGroup | None) -> None:
    """Until ``stop`` is closed: note the rank of a worker whose process ends in ``dead`` and abort ``group``
    (NCCL; gloo's collectives fail by themselves when a peer's connection closes)."""
    sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs, start=1)}
    ready = multiprocessing.connection.wait([stop, *sentinels])
    if stop in ready:
        return
    dead.extend(sentinels[r] for r in ready)
    logger.error("tensor parallel: worker rank(s) %s ended", dead)
    abort = getattr(group, "abort", None)  # ProcessGroup.abort: torch >= 2.6
    if abort is not None:
        with contextlib.suppress(Exception):
            abort()


def _shut_down(procs: list[Any], conns: list[Any], state: list[TensorParallelState | None],
               stop_watch: Any = None) -> None:
    if stop_watch is not None:
        stop_watch.close()
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(None)
    deadline = time.monotonic() + _CLOSE_S
    # Rank 0 leaves the group now, while the workers leave theirs, not after their exit: a leave that waits on the
    # other ranks (NCCL's communicator destroy, an intra-node collective) then waited for peers already gone, for
    # ever (issue 17: a benchmark's close never returned). destroy_tensor_parallel aborts NCCL groups instead.
    leaving = _leave(state[0], all(p.is_alive() for p in procs)) if state[0] is not None else None
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.1))
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)
    for conn in conns:
        conn.close()
    if leaving is not None:
        leaving.join(max(deadline - time.monotonic(), 0.1))
        if leaving.is_alive():  # a daemon thread: the caller goes on (its group's name is gone: no model runs on it)
            logger.error("tensor parallel: rank 0 did not leave its group within %.0fs (a worker that never left "
                         "its own?); going on without it", _CLOSE_S)
    logger.debug("tensor parallel: %d workers stopped", len(procs))


def _leave(state: TensorParallelState, peers_alive: bool) -> threading.Thread | None:
    """Leave ``state``'s group in a daemon thread (whose join the caller bounds), aborting it first where a worker
    is already gone (no collective leave is possible then); inline where no thread can start (at exit)."""
    disable_symmetric(state.group_name)

    def leave() -> None:
        with contextlib.suppress(Exception):
            destroy_tensor_parallel(state, abort=not peers_alive)

    thread = threading.Thread(target=leave, name="dynamo-once-tp-leave", daemon=True)
    try:
        thread.start()
    except RuntimeError:  # interpreter shutdown (Python >= 3.12 starts no thread then)
        leave()
        return None
    return thread


def _summary(report: str) -> str:
    """A worker's traceback with its last line (the exception) first."""
    lines = report.rstrip().splitlines()
    return f"{lines[-1]}\n{report}" if lines else "(no report)"
