"""ops.triton_utils.FastLaunch: the specialization key, the normal launch wherever the fast path cannot serve,
and (on CUDA) fast launches giving the normal launches' results, bit for bit.

On the CPU no Triton kernel runs outside the interpreter, so the fast path's bookkeeping is checked on a
real ``JITFunction`` whose ``run`` (compile and launch) and compiled launcher are stand-ins."""

import pytest
import torch

from ops import triton_utils
from ops.triton_utils import FastLaunch, specialization_key
from ops_testing import NoHooks as _NoHooks, fake_jit as _fake_jit

triton = pytest.importorskip("triton")


def test_key_follows_what_triton_specializes_on():
    x = torch.zeros(64)
    key = specialization_key((x, 1, 16, 17, 2**40, 0.5, None, True))
    assert key == (torch.float32, True, 1, 3, 2, 5, 0, None, True)  # 2**40: i64, divisible by 16
    # a different dtype, a 4-byte offset (not 16-byte aligned), a stride of 1 against 2 (1 is a constant)
    assert specialization_key((x.double(),))[0] == torch.float64
    assert specialization_key((x[1:],)) == (torch.float32, False)
    assert specialization_key((x[4:],)) == (torch.float32, True)
    assert specialization_key((1,)) != specialization_key((2,))
    assert specialization_key((32,)) == specialization_key((48,))  # both divisible by 16: one kernel
    assert specialization_key(((1, 2),)) is None  # a tuple argument: the normal launch


def test_first_launch_compiles_through_run_later_ones_call_the_launcher(monkeypatch):
    fast, runs, launcher = _fake_jit(monkeypatch)
    x = torch.zeros(64)
    fast((4,), x, 32, BLOCK=128, num_warps=4)
    assert len(runs) == 1 and launcher.calls == []
    fast((5, 2), x, 48, BLOCK=128, num_warps=4)  # same specialization (48 % 16 == 0)
    assert len(runs) == 1 and fast.fast_launches == 1
    # the tensor as its address: the C launcher takes an int as it is (no data_ptr call, no driver query)
    assert launcher.calls[-1] == (5, 2, 1, 777, 1234, False, True, None, None, (4, 1, 0), None, None, None,
                                  x.data_ptr(), 48, 128)
    fast((4,), x[1:], 48, BLOCK=128, num_warps=4)  # misaligned: another specialization, compiled by run
    fast((4,), x, 48, BLOCK=64, num_warps=4)  # another constexpr
    assert len(runs) == 3 and fast.fast_launches == 1
    fast((4,), x[1:], 16, BLOCK=128, num_warps=4)
    assert len(runs) == 3 and fast.fast_launches == 2


def test_normal_launch_where_the_fast_path_cannot_serve(monkeypatch):
    fast, runs, launcher = _fake_jit(monkeypatch)
    x = torch.zeros(64)
    for _ in range(2):
        fast((4,), x, n=32, BLOCK=128)  # a runtime argument by keyword: its value would be frozen
    assert len(runs) == 2 and launcher.calls == []

    class Hooked:
        launch_enter_hook, launch_exit_hook = type("Chain", (), {"calls": [print]})(), None

    fast((4,), x, 32, BLOCK=128)
    fast._runtime = Hooked()  # a profiler's launch hook: every launch through run, which calls it
    fast((4,), x, 32, BLOCK=128)
    assert len(runs) == 4 and launcher.calls == []
    monkeypatch.setattr(FastLaunch, "enabled", False)
    calls = []
    monkeypatch.setattr(type(fast.kernel), "__getitem__", lambda self, grid: lambda *a, **k: calls.append(grid))
    fast((3,), x, 32, BLOCK=128)
    assert calls == [(3,)]


def test_an_interpreted_or_missing_kernel_is_launched_as_usual():
    calls = []

    class Interpreted:  # what triton.jit returns under TRITON_INTERPRET=1: no JITFunction
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    fast = FastLaunch(Interpreted())
    fast((2, 3), 5, BLOCK=8)
    fast((2, 3), 5, BLOCK=8)
    assert calls == [((2, 3), (5,), {"BLOCK": 8})] * 2 and fast.fast_launches == 0


@pytest.mark.cuda
@pytest.mark.parametrize("num_seqs", [1, 3, 64, 200])  # many splits (a merge launch) down to one (none)
def test_fast_launches_equal_normal_launches_on_cuda(num_seqs, monkeypatch):
    from ops import paged_attention as pa

    g = torch.Generator().manual_seed(num_seqs)
    heads, kv_heads, head, block = 8, 2, 64, 16
    ctx = torch.randint(0, 200, (num_seqs,), generator=g)
    per_seq = int((ctx.max() + 1 + block - 1) // block)
    table = torch.arange(num_seqs * per_seq, dtype=torch.int32).view(per_seq, num_seqs).t().contiguous().cuda()
    seq_lens = (ctx + 1).int().cuda()
    cache = torch.randn(2, num_seqs * per_seq, block, kv_heads, head, generator=g).bfloat16().cuda()
    qkv = torch.randn(num_seqs, (heads + 2 * kv_heads) * head, generator=g).bfloat16().cuda()
    q, k, v = qkv.split([heads * head, kv_heads * head, kv_heads * head], -1)  # strided rows, as in a model
    slots = (table[:, 0].long() * block + torch.arange(num_seqs, device="cuda") % block)

    def step():
        c = cache.clone()
        pa.write_kv_cache_triton(c, k, v, slots)
        return c, pa.paged_decode_triton(q, c, table, seq_lens, heads, head, head**-0.5)

    monkeypatch.setattr(FastLaunch, "enabled", False)
    expected = step()
    monkeypatch.setattr(FastLaunch, "enabled", True)
    before = pa._decode_split_launch.fast_launches + pa._write_kv_cache_launch.fast_launches
    for _ in range(3):  # the first may compile through run; the others are fast
        got = step()
        torch.cuda.synchronize()
        for a, b in zip(got, expected):
            assert torch.equal(a, b)
    assert pa._decode_split_launch.fast_launches + pa._write_kv_cache_launch.fast_launches >= before + 4
    assert triton_utils.FastLaunch.enabled


def test_callable_grids_and_unhashable_constexprs_take_the_normal_launch(monkeypatch):
    fast, runs, launcher = _fake_jit(monkeypatch)
    x = torch.zeros(64)
    calls = []
    monkeypatch.setattr(type(fast.kernel), "__getitem__", lambda self, grid: lambda *a, **k: calls.append(grid))
    grid = lambda meta: (4,)  # noqa: E731
    fast(grid, x, 32, BLOCK=128)
    assert calls == [grid]
    for _ in range(2):
        fast((4,), x, 32, BLOCK=[128])
    assert len(runs) == 2 and launcher.calls == []


def test_bound_launch_keys_only_the_per_call_values(monkeypatch):
    from ops.triton_utils import Slot

    fast, runs, launcher = _fake_jit(monkeypatch)
    x = torch.zeros(64)
    bound = fast.bind((4, 2), (Slot.tensor(0), Slot.scalar(0)), BLOCK=128, num_warps=4)
    bound((x,), (32,))  # compiles through run, as the unbound launch would
    assert len(runs) == 1 and runs[0] == ((4, 2), (x, 32), {"BLOCK": 128, "num_warps": 4}) and launcher.calls == []
    direct = (4, 2, 1, 777, 1234, False, True, None, None, (4, 1, 0), None, None, None, x.data_ptr(), 48, 128)
    bound((x,), (48,))  # a new scalar value: the whole launch once (fast: 48 specializes as 32), then the bound path
    bound((x,), (48,))
    assert len(runs) == 1 and launcher.calls == [direct, direct] and fast.fast_launches == 2
    bound((x[1:],), (48,))  # misaligned: another specialization, compiled by run
    bound((x.double(),), (48,))  # another dtype
    assert len(runs) == 3 and fast.fast_launches == 2
    fixed = fast.bind((4, 2), (x, Slot.scalar(0)), BLOCK=128, num_warps=4)  # a fixed tensor goes as its address
    for _ in range(2):
        fixed((), (48,))
    assert launcher.calls[-2:] == [direct, direct] and len(runs) == 3

    class Hooked:
        launch_enter_hook, launch_exit_hook = type("Chain", (), {"calls": [print]})(), None

    fast._runtime = Hooked()  # a profiler's hook: every launch through run
    bound((x,), (48,))
    assert len(runs) == 4 and len(launcher.calls) == 4
    fast._runtime = _NoHooks()
    monkeypatch.setattr(FastLaunch, "enabled", False)
    calls = []
    monkeypatch.setattr(type(fast.kernel), "__getitem__", lambda self, grid: lambda *a, **k: calls.append((grid, a)))
    bound((x,), (48,))
    assert calls == [((4, 2), (x, 48))]


def test_a_new_bound_launch_of_a_known_shape_takes_its_launch_layout_from_the_kernel(monkeypatch):
    """A step's bound launches are new objects each step (another grid, another table): the first call of one whose
    bound values specialize, order and constexprs as an earlier one's (and the same per-call specialization) launches
    through the layout that one kept (FastLaunch.layout), with its own grid and addresses, not the whole launch;
    another specialization of a bound value, or another constexpr, takes the whole launch once."""
    from ops.triton_utils import Slot

    fast, runs, launcher = _fake_jit(monkeypatch)
    x, y = torch.zeros(64), torch.zeros(128)
    fast.bind((4,), (x, Slot.scalar(0)), BLOCK=128)((), (48,))  # compiles through run, keeps the layout
    whole = []
    entry = fast.launch_entry
    monkeypatch.setattr(fast, "launch_entry", lambda *a: whole.append(a) or entry(*a))
    fast.bind((9, 3), (y, Slot.scalar(0)), BLOCK=128)((), (48,))  # another grid and table, one shape
    assert whole == [] and launcher.calls[-1] == (9, 3, 1, 777, 1234, False, True, None, None, (4, 1, 0), None,
                                                  None, None, y.data_ptr(), 48, 128)
    fast.bind((9, 3), (y[1:], Slot.scalar(0)), BLOCK=128)((), (48,))  # a misaligned table: another specialization
    fast.bind((9, 3), (y, Slot.scalar(0)), BLOCK=64)((), (48,))  # another constexpr
    assert len(whole) == 2 and len(runs) == 3


def test_bound_launches_take_the_target_their_caller_read_once(monkeypatch):
    """The attention op reads the device and stream once a call (``FastLaunch.target``) and passes them to its two
    or three bound launches: they launch there, read no device themselves, and key their kernels by that device;
    without a target each launch reads its own; hooks set or the fast path off: no target (the normal launch)."""
    from ops.triton_utils import Slot

    fast, runs, launcher = _fake_jit(monkeypatch)
    x = torch.zeros(64)
    assert fast.target() == (0, 777)  # the current device and its current stream
    bound = fast.bind((4,), (Slot.tensor(0), Slot.scalar(0)), BLOCK=128)
    bound((x,), (32,), (0, 777))  # compiles through run
    reads = []
    monkeypatch.setattr(fast, "_device", lambda: reads.append(1) or 0)
    bound((x,), (32,), (0, 555))  # a stream the caller read: another CUDA graph capture's, say
    assert len(runs) == 1 and launcher.calls[-1][3] == 555 and reads == []
    bound((x,), (32,))  # no target: read here
    assert launcher.calls[-1][3] == 777 and reads == [1] and fast.fast_launches == 2
    monkeypatch.setattr(fast, "_device", lambda: 1)  # another current device: its own kernel, compiled through run
    bound((x,), (32,), fast.target())
    assert len(runs) == 2 and fast.fast_launches == 2
    bound((x,), (32,), fast.target())
    assert len(runs) == 2 and fast.fast_launches == 3

    class Hooked:
        launch_enter_hook, launch_exit_hook = type("Chain", (), {"calls": [print]})(), None

    fast._runtime = Hooked()
    assert fast.target() is None
    bound((x,), (32,))  # the target read here is None: through run, which calls the hook
    assert len(runs) == 3
    fast._runtime = _NoHooks()
    monkeypatch.setattr(FastLaunch, "enabled", False)
    assert fast.target() is None
