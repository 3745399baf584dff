"""Which operand order of the decode attention's two dots reads a paged cache fastest (GPU only).

``python -m benchmarks.attention_operands [--out DIR]``: a one-split decode kernel (no window, soft cap or fused write) in three forms, bf16 and fp8 e4m3 caches, Llama-3-8B
heads (32 q heads, 8 KV heads, D 128), 16-token pages scattered: 0 q·kᵀ and p·v as ops.paged_attention does
(the key tile is the MMA's shared-memory operand); 1 k·qᵀ (the key tile the register operand, the small q tile in
shared memory); 2 also (p·v)ᵀ = vᵀ·pᵀ (the value tile the register operand); 3 (an fp8 cache only) form 0 with the
value tile converted to fp16 by an opaque ``cvt`` (``ops.kv_quant.f16_from_e4m3``) before its shared-memory round trip, where
Triton otherwise moves the conversion after it and gathers the transposed tile a byte at a time
(``benchmarks.attention_instructions`` counts the difference in the sm_90 code). Prints µs per call (CUDA-graph
replays) and % of copy bandwidth, each checked against ops.paged_decode_ref; the table, CSV and PNG (with ``--out``)
``attention_operands``. The kernel is this file's own, smaller than ops.paged_attention's (which also splits,
merges, writes the new tokens and takes windows and soft caps): a lower bound of what its loop costs.
"""

from __future__ import annotations

import argparse

import sys
from typing import Any

import torch

from benchmarks import common
from ops.kv_quant import dot_operand, f16_from_e4m3
from ops.paged_attention import paged_decode_ref
from ops.triton_utils import tl, triton

HEADS, KV_HEADS, D, PAGE = 32, 8, 128, 16


@triton.jit
def _kernel(q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, stride_bt, stride_half, stride_b, stride_s, stride_h,
            scale, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_D: tl.constexpr, PAGE_: tl.constexpr,
            BLOCK_N: tl.constexpr, FORM: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b * (GROUP * tl.num_programs(1) * HEAD_D) + heads[:, None] * HEAD_D + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)
    q = dot_operand(q, cache_ptr)  # fp16 for a bf16 q over an fp8 cache, as ops.paged_attention's
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_D], tl.float32)
    acc_t = tl.zeros([HEAD_D, BLOCK_G], tl.float32)
    q_t = tl.trans(q)
    for pos0 in range(0, seq_len, BLOCK_N):
        k_pos = pos0 + offs_n
        n_mask = k_pos < seq_len
        block = tl.load(bt_ptr + b * stride_bt + k_pos // PAGE_, mask=n_mask, other=0).to(tl.int64)
        off = block[:, None] * stride_b + (k_pos % PAGE_)[:, None] * stride_s + kvh * stride_h + offs_d[None, :]
        k = tl.load(cache_ptr + off, mask=n_mask[:, None], other=0.0).to(q.dtype)
        if FORM == 0 or FORM == 3:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.trans(tl.dot(k, q_t))
        s = tl.where(n_mask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_half + off, mask=n_mask[:, None], other=0.0)
        v = f16_from_e4m3(v) if FORM == 3 else v.to(q.dtype)
        if FORM == 2:
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(v), tl.trans(p.to(v.dtype)))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if FORM == 2:
        acc = tl.trans(acc_t)
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * (GROUP * tl.num_programs(1) * HEAD_D) + heads[:, None] * HEAD_D + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def forms(dtype: torch.dtype) -> tuple[int, ...]:
    """The kernel's forms for a cache of ``dtype`` (form 3 converts an fp8 value tile)."""
    return (0, 1, 2, 3) if dtype == torch.float8_e4m3fn else (0, 1, 2)


def run(form: int, q, cache, table, seq_lens, out, block_n: int, warps: int, stages: int) -> None:
    b = q.shape[0]
    _kernel[(b, KV_HEADS)](q, cache, table, seq_lens, out, table.stride(0), cache.stride(0), cache.stride(1),
                           cache.stride(2), cache.stride(3), D**-0.5, GROUP=HEADS // KV_HEADS, BLOCK_G=16, HEAD_D=D,
                           PAGE_=PAGE, BLOCK_N=block_n, FORM=form, num_warps=warps, num_stages=stages)


def measure(dtype: torch.dtype, batch: int, ctx: int, configs: list[str], copy_gbps: float) -> list[dict[str, Any]]:
    """Every config and form at one shape; a form Triton cannot build is reported and skipped."""
    from triton.testing import do_bench_cudagraph

    per_seq = ctx // PAGE
    g = torch.Generator(device="cuda").manual_seed(0)
    total = batch * per_seq
    cache = torch.randn(2, total, PAGE, KV_HEADS, D, generator=g, device="cuda", dtype=torch.bfloat16).to(dtype)
    table = torch.randperm(total, generator=g, device="cuda").to(torch.int32).view(batch, per_seq)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HEADS * D, generator=g, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ref = paged_decode_ref(q, cache, table, seq_lens, HEADS, D, D**-0.5)
    nbytes = cache[0].element_size() * 2 * batch * ctx * KV_HEADS * D
    rows = []
    for cfg in configs:
        bn, w, st = (int(x) for x in cfg.split("x"))
        for form in forms(dtype):
            try:
                run(form, q, cache, table, seq_lens, out, bn, w, st)
                err = (out.float() - ref.float()).abs().max().item()
                us = do_bench_cudagraph(lambda: run(form, q, cache, table, seq_lens, out, bn, w, st)) * 1e3
            except Exception as e:  # a form Triton cannot build
                print(f"{dtype} b{batch} ctx{ctx} {cfg} form {form}: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append({"cache": str(dtype).removeprefix("torch."), "batch": batch, "context": ctx,
                         "config": cfg, "form": form, "us": round(us, 2),
                         "pct_of_copy_bw": round(100 * nbytes / (us * 1e-6) / (copy_gbps * 1e9), 1),
                         "max_err": float(f"{err:.1e}")})
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="128x512,128x2048,32x2048", help="BATCHxCONTEXT, comma-separated")
    p.add_argument("--configs", default="64x4x3,128x4x3,64x2x3,128x8x3", help="BLOCK_NxWARPSxSTAGES, comma-separated")
    p.add_argument("--out", default=None, help="results folder (nothing is written without it)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("the operand-order benchmark needs a CUDA GPU")
    copy_gbps = common.measure_copy_bandwidth()
    rows = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for shape in a.shapes.split(","):
            batch, ctx = (int(x) for x in shape.split("x"))
            rows += measure(dtype, batch, ctx, a.configs.split(","), copy_gbps)
    common.write_results("attention_operands", rows, title="Decode attention's dot operands, one-split kernel",
                         device="cuda", out_dir=a.out,
                         notes=[f"copy bandwidth {copy_gbps:.0f} GB/s; Llama-3-8B heads (32 q, 8 KV, D 128), "
                                f"{PAGE}-token pages scattered; bytes: every K and V byte of the cache's dtype",
                                "form 0: q·kᵀ, p·v (ops.paged_attention's); 1: k·qᵀ; 2: k·qᵀ and vᵀ·pᵀ; "
                                "3: form 0, fp8 values converted before their shared-memory round trip; config: "
                                "BLOCK_N x warps x stages; us: triton.testing.do_bench_cudagraph, per call",
                                "fp8 cache: q and the tiles in fp16 for the dots, as ops.kv_quant.dot_operand"])
    common.plot_panels("attention_operands", [dict(r, shape=f"b{r['batch']} ctx{r['context']} {r['config']}")
                                              for r in rows],
                       x="shape", y="pct_of_copy_bw", series="form", panel="cache", out_dir=a.out,
                       title="Decode attention: dot operand order", xlabel="shape and config",
                       ylabel="% of copy bandwidth")

if __name__ == "__main__":
    main(sys.argv[1:])
