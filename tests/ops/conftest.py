"""Fixtures of the ops tests."""

import numpy as np
import pytest


@pytest.fixture
def bf16_dot_in_the_interpreter(monkeypatch):
    """Triton 3.6's interpreter multiplies bf16 blocks in tl.dot as their uint16 storage (a 16x16 product off by
    ~1e10; see test_kernels_interpreted.py): hand its dot the bf16 values instead, widened exactly to fp32 (a bf16
    is the upper half of an fp32). Only the interpreter's arithmetic changes, not what the kernel asks of it."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widened(h):
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
