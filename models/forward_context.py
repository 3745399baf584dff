"""Per-step attention metadata, reaching ``torch.ops.dynamo_once.attention`` outside the graph.

The compiled decoder takes only ``input_ids``, ``positions`` (and optionally
``inputs_embeds``): anything per batch that the graph took as an input would be
traced (and, for Python values, specialized). Instead the runner sets a
:class:`ForwardContext` around each forward; the attention op, opaque to Dynamo
and Inductor, looks its layer and the step's :class:`AttentionMetadata` up in
it at run time.

Batch layout (as serving engines use): the step's T tokens are the
concatenation of its sequences' new tokens, decode sequences (1 new token)
first, then prefill sequences. Sequence ``i`` owns tokens
``query_start_loc[i]:query_start_loc[i + 1]``, which are the last
``query_len`` of its ``seq_lens[i]`` tokens.

KV cache: paged. Each layer has one tensor ``[2, num_blocks, block_size,
num_kv_heads, head_size]`` (keys, values); a sequence's block ``j`` holds its
tokens ``j * block_size ... (j + 1) * block_size - 1``, and ``block_table[i,
j]`` names that block. ``slot_mapping[t] = block * block_size + offset`` is the
flat slot token ``t`` is written to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from dispatcher import envs
from ops.launch_cache import LaunchCache
from ops.paged_attention import DecodePlan, DecodeWorkspace, bind_write_kv_cache
from ops.paged_prefill import bind_prefill
from ops.triton_utils import BoundLaunch

if TYPE_CHECKING:
    from .attention import Attention

__all__ = ["AttentionMetadata", "ForwardContext", "get_forward_context", "set_forward_context"]

#: On by default: a step with a prompt, which never replays a whole-step CUDA graph (those are decode-only) and so runs
#: its attention eagerly, between the pieces, where each launch costs host time, has its split-KV decode kernel write
#: the decodes' new keys and values and merge its splits itself, a launch a layer fewer each, whatever the decode
#: config's ``fused_write`` and ``fused_merge`` (``ops.paged_decode_config``, chosen by GPU time for the whole-step
#: graphs, which keep them). Off: the config's, as a decode-only step. Read at every plan; its default comes from
#: ``DYNAMO_ONCE_MIXED_DECODE_FUSED`` (1/0) at import.
MIXED_DECODE_FUSED = envs.mixed_decode_fused()


@dataclasses.dataclass
class AttentionMetadata:
    """What one step's attention needs besides q, k, v; shared by every layer.

    Device tensors are views of persistent buffers sized for the largest batch
    (so a CUDA graph captured on them stays valid); the ``*_cpu`` lists and ints
    are host copies for the paths that loop over sequences, so that no kernel
    path needs ``.item()`` or ``.tolist()``.

    What every layer of the step would otherwise recompute is derived once, at
    the first layer's call, and kept here: :meth:`decode_plan` (the decode
    sequences' slices, split count, grids and split-KV scratch, per layer
    shape) and :attr:`seq_spans` (each sequence's token range and length). They
    hold views and shapes only, so a metadata object that a CUDA graph was
    captured with stays valid for its replays. Build a new object per step;
    do not mutate one after its first use.

    Args:
        slot_mapping: ``[T]`` int64, flat cache slot of each new token.
        query_start_loc: ``[B + 1]`` int32, cumulative new-token counts.
        seq_lens: ``[B]`` int32, tokens of each sequence including this step's.
        block_table: ``[B, max_blocks_per_seq]`` int32, cache blocks of each sequence.
        num_decodes: the first ``num_decodes`` sequences have one new token each.
        query_start_loc_cpu: host copy of ``query_start_loc``.
        seq_lens_cpu: host copy of ``seq_lens``.
        max_seq_len: ``max(seq_lens_cpu)``.
        workspace: persistent split-KV decode scratch (``ops.paged_attention.DecodeWorkspace``), shared by
            every step of its owner; None: each step's plan allocates its own (once, not per layer; under
            CUDA-graph capture, in the graph's pool).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    num_decodes: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seq_len: int
    workspace: DecodeWorkspace | None = None
    _plans: dict[tuple, DecodePlan] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    _writes: dict[tuple, BoundLaunch | None] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                                  compare=False)
    _prefills: dict[tuple, BoundLaunch | None] = dataclasses.field(default_factory=dict, init=False, repr=False,
                                                                    compare=False)
    #: The attention op's per-step state by layer configuration (``models.attention``'s CUDA path: its plan and
    #: bound launches, gathered for one lookup a layer); built at the first call, as the caches above.
    layer_calls: dict[tuple, object] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    #: What :meth:`decodes_fit_unified` answered, by threshold: the one fact of the step's per-sequence lengths that
    #: the state above is built from (:meth:`inherit` compares it).
    _fits: dict[int, bool] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    _launch_cache: LaunchCache | None | bool = dataclasses.field(default=False, init=False, repr=False, compare=False)

    def inherit(self, previous: AttentionMetadata | None) -> bool:
        """Take over ``previous``'s per-step state (decode plans, bound launches, the attention op's
        :attr:`layer_calls` with their recorded launch programs) when this step's would be built the same, else that
        of a recent step of this layout from the workspace's cache (:meth:`launch_cache`); True if it took one. Call
        it on a new object, before its first use.

        A step's state is built the same when the two steps have the same device tensors (address, shape, strides,
        dtype: views of the same persistent buffers at the same sizes), decode count, query layout
        (``query_start_loc_cpu``) and workspace, and :meth:`decodes_fit_unified` gives this step the answers it gave
        the other. Nothing else the state holds is read on the host: the kernels read the tensors' contents
        (positions, lengths, blocks) when they run. A serving engine's consecutive steps of one shape (a prompt's
        chunks beside the same decodes), and its steps whose layout a recent one had (chunked prefill's mixed steps
        come back to a layout), then pay the plan and the first layer's binding once, not once a step. A step that
        takes no state is kept in the cache for later steps of its layout."""
        if previous is not None and previous is not self and previous.workspace is self.workspace \
                and previous.num_decodes == self.num_decodes \
                and previous.query_start_loc_cpu == self.query_start_loc_cpu \
                and self._layouts == previous._layouts and self._take(previous):
            return True
        cache = self.launch_cache()
        if cache is None:
            return False
        recent = cache.get_or_build(("step", self.num_decodes, tuple(self.query_start_loc_cpu), self._layouts),
                                    lambda: self)
        return recent is not self and self._take(recent)

    @functools.cached_property
    def _layouts(self) -> tuple:
        """The device tensors' layouts (:func:`_layout`): what the step's state takes from them besides contents;
        ``(slot_mapping, query_start_loc, seq_lens, block_table)``'s, read once a step."""
        return (_layout(self.slot_mapping), _layout(self.query_start_loc), _layout(self.seq_lens),
                _layout(self.block_table))

    def _take(self, other: AttentionMetadata) -> bool:
        """Share ``other``'s step state (same tensors, decode count and query layout: the caller checked) when
        :meth:`decodes_fit_unified` answers as it did there."""
        if any(self.decodes_fit_unified(short) != fit for short, fit in other._fits.items()):
            return False
        self._plans, self._writes, self._prefills = other._plans, other._writes, other._prefills
        self.layer_calls = other.layer_calls
        self._fits = dict(other._fits)
        return True

    def decode_plan(self, num_heads: int, num_kv_heads: int, head_size: int, page: int,
                    device: torch.device, kv_fp8: bool = False) -> DecodePlan:
        """The decode sequences' :class:`~ops.paged_attention.DecodePlan` for a layer shape (``kv_fp8``: over an
        fp8 cache), built at its first call in this step (one dict lookup after). In a step with a prompt its decode
        kernel writes the decodes' new keys and values and merges its splits (``fused_write``, ``fused_merge``)
        whatever the config says, under :data:`MIXED_DECODE_FUSED`."""
        key = (num_heads, num_kv_heads, head_size, page, device, kv_fp8, MIXED_DECODE_FUSED)
        if self.workspace is None and device.type == "cuda":
            # Scratch of its own, which a CUDA graph must not capture from outside it: this object may die
            # before the graph. Under capture, a plan allocated there (in the graph's pool), as before plans.
            key += (torch.cuda.is_current_stream_capturing(),)
        plan = self._plans.get(key)
        if plan is None:
            build = functools.partial(self._new_plan, num_heads, num_kv_heads, head_size, page, device, kv_fp8)
            cache = self.launch_cache()
            if cache is None:
                plan = build()
            else:  # the decodes' rows of the table and lengths (not how many rows follow them), and whether any do
                plan = cache.get_or_build(("plan", key, self.num_decodes, self.is_decode_only,
                                           _rows_layout(self.seq_lens), _rows_layout(self.block_table)), build)
            self._plans[key] = plan
        return plan

    def launch_cache(self) -> LaunchCache | None:
        """The :attr:`workspace`'s cache of recent steps' plans and bound launches (``ops.launch_cache``), which
        this step's take what they share with; None without a workspace, and while the current stream captures a
        CUDA graph (whose plans stay the capture's own)."""
        cache = self._launch_cache
        if cache is False:  # asked once a step (the capture check costs ~1 µs; a step is captured whole or not)
            ws = self.workspace
            capturing = ws is not None and self.block_table.is_cuda and torch.cuda.is_current_stream_capturing()
            cache = self._launch_cache = None if ws is None or capturing else ws.launches
        return cache

    def _new_plan(self, num_heads: int, num_kv_heads: int, head_size: int, page: int,
                  device: torch.device, kv_fp8: bool) -> DecodePlan:
        nd = self.num_decodes
        whole = nd == self.num_seqs  # the tensors hold exactly the decodes: no slicing
        ws = self.workspace
        buf = ws.get(num_heads, num_kv_heads, head_size, device) if ws is not None else None
        counters = ws.counters(num_kv_heads, device) if ws is not None else None
        # A step with a prompt under MIXED_DECODE_FUSED: the kernel writes and merges itself; else (None) the config's
        fused = True if MIXED_DECODE_FUSED and not whole else None
        return DecodePlan(self.block_table if whole else self.block_table[:nd],
                          self.seq_lens if whole else self.seq_lens[:nd],
                          num_heads, num_kv_heads, head_size, page, device, workspace=buf, counters=counters,
                          kv_fp8=kv_fp8, fused_write=fused, fused_merge=fused)

    @functools.cached_property
    def prefill_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The sequences after the decodes, as ``ops.paged_prefill_triton`` takes them: ``(block_table,
        seq_lens, query_start_loc, max_query_len)``, views made once a step (the first layer's call)."""
        return self._seq_args(self.num_decodes)

    @functools.cached_property
    def all_seq_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Every sequence of the step, decodes included, as :attr:`prefill_args` (the unified launch's)."""
        return self._seq_args(0)

    def _seq_args(self, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        starts = self.query_start_loc_cpu
        # the query lengths by one C-level map: a Python loop costs ~8 µs beside 128 decodes
        n = self.num_seqs
        longest = max(map(operator.sub, starts[first + 1:n + 1], starts[first:n]), default=0)
        if first == 0:  # the tensors whole (no views), as they hold the step's sequences only
            return self.block_table, self.seq_lens, self.query_start_loc, longest
        return self.block_table[first:], self.seq_lens[first:], self.query_start_loc[first:], longest

    def write_launch(self, num_tokens: int, row: int, first: int) -> BoundLaunch | None:
        """The cache-write kernel (``ops.paged_attention.bind_write_kv_cache``) bound to ``num_tokens`` slots of
        :attr:`slot_mapping` from token ``first`` on (and the same rows of its launches' k and v), for cache rows of
        ``row`` elements, built at its first call in this step; None: no token."""
        key = (num_tokens, row, first)
        try:
            return self._writes[key]
        except KeyError:
            build = functools.partial(bind_write_kv_cache, self.slot_mapping, num_tokens, row, first)
            cache = self.launch_cache()
            launch = build() if cache is None else cache.get_or_build(("write", key, _rows_layout(self.slot_mapping)),
                                                                       build)
            self._writes[key] = launch
            return launch

    def prefill_launch(self, num_heads: int, num_kv_heads: int, head_size: int, page: int, dtype: torch.dtype,
                       use_softcap: bool, use_window: bool, new_kv: bool = False,
                       all_seqs: bool = False) -> BoundLaunch | None:
        """The prefill kernel bound to :attr:`prefill_args` (``ops.paged_prefill.bind_prefill``) for a layer shape,
        q's dtype and the soft cap's and window's presence, built at its first call in this step; None: no
        sequence to launch for. ``new_kv``: the form that writes the sequences' new keys and values itself.
        ``all_seqs``: bound to :attr:`all_seq_args` instead, the decodes too (a decode is a sequence with one new
        token, on a tile of its own: ``decode_rows``): the unified launch, one for the whole step's attention."""
        key = (num_heads, num_kv_heads, head_size, page, dtype, use_softcap, use_window, new_kv, all_seqs)
        try:
            return self._prefills[key]
        except KeyError:
            block_table, seq_lens, query_start_loc, longest = self.all_seq_args if all_seqs else self.prefill_args
            # The grid is bound for a bucket of query lengths (programs past a sequence's queries return at once): a
            # later step with another prompt chunk of the bucket takes this launch from the cache.
            max_query_len = query_bucket(longest)
            build = functools.partial(bind_prefill, block_table, seq_lens, query_start_loc, max_query_len, num_heads,
                                      num_kv_heads, head_size, page, dtype, use_softcap, use_window, new_kv=new_kv,
                                      decode_rows=all_seqs)
            cache = self.launch_cache()
            launch = build() if cache is None else cache.get_or_build(
                ("prefill", key, max_query_len, _layout(block_table), _layout(seq_lens), _layout(query_start_loc)),
                build)
            self._prefills[key] = launch
            return launch

    def decodes_fit_unified(self, short: int = 0) -> bool:
        """Whether no decode sequence is longer than ``short`` tokens or the step's longest other sequence (True
        without decodes; False without another sequence). In the unified launch one program reads a decode's whole
        sequence for a KV head (no split), as one reads the longest prompt's last query block: a decode no longer
        than that does not outlast the prompts' programs, and one of at most ``short`` tokens takes less GPU time
        than the separate launches' host time would (the caller's threshold)."""
        fit = self._fits.get(short)
        if fit is None:
            nd, lens = self.num_decodes, self.seq_lens_cpu
            fit = self._fits[short] = nd != len(lens) and (nd == 0 or max(lens[:nd]) <= max(short, max(lens[nd:])))
        return fit

    @functools.cached_property
    def seq_spans(self) -> list[tuple[int, int, int]]:
        """``(first token, end token, seq_len)`` of each sequence, from the host copies."""
        starts = self.query_start_loc_cpu
        return [(starts[i], starts[i + 1], n) for i, n in enumerate(self.seq_lens_cpu)]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @property
    def is_decode_only(self) -> bool:
        return self.num_decodes == self.num_seqs


def query_bucket(n: int) -> int:
    """The longest query a prefill launch is bound for when a step's longest is ``n``: the next power of two up to
    256, else the next multiple of 256 (at most 255 query rows of programs that return at once, against a launch of
    256 rows or more; the kernel's tile config, by powers of two, is the same)."""
    if n <= 0:
        return 0
    if n <= 256:
        return 1 << (n - 1).bit_length()
    return -(-n // 256) * 256


def _layout(t: torch.Tensor) -> tuple:
    """What a bound launch takes from a tensor besides its contents."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


def _rows_layout(t: torch.Tensor) -> tuple:
    """:func:`_layout` less the row count: what views of a tensor's leading rows share however many rows it has."""
    return t.data_ptr(), t.shape[1:], t.stride(), t.dtype, t.device


@dataclasses.dataclass
class ForwardContext:
    """The attention layers of the running model (by ``layer_name``) and this step's metadata.

    ``attn_metadata=None`` is a profile / warm-up run: attention writes no cache
    and returns zeros, so a model can be traced before its cache exists.
    """

    layers: dict[str, Attention]
    attn_metadata: AttentionMetadata | None = None


_local = threading.local()


def get_forward_context() -> ForwardContext:
    """The context set by the innermost :func:`set_forward_context` on this thread."""
    ctx = getattr(_local, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "torch.ops.dynamo_once.attention ran outside set_forward_context(...): run the model through "
            "models.LLM, or wrap the call in `with set_forward_context(ForwardContext(layers, metadata)):`"
        )
    return ctx


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make ``ctx`` current on this thread for the block (nesting restores the outer one)."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = previous
