"""Emulated-accumulator GEMMs: C = A @ B with the accumulator held in any FloatFormat.

Model and proof of exactness: kernels/reference_emulate.py (the ground truth these kernels equal).

``fma`` mode, on CUDA cores (pseudo-code of one program, a BLOCK_M x BLOCK_N tile of C)::

    s = 0; c = 0
    for k in range(K):                       # in order along K: the model fixes the order
        p = R(a[:, k] * b[k, :])             # outer product of a column and a row, rounded once
        s = R(s + p)                         # (or Kahan: y = R(p - c); t = R(s + y); ...)

Fast path (``FAST``, signed formats with zero and subnormals, deterministic modes).  Every R is
one rounding of the exact result; the fast loop gets there with a few float32 instructions:

* sum of two acc values, nearest modes, man <= 10: ``RN_fp32(s + p)`` then R.  Double rounding is
  innocuous for a sum of two p-bit floats when the working precision q >= 2p + 1 (Figueroa 1995;
  24 >= 2*11 + 1): either the fp32 sum is exact, or the addend is so small that neither the exact
  nor the fp32 sum lies near a midpoint of the acc grid.  Directed modes: ``add.rz/rp/rm`` then R
  in the same direction (the acc grid is a subset of the fp32 grid, so D(D32(x)) == D(x)).
  Other cases (nearest with man > 10): round-to-odd ``add.rm``/``add.rp`` pair, then R.
* R of such a sum needs no subnormal or range logic: the exact sum of two grid values with
  |sum| < min_normal is a multiple of the acc quantum with <= man bits, so it is exact in fp32 and
  left unchanged by the rounding below.  R is Veltkamp's split for nearest-even
  (``c = x * (2**S + 1); r = c - (c - x)``, S = 23 - man: round to man + 1 bits, ties to even;
  checked exhaustively over whole binades), ``(bits + 2**(S-1)) & -2**S`` for nearest-away,
  ``bits & -2**S`` for toward-zero, and a sign-dependent add for up/down.
* products: exact in fp32 and on the acc grid (``PROD == 0``, narrow operand formats, e.g. e4m3 x
  e4m3 into e5m10): ``p = a * b``, no rounding.  Otherwise the product (exact, or rounded to odd by
  ``mul.rm``/``mul.rp``) is rounded by Veltkamp plus a constant-quantum fix below min normal
  (nearest-even) or by the generic ``round_to_format``.
* overflow, Inf and NaN: the fast loop ignores them and tracks ``m = max(|x|)`` over every
  pre-rounding sum (NaN-propagating max).  Any overflow needs some |x| >= 2**emax (a product past
  the acc range lifts the next sum past 2**emax); if a tile saw one, or ends non-finite, the
  program recomputes that tile with the generic loop (``round_to_format``, every special case),
  so the result is the model's in every case.  Zeros leave the fast loop as +0 (the model's sums
  never produce -0 for these formats; see the proof in reference_emulate.py).

``chunk`` mode runs ``tl.dot`` (tensor cores) over the K-chunk in BLOCK_K steps into a fresh fp32
partial sum, and rounds the running sum once per chunk: ``s = R(RO(s + p))`` with the round-to-odd
sum from ``add.rm``/``add.rp`` (the odd one of the two).  R is the hardware ``cvt.rn`` when the acc
format *is* fp16 or bf16 and the mode is nearest (s is then held in that type: half the registers),
else the fast nearest-even rounding with its subnormal fix-up (other modes: the generic rounding).
Cost model per accumulator element and chunk: the MMA work is 2C flops at ~4096 flops/clock/SM
(dense bf16), C/2048 SM-clocks; the rounding is ~7 SASS instructions (FADD.RM, LOP3, @P FADD.RP,
F2FP, HADD2.F32, moves) at 128 lanes/clock, 7/128 SM-clocks: rounding/MMA = 112/C (3.5 at C = 32,
0.44 at C = 256) unless another CTA's MMAs overlap it, which bounds small chunks.
Overflow: without cvt, a sum at or past 2**(emax-1) poisons s with NaN (no per-element max tile);
with cvt, Inf/NaN arise by themselves.  A tile that ends non-finite sets a flag, and a second launch
recomputes just the flagged tiles with the generic update (a separate kernel: the generic rounding's
~220 registers would otherwise cap the fast loop's occupancy).

Kahan negations are sign-bit flips (round.neg), as in the all-reduce kernels: Triton up to 3.6
compiles a float ``-x`` as ``0 - x`` (+0 for x = +0).  Directed float32 operations are inline PTX (``add.rm.f32`` ...), not libdevice: Triton links
libdevice with __CUDA_FTZ=1, so ``__nv_fadd_rd`` compiles to FADD.FTZ.RM and flushes float32
subnormals (bf16 accumulators reach them) to zero.

Under ``TRITON_INTERPRET=1`` (CPU tests) the directed float32 adds/multiplies (inline PTX) are not
available (``HW=False``): the kernels use the TwoSum / float64 round-to-odd forms instead, which
give the same R(.) by the round-to-odd theorem.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import triton
import triton.language as tl

from ...formats import FloatFormat
from ..tile_tables import int_in, load_table, pos_int, record
from ._host import cdiv
from ...enums import Rounding
from .round import (
    MODES,
    ROUND_DOWN,
    ROUND_NEAREST,
    ROUND_NEAREST_AWAY,
    ROUND_TOWARD_ZERO,
    ROUND_UP,
    add_round_to_odd,
    mul_round_to_odd,
    neg,
    round_constexprs,
    round_to_format,
)


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _dir_add(a, b, RND: tl.constexpr):
    """a + b in float32 rounded in direction RND ("rm", "rp", "rz"), subnormals kept.  Inline PTX,
    not libdevice: Triton links libdevice with __CUDA_FTZ=1, and its __nv_fadd_rd compiles to
    FADD.FTZ.RM, which flushes subnormal operands and results to zero."""
    return tl.inline_asm_elementwise(f"add.{RND}.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _dir_mul(a, b, RND: tl.constexpr):
    """a * b in float32 rounded in direction RND, subnormals kept (see _dir_add)."""
    return tl.inline_asm_elementwise(f"mul.{RND}.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _ro_add(a, b, HW: tl.constexpr):
    """a + b rounded to odd in float32.  HW: the odd one of add.rm / add.rp (equal when exact)."""
    if HW:
        lo = _dir_add(a, b, "rm")
        hi = _dir_add(a, b, "rp")
        return tl.where((lo.to(tl.int32, bitcast=True) & 1) != 0, lo, hi)
    else:
        return add_round_to_odd(a, b)


@triton.jit
def _ro_mul(a, b, HW: tl.constexpr):
    """a * b rounded to odd in float32 (HW: mul.rm / mul.rp pair; else the float64 product)."""
    if HW:
        lo = _dir_mul(a, b, "rm")
        hi = _dir_mul(a, b, "rp")
        return tl.where((lo.to(tl.int32, bitcast=True) & 1) != 0, lo, hi)
    else:
        return mul_round_to_odd(a, b, False)


@triton.jit
def _sum_fast(a, b, MODE: tl.constexpr, SUM_RN: tl.constexpr, HW: tl.constexpr):
    """A float32 value x with R(x) == R(a + b) for acc-grid values a, b (see the module doc)."""
    if MODE == ROUND_NEAREST or MODE == ROUND_NEAREST_AWAY:
        if SUM_RN:
            x = a + b
        else:
            x = _ro_add(a, b, HW)
    elif HW:
        if MODE == ROUND_TOWARD_ZERO:
            x = _dir_add(a, b, "rz")
        elif MODE == ROUND_UP:
            x = _dir_add(a, b, "rp")
        else:
            x = _dir_add(a, b, "rm")
    else:
        x = add_round_to_odd(a, b)
    return x


@triton.jit
def _round_fast(x, MODE: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr):
    """R(x) on the normal range of the acc format (no specials, no subnormal fix-up)."""
    if MODE == ROUND_NEAREST:  # Veltkamp: nearest, ties to even, at bit S
        c = x * VELT
        r = c - (c - x)
    else:
        bits = x.to(tl.int32, bitcast=True)
        if MODE == ROUND_NEAREST_AWAY:
            bits = bits + (1 << (S - 1))
        elif MODE == ROUND_UP:  # up: magnitude up for positive values
            bits = bits + (~(bits >> 31) & ((1 << S) - 1))
        elif MODE == ROUND_DOWN:  # down: magnitude up for negative values
            bits = bits + ((bits >> 31) & ((1 << S) - 1))
        r = (bits & -(1 << S)).to(tl.float32, bitcast=True)
    return r


@triton.jit
def _round_any(x, MODE: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr, M_LOW: tl.constexpr,
               MIN_NORMAL: tl.constexpr,
               MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
               MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
               HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr):
    """R(x) for any finite x below the tracked limit: nearest-even by Veltkamp plus the constant-
    quantum rounding below min normal ((x + M) - M, M = 1.5 * 2**(qe_low + 23)); other modes
    through the generic rounding."""
    if MODE == ROUND_NEAREST:
        c = x * VELT
        r = c - (c - x)
        low = (x + M_LOW) - M_LOW  # a zero result keeps x's sign, like the reference cast:
        low = (low.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
        r = tl.where(tl.abs(x) < MIN_NORMAL, low, r)
    else:
        r = round_to_format(x, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED,
                            HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
    return r


@triton.jit
def _acc_update(s, c, p,
                MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
                MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
                HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
                MODE: tl.constexpr, KAHAN: tl.constexpr):
    """Generic s <- R(s + p) (KAHAN: the compensated update, every operation rounded); (s, c)."""
    if KAHAN:
        y = round_to_format(add_round_to_odd(p, neg(c)), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        t = round_to_format(add_round_to_odd(s, y), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        d = round_to_format(add_round_to_odd(t, neg(s)), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        c = round_to_format(add_round_to_odd(d, neg(y)), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        s = t
    else:
        s = round_to_format(add_round_to_odd(s, p), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
    return s, c


@triton.jit
def _acc_update_fast(s, c, m, p, MODE: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr,
                     SUM_RN: tl.constexpr, HW: tl.constexpr, KAHAN: tl.constexpr):
    """Fast s <- R(s + p) for acc-grid s, p, c; m tracks max |x| of the sums that could overflow."""
    if KAHAN:
        x1 = _sum_fast(p, neg(c), MODE, SUM_RN, HW)
        y = _round_fast(x1, MODE, S, VELT)
        x2 = _sum_fast(s, y, MODE, SUM_RN, HW)
        t = _round_fast(x2, MODE, S, VELT)
        d = _round_fast(_sum_fast(t, neg(s), MODE, SUM_RN, HW), MODE, S, VELT)
        c = _round_fast(_sum_fast(d, neg(y), MODE, SUM_RN, HW), MODE, S, VELT)
        m = tl.maximum(m, tl.abs(x1), propagate_nan=tl.PropagateNan.ALL)
        m = tl.maximum(m, tl.abs(x2), propagate_nan=tl.PropagateNan.ALL)
        s = t
    else:
        x = _sum_fast(s, p, MODE, SUM_RN, HW)
        m = tl.maximum(m, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        s = _round_fast(x, MODE, S, VELT)
    return s, c, m


@triton.jit
def _fma_slow_loop(a_ptrs, b_ptrs, stride_ak, stride_bk, mask_m, mask_n, K,
                   MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
                   MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
                   HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
                   MODE: tl.constexpr, KAHAN: tl.constexpr, PROD: tl.constexpr, HW: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The generic loop: every rounding through round_to_format, every special case handled."""
    s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    c = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K):
        a_k = tl.load(a_ptrs + k * stride_ak, mask=mask_m, other=0.0)
        b_k = tl.load(b_ptrs + k * stride_bk, mask=mask_n, other=0.0)
        if PROD == 2:
            p = _ro_mul(a_k[:, None], b_k[None, :], HW)
        else:
            p = a_k[:, None] * b_k[None, :]
        p = round_to_format(p, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        s, c = _acc_update(s, c, p, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                           OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE, KAHAN)
    return s


@triton.jit
def _fma_gemm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    # -- the accumulator format (FloatFormat), folded at compile time --
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
    HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
    # -- the fast path (see the module doc) --
    FAST: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr, M_LOW: tl.constexpr, MIN_NORMAL: tl.constexpr,
    LIM: tl.constexpr, SUM_RN: tl.constexpr, HW: tl.constexpr,
    # -- what to do --
    MODE: tl.constexpr, KAHAN: tl.constexpr, PROD: tl.constexpr,  # PROD: 0 exact on the acc grid, 1 exact, 2 fp32
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m * stride_am  # (BLOCK_M,) column k of the A tile
    b_ptrs = b_ptr + offs_n * stride_bn  # (BLOCK_N,) row k of the B tile
    if FAST:
        s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        c = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        m = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k in range(0, K):
            a_k = tl.load(a_ptrs + k * stride_ak, mask=mask_m, other=0.0)
            b_k = tl.load(b_ptrs + k * stride_bk, mask=mask_n, other=0.0)
            # ---- product, rounded once to the accumulator format ----
            if PROD == 0:  # exact and on the acc grid: nothing to round
                p = a_k[:, None] * b_k[None, :]
            else:
                if PROD == 1:
                    p = a_k[:, None] * b_k[None, :]
                else:
                    p = _ro_mul(a_k[:, None], b_k[None, :], HW)
                p = _round_any(p, MODE, S, VELT, M_LOW, MIN_NORMAL, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS,
                               MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE)
            # ---- accumulate, rounded once; m tracks what could overflow ----
            s, c, m = _acc_update_fast(s, c, m, p, MODE, S, VELT, SUM_RN, HW, KAHAN)
        bad = ~(m < LIM) | ~(tl.abs(s) < float("inf")) | ~(tl.abs(c) < float("inf"))
        s = tl.where(s == 0.0, 0.0, s)  # the model's zeros are +0 (module doc)
        if tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0:  # rare: the tile overflowed, redo it exactly
            s = _fma_slow_loop(a_ptrs, b_ptrs, stride_ak, stride_bk, mask_m, mask_n, K, MAN, BIAS, MIN_NORMAL_BITS,
                               QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE,
                               MODE, KAHAN, PROD, HW, BLOCK_M, BLOCK_N)
    else:
        s = _fma_slow_loop(a_ptrs, b_ptrs, stride_ak, stride_bk, mask_m, mask_n, K, MAN, BIAS, MIN_NORMAL_BITS,
                           QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE,
                           MODE, KAHAN, PROD, HW, BLOCK_M, BLOCK_N)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, s, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _round_cvt(x, HWCVT: tl.constexpr):
    """R(x) to nearest-even by the hardware conversion (cvt.rn: F2FP + HADD2.F32 back) when the acc
    format *is* IEEE fp16 (HWCVT 1) or bfloat16 (HWCVT 2): subnormals, overflow to Inf and NaN
    exactly as the model.  (Packing two values per cvt through inline asm cost more in shuffles.)"""
    if HWCVT == 1:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _narrow(x, HWCVT: tl.constexpr):
    """x rounded to nearest-even into the acc type (cvt.rn), kept in that type."""
    if HWCVT == 1:
        return x.to(tl.float16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _chunk_round(x, HWCVT: tl.constexpr, MODE: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr,
                 M_LOW: tl.constexpr, MIN_NORMAL: tl.constexpr, LIM: tl.constexpr,
                 MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
                 MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
                 HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr):
    """R(x) of a round-to-odd sum in the fast chunk update.  Without HWCVT, x at or past LIM (where
    the fast rounding stops being exact) or NaN gives NaN: the poison survives every later update
    (each re-checks its own sum), so a non-finite tile at the end sends it to the generic loop.  With
    HWCVT the conversion itself is exact everywhere and Inf/NaN reach the end check on their own."""
    if HWCVT != 0:
        r = _round_cvt(x, HWCVT)
    else:
        r = _round_any(x, MODE, S, VELT, M_LOW, MIN_NORMAL, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS,
                       MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE)
        r = tl.where(tl.abs(x) < LIM, r, float("nan"))
    return r


@triton.jit
def _chunk_update(s, c, p, FASTUPD: tl.constexpr, HWCVT: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr,
                  M_LOW: tl.constexpr, MIN_NORMAL: tl.constexpr, LIM: tl.constexpr, HW: tl.constexpr,
                  MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
                  MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
                  HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
                  MODE: tl.constexpr, KAHAN: tl.constexpr):
    """s <- R(s + p) once per chunk (p: the chunk's fp32 partial sum, any value).  With FASTUPD and
    HWCVT, s and c are held in the acc type itself (fp16/bf16: half the registers of float32)."""
    if FASTUPD and HWCVT != 0:
        sf = s.to(tl.float32)
        if KAHAN:
            y = _round_cvt(_ro_add(p, neg(c.to(tl.float32)), HW), HWCVT)
            t = _round_cvt(_ro_add(sf, y, HW), HWCVT)
            d = _round_cvt(_ro_add(t, neg(sf), HW), HWCVT)
            c = _narrow(_ro_add(d, neg(y), HW), HWCVT)
            s = _narrow(t, HWCVT)
        else:
            s = _narrow(_ro_add(sf, p, HW), HWCVT)
    elif FASTUPD:
        if KAHAN:
            y = _chunk_round(_ro_add(p, neg(c), HW), HWCVT, MODE, S, VELT, M_LOW, MIN_NORMAL, LIM, MAN, BIAS,
                             MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO,
                             SUBNORMALS, LOW_BASE)
            t = _chunk_round(_ro_add(s, y, HW), HWCVT, MODE, S, VELT, M_LOW, MIN_NORMAL, LIM, MAN, BIAS,
                             MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO,
                             SUBNORMALS, LOW_BASE)
            d = _chunk_round(_ro_add(t, neg(s), HW), HWCVT, MODE, S, VELT, M_LOW, MIN_NORMAL, LIM, MAN, BIAS,
                             MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO,
                             SUBNORMALS, LOW_BASE)
            c = _chunk_round(_ro_add(d, neg(y), HW), HWCVT, MODE, S, VELT, M_LOW, MIN_NORMAL, LIM, MAN, BIAS,
                             MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO,
                             SUBNORMALS, LOW_BASE)
            s = t
        else:
            s = _chunk_round(_ro_add(s, p, HW), HWCVT, MODE, S, VELT, M_LOW, MIN_NORMAL, LIM, MAN, BIAS,
                             MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO,
                             SUBNORMALS, LOW_BASE)
    else:
        s, c = _acc_update(s, c, p, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                           OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE, KAHAN)
    return s, c


@triton.jit
def _chunk_loop(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                FASTUPD: tl.constexpr, HWCVT: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr,
                M_LOW: tl.constexpr, MIN_NORMAL: tl.constexpr, LIM: tl.constexpr, HW: tl.constexpr,
                MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
                MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
                HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
                MODE: tl.constexpr, KAHAN: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
                IEEE_DOT: tl.constexpr):
    """One flat loop over K in BLOCK_K steps (software-pipelined); the fp32 partial sum p collects
    CHUNK / BLOCK_K dots and the running sum is rounded when a chunk (or K) ends."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # (BLOCK_M, BLOCK_K)
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (BLOCK_K, BLOCK_N)
    if FASTUPD and HWCVT == 1:  # the running sum (and Kahan term) in the acc type itself
        s = tl.zeros((BLOCK_M, BLOCK_N), tl.float16)
        c = tl.zeros((BLOCK_M, BLOCK_N), tl.float16)
    elif FASTUPD and HWCVT == 2:
        s = tl.zeros((BLOCK_M, BLOCK_N), tl.bfloat16)
        c = tl.zeros((BLOCK_M, BLOCK_N), tl.bfloat16)
    else:
        s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        c = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & (offs_n[None, :] < N), other=0.0)
        if IEEE_DOT:  # float32 operands that do not fit a 16-bit type: no TF32 shortcut
            p = tl.dot(a, b, p, input_precision="ieee")
        else:  # fp16 / bf16 operands (exact copies of the values): tensor cores, fp32 accumulate
            p = tl.dot(a, b, p)
        if CHUNK == BLOCK_K:  # every step ends a chunk: no branch in the loop
            s, c = _chunk_update(s, c, p, FASTUPD, HWCVT, S, VELT, M_LOW, MIN_NORMAL, LIM, HW, MAN, BIAS,
                                 MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO,
                                 SUBNORMALS, LOW_BASE, MODE, KAHAN)
            p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        elif ((k0 + BLOCK_K) % CHUNK == 0) | (k0 + BLOCK_K >= K):
            s, c = _chunk_update(s, c, p, FASTUPD, HWCVT, S, VELT, M_LOW, MIN_NORMAL, LIM, HW, MAN, BIAS,
                                 MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO,
                                 SUBNORMALS, LOW_BASE, MODE, KAHAN)
            p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return s.to(tl.float32), c.to(tl.float32)


@triton.jit
def _chunk_gemm_kernel(
    a_ptr, b_ptr, c_ptr, flag_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
    HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
    S: tl.constexpr, VELT: tl.constexpr, M_LOW: tl.constexpr, MIN_NORMAL: tl.constexpr,
    LIM: tl.constexpr, SUM_RN: tl.constexpr, HW: tl.constexpr, HWCVT: tl.constexpr,
    MODE: tl.constexpr, KAHAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE_DOT: tl.constexpr, ROLE: tl.constexpr,
):
    """ROLE 0: the fast update; a tile that ends non-finite (poisoned or overflowed) sets its flag.
    ROLE 1: a second launch that recomputes only the flagged tiles with the generic update (a
    separate kernel, so the generic rounding's registers do not cap the fast loop's occupancy).
    ROLE 2: the generic update for every tile."""
    # grouped tile order: GROUP_M row-tiles share their B columns in L2
    pid = tl.program_id(0)
    if ROLE == 1:
        if tl.load(flag_ptr + pid) == 0:
            return
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s, c = _chunk_loop(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                       ROLE == 0, HWCVT, S, VELT, M_LOW, MIN_NORMAL, LIM, HW, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW,
                       MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE, KAHAN,
                       BLOCK_M, BLOCK_N, BLOCK_K, CHUNK, IEEE_DOT)
    if ROLE == 0:
        bad = ~(tl.abs(s) < float("inf")) | ~(tl.abs(c) < float("inf"))
        tl.store(flag_ptr + pid, tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0))
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, s, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Wrappers: check, allocate, launch
# ----------------------------------------------------------------------------------------------


# acc formats that *are* a hardware type: the chunk update rounds to nearest by cvt.rn (CUDA only)
_HWCVT = {FloatFormat(5, 10): 1, FloatFormat(8, 7): 2}


def can_implement(acc_fmt, rounding: str, mode: str, chunk: int = 32) -> str | None:
    """None if the kernels run this configuration, else the reason they cannot."""
    if not isinstance(acc_fmt, FloatFormat):
        return f"the accumulator must be a FloatFormat, got {acc_fmt}"
    if acc_fmt.man > 21:
        return (f"acc_fmt {acc_fmt} has {acc_fmt.man} mantissa bits; exact rounding from a float32 rounded-to-odd "
                "sum needs <= 21 (the reference backend handles up to 23 through float64)")
    if rounding not in MODES:
        return f"rounding={rounding!r} inside the GEMM kernel is not implemented (deterministic modes: {tuple(MODES)})"
    if mode == "chunk" and (chunk < 16 or chunk & (chunk - 1)):
        return f"chunk mode on tensor cores needs chunk a power of two >= 16 (tl.dot), got chunk={chunk}"
    return None


def product_is_exact(a_fmt, b_fmt) -> bool:
    """True if every product of an a_fmt value and a b_fmt value is a float32 (one multiply suffices)."""
    if not (isinstance(a_fmt, FloatFormat) and isinstance(b_fmt, FloatFormat)):
        return False
    fits = a_fmt.precision + b_fmt.precision <= 24
    q = (a_fmt.emin - a_fmt.man if a_fmt.subnormals else a_fmt.emin) + \
        (b_fmt.emin - b_fmt.man if b_fmt.subnormals else b_fmt.emin)  # exponent of the finest product quantum
    return fits and q >= -149 and a_fmt.max * b_fmt.max < 3.4e38


def product_on_grid(a_fmt, b_fmt, acc_fmt) -> bool:
    """True if every product of an a_fmt and a b_fmt value is exact in float32 and, unless it
    overflows acc_fmt, already a value of acc_fmt (e.g. e4m3 x e4m3 into e5m10 or e8m7)."""
    if not (product_is_exact(a_fmt, b_fmt) and isinstance(acc_fmt, FloatFormat)):
        return False
    q = (a_fmt.emin - a_fmt.man if a_fmt.subnormals else a_fmt.emin) + \
        (b_fmt.emin - b_fmt.man if b_fmt.subnormals else b_fmt.emin)
    q_acc = acc_fmt.emin - acc_fmt.man if acc_fmt.subnormals else acc_fmt.emin
    return a_fmt.precision + b_fmt.precision <= acc_fmt.precision and q >= q_acc


def fast_constexprs(fmt: FloatFormat, hw: bool) -> dict:
    """Constexprs of the fast path (module doc).  FAST needs a signed format with zero, -0 and
    subnormals whose normal range sits inside float32's (every acc value an fp32 normal or an exact
    multiple of its quantum) and at least one mantissa bit."""
    qe_low = fmt.emin - fmt.man if fmt.subnormals else fmt.emin
    emax = math.frexp(fmt.max)[1] - 1  # floor(log2(max))
    fast = (fmt.signed and fmt.zero and fmt.has_negative_zero and fmt.subnormals and 1 <= fmt.man <= 21
            and fmt.min_normal >= 2.0**-126 and emax <= 127)
    s = 23 - fmt.man
    return dict(FAST=bool(fast), S=s, VELT=float(2.0**s + 1), M_LOW=float(1.5 * 2.0 ** min(qe_low + 23, 126)),
                MIN_NORMAL=float(fmt.min_normal), LIM=float(2.0 ** (emax - 1)), SUM_RN=fmt.man <= 10, HW=bool(hw))


# Default tiles as data: emulate_gemm_tiles.json (each value with what was measured to pick it; the chunk tiles from
# the H200 sweep of decision 0032, results/emulate_chunk_sweep.json), validated at import (decision 0033).
TILE_TABLE_PATH = Path(__file__).with_name("emulate_gemm_tiles.json")


def _tile4(v) -> str | None:
    ok = (isinstance(v, list) and len(v) == 4 and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
          and v[0] in (16, 32, 64, 128, 256) and v[1] in (16, 32, 64, 128, 256) and v[2] in (1, 2, 4, 8, 16)
          and 1 <= v[3] <= 8)
    return None if ok else ("[BLOCK_M, BLOCK_N, num_warps, num_stages] with BLOCK_M and BLOCK_N in 16..256 (powers of "
                            "two), num_warps a power of two <= 16, num_stages in 1..8")


_RULES = {
    "fma_tile": _tile4,
    "chunk_tile": _tile4,
    "chunk_big_tile": record(min_chunk=pos_int, tile=_tile4),
    "chunk_max_block_k": int_in((16, 32, 64, 128)),
}
_TABLE = load_table(TILE_TABLE_PATH, _RULES)
FMA_TILE = tuple(_TABLE["fma_tile"])


def chunk_tile(hwcvt: int, kahan: bool, chunk: int, fp32_operands: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, BLOCK_K) of chunk mode: with s held in fp16/bf16 (cvt), no Kahan and
    16-bit operands, the big tile from chunk_big_tile's chunk on (one CTA an SM does the MMAs); else the chunk tile
    (2-3 CTAs an SM: one CTA's rounding overlaps another's MMAs).  BLOCK_K: the chunk, capped."""
    big = _TABLE["chunk_big_tile"]
    use_big = hwcvt != 0 and not kahan and chunk >= big["min_chunk"] and not fp32_operands
    return (*(big["tile"] if use_big else _TABLE["chunk_tile"]), min(chunk, _TABLE["chunk_max_block_k"]))


def matmul(a: torch.Tensor, b: torch.Tensor, acc_fmt: FloatFormat, mode: str = "fma", chunk: int = 32,
           kahan: bool = False, rounding: str = "nearest", exact_product: bool = False,
           product_on_acc_grid: bool = False, block_m: int | None = None, block_n: int | None = None,
           block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
           fast: bool = True, hw_convert: bool = True, max_registers: int | None = None) -> torch.Tensor:
    """(M, K) @ (K, N) -> float32 (M, N); the op layer validates and explains.  fma mode takes float32
    operands; chunk mode takes float32, or float16/bfloat16 holding the values exactly (tensor cores).
    ``exact_product``: every a*b is exact in float32; ``product_on_acc_grid``: and a value of acc_fmt
    (see product_on_grid).  ``fast=False`` forces the generic loop and ``hw_convert=False`` the
    Veltkamp rounding instead of cvt.rn in chunk mode (for tests and comparisons).  ``max_registers``
    caps the fast chunk kernel's registers per thread (more CTAs per SM overlap one CTA's rounding
    with another's tensor-core work)."""
    why = can_implement(acc_fmt, rounding, mode, chunk)
    if why is not None:
        raise ValueError(why)
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    if M == 0 or N == 0:
        return c
    fc = fast_constexprs(acc_fmt, hw=a.is_cuda)
    fc["FAST"] = fc["FAST"] and fast
    common = dict(**round_constexprs(acc_fmt), **fc, MODE=Rounding(rounding).code, KAHAN=kahan)
    hwcvt = _HWCVT.get(acc_fmt, 0) if (fc["HW"] and rounding == "nearest" and hw_convert) else 0
    args = (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    if mode == "fma":
        bm, bn = block_m or FMA_TILE[0], block_n or FMA_TILE[1]
        prod = 0 if (product_on_acc_grid and exact_product) else 1 if exact_product else 2
        grid = (cdiv(M, bm), cdiv(N, bn))
        _fma_gemm_kernel[grid](*args, PROD=prod, BLOCK_M=bm, BLOCK_N=bn, **common,
                               num_warps=num_warps or FMA_TILE[2], num_stages=num_stages or FMA_TILE[3],
                               enable_fp_fusion=False)
    else:
        if mode != "chunk":
            raise ValueError(f"mode must be 'fma' or 'chunk', got {mode!r}")
        tbm, tbn, twarps, tstages, tbk = chunk_tile(hwcvt, kahan, chunk, a.dtype == torch.float32)
        bm, bn = block_m or tbm, block_n or tbn
        num_warps, num_stages = num_warps or twarps, num_stages or tstages
        bk = block_k or tbk
        if chunk % bk:
            raise ValueError(f"block_k={bk} must divide chunk={chunk}")
        grid = (cdiv(M, bm) * cdiv(N, bn),)
        flags = torch.empty(grid[0], dtype=torch.int32, device=a.device)
        launch = dict(HWCVT=hwcvt, CHUNK=chunk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                      IEEE_DOT=a.dtype == torch.float32, **common, num_warps=num_warps,
                      num_stages=num_stages, enable_fp_fusion=False)
        fast_tiles = launch.pop("FAST")  # picks the roles; the kernel itself only sees ROLE
        for role in ((0, 1) if fast_tiles else (2,)):  # 1: redo the flagged tiles (no host sync)
            cap = dict(maxnreg=max_registers) if (max_registers and role == 0) else {}
            _chunk_gemm_kernel[grid](a, b, c, flags, *args[3:], ROLE=role, **launch, **cap)
    return c
