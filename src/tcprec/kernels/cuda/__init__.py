"""CUDA kernels compiled at run time by NVRTC through cuda.core (no GPU needed to compile).

``runtime`` is the generic part: build a ``.cu`` file with ``-D`` defines, cache the cubin on disk,
load a kernel once per device, launch it on PyTorch's current stream.  Each kernel module uses only
its public API and registers nothing but its own op:

* ``bmma_gemm`` (``bmma_gemm.cu``, inline PTX ``mma.sync ... b1.b1.s32.and.popc`` / ``wgmma``): the
  bit-serial integer GEMM on the binary tensor cores, its variants and tile choices
  (``bmma_gemm_tiles.json``); importing it registers ``torch.ops.tcprec.bmma_gemm``.
* ``stem_conv`` (``stem_conv.cu``): the thin-input INT8 stem convolution with the bit-plane epilogue.
* ``i8_gemm`` (``i8_gemm.cu``, ``wgmma ... s32.s8.s8``, sm_90a): the warp-specialised ping-pong INT8 GEMM with the
  quantized linear's epilogue (scale, bias, erf GELU, fp16 + residual or the next layer's int8 codes).

``hopper.cuh`` holds the sm_90a building blocks both warp-specialised kernels share (TMA descriptor, mbarrier steps,
setmaxnreg, wgmma fence / commit / wait, the swizzled shared-memory descriptor); ``codes.cuh`` the packed-output codes.

They are imported on first use (``tcprec.ops.matmul``, ``tcprec.ops.qconv``), never at ``import tcprec``.
"""
