"""Shapes, dtypes, tolerances and devices shared by the op tests (set once, here)."""

from __future__ import annotations

import pytest
import torch

NUM_TOKENS = [1, 7, 83, 4096]
HIDDEN = [8, 768, 769, 5120]  # 769: odd, no 16-byte vectors; 8: many rows per program
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

# The op and the reference both compute in fp32 and round once to the output
# dtype; fp32 differences (reduction order, approximate rsqrt ~1e-7) can flip
# that rounding, so allow 2 ulp of the output dtype: fp16 2**-10 ~ 9.8e-4,
# bf16 2**-7 ~ 7.8e-3. fp32 outputs: a 5120-term sum reordered, ~1e-6.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype])


def grid_cases(device: str) -> list:
    """(num_tokens, hidden, dtype) for the eager grid: all on CUDA; on CPU, 4096 x 5120 in bf16 only (fp32 refs of 21M elements are slow on 2 cores)."""
    cases = []
    for t in NUM_TOKENS:
        for h in HIDDEN:
            for dt in DTYPES:
                if device == "cpu" and t * h > 1 << 21 and dt != torch.bfloat16:
                    continue
                cases.append((t, h, dt))
    return cases


def grid_params(device_filter: str | None = None) -> list:
    """pytest params over DEVICES x grid_cases, ids like ``cpu-83x769-bf16``."""
    out = []
    for dev in DEVICES:
        device = dev.values[0]
        for t, h, dt in grid_cases(device):
            out.append(pytest.param(device, t, h, dt, marks=dev.marks, id=f"{device}-{t}x{h}-{DTYPE_IDS[dt]}"))
    return out


def compile_params() -> list:
    """A sample for torch.compile(fullgraph=True): each Inductor compile costs ~1 s on CPU, so CPU gets
    the awkward shapes once per dtype; CUDA every dtype x hidden at 83 tokens."""
    out = []
    cpu = [(7, 769, torch.float32), (83, 768, torch.float16), (83, 769, torch.bfloat16), (1, 8, torch.bfloat16)]
    for t, h, dt in cpu:
        out.append(pytest.param("cpu", t, h, dt, id=f"cpu-{t}x{h}-{DTYPE_IDS[dt]}"))
    for h in HIDDEN:
        for dt in DTYPES:
            out.append(pytest.param("cuda", 83, h, dt, marks=pytest.mark.cuda, id=f"cuda-83x{h}-{DTYPE_IDS[dt]}"))
    return out


def strided_rows(x: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """The same values as ``x: [T, H]`` with a row stride of ``H + pad`` (a slice of a wider buffer)."""
    wide = torch.empty(x.shape[0], x.shape[1] + pad, dtype=x.dtype, device=x.device)
    wide[:, : x.shape[1]] = x
    out = wide[:, : x.shape[1]]
    assert out.stride(0) == x.shape[1] + pad
    return out


def compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=False)


# ------------------------------------------------ FastLaunch stand-ins (CPU)
def _plain(x_ptr, n, BLOCK: "tl.constexpr"):  # noqa: F821 - never compiled: run() is a stand-in
    pass


class _Launcher:
    """A stand-in for Triton 3.6's CudaLauncher: ``launch`` is the C entry point."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self):
        self.calls = []

    def launch(self, *args):
        self.calls.append(args)


class _Compiled:
    def __init__(self, launcher):
        self.run, self.function, self.packed_metadata = launcher, 1234, (4, 1, 0)


class NoHooks:
    launch_enter_hook = launch_exit_hook = None


def fake_jit(monkeypatch):
    """A real JITFunction whose ``run`` records its calls and returns the stand-in compiled kernel."""
    import triton

    kernel = triton.runtime.JITFunction(_plain)
    launcher = _Launcher()
    runs = []

    def run(*args, grid, warmup, **kwargs):
        runs.append((grid, args, kwargs))
        return _Compiled(launcher)

    monkeypatch.setattr(kernel, "run", run)
    from ops.triton_utils import FastLaunch

    fast = FastLaunch(kernel)

    def resolve():
        fast._device, fast._stream, fast._runtime = (lambda: 0), (lambda device: 777), NoHooks()

    monkeypatch.setattr(fast, "_resolve", resolve)
    return fast, runs, launcher


def spy_on_rows(monkeypatch, module, name: str) -> list[int]:
    """Replace ``module.name`` (a launcher taking the ``[M, K]`` operand first) by a spy that records each call's
    M and calls it; returns the list of M's."""
    calls: list[int] = []
    launcher = getattr(module, name)

    def spy(a, *args, **kwargs):
        calls.append(a.shape[0])
        return launcher(a, *args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls
