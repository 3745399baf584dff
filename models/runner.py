"""``LLM``: batches sequences of different lengths through a model, with a paged KV cache, and samples.

Each step runs one forward over a flat batch: first one token for every
running (decode) sequence, then prompt tokens while the step's token budget
(``max_num_tokens``) and the cache allow, so prefill and decode sequences
share steps. With ``chunked_prefill`` (default) a prompt that does not fit the
budget left in a step is prefilled in chunks over several steps, each chunk
attending to the cached earlier ones, so prompts may be longer than
``max_num_tokens``; prompts with images are always prefilled whole. A sequence
gets the cache blocks for ``prompt + max_new_tokens`` when it is admitted (no
preemption).

At construction the runner builds the model under the requested compilation
level, allocates the cache and makes a warm-up forward of ``max_num_tokens``
tokens with no attention metadata: at levels >= 1 that is the one trace
(Dynamo specializes sizes 0 and 1, so the first call must not be a small
decode batch), and ``compile_time_s`` measures it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dispatcher import (
    CompilationConfig,
    CompilationLevel,
    TorchCompileWrapperWithCustomDispatcher,
    get_compilation_config,
    set_compilation_config,
)

from dispatcher.cuda_graph import FullGraphs, capture_sizes, mark_static_buffers

from .forward_context import AttentionMetadata, ForwardContext, set_forward_context
from .kv_cache import KVCache, attention_layers
from .loader import load_model

logger = logging.getLogger(__name__)

__all__ = ["LLM", "GenerateStats"]


@dataclasses.dataclass
class GenerateStats:
    """Timing of the last :meth:`LLM.generate`; a step is one forward + sampling."""

    num_steps: int = 0
    num_mixed_steps: int = 0
    """Steps holding both decode and prefill sequences."""
    step_times_s: list[float] = dataclasses.field(default_factory=list)
    decode_step_times_s: list[float] = dataclasses.field(default_factory=list)
    """Steps with decode sequences only."""
    num_generated: int = 0
    num_overlapped_steps: int = 0
    """Decode steps launched before the last step's tokens were read (``async_scheduling``)."""
    total_s: float = 0.0

    @property
    def median_decode_step_s(self) -> float:
        times = sorted(self.decode_step_times_s or self.step_times_s)
        return times[len(times) // 2] if times else float("nan")


@dataclasses.dataclass(eq=False)  # compared by identity (the runner's block-table reuse)
class _Seq:
    index: int
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose keys and values are in the cache
    images: Any = None  # the model's prepare_images() of this prompt's images, used at its prefill

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len


Chooser = Callable[[list[_Seq], torch.Tensor], list[int]]
Sampler = Callable[[torch.Tensor], torch.Tensor]  # logits [B, vocab] -> token ids [B], on the device


@dataclasses.dataclass(eq=False)
class _Pending:
    """A decode-only step whose sampled tokens are on the device, on their way to a host buffer."""

    seqs: list[_Seq]
    tokens: torch.Tensor  # [B] int64, on the device: the next step's input ids
    host: torch.Tensor  # [B] int64 (pinned on CUDA), filled by an asynchronous copy
    copied: Any  # torch.cuda.Event recorded after that copy; None on the CPU
    t0: float  # when the step was launched


def _next_size(sizes: list[int], n: int) -> int | None:
    """The smallest of ``sizes`` (sorted) that holds ``n``; None if none does."""
    for size in sizes:
        if size >= n:
            return size
    return None


class LLM:
    """Run a causal LM over batches of token-id prompts.

    Args:
        model: a checkpoint directory or built-in name (:func:`models.load_model`), a
            callable returning a model (called under the compilation config), or a
            model already built (then ``level`` must be None: its level was read at its construction).
        level: compilation level; None: ``compilation_config``'s, else the environment's.
        max_num_tokens: tokens per step (the largest T the model sees), >= 2.
        max_num_seqs: sequences per step (default ``min(64, max_num_tokens)``).
        num_cache_tokens: the KV cache's token budget, shared by all sequences
            (default: ``max(8192, max_num_tokens)``).
        block_size: tokens per cache block.
        dtype, device: for loading ``model`` by name and for the cache (default: the model's).
        compilation_config: base config (default: the current one); ``level`` overrides its level.
        chunked_prefill: split prompts over steps to fill each step's token budget (False: whole
            prompts only, and a prompt longer than ``max_num_tokens`` is refused).
        async_scheduling: in :meth:`generate`, once every prompt is admitted, launch each decode step
            before reading the last one's tokens: its input ids come from the device, and the host's
            bookkeeping and the next step's inputs overlap the GPU's work. A sequence that ends on its
            end-of-sequence token has computed one step more, whose token is dropped. Greedy tokens are
            the same as without; sampled ones are reproducible for a seed, drawn in another order.
            None (default): on for a CUDA model, where it makes a decode step of ``generate`` 6-9%
            faster (llama-3.2-1b on an H200, batch 1-128); off on the CPU, where the host runs the
            model itself and there is nothing to overlap.
    """

    def __init__(self, model: str | nn.Module | Callable[[], nn.Module], level: int | str | None = None,
                 max_num_tokens: int = 512, max_num_seqs: int | None = None, num_cache_tokens: int | None = None,
                 block_size: int = 16, dtype: torch.dtype | str | None = None,
                 device: torch.device | str | None = None,
                 compilation_config: CompilationConfig | None = None, chunked_prefill: bool = True,
                 async_scheduling: bool | None = None) -> None:
        self.chunked_prefill = chunked_prefill
        if max_num_tokens < 2:
            raise ValueError(f"LLM: max_num_tokens must be >= 2 (the warm-up trace needs T >= 2); got {max_num_tokens}")
        max_num_seqs = min(64, max_num_tokens) if max_num_seqs is None else max_num_seqs
        if not 1 <= max_num_seqs <= max_num_tokens:
            raise ValueError(f"LLM: max_num_seqs must be in [1, max_num_tokens={max_num_tokens}]; got {max_num_seqs}")
        config = (compilation_config or get_compilation_config()).copy()
        if level is not None:
            if isinstance(model, nn.Module):
                raise ValueError("LLM: level applies when the LLM builds the model; a model passed in "
                                 "already read its level at construction (pass a name, path or factory)")
            config.level = CompilationLevel.parse(level)
        t0 = time.perf_counter()
        with set_compilation_config(config):
            if isinstance(model, str):
                self.model = load_model(model, dtype=dtype, device=device)
            elif isinstance(model, nn.Module):
                self.model = model
            elif callable(model):
                self.model = model()
            else:
                raise TypeError(f"LLM: model must be a path, a built-in name, an nn.Module or a factory; "
                                f"got {type(model).__name__}")
        self.load_time_s = time.perf_counter() - t0
        self.model.eval()
        self.compilation_config = config
        compiled = [m for m in self.model.modules() if isinstance(m, TorchCompileWrapperWithCustomDispatcher)]
        self.level = compiled[0].compilation_level if compiled else config.level
        param = next(self.model.parameters())
        self.device = param.device
        self.async_scheduling = self.device.type == "cuda" if async_scheduling is None else async_scheduling
        self.dtype = param.dtype
        self.vocab_size: int = self.model.config.vocab_size
        self.max_model_len: int = self.model.config.max_position_embeddings
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.layers = attention_layers(self.model)
        self.kv_cache = KVCache(self.layers, num_cache_tokens or max(8192, max_num_tokens), block_size,
                                dtype=self.dtype, device=self.device)
        self.max_blocks_per_seq = self.kv_cache.blocks_for(self.max_model_len)
        # Persistent input and metadata buffers, sized for the largest step: each step's inputs are
        # views of them, so a CUDA graph captured on them stays valid.
        # Per-token and per-sequence buffers are rows of one tensor each, filled from a (pinned, on
        # CUDA) host staging tensor of the same shape, one asynchronous copy a row.
        dev, i32, i64 = self.device, torch.int32, torch.int64
        pin = dev.type == "cuda"
        self._tok = torch.zeros(3, max_num_tokens, dtype=i64, device=dev)
        self.input_ids, self.positions, self.slot_mapping = self._tok.unbind(0)
        # Per sequence: query_start_loc, seq_lens, and (async scheduling, when some sequences stop) which of
        # the last step's sampled tokens each reads.
        self._seq = torch.zeros(3, max_num_seqs + 1, dtype=i32, device=dev)
        self.query_start_loc, self.seq_lens, self._id_rows = self._seq[0], self._seq[1, :-1], self._seq[2, :-1]
        # On the CPU, the buffers are their own staging tensors: nothing to copy.
        self._tok_host = torch.zeros(3, max_num_tokens, dtype=i64, pin_memory=True) if pin else self._tok
        self._seq_host = torch.zeros(3, max_num_seqs + 1, dtype=i32, pin_memory=True) if pin else self._seq
        # NumPy views of the staging tensors: a list assigned into one is ~7x faster than torch.tensor
        # of it (6.7 against 50 us for three rows of 128 ints on the CPU machine).
        self._tok_np, self._seq_np = self._tok_host.numpy(), self._seq_host.numpy()
        # Recorded after each step's copies out of the staging tensors (CUDA: they are asynchronous).
        self._staged = torch.cuda.Event() if pin else None
        # Two host buffers for sampled tokens, alternating: one step's are read while the next's arrive.
        self._sampled_host = [torch.zeros(max_num_seqs, dtype=i64, pin_memory=pin) for _ in range(2)]
        self._sampled_events = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self._sampled_slot = 0
        self.block_table = torch.zeros(max_num_seqs, self.max_blocks_per_seq, dtype=i32, device=dev)
        self._table_seqs: list[_Seq | None] = []  # whose rows block_table holds, in order (None: a dummy)
        self.stats = GenerateStats()
        self.compile_time_s = self._warm_up()
        logger.info("LLM: %s at level %s, warm-up (trace + compile) %.2fs", type(self.model).__name__,
                    self.level.name, self.compile_time_s)
        self._check_one_dynamic_size(compiled)
        self.capture_time_s = self._setup_cuda_graphs(compiled[0].compilation_config if compiled else config)

    # ------------------------------------------------------------ forward
    def _warm_up(self) -> float:
        t0 = time.perf_counter()
        with set_forward_context(ForwardContext(self.layers, None)), torch.inference_mode():
            self.model(self.input_ids, self.positions)
        self._sync()
        return time.perf_counter() - t0

    @staticmethod
    def _check_one_dynamic_size(compiled: list[TorchCompileWrapperWithCustomDispatcher]) -> None:
        """Levels 3-4: the traced step must have one dynamic size (the token count); with two, the
        piecewise backend would run without per-size compiles and CUDA graphs, only logging a warning.
        The runner's inputs are built for one, so a second is a bug here, not a model's choice."""
        for wrapper in compiled:
            backend = getattr(getattr(wrapper, "_do_backend", None), "piecewise", None)
            if backend is not None and backend.pieces and backend.size_symbol is None:
                raise RuntimeError(f"LLM: {backend.owner} was traced with more than one dynamic size, so its "
                                   f"pieces get no per-size compiles or CUDA graphs; the runner expects the "
                                   f"token count alone (see the warning logged by dispatcher.piecewise)")

    def _setup_cuda_graphs(self, config: CompilationConfig) -> float:
        """Levels 3-4 on CUDA: capture every capture size at start-up; returns seconds taken.

        Piecewise graphs (one per piece per size, attention eager between them) serve every
        step of up to the largest capture size, its tokens padded up to the next size. With
        ``full_and_piecewise``, a decode-only step of up to ``max_num_seqs`` sequences instead
        replays one whole-step graph (attention included), padded with dummy sequences that
        attend to, and write into, one reserved cache block.
        """
        self.piece_sizes: list[int] = []
        self.full_sizes: list[int] = []
        self.full_graphs: FullGraphs | None = None
        if (self.device.type != "cuda" or self.level < CompilationLevel.INDUCTOR or not config.use_cudagraph
                or config.cudagraph_mode == "none"):
            return 0.0
        sizes = config.cudagraph_capture_sizes
        self.piece_sizes = [n for n in sizes if n <= self.max_num_tokens]
        if config.cudagraph_mode == "full_and_piecewise":
            self.full_sizes = [n for n in sizes if n <= self.max_num_seqs]
            self.full_graphs = FullGraphs()
        self.pad_block = self.kv_cache.allocate(1)[0]  # padding tokens write here, never read by a sequence
        mark_static_buffers(self.input_ids, self.positions)  # read in place by the graphs: no copy per step
        self._full_md: dict[int, AttentionMetadata] = {}

        def capture(n: int) -> None:
            if n in self.piece_sizes:  # warm-up, then capture; attention (eager between pieces) gets no metadata
                for _ in range(2):
                    with set_forward_context(ForwardContext(self.layers, None)), torch.inference_mode():
                        self.model(self.input_ids[:n], self.positions[:n])
            if n in self.full_sizes:
                self._full_md[n] = self._dummy_decodes(n)
                self.full_graphs.capture(n, lambda: self._decode_step(n))

        dt = capture_sizes(capture, sorted(set(self.piece_sizes) | set(self.full_sizes)),
                           desc=f"capturing CUDA graphs ({config.cudagraph_mode})")
        logger.info("LLM: captured CUDA graphs for %d piecewise and %d full sizes in %.1fs",
                    len(self.piece_sizes), len(self.full_sizes), dt)
        return dt

    def _dummy_decodes(self, n: int) -> AttentionMetadata:
        """``n`` dummy decode sequences in the persistent buffers and their metadata: what a whole-step
        graph is captured on."""
        ids, pos, slots, starts, lens = [], [], [], [0], []
        self._add_padding(ids, pos, slots, starts, lens, n, 0)
        self._stage(ids, pos, slots, starts, lens, torch.full((n, 1), self.pad_block, dtype=torch.int32))
        self._table_seqs = []
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], query_start_loc=self.query_start_loc[:n + 1],
            seq_lens=self.seq_lens[:n], block_table=self.block_table[:n], num_decodes=n,
            query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=[1] * n, max_seq_len=1)

    def _decode_step(self, n: int) -> torch.Tensor:
        """A decode-only step of ``n`` sequences over the persistent buffers: logits ``[n, vocab]``."""
        with set_forward_context(ForwardContext(self.layers, self._full_md[n])), torch.inference_mode():
            return self.model.compute_logits(self.model(self.input_ids[:n], self.positions[:n]))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _padding(self, b: int, t: int, num_decodes: int, images: bool) -> tuple[bool, int, int]:
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

    def _add_padding(self, ids: list[int], pos: list[int], slots: list[int], starts: list[int], lens: list[int],
                     pad_seqs: int, pad_tokens: int) -> None:
        """Append ``pad_seqs`` dummy decode sequences (one token at position 0, in the reserved pad block) or
        ``pad_tokens`` padding tokens of no sequence (their keys and values also go to the pad block)."""
        k = pad_seqs + pad_tokens
        ids += [0] * k
        pos += [0] * k
        slots += [self.pad_block * self.kv_cache.block_size] * k
        starts += range(starts[-1] + 1, starts[-1] + pad_seqs + 1)
        lens += [1] * pad_seqs

    def _stage(self, ids: list[int], pos: list[int], slots: list[int], starts: list[int], lens: list[int],
               rows: torch.Tensor | None, id_rows: list[int] | None = None) -> None:
        """Write a step's inputs into the persistent buffers through the (pinned, on CUDA) staging tensors:
        per token ``ids, pos, slots``; per sequence ``starts`` (one more), ``lens`` and ``id_rows``; and
        block-table ``rows`` (None: the table already holds them)."""
        t, n = len(ids), len(lens)
        if self._staged is not None:  # the last step's copies may still be reading the staging tensors
            self._staged.synchronize()
        self._tok_np[:, :t] = (ids, pos, slots)
        self._seq_np[0, :n + 1] = starts
        self._seq_np[1, :n] = lens
        if id_rows is not None:
            self._seq_np[2, :len(id_rows)] = id_rows
        # Row by row: a row's first entries are contiguous at both ends, so each is one asynchronous copy
        # from pinned memory. A [rows, :n] slice is not, and copy_ would stage it through a pageable
        # temporary (a synchronous copy) and a device-side scatter.
        if self._tok_host is not self._tok:
            for r in range(3):
                self._tok[r, :t].copy_(self._tok_host[r, :t], non_blocking=True)
            for r in range(2 if id_rows is None else 3):
                self._seq[r, :n + 1].copy_(self._seq_host[r, :n + 1], non_blocking=True)
        if rows is not None:
            self.block_table[:n, :rows.shape[1]].copy_(rows, non_blocking=True)
        if self._staged is not None:
            self._staged.record()

    def _execute(self, batch: list[tuple[_Seq, int]], num_decodes: int,
                 device_ids: torch.Tensor | None = None, id_rows: list[int] | None = None) -> torch.Tensor:
        """One forward over ``batch`` (sequence, new tokens), decodes first; logits ``[B, vocab]`` of each last token.

        ``device_ids``: a decode-only step's input ids, already on the device (async scheduling: the last
        step's sampled tokens, not yet on the host); ``id_rows``: which of them, when not all.
        """
        bs = self.kv_cache.block_size
        b = len(batch)
        # Decodes (one token each, first in the batch) as whole-list comprehensions: per-sequence Python
        # statements cost ~1.5 us each at batch 128 on the CPU machine.
        decodes = [seq for seq, _ in batch[:num_decodes]]
        pos = [seq.num_computed for seq in decodes]
        ids = [0] * num_decodes if device_ids is not None else [seq.tokens[p] for seq, p in zip(decodes, pos)]
        slots = [seq.blocks[p // bs] * bs + p % bs for seq, p in zip(decodes, pos)]
        lens = [p + 1 for p in pos]
        starts = list(range(num_decodes + 1))
        for seq, n in batch[num_decodes:]:  # prompt chunks
            first = seq.num_computed
            ids += seq.tokens[first:first + n]
            new_pos = range(first, first + n)
            pos += new_pos
            slots += [seq.blocks[p // bs] * bs + p % bs for p in new_pos]
            starts.append(starts[-1] + n)
            lens.append(first + n)
        t = starts[-1]
        # Prompts with images in this step (always prefilled whole), for embed_multimodal.
        images = [(starts[i], seq.images) for i, (seq, _) in enumerate(batch[num_decodes:], num_decodes)
                  if seq.images is not None and seq.num_computed == 0]
        # Padding is decided from host facts, so that it goes out with the step's own inputs.
        full_graph, pad_seqs, pad_tokens = self._padding(b, t, num_decodes, bool(images))
        if pad_seqs or pad_tokens:
            self._add_padding(ids, pos, slots, starts, lens, pad_seqs, pad_tokens)
        num_seqs, num_tokens = b + pad_seqs, t + pad_seqs + pad_tokens
        # A sequence's blocks are allocated whole at admission and never change, so the device block
        # table still holds this step's rows when the step has the last table's sequences in the same
        # order and the same dummies (most decode steps): then nothing is built or copied. Rows are as
        # wide as the longest block list (the kernels read no further); a dummy's row is the pad block.
        seqs: list[_Seq | None] = [seq for seq, _ in batch] + [None] * pad_seqs
        rows = None
        if seqs != self._table_seqs:  # _Seq compares by identity
            width = max(len(seq.blocks) for seq, _ in batch)
            zeros = [0] * width
            table = [seq.blocks + zeros[len(seq.blocks):] for seq, _ in batch]
            if pad_seqs:
                table += [[self.pad_block] + zeros[1:]] * pad_seqs
            rows = torch.tensor(table, dtype=torch.int32)
            self._table_seqs = seqs
        self._stage(ids, pos, slots, starts, lens, rows, id_rows)
        if device_ids is not None:  # after the staged ids (placeholders), in stream order
            if id_rows is None:
                self.input_ids[:b].copy_(device_ids)
            else:
                torch.index_select(device_ids, 0, self._id_rows[:b], out=self.input_ids[:b])
        if full_graph:
            return self.full_graphs.replay(num_seqs)[:b]
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], query_start_loc=self.query_start_loc[:num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs], block_table=self.block_table[:num_seqs],
            num_decodes=num_decodes + pad_seqs, query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens))
        with set_forward_context(ForwardContext(self.layers, md)), torch.inference_mode():
            if images:
                embeds = self.model.embed_multimodal(self.input_ids[:t], images)  # [T, hidden]
                hidden = self.model(self.input_ids[:t], self.positions[:t], embeds)
            else:
                hidden = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens])  # [T, hidden]
            # Each sequence's last token: the first b rows when every sequence has one (no gather), else
            # at query_start_loc[1:] - 1, already on the device.
            last = hidden[:b] if t == b else hidden[self.query_start_loc[1:b + 1] - 1]
            return self.model.compute_logits(last)  # [B, vocab], the model's dtype

    # ------------------------------------------------------------ generate
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int = 16,
                 temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
                 eos_token_id: int | None = None, images: Sequence[Any] | None = None) -> list[list[int]]:
        """Generate up to ``max_new_tokens`` after each prompt; returns the new token ids per prompt.

        Args:
            prompt_token_ids: one list of token ids per sequence, any lengths.
            temperature: 0 for greedy (argmax, ties to the lowest id, as ``transformers``);
                else sample from ``softmax(logits / temperature)``.
            top_k: sample among the ``top_k`` most likely tokens only.
            seed: seeds the sampling generator; the same call gives the same tokens.
            eos_token_id: stop a sequence after this token (None: always ``max_new_tokens``).
            images: for a model that takes images (one with ``prepare_images``, e.g. Llava): one entry
                per prompt, None or that prompt's images (see the model's ``prepare_images``).
        """
        if temperature < 0:
            raise ValueError(f"generate: temperature must be >= 0; got {temperature}")
        gen = torch.Generator(device=self.device).manual_seed(seed)

        def sample(logits: torch.Tensor) -> torch.Tensor:
            if temperature == 0:  # in the model's dtype: converting is exact, so the argmax is the same
                return logits.argmax(dim=-1)
            scaled = logits.float() / temperature
            if top_k is not None:
                kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            probs = torch.softmax(scaled, dim=-1)
            return torch.multinomial(probs, 1, generator=gen).squeeze(1)

        def choose(seqs: list[_Seq], logits: torch.Tensor) -> list[int]:
            return sample(logits).tolist()

        return self._run(prompt_token_ids, max_new_tokens, choose, eos_token_id, images, fp32_logits=False,
                         sample=sample if self.async_scheduling else None)

    def run(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int, choose: Chooser,
            eos_token_id: int | None = None, images: Sequence[Any] | None = None) -> list[list[int]]:
        """The scheduling loop of :meth:`generate` with a custom token chooser.

        ``choose(seqs, logits)`` gets the step's sequences (``seq.index`` is the
        prompt's index, ``seq.num_generated`` the tokens so far) and their
        ``[B, vocab]`` fp32 logits, and returns the next token of each.
        """
        return self._run(prompt_token_ids, max_new_tokens, choose, eos_token_id, images, fp32_logits=True)

    def _run(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int, choose: Chooser,
             eos_token_id: int | None, images: Sequence[Any] | None, fp32_logits: bool,
             sample: Sampler | None = None) -> list[list[int]]:
        """:meth:`run`; ``fp32_logits=False`` hands ``choose`` the model's dtype (a [128, 128256] bf16
        step's conversion alone writes 65 MB). ``sample``: async scheduling (see the class), decode-only
        steps sample with it on the device and are read one step late."""
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1; got {max_new_tokens}")
        if images is not None and len(images) != len(prompt_token_ids):
            raise ValueError(f"generate: images must have one entry (None or images) per prompt: "
                             f"{len(prompt_token_ids)} prompts, {len(images)} entries")
        seqs = [self._new_seq(i, p, max_new_tokens, None if images is None else images[i])
                for i, p in enumerate(prompt_token_ids)]
        waiting, running = deque(seqs), []
        self.stats = stats = GenerateStats()
        t_start = time.perf_counter()
        pending: _Pending | None = None
        self._last_read = t_start
        while waiting or running or pending:
            if pending is not None:
                # Launch the next decode step from the device's tokens before reading them, when it
                # holds exactly the pending step's sequences that go on (none waits to be admitted).
                launched = None
                alive = [s for s in pending.seqs if s.blocks]  # not ended by the read before
                if not waiting and len(running) == len(alive):
                    going_on = [s for s in alive if len(s.tokens) + 1 - s.prompt_len < s.max_new_tokens]
                    if going_on:
                        launched = self._launch_decodes(going_on, pending, sample)
                        stats.num_overlapped_steps += 1
                self._read(pending, stats, eos_token_id)
                running = [s for s in running if s.blocks]
                pending = launched
                continue
            # Decodes first (one token each: the last sampled one), then prompt chunks of the sequences
            # already prefilling, then newly admitted prompts, while the token budget lasts.
            batch = [(s, 1) for s in running if s.num_computed >= s.prompt_len]
            num_decodes = len(batch)
            budget = self.max_num_tokens - num_decodes
            for s in running:
                if s.num_computed < s.prompt_len and budget > 0:
                    n = min(s.prompt_len - s.num_computed, budget)
                    batch.append((s, n))
                    budget -= n
            admitted = []
            while waiting and len(batch) < self.max_num_seqs and budget > 0:
                seq = waiting[0]
                need_blocks = self.kv_cache.blocks_for(seq.prompt_len + max_new_tokens)
                whole = not self.chunked_prefill or seq.images is not None
                if (whole and seq.prompt_len > budget) or need_blocks > self.kv_cache.num_free_blocks:
                    break
                seq.blocks = self.kv_cache.allocate(seq.prompt_len + max_new_tokens)
                waiting.popleft()
                n = min(seq.prompt_len, budget)
                batch.append((seq, n))
                admitted.append(seq)
                budget -= n
            if not batch:  # nothing running, and the first waiting one cannot be admitted
                raise RuntimeError(f"LLM: sequence {waiting[0].index} cannot be scheduled: it needs "
                                   f"{self.kv_cache.blocks_for(waiting[0].prompt_len + max_new_tokens)} cache "
                                   f"blocks of {self.kv_cache.num_blocks}; raise num_cache_tokens")
            t0 = time.perf_counter()
            logits = self._execute(batch, num_decodes)
            if sample is not None and num_decodes == len(batch):  # read one step late
                for seq, _ in batch:
                    seq.num_computed += 1
                pending = self._sampled([seq for seq, _ in batch], sample(logits), t0)
                continue
            if fp32_logits:
                logits = logits.float()
            # Sample only for the sequences whose known tokens are now all computed (decodes, and prompts
            # whose last chunk this was): a partial chunk's logits are not a next-token distribution.
            if num_decodes == len(batch):  # decode-only: every sequence samples
                ready_seqs = [seq for seq, _ in batch]
                tokens = choose(ready_seqs, logits)
            else:
                ready = [i for i, (seq, n) in enumerate(batch) if seq.num_computed + n == len(seq.tokens)]
                ready_seqs = [batch[i][0] for i in ready]
                tokens = choose(ready_seqs, logits if len(ready) == len(batch) else logits[ready]) if ready else []
            dt = time.perf_counter() - t0  # choose() syncs: its tokens are host ints
            stats.num_steps += 1
            stats.step_times_s.append(dt)
            if num_decodes == len(batch):
                stats.decode_step_times_s.append(dt)
            elif num_decodes:
                stats.num_mixed_steps += 1
            for seq, n in batch:
                seq.num_computed += n
            stats.num_generated += len(ready_seqs)
            finished = False
            for seq, tok in zip(ready_seqs, tokens):
                tok = int(tok)
                seq.tokens.append(tok)
                if tok == eos_token_id or len(seq.tokens) - seq.prompt_len >= seq.max_new_tokens:
                    self.kv_cache.free(seq.blocks)
                    seq.blocks = []
                    finished = True
            if finished or admitted:
                running = [s for s in running + admitted if s.blocks]
        stats.total_s = time.perf_counter() - t_start
        self._table_seqs = []  # the block table's rows are stale once their sequences are gone
        return [s.tokens[s.prompt_len:] for s in seqs]

    def _sampled(self, seqs: list[_Seq], tokens: torch.Tensor, t0: float) -> _Pending:
        """Start copying a step's sampled ``tokens`` (device) to the next of the two host buffers."""
        self._sampled_slot ^= 1
        host = self._sampled_host[self._sampled_slot][:len(seqs)]
        host.copy_(tokens, non_blocking=True)
        copied = self._sampled_events[self._sampled_slot]
        if copied is not None:
            copied.record()
        return _Pending(seqs, tokens, host, copied, t0)

    def _launch_decodes(self, seqs: list[_Seq], pending: _Pending, sample: Sampler) -> _Pending:
        """A decode step of ``seqs`` (those of ``pending`` that go on, in its order) whose input ids are
        ``pending``'s sampled tokens, still on the device."""
        t0 = time.perf_counter()
        rows = None
        if len(seqs) != len(pending.seqs):
            keep = set(map(id, seqs))
            rows = [i for i, s in enumerate(pending.seqs) if id(s) in keep]
        logits = self._execute([(s, 1) for s in seqs], len(seqs), device_ids=pending.tokens, id_rows=rows)
        for seq in seqs:
            seq.num_computed += 1
        return self._sampled(seqs, sample(logits), t0)

    def _read(self, pending: _Pending, stats: GenerateStats, eos_token_id: int | None) -> None:
        """A pending step's tokens, on the host: append them, end the sequences they end."""
        if pending.copied is not None:
            pending.copied.synchronize()
        tokens = pending.host.tolist()
        # Since the step's launch, or for a step launched before the last read (overlapped), since that
        # read: the time between two steps' tokens.
        now = time.perf_counter()
        dt = now - max(pending.t0, self._last_read)
        self._last_read = now
        stats.num_steps += 1
        stats.step_times_s.append(dt)
        stats.decode_step_times_s.append(dt)
        for seq, tok in zip(pending.seqs, tokens):
            if not seq.blocks:  # ended on its end-of-sequence token the step before: one past its end
                continue
            seq.tokens.append(tok)
            stats.num_generated += 1
            if tok == eos_token_id or len(seq.tokens) - seq.prompt_len >= seq.max_new_tokens:
                self.kv_cache.free(seq.blocks)
                seq.blocks = []

    def _new_seq(self, index: int, prompt: Sequence[int], max_new_tokens: int, images: Any = None) -> _Seq:
        tokens = [int(t) for t in prompt]
        where = f"generate: prompt {index}"
        if not tokens:
            raise ValueError(f"{where} is empty")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where}: token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        if len(tokens) > self.max_num_tokens and (not self.chunked_prefill or images is not None):
            why = "prompts with images are prefilled whole" if images is not None else "chunked_prefill=False"
            raise ValueError(f"{where} has {len(tokens)} tokens, more than max_num_tokens={self.max_num_tokens} "
                             f"({why}); raise max_num_tokens")
        if len(tokens) + max_new_tokens > self.max_model_len:
            raise ValueError(f"{where}: {len(tokens)} + {max_new_tokens} new tokens exceed the model's "
                             f"max_position_embeddings={self.max_model_len}")
        if self.kv_cache.blocks_for(len(tokens) + max_new_tokens) > self.kv_cache.num_blocks:
            raise ValueError(f"{where}: {len(tokens)} + {max_new_tokens} tokens do not fit the KV cache of "
                             f"{self.kv_cache.num_blocks * self.kv_cache.block_size} tokens; raise num_cache_tokens")
        seq = _Seq(index, tokens, len(tokens), max_new_tokens)
        if images is not None:
            if not hasattr(self.model, "prepare_images"):
                raise ValueError(f"{where}: images given, but {type(self.model).__name__} takes no images")
            seq.images = self.model.prepare_images(tokens, images, where)
        return seq
