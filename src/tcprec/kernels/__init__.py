"""Kernels: the pure-torch reference (ground truth, CPU backend), Triton kernels, CUDA kernels."""
