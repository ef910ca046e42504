"""Running a Hugging Face model over the paged KV cache: loading, the KV cache tensors, the model
runner and its step inputs, static-shape decode (CUDA graphs), the CPU's native decoder stack,
memory profiling, and the setup that builds an engine's real parts. Imports torch and transformers."""
