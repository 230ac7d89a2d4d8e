"""Bit-serial integer GEMM on the binary tensor cores: one CUDA C++ source (``bmma_gemm.cu``,
inline PTX ``mma.sync ... b1.b1.s32.and.popc``) compiled at run time by NVRTC through cuda.core.

``loader`` builds / caches / launches the variants and registers ``torch.ops.tcprec.bmma_gemm``;
it is imported on first use (``tcprec.ops.matmul``), never at ``import tcprec``.  ``stem_conv``
(``stem_conv.cu``, built by the same ``loader.compile_source``) is the thin INT8 stem convolution.
"""
