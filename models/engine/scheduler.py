"""``Scheduler``: which sequences and tokens each step of ``LLM.generate`` runs, and what it does with their tokens.

Each step runs one forward over a flat batch: first one token for every running (decode) sequence, then
prompt tokens while the step's token budget (``max_num_tokens``) and the cache allow, so prefill and decode
sequences share steps. With ``chunked_prefill`` a prompt that does not fit the budget left in a step is
prefilled in chunks over several steps, each chunk attending to the cached earlier ones, so prompts may be
longer than ``max_num_tokens``; prompts with images are always prefilled whole. A sequence gets the cache
blocks for ``prompt + max_new_tokens`` when it is admitted (no preemption). With async scheduling, once
every prompt is admitted, each decode step is launched before the last one's tokens are read.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from .kv_cache import KVCache
from .sampling import PendingStep, SampledTokens, Sampler
from .sequence import Chooser, Seq
from .stats import GenerateStats

__all__ = ["Execute", "Scheduler"]

Execute = Callable[..., torch.Tensor]
"""``execute(batch, num_decodes, device_ids=None, id_rows=None)``: one step's logits (:meth:`LLM._execute`)."""


class Scheduler:
    """The batching loop: admission, chunked prefill, decodes first, async decode steps.

    Args:
        kv_cache: where an admitted sequence gets its blocks.
        max_num_tokens, max_num_seqs, chunked_prefill: as :class:`LLM`.
        device: the model's (on CUDA, async decode steps' tokens come back through pinned buffers).
    """

    def __init__(self, kv_cache: KVCache, max_num_tokens: int, max_num_seqs: int, chunked_prefill: bool,
                 device: torch.device) -> None:
        self.kv_cache = kv_cache
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.sampled_tokens = SampledTokens(max_num_seqs, device)
        self._last_read = 0.0

    def run(self, seqs: list[Seq], max_new_tokens: int, execute: Execute, choose: Chooser,
            eos_token_id: int | None, fp32_logits: bool, sample: Sampler | None, stats: GenerateStats) -> None:
        """Run ``seqs`` until each ends, appending its new tokens to ``seq.tokens``; time it in ``stats``.

        ``choose`` gets each step's sequences that sample and their logits, fp32 if ``fp32_logits``,
        else the model's dtype (a [128, 128256] bf16 step's conversion alone writes 65 MB). ``sample``:
        async scheduling, decode-only steps sample with it on the device and are read one step late.
        """
        waiting, running = deque(seqs), []
        t_start = time.perf_counter()
        pending: PendingStep | None = None
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
                        launched = self._launch_decodes(execute, going_on, pending, sample)
                        stats.num_overlapped_steps += 1
                self._read(pending, stats, eos_token_id)
                running = [s for s in running if s.blocks]
                pending = launched
                continue
            batch, num_decodes, admitted = self._schedule(waiting, running, max_new_tokens)
            t0 = time.perf_counter()
            logits = execute(batch, num_decodes)
            if sample is not None and num_decodes == len(batch):  # read one step late
                for seq, _ in batch:
                    seq.num_computed += 1
                pending = self.sampled_tokens.copy_to_host([seq for seq, _ in batch], sample(logits), t0)
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

    def _schedule(self, waiting: deque[Seq], running: list[Seq], max_new_tokens: int
                  ) -> tuple[list[tuple[Seq, int]], int, list[Seq]]:
        """The next step: its batch of (sequence, new tokens), decodes first; its number of decodes; the
        sequences it admits from ``waiting`` (which then hold their cache blocks)."""
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
        return batch, num_decodes, admitted

    def _launch_decodes(self, execute: Execute, seqs: list[Seq], pending: PendingStep,
                        sample: Sampler) -> PendingStep:
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
        return self.sampled_tokens.copy_to_host(seqs, sample(logits), t0)

    def _read(self, pending: PendingStep, stats: GenerateStats, eos_token_id: int | None) -> None:
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
