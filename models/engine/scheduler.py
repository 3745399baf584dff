"""``Scheduler``: which sequences and tokens each step of ``LLM.generate`` runs, and what it does with their tokens.

Each step runs one forward over a flat batch: first one token for every running (decode) sequence, then
prompt tokens while the step's token budget (``max_num_tokens``) and the cache allow, so prefill and decode
sequences share steps. With ``chunked_prefill`` a prompt that does not fit the budget left in a step is
prefilled in chunks over several steps, each chunk attending to the cached earlier ones, so prompts may be
longer than ``max_num_tokens``; prompts with images are always prefilled whole. A sequence gets the cache
blocks of its prompt when it is admitted (while a watermark of free blocks stays for the running ones' growth),
and one more block whenever its next token needs it. When the cache has none left, the most recently admitted
running sequences are preempted: their blocks are freed and they wait at the front of the queue, to compute every
token they had again (recompute, as vLLM's; what they generated and sampled is kept). With prefix caching the first
blocks of a prompt (or of a preempted sequence's tokens) may be cached blocks of the same tokens computed before,
which it then does not compute. With async scheduling, once every prompt is admitted, each decode step is launched
before the last one's tokens are read.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from .kv_cache import KVCache
from .prefix_cache import ROOT
from .prompt_logprobs import wants_prompt_logprobs
from .sampling import PendingStep, SampledTokens, sample
from .sequence import Seq
from .stats import GenerateStats

__all__ = ["Execute", "Scheduler"]

Execute = Callable[..., torch.Tensor]
"""``execute(batch, num_decodes, device_ids=None, id_rows=None)``: one step's logits (:meth:`LLM._execute`)."""


class Scheduler:
    """The batching state and its step: admission, chunked prefill, decodes first, async decode steps.

    Sequences wait (``waiting``), run (``running``: admitted, holding their cache blocks) and, with async
    scheduling, may have a decode step in flight (``pending``). :meth:`step` runs one step of all of them;
    the caller (:class:`.engine_loop.EngineLoop`) makes sure one thread at a time calls it.

    Args:
        kv_cache: where an admitted sequence gets its blocks.
        max_num_tokens, max_num_seqs, chunked_prefill, async_scheduling: as :class:`LLM`.
        device: the model's (on CUDA, async decode steps' tokens come back through pinned buffers).
        on_grow: told of each running sequence whose blocks grew (the input batch patches its block-table row).
    """

    def __init__(self, kv_cache: KVCache, max_num_tokens: int, max_num_seqs: int, chunked_prefill: bool,
                 device: torch.device, async_scheduling: bool = False,
                 on_grow: Callable[[Seq], None] | None = None) -> None:
        self.kv_cache = kv_cache
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.async_scheduling = async_scheduling
        self.sampled_tokens = SampledTokens(max_num_seqs, device)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.pending: PendingStep | None = None
        self.stats = GenerateStats()
        self._last_read = 0.0
        # The samplers of the sequences in the engine, with their counts: with one (one caller), a step's
        # sampling needs no split by sampler, found without a pass over the batch (~5 us at batch 128).
        self._samplers: dict[int, list] = {}
        self._admitted: list[Seq] = []  # the running step's newly admitted sequences
        #: Told of each running sequence whose blocks grew (the input batch patches its block-table row).
        self.on_grow: Callable[[Seq], None] = on_grow or _ignore
        #: Free blocks admission leaves for the running sequences' next tokens (1% of the cache, as vLLM's).
        self.watermark = max(1, kv_cache.num_blocks // 100)
        #: Sequences ended so far (any way: a stop, ``max_tokens``, an abort, a failed step), never reset: a
        #: caller that follows many sequences looks at them only when it moved (the server's engine thread).
        self.num_ended = 0
        #: Preemptions so far, never reset (``stats.num_preemptions`` counts those of the last call).
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.pending)

    def add(self, seqs: list[Seq]) -> None:
        for seq in seqs:
            self._samplers.setdefault(id(seq.sampler), [seq.sampler, 0])[1] += 1
        self.waiting.extend(seqs)

    def _release(self, seq: Seq) -> None:
        """``seq`` ended: its cache blocks and its count among the samplers go."""
        self.num_ended += 1
        if seq.blocks:
            self.kv_cache.free(seq.blocks)
            seq.blocks = []
        entry = self._samplers[id(seq.sampler)]
        entry[1] -= 1
        if not entry[1]:
            del self._samplers[id(seq.sampler)]

    def _sample(self, seqs: list[Seq], logits: torch.Tensor) -> torch.Tensor | list[int]:
        return seqs[0].sampler(seqs, logits) if len(self._samplers) == 1 else sample(seqs, logits)

    def step(self, execute: Execute) -> None:
        """One step of every sequence: a forward, each ready sequence's next token, the ends they make.

        Each sequence's sampler (``seq.sampler``, see :func:`.sampling.sample`) picks its tokens, from
        logits in the model's dtype. With async scheduling, a decode-only step whose samplers all sample
        on the device leaves its tokens there (``pending``); the next step is launched from them before
        they are read, when it holds exactly the sequences that go on (none waits to be admitted).
        """
        if self.pending is not None:
            self._step_pending(execute)
            return
        batch, num_decodes, admitted = self._schedule()
        self._admitted = admitted  # in neither waiting nor running until the step ends: fail() needs them
        t0 = time.perf_counter()
        logits = execute(batch, num_decodes)
        stats = self.stats
        if num_decodes == len(batch) and self._overlaps():  # read one step late
            seqs = [seq for seq, _ in batch]
            for seq in seqs:
                seq.num_computed += 1
            self.pending = self.sampled_tokens.copy_to_host(seqs, self._sample(seqs, logits), t0)
            return
        # Sample only for the sequences whose known tokens are now all computed (decodes, and prompts
        # whose last chunk this was): a partial chunk's logits are not a next-token distribution.
        if num_decodes == len(batch):  # decode-only: every sequence samples
            ready_seqs = [seq for seq, _ in batch]
            tokens = self._sample(ready_seqs, logits)
        else:
            ready = [i for i, (seq, n) in enumerate(batch) if seq.num_computed + n == len(seq.tokens)]
            ready_seqs = [batch[i][0] for i in ready]
            tokens = self._sample(ready_seqs, logits if len(ready) == len(batch) else logits[ready]) if ready else []
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()  # syncs
        dt = time.perf_counter() - t0
        stats.num_steps += 1
        stats.step_times_s.append(dt)
        if num_decodes == len(batch):
            stats.decode_step_times_s.append(dt)
            stats.max_decode_batch = max(stats.max_decode_batch, num_decodes)
        elif num_decodes:
            stats.num_mixed_steps += 1
            stats.mixed_step_times_s.append(dt)
        for seq, n in batch:
            seq.num_computed += n
        cache = self.kv_cache
        if cache.prefix is not None:
            bs = cache.block_size
            for seq, _ in batch:
                if seq.num_computed >= (seq.num_keyed + 1) * bs:  # a block may be whole now (the call checks)
                    cache.cache_computed(seq)
        stats.num_generated += len(ready_seqs)
        finished = False
        for seq, tok in zip(ready_seqs, tokens):
            if seq.append(int(tok)):
                self._release(seq)
                finished = True
        if finished or admitted:
            self.running = [s for s in self.running + admitted if s.blocks]

    def _overlaps(self) -> bool:
        return self.async_scheduling and all(sampler.on_device for sampler, _ in self._samplers.values())

    def _step_pending(self, execute: Execute) -> None:
        pending = self.pending
        launched = None
        alive = [s for s in pending.seqs if s.blocks]  # not ended by the read before
        if not self.waiting and len(self.running) == len(alive):
            going_on = [s for s in alive if len(s.tokens) + 1 - s.prompt_len < s.max_new_tokens]
            if going_on and self._grow_ahead(going_on):
                launched = self._launch_decodes(execute, going_on, pending)
                self.stats.num_overlapped_steps += 1
        self._read(pending)
        self.running = [s for s in self.running if s.blocks]
        self.pending = launched
        if launched is not None and not any(s.blocks for s in launched.seqs):
            self._read(launched)  # every sequence of it ended in that read: its tokens are past their ends
            self.pending = None

    def abort(self, seqs: list[Seq]) -> None:
        """End ``seqs`` (added, not ended yet) now: ``finish_reason`` "abort", blocks freed; between steps only."""
        for seq in seqs:
            if not seq.done:
                seq.finish_reason = "abort"
                self._release(seq)
        gone = {id(s) for s in seqs}
        self.waiting = deque(s for s in self.waiting if id(s) not in gone)
        self.running = [s for s in self.running if s.blocks]

    def fail(self, error: BaseException) -> None:
        """A step raised: every sequence not yet ended gets ``error``; all state is dropped, blocks freed."""
        seqs = list(self.waiting) + self.running + self._admitted + (self.pending.seqs if self.pending else [])
        self.num_ended += len(seqs)
        for seq in seqs:
            if not seq.done:
                seq.error = error
            if seq.blocks:
                self.kv_cache.free(seq.blocks)
                seq.blocks = []
        self.waiting, self.running, self.pending, self._samplers, self._admitted = deque(), [], None, {}, []

    def _schedule(self) -> tuple[list[tuple[Seq, int]], int, list[Seq]]:
        """The next step: its batch of (sequence, new tokens), decodes first; its number of decodes; the
        sequences it admits from ``waiting`` (which then hold their cache blocks)."""
        # Decodes first (one token each: the last sampled one), then prompt chunks of the sequences
        # already prefilling, then newly admitted prompts, while the token budget lasts.
        preempted = self._grow_running()
        waiting, running = self.waiting, self.running
        batch = [(s, 1) for s in running if s.num_computed >= s.prefill_len]
        num_decodes = len(batch)
        budget = self.max_num_tokens - num_decodes
        for s in running:
            if s.num_computed < s.prefill_len and budget > 0:
                n = min(s.prefill_len - s.num_computed, budget)
                batch.append((s, n))
                budget -= n
        admitted = []
        prefilling = [s for s, n in batch[num_decodes:]]  # computing prompt tokens this step
        # After a preemption nothing is admitted this step (the cache has no room to spare), unless nothing runs.
        while waiting and not (preempted and batch) and len(batch) < self.max_num_seqs and budget > 0:
            seq = waiting[0]
            if not self._admit(seq, budget, prefilling):
                break
            prefilling.append(seq)
            waiting.popleft()
            n = min(seq.prefill_len - seq.num_computed, budget)
            batch.append((seq, n))
            admitted.append(seq)
            budget -= n
        if not batch:  # nothing running, and the first waiting one cannot be admitted
            raise RuntimeError(f"LLM: sequence {waiting[0].index} cannot be scheduled: it needs "
                               f"{self.kv_cache.blocks_for(waiting[0].prefill_len)} cache blocks of "
                               f"{self.kv_cache.num_blocks}; raise num_cache_tokens")
        return batch, num_decodes, admitted

    def _admit(self, seq: Seq, budget: int, prefilling: list[Seq]) -> bool:
        """Give ``seq`` its cache blocks if it fits this step (``budget`` tokens left) and the cache: its prompt's
        cached prefix (prefix caching; those tokens then count as computed), then new blocks for the rest of its
        ``prefill_len`` tokens, leaving ``watermark`` blocks free while others run. With prefix caching, not while
        a sequence of ``prefilling`` (computing prompt tokens this step) computes the next block of ``seq``'s
        prefix: ``seq`` then waits a step and takes it from the cache (a block is cached once computed; two
        sequences of one step never read each other's)."""
        cache = self.kv_cache
        cached = cache.cached_prefix(seq)
        if cache.prefix is not None and _computes_next_block(seq, len(cached) * cache.block_size, prefilling,
                                                              cache.block_size):
            return False
        total = seq.prefill_len
        # Prompts with images (and all, without chunked prefill) in one step; a preempted sequence's generated tokens
        # may follow in later chunks.
        whole = not self.chunked_prefill or seq.images is not None
        room = total + (self.watermark * cache.block_size if self.running or prefilling else 0)
        if (whole and seq.prompt_len - len(cached) * cache.block_size > budget) or not cache.fits(room, cached):
            return False
        seq.blocks = cache.allocate(total, cached)
        seq.num_computed = len(cached) * cache.block_size
        if not seq.num_preempted:  # a prompt's tokens from the cache (not a preempted one's computed again)
            seq.num_cached = seq.num_computed
            self.stats.num_cached_tokens += seq.num_cached
        return True

    def _grow_running(self) -> bool:
        """Give each running sequence the blocks its next token needs, the earliest admitted first; when the cache
        has too few, preempt the most recently admitted (possibly the one growing). True if any was preempted."""
        preempted = False
        for seq in self._short(self.running):
            if not seq.blocks:  # preempted for an earlier short one
                continue
            while not self.kv_cache.grow(seq.blocks, seq.num_computed + 1):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.on_grow(seq)
        return preempted

    def _grow_ahead(self, seqs: list[Seq]) -> bool:
        """The blocks a decode step launched ahead needs (its tokens' positions are ``num_computed``); False when the
        cache has too few: the step is then not launched ahead, and the next one preempts as it must."""
        for seq in self._short(seqs):
            if not self.kv_cache.grow(seq.blocks, seq.num_computed + 1):
                return False
            self.on_grow(seq)
        return True

    def _short(self, seqs: list[Seq]) -> list[Seq]:
        """Those of ``seqs`` whose next token (at ``num_computed``) has no block yet."""
        bs = self.kv_cache.block_size
        return [s for s in seqs if len(s.blocks) * bs <= s.num_computed]

    def _preempt(self, seq: Seq) -> None:
        """Free a running sequence's blocks and queue it first to compute all its tokens again."""
        self.kv_cache.free(seq.blocks)
        seq.blocks = []
        seq.prefill_len = len(seq.tokens)
        seq.num_computed = seq.num_keyed = 0
        seq.prefix_id = ROOT
        seq.num_preempted += 1
        self.stats.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _launch_decodes(self, execute: Execute, seqs: list[Seq], pending: PendingStep) -> PendingStep:
        """A decode step of ``seqs`` (those of ``pending`` that go on, in its order) whose input ids are
        ``pending``'s sampled tokens, still on the device."""
        t0 = time.perf_counter()
        rows = None
        if len(seqs) != len(pending.seqs):
            keep = set(map(id, seqs))
            rows = [i for i, s in enumerate(pending.seqs) if id(s) in keep]
        logits = execute([(s, 1) for s in seqs], len(seqs), device_ids=pending.tokens, id_rows=rows)
        for seq in seqs:
            seq.num_computed += 1
        return self.sampled_tokens.copy_to_host(seqs, self._sample(seqs, logits), t0)

    def _read(self, pending: PendingStep) -> None:
        """A pending step's tokens, on the host: append them, end the sequences they end."""
        if pending.copied is not None:
            pending.copied.synchronize()
        tokens = pending.host.tolist()
        # Since the step's launch, or for a step launched before the last read (overlapped), since that
        # read: the time between two steps' tokens.
        now = time.perf_counter()
        stats = self.stats
        dt = now - max(pending.t0, self._last_read)
        self._last_read = now
        stats.num_steps += 1
        stats.step_times_s.append(dt)
        stats.decode_step_times_s.append(dt)
        stats.max_decode_batch = max(stats.max_decode_batch, len(pending.seqs))
        cache = self.kv_cache if self.kv_cache.prefix is not None else None
        bs = self.kv_cache.block_size
        for seq, tok in zip(pending.seqs, tokens):
            if not seq.blocks:  # ended (stop token, stop string, abort) the step before: one past its end
                continue
            stats.num_generated += 1
            if cache is not None and seq.num_computed >= (seq.num_keyed + 1) * bs:  # a block may be whole now
                cache.cache_computed(seq)
            if seq.append(tok):
                self._release(seq)


def _computes_next_block(seq: Seq, cached: int, prefilling: list[Seq], block_size: int) -> bool:
    """Whether a sequence of ``prefilling`` has yet to compute the block after ``seq``'s ``cached`` tokens, holding
    the same tokens from the first on (so ``seq`` could take it from the cache once computed). Only a block ``seq``
    would take: within its first ``prompt_len - 1`` tokens."""
    end = cached + block_size
    if end > seq.prompt_len - 1 or seq.images is not None or wants_prompt_logprobs(seq):
        return False
    head = seq.tokens[:end]
    return any(other.num_computed < end <= len(other.tokens) and other.images is None and other.tokens[:end] == head
               for other in prefilling)


def _ignore(seq: Seq) -> None:
    pass
