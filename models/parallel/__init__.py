"""Tensor parallelism for Llama and Gemma 2 over ``torch.distributed`` (gloo on CPU, NCCL on GPUs).

``LLM(model, tensor_parallel_size=N)`` (CLI: ``--tensor-parallel-size N``) makes the caller's process rank 0
and starts ranks 1..N-1 as worker processes (``torch.multiprocessing``, spawn): each builds its shard of
the model from the same checkpoint, compiles it at the LLM's level and keeps its own KV cache (its KV
heads). The caller schedules and samples; every step it sends the step's staged inputs to the workers
(:mod:`.executor`, :mod:`.worker`) and all ranks run the step together.

The layers (:mod:`.linear`, :mod:`.vocab`), Megatron-style:

- QKV and gate-up are column-parallel: each rank holds its query and KV heads (GQA: the KV heads are split
  too, so ``num_key_value_heads`` and ``num_attention_heads`` must be multiples of N) and its slice of the
  intermediate size; no communication.
- o_proj and down_proj are row-parallel: each rank multiplies its slice of the input features, then one
  all-reduce sums the partial outputs (a bias is added once, after it).
- The embedding is vocab-parallel (each rank its slice of the vocabulary: masked lookup, then an
  all-reduce); the LM head holds the same slice (tied or not) and its logits are all-gathered.

Communication is two custom ops, opaque to Dynamo and Inductor so that the traced graph holds each
collective as one node a graph pass can match (:mod:`.communication`): ``torch.ops.dynamo_once.all_reduce(x,
group_name)`` and ``torch.ops.dynamo_once.all_gather(x, dim, group_name)``. The piecewise backend does not
split at them: NCCL collectives are captured in the pieces' CUDA graphs. The sequence-parallel graph pass
(``dispatcher.passes.sequence_parallel``) rewrites prefill-sized compiles with three more:
``dynamo_once::reduce_scatter``, ``rank_shard`` (:mod:`.communication`) and the GEMMs fused with their
collective, ``matmul_reduce_scatter`` / ``all_gather_matmul`` (:mod:`.async_tp`: torch's symmetric-memory
async-TP ops on CUDA).

On CUDA, ``DYNAMO_ONCE_SYMM_MEM_ALL_REDUCE="ONE_SHOT_KIB,TWO_SHOT_KIB"`` sends all-reduces up to those sizes
through torch's symmetric-memory one-shot / two-shot kernels instead of NCCL (:mod:`.symmetric`; off by
default, the limits are to be measured). NVLink multicast stays off in every process of the group.

Each rank reads only its slices of the checkpoint's tensors (safetensors slices); a built-in model's rank
draws the same random weights as one rank would and keeps its slices. Rank r > 0 keeps its compile-cache
entries in ``<cache dir>/tp<N>-rank<r>/``.

Lifetime and failures: ``LLM.close()`` stops the workers (also done when the LLM is garbage-collected, and
at exit); a worker ends with its caller. A worker that raises or dies, during start-up or a step, is a
:class:`.executor.WorkerError` in the caller naming its rank (with the worker's traceback), never a hang:
every wait has a deadline (:data:`.executor.TIMEOUT_S`), gloo's collectives fail at once when a peer's
connection closes, and on NCCL a watcher aborts the group when a worker's process ends. The group is then
shut down and the LLM refuses further steps.

Async scheduling (on by default on CUDA) works as with one rank: a decode step's input ids, sampled on rank
0's device, are broadcast to the others device to device. Not supported: quantized (W8A8) checkpoints and
Llava (each refused with an error saying so).
"""

# Importing the package registers its collectives (``torch.ops.dynamo_once.all_reduce`` and the others, and the
# fused async-TP ops): a process that only imports ``models.parallel`` (a spawned worker) can call them.
from . import async_tp, communication  # noqa: F401
from .state import (
    TensorParallelState,
    destroy_tensor_parallel,
    divide,
    get_tp_state,
    init_tensor_parallel,
    process_group,
    tp_rank,
    tp_size,
    use_tensor_parallel,
)

__all__ = [
    "TensorParallelState",
    "destroy_tensor_parallel",
    "divide",
    "get_tp_state",
    "init_tensor_parallel",
    "process_group",
    "tp_rank",
    "tp_size",
    "use_tensor_parallel",
]
