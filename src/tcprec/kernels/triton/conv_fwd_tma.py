"""INT8 / FP8 1x1 convolution and linear layer as a persistent Hopper GEMM with TMA loads, sharing conv_fwd's epilogue.

A 1x1, stride-1, unpadded NHWC convolution is a plain GEMM: x ``(N, H, W, C)`` is the ``(M, C)`` matrix of its M =
N*H*W pixels, w ``(K, 1, 1, C)`` the ``(K, C)`` matrix, y ``(N, H, W, K)`` the ``(M, K)`` one -- both operands
reduction-major (C contiguous), which is what Hopper's 8-bit wgmma reads from shared memory.  ``conv_fwd.py``'s
implicit GEMM runs it with masked pointer loads (cp.async), one output tile a program; here (the pattern of Triton's
tutorial 09-persistent-matmul):

    grid = min(#tiles, #SMs)                            # persistent: program s runs tiles s, s + #SMs, ...
    for tile in tl.range(start, tiles, #SMs, flatten=True):
        (pid_m, pid_n) = grouped order of tile           # GROUP_M row blocks share the weight columns, in L2
        acc[BLOCK_M, BLOCK_N] = 0   (int32 for int8, fp32 for fp8)
        for c0 in 0, BLOCK_K, ..., C:                    # TMA zero-fills columns past C and rows past M / K
            a = x_desc.load([pid_m * BLOCK_M, c0])       # (BLOCK_M, BLOCK_K): cp.async.bulk.tensor.2d
            b = w_desc.load([pid_n * BLOCK_N, c0])       # (BLOCK_N, BLOCK_K)
            acc += a @ b.T                               # wgmma s8 / e4m3 (fp8: promoted into fp32 every BLOCK_K)
        shifted int8 operands: acc = acc * acc_mul + add[k] (or add[(p, q), k])
        conv_fwd_epilogue._conv_epilogue(acc, ...)       # the very code the implicit kernel runs

``flatten=True`` makes the tile loop and the reduction loop one software-pipelined loop: the next tile's TMA loads
are in flight while this tile's epilogue runs (scales, residual, the int8 / fp8 codes and the stores are most of a
ResNet-50 conv3's time).  Results equal the implicit kernel's bit for bit: the int32 products are exact, the fp8
accumulator is promoted every BLOCK_K products in the same order (with the same BLOCK_K), and the epilogue is the same
function.

What the compiler makes of it (triton 3.9, sm_90a, read from the PTX and the cubin on the CPU; tests check the
instructions): both operands by ``cp.async.bulk.tensor.2d`` into shared memory, ``num_stages`` deep with mbarriers,
the next tile's first loads issued before this tile's epilogue; ``wgmma.mma_async`` m64n128k32 s8 / e4m3 from shared
memory (a 256-wide tile as two n128 halves), waited on each step as the implicit kernel's are.  Registers: int8
float16-out 128 x 256 on 8 warps 230, no spill; the residual + dual epilogue spills at 128 x 128 on 4 warps, not on 8
(179) or at 64 x 64 (108); fp8 spills at 128 x 256 on 8 warps, not at 128 x 128 (178).

The kernel is chosen by the tile table (``conv_fwd.pick_config``: a class whose entry names ``"tma"``) or by an
explicit ``config={"kernel": "tma", ...}``; ``conv_fwd.tma_unsupported`` says why a launch cannot take it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._host import cdiv
from .conv_fwd_epilogue import _channel_scale, _conv_epilogue

__all__ = ["launch", "tile_order"]

_NOSPEC = ["M", "PQ", "alpha", "sa_stride", "sb_stride", "bias_stride", "act", "slope", "acc_mul"]


@triton.jit
def _tile_of(tile, in_group, num_m, GROUP_M: tl.constexpr):
    """Grouped order (tutorial 03): GROUP_M row blocks, column by column -- neighbours share a weight block and the
    group's rows stay in L2."""
    group = tile // in_group
    first_m = group * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group_m)
    pid_n = (tile % in_group) // group_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=_NOSPEC)
def _gemm_tma_kernel(
    x_desc, w_desc, out_ptr, sa_ptr, sb_ptr, bias_ptr, add_ptr, oscale_ptr, res_ptr, out8_ptr,
    # -- sizes: x (M, C), w (K, C), out (M, K) contiguous; PQ = P*Q (a (P, Q, K) add's rows) --
    M, K, C, PQ,
    # -- epilogue (conv_fwd._conv_fwd_kernel's arguments of the same names) --
    alpha, sa_stride, sb_stride, bias_stride, act, slope, acc_mul,
    IS_FP8: tl.constexpr, FAST_ACCUM: tl.constexpr, OUT_MODE: tl.constexpr, HAS_ADD: tl.constexpr,
    ADD_PIX: tl.constexpr, INT64: tl.constexpr, HAS_RES: tl.constexpr,
    OUT_LO: tl.constexpr, OUT_HI: tl.constexpr, OUT_OFF: tl.constexpr,
    F8_MAN: tl.constexpr, F8_BIAS: tl.constexpr, F8_MAX_BITS: tl.constexpr, F8_MIN_NORMAL_BITS: tl.constexpr,
    F8_SUB_SCALE: tl.constexpr,
    # -- tiles: (BLOCK_M, BLOCK_N) outputs, BLOCK_K reduction columns a step; NUM_PROGRAMS persistent programs --
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
):
    start = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(K, BLOCK_N)
    k_steps = tl.cdiv(C, BLOCK_K)
    num_tiles = num_m * num_n
    in_group = GROUP_M * num_n
    tile_out = start - NUM_PROGRAMS  # the epilogue's tile, counted apart (the flattened loop keeps it out of the
    #                                  reduction's registers, as tutorial 09 does)
    for tile in tl.range(start, num_tiles, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_of(tile, in_group, num_m, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        if IS_FP8:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for ks in range(k_steps):
            a = x_desc.load([m0, ks * BLOCK_K])  # (BLOCK_M, BLOCK_K)
            b = w_desc.load([n0, ks * BLOCK_K])  # (BLOCK_N, BLOCK_K)
            if not IS_FP8:  # as conv_fwd._conv_acc: the same dot, the same accumulator type
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
            elif FAST_ACCUM:
                acc = tl.dot(a, b.T, acc, out_dtype=tl.float32)
            else:
                acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K, out_dtype=tl.float32)

        # ---- epilogue of this tile ----
        tile_out += NUM_PROGRAMS
        pid_m, pid_n = _tile_of(tile_out, in_group, num_m, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = offs_m < M
        n_ok = offs_n < K
        offs_n_ld = offs_n % K  # channels past K read channel (k mod K): loads need no mask along N
        if HAS_ADD:  # int32 wrap-around is harmless: the true sum fits int32 (checked by the caller)
            if ADD_PIX:  # a (P, Q, K) correction: row m is output position m mod P*Q
                add = tl.load(add_ptr + (offs_m % PQ)[:, None] * K + offs_n_ld[None, :], mask=m_ok[:, None], other=0)
            else:
                add = tl.load(add_ptr + offs_n_ld)[None, :]
            acc = acc * acc_mul + add
        scl = _channel_scale(sa_ptr, sb_ptr, offs_n_ld, alpha, sa_stride, sb_stride, OUT_MODE, BLOCK_N)
        _conv_epilogue(acc, offs_m, offs_n, offs_n_ld, m_ok, n_ok, scl, pid_n, num_n, M, K, out_ptr, bias_ptr,
                       oscale_ptr, res_ptr, out8_ptr, bias_stride, act, slope, 0, OUT_MODE, INT64, HAS_RES, OUT_LO,
                       OUT_HI, OUT_OFF, F8_MAN, F8_BIAS, F8_MAX_BITS, F8_MIN_NORMAL_BITS, F8_SUB_SCALE, 1, 0, BLOCK_N)


def tile_order(M: int, K: int, block_m: int, block_n: int, group_m: int) -> list[tuple[int, int]]:
    """(pid_m, pid_n) of tiles 0, 1, ... as the kernel's ``_tile_of`` orders them (for tests and the docs)."""
    num_m, num_n = cdiv(M, block_m), cdiv(K, block_n)
    out = []
    for tile in range(num_m * num_n):
        first = tile // (group_m * num_n) * group_m
        gm = min(num_m - first, group_m)
        out.append((first + tile % gm, tile % (group_m * num_n) // gm))
    return out


def launch(x: torch.Tensor, w: torch.Tensor, M: int, K: int, C: int, PQ: int, cfg: dict, programs: int, args: tuple,
           flags: dict):
    """Launch the persistent TMA GEMM over x as (M, C) and w as (K, C) (both contiguous, 16-byte rows: checked by
    ``conv_fwd``'s eligibility rule before this): ``args`` are the pointers and epilogue scalars in the kernel's
    order after the descriptors (out, sa, sb, bias, add, oscale, res, out8, then alpha ... acc_mul), ``flags`` its
    constexprs but the tiles.  Returns the compiled kernel."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    x2 = x.view(M, C)  # (M, C) pixels x channels
    w2 = w.view(K, C)  # (K, C) output channels x channels
    x_desc = TensorDescriptor(x2, [M, C], [C, 1], [bm, bk])
    w_desc = TensorDescriptor(w2, [K, C], [C, 1], [bn, bk])
    # the tile loop's step is ``programs`` (a constexpr: one compile per device, not per shape); with fewer tiles
    # than that the grid has one program a tile and each loop runs once
    grid = (max(1, min(programs, cdiv(M, bm) * cdiv(K, bn))),)
    ptrs, scalars = args[:8], args[8:]
    return _gemm_tma_kernel[grid](
        x_desc, w_desc, *ptrs, M, K, C, PQ, *scalars, **flags,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 8), NUM_PROGRAMS=programs,
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), enable_fp_fusion=False)
