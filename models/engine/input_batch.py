"""``InputBatch``: a step's inputs in persistent device buffers, staged through (pinned) host memory.

The buffers are sized for the largest step and each step's inputs are views of them. A step's inputs
are built as Python lists, assigned into NumPy views of host staging tensors and copied to the device one
row at a time. The block table is rebuilt only when a step's sequences differ from the last step's;
padding (dummy decode sequences, or padding tokens) is added as the CUDA graphs ask (see
:meth:`StepGraphs.padding`) and goes to a reserved cache block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ops.paged_attention import DecodeWorkspace

from ..forward_context import AttentionMetadata
from .sequence import Seq

__all__ = ["InputBatch", "Padding"]

Padding = Callable[[int, int, int, bool], tuple[bool, int, int]]
"""``padding(b, t, num_decodes, images)`` -> ``(whole-step graph, dummy sequences, padding tokens)``."""


class InputBatch:
    """The persistent input and attention-metadata buffers of every step, and their staging.

    Args:
        max_num_tokens, max_num_seqs: the largest step.
        max_blocks_per_seq: block-table columns (the model's longest sequence).
        block_size: tokens per cache block.
        device: where the buffers are; on CUDA the staging tensors are pinned and the copies asynchronous.
    """

    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.device = device
        self.block_size = block_size
        # Persistent input and metadata buffers, sized for the largest step: each step's inputs are
        # views of them, so a CUDA graph captured on them stays valid.
        # Per-token and per-sequence buffers are rows of one tensor each, filled from a (pinned, on
        # CUDA) host staging tensor of the same shape, one asynchronous copy a row.
        dev, i32, i64 = device, torch.int32, torch.int64
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
        self.block_table = torch.zeros(max_num_seqs, max_blocks_per_seq, dtype=i32, device=dev)
        self._table_seqs: list[Seq | None] = []  # whose rows block_table holds, in order (None: a dummy)
        self._table_rows: dict[int, int] = {}  # id(seq) -> its row in block_table
        self._row_lens: list[int] = []  # the blocks each row holds
        self._grown: list[Seq] = []  # sequences whose blocks grew since the last step (note_grown)
        # Block-table patches (row, column, block) for grown rows, staged like the other inputs.
        self._patch = torch.zeros(2 * max_num_seqs, 3, dtype=i32, device=dev)
        self._patch_host = torch.zeros(2 * max_num_seqs, 3, dtype=i32, pin_memory=True) if pin else self._patch
        self._patch_np = self._patch_host.numpy()
        self.pad_block: int | None = None  # the cache block padding writes to, reserved with the CUDA graphs
        # The decode kernels' split-KV scratch, shared by every step's metadata (see AttentionMetadata.decode_plan).
        self.decode_workspace = DecodeWorkspace(max_num_seqs)
        self._last_metadata: AttentionMetadata | None = None  # the last step's (see metadata)

    def prepare(self, batch: list[tuple[Seq, int]], num_decodes: int, padding: Padding,
                device_ids: torch.Tensor | None = None, id_rows: list[int] | None = None
                ) -> tuple[bool, int, int, int, list[tuple[int, Any]], AttentionMetadata | None]:
        """Build and stage one step's inputs: ``batch`` (sequence, new tokens), decodes first, padded as
        ``padding`` says.

        ``device_ids``: a decode-only step's input ids, already on the device (async scheduling: the last
        step's sampled tokens, not yet on the host); ``id_rows``: which of them, when not all.

        Returns:
            ``(whole-step graph, sequences, tokens, unpadded tokens, images, metadata)``: the step's sizes
            with padding and its token count without; ``(first token, images)`` of each prompt with images
            prefilled in it; its attention metadata, None for a whole-step graph (captured with its own).
        """
        bs = self.block_size
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
        full_graph, pad_seqs, pad_tokens = padding(b, t, num_decodes, bool(images))
        if pad_seqs or pad_tokens:
            self.add_padding(ids, pos, slots, starts, lens, pad_seqs, pad_tokens)
        num_seqs, num_tokens = b + pad_seqs, t + pad_seqs + pad_tokens
        rows, patch = self._table(batch, pad_seqs)
        self.stage(ids, pos, slots, starts, lens, rows, id_rows, patch)
        if device_ids is not None:  # after the staged ids (placeholders), in stream order
            if id_rows is None:
                self.input_ids[:b].copy_(device_ids)
            else:
                torch.index_select(device_ids, 0, self._id_rows[:b], out=self.input_ids[:b])
        if full_graph:
            return True, num_seqs, num_tokens, t, images, None
        md = self.metadata(num_seqs, num_tokens, num_decodes + pad_seqs, starts, lens)
        return False, num_seqs, num_tokens, t, images, md

    def note_grown(self, seq: Seq) -> None:
        """``seq``'s blocks grew (``Scheduler.on_grow``): its block-table row gets the new ones at the next step."""
        self._grown.append(seq)

    def _table(self, batch: list[tuple[Seq, int]], pad_seqs: int
               ) -> tuple[torch.Tensor | None, list[tuple[int, int, int]] | None]:
        """The block-table rows to write (all of them), or the patches of the rows that grew, or neither.

        The device table still holds this step's rows when the step has the last table's sequences in the same
        order and the same dummies (most decode steps): then only the blocks a sequence gained since are written
        (a block every ``block_size`` decode steps). Rows are as wide as the longest block list (the kernels read
        no further); a dummy's row is the pad block."""
        seqs: list[Seq | None] = [seq for seq, _ in batch] + [None] * pad_seqs
        grown, self._grown = self._grown, []
        if seqs == self._table_seqs:  # Seq compares by identity
            if not grown:
                return None, None
            where, lens = self._table_rows, self._row_lens
            patch = []
            for seq in grown:
                r = where.get(id(seq))
                if r is not None and lens[r] < len(seq.blocks):
                    patch += [(r, c, seq.blocks[c]) for c in range(lens[r], len(seq.blocks))]
                    lens[r] = len(seq.blocks)
            if len(patch) <= len(self._patch_np):
                return None, patch or None
        width = max(len(seq.blocks) for seq, _ in batch)
        zeros = [0] * width
        table = [seq.blocks + zeros[len(seq.blocks):] for seq, _ in batch]
        if pad_seqs:
            table += [[self.pad_block] + zeros[1:]] * pad_seqs
        self._table_seqs = seqs
        self._table_rows = {id(seq): r for r, (seq, _) in enumerate(batch)}
        self._row_lens = [len(seq.blocks) for seq, _ in batch]
        return torch.tensor(table, dtype=torch.int32), None

    def metadata(self, num_seqs: int, num_tokens: int, num_decodes: int, starts: list[int],
                 lens: list[int]) -> AttentionMetadata:
        """The attention metadata of a staged step (views of the persistent buffers at its sizes). It takes over the
        last such step's plans and bound launches when they would be built the same (``AttentionMetadata.inherit``:
        a prompt's chunks beside the same decodes, say), so that such a step's first layer binds nothing."""
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens], query_start_loc=self.query_start_loc[:num_seqs + 1],
            seq_lens=self.seq_lens[:num_seqs], block_table=self.block_table[:num_seqs], num_decodes=num_decodes,
            query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens), workspace=self.decode_workspace)
        md.inherit(self._last_metadata)
        self._last_metadata = md
        return md

    def add_padding(self, ids: list[int], pos: list[int], slots: list[int], starts: list[int], lens: list[int],
                    pad_seqs: int, pad_tokens: int) -> None:
        """Append ``pad_seqs`` dummy decode sequences (one token at position 0, in the reserved pad block) or
        ``pad_tokens`` padding tokens of no sequence (their keys and values also go to the pad block)."""
        k = pad_seqs + pad_tokens
        ids += [0] * k
        pos += [0] * k
        slots += [self.pad_block * self.block_size] * k
        starts += range(starts[-1] + 1, starts[-1] + pad_seqs + 1)
        lens += [1] * pad_seqs

    def stage(self, ids: list[int], pos: list[int], slots: list[int], starts: list[int], lens: list[int],
              rows: torch.Tensor | None, id_rows: list[int] | None = None,
              patch: list[tuple[int, int, int]] | None = None) -> None:
        """Write a step's inputs into the persistent buffers through the (pinned, on CUDA) staging tensors:
        per token ``ids, pos, slots``; per sequence ``starts`` (one more), ``lens`` and ``id_rows``; and
        block-table ``rows`` (None: the table already holds them) or ``patch`` ((row, column, block) entries)."""
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
        if patch:
            k = len(patch)
            self._patch_np[:k] = patch
            if self._patch_host is not self._patch:
                self._patch[:k].copy_(self._patch_host[:k], non_blocking=True)
            p = self._patch[:k]
            self.block_table.index_put_((p[:, 0], p[:, 1]), p[:, 2])
        if self._staged is not None:
            self._staged.record()

    def forget_table(self) -> None:
        """Rebuild the block table at the next step: its rows are stale once their sequences are gone."""
        self._table_seqs = []
        self._grown = []
