"""Triton kernels (run on CUDA, or on the CPU under TRITON_INTERPRET=1)."""
