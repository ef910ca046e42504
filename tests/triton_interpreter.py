"""The Triton attention kernels on the CPU, in Triton's interpreter (``TRITON_INTERPRET=1``).

``triton.jit`` decides at decoration time whether a function is compiled or interpreted, and an
interpreted kernel can only call interpreted library functions (``tl.max``, ``tl.sum``): so the
variable must be set before triton is first imported, which ``transformers.masking_utils`` does
(through ``torch._dynamo``). :func:`enable_interpreter_without_cuda` sets it from the suite's root
conftest, before any test module is collected; on a machine with CUDA it is left alone, so the kernels stay
compiled for the CUDA cases and the interpreter's cases are skipped there.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None


def enable_interpreter_without_cuda() -> None:
    """Set ``TRITON_INTERPRET=1`` where there is no CUDA device (call before anything imports triton)."""
    if HAS_TRITON and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_module(device: str) -> ModuleType:
    """``engine.kernels.attention.triton_paged`` for tensors on ``device``: compiled on CUDA, interpreted on the CPU.

    Skips the test when the interpreter is wanted but cannot run here: a CUDA machine (its cases run
    the compiled kernels), or triton imported before the variable was set.
    """
    if device == "cpu":
        if torch.cuda.is_available():
            pytest.skip("Triton's interpreter cases run where there is no GPU; here the CUDA cases run")
        if "triton" in sys.modules and not _library_is_interpreted():
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (see tests/triton_interpreter.py)")
        os.environ["TRITON_INTERPRET"] = "1"
        _widen_bfloat16_dots()
    return importlib.import_module("tokenmill.engine.kernels.attention.triton_paged")


def _library_is_interpreted() -> bool:
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.max, InterpretedFunction)


def _widen_bfloat16_dots() -> None:
    """NOTE: Triton's interpreter multiplies the bfloat16 operands of tl.dot as the uint16 words it
    stores them in (3.9.0: garbage); widening them to float32 first is exact (a product of two
    bfloat16 values fits a float32), as the GPU's tensor cores multiply before they accumulate."""
    from triton import language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_tokenmill_widened", False):
        return
    create_dot = builder.create_dot

    def widened(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = widened  # type: ignore[method-assign]
    builder._tokenmill_widened = True  # type: ignore[attr-defined]
