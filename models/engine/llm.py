"""``LLM``: batches sequences of different lengths through a model, with a paged KV cache, and samples.

The facade over the engine's parts: the :class:`Scheduler` picks each step's sequences and tokens (decodes
first, chunked prefill; see :mod:`.scheduler`), the :class:`InputBatch` stages the step's inputs into
persistent buffers, :class:`StepGraphs` picks the graph it runs and its padding, and :meth:`LLM._execute`
runs the model on it.

At construction the runner builds the model under the requested compilation
level, allocates the cache and makes a warm-up forward of ``max_num_tokens``
tokens with no attention metadata: at levels >= 1 that is the one trace
(Dynamo specializes sizes 0 and 1, so the first call must not be a small
decode batch), and ``compile_time_s`` measures it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dispatcher import (
    CompilationConfig,
    CompilationLevel,
    CUDAGraphs,
    TorchCompileWrapperWithCustomDispatcher,
    get_compilation_config,
    set_compilation_config,
)

from ..forward_context import ForwardContext, set_forward_context
from .kv_cache import KVCache, attention_layers
from ..loader import load_model
from .graphs import StepGraphs, check_one_dynamic_size
from .input_batch import InputBatch
from .sampling import Sampler, host_chooser, make_sampler
from .scheduler import Scheduler
from .sequence import Chooser, Seq
from .startup import StartupReport, process_age_s
from .stats import GenerateStats

logger = logging.getLogger(__name__)

__all__ = ["LLM"]


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
        self.startup = StartupReport(import_s=process_age_s())  # filled as the phases end; logged at INFO
        self._execute = self.startup.first_token(self._execute)
        t0 = time.perf_counter()
        self.model = self._build_model(model, config, dtype, device)
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
        self.input_batch = InputBatch(max_num_tokens, max_num_seqs, self.max_blocks_per_seq, block_size, self.device)
        # The persistent buffers under the runner's names (never rebound: each step's inputs are views of them).
        inputs = self.input_batch
        self.input_ids, self.positions, self.slot_mapping = inputs.input_ids, inputs.positions, inputs.slot_mapping
        self.query_start_loc, self.seq_lens = inputs.query_start_loc, inputs.seq_lens
        self.block_table = inputs.block_table
        self.graphs = StepGraphs(inputs, max_num_tokens, max_num_seqs)
        self.scheduler = Scheduler(self.kv_cache, max_num_tokens, max_num_seqs, chunked_prefill, self.device)
        self.stats = GenerateStats()
        self.compile_time_s = self._warm_up()
        logger.info("LLM: %s at level %s, warm-up (trace + compile) %.2fs", type(self.model).__name__,
                    self.level.name, self.compile_time_s)
        check_one_dynamic_size(compiled)
        self.capture_time_s = self.graphs.setup(self.model, self.layers, self.kv_cache, self.level,
                                                compiled[0].compilation_config if compiled else config)
        self.startup.finish(compiled, self.load_time_s, self.compile_time_s, self.capture_time_s)

    @staticmethod
    def _build_model(model: str | nn.Module | Callable[[], nn.Module], config: CompilationConfig,
                     dtype: torch.dtype | str | None, device: torch.device | str | None) -> nn.Module:
        with set_compilation_config(config):
            if isinstance(model, str):
                return load_model(model, dtype=dtype, device=device)
            if isinstance(model, nn.Module):
                return model
            if callable(model):
                return model()
        raise TypeError(f"LLM: model must be a path, a built-in name, an nn.Module or a factory; "
                        f"got {type(model).__name__}")

    # ------------------------------------------------------------ the parts' knobs, under the runner's names
    @property
    def chunked_prefill(self) -> bool:
        return self.scheduler.chunked_prefill

    @chunked_prefill.setter
    def chunked_prefill(self, value: bool) -> None:
        self.scheduler.chunked_prefill = value

    @property
    def piece_sizes(self) -> list[int]:
        """Token counts with piecewise CUDA graphs; a step is padded up to the next (empty: no padding)."""
        return self.graphs.piece_sizes

    @piece_sizes.setter
    def piece_sizes(self, sizes: list[int]) -> None:
        self.graphs.piece_sizes = sizes

    @property
    def full_sizes(self) -> list[int]:
        """Decode batch sizes with whole-step CUDA graphs."""
        return self.graphs.full_sizes

    @full_sizes.setter
    def full_sizes(self, sizes: list[int]) -> None:
        self.graphs.full_sizes = sizes

    @property
    def cuda_graphs(self) -> CUDAGraphs | None:
        """Every CUDA graph of the model (``dispatcher.CUDAGraphs``: piecewise and whole-step, by mode and
        size), None without graphs."""
        return self.graphs.cuda_graphs

    @property
    def pad_block(self) -> int | None:
        """The cache block that padding writes to (reserved with the CUDA graphs)."""
        return self.input_batch.pad_block

    @pad_block.setter
    def pad_block(self, block: int) -> None:
        self.input_batch.pad_block = block

    # ------------------------------------------------------------ forward
    def _warm_up(self) -> float:
        t0 = time.perf_counter()
        with set_forward_context(ForwardContext(self.layers, None)), torch.inference_mode():
            self.model(self.input_ids, self.positions)
        self._sync()
        return time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _execute(self, batch: list[tuple[Seq, int]], num_decodes: int,
                 device_ids: torch.Tensor | None = None, id_rows: list[int] | None = None) -> torch.Tensor:
        """One forward over ``batch`` (sequence, new tokens), decodes first; logits ``[B, vocab]`` of each last token.

        ``device_ids``: a decode-only step's input ids, already on the device (async scheduling: the last
        step's sampled tokens, not yet on the host); ``id_rows``: which of them, when not all.
        """
        full_graph, num_seqs, num_tokens, t, images, md = self.input_batch.prepare(
            batch, num_decodes, self.graphs.padding, device_ids, id_rows)
        b = len(batch)
        if full_graph:
            return self.graphs.replay(num_seqs)[:b]
        with set_forward_context(ForwardContext(self.layers, md)), torch.inference_mode():
            if images:
                embeds = self.model.embed_multimodal(self.input_ids[:t], images)  # [T, hidden]
                hidden = self.model(self.input_ids[:t], self.positions[:t], embeds)
            else:
                hidden = self.graphs.forward(self.model, num_tokens)  # [T, hidden]
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
        sample = make_sampler(temperature, top_k, torch.Generator(device=self.device).manual_seed(seed))
        return self._run(prompt_token_ids, max_new_tokens, host_chooser(sample), eos_token_id, images,
                         fp32_logits=False, sample=sample if self.async_scheduling else None)

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
        """:meth:`run`, through :meth:`Scheduler.run` (which says what ``fp32_logits`` and ``sample`` do)."""
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1; got {max_new_tokens}")
        if images is not None and len(images) != len(prompt_token_ids):
            raise ValueError(f"generate: images must have one entry (None or images) per prompt: "
                             f"{len(prompt_token_ids)} prompts, {len(images)} entries")
        seqs = [self._new_seq(i, p, max_new_tokens, None if images is None else images[i])
                for i, p in enumerate(prompt_token_ids)]
        self.stats = stats = GenerateStats()
        self.scheduler.run(seqs, max_new_tokens, self._execute, choose, eos_token_id, fp32_logits, sample, stats)
        self.input_batch.forget_table()  # the block table's rows are stale once their sequences are gone
        return [s.tokens[s.prompt_len:] for s in seqs]

    def _new_seq(self, index: int, prompt: Sequence[int], max_new_tokens: int, images: Any = None) -> Seq:
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
        seq = Seq(index, tokens, len(tokens), max_new_tokens)
        if images is not None:
            if not hasattr(self.model, "prepare_images"):
                raise ValueError(f"{where}: images given, but {type(self.model).__name__} takes no images")
            seq.images = self.model.prepare_images(tokens, images, where)
        return seq
