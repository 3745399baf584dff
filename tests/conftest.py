import os
import tempfile

import pytest
import torch

# Keep Dynamo's caches and Inductor's artifacts per test worker.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
# The compile cache off from the start (module- and session-scoped fixtures run before the per-test fixture below
# that also turns it off: one of them hit an entry a run left under ~/.cache and never ran its pass manager), and
# whatever a test or its subprocesses write goes to a temporary directory, never the user's ~/.cache.
os.environ["DYNAMO_ONCE_DISABLE_COMPILE_CACHE"] = "1"
os.environ.setdefault("DYNAMO_ONCE_CACHE_DIR", tempfile.mkdtemp(prefix="dynamo_once_tests_"))


def _interpreting() -> bool:
    """Triton's interpreter is on (it must be set before any kernel is defined) and Triton is installed."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreter_int_from_one_element() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with ``int(array)``, which NumPy >= 2.3
    refuses for the 1-element arrays its scalars are (a loop bound loaded from memory fails). Convert
    through the element instead. Applied only while interpreting (a test session's own process)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_dynamo_once_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._dynamo_once_fixed = True
    interpreter._patch_lang_tensor = patched


def _interpreter_fma_rounds_once() -> None:
    """Triton's interpreter computes ``tl.fma(x, y, z)`` as NumPy's ``x * y + z`` in the operands' dtype: two
    roundings, where the GPU's fused multiply-add has one (the quant kernels' correctly rounded quotient, see
    ops.quant_fp8, relies on it). fp32 operands are computed in float64 instead (the product exact; the sum
    rounded twice, to float64 then fp32, which differs from one rounding about once in 2**29 results)."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_fma, "_dynamo_once_fixed", False):
        return

    def create_fma(self, x, y, z):
        if z.data.dtype == np.float32:
            exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)
            return interpreter.TensorHandle(exact.astype(np.float32), z.dtype.scalar)
        return interpreter.TensorHandle(x.data * y.data + z.data, z.dtype.scalar)

    create_fma._dynamo_once_fixed = True
    builder.create_fma = create_fma


def _interpreter_fp8_rounds_as_the_gpu() -> None:
    """Triton 3.6's interpreter converts fp32 to fp8 e4m3 by truncating the mantissa and adding the cut-off bit
    without its carry into the exponent (126.9 becomes 64, and -0.1248 becomes -0.0625, not -0.125). Convert as
    the GPU's ``cvt.rn.satfinite`` does instead: rounded to nearest even, saturated at +-448 (NaN stays NaN)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "_dynamo_once_fixed", False):
        return

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            q = torch.where(x.isnan(), x, x.clamp(-448.0, 448.0)).to(torch.float8_e4m3fn)
            return interpreter.TensorHandle(q.view(torch.uint8).numpy().reshape(src.data.shape), dst_type.scalar)
        return original(self, src, dst_type, rounding_mode)

    create_fp_to_fp._dynamo_once_fixed = True
    builder.create_fp_to_fp = create_fp_to_fp


def _interpreter_patches_the_language_once_a_launch() -> None:
    """Triton 3.6's interpreter patches the language modules a kernel's globals hold (``triton.language``,
    ``triton.language.core``: every builtin, found through ``inspect.getmembers``) when a launch starts, restores
    them when it ends, and patches those of each ``@triton.jit`` helper again at every call inside the kernel,
    never restored: the same functions over the ones already there, a millisecond a call (a quarter of the
    attention kernels' interpreted time). Inside a launch a helper whose modules are patched already skips it (one
    whose globals hold a module not yet patched, such as ``triton.language.core`` for the standard library's
    functions, patches as before)."""
    import threading

    import triton.language as tl
    from triton.runtime import interpreter

    if not hasattr(interpreter, "GridExecutor") or getattr(interpreter._patch_lang, "_dynamo_once_fixed", False):
        return  # another interpreter than this was written for: left as it is
    original_patch, original_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = threading.local()
    modules_of: dict = {}

    class _Kept:
        @staticmethod
        def restore() -> None:  # the launch's scope restores the language
            pass

    def patch_lang(fn):
        mods = modules_of.get(fn)
        if mods is None:
            mods = modules_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        patched = getattr(state, "patched", None)
        if patched is not None and mods <= patched:
            return _Kept
        scope = original_patch(fn)
        if patched is not None:
            state.patched = patched | mods
        return scope

    def launch(self, *args, **kwargs):
        state.patched = frozenset()
        try:
            return original_launch(self, *args, **kwargs)
        finally:
            state.patched = None

    patch_lang._dynamo_once_fixed = True
    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch


if _interpreting():
    _interpreter_int_from_one_element()
    _interpreter_patches_the_language_once_a_launch()
    _interpreter_fma_rounds_once()
    _interpreter_fp8_rounds_as_the_gpu()


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interpret = pytest.mark.skip(reason="runs the Triton kernels on CPU tensors in Triton's interpreter: "
                                             "TRITON_INTERPRET=1 pytest -m interpret (make test does)")
    cuda, interpreting = torch.cuda.is_available(), _interpreting()
    for item in items:
        if "cuda" in item.keywords and not cuda:
            item.add_marker(skip_cuda)
        if "interpret" in item.keywords and not interpreting:
            item.add_marker(skip_interpret)


@pytest.fixture(autouse=True)
def _clean_dynamo_and_config(monkeypatch):
    """Each test starts from the environment's config and an empty Dynamo cache."""
    import dispatcher

    for var in list(os.environ):
        if var.startswith("DYNAMO_ONCE_") or var == "TORCH_COMPILE_DISABLE":
            monkeypatch.delenv(var, raising=False)
    # The compile cache off: a test that counts compiles or pass runs must compile, and nothing is written
    # under ~/.cache. tests/models/test_compile_cache.py turns it on where it tests it.
    monkeypatch.setenv("DYNAMO_ONCE_DISABLE_COMPILE_CACHE", "1")
    dispatcher.set_compilation_config(None)
    torch._dynamo.reset()
    yield
    dispatcher.set_compilation_config(None)
    torch._dynamo.reset()
