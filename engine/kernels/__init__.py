"""Tensor kernels behind small Python interfaces: paged attention backends (attention/), CPU
linear layers (cpu_linear.py, panel_linear/) and the C++ builder they share (cpp_build.py, csrc/).
Imports torch; knows nothing of models, requests or the scheduler."""
