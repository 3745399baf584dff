"""Programmatic dependent launch (PDL) of the latency-bound kernels: when it is used, and that a chain of
PDL launches, each reading the one before, gives the results of plain launches (eager and in a CUDA graph).
"""

import dataclasses
import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dispatcher import envs
from ops.triton_utils import SMALL_ELEMENTS, pdl_launch

act = importlib.import_module("ops.silu_and_mul")
gelu = importlib.import_module("ops.gelu_and_mul")
rms = importlib.import_module("ops.rms_norm")
quant = importlib.import_module("ops.quant_fp8")


def test_pdl_is_never_used_off_cuda_or_on_fake_tensors(monkeypatch):
    monkeypatch.delenv("DYNAMO_ONCE_PDL", raising=False)
    assert not pdl_launch(torch.ones(4), 4)
    with FakeTensorMode():
        fake = torch.empty(4, 8)
    assert not pdl_launch(fake, 32)


@pytest.mark.parametrize("value,expected", [("0", False), ("off", False), ("1", True), ("yes", True)])
def test_pdl_switch(monkeypatch, value, expected):
    monkeypatch.setenv("DYNAMO_ONCE_PDL", value)
    assert envs.pdl() is expected


def test_bad_pdl_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "fast")
    with pytest.raises(ValueError, match=r"DYNAMO_ONCE_PDL='fast'.*0, 1"):
        envs.pdl()


@pytest.mark.cuda
def test_pdl_only_for_small_launches_on_hopper(monkeypatch):
    monkeypatch.delenv("DYNAMO_ONCE_PDL", raising=False)
    x = torch.ones(4, 8, device="cuda")
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert pdl_launch(x, 32) is hopper
    assert not pdl_launch(x, SMALL_ELEMENTS + 1) and not pdl_launch(x, None)
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "0")
    assert not pdl_launch(x, 32)


def _chain(x: torch.Tensor, scale: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """Ops back to back, each reading the last one's output (read-after-write across launches), and each
    writing a buffer the allocator may have just freed (write-after-read). PDL as ``DYNAMO_ONCE_PDL`` says."""
    outs = []
    h = x
    for _ in range(8):
        h2, res = rms._launch_rms_norm(h, h, w, 1e-6, False)
        g = act._launch_silu_and_mul(torch.cat([h2, res], dim=-1))
        g = gelu._launch_gelu_and_mul(torch.cat([g, h2], dim=-1), "tanh")
        outs.append(quant._launch_static_fp8_quant(g, scale))
        outs.extend(quant._launch_dynamic_fp8_quant(g))  # one program up to 8192 elements, else two kernels
        h = g
    return outs + [h]


def _pdl_and_plain(monkeypatch, chain, graph: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``chain()``'s outputs with PDL on (eager, or captured in a CUDA graph replayed twice) and off (eager)."""
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "0")
    expected = chain()
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "1")
    if graph:
        chain()  # compile the PDL variants outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got = chain()
        g.replay()  # twice: the second replay's first kernel follows the first's last
        g.replay()
    else:
        got = chain()
    torch.cuda.synchronize()
    assert len(got) == len(expected)
    return got, expected


@pytest.mark.cuda
@pytest.mark.parametrize("tokens,hidden", [(1, 4096), (16, 8192), (7, 769)])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_pdl_chain_equals_plain_launches(monkeypatch, tokens, hidden, graph):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    assert tokens * hidden <= SMALL_ELEMENTS
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([0.05], device="cuda")
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "1")
    assert pdl_launch(x, x.numel())
    got, expected = _pdl_and_plain(monkeypatch, lambda: _chain(x, scale, w), graph)
    for a, b in zip(got, expected):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_pdl_rotary_in_a_chain_equals_plain_launches(monkeypatch, graph):
    """The rotary kernel between norms, each reading the one before (as q's rotary between the QKV GEMM and
    attention), with and without PDL."""
    from ops import compute_cos_sin_cache
    from ops.rotary_embedding import _launch_rotary_embedding

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    torch.manual_seed(0)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    positions = torch.tensor([0, 9, 100, 511], device="cuda")
    cos_sin = compute_cos_sin_cache(128, 1024, 500000.0).to("cuda", torch.bfloat16)

    def chain() -> list[torch.Tensor]:
        outs, h = [], x
        for _ in range(8):
            q, k = _launch_rotary_embedding(positions, h, h[:, :1024], cos_sin, 128, True)
            h = rms._launch_rms_norm(q, q, w, 1e-6, False)[0]
            outs += [q, k, h]
        return outs

    got, expected = _pdl_and_plain(monkeypatch, chain, graph)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def _decode_chain(q0, w, cache, plan, new_kv, scale, out):
    """A PDL norm writing q, the decode kernel reading it (and writing out), a PDL norm reading out, 8 layers over
    one cache: the decode's reads after the norm's writes, and the next norm's after the decode's."""
    from ops import rms_norm
    from ops.paged_attention import paged_decode_launch

    outs, h = [], q0
    for _ in range(8):
        q = rms_norm(h, w, 1e-6)
        paged_decode_launch(plan, q, cache, out, scale, new_kv=new_kv)
        h = rms_norm(out, w, 1e-6)
        outs.append(h)
    return outs


@pytest.mark.cuda
@pytest.mark.parametrize("num_seqs", [1, 4])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_pdl_decode_attention_in_a_chain_equals_plain_launches(monkeypatch, num_seqs, graph):
    """The decode kernel launched with PDL (``DecodeConfig.pdl``) between PDL launches of the norm: bit for bit
    the plain launches' values, the cache too (its fused write). 1 and 4 sequences: the table's 16 and 8 splits of
    8 KV heads, 128 and 256 programs, within two an SM on a Hopper GPU of 132 SMs."""
    from ops.paged_attention import DecodePlan
    from ops.paged_decode_config import decode_config

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "1")
    torch.manual_seed(0)
    heads, kv_heads, head, page, context = 32, 8, 128, 16, 300
    pages = context // page + 1
    cache = torch.randn(2, num_seqs * pages, page, kv_heads, head, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(num_seqs * pages, device="cuda", dtype=torch.int32).view(num_seqs, pages)
    seq_lens = torch.full((num_seqs,), context + 1, device="cuda", dtype=torch.int32)
    slots = (table[:, context // page].long() * page + context % page)
    kv = torch.randn(num_seqs, 2 * kv_heads * head, device="cuda", dtype=torch.bfloat16)
    new_kv = (kv[:, :kv_heads * head], kv[:, kv_heads * head:], slots)
    q0 = torch.randn(num_seqs, heads * head, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(heads * head, device="cuda", dtype=torch.bfloat16) + 0.5
    results = {}
    for pdl in (False, True):
        cfg = dataclasses.replace(decode_config(num_seqs, head), pdl=pdl)
        plan = DecodePlan(table, seq_lens, heads, kv_heads, head, page, q0.device, config=cfg)
        if pdl and num_seqs * kv_heads * plan.num_splits > 2 * torch.cuda.get_device_properties(0).multi_processor_count:
            pytest.skip("this GPU has too few SMs for the grid to take PDL")
        assert plan.pdl is pdl
        c, out = cache.clone(), torch.empty_like(q0)
        if graph:
            _decode_chain(q0, w, c, plan, new_kv, head**-0.5, out)  # compile outside the capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                got = _decode_chain(q0, w, c, plan, new_kv, head**-0.5, out)
            g.replay()
            g.replay()
        else:
            got = _decode_chain(q0, w, c, plan, new_kv, head**-0.5, out)
        torch.cuda.synchronize()
        results[pdl] = (got, c)
    for a, b in zip(results[False][0], results[True][0]):
        assert torch.equal(a, b)
    assert torch.equal(results[False][1], results[True][1])


@pytest.mark.cuda
def test_decode_plan_takes_pdl_only_where_every_program_is_resident(monkeypatch):
    from ops.paged_attention import DecodePlan

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability >= 9.0")
    monkeypatch.delenv("DYNAMO_ONCE_PDL", raising=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def plan(num_seqs: int) -> DecodePlan:
        table = torch.zeros(num_seqs, 4, device="cuda", dtype=torch.int32)
        lens = torch.full((num_seqs,), 40, device="cuda", dtype=torch.int32)
        return DecodePlan(table, lens, 32, 8, 128, 16, table.device)

    small, large = plan(1), plan(256)
    assert small.pdl and small.num_seqs * 8 * small.num_splits <= 2 * sms
    assert not large.pdl and large.num_seqs * 8 * large.num_splits > 2 * sms
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "0")
    assert not plan(1).pdl


def test_a_traced_pdl_launch_leaves_the_launch_option_to_inductor():
    """Traced for an Inductor compile, a kernel's PDL constexpr goes into the graph but not ``launch_pdl``, which
    ``wrap_triton`` would take for a kernel argument: Inductor launches the kernel and gives it the option."""
    from ops.triton_utils import pdl_args

    with FakeTensorMode():
        fake = torch.empty(4, 8)
    assert pdl_args(True, fake) == {"PDL": True}
    assert pdl_args(True, torch.ones(2)) == {"PDL": True, "launch_pdl": True}
    assert pdl_args(False, fake) == pdl_args(False, torch.ones(2)) == {"PDL": False}


def test_pdl_args_decides_by_the_launch_rule_when_not_told(monkeypatch):
    """``pdl_args(None, x, n)`` is ``pdl_args(pdl_launch(x, n), x)`` (``any_size``: ``pdl_available``'s): a CPU
    tensor never takes PDL, nor anything with ``DYNAMO_ONCE_PDL=0``; on a CUDA GPU, the same answer as the rule."""
    from ops.triton_utils import pdl_args, pdl_available, pdl_launch

    assert pdl_args(None, torch.ones(2), 2) == pdl_args(None, torch.ones(2), any_size=True) == {"PDL": False}
    if torch.cuda.is_available():
        x = torch.ones(2, device="cuda")
        for n in (2, None, 1 << 30):
            assert pdl_args(None, x, n) == pdl_args(pdl_launch(x, n), x)
        assert pdl_args(None, x, any_size=True) == pdl_args(pdl_available(x), x)
        monkeypatch.setenv("DYNAMO_ONCE_PDL", "0")
        assert pdl_args(None, x, 2) == pdl_args(None, x, any_size=True) == {"PDL": False}


def _ops_chain(x, w, positions, cos_sin, scale):
    """Library ops (inlined into their kernels by a compile) between native ops, each reading the one before."""
    from ops import rms_norm, rotary_embedding, static_scaled_fp8_quant

    h = rms_norm(x * 2, w, 1e-6)
    q, k = rotary_embedding(positions, h, h[:, :1024] + 1, cos_sin, 128)
    return static_scaled_fp8_quant(q.float().relu().to(q.dtype), scale), k


@pytest.mark.cuda
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_inductor_launches_the_library_kernels_it_inlines_with_pdl(monkeypatch, tmp_path, pdl):
    from dispatcher import compat
    from ops import compute_cos_sin_cache

    # A plain torch.compile keys its caches on the graph Dynamo traced, where the ops are opaque: a cached compile of
    # the other ``pdl`` would serve this one (the library's level 3 keys on DYNAMO_ONCE_PDL: its pass manager's uuid)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    hopper = torch.cuda.get_device_capability() >= (9, 0)
    torch.manual_seed(0)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    positions = torch.tensor([5, 17, 300], device="cuda")
    cos_sin = compute_cos_sin_cache(128, 1024, 500000.0).to("cuda", torch.bfloat16)
    scale = torch.tensor([0.05], device="cuda")
    monkeypatch.setenv("DYNAMO_ONCE_PDL", "0")
    expected = _ops_chain(x, w, positions, cos_sin, scale)
    monkeypatch.setenv("DYNAMO_ONCE_PDL", pdl)
    torch.compiler.reset()
    compiled = torch.compile(_ops_chain, dynamic=False, options={"triton.enable_pdl": True})
    got, code = compat.inductor_code(lambda: compiled(x, w, positions, cos_sin, scale))
    torch.compiler.reset()
    source = "\n".join(code)
    launched_early = source.count("triton_meta={'launch_pdl': True")
    assert launched_early == (3 if hopper and pdl == "1" else 0)  # the norm's, the rotary's and the quant's kernels
    for a, b in zip(got, expected):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
