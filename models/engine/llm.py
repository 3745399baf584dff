"""``LLM``: batches sequences of different lengths through a model, with a paged KV cache, and samples.

The facade over the engine's parts: the :class:`Scheduler` picks each step's sequences and tokens (decodes
first, chunked prefill; see :mod:`.scheduler`), the :class:`InputBatch` stages the step's inputs into
persistent buffers, :class:`StepGraphs` picks the graph it runs and its padding, and :meth:`LLM._execute`
runs the model on it. Requests go through one :class:`.engine_loop.EngineLoop`: callers on several
threads share its batches, each getting its own results.

Two ways to call :meth:`LLM.generate`: the text way (strings, vLLM-style dicts, or any prompts with
``SamplingParams``) returns a :class:`RequestOutput` per prompt, with text when the checkpoint has a
tokenizer; the token-id way (lists of token ids, no ``SamplingParams``: ``generate(ids, 16,
temperature=..., seed=...)``) returns the new token ids per prompt, as it always has.

At construction the runner builds the model under the requested compilation
level, allocates the cache and makes a warm-up forward of ``max_num_tokens``
tokens with no attention metadata: at levels >= 1 that is the one trace
(Dynamo specializes sizes 0 and 1, so the first call must not be a small
decode batch), and ``compile_time_s`` measures it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from dispatcher import envs
from dispatcher import (
    CompilationConfig,
    CompilationLevel,
    CUDAGraphs,
    TorchCompileWrapperWithCustomDispatcher,
    get_compilation_config,
    set_compilation_config,
)
from ops.kv_quant import KV_CACHE_DTYPES, cache_dtype
from ops.triton_utils import cdiv

from ..forward_context import ForwardContext, set_forward_context
from ..image_processing import load_image_processor, process_images
from ..loader import load_model
from ..parallel.executor import TensorParallelExecutor
from ..parallel.state import TensorParallelState, get_tp_state, use_tensor_parallel
from ..parallel.validate import check_size, check_tensor_parallel, device_type
from ..sampling_params import SamplingParams
from ..tokenizer import eos_token_ids, load_tokenizer
from .detokenizer import IncrementalDetokenizer
from .cache_memory import cache_tokens_for_memory, check_gpu_memory_utilization, profile_memory
from .engine_loop import EngineLoop
from .graphs import StepGraphs, check_one_dynamic_size
from .input_batch import InputBatch
from .grammar import Grammars, StructuredSampler
from .kv_cache import KVCache, attention_layers
from .outputs import RequestOutput
from .progress import progress
from .prompt_logprobs import record_prompt_logprobs, wants_prompt_logprobs
from .prompts import Prompt, is_text_call, parse_prompts
from .request import Request, final_output
from .request_sampler import RequestSampler
from .sampling import ChooserSampler, Sampler, make_sampler
from .scheduler import Scheduler
from .sequence import Chooser, Seq
from .startup import StartupReport, process_age_s
from .stats import GenerateStats

logger = logging.getLogger(__name__)

__all__ = ["LLM"]


class LLM:
    """Run a causal LM over batches of prompts: text (with the checkpoint's tokenizer) or token ids.

    One ``LLM`` may be used from several threads at once: each call's sequences join the running batch
    and each caller gets its own results (see :mod:`.engine_loop`).

    Args:
        model: a checkpoint directory or built-in name (:func:`models.load_model`), a
            callable returning a model (called under the compilation config), or a
            model already built (then ``level`` must be None: its level was read at its construction).
        level: compilation level; None: ``compilation_config``'s, else the environment's.
        max_num_tokens: tokens per step (the largest T the model sees), >= 2.
        max_num_seqs: sequences per step (default ``min(64, max_num_tokens)``).
        num_cache_tokens: the KV cache's token budget, shared by all sequences
            (default: ``max(8192, max_num_tokens)``, or what ``gpu_memory_utilization`` leaves): blocks are taken
            as tokens need them, and when none is left the most recently admitted sequences are preempted and
            computed again later (:mod:`.scheduler`). One sequence's ``prompt + max_tokens`` must fit it whole.
        block_size: tokens per cache block.
        dtype, device: for loading ``model`` by name and for the cache (default: the model's).
        compilation_config: base config (default: the current one); ``level`` overrides its level.
        chunked_prefill: split prompts over steps to fill each step's token budget (False: whole
            prompts only, and a prompt longer than ``max_num_tokens`` is refused).
        async_scheduling: once every prompt is admitted, launch each decode step before reading the last
            one's tokens: its input ids come from the device, and the host's bookkeeping and the next
            step's inputs overlap the GPU's work (not for :meth:`run`, whose chooser reads logits on the
            host). A sequence that ends (end-of-sequence or stop token, stop string) has computed one step
            more, whose token is dropped. Greedy tokens are the same as without; sampled ones are
            reproducible for a seed (the token-id call's are drawn in another order).
            None (default): on for a CUDA model, where it makes a decode step of ``generate`` 6-9%
            faster (llama-3.2-1b on an H200, batch 1-128); off on the CPU, where the host runs the
            model itself and there is nothing to overlap.
        tokenizer: None: the checkpoint directory's (``tokenizer.json`` / ``tokenizer_config.json``, through
            ``transformers.AutoTokenizer``), none for a built-in model or a model passed in; a path: the
            tokenizer there; else a tokenizer object (``encode``, ``decode``, ``apply_chat_template``).
        tensor_parallel_size: ranks that each hold a shard of the model (Llama, Gemma 2; :mod:`models.parallel`):
            this process is rank 0 and starts ranks 1..N-1 as worker processes (one GPU each on CUDA), which
            :meth:`close` stops. Needs ``model`` as a path or built-in name.
        kv_cache_dtype: "auto" (default): the model's dtype, or fp8 where the checkpoint's quantization config
            has a ``kv_cache_scheme``; "fp8" / "fp8_e4m3": an fp8 e4m3 cache (``ops.kv_quant``), half the bytes
            of a bf16 one a token, with the checkpoint's per-layer ``k_scale`` / ``v_scale`` (1 without them).
        enable_prefix_caching: keep every whole cache block of computed tokens after its sequence ends, found
            again by its tokens and all before them (:mod:`.prefix_cache`), so that a prompt starting with an
            earlier one's tokens (a system prompt, a chat's earlier turns) computes only the rest: at most its
            last ``prompt_len - 1`` tokens come from the cache, whole blocks (``block_size``), never for a prompt
            with images. Cached blocks no sequence holds are evicted as the cache needs room, least recently
            released first. On by default, as in vLLM: a prompt whose prefix was cached attends to it as a
            chunk after cached context. In fp32 its tokens are the uncached run's; in bf16 the cached keys and
            values were computed in another step's shape, so they may differ in the last bits, and a near-tie
            between two tokens can turn (``benchmarks/results/prefix_caching*_h200.md``). False: every prompt
            is computed whole. ``RequestOutput.num_cached_tokens`` and ``stats.num_cached_tokens`` say how many
            prompt tokens came from it.
        gpu_memory_utilization: size the KV cache from the GPU's memory instead of ``num_cache_tokens`` (vLLM's
            knob): the share of the device's total memory, in (0, 1], that this process may take, weights,
            activations, CUDA graphs and the cache together; the cache gets what the warm-up's measured needs
            leave (:mod:`.cache_memory` says how). CUDA, one rank; ``llm.kv_cache.num_blocks`` says what it got.
    """

    def __init__(self, model: str | nn.Module | Callable[[], nn.Module], level: int | str | None = None,
                 max_num_tokens: int = 512, max_num_seqs: int | None = None, num_cache_tokens: int | None = None,
                 block_size: int = 16, dtype: torch.dtype | str | None = None,
                 device: torch.device | str | None = None,
                 compilation_config: CompilationConfig | None = None, chunked_prefill: bool = True,
                 async_scheduling: bool | None = None, tokenizer: str | Any | None = None,
                 tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                 enable_prefix_caching: bool = True, gpu_memory_utilization: float | None = None) -> None:
        max_num_seqs = self._check_sizes(max_num_tokens, max_num_seqs, num_cache_tokens, block_size, kv_cache_dtype)
        check_gpu_memory_utilization(gpu_memory_utilization, num_cache_tokens, tensor_parallel_size, device)
        config = (compilation_config or get_compilation_config()).copy()
        if level is not None:
            if isinstance(model, nn.Module):
                raise ValueError("LLM: level applies when the LLM builds the model; a model passed in "
                                 "already read its level at construction (pass a name, path or factory)")
            config.level = CompilationLevel.parse(level)
        if config.level != CompilationLevel.NO_COMPILATION and envs.torch_compile_disabled():
            logger.warning("TORCH_COMPILE_DISABLE=1 disables torch.compile: running level 0 (no compilation) "
                           "instead of level %d (%s)", int(config.level), config.level.name)
            config.level = CompilationLevel.NO_COMPILATION
        self._tp, tp_state = self._start_tensor_parallel(check_size(tensor_parallel_size), dict(
            model=model, max_num_tokens=max_num_tokens, max_num_seqs=max_num_seqs, num_cache_tokens=num_cache_tokens,
            block_size=block_size, dtype=dtype, device=device, compilation_config=config,
            chunked_prefill=chunked_prefill, async_scheduling=async_scheduling, kv_cache_dtype=kv_cache_dtype))
        self.startup = StartupReport(import_s=process_age_s())  # filled as the phases end; logged at INFO
        t0 = time.perf_counter()
        with self._tp_guard("load"), use_tensor_parallel(tp_state):
            self.model = self._build_model(model, config, dtype, device)
        self.load_time_s = time.perf_counter() - t0
        self.model.eval()
        compiled = [m for m in self.model.modules() if isinstance(m, TorchCompileWrapperWithCustomDispatcher)]
        #: the config the model runs with: the one given, or for a W8A8 checkpoint that with its defaults filled
        #: in (:mod:`models.compile_defaults`)
        self.compilation_config = compiled[0].compilation_config if compiled else config
        self.level = compiled[0].compilation_level if compiled else config.level
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size: int = self.model.config.vocab_size
        self.max_model_len: int = self.model.config.max_position_embeddings
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.layers = attention_layers(self.model)
        graph_config = compiled[0].compilation_config if compiled else config
        self.kv_cache_dtype = cache_dtype(kv_cache_dtype, self.dtype, getattr(self.model, "fp8_kv_cache", False))
        self.max_blocks_per_seq = cdiv(self.max_model_len, block_size)
        self.input_batch = InputBatch(max_num_tokens, max_num_seqs, self.max_blocks_per_seq, block_size, self.device)
        # The persistent buffers under the runner's names (never rebound: each step's inputs are views of them).
        inputs = self.input_batch
        self.input_ids, self.positions, self.slot_mapping = inputs.input_ids, inputs.positions, inputs.slot_mapping
        self.query_start_loc, self.seq_lens = inputs.query_start_loc, inputs.seq_lens
        self.block_table = inputs.block_table
        self.graphs = StepGraphs(inputs, max_num_tokens, max_num_seqs)
        cache_args = dict(block_size=block_size, pad_block=StepGraphs.captures(self.device, self.level, graph_config),
                          prefix_caching=bool(enable_prefix_caching), chunked_prefill=chunked_prefill,
                          async_scheduling=async_scheduling)
        if gpu_memory_utilization is None:
            self._build_cache(num_cache_tokens or max(8192, max_num_tokens), **cache_args)
        self._setup_text(model, tokenizer)
        if self._tp is not None:
            self._tp.attach(self.input_batch)
        with self._tp_guard("warm-up"), self._memory_profile(gpu_memory_utilization) as profile:
            self.compile_time_s = self._warm_up()
        logger.info("LLM: %s at level %s, warm-up (trace + compile) %.2fs", type(self.model).__name__,
                    self.level.name, self.compile_time_s)
        if gpu_memory_utilization is not None:  # the cache from what the warm-up left (cache_memory)
            self._build_cache(cache_tokens_for_memory(
                gpu_memory_utilization, profile, self.layers, self.kv_cache_dtype, block_size, max_num_seqs,
                self.vocab_size, max(max_num_tokens, block_size), self.device), **cache_args)
        check_one_dynamic_size(compiled)
        with self._tp_guard("CUDA-graph capture"):
            self.capture_time_s = self.graphs.setup(self.model, self.layers, self.kv_cache, self.level, graph_config)
            if self._tp is not None:
                self._tp.wait_ready()
        self.startup.finish(compiled, self.load_time_s, self.compile_time_s, self.capture_time_s)

    @staticmethod
    def _start_tensor_parallel(size: int, kwargs: dict[str, Any]
                               ) -> tuple[TensorParallelExecutor | None, TensorParallelState]:
        """The group a model of ``size`` ranks is built in: started here (this process rank 0, the workers
        building with ``kwargs``), or the one this process already is a rank of (a worker)."""
        current = get_tp_state()
        if size == 1 or current.world_size > 1:
            if size != current.world_size:
                raise ValueError(f"LLM: tensor_parallel_size={size}, but built in a tensor-parallel group of "
                                 f"{current.world_size}")
            return None, current
        check_tensor_parallel(kwargs["model"], size, kwargs["device"])
        kind = device_type(kwargs["device"])  # rank r on GPU r: a worker builds on its current device
        workers = TensorParallelExecutor(size, LLM, dict(kwargs, async_scheduling=False, tensor_parallel_size=size,
                                                         device=kind if kind == "cuda" else kwargs["device"]), kind)
        # (a worker's own scheduler never runs: the caller's async scheduling reaches it through send_step)
        return workers, workers.state

    def _tp_guard(self, what: str) -> contextlib.AbstractContextManager[None]:
        """Around what every rank runs together: a failure ends the group and names the failing rank."""
        return self._tp.guard(what) if self._tp is not None else contextlib.nullcontext()

    @staticmethod
    def _check_sizes(max_num_tokens: int, max_num_seqs: int | None, num_cache_tokens: int | None, block_size: int,
                     kv_cache_dtype: str) -> int:
        """The size arguments' contract, before anything is built; ``max_num_seqs`` with its default."""
        if max_num_tokens < 2:
            raise ValueError(f"LLM: max_num_tokens must be >= 2 (the warm-up trace needs T >= 2); got {max_num_tokens}")
        if block_size < 1 or (num_cache_tokens is not None and num_cache_tokens < 1):
            raise ValueError(f"LLM: block_size and num_cache_tokens must be >= 1; got {block_size} and "
                             f"{num_cache_tokens}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"LLM: kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got "
                             f"{kv_cache_dtype!r}")
        max_num_seqs = min(64, max_num_tokens) if max_num_seqs is None else max_num_seqs
        if not 1 <= max_num_seqs <= max_num_tokens:
            raise ValueError(f"LLM: max_num_seqs must be in [1, max_num_tokens={max_num_tokens}]; got {max_num_seqs}")
        return max_num_seqs

    def _build_cache(self, num_cache_tokens: int, block_size: int, pad_block: bool, prefix_caching: bool,
                     chunked_prefill: bool, async_scheduling: bool | None) -> None:
        """The KV cache, its scheduler and the engine loop that runs the scheduler's steps."""
        self.kv_cache = KVCache(self.layers, num_cache_tokens, block_size, dtype=self.kv_cache_dtype,
                                device=self.device, pad_block=pad_block, prefix_caching=prefix_caching)
        self.scheduler = Scheduler(self.kv_cache, self.max_num_tokens, self.max_num_seqs, chunked_prefill,
                                   self.device,
                                   self.device.type == "cuda" if async_scheduling is None else async_scheduling,
                                   on_grow=self.input_batch.note_grown)  # a new block: its block-table row
        # The engine calls the step through a weak reference: a bound method would make a cycle (LLM -> engine
        # -> LLM), and `del llm` would free the model and its KV cache only at the next garbage collection.
        self._engine = EngineLoop(self.scheduler, self.startup.first_token(_weak_method(self._execute)),
                                  self.input_batch.forget_table)

    def _memory_profile(self, gpu_memory_utilization: float | None) -> contextlib.AbstractContextManager:
        """The warm-up's memory profile where the cache is sized from the GPU's memory, else nothing."""
        return contextlib.nullcontext() if gpu_memory_utilization is None else profile_memory(self.device)

    def close(self) -> None:
        """Stop the tensor-parallel workers (if any) and leave their group; the LLM cannot run after it.
        Also done when the LLM is garbage-collected and at exit."""
        if self._tp is not None:
            self._tp.close()

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

    def _setup_text(self, model: Any, tokenizer: str | Any | None) -> None:
        """The tokenizer, end-of-sequence ids, image processor and per-request sampler of the text way."""
        self.model_name = model if isinstance(model, str) else type(self.model).__name__
        if isinstance(tokenizer, str):
            loaded = load_tokenizer(tokenizer)
            if loaded is None:
                raise ValueError(f"LLM: tokenizer={tokenizer!r} holds no tokenizer.json / tokenizer_config.json")
            tokenizer = loaded
        elif tokenizer is None and isinstance(model, str):
            tokenizer = load_tokenizer(model)
        self.tokenizer = tokenizer
        #: the checkpoint's end-of-sequence ids (``generation_config.json``, else ``config.json``, else the
        #: tokenizer's): where a text-way request stops unless ``ignore_eos``
        self.eos_token_ids = eos_token_ids(model if isinstance(model, str) else "", tokenizer)
        self._image_processor = (load_image_processor(model) if isinstance(model, str)
                                 and hasattr(self.model, "prepare_images") else None)
        self._request_sampler = RequestSampler(self.device)
        self._structured_sampler: StructuredSampler | None = None

    # ------------------------------------------------------------ the parts' knobs, under the runner's names
    @property
    def stats(self) -> GenerateStats:
        """The timing of the last :meth:`generate` (with overlapping calls from several threads: of the steps
        since the engine was last idle)."""
        return self.scheduler.stats

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's blocks (``enable_prefix_caching``): later prompts compute their prefixes
        again (a cold-cache measurement; keys and values made stale by a change of the weights). Safe while other
        threads generate: it runs between two steps, and blocks their sequences hold stay theirs. The number of
        blocks it freed."""
        return self._engine.between_steps(self.kv_cache.reset_prefix_cache)

    @property
    def async_scheduling(self) -> bool:
        return self.scheduler.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, value: bool) -> None:
        self.scheduler.async_scheduling = value

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
        # prompt chunks whose sequences ask for prompt logprobs: the step's batch, to take them from its hidden states
        asks = (batch, num_decodes) if any(wants_prompt_logprobs(s) for s, _ in batch[num_decodes:]) else None
        if self._tp is None:
            return self._forward_step(full_graph, num_seqs, num_tokens, t, len(batch), images, md, asks)
        with self._tp.guard("step"):  # the workers run the step with this one
            self._tp.send_step(self.input_ids, full_graph, num_seqs, num_tokens, t, len(batch),
                               md.num_decodes if md else 0, device_ids is not None)
            return self._forward_step(full_graph, num_seqs, num_tokens, t, len(batch), images, md, asks)

    def _forward_step(self, full_graph: bool, num_seqs: int, num_tokens: int, t: int, b: int, images: list,
                      md: Any, asks: tuple[list[tuple[Seq, int]], int] | None = None) -> torch.Tensor:
        """The forward of a staged step (:meth:`InputBatch.prepare`'s results; ``b`` sequences): logits ``[B, vocab]``.
        ``asks``: (batch, decodes) of a step with prompt chunks that ask for prompt logprobs (recorded here)."""
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
            if asks is not None:
                record_prompt_logprobs(*asks, hidden, self.model.compute_logits)
            return self.model.compute_logits(last)  # [B, vocab], the model's dtype

    # ------------------------------------------------------------ generate
    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | int | None = None,
                 *, images: Sequence[Any] | None = None, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, seed: int | None = None,
                 eos_token_id: int | None = None, use_tqdm: bool = False) -> list[RequestOutput] | list[list[int]]:
        """Generate after each prompt.

        The text way, when a prompt is a string or a dict or ``sampling_params`` is given: returns one
        :class:`RequestOutput` per prompt (text, token ids, finish reason), as vLLM's ``LLM.generate``.

        Args:
            prompts: a prompt or a list of them: a string (tokenized with the checkpoint's tokenizer), a
                list of token ids, or a dict ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` with
                optionally ``"multi_modal_data": {"image": ...}`` (see :mod:`.prompts`). A model that takes
                images expands a lone image token (``<image>``) to its image-token count.
            sampling_params: one :class:`SamplingParams` for all prompts or one per prompt (default
                ``SamplingParams()``: vLLM's defaults, temperature 1, 16 tokens).
            images: one entry per prompt, None or that prompt's images: PIL images or uint8 arrays
                (processed as the checkpoint's ``preprocessor_config.json`` says) or pixel-value tensors.
            use_tqdm: show a progress bar (``tqdm``) of the prompts processed and the output tokens a second.
                Off by default (vLLM's is on): a library call prints nothing unless asked.

        The token-id way, when every prompt is a list of token ids and no ``SamplingParams`` is given
        (an int in second place is ``max_new_tokens``): returns the new token ids per prompt. Its keywords
        apply to it only (with the text way they are a ``TypeError``):

            max_new_tokens: tokens per prompt (default 16), always that many unless ``eos_token_id``.
            temperature: 0 (default) for greedy (argmax, ties to the lowest id, as ``transformers``);
                else sample from ``softmax(logits / temperature)`` with one generator for the call.
            top_k: sample among the ``top_k`` most likely tokens only.
            seed: seeds the call's generator (default 0); the same call gives the same tokens.
            eos_token_id: stop a sequence after this token (None: never; the checkpoint's is not used).
        """
        legacy = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed,
                      eos_token_id=eos_token_id)
        if isinstance(sampling_params, int) and not isinstance(sampling_params, bool):
            if max_new_tokens is not None:
                raise TypeError("generate: max_new_tokens given twice (second argument and keyword)")
            legacy["max_new_tokens"], sampling_params = sampling_params, None
        legacy = {k: v for k, v in legacy.items() if v is not None}
        if sampling_params is None and not is_text_call(prompts):
            return self._generate_ids(prompts, images=images, use_tqdm=use_tqdm, **legacy)
        if legacy:
            raise TypeError(f"generate: {', '.join(legacy)} apply to token-id prompts without sampling_params; "
                            f"with strings, dicts or SamplingParams say it in SamplingParams (max_tokens, "
                            f"temperature, top_k, seed, stop_token_ids)")
        return self._generate_prompts(parse_prompts(prompts, images, self._encode), sampling_params, use_tqdm)

    def _generate_ids(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int = 16,
                      temperature: float = 0.0, top_k: int | None = None, seed: int = 0,
                      eos_token_id: int | None = None, images: Sequence[Any] | None = None,
                      use_tqdm: bool = False) -> list[list[int]]:
        if not temperature >= 0:  # NaN too
            raise ValueError(f"generate: temperature must be >= 0; got {temperature}")
        sampler = make_sampler(temperature, top_k, torch.Generator(device=self.device).manual_seed(seed))
        return self._run_ids(prompt_token_ids, max_new_tokens, sampler, eos_token_id, images, use_tqdm)

    def run(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int, choose: Chooser,
            eos_token_id: int | None = None, images: Sequence[Any] | None = None) -> list[list[int]]:
        """The scheduling loop of :meth:`generate` with a custom token chooser.

        ``choose(seqs, logits)`` gets the step's sequences of this call (``seq.index`` is the prompt's
        index, ``seq.num_generated`` the tokens so far) and their ``[B, vocab]`` fp32 logits, and returns
        the next token of each.
        """
        return self._run_ids(prompt_token_ids, max_new_tokens, ChooserSampler(choose), eos_token_id, images)

    def _run_ids(self, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int, sampler: Sampler,
                 eos_token_id: int | None, images: Sequence[Any] | None, use_tqdm: bool = False) -> list[list[int]]:
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1; got {max_new_tokens}")
        if images is not None and len(images) != len(prompt_token_ids):
            raise ValueError(f"generate: images must have one entry (None or images) per prompt: "
                             f"{len(prompt_token_ids)} prompts, {len(images)} entries")
        seqs = [self._new_seq(i, p, max_new_tokens, None if images is None else images[i])
                for i, p in enumerate(prompt_token_ids)]
        stop = frozenset() if eos_token_id is None else frozenset([eos_token_id])
        for seq in seqs:
            seq.sampler, seq.stop_token_ids = sampler, stop
        self._submit_and_wait(seqs, use_tqdm)
        return [s.tokens[s.prompt_len:] for s in seqs]

    def _submit_and_wait(self, seqs: list[Seq], use_tqdm: bool = False) -> None:
        """Run ``seqs`` to their ends in the shared engine (taking turns at its steps with other callers)."""
        self._engine.submit(seqs)
        try:
            with progress(_all_done(seqs), seqs) if use_tqdm else contextlib.nullcontext(_all_done(seqs)) as done:
                self._engine.run_until(done)
        except BaseException:
            self._engine.abort(seqs)  # interrupted while waiting: free them; after a failed step: nothing left
            raise
        failed = next((s.error for s in seqs if s.error is not None), None)
        if failed is not None:
            raise RuntimeError(f"LLM: a step failed (run by another caller's thread): {failed!r}") from failed

    # ------------------------------------------------------------ the text way
    def _generate_prompts(self, prompts: list[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                          use_tqdm: bool = False) -> list[RequestOutput]:
        params = self._params_per_prompt(sampling_params, len(prompts))
        # SamplingParams.n: a sequence a completion, each prompt's next to each other
        per_prompt = [[self._request_seq(i, p, one) for one in sp.completions()]
                      for i, (p, sp) in enumerate(zip(prompts, params))]
        self._submit_and_wait([seq for seqs in per_prompt for seq in seqs], use_tqdm)
        return [self._outputs(seqs, p) for seqs, p in zip(per_prompt, prompts)]

    @staticmethod
    def _outputs(seqs: list[Seq], prompt: Prompt) -> RequestOutput:
        """One prompt's output; with ``n`` > 1 sequences, the first's, holding all ``n`` as ``completions``."""
        outs = [dataclasses.replace(final_output(seq, prompt), index=i) for i, seq in enumerate(seqs)]
        if len(outs) > 1:
            outs[0].completions = outs
        return outs[0]

    @staticmethod
    def _params_per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                           n: int) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * n
        params = list(sampling_params)
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"generate: sampling_params must be a SamplingParams or a list of them; got "
                            f"{[type(p).__name__ for p in params]}")
        if len(params) != n:
            raise ValueError(f"generate: {len(params)} SamplingParams for {n} prompts (one, or one per prompt)")
        return params

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, *, tools: list[dict[str, Any]] | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Answer a conversation (a list of ``{"role": ..., "content": ...}``) or a list of conversations,
        through the tokenizer's chat template; one output each. As vLLM's: ``tools`` (OpenAI's tool dicts) are
        shown as the template shows them; ``add_generation_prompt`` adds the assistant's header;
        ``continue_final_message`` goes on from the assistant's last message instead (``add_generation_prompt``
        False); ``chat_template_kwargs``: the template's own variables. ``use_tqdm``: as :meth:`generate`'s."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("LLM.chat: continue_final_message continues the last message: pass "
                             "add_generation_prompt=False with it")
        options = {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
                   "continue_final_message": continue_final_message, **({"tools": tools} if tools else {})}
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(conversation, **options) for conversation in conversations]
        return self._generate_prompts(prompts, sampling_params, use_tqdm)

    def render_chat(self, conversation: Sequence[dict[str, Any]], **options: Any) -> Prompt:
        """A conversation through the tokenizer's chat template: its text and token ids (the template writes the
        special tokens, BOS, itself). ``options``: ``apply_chat_template``'s keywords (``add_generation_prompt``
        True unless given, ``continue_final_message``, ``tools``) and the template's own variables. A missing
        template, or the template's own error, is a ``ValueError``."""
        tok = self._need_tokenizer("chat")
        if getattr(tok, "chat_template", None) is None:
            raise ValueError(f"LLM.chat: the tokenizer of {self.model_name} has no chat template "
                             "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        try:
            text = tok.apply_chat_template(list(conversation), tokenize=False,
                                           **{"add_generation_prompt": True, **options})
        except Exception as e:  # jinja's error, or the template's raise_exception
            raise ValueError(f"LLM.chat: the chat template failed: {e}") from None
        return Prompt(text, tok.encode(text, add_special_tokens=False))

    def generate_stream(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate after one prompt (as :meth:`generate` takes it), yielding the text as it grows: each
        item is what the last tokens added. Joined, the items are the final text of :meth:`generate`.

        A character split over tokens is yielded once whole; with stop strings, text that may begin one is
        held back until it cannot. Closing the iterator early ends the request and frees its cache blocks.
        """
        self._need_tokenizer("generate_stream")
        (parsed,) = parse_prompts(prompt, None, self._encode)
        seq = self._one_request_seq(parsed, sampling_params or SamplingParams(), "generate_stream")  # errors now
        return self._stream(seq)

    def stream_outputs(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """As :meth:`generate_stream`, each item the request so far: a :class:`RequestOutput` whose ``text`` is
        the text shown so far (joined pieces of :meth:`generate_stream`), ``token_ids`` the tokens so far and
        ``finish_reason`` None, then a last item, :meth:`generate`'s output (logprobs included). For callers
        that need counts and the finish reason as they stream (the HTTP server). Closing it early ends the
        request and frees its cache blocks."""
        self._need_tokenizer("stream_outputs")
        (parsed,) = parse_prompts(prompt, None, self._encode)
        seq = self._one_request_seq(parsed, sampling_params or SamplingParams(), "stream_outputs")  # errors now
        return self._stream_outputs(seq, parsed)

    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None) -> Request:
        """One prompt (as :meth:`stream_outputs` takes it) made a :class:`.request.Request`, checked (a
        ``ValueError`` now) but not submitted: for a caller that runs the engine itself, submitting
        ``request.seq`` to :attr:`engine` (the HTTP server's engine thread)."""
        self._need_tokenizer("add_request")
        (parsed,) = parse_prompts(prompt, None, self._encode)
        return Request(self._one_request_seq(parsed, sampling_params or SamplingParams(), "add_request"), parsed)

    @property
    def engine(self) -> EngineLoop:
        """The engine every call goes through (:class:`.engine_loop.EngineLoop`: ``submit``, ``run_until``,
        ``abort``; thread-safe)."""
        return self._engine

    def _stream_outputs(self, seq: Seq, prompt: Prompt) -> Iterator[RequestOutput]:
        pieces = self._stream(seq)
        try:
            text = ""
            for piece in pieces:
                text += piece
                yield RequestOutput(prompt.text, seq.tokens[:seq.prompt_len], text, seq.tokens[seq.prompt_len:], None,
                                    num_cached_tokens=seq.num_cached)
            yield final_output(seq, prompt)
        finally:
            pieces.close()  # closed early: the stream's own close aborts the sequence

    def _stream(self, seq: Seq) -> Iterator[str]:
        self._engine.submit([seq])
        shown = 0
        try:
            while True:
                self._engine.run_until(lambda: seq.done or len(seq.detokenizer.visible) > shown)
                done = seq.done  # read before the text: once ended, the text read after it is final
                text = seq.detokenizer.visible
                if seq.error is not None:
                    raise RuntimeError(f"LLM: a step failed (run by another caller's thread): "
                                       f"{seq.error!r}") from seq.error
                if len(text) > shown:
                    yield text[shown:]
                    shown = len(text)
                if done:
                    return
        finally:
            if not seq.done:
                self._engine.abort([seq])

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"LLM.{what}: model {self.model_name!r} has no tokenizer (built-in models have "
                             "random weights and none; a checkpoint directory needs tokenizer.json or "
                             "tokenizer_config.json, or pass LLM(..., tokenizer=PATH)); pass token ids instead")
        return self.tokenizer

    def _encode(self, text: str, where: str) -> list[int]:
        if self.tokenizer is None:
            self._need_tokenizer(f"generate ({where.removeprefix('generate: ')} is text)")
        return self.tokenizer.encode(text)

    def _expand_image_tokens(self, tokens: list[int]) -> list[int]:
        """A model that takes images: each lone image token (an ``<image>``) becomes the image's token run."""
        if not hasattr(self.model, "prepare_images"):
            return tokens
        from ..llava import expand_image_tokens

        config = self.model.config
        return expand_image_tokens(tokens, config.image_token_index, config.num_image_tokens)

    def _grammar_sampler(self) -> StructuredSampler:
        """The sampler of requests with structured outputs, made at the first (it compiles the tokenizer's vocabulary
        for ``xgrammar``)."""
        if self._structured_sampler is None:
            self._need_tokenizer("generate (structured_outputs are matched on the tokenizer's tokens)")
            grammars = Grammars(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
            self._structured_sampler = StructuredSampler(self.device, grammars)
        return self._structured_sampler

    def _one_request_seq(self, prompt: Prompt, params: SamplingParams, where: str) -> Seq:
        """The sequence of a call that takes one completion (streams, :meth:`add_request`)."""
        if params.n != 1:
            raise ValueError(f"{where}: SamplingParams.n must be 1 here (one completion a stream or request); "
                             f"got {params.n}: call once a completion, or use generate")
        return self._request_seq(0, prompt, params)

    def _request_seq(self, index: int, prompt: Prompt, params: SamplingParams) -> Seq:
        if params.prompt_logprobs is not None and self._tp is not None:
            raise ValueError("generate: prompt_logprobs are not supported with tensor_parallel_size > 1 (the "
                             "vocabulary-parallel LM head would run on rank 0 alone)")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"generate: logit_bias token ids must be in [0, {self.vocab_size}); got "
                             f"{max(params.logit_bias)}")
        tokens = self._expand_image_tokens(prompt.token_ids)
        seq = self._new_seq(index, tokens, params.max_tokens, prompt.images)
        seq.sampler, seq.params = self._request_sampler, params
        if params.seed is not None and not params.greedy:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq.eos_token_ids = frozenset() if params.ignore_eos else self.eos_token_ids
        seq.stop_token_ids = frozenset(params.stop_token_ids)
        seq.min_tokens = params.min_tokens
        if params.structured_outputs is not None:
            seq.grammar = self._grammar_sampler().grammars.matcher(params.structured_outputs)
            seq.sampler = self._structured_sampler
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, tokens, params.stop)
        elif params.stop:
            self._need_tokenizer("generate (stop strings are matched on the text)")
        return seq

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
            images = process_images(images, self._image_processor, where)
            seq.images = self.model.prepare_images(tokens, images, where)
        return seq


def _all_done(seqs: list[Seq]) -> Callable[[], bool]:
    """``done()`` for :meth:`EngineLoop.run_until`: whether every one of ``seqs`` ended, amortized O(1) a
    call (it resumes where the last call found one still running)."""
    i = 0

    def done() -> bool:
        nonlocal i
        while i < len(seqs) and seqs[i].done:
            i += 1
        return i == len(seqs)

    return done


def _weak_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` without a strong reference to its object (which must outlive the calls)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        return ref()(*args, **kwargs)
    return call
