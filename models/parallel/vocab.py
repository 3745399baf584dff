"""Vocab-parallel embedding and LM head: each rank holds one slice of the vocabulary's rows.

Rank ``r`` holds token ids ``r * n : (r + 1) * n``, ``n = ceil(vocab / world_size)``; the last slice is padded
with zero rows when the world size does not divide the vocabulary. The embedding looks up the ids in its
slice (the others read row 0 and are zeroed), then one ``dynamo_once::all_reduce`` sums the ranks' rows:
each id's row comes from the one rank that holds it. The LM head multiplies by the same slice (a tied head
is the embedding's weight) and all-gathers the logits, dropping the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ops

from ..quant_linear import make_linear
from ..quantization import QuantizationConfig
from .communication import tensor_parallel_all_gather, tensor_parallel_all_reduce
from .linear import refuse_quantized
from .state import get_tp_state, tp_size

__all__ = ["VocabParallelEmbedding", "ParallelLMHead", "LMHead", "vocab_parallel_embedding", "parallel_lm_head"]


class _VocabSlice:
    """The rows of a ``[vocab, hidden]`` weight that rank ``rank`` of ``world_size`` holds."""

    def _init_slice(self, vocab_size: int, rank: int, world_size: int, group_name: str | None) -> int:
        self.vocab_size, self.rank, self.world_size, self.group_name = vocab_size, rank, world_size, group_name
        self.rows = -(-vocab_size // world_size)  # ceil
        self.vocab_start = min(rank * self.rows, vocab_size)
        self.vocab_end = min(self.vocab_start + self.rows, vocab_size)
        return self.rows

    def checkpoint_rows(self, leaf: str) -> list[tuple[str | None, int, tuple[int, ...], tuple[int, int, int]]]:
        n = self.vocab_end - self.vocab_start
        return [(None, 0, (self.vocab_size, self.weight.shape[1]), (0, self.vocab_start, n))]

    @property
    def full_weight_shape(self) -> tuple[int, int]:
        return self.vocab_size, self.weight.shape[1]

    def tp_shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the ``[vocab, hidden]`` ``full``, zero-padded to :attr:`rows`."""
        out = full.new_zeros(self.rows, full.shape[1])
        out[:self.vocab_end - self.vocab_start] = full[self.vocab_start:self.vocab_end]
        return out


class VocabParallelEmbedding(_VocabSlice, nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int = 0, world_size: int = 1,
                 group_name: str | None = None) -> None:
        nn.Embedding.__init__(self, self._init_slice(vocab_size, rank, world_size, group_name), hidden_size)
        with torch.no_grad():
            self.weight.zero_()  # padding rows stay zero (the loader fills the others)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [T]
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        rows = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)  # [T, hidden]
        return tensor_parallel_all_reduce(rows, self.group_name)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.embedding_dim}, rows={self.vocab_start}:{self.vocab_end}"


def _head_gemm(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T``: ``ops.linear`` for bf16 / fp16 operands of one dtype (the small-M Triton GEMM at decode
    batch sizes on CUDA: on the H200 the 8B's head at M = 1 in 231 against cuBLAS's 252 µs,
    benchmarks/results/gemm_sweep_separated_unroll.md), else ``F.linear``."""
    if hidden.dim() == 2 and hidden.dtype in ops.LINEAR_DTYPES and weight.dtype == hidden.dtype:
        return ops.linear(hidden, weight)
    return F.linear(hidden, weight)


class LMHead(nn.Linear):
    """The unquantized LM head, ``hidden [B, hidden] -> logits [B, vocab]``: an ``nn.Linear`` without bias whose GEMM
    goes through ``ops.linear``. The logits are computed outside the compiled forward, where the ``small_m_linear``
    graph pass does not reach; a module (not a function beside it) so that hooks on ``lm_head`` still run."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _head_gemm(hidden, self.weight)


class ParallelLMHead(_VocabSlice, nn.Module):
    """``hidden [B, hidden] -> logits [B, vocab]``: this rank's vocabulary slice, then every rank's gathered."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int = 0, world_size: int = 1,
                 group_name: str | None = None) -> None:
        nn.Module.__init__(self)
        rows = self._init_slice(vocab_size, rank, world_size, group_name)
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = tensor_parallel_all_gather(_head_gemm(hidden, self.weight), -1, self.group_name)  # [B, N * rows]
        return logits if logits.shape[-1] == self.vocab_size else logits[:, :self.vocab_size].contiguous()

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]}, {self.vocab_size}, rows={self.vocab_start}:{self.vocab_end}"


def vocab_parallel_embedding(vocab_size: int, hidden_size: int) -> nn.Module:
    """``nn.Embedding`` without a tensor-parallel group, else this rank's :class:`VocabParallelEmbedding`."""
    if tp_size() == 1:
        return nn.Embedding(vocab_size, hidden_size)
    state = get_tp_state()
    return VocabParallelEmbedding(vocab_size, hidden_size, state.rank, state.world_size, state.group_name)


def parallel_lm_head(hidden_size: int, vocab_size: int, quant: QuantizationConfig | None) -> nn.Module:
    """The LM head without a tensor-parallel group (``make_linear``'s quantized linear when ``quant`` targets
    ``lm_head``, else an :class:`LMHead`), else this rank's :class:`ParallelLMHead`."""
    if tp_size() == 1:
        if quant is not None and quant.scheme_for("lm_head") is not None:
            return make_linear(hidden_size, vocab_size, False, quant, "lm_head")
        return LMHead(hidden_size, vocab_size)
    refuse_quantized(quant)
    state = get_tp_state()
    return ParallelLMHead(hidden_size, vocab_size, state.rank, state.world_size, state.group_name)
