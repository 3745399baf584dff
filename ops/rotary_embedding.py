"""Rotary position embedding applied to q and k, NeoX (rotate halves) or GPT-J (rotate pairs) style.

``cos_sin_cache`` is ``[max_position, rotary_dim]``: cos of each frequency in
the first half of a row, sin in the second (vLLM's layout), built by
:func:`compute_cos_sin_cache` (plain RoPE, linear, or Llama-3 frequency
scaling). Only the first ``rotary_dim`` dims of each head rotate; the rest
pass through. ``rotary_embedding_ref`` is the definition, in fp32, cast back
once; unlike vLLM's in-place kernel the op returns new tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.library import wrap_triton

from dispatcher.passes.native_forms import register_native_form

from .triton_utils import cdiv, known_int, next_power_of_2, pdl_args, tl, triton, triton_op, use_triton
from .custom_op import CustomOp

__all__ = [
    "rotary_embedding", "compute_cos_sin_cache", "RotaryEmbedding", "rotary_embedding_ref", "rotary_embedding_native",
    "rotate_heads_in_place",
]


@triton.jit
def _rotary_embedding_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cache_ptr,
    q_out_ptr,
    k_out_ptr,
    q_row_stride,
    k_row_stride,
    q_out_row_stride,
    k_out_row_stride,
    cache_row_stride,
    n_q_heads,
    n_k_heads,
    HEAD_SIZE: tl.constexpr,
    ROT_DIM: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # Axis 0: one token; axis 1: a block of heads, q's heads first, then k's. Each program loads what it stores
    # before storing it: the outputs may be the inputs (rotate_heads_in_place).
    if PDL:  # launched early (ops.triton_utils.pdl_launch): wait for the kernel before, then let the next launch
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    is_q = (heads < n_q_heads)[:, None]
    head_mask = (heads < n_q_heads + n_k_heads)[:, None]
    in_base = tl.where(
        is_q,
        q_ptr + t * q_row_stride + heads[:, None] * HEAD_SIZE,
        k_ptr + t * k_row_stride + (heads - n_q_heads)[:, None] * HEAD_SIZE,
    )
    out_base = tl.where(
        is_q,
        q_out_ptr + t * q_out_row_stride + heads[:, None] * HEAD_SIZE,
        k_out_ptr + t * k_out_row_stride + (heads - n_q_heads)[:, None] * HEAD_SIZE,
    )

    half = tl.arange(0, BLOCK_HALF)
    half_mask = half < ROT_DIM // 2
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cache_ptr + pos * cache_row_stride + half, mask=half_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * cache_row_stride + ROT_DIM // 2 + half, mask=half_mask, other=0.0)
    sin = sin.to(tl.float32)[None, :]
    if IS_NEOX:
        i1 = half[None, :]
        i2 = half[None, :] + ROT_DIM // 2
    else:
        i1 = 2 * half[None, :]
        i2 = 2 * half[None, :] + 1
    mask = head_mask & half_mask[None, :]
    x1 = tl.load(in_base + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(in_base + i2, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_base + i1, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_base + i2, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:
        # Partial rotary (rotary_dim < head_size): copy the dims that do not rotate.
        p = ROT_DIM + tl.arange(0, BLOCK_PASS)[None, :]
        pmask = head_mask & (p < HEAD_SIZE)
        tl.store(out_base + p, tl.load(in_base + p, mask=pmask), mask=pmask)


def _heads_2d(x: torch.Tensor) -> torch.Tensor:
    """``[T, n * head_size]`` with a dense last dim (a strided row, e.g. a slice of qkv, is fine)."""
    x2 = x.flatten(1) if x.dim() == 3 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch_rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    rot_dim = cos_sin_cache.shape[-1]
    pos = positions.reshape(-1)
    q2, k2 = _heads_2d(q), _heads_2d(k)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    n_q_heads, n_k_heads = q2.shape[1] // head_size, k2.shape[1] // head_size
    block_h, consts = _launch_consts(n_q_heads + n_k_heads, head_size, rot_dim, is_neox)
    known_t = known_int(pos.shape[0])
    known_n = known_t * (n_q_heads + n_k_heads) * head_size if known_t is not None else None
    wrap_triton(_rotary_embedding_kernel)[(pos.shape[0], cdiv(n_q_heads + n_k_heads, block_h))](
        pos,
        q2,
        k2,
        cache,
        q_out,
        k_out,
        q2.stride(0),
        k2.stride(0),
        n_q_heads * head_size,
        n_k_heads * head_size,
        cache.stride(0),
        n_q_heads,
        n_k_heads,
        **consts,
        **pdl_args(None, q2, known_n),
    )
    return q_out, k_out


def _launch_consts(n_heads: int, head_size: int, rot_dim: int, is_neox: bool) -> tuple[int, dict[str, Any]]:
    """``(BLOCK_H, the kernel's constexprs and num_warps)`` for rows of ``n_heads`` heads."""
    block_half = next_power_of_2(rot_dim // 2)
    # ~2048 elements per program: 8 heads of 128, enough to keep 4 warps' loads in flight.
    block_h = min(next_power_of_2(n_heads), max(1, 1024 // block_half))
    pass_dims = head_size - rot_dim
    return block_h, dict(HEAD_SIZE=head_size, ROT_DIM=rot_dim, IS_NEOX=is_neox, BLOCK_H=block_h,
                         BLOCK_HALF=block_half, BLOCK_PASS=next_power_of_2(pass_dims) if pass_dims > 0 else 0,
                         num_warps=4)


def rotate_heads_in_place(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int,
                          rot_heads: int) -> None:
    """Rotate (NeoX) the first ``rot_heads`` heads of each row of ``x`` ``[T, N]`` (unit column stride, rows of any
    stride) in place, with :func:`rotary_embedding_ref`'s values: the Triton kernel on CUDA, the reference elsewhere.
    An eager launcher (``ops.rope_linear``'s unfused path); the caller checks the arguments."""
    cols = rot_heads * head_size
    if not use_triton(x):
        cos, sin = _cos_sin(positions, cos_sin_cache)
        x[:, :cols] = _rotate(x[:, :cols], cos, sin, head_size, True).reshape(x.shape[0], cols)
        return
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    block_h, consts = _launch_consts(rot_heads, head_size, cache.shape[-1], True)
    _rotary_embedding_kernel[(x.shape[0], cdiv(rot_heads, block_h))](
        positions.reshape(-1), x, x, cache, x, x, x.stride(0), x.stride(0), x.stride(0), x.stride(0),
        cache.stride(0), rot_heads, 0, **consts,
    )


@triton_op("dynamo_once::rotary_embedding", mutates_args=())
def _rotary_embedding_op(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # One position a token. Traced, this also tells Dynamo that positions and q share the token count: the
    # Triton launch below relates nothing, and the trace would otherwise get a second dynamic size (seen on
    # CUDA with every custom op on: models.LLM refused the trace).
    torch._check(positions.shape[0] == q.shape[0],
                 lambda: f"rotary_embedding: positions has {positions.shape[0]} entries, q {q.shape[0]} tokens")
    if not use_triton(q):
        return rotary_embedding_ref(positions, q, k, cos_sin_cache, head_size, is_neox)
    return _launch_rotary_embedding(positions, q, k, cos_sin_cache, head_size, is_neox)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by the angles of ``positions``; returns new ``(q, k)``.

    Args:
        positions: ``[T]`` integer positions, rows of ``cos_sin_cache``.
        q: ``[T, n_q_heads * head_size]`` (or ``[T, n_q_heads, head_size]``).
        k: ``[T, n_kv_heads * head_size]`` (or 3-d), same dtype as q.
        cos_sin_cache: ``[max_position, rotary_dim]``, ``cat(cos, sin)`` per row.
        head_size: per-head size; the first ``rotary_dim`` dims rotate.
        is_neox: rotate the two halves (NeoX, Llama) rather than adjacent pairs (GPT-J).
    """
    return torch.ops.dynamo_once.rotary_embedding(positions, q, k, cos_sin_cache, head_size, is_neox)


def _scaled_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict[str, Any]) -> torch.Tensor:
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between.
        factor = float(rope_scaling["factor"])
        low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope_scaling: unsupported rope_type {kind!r}; supported: default, linear, llama3")


def compute_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[max_position, rotary_dim]``: ``cat(cos(p * f), sin(p * f))`` per position ``p``.

    Frequencies ``f_i = base ** (-2i / rotary_dim)`` as in HF transformers
    (computed in fp32, then cast to ``dtype``), optionally rescaled by
    ``rope_scaling`` (an HF ``config.json`` dict: ``rope_type`` ``"default"``,
    ``"linear"`` or ``"llama3"``).
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_scaling is not None:
        inv_freq = _scaled_inv_freq(inv_freq, rope_scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


@CustomOp.register("rotary_embedding")
class RotaryEmbedding(CustomOp):
    """RoPE for one attention layer; ``forward(positions, q, k) -> (q, k)``, q and k ``[T, n_heads * head_size]``.

    Args:
        head_size: per-head size.
        rotary_dim: leading dims of each head that rotate (``head_size`` for full RoPE).
        max_position: rows of the cos/sin cache.
        base: RoPE theta.
        is_neox_style: rotate halves (True: Llama, Gemma) or adjacent pairs (GPT-J).
        rope_scaling: HF ``rope_scaling`` dict (``linear``, ``llama3``), or None.
        dtype: the cache's dtype (HF rounds cos/sin to the model dtype too); default torch's default dtype.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float = 10000.0,
        is_neox_style: bool = True,
        rope_scaling: dict[str, Any] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if rotary_dim > head_size or rotary_dim % 2:
            raise ValueError(f"RotaryEmbedding: rotary_dim must be even and <= head_size; got {rotary_dim}, {head_size}")
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        self.is_neox_style = is_neox_style
        self.rope_scaling = rope_scaling
        cache = compute_cos_sin_cache(rotary_dim, max_position, base, rope_scaling, dtype or torch.get_default_dtype())
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding_native(positions, q, k, self.cos_sin_cache, self.head_size, self.is_neox_style)

    def forward_cuda(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_embedding(positions, q, k, self.cos_sin_cache, self.head_size, self.is_neox_style)

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
            f"base={self.base}, is_neox_style={self.is_neox_style}, rope_scaling={self.rope_scaling}"
        )


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 reference: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`` on each rotated pair; new
    contiguous ``(q, k)``."""
    cos, sin = _cos_sin(positions, cos_sin_cache)
    return tuple(_rotate(x, cos, sin, head_size, is_neox).reshape(x.shape).contiguous() for x in (q, k))


def rotary_embedding_native(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_embedding_ref`'s values, q's and k's heads rotated as one ``[T, n_q + n_k, head_size]``
    tensor: under Inductor one pointwise kernel a layer rather than one for q and one for k (their head counts
    differ, so Inductor fuses nothing across them). The outputs are views of that tensor, each row ``(n_q + n_k)
    * head_size`` elements apart (contiguous rows, as the attention layer and the rotary op take them)."""
    cos, sin = _cos_sin(positions, cos_sin_cache)
    q3, k3 = (x if x.dim() == 3 else x.unflatten(-1, (-1, head_size)) for x in (q, k))
    both = _rotate(torch.cat((q3, k3), dim=1), cos, sin, head_size, is_neox)
    q_out, k_out = both.split([q3.shape[1], k3.shape[1]], dim=1)
    return q_out.reshape(q.shape), k_out.reshape(k.shape)


def _cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, 1, rotary_dim / 2]`` fp32 cos and sin of each token's position."""
    # 1-d positions (the models') indexed as they are: no no-op reshape in the traced form (a graph pass's pattern)
    cos, sin = cos_sin_cache.index_select(0, positions if positions.dim() == 1 else positions.reshape(-1)).float() \
        .chunk(2, dim=-1)
    return cos[:, None, :], sin[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, is_neox: bool) -> torch.Tensor:
    """``x`` (``[T, heads * head_size]`` or ``[T, heads, head_size]``) rotated in fp32, cast back: ``[T, heads,
    head_size]``."""
    rot_dim = cos.shape[-1] * 2
    xf = x.float()
    if xf.dim() == 2:
        xf = xf.unflatten(-1, (-1, head_size))
    x_rot, x_pass = xf[..., :rot_dim], xf[..., rot_dim:]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x_pass), dim=-1).to(x.dtype)


register_native_form("rotary_embedding", rotary_embedding_native)
