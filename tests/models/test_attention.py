"""torch.ops.dynamo_once.attention: one opaque op, mixed batches, no specialization of T, the CUDA decode path.

The kernels themselves (cache write, split-KV decode) are ops.paged_attention's: tests/ops/test_paged_attention.py.
"""

import dataclasses

import pytest
import torch

import ops
from dispatcher import CompilationConfig, compilation_counter, dispatcher_of, set_compilation_config, support_torch_compile
from models import Attention, AttentionMetadata, ForwardContext, KVCache, set_forward_context
from models.attention import UNIFIED_DECODE_TOKENS, attention_native, eager_layouts, write_kv_cache
from ops.paged_attention import DecodeWorkspace
from ops.paged_decode_config import decode_config

HEADS, KV_HEADS, HEAD = 4, 2, 16  # Llama 3 8B: 32, 8, 128
BLOCK = 4  # small blocks: sequences span several, with a partial last one
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_batch(layer, seq_specs, device="cpu", dtype=torch.float32, seed=0):
    """``seq_specs``: (context_len already cached, new tokens) per sequence, decodes first.

    Fills the cache with random context, returns (q, k, v, metadata).
    """
    g = torch.Generator().manual_seed(seed)
    cache = layer.kv_cache
    blocks_per_seq = max((c + n + BLOCK - 1) // BLOCK for c, n in seq_specs)
    # Interleave the sequences' blocks so that a wrong block table cannot pass.
    table = torch.tensor([[b * len(seq_specs) + i for b in range(blocks_per_seq)] for i in range(len(seq_specs))],
                         dtype=torch.int32)
    cache.copy_(torch.randn(cache.shape, generator=g).to(dtype))
    slots, starts, lens = [], [0], []
    for i, (ctx, new) in enumerate(seq_specs):
        slots += [int(table[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(ctx, ctx + new)]
        starts.append(starts[-1] + new)
        lens.append(ctx + new)
    t = starts[-1]
    q = torch.randn(t, HEADS * HEAD, generator=g).to(dtype).to(device)
    k = torch.randn(t, KV_HEADS * HEAD, generator=g).to(dtype).to(device)
    v = torch.randn(t, KV_HEADS * HEAD, generator=g).to(dtype).to(device)
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device), query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), block_table=table.to(device),
        num_decodes=next((i for i, (_, n) in enumerate(seq_specs) if n != 1), len(seq_specs)),
        query_start_loc_cpu=starts, seq_lens_cpu=lens, max_seq_len=max(lens))
    return q, k, v, md


def new_layer(name="l0", device="cpu", dtype=torch.float32, num_blocks=64, **kw):
    layer = Attention(HEADS, HEAD, HEAD**-0.5, KV_HEADS, name, **kw)
    KVCache({name: layer}, num_blocks * BLOCK, BLOCK, dtype=dtype, device=device)
    return layer


def dense_reference(q, k_all, v_all, scale, window=None, cap=None):
    """Plain fp64 attention of one sequence's last len(q) positions, q [Lq, H, D], k/v [L, Hkv, D]."""
    lq, L = q.shape[0], k_all.shape[0]
    k = k_all.double().repeat_interleave(HEADS // KV_HEADS, 1)
    v = v_all.double().repeat_interleave(HEADS // KV_HEADS, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    qp = torch.arange(L - lq, L)[:, None]
    kp = torch.arange(L)[None]
    ok = kp <= qp
    if window:
        ok &= kp > qp - window
    s = s.masked_fill(~ok, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


SPECS = [(9, 1), (0, 1), (13, 1), (0, 6), (5, 3), (0, 11)]  # three decodes (one at the first token), three prefills


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 5}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_mixed_batch_matches_dense_reference_and_each_sequence_alone(kw):
    layer = new_layer(**kw)
    q, k, v, md = make_batch(layer, SPECS)
    cache_before = layer.kv_cache.clone()
    with set_forward_context(ForwardContext({"l0": layer}, md)):
        out = torch.ops.dynamo_once.attention(q, k, v, "l0")
    for i, (ctx, new) in enumerate(SPECS):
        s, e = md.query_start_loc_cpu[i], md.query_start_loc_cpu[i + 1]
        # written where slot_mapping says
        flat = layer.kv_cache.view(2, -1, KV_HEADS, HEAD)
        torch.testing.assert_close(flat[0, md.slot_mapping[s:e]], k[s:e].view(-1, KV_HEADS, HEAD), rtol=0, atol=0)
        rows = md.block_table[i].long()
        kk = layer.kv_cache[0, rows].flatten(0, 1)[: ctx + new]
        vv = layer.kv_cache[1, rows].flatten(0, 1)[: ctx + new]
        ref = dense_reference(q[s:e].view(new, HEADS, HEAD), kk, vv, HEAD**-0.5, kw.get("sliding_window"),
                              kw.get("logits_soft_cap"))
        torch.testing.assert_close(out[s:e].view(new, HEADS, HEAD).double(), ref, rtol=1e-5, atol=1e-5)
        # the same sequence alone in a batch, from the same cache contents
        alone = new_layer("l1", **kw)
        alone.kv_cache.copy_(cache_before)
        md1 = AttentionMetadata(md.slot_mapping[s:e], torch.tensor([0, new], dtype=torch.int32), md.seq_lens[i:i + 1],
                                md.block_table[i:i + 1], int(new == 1), [0, new], [ctx + new], ctx + new)
        with set_forward_context(ForwardContext({"l1": alone}, md1)):
            out1 = torch.ops.dynamo_once.attention(q[s:e], k[s:e], v[s:e], "l1")
        torch.testing.assert_close(out1, out[s:e], rtol=0, atol=0)


def test_opcheck():
    layer = new_layer()
    q, k, v, md = make_batch(layer, SPECS)
    with set_forward_context(ForwardContext({"l0": layer}, md)):
        # test_schema would see the cache write as an undeclared mutation of nothing: the cache is no argument.
        torch.library.opcheck(torch.ops.dynamo_once.attention.default, (q, k, v, "l0"),
                              test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


def test_no_context_names_the_fix():
    q = torch.zeros(2, HEADS * HEAD)
    with pytest.raises(RuntimeError, match="set_forward_context"):
        torch.ops.dynamo_once.attention(q, q[:, :32], q[:, :32], "l0")


@support_torch_compile
class OneLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(HEADS * HEAD, (HEADS + 2 * KV_HEADS) * HEAD)
        self.attn = Attention(HEADS, HEAD, HEAD**-0.5, KV_HEADS, "one")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).split([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], -1)
        return self.attn(q, k, v) * 2


@pytest.mark.parametrize("lvl", [1, 2])
def test_compiled_once_for_three_token_counts(lvl):
    with set_compilation_config(CompilationConfig(level=lvl)):
        model = OneLayer()
    KVCache({"one": model.attn}, 64 * BLOCK, BLOCK)
    eager = {}
    with compilation_counter.expect(num_graphs_seen=1, num_backend_compilations=1, num_recompiles=0,
                                    num_dispatched_calls=2 if lvl == 2 else 0):
        for specs in ([(0, 5), (2, 3)], [(5, 1), (3, 1), (0, 4)], [(9, 1), (0, 2)]):  # T = 8, 6, 3
            q, _, _, md = make_batch(model.attn, specs)
            x = torch.randn(q.shape[0], HEADS * HEAD)
            with set_forward_context(ForwardContext({"one": model.attn}, md)), torch.no_grad():
                cache = model.attn.kv_cache.clone()
                out = model(x)
                model.attn.kv_cache.copy_(cache)
                eager[len(eager)] = (out, OneLayer.forward(model, x))
    for out, ref in eager.values():
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    graph = dispatcher_of(model)._do_backend.graphs[0].graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    op = torch.ops.dynamo_once.attention
    assert sum(t in (op, op.default) for t in targets) == 1  # one opaque node, not traced through
    # T stayed symbolic: the graph's input has a symbolic first dim
    x_node = next(n for n in graph.nodes if n.op == "placeholder" and n.name.lower() in ("l_x_", "x"))
    assert isinstance(x_node.meta["example_value"].shape[0], torch.SymInt)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 37}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
@pytest.mark.parametrize("num_seqs", [1, 7, 64, 256])
def test_cuda_decode_kernel_matches_native(num_seqs, kw, dtype):
    gen = torch.Generator().manual_seed(num_seqs)
    ctx = torch.randint(0, 300, (num_seqs,), generator=gen).tolist()
    specs = [(c, 1) for c in ctx]
    n_blocks = num_seqs * ((max(ctx) + 1 + BLOCK - 1) // BLOCK) + 1
    layer = new_layer(device="cuda", dtype=dtype, num_blocks=n_blocks, **kw)
    q, k, v, md = make_batch(layer, specs, device="cuda", dtype=dtype)
    assert md.is_decode_only
    cache = layer.kv_cache.clone()
    with set_forward_context(ForwardContext({"l0": layer}, md)):
        out = torch.ops.dynamo_once.attention(q, k, v, "l0")  # Triton decode
    ref = attention_native(q, k, v, cache, md, HEADS, HEAD, HEAD**-0.5, kw.get("sliding_window"),
                           kw.get("logits_soft_cap"))
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(layer.kv_cache, cache, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_mixed_batch_matches_native():
    layer = new_layer(device="cuda")
    q, k, v, md = make_batch(layer, SPECS, device="cuda")
    cache = layer.kv_cache.clone()
    with set_forward_context(ForwardContext({"l0": layer}, md)):
        out = torch.ops.dynamo_once.attention(q, k, v, "l0")
    ref = attention_native(q, k, v, cache, md, HEADS, HEAD, HEAD**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_cuda_decode_captures_in_a_cuda_graph():
    """A replay equals the eager call bit for bit with the step's scratch in a persistent workspace, as the
    engine keeps it (without one, a capture cannot allocate the fused merge's counters and takes the merge
    kernel: the same values up to rounding)."""
    layer = new_layer(device="cuda", num_blocks=256)
    q, k, v, md = make_batch(layer, [(40, 1), (3, 1), (100, 1)], device="cuda")
    md = dataclasses.replace(md, workspace=DecodeWorkspace(max_num_seqs=3))
    ctx = ForwardContext({"l0": layer}, md)
    with set_forward_context(ctx):
        expected = torch.ops.dynamo_once.attention(q, k, v, "l0")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.ops.dynamo_once.attention(q, k, v, "l0")  # warm up Triton's compile off the graph
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.dynamo_once.attention(q, k, v, "l0")
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("unified", [False, True], ids=["split", "unified"])
def test_cuda_layers_of_a_step_follow_the_stream_and_the_launch_hooks_of_their_call(unified, monkeypatch):
    """The attention op reads its launch target (device, stream, hooks) once a call and keeps it no longer: on one
    step's metadata, a mixed step's calls eagerly, then captured in a CUDA graph (another stream; a target kept from
    the eager calls would launch on the legacy stream, which capture refuses), then with a launch hook set (every
    launch through Triton's run, which calls it): each the eager call's output bit for bit, the native one's within
    tolerance. Split: decode and prefill launches (and the cache write); unified: one launch."""
    from triton import knobs

    import models.attention as attention_module

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", unified)
    layer = new_layer(device="cuda", num_blocks=256)
    q, k, v, md = make_batch(layer, [(40, 1), (3, 1), (0, 6), (5, 3)], device="cuda")
    md = dataclasses.replace(md, workspace=DecodeWorkspace(max_num_seqs=4))
    start = layer.kv_cache.clone()
    ref = attention_native(q, k, v, start.clone(), md, HEADS, HEAD, HEAD**-0.5)
    with set_forward_context(ForwardContext({"l0": layer}, md)):
        expected = torch.ops.dynamo_once.attention(q, k, v, "l0")
        torch.testing.assert_close(expected, ref, rtol=1e-5, atol=1e-5)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.ops.dynamo_once.attention(q, k, v, "l0")
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.dynamo_once.attention(q, k, v, "l0")
        layer.kv_cache.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        seen = []
        hook = lambda *a, **kw: seen.append(1)  # noqa: E731
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            hooked = torch.ops.dynamo_once.attention(q, k, v, "l0")
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
    torch.testing.assert_close(hooked, expected, rtol=0, atol=0)
    assert len(seen) == 1 if unified else len(seen) >= 2  # each launch through run: the decode and prefill at least


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 5}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_native_decodes_equal_the_paged_decode_reference(kw):
    """The native path on decodes is ops.paged_decode_ref, the reference the decode kernel is tested against."""
    layer = new_layer(**kw)
    q, k, v, md = make_batch(layer, [(9, 1), (0, 1), (13, 1), (BLOCK - 1, 1)])
    window, cap = kw.get("sliding_window"), kw.get("logits_soft_cap")
    out = attention_native(q, k, v, layer.kv_cache, md, HEADS, HEAD, HEAD**-0.5, window, cap)
    ref = ops.paged_decode_ref(q, layer.kv_cache, md.block_table, md.seq_lens, HEADS, HEAD, HEAD**-0.5, window, cap)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_decode_plan_is_built_once_per_step_from_the_persistent_workspace():
    """Every layer of a step shares one plan (per layer shape); each step's plan is views of the same scratch."""
    import dataclasses

    from ops.paged_attention import DecodeWorkspace, decode_num_splits, decode_workspace_numel

    layer = new_layer()
    _, _, _, md = make_batch(layer, SPECS)
    ws = DecodeWorkspace(max_num_seqs=8)
    md = dataclasses.replace(md, workspace=ws)
    cpu = torch.device("cpu")
    plan = md.decode_plan(HEADS, KV_HEADS, HEAD, BLOCK, cpu)
    assert md.decode_plan(HEADS, KV_HEADS, HEAD, BLOCK, cpu) is plan  # a dict lookup for the other layers
    nd = md.num_decodes
    assert plan.num_seqs == nd == 3 and plan.block_table.shape[0] == nd and plan.seq_lens.shape == (nd,)
    assert plan.block_table.data_ptr() == md.block_table.data_ptr()  # views, no copies
    assert plan.num_splits == decode_num_splits(nd, KV_HEADS, cpu) > 1
    buf = ws.get(HEADS, KV_HEADS, HEAD, cpu)
    assert plan.mid_o.data_ptr() == buf.data_ptr() and plan.mid_lse.untyped_storage().data_ptr() == buf.data_ptr()
    # The next step's metadata over the same rows takes the plan from the workspace's cache of recent steps; one of
    # another decode count builds its own, from the same memory.
    assert dataclasses.replace(md).decode_plan(HEADS, KV_HEADS, HEAD, BLOCK, cpu) is plan
    plan2 = dataclasses.replace(md, num_decodes=2).decode_plan(HEADS, KV_HEADS, HEAD, BLOCK, cpu)
    assert plan2 is not plan and plan2.num_seqs == 2 and plan2.mid_o.data_ptr() == buf.data_ptr()
    # the scratch holds the largest batch's partial results; batches that need more fall back to their own
    assert buf.numel() == decode_workspace_numel(8, HEADS, KV_HEADS, HEAD, cpu)
    for n in range(1, 9):
        splits = decode_num_splits(n, KV_HEADS, cpu)
        assert splits == 1 or n * HEADS * splits * (HEAD + 1) <= buf.numel()
    assert md.seq_spans == [(s, e, n) for s, e, n in zip(md.query_start_loc_cpu, md.query_start_loc_cpu[1:],
                                                         md.seq_lens_cpu)]


def test_decode_plan_of_one_split_has_no_partial_results():
    from ops.paged_attention import DecodePlan

    table, lens = torch.zeros(4, 3, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    plan = DecodePlan(table, lens, HEADS, KV_HEADS, HEAD, BLOCK, torch.device("cpu"), num_splits=1)
    assert plan.mid_o is None and plan.mid_lse is None
    assert plan.split_grid == ((KV_HEADS, 4, 1) if plan.heads_first else (4, KV_HEADS, 1))  # the table row's order
    with pytest.raises(ValueError, match="num_splits must be a power of two .* got 3"):
        DecodePlan(table, lens, HEADS, KV_HEADS, HEAD, BLOCK, torch.device("cpu"), num_splits=3)


def test_piecewise_steps_write_the_output_into_the_layers_persistent_buffer(monkeypatch):
    """In a PIECEWISE step (the next piece's CUDA graph reads the output in place) the op writes into the
    layer's buffer; anywhere else, and for a step larger than the buffer, it returns a new tensor."""
    from dispatcher.cuda_graph import thread_state

    layer = new_layer()
    q, k, v, md = make_batch(layer, SPECS)
    cache = layer.kv_cache.clone()
    with set_forward_context(ForwardContext({"l0": layer}, md)):
        expected = torch.ops.dynamo_once.attention(q, k, v, "l0")
        layer.piecewise_out = buf = torch.full((q.shape[0] + 3, HEADS * HEAD), float("nan"))
        layer.kv_cache.copy_(cache)
        assert torch.ops.dynamo_once.attention(q, k, v, "l0").data_ptr() != buf.data_ptr()  # no step: new
        monkeypatch.setattr(thread_state, "step", object())  # what CUDAGraphs.run sets for a PIECEWISE step
        layer.kv_cache.copy_(cache)
        out = torch.ops.dynamo_once.attention(q, k, v, "l0")
        assert out.data_ptr() == buf.data_ptr() and out.shape == q.shape
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        layer.piecewise_out = buf2 = torch.empty_like(buf)  # another buffer: the op's rows follow it
        layer.kv_cache.copy_(cache)
        out2 = torch.ops.dynamo_once.attention(q, k, v, "l0")
        assert out2.data_ptr() == buf2.data_ptr() and torch.equal(out2, expected)
        layer.piecewise_out = buf[:2]  # smaller than the step: a new tensor
        assert torch.ops.dynamo_once.attention(q, k, v, "l0").data_ptr() != buf.data_ptr()
    layer.piecewise_out = buf
    with set_forward_context(ForwardContext({"l0": layer}, None)):  # the pieces' capture: zeros, in the buffer
        out = torch.ops.dynamo_once.attention(q, k, v, "l0")
    assert out.data_ptr() == buf.data_ptr() and not out.any()


@pytest.mark.cuda
@pytest.mark.parametrize("specs", [SPECS, [(9, 1), (40, 1)], [(0, 6), (5, 3)]], ids=["mixed", "decodes", "prompts"])
@pytest.mark.parametrize("unified", [False, True], ids=["split", "unified"])
def test_cuda_later_layers_of_a_step_replay_the_first_layers_launches_with_their_own_tensors(specs, unified,
                                                                                           monkeypatch):
    """The attention op's later layers of a step replay the first layer's launches (ops.launch_program) with their
    own q, k, v, cache and output: each layer's output and cache equal, bit for bit, the same calls with every
    launch through Triton's normal path; a layer whose tensors differ in what the kernels are specialized on (a q
    of another row stride) still gets its own launches right."""
    import models.attention as attention_module
    from ops import triton_utils
    from ops.paged_attention import _decode_split_launch
    from ops.paged_prefill import _prefill_launch

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", unified)
    layers = [new_layer(f"l{i}", device="cuda", num_blocks=128) for i in range(4)]
    batches = [make_batch(layer, specs, device="cuda", seed=i) for i, layer in enumerate(layers)]
    md = batches[0][3]
    starts = [layer.kv_cache.clone() for layer in layers]
    wide = torch.randn(batches[0][0].shape[0], 2 * HEADS * HEAD, device="cuda")
    wide[:, :HEADS * HEAD] = batches[3][0]
    batches[3] = (wide[:, :HEADS * HEAD], *batches[3][1:])  # the last layer's q: another row stride

    def step(fast, workspace, previous=None):
        monkeypatch.setattr(triton_utils.FastLaunch, "enabled", fast)
        for layer, start in zip(layers, starts):
            layer.kv_cache.copy_(start)
        step_md = dataclasses.replace(md, workspace=workspace)
        taken = step_md.inherit(previous)
        with set_forward_context(ForwardContext({layer.layer_name: layer for layer in layers}, step_md)):
            outs = [torch.ops.dynamo_once.attention(q, k, v, layer.layer_name)
                    for layer, (q, k, v, _) in zip(layers, batches)]
        return outs, [layer.kv_cache.clone() for layer in layers], step_md, taken

    expected = step(False, DecodeWorkspace(max_num_seqs=4))  # Triton's normal path, its own workspace (no cache)
    workspace = DecodeWorkspace(max_num_seqs=4)
    assert not step(True, workspace)[3]  # the first step of its layout builds (and compiles what the fast path needs)
    counters = [_decode_split_launch, _prefill_launch]
    before = sum(c.fast_launches for c in counters)
    got = step(True, workspace)
    # A fresh metadata object of a layout seen before takes that step's state from the workspace's cache
    # (ops.launch_cache); the next step of this shape takes the last step's (AttentionMetadata.inherit, as the
    # engine's steps): every layer, the first too, replays the recorded launches.
    again = step(True, workspace, previous=got[2])
    torch.cuda.synchronize()
    assert got[3] and again[3]
    assert sum(c.fast_launches for c in counters) >= before + len(layers)
    for a, b, c in zip(got[0] + got[1], expected[0] + expected[1], again[0] + again[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(c, b, rtol=0, atol=0)


@pytest.mark.parametrize("fused_write", [False, True], ids=["write", "fused_write"])
@pytest.mark.parametrize("on", [False, True], ids=["off", "prefill_writes_kv"])
def test_prefill_writes_kv_switch_routes_the_rows(on, fused_write, monkeypatch):
    """attention_cuda's launches, recorded (no kernel runs): off, the cache write takes every token (the prompts' at
    least); with models.attention.PREFILL_WRITES_KV (the default) the decodes' only (none under fused_write) and the
    prefill launch, bound in its NEW_KV form, gets k and v; a decode-only step is the same either way. A step with a
    prompt writes its decodes' rows in the decode kernel whatever the config's fused_write (an eager step)."""
    import models.attention as attention_module
    import ops.paged_attention as pa
    from ops.paged_decode_config import DecodeConfig

    assert attention_module.PREFILL_WRITES_KV is True  # on by default
    monkeypatch.setattr(attention_module, "PREFILL_WRITES_KV", on)
    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", False)  # the split form's routes
    monkeypatch.setattr(pa, "decode_config", lambda b, d, *_: DecodeConfig(num_splits=1, BLOCK_N=16,
                                                                        fused_write=fused_write))
    calls = []
    # the write: the whole k and v, its first row bound (the kernel's `first`, before the fp8 cache's inverse
    # scales), no slice per layer
    monkeypatch.setattr(attention_module, "write_kv_cache_launch", lambda launch, cache, k, v, **_: calls.append(
        ("write", launch.grid[0], k.data_ptr(), v.data_ptr(), launch.args[-3])))
    monkeypatch.setattr(attention_module, "paged_decode_launch", lambda plan, *a, new_kv, **_: calls.append(
        ("decode", new_kv is not None)))
    monkeypatch.setattr(attention_module, "prefill_launch", lambda launch, *a, new_kv, **_: calls.append(
        ("prefill", launch.kwargs["NEW_KV"], new_kv)))
    for specs in (SPECS, [(0, 6), (5, 3)], [(9, 1), (3, 1)]):
        layer = new_layer()
        q, k, v, md = make_batch(layer, specs)
        nd, t = md.num_decodes, q.shape[0]
        calls.clear()
        attention_module.attention_cuda(q, k, v, layer.kv_cache, md, HEADS, HEAD, HEAD**-0.5)
        fused = fused_write or nd < md.num_seqs
        first = nd if fused else 0
        end = nd if on and nd < md.num_seqs else t
        expected = [("write", end - first, k.data_ptr(), v.data_ptr(), first)] if end > first else []
        if nd:
            expected.append(("decode", fused))
        if nd < md.num_seqs:
            expected.append(("prefill", on, (k, v) if on else None))
        assert calls == expected, specs


def test_layers_of_a_step_share_one_step_call_and_pass_their_own_strides(monkeypatch):
    """attention_cuda's launches, recorded (no kernel runs): the layers of a step share one ``_StepCall`` per layer
    configuration (plan and bound launches, one lookup a layer), a new one for another configuration or step; the
    strides each launch gets are the call's own tensors' (a strided q or output, another cache shape), never a
    cached layer's, and the cache's derived from its shape equal its stride()."""
    import models.attention as attention_module

    calls = []
    monkeypatch.setattr(attention_module, "write_kv_cache_launch", lambda launch, cache, k, v, **kw: calls.append(
        ("write", kw["strides"])))
    monkeypatch.setattr(attention_module, "paged_decode_launch", lambda plan, q, cache, out, *a, **kw: calls.append(
        ("decode", kw["strides"], plan)))
    monkeypatch.setattr(attention_module, "prefill_launch", lambda launch, q, cache, out, *a, **kw: calls.append(
        ("prefill", kw["strides"], launch)))
    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", False)  # three launches: each one's strides
    monkeypatch.setattr(attention_module, "PREFILL_WRITES_KV", False)
    layer = new_layer()
    q, k, v, md = make_batch(layer, SPECS)
    wide = torch.randn(q.shape[0], 3 * q.shape[1])  # q and out as column slices: row strides 3x theirs
    other = new_layer("l1", num_blocks=32)  # another layer of the step, a cache of another shape

    def run(q, layer, out=None, **kw):
        calls.clear()
        res = attention_module.attention_cuda(q, k, v, layer.kv_cache, md, HEADS, HEAD, HEAD**-0.5, out=out, **kw)
        expected = (q.stride(0), k.stride(0), v.stride(0), res.stride(0), *layer.kv_cache.stride()[:4])
        assert [c[0] for c in calls] == ["write", "decode", "prefill"] and all(c[1] == expected for c in calls)
        return calls[1][2], calls[2][2]

    plan, prefill = run(q, layer)
    assert len(md.layer_calls) == 1 and run(q, layer) == (plan, prefill)
    out = torch.empty_like(wide)[:, :q.shape[1]]
    assert run(wide[:, :q.shape[1]], other, out=out) == (plan, prefill)  # the same configuration's key...
    assert len(md.layer_calls) == 2  # ...but for the other cache's shape: its own entry, the same plan
    run(q, layer, sliding_window=5)  # another configuration: its own bound launches
    assert len(md.layer_calls) == 3
    fresh = dataclasses.replace(md)  # the next step: its own
    assert fresh.layer_calls == {}


@pytest.mark.parametrize("var, module, attr", [
    ("DYNAMO_ONCE_PREFILL_WRITES_KV", "attention", "PREFILL_WRITES_KV"),
    ("DYNAMO_ONCE_UNIFIED_ATTENTION", "attention", "UNIFIED_ATTENTION"),
    ("DYNAMO_ONCE_MIXED_DECODE_FUSED", "forward_context", "MIXED_DECODE_FUSED")])
@pytest.mark.parametrize("value, expected", [("1", "True"), ("0", "False"), ("maybe", None)])
def test_attention_switch_defaults_come_from_the_environment(var, module, attr, value, expected):
    """``DYNAMO_ONCE_PREFILL_WRITES_KV``, ``DYNAMO_ONCE_UNIFIED_ATTENTION`` and ``DYNAMO_ONCE_MIXED_DECODE_FUSED`` set
    the attention switches at import; a bad value is an error naming the variable."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, **{var: value})
    proc = subprocess.run([sys.executable, "-c", f"import models.{module} as a; print(a.{attr})"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert (expected or var) in (proc.stdout if proc.returncode == 0 else proc.stderr)
    assert (proc.returncode == 0) == (value != "maybe")


def prefill_write_off_and_on(layer, specs, kw, monkeypatch, device="cpu", dtype=torch.float32):
    """``attention_cuda`` on a batch of ``specs`` with models.attention.PREFILL_WRITES_KV off, then on, from the same
    cache (the step's slots NaN: a read of one before its write shows), k and v column slices of a qkv tensor as the
    models pass them: ``(outputs, caches after, q, k, v, md, the cache before)``."""
    import models.attention as attention_module
    from models.attention import attention_cuda

    q, k, v, md = make_batch(layer, specs, device=device, dtype=dtype)
    q, k, v = torch.cat([q, k, v], 1).split([q.shape[1], k.shape[1], v.shape[1]], 1)
    layer.kv_cache.view(2, -1, *layer.kv_cache.shape[-2:])[:, md.slot_mapping] = float("nan")
    start = layer.kv_cache.clone()
    outs, caches = [], []
    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", False)  # the split form, with and without the switch
    for on in (False, True):
        monkeypatch.setattr(attention_module, "PREFILL_WRITES_KV", on)
        layer.kv_cache.copy_(start)
        outs.append(attention_cuda(q, k, v, layer.kv_cache, dataclasses.replace(md), HEADS, HEAD, HEAD**-0.5,
                                   kw.get("sliding_window"), kw.get("logits_soft_cap")))
        caches.append(layer.kv_cache.clone())
    return outs, caches, q, k, v, md, start


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_cuda_prefill_writes_kv_in_the_op_equals_the_separate_write(kw, monkeypatch):
    """models.attention.PREFILL_WRITES_KV on the GPU in bf16, the table's decode configs (the fused write at a few
    decodes; at 40, the cache-write launch for theirs): a mixed step and a prompts-only one give the output and the
    cache of the switch off, bit for bit, with k, v column slices of a qkv tensor as the models pass them."""
    many = [(5 + i, 1) for i in range(40)] + [(0, 6), (BLOCK * 3 + 1, 9)]
    for specs in (SPECS, many, [(0, 6), (BLOCK * 3 + 1, 9), (0, 11)]):
        layer = new_layer(device="cuda", dtype=torch.bfloat16, num_blocks=len(specs) * 20, **kw)
        outs, caches, *_ = prefill_write_off_and_on(layer, specs, kw, monkeypatch, "cuda", torch.bfloat16)
        assert torch.equal(outs[1], outs[0]) and not outs[1].isnan().any()
        assert torch.equal(caches[1].view(torch.int16), caches[0].view(torch.int16))  # bits (NaN left alike)


# ------------------------------------------------------------------------------------- the unified launch
UNIFIED_SPECS = [(9, 1), (0, 1), (13, 1), (0, 6), (12, 5), (0, 11)]  # decodes of 10, 1, 14 tokens; prompts to 17


@pytest.mark.parametrize("max_decodes, short", [(32, 0), (2, 0), (32, 2048)])
def test_unified_attention_routes_a_step_with_a_prompt_to_one_launch(max_decodes, short, monkeypatch):
    """attention_cuda's launches, recorded (no kernel runs), under models.attention.UNIFIED_ATTENTION (the default):
    a step with a prompt, at most UNIFIED_MAX_DECODES decodes and none longer than UNIFIED_DECODE_TOKENS or its
    longest prompt is one launch, the prefill kernel bound to every sequence (its grid's second dimension) in its
    NEW_KV form, given k and v; a step with a longer decode, or more decodes, takes the split form (cache write,
    decode, prefill of the prompts only); a decode-only step is the same either way; the switch off, always split."""
    import models.attention as attention_module

    assert attention_module.UNIFIED_ATTENTION is True  # on by default
    monkeypatch.setattr(attention_module, "PREFILL_WRITES_KV", False)  # the split form's separate cache write
    monkeypatch.setattr(attention_module, "UNIFIED_MAX_DECODES", max_decodes)
    monkeypatch.setattr(attention_module, "UNIFIED_DECODE_TOKENS", short)
    calls = []
    monkeypatch.setattr(attention_module, "write_kv_cache_launch", lambda launch, *a, **_: calls.append("write"))
    monkeypatch.setattr(attention_module, "paged_decode_launch", lambda plan, *a, **_: calls.append("decode"))
    monkeypatch.setattr(attention_module, "prefill_launch", lambda launch, *a, new_kv, **_: calls.append(
        ("prefill", launch.grid[1], launch.kwargs["NEW_KV"], new_kv is not None)))
    longer_decode = [(20, 1)] + UNIFIED_SPECS[1:]  # 21 tokens: longer than every prompt
    cases = [(UNIFIED_SPECS, True), ([(0, 6), (12, 5)], True), (longer_decode, short >= 21),
             ([(9, 1), (4, 1)], False)]
    for on in (True, False):
        monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", on)
        for specs, fits in cases:
            layer = new_layer()
            q, k, v, md = make_batch(layer, specs)
            nd, n = md.num_decodes, md.num_seqs
            calls.clear()
            attention_module.attention_cuda(q, k, v, layer.kv_cache, md, HEADS, HEAD, HEAD**-0.5)
            if on and fits and nd <= max_decodes:
                assert calls == [("prefill", n, True, True)], specs
            elif nd == n:
                assert "decode" in calls and not any(isinstance(c, tuple) for c in calls), specs
            else:
                assert calls[0] == "write" and calls[-1] == ("prefill", n - nd, False, False), specs
                assert ("decode" in calls) == (nd > 0), specs


def test_a_prefill_launch_is_bound_for_a_bucket_of_query_lengths():
    """query_bucket: powers of two up to 256, then multiples of 256; no query, no launch (a step of another prompt
    length in the bucket shares the launch: test_a_step_of_the_last_ones_shape_takes_over_its_plans_...)."""
    from models.forward_context import query_bucket

    assert [query_bucket(n) for n in (0, 1, 3, 16, 17, 256, 257, 448, 512, 513)] == [0, 1, 4, 16, 32, 256, 512, 512,
                                                                                     512, 768]


def test_decodes_fit_unified_compares_the_longest_decode_with_the_longest_prompt_or_a_threshold():
    md = make_batch(new_layer(), UNIFIED_SPECS)[3]
    assert md.decodes_fit_unified()
    assert md.all_seq_args[0] is md.block_table and md.all_seq_args[3] == 11
    assert md.prefill_args[0].shape[0] == 3 and md.prefill_args[3] == 11
    longer = make_batch(new_layer(), [(20, 1)] + UNIFIED_SPECS[1:])[3]  # a decode of 21 tokens, prompts to 17
    assert not longer.decodes_fit_unified() and not longer.decodes_fit_unified(20) and longer.decodes_fit_unified(21)
    assert make_batch(new_layer(), [(0, 4)])[3].decodes_fit_unified()  # no decode
    assert not make_batch(new_layer(), [(3, 1)])[3].decodes_fit_unified(2048)  # no prompt


def _next_step(md, **changes):
    """The next step's metadata over the same buffers: every sequence one token further unless ``changes`` say
    otherwise (the host copies; the device tensors are read only when kernels run)."""
    lens = [n + 1 for n in md.seq_lens_cpu]
    return dataclasses.replace(md, **{"seq_lens_cpu": lens, "max_seq_len": max(lens), **changes})


# Each change, and which of the last step's pieces the step still shares through the workspace's cache of recent
# steps' (ops.launch_cache) when it does not inherit them: the decode plan (the decodes' rows of the table and
# lengths), the unified prefill launch (every sequence's rows, and the longest query's bucket).
NEXT_STEPS = {
    "another query layout": (lambda md: _next_step(md, query_start_loc_cpu=[0, 1, 2, 3, 8, 12, 20]), "plan"),
    # the longest prompt 10 tokens, not 11: the prefill launch is bound for the bucket of both (query_bucket: 16)
    "a shorter prompt, the same bucket": (lambda md: _next_step(md, query_start_loc_cpu=[0, 1, 2, 3, 9, 14, 24]),
                                          "plan prefill"),
    "another decode count": (lambda md: _next_step(md, num_decodes=2), "prefill"),
    "another buffer": (lambda md: _next_step(md, slot_mapping=md.slot_mapping.clone()), "plan prefill"),
    "a longer view": (lambda md: _next_step(md, block_table=torch.zeros(6, 9, dtype=torch.int32)[:, :8]), ""),
    # the same buffers' first rows: the decodes' plan does not depend on how many sequences follow them
    "a prompt fewer": (lambda md: _next_step(
        md, slot_mapping=md.slot_mapping[:md.query_start_loc_cpu[5]], query_start_loc=md.query_start_loc[:6],
        seq_lens=md.seq_lens[:5], block_table=md.block_table[:5], query_start_loc_cpu=md.query_start_loc_cpu[:6],
        seq_lens_cpu=[n + 1 for n in md.seq_lens_cpu[:5]], max_seq_len=max(md.seq_lens_cpu[:5]) + 1), "plan"),
    "another workspace": (lambda md: _next_step(md, workspace=DecodeWorkspace(max_num_seqs=8)), ""),
    "a decode past the unified threshold": (lambda md: _next_step(
        md, seq_lens_cpu=[30, 1, 14, 6, 17, 11], max_seq_len=30), "plan prefill"),
}


@pytest.mark.parametrize("change", [None, *NEXT_STEPS])
def test_a_step_of_the_last_ones_shape_takes_over_its_plans_and_bound_launches(change):
    """AttentionMetadata.inherit: a step over the same buffers, decode count and query layout (only lengths and
    contents moved on) takes over the last step's decode plan, bound launches and the attention op's per-layer
    state; any difference in what they are built from, the unified launch's fit among it, builds its own state,
    and takes from the workspace's cache the pieces built from the same as the last step's."""
    layer = new_layer()
    _, _, _, md = make_batch(layer, UNIFIED_SPECS)
    last = dataclasses.replace(md, workspace=DecodeWorkspace(max_num_seqs=8))
    cpu = torch.device("cpu")
    plan = last.decode_plan(HEADS, KV_HEADS, HEAD, BLOCK, cpu)
    prefill = last.prefill_launch(HEADS, KV_HEADS, HEAD, BLOCK, torch.float32, False, False, all_seqs=True)
    assert last.decodes_fit_unified(4) and prefill is not None
    step, shared = (_next_step(last), "plan prefill") if change is None else \
        (NEXT_STEPS[change][0](last), NEXT_STEPS[change][1])
    inherited = step.inherit(last)
    assert inherited == (change is None)
    assert (step.decode_plan(HEADS, KV_HEADS, HEAD, BLOCK, cpu) is plan) == ("plan" in shared)
    assert (step.prefill_launch(HEADS, KV_HEADS, HEAD, BLOCK, torch.float32, False, False, all_seqs=True)
            is prefill) == ("prefill" in shared)
    assert (step.layer_calls is last.layer_calls) == inherited
    assert not _next_step(last).inherit(None)


def test_a_step_of_a_recent_layout_takes_over_that_steps_state_from_the_workspace_cache():
    """AttentionMetadata.inherit past the last step: a step whose layout (buffers, decode count, query layout) a recent
    step had, not the last, takes over that step's state from the workspace's cache of recent steps'
    (ops.launch_cache), as long as the unified launch's fit answers the same; the first of a layout takes none and is
    kept for later ones."""
    layer = new_layer()
    _, _, _, md = make_batch(layer, UNIFIED_SPECS)
    cpu = torch.device("cpu")
    a = dataclasses.replace(md, workspace=DecodeWorkspace(max_num_seqs=8))
    assert not a.inherit(None)  # the first of its layout
    plan = a.decode_plan(HEADS, KV_HEADS, HEAD, BLOCK, cpu)
    assert a.decodes_fit_unified(4)
    b = _next_step(a, num_decodes=2)  # another layout: not the last step's, none in the cache
    assert not b.inherit(a) and b.layer_calls is not a.layer_calls
    again = _next_step(a)
    assert again.inherit(b) and again.layer_calls is a.layer_calls
    assert again.decode_plan(HEADS, KV_HEADS, HEAD, BLOCK, cpu) is plan
    longer = _next_step(a, seq_lens_cpu=[30, 1, 14, 6, 17, 11], max_seq_len=30)  # a decode past the threshold
    assert not longer.inherit(b) and longer.layer_calls is not a.layer_calls
    apart = _next_step(a, workspace=DecodeWorkspace(max_num_seqs=8))  # another workspace: another cache
    assert not apart.inherit(b)


def unified_and_split(layer, specs, kw, monkeypatch, device="cpu", dtype=torch.float32):
    """``attention_cuda`` on a step of ``specs``, unified then split, from the same cache (the step's slots NaN: a
    read of one before its write shows), k and v column slices of a qkv tensor: ``(outputs, caches, q, k, v, md,
    the cache before)``."""
    import models.attention as attention_module

    q, k, v, md = make_batch(layer, specs, device=device, dtype=dtype)
    q, k, v = torch.cat([q, k, v], 1).split([q.shape[1], k.shape[1], v.shape[1]], 1)
    layer.kv_cache.view(2, -1, *layer.kv_cache.shape[-2:])[:, md.slot_mapping] = float("nan")
    start = layer.kv_cache.clone()
    outs, caches = [], []
    for on in (True, False):
        monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", on)
        layer.kv_cache.copy_(start)
        outs.append(attention_module.attention_cuda(q, k, v, layer.kv_cache, dataclasses.replace(md), HEADS, HEAD,
                                                    HEAD**-0.5, kw.get("sliding_window"), kw.get("logits_soft_cap")))
        caches.append(layer.kv_cache.clone())
    return outs, caches, q, k, v, md, start


@pytest.mark.cuda
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 3}, {"logits_soft_cap": 5.0}], ids=["plain", "window", "softcap"])
def test_cuda_unified_attention_matches_native_and_writes_the_split_forms_cache(kw, monkeypatch):
    """The unified launch on the GPU in bf16: a mixed step (decodes, whole prompts, a chunk after cached context) and
    a prompts-only one, k, v column slices of a qkv tensor: the native path's output within bf16's tolerance, and
    the split form's cache bit for bit."""
    for specs in (UNIFIED_SPECS, [(0, 6), (BLOCK * 3 + 1, 9), (0, 11)]):
        layer = new_layer(device="cuda", dtype=torch.bfloat16, num_blocks=len(specs) * 20, **kw)
        outs, caches, q, k, v, md, start = unified_and_split(layer, specs, kw, monkeypatch, "cuda", torch.bfloat16)
        assert not outs[0].isnan().any()
        assert torch.equal(caches[0].view(torch.int16), caches[1].view(torch.int16))
        ref = attention_native(q, k, v, start.clone(), md, HEADS, HEAD, HEAD**-0.5, kw.get("sliding_window"),
                               kw.get("logits_soft_cap"))
        tol = TOLERANCES[torch.bfloat16]
        torch.testing.assert_close(outs[0].float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpret),
                                    pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_step_of_a_recent_layout_takes_its_launches_from_the_workspace_cache(device, monkeypatch):
    """Steps over the same persistent buffers in layouts A, B, A (B: one decode fewer, the same tokens), each a
    fresh metadata object that does not inherit the last step's: the second A takes A's step state (plan, bound
    launches, recorded launches) from the workspace's cache of recent steps' (ops.launch_cache), and with new q, k, v
    gives the native path's output and cache, as every step does."""
    import models.attention as attention_module

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", False)  # the split form: a decode plan to share
    layer = new_layer(device=device, num_blocks=len(SPECS) * 20)
    _, _, _, md = make_batch(layer, SPECS, device=device)
    ws = DecodeWorkspace(max_num_seqs=8)
    layouts = {"A": dataclasses.replace(md, workspace=ws), "B": dataclasses.replace(md, workspace=ws, num_decodes=2)}
    g = torch.Generator().manual_seed(1)
    states = []
    for name in ("A", "B", "A"):
        step = dataclasses.replace(layouts[name])
        q, k, v = (torch.randn(md.num_tokens, n * HEAD, generator=g).to(device) for n in (HEADS, KV_HEADS, KV_HEADS))
        cache = layer.kv_cache.clone()
        for _ in range(2):  # two layers' calls: the first builds or takes the state, the second replays it
            out = attention_module.attention_cuda(q, k, v, layer.kv_cache, step, HEADS, HEAD, HEAD**-0.5)
        ref = attention_native(q, k, v, cache, md, HEADS, HEAD, HEAD**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer.kv_cache, cache, rtol=0, atol=0)
        states.append(list(step.layer_calls.values()))
    assert len(states[0]) == 1 and states[2] == states[0] and states[1] != states[0]
    assert ws.launches.hits["call"] == 1 and ws.launches.misses["call"] == 2 and ws.launches.hits["plan"] == 1


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpret),
                                    pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_step_of_another_token_count_over_the_same_pieces_takes_their_state(device, monkeypatch):
    """A step whose last prompt chunk is a token shorter (fewer tokens, the same sequences, the longest query in the
    same bucket; the persistent buffers rewritten in place, as an engine does) after a step of the full chunk: its
    state (plan, bound launches, recorded launches) is the first step's, from the workspace's cache (the token count
    is no part of it), and its output and cache are the native path's."""
    import models.attention as attention_module

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", False)  # the split form: plan, write and prefill
    layer = new_layer(device=device, num_blocks=len(SPECS) * 20)
    _, _, _, md = make_batch(layer, SPECS, device=device)
    ws = DecodeWorkspace(max_num_seqs=8)
    starts, lens = md.query_start_loc_cpu, md.seq_lens_cpu
    shorter = dict(slot_mapping=md.slot_mapping[:-1], query_start_loc_cpu=starts[:-1] + [starts[-1] - 1],
                   seq_lens_cpu=lens[:-1] + [lens[-1] - 1])
    g = torch.Generator().manual_seed(2)
    states = []
    for changes in ({}, shorter):
        step = dataclasses.replace(md, workspace=ws, **changes)
        md.query_start_loc[-1], md.seq_lens[-1] = step.query_start_loc_cpu[-1], step.seq_lens_cpu[-1]
        q, k, v = (torch.randn(step.num_tokens, n * HEAD, generator=g).to(device) for n in (HEADS, KV_HEADS, KV_HEADS))
        cache = layer.kv_cache.clone()
        for _ in range(2):  # two layers' calls
            out = attention_module.attention_cuda(q, k, v, layer.kv_cache, step, HEADS, HEAD, HEAD**-0.5)
        ref = attention_native(q, k, v, cache, step, HEADS, HEAD, HEAD**-0.5)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(layer.kv_cache, cache, rtol=0, atol=0)
        states.append(list(step.layer_calls.values()))
    assert states[1] == states[0] and ws.launches.hits["call"] == 1 and ws.launches.misses["call"] == 1


MANY_DECODES = [(9, 1), (0, 1), (13, 1)] * 11  # 33 decodes: past the decode counts whose config fuses the write


def _recorded_launches(monkeypatch) -> list:
    """attention_cuda's launch helpers, recorded instead of run: ``"write"``, ``("decode", the plan's fused_write,
    given new keys and values)``, ``("prefill", writes the new keys and values)``."""
    import models.attention as attention_module

    calls = []
    monkeypatch.setattr(attention_module, "write_kv_cache_launch", lambda launch, *a, **_: calls.append("write"))
    monkeypatch.setattr(attention_module, "paged_decode_launch", lambda plan, *a, new_kv, **_: calls.append(
        ("decode", plan.fused_write, new_kv is not None)))
    monkeypatch.setattr(attention_module, "prefill_launch", lambda launch, *a, new_kv, **_: calls.append(
        ("prefill", new_kv is not None)))
    return calls


@pytest.mark.parametrize("fused", [True, False], ids=["default", "switched_off"])
def test_a_step_with_a_prompt_writes_its_decodes_keys_in_the_decode_kernel(fused, monkeypatch):
    """Past the decode counts whose config fuses the cache write into the decode kernel, a step with a prompt (the
    split form) still has the decode kernel write the decodes' keys and values, and the prefill kernel the prompt's:
    two launches, no cache write (its attention runs eagerly, where each launch costs host time). A decode-only step
    of as many decodes keeps the config's separate write (what a whole-step CUDA graph replays); so does the step with
    a prompt with models.forward_context.MIXED_DECODE_FUSED off."""
    import models.attention as attention_module
    import models.forward_context as forward_context

    monkeypatch.setattr(forward_context, "MIXED_DECODE_FUSED", fused)
    assert not decode_config(len(MANY_DECODES), HEAD).fused_write
    calls = _recorded_launches(monkeypatch)
    mixed = [("decode", True, True), ("prefill", True)] if fused else ["write", ("decode", False, False),
                                                                       ("prefill", True)]
    for specs, expected in ((MANY_DECODES + [(0, 6)], mixed), (MANY_DECODES, ["write", ("decode", False, False)])):
        layer = new_layer(num_blocks=len(specs) * 5)
        q, k, v, md = make_batch(layer, specs)
        calls.clear()
        attention_module.attention_cuda(q, k, v, layer.kv_cache, md, HEADS, HEAD, HEAD**-0.5)
        assert calls == expected, specs


@pytest.mark.interpret
def test_a_step_with_a_prompt_and_many_decodes_matches_the_native_path():
    """The form above run (Triton's interpreter): 33 decodes whose decode kernel writes their keys and values, beside a
    prompt the prefill kernel writes: the native path's output and cache."""
    import models.attention as attention_module

    specs = MANY_DECODES + [(0, 6)]
    layer = new_layer(num_blocks=len(specs) * 5)
    q, k, v, md = make_batch(layer, specs)
    cache = layer.kv_cache.clone()
    out = attention_module.attention_cuda(q, k, v, layer.kv_cache, md, HEADS, HEAD, HEAD**-0.5)
    ref = attention_native(q, k, v, cache, md, HEADS, HEAD, HEAD**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(layer.kv_cache, cache, rtol=0, atol=0)


@pytest.mark.parametrize("run", [False, pytest.param(True, marks=pytest.mark.interpret)], ids=["plan", "run"])
def test_a_step_with_a_prompt_merges_its_decodes_splits_in_the_decode_kernel(run, monkeypatch):
    """A decode config of two splits that fuses neither the write nor the merge: a step with a prompt (the split form)
    still has its decode kernel write and merge (no merge launch), a decode-only step keeps the config's merge launch;
    run (Triton's interpreter), the mixed step gives the native path's output and cache."""
    import models.attention as attention_module
    import ops.paged_attention as pa
    from ops.paged_decode_config import DecodeConfig

    monkeypatch.setattr(attention_module, "UNIFIED_ATTENTION", False)
    monkeypatch.setattr(pa, "decode_config", lambda b, d, *_: DecodeConfig(num_splits=2, BLOCK_N=16))
    for specs, fused in ((SPECS, True), (SPECS[:3], False)):
        layer = new_layer(num_blocks=len(specs) * 20)
        q, k, v, md = make_batch(layer, specs)
        plan = md.decode_plan(HEADS, KV_HEADS, HEAD, BLOCK, torch.device("cpu"))
        assert plan.num_splits == 2 and plan.fused_merge == plan.fused_write == fused, specs
        assert (plan.launches(False, False, True, fused)[1] is None) == fused, specs  # the merge kernel's launch
        if run and fused:
            cache = layer.kv_cache.clone()
            out = attention_module.attention_cuda(q, k, v, layer.kv_cache, md, HEADS, HEAD, HEAD**-0.5)
            ref = attention_native(q, k, v, cache, md, HEADS, HEAD, HEAD**-0.5)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(layer.kv_cache, cache, rtol=0, atol=0)


def test_eager_layouts_cover_every_decode_count_and_prompt_tile_within_the_budgets():
    """The start-up's step layouts (``eager_layouts``, launched by the engine so that no kernel compiles while it
    serves): every decode count beside a prompt and alone, every power of two of prompt tokens, decodes past the
    unified launch's length where the model's length allows, and nothing over the step's budgets."""
    layouts = eager_layouts(8, 64, 2048)
    assert len(set(layouts)) == len(layouts)
    assert all(d + p <= 64 and d + (p > 0) <= 8 and 1 <= n <= 2048 for d, n, p in layouts)
    assert {d for d, _, p in layouts if p} == set(range(8))  # beside a prompt: 0-7 decodes
    assert {d for d, _, p in layouts if not p} == set(range(1, 9))  # decode-only: 1-8
    assert {p for _, _, p in layouts if p} == {1, 2, 4, 8, 16, 32, 64}
    longer = [(d, n, p) for d, n, p in layouts if n > 1]
    assert longer and all(d and n > max(UNIFIED_DECODE_TOKENS, p) for d, n, p in longer)
    assert all(n == 1 for _, n, _ in eager_layouts(8, 64, UNIFIED_DECODE_TOKENS))  # the model allows none longer
    assert eager_layouts(1, 4, 64) == [(0, 1, 1), (0, 1, 2), (0, 1, 4), (1, 1, 0)]
