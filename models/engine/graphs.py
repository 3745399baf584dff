"""CUDA graphs of the engine's steps: their capture at start-up, and which graph a step runs.

Levels 3-4 on CUDA. Piecewise graphs (one per piece per size, attention eager between them) serve every
step of up to the largest capture size, its tokens padded up to the next size; the compiled pieces
replay them inside a PIECEWISE step the engine declares (``CUDAGraphs.run``). With ``full_and_piecewise``, a decode-only step of up to ``max_num_seqs``
sequences instead replays one whole-step graph (attention included), padded with dummy sequences that
attend to, and write into, one reserved cache block.

Everything the engine does with CUDA graphs is here, so that the mechanism can change in this file
alone: :func:`check_one_dynamic_size` after the trace, :meth:`StepGraphs.setup` at start-up, and at
each step :meth:`StepGraphs.padding` (which graph, how much padding), then :meth:`StepGraphs.replay` (a
whole-step graph) or :meth:`StepGraphs.forward` (the model, its pieces on their graphs).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from dispatcher import (
    CompilationConfig,
    CompilationLevel,
    CUDAGraphMode,
    CUDAGraphs,
    TorchCompileWrapperWithCustomDispatcher,
    envs,
)

from ..attention import Attention, eager_layouts
from ..forward_context import AttentionMetadata, ForwardContext, set_forward_context
from .kv_cache import KVCache
from .input_batch import InputBatch

if TYPE_CHECKING:
    from ops.paged_attention import DecodeWorkspace

logger = logging.getLogger(__name__)

__all__ = ["StepGraphs", "check_one_dynamic_size"]


def check_one_dynamic_size(compiled: Sequence[TorchCompileWrapperWithCustomDispatcher]) -> None:
    """Levels 3-4: the traced step must have one dynamic size (the token count); with two, the
    piecewise backend would run without per-size compiles and CUDA graphs, only logging a warning.
    The runner's inputs are built for one, so a second is a bug here, not a model's choice."""
    for wrapper in compiled:
        n = wrapper.num_dynamic_sizes
        if n is not None and n > 1:
            raise RuntimeError(f"LLM: {type(wrapper).__qualname__}.forward was traced with {n} dynamic sizes, "
                               f"so its pieces get no per-size compiles or CUDA graphs; the runner expects the "
                               f"token count alone (see the warning logged by dispatcher.piecewise)")


def _next_size(sizes: list[int], n: int) -> int | None:
    """The smallest of ``sizes`` (sorted) that holds ``n``; None if none does."""
    for size in sizes:
        if size >= n:
            return size
    return None


class StepGraphs:
    """The CUDA graphs a step may run, over ``inputs``' persistent buffers; none until :meth:`setup`.

    Attributes:
        piece_sizes: token counts with piecewise graphs (empty: no graphs, no padding).
        eager_warm_s: seconds :meth:`setup` took to launch the eager attention of every step layout (its kernels
            compiled or loaded), part of what it returns.
        full_sizes: decode batch sizes with whole-step graphs.
        cuda_graphs: every graph of the model (piecewise and whole-step), None without.
    """

    def __init__(self, inputs: InputBatch, max_num_tokens: int, max_num_seqs: int) -> None:
        self.inputs = inputs
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.piece_sizes: list[int] = []
        self.full_sizes: list[int] = []
        self.cuda_graphs: CUDAGraphs | None = None
        self._captured_pieces: frozenset[int] = frozenset()  # token counts with piecewise graphs
        self._full_md: dict[int, AttentionMetadata] = {}
        self.eager_warm_s = 0.0  # seconds of setup's eager attention launches (_warm_eager_attention)

    @staticmethod
    def captures(device: torch.device, level: CompilationLevel, config: CompilationConfig) -> bool:
        """Whether :meth:`setup` captures graphs (levels 3-4 on CUDA, graphs on): the KV cache then needs its
        pad block (``KVCache(pad_block=True)``)."""
        return (device.type == "cuda" and level >= CompilationLevel.INDUCTOR and config.use_cudagraph
                and config.cudagraph_mode != "none")

    def setup(self, model: nn.Module, layers: dict[str, Attention], kv_cache: KVCache,
              level: CompilationLevel, config: CompilationConfig) -> float:
        """Levels 3-4 on CUDA: capture every capture size of ``config`` at start-up (padding writes to
        ``kv_cache``'s pad block, outside the sequences' budget), then compile what the eager attention of the
        other steps launches (:meth:`_warm_eager_attention`); returns seconds taken, both together."""
        inputs = self.inputs
        if not self.captures(inputs.device, level, config):
            return 0.0
        if kv_cache.pad_block is None:
            raise ValueError("StepGraphs.setup: the KV cache has no pad block (KVCache(..., pad_block=True))")
        sizes = config.cudagraph_capture_sizes
        self.piece_sizes = [n for n in sizes if n <= self.max_num_tokens]
        graphs = self.cuda_graphs = CUDAGraphs()
        inputs.pad_block = kv_cache.pad_block  # padding tokens write here, never read by a sequence
        graphs.mark_static(inputs.input_ids, inputs.positions)  # read in place by the graphs: no copy per step
        dtype = next(model.parameters()).dtype  # the activations', q's and the attention outputs'
        self._piecewise_outputs(layers, graphs, dtype)

        def piece_step(n: int) -> torch.Tensor:  # attention, eager between the pieces, gets no metadata
            with set_forward_context(ForwardContext(layers, None)), torch.inference_mode():
                return model(inputs.input_ids[:n], inputs.positions[:n])

        dt = graphs.capture(self.piece_sizes, CUDAGraphMode.PIECEWISE, piece_step)
        self._captured_pieces = frozenset(graphs.sizes(CUDAGraphMode.PIECEWISE))
        if config.cudagraph_mode == "full_and_piecewise":
            self.full_sizes = [n for n in sizes if n <= self.max_num_seqs]
            dt += graphs.capture(self.full_sizes, CUDAGraphMode.FULL, lambda n: self._decode_step(model, layers, n),
                                 prepare=lambda n: self._full_md.__setitem__(
                                     n, self._dummy_step(n, 1, 0, workspace=inputs.decode_workspace)))
        logger.info("LLM: captured CUDA graphs for %d piecewise and %d full sizes in %.1fs",
                    len(self.piece_sizes), len(self.full_sizes), dt)
        return dt + (self._warm_eager_attention(layers, dtype) if envs.warm_attention() else 0.0)

    def _warm_eager_attention(self, layers: dict[str, Attention], dtype: torch.dtype) -> float:
        """Launch the attention op eagerly, as a piecewise step does, once for each of :func:`eager_layouts`' step
        layouts that no whole-step graph serves, on every distinct layer configuration: each Triton kernel
        specialization such a step can take is then compiled (or loaded from Triton's cache) here, not in the middle
        of serving, where on an H100 each new one held its step 0.3-1 s. Dummy steps: every new key and value goes
        to the pad block, every block read is the pad block, the outputs are dropped. Returns seconds taken."""
        t0 = time.perf_counter()
        kinds: dict[tuple, Attention] = {}
        for layer in layers.values():
            kinds.setdefault((layer.num_heads, layer.num_kv_heads, layer.head_size, layer.sliding_window is None,
                              layer.logits_soft_cap is None, layer.kv_cache.dtype), layer)
        inputs = self.inputs
        max_len = inputs.block_table.shape[1] * inputs.block_size
        layouts = [(d, n, p) for d, n, p in eager_layouts(self.max_num_seqs, self.max_num_tokens, max_len)
                   if p or not self.padding(d, d, d, False)[0]]
        # q, k and v as the model's are: column blocks of one [tokens, (Hq + 2 Hkv) x D] projection, a step's rows of it
        qkvs = []
        for layer in kinds.values():
            kv_width = layer.num_kv_heads * layer.head_size
            qkv = torch.zeros(self.max_num_tokens, layer.num_heads * layer.head_size + 2 * kv_width, dtype=dtype,
                              device=inputs.device)
            qkvs.append((layer, qkv.split([qkv.shape[1] - 2 * kv_width, kv_width, kv_width], dim=-1)))
        with torch.inference_mode():
            for d, n, p in layouts:
                md = self._dummy_step(d, n, p)
                for layer, (q, k, v) in qkvs:
                    t = d + p
                    # a step of up to the largest piecewise size writes into the layer's buffer, a larger one anew
                    fits = layer.piecewise_out is not None and t <= layer.piecewise_out.shape[0]
                    layer.forward_impl(q[:t], k[:t], v[:t], md, out=layer.piecewise_rows(t) if fits else None)
        torch.cuda.synchronize(inputs.device)
        dt = self.eager_warm_s = time.perf_counter() - t0
        logger.info("LLM: launched attention eagerly on %d step layouts x %d layer configurations (their kernels "
                    "compiled) in %.1fs", len(layouts), len(kinds), dt)
        return dt

    def _dummy_step(self, decodes: int, decode_len: int, prompt: int,
                    workspace: DecodeWorkspace | None = None) -> AttentionMetadata:
        """A dummy step in the persistent buffers and its metadata: ``decodes`` sequences of ``decode_len`` tokens
        decoding one, then a new prompt of ``prompt`` tokens (none: 0), every block of every sequence the pad block
        (which no sequence reads). ``decodes`` sequences of one token alone are what a whole-step graph is captured
        on (with the persistent ``workspace``); without one, nothing of the step enters the launch cache."""
        inputs = self.inputs
        t = decodes + prompt
        starts = list(range(decodes + 1)) + ([t] if prompt else [])
        lens = [decode_len] * decodes + ([prompt] if prompt else [])
        slots = [inputs.pad_block * inputs.block_size] * t
        blocks = -(-max(lens) // inputs.block_size)
        inputs.stage([0] * t, [0] * t, slots, starts, lens,
                     torch.full((len(lens), blocks), inputs.pad_block, dtype=torch.int32))
        inputs.forget_table()
        n = len(lens)
        return AttentionMetadata(
            slot_mapping=inputs.slot_mapping[:t], query_start_loc=inputs.query_start_loc[:n + 1],
            seq_lens=inputs.seq_lens[:n], block_table=inputs.block_table[:n], num_decodes=decodes,
            query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens), workspace=workspace)

    def _piecewise_outputs(self, layers: dict[str, Attention], graphs: CUDAGraphs, dtype: torch.dtype) -> None:
        """Give each attention layer a persistent output buffer for PIECEWISE steps, marked static: the piece
        after it reads it in place (no copy into the graph's input per layer and step, 17 MB for a 2048-token
        step of Llama 3 8B; no allocation). One per layer, so that an output stays valid for the whole step;
        ``[largest piecewise size, Hq * D]`` each (Llama 3 8B at 512 tokens: 4 MiB a layer), in the model's ``dtype``
        (q's: not the cache's, which may be fp8)."""
        rows = max(self.piece_sizes, default=0)
        if not rows:
            return
        for layer in layers.values():
            layer.piecewise_out = torch.empty(rows, layer.num_heads * layer.head_size, dtype=dtype,
                                              device=self.inputs.device)
            graphs.mark_static(layer.piecewise_out)

    def padding(self, b: int, t: int, num_decodes: int, images: bool) -> tuple[bool, int, int]:
        """How a step of ``b`` sequences and ``t`` tokens is padded for the CUDA graphs:
        ``(whole-step graph, dummy sequences, padding tokens)``.

        A decode-only step is padded with dummy sequences (one token at position 0, in the reserved pad
        block) up to the next whole-step graph size, else up to the next piecewise size; another step with
        padding tokens of no sequence (their keys and values go to the pad block). Steps with images, and
        steps above the largest size, run unpadded without graphs.
        """
        if not self.piece_sizes or images:
            return False, 0, 0
        n = _next_size(self.full_sizes, b) if num_decodes == b else None
        if n is not None:
            return True, n - b, 0
        padded = _next_size(self.piece_sizes, t)
        if padded is None:
            return False, 0, 0
        if num_decodes == b:
            return False, (padded - b if padded <= self.max_num_seqs else 0), 0
        return False, 0, padded - t

    def forward(self, model: nn.Module, num_tokens: int) -> torch.Tensor:
        """The model on the first ``num_tokens`` staged tokens (padded), in the caller's forward context:
        hidden states ``[T, hidden]``. A size with piecewise graphs runs as a PIECEWISE step (the compiled
        pieces replay their graphs of that size); any other without graphs."""
        ids, pos = self.inputs.input_ids, self.inputs.positions
        if num_tokens in self._captured_pieces:
            return self.cuda_graphs.run(CUDAGraphMode.PIECEWISE, num_tokens, lambda n: model(ids[:n], pos[:n]))
        return model(ids[:num_tokens], pos[:num_tokens])

    def replay(self, num_seqs: int) -> torch.Tensor:
        """Replay the whole-step graph of ``num_seqs`` (padded) decodes on the staged inputs: logits
        ``[num_seqs, vocab]``, in the graph's output buffer (overwritten by the next step with graphs)."""
        return self.cuda_graphs.run(CUDAGraphMode.FULL, num_seqs, None)

    def _decode_step(self, model: nn.Module, layers: dict[str, Attention], n: int) -> torch.Tensor:
        """A decode-only step of ``n`` sequences over the persistent buffers: logits ``[n, vocab]``."""
        inputs = self.inputs
        with set_forward_context(ForwardContext(layers, self._full_md[n])), torch.inference_mode():
            return model.compute_logits(model(inputs.input_ids[:n], inputs.positions[:n]))
