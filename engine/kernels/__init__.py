"""Tensor kernels behind small Python interfaces: paged attention backends (attention/), CPU
linear layers (cpu_linear.py, panel_linear/) and the C++ builder they share (cpp_build.py, csrc/); and the builder of
torch-free CPython modules (python_module.py: the speculator's n-gram index). Imports torch (but cpp_build.py and
python_module.py load without it); knows nothing of models, requests or the scheduler."""
