"""Unit-test set-up: Triton's kernels run in its interpreter where there is no CUDA device
(tests/triton_interpreter.py says why this must happen before anything imports triton)."""

from tests.triton_interpreter import enable_interpreter_without_cuda

enable_interpreter_without_cuda()
