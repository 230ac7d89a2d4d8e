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
sum from ``add.rm``/``add.rp`` and the fast nearest-even rounding with its subnormal fix-up (other
modes: the generic rounding), with the same overflow tracking and fallback.

Under ``TRITON_INTERPRET=1`` (CPU tests) the directed float32 adds/multiplies of libdevice are not
available (``HW=False``): the kernels use the TwoSum / float64 round-to-odd forms instead, which
give the same R(.) by the round-to-odd theorem.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...formats import FloatFormat
from .round import MODES, add_round_to_odd, mul_round_to_odd, round_constexprs, round_to_format


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _ro_add(a, b, HW: tl.constexpr):
    """a + b rounded to odd in float32.  HW: the odd one of add.rm / add.rp (equal when exact)."""
    if HW:
        lo = libdevice.add_rd(a, b)
        hi = libdevice.add_ru(a, b)
        return tl.where((lo.to(tl.int32, bitcast=True) & 1) != 0, lo, hi)
    else:
        return add_round_to_odd(a, b)


@triton.jit
def _ro_mul(a, b, HW: tl.constexpr):
    """a * b rounded to odd in float32 (HW: mul.rm / mul.rp pair; else the float64 product)."""
    if HW:
        lo = libdevice.mul_rd(a, b)
        hi = libdevice.mul_ru(a, b)
        return tl.where((lo.to(tl.int32, bitcast=True) & 1) != 0, lo, hi)
    else:
        return mul_round_to_odd(a, b, False)


@triton.jit
def _sum_fast(a, b, MODE: tl.constexpr, SUM_RN: tl.constexpr, HW: tl.constexpr):
    """A float32 value x with R(x) == R(a + b) for acc-grid values a, b (see the module doc)."""
    if MODE <= 1:
        if SUM_RN:
            x = a + b
        else:
            x = _ro_add(a, b, HW)
    elif HW:
        if MODE == 2:
            x = libdevice.add_rz(a, b)
        elif MODE == 3:
            x = libdevice.add_ru(a, b)
        else:
            x = libdevice.add_rd(a, b)
    else:
        x = add_round_to_odd(a, b)
    return x


@triton.jit
def _round_fast(x, MODE: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr):
    """R(x) on the normal range of the acc format (no specials, no subnormal fix-up)."""
    if MODE == 0:  # Veltkamp: nearest, ties to even, at bit S
        c = x * VELT
        r = c - (c - x)
    else:
        bits = x.to(tl.int32, bitcast=True)
        if MODE == 1:
            bits = bits + (1 << (S - 1))
        elif MODE == 3:  # up: magnitude up for positive values
            bits = bits + (~(bits >> 31) & ((1 << S) - 1))
        elif MODE == 4:  # down: magnitude up for negative values
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
    if MODE == 0:
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
        y = round_to_format(add_round_to_odd(p, -c), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        t = round_to_format(add_round_to_odd(s, y), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        d = round_to_format(add_round_to_odd(t, -s), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                            OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        c = round_to_format(add_round_to_odd(d, -y), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
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
        x1 = _sum_fast(p, -c, MODE, SUM_RN, HW)
        y = _round_fast(x1, MODE, S, VELT)
        x2 = _sum_fast(s, y, MODE, SUM_RN, HW)
        t = _round_fast(x2, MODE, S, VELT)
        d = _round_fast(_sum_fast(t, -s, MODE, SUM_RN, HW), MODE, S, VELT)
        c = _round_fast(_sum_fast(d, -y, MODE, SUM_RN, HW), MODE, S, VELT)
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
def _chunk_update(s, c, m, p, FASTUPD: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr, M_LOW: tl.constexpr,
                  MIN_NORMAL: tl.constexpr, HW: tl.constexpr,
                  MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
                  MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
                  HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
                  MODE: tl.constexpr, KAHAN: tl.constexpr):
    """s <- R(s + p) once per chunk (p: the chunk's fp32 partial sum, any value)."""
    if FASTUPD:
        if KAHAN:
            x1 = _ro_add(p, -c, HW)
            y = _round_any(x1, MODE, S, VELT, M_LOW, MIN_NORMAL, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS,
                           MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE)
            x2 = _ro_add(s, y, HW)
            t = _round_any(x2, MODE, S, VELT, M_LOW, MIN_NORMAL, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS,
                           MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE)
            d = _round_any(_ro_add(t, -s, HW), MODE, S, VELT, M_LOW, MIN_NORMAL, MAN, BIAS, MIN_NORMAL_BITS,
                           QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE)
            c = _round_any(_ro_add(d, -y, HW), MODE, S, VELT, M_LOW, MIN_NORMAL, MAN, BIAS, MIN_NORMAL_BITS,
                           QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE)
            m = tl.maximum(m, tl.abs(x1), propagate_nan=tl.PropagateNan.ALL)
            m = tl.maximum(m, tl.abs(x2), propagate_nan=tl.PropagateNan.ALL)
            s = t
        else:
            x = _ro_add(s, p, HW)
            m = tl.maximum(m, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
            s = _round_any(x, MODE, S, VELT, M_LOW, MIN_NORMAL, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS,
                           MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE)
    else:
        s, c = _acc_update(s, c, p, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                           OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE, KAHAN)
    return s, c, m


@triton.jit
def _chunk_loop(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                FASTUPD: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr, M_LOW: tl.constexpr,
                MIN_NORMAL: tl.constexpr, HW: tl.constexpr,
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
    s = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    c = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    m = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + offs_k) < K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & (offs_n[None, :] < N), other=0.0)
        if IEEE_DOT:  # float32 operands that do not fit a 16-bit type: no TF32 shortcut
            p = tl.dot(a, b, p, input_precision="ieee")
        else:  # fp16 / bf16 operands (exact copies of the values): tensor cores, fp32 accumulate
            p = tl.dot(a, b, p)
        if CHUNK == BLOCK_K:
            s, c, m = _chunk_update(s, c, m, p, FASTUPD, S, VELT, M_LOW, MIN_NORMAL, HW, MAN, BIAS,
                                    MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO,
                                    SUBNORMALS, LOW_BASE, MODE, KAHAN)
            p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        elif ((k0 + BLOCK_K) % CHUNK == 0) | (k0 + BLOCK_K >= K):
            s, c, m = _chunk_update(s, c, m, p, FASTUPD, S, VELT, M_LOW, MIN_NORMAL, HW, MAN, BIAS,
                                    MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO,
                                    SUBNORMALS, LOW_BASE, MODE, KAHAN)
            p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return s, c, m


@triton.jit
def _chunk_gemm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
    HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
    FAST: tl.constexpr, S: tl.constexpr, VELT: tl.constexpr, M_LOW: tl.constexpr, MIN_NORMAL: tl.constexpr,
    LIM: tl.constexpr, SUM_RN: tl.constexpr, HW: tl.constexpr,
    MODE: tl.constexpr, KAHAN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE_DOT: tl.constexpr,
):
    # grouped tile order: GROUP_M row-tiles share their B columns in L2
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s, c, m = _chunk_loop(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                          FAST, S, VELT, M_LOW, MIN_NORMAL, HW, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS,
                          MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE, KAHAN,
                          BLOCK_M, BLOCK_N, BLOCK_K, CHUNK, IEEE_DOT)
    if FAST:
        bad = ~(m < LIM) | ~(tl.abs(s) < float("inf")) | ~(tl.abs(c) < float("inf"))
        if tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0) > 0:  # rare: the tile overflowed, redo it exactly
            s, c, m = _chunk_loop(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                  False, S, VELT, M_LOW, MIN_NORMAL, HW, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS,
                                  MIN_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE, KAHAN,
                                  BLOCK_M, BLOCK_N, BLOCK_K, CHUNK, IEEE_DOT)
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, s, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# ----------------------------------------------------------------------------------------------
# Wrappers: check, allocate, launch
# ----------------------------------------------------------------------------------------------


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


def matmul(a: torch.Tensor, b: torch.Tensor, acc_fmt: FloatFormat, mode: str = "fma", chunk: int = 32,
           kahan: bool = False, rounding: str = "nearest", exact_product: bool = False,
           product_on_acc_grid: bool = False, block_m: int | None = None, block_n: int | None = None,
           block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
           fast: bool = True) -> torch.Tensor:
    """(M, K) @ (K, N) -> float32 (M, N); the op layer validates and explains.  fma mode takes float32
    operands; chunk mode takes float32, or float16/bfloat16 holding the values exactly (tensor cores).
    ``exact_product``: every a*b is exact in float32; ``product_on_acc_grid``: and a value of acc_fmt
    (see product_on_grid).  ``fast=False`` forces the generic loop (for tests and comparisons)."""
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
    common = dict(**round_constexprs(acc_fmt), **fc, MODE=MODES[rounding], KAHAN=kahan)
    args = (a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1))
    if mode == "fma":
        bm, bn = block_m or 64, block_n or 64
        prod = 0 if (product_on_acc_grid and exact_product) else 1 if exact_product else 2
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
        _fma_gemm_kernel[grid](*args, PROD=prod, BLOCK_M=bm, BLOCK_N=bn, **common,
                               num_warps=num_warps or 4, num_stages=num_stages or 1, enable_fp_fusion=False)
    else:
        if mode != "chunk":
            raise ValueError(f"mode must be 'fma' or 'chunk', got {mode!r}")
        bm, bn = block_m or 128, block_n or 128
        bk = block_k or min(chunk, 64)
        if chunk % bk:
            raise ValueError(f"block_k={bk} must divide chunk={chunk}")
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _chunk_gemm_kernel[grid](*args, CHUNK=chunk, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                 IEEE_DOT=a.dtype == torch.float32, **common,
                                 num_warps=num_warps or 8, num_stages=num_stages or 3, enable_fp_fusion=False)
    return c
