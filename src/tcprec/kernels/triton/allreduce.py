"""Fused kernels of the APS low-precision gradient all-reduce (the algorithm and its pure-torch
reference: distributed/lowp.py).  They compute the reference's bits with float32/float64 device
arithmetic instead of float64 tensors::

    amax       grads (n_local, numel) f32 -> state (T + 2,) int32: state[t] = max |g| of tensor t as
               f32 bits (relaxed atomic max; NaN/Inf bits sort above every finite value),
               state[T] = 1 if any gradient is not finite
    --- MAX all-reduce of state (the max of the bits is the bits of the max) ---
    encode     grads, state -> send (world, n_local, shard): q = R(g * 2**s), s = top - e_t with
               e_t = ceil(log2(amax_t * n)) computed exactly where it is needed (integer arithmetic),
               written in the collective's layout (codes, or float32 values for transport="emulate")
    then one of two exchanges (distributed/lowp.py picks the one that moves fewer bytes):
    * reduce-scatter: all_to_all (rank j gets shard j of every node) -> reduce: S = R(..R(R(q_0 +
      q_1) + q_2).. + q_{n-1}) node by node (Kahan optional) -> all_gather -> finish: S * 2**-s / n
    * all-gather: every rank gets every node's codes -> reduce_finish: the same sum over the whole
      vector, the wire round trip of S, and the mean, in one kernel
    The mean is float64 like the reference (float32 where that is exact), finite results clamped
    to the float32 range, all NaN if state[T] (a non-finite gradient somewhere); state[T + 1] = 1
    if a mean overflowed.

Why float32 is exact here (formats accepted by ``can_implement``: <= 16 bits, quantum >= 2**-147,
<= 21 mantissa bits):

* ``g * 2**s``: the exact product is formed in float64 (exact for any s the APS rule gives) and
  rounded to odd float32; rounding that to a format with >= 2 fewer significand bits than float32,
  and a quantum >= 4x float32's smallest subnormal, equals rounding the exact product (Boldo and
  Melquiond's round-to-odd theorem, as in kernels/reference_emulate.py).  When a whole block shares
  one tensor with 0 <= s <= 127, one float32 multiply is exact (scaling up, result <= 2**top / n).
* ``q_a + q_b``: TwoSum + round to odd in float32 (round.add_round_to_odd), then R; a float32
  overflow of two finite values (exact |sum| > float32 max > fmt max) is replaced by +-float32
  max, which every rounding mode sends where it sends the exact sum.
* codes: the value -> code step mirrors cast._float_round_kernel's code block; a value that would
  be NaN in a format without NaN is +Inf (value) and the code of +Inf, rounded to nearest (the
  reference's ``nan_to_num`` then ``encode``).
* hardware conversions (CUDA only; Triton's interpreter truncates float32 -> fp8): OCP e4m3fn and
  IEEE e5m2 with APS, round to nearest, no Kahan: R is ``cvt.rn.satfinite`` to fp8 (APS keeps every
  |value| <= 2**top / n, far below the format's max, so saturation never acts).  Decoding e4m3fn,
  e5m2, fp16 and bf16 codes is a bit cast (exact anywhere); other formats decode by a table.

Segment (tensor) lookup: a per-layout table (``Layout``, made once per shape) gives the tensors of
each block's first and last element; a block inside one tensor uses that tensor's shift as a
scalar, only blocks that straddle tensors binary-search per element.  (A per-block binary search
was a chain of dependent loads in every block: latency, not bytes.)

Negation is a sign-bit flip (``_neg`` = round.neg), never the unary minus: Triton up to 3.6 compiles a float
``-x`` as ``0 - x``, which gives +0 for x = +0 and changed the sign of zero sums under Kahan.

Launch cost: ``fn[grid](...)`` re-binds ~30 arguments and rebuilds the specialization key on every
call (~0.1 ms of host time per launch on the H200 host, more than these kernels run); ``_Launcher``
compiles each specialization once through Triton and launches the compiled kernel directly after.
"""

from __future__ import annotations

import itertools
import logging
import math

import torch
import triton
import triton.language as tl

from ...enums import Rounding
from ...formats import FloatFormat
from ._host import cdiv
from .cast import _finish_value, _finite_code, _float_constexprs, _round_float, round_to_format
from .round import MODES, add_round_to_odd
from .round import neg as _neg

__all__ = ["can_implement", "layout", "Layout", "state_buffer", "amax", "encode", "reduce", "finish",
           "reduce_finish", "ring_step", "halving_step", "BLOCK"]

log = logging.getLogger("tcprec.kernels")

BLOCK = 2048  # elements per program (read at launch time: tests shrink it to cover block boundaries)
NUM_WARPS = 8
_FMAX = tl.constexpr(3.4028234663852886e38)  # float32 max
_FMAX_BITS = tl.constexpr(0x7F7FFFFF)

# decode by bit cast: 1 e4m3fn, 2 e5m2, 3 fp16, 4 bf16 (0: through the 2**bits-entry table)
_BITCAST_FORMATS = {FloatFormat(4, 3, specials="fn"): 1, FloatFormat(5, 2): 2, FloatFormat(5, 10): 3,
                    FloatFormat(8, 7): 4}


def can_implement(fmt, rounding: str) -> str | None:
    """None if the fused kernels compute this all-reduce exactly, else the reason they cannot."""
    if not isinstance(fmt, FloatFormat):
        return f"the all-reduce format must be a FloatFormat, got {fmt}"
    if rounding not in MODES:
        return (f"rounding={rounding!r} is not implemented in the fused all-reduce (deterministic modes: "
                f"{tuple(MODES)}); the reference draws its random bits in a layout these kernels do not share")
    if fmt.bits > 16:
        return (f"{fmt} has {fmt.bits} bits; the fused kernels send codes of up to 16 bits (uint8 / int16) and "
                "decode them through a 2**bits-entry table")
    if fmt.max > _FMAX.value:
        return f"{fmt} reaches past float32's range (max {fmt.max:.4g}): its values are not float32 values"
    quantum = 2.0 ** (fmt.emin - fmt.man if fmt.subnormals else fmt.emin)
    if quantum < 2.0**-147:
        return (f"{fmt}'s smallest quantum 2**{math.log2(quantum):.0f} is below 2**-147: float32 round-to-odd "
                "cannot round into it exactly")
    if fmt.man > 21:
        return f"{fmt} has {fmt.man} mantissa bits; exact rounding from a float32 round-to-odd value needs <= 21"
    return None


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _seg_in_block(offs, starts_ptr, seg_lo, seg_hi):
    """The tensor of each flat index ``offs`` of a block whose first and last elements lie in
    tensors seg_lo and seg_hi: the largest t with starts[t] <= index, counted over the block's few
    tensor starts (starts is non-decreasing; a loop, not an unrolled search: few registers)."""
    seg = tl.zeros(offs.shape, tl.int32) + seg_lo
    for t in range(seg_lo + 1, seg_hi + 1):
        seg += (offs >= tl.load(starts_ptr + t)).to(tl.int32)
    return seg


@triton.jit
def _shift_of(a, n, TOP: tl.constexpr):
    """APS shift of a tensor from its (all-reduced) max |g| as float32 bits ``a`` (int32 >= 0):
    TOP - e with e = ceil(log2(amax * n)) exactly (integer arithmetic); 0 for an all-zero tensor
    (and for a non-finite one, whose mean is all NaN anyway).  int64."""
    ex = a >> 23
    sig = tl.where(ex == 0, a & 0x7FFFFF, (a & 0x7FFFFF) | 0x800000)  # amax = sig * 2**(max(ex,1) - 150)
    prod = sig.to(tl.float64) * n  # exact: < 2**24 * 2**29
    pb = prod.to(tl.int64, bitcast=True)
    ceil_log2 = (pb >> 52) - 1023 + ((pb & 0xFFFFFFFFFFFFF) != 0).to(tl.int64)  # of the integer sig * n
    e = ceil_log2 + (tl.maximum(ex, 1) - 150).to(tl.int64)
    return tl.where((a == 0) | (a >= 0x7F800000), 0, TOP - e)


@triton.jit
def _pow2_f64(s):
    """2**s as float64, exact for -1022 <= s <= 1023 (built from the exponent field)."""
    return ((s.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _scale_round_to_odd(g, s):
    """g * 2**s (float32 g, any APS shift s) rounded to odd float32: the float64 product is exact."""
    p64 = g.to(tl.float64) * _pow2_f64(s)
    p = p64.to(tl.float32)
    pb = p.to(tl.int32, bitcast=True)
    d = p64 - p.to(tl.float64)
    fix = (d != 0.0) & ((pb & 1) == 0)
    step = tl.where((d < 0.0) == (pb < 0), 1, -1)
    return tl.where(fix, pb + step, pb).to(tl.float32, bitcast=True)


@triton.jit
def _add_rto(a, b):
    """a + b rounded to odd in float32; a float32 overflow of two finite values becomes +-max."""
    s = add_round_to_odd(a, b)
    ovf = (tl.abs(s) == float("inf")) & (tl.abs(a) < float("inf")) & (tl.abs(b) < float("inf"))
    big = tl.full(s.shape, _FMAX_BITS, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(ovf, tl.where(s < 0.0, -big, big), s)


@triton.jit
def _round_value_code(
    x, WANT_CODE: tl.constexpr, MODE: tl.constexpr,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, SPECIALS: tl.constexpr, OVERFLOW: tl.constexpr,
    SIGNED: tl.constexpr, HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr,
    CODE_MAX: tl.constexpr, CODE_MIN: tl.constexpr, CODE_INF: tl.constexpr, CODE_NAN: tl.constexpr,
    SIGN_BIT: tl.constexpr, LOW_BASE: tl.constexpr,
):
    """R(x) as what goes on the wire: the float32 value (NaN -> +Inf for a format without NaN) and,
    if WANT_CODE, its code (the code the reference's ``encode`` gives that value)."""
    bits, a, neg, mag, kept_low, below, to_max, to_over, to_nan, to_min, keep_sign = _round_float(
        x, 0, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS,
        LOW_BASE, MODE)
    y = _finish_value(bits, a, mag, to_max, to_over, to_nan, to_min, keep_sign, MAX_BITS, MIN_BITS, SIGNED, ZERO)
    if CODE_NAN < 0:
        y = tl.where(to_nan, float("inf"), y)
    if WANT_CODE:
        # as in cast._float_round_kernel; the value is a positive NaN (or, without NaN, +Inf, whose
        # nearest code in a format without Inf is the largest finite one: overflow must saturate)
        code = _finite_code(mag, kept_low, below, to_max, to_over, to_min, keep_sign, MAN, BIAS, SPECIALS,
                            OVERFLOW, SIGNED, ZERO, SUBNORMALS, CODE_MAX, CODE_MIN, CODE_INF, SIGN_BIT, LOW_BASE)
        if CODE_NAN < 0:
            code = tl.where(to_nan, CODE_MAX, code)
        else:
            code = tl.where(to_nan, CODE_NAN, code)
    else:
        code = 0
    return y, code


@triton.jit
def _round_hw(x, HW: tl.constexpr):
    """R(x) to nearest by the hardware conversion (1: e4m3fn, 2: e5m2): (float32 value, code)."""
    if HW == 1:
        q = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        q = x.to(tl.float8e5, fp_downcast_rounding="rtne")
    return q.to(tl.float32), q.to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def _decode(c, mask, lut_ptr, N_CODES: tl.constexpr, DEC: tl.constexpr):
    """Codes (int32, bit patterns) -> float32 values: a bit cast (DEC 1..4) or the table."""
    c = c & (N_CODES - 1)
    if DEC == 1:  # (NaN spelled out: Triton's interpreter decodes 0x7F as 480)
        v = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return tl.where((c & 0x7F) == 0x7F, float("nan"), v)
    elif DEC == 2:  # e5m2 is the top byte of fp16
        return (c << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    elif DEC == 3:
        return c.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    elif DEC == 4:
        return (c << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(lut_ptr + c, mask=mask, other=0.0)


@triton.jit
def _load_values(ptrs, mask, lut_ptr, CODES: tl.constexpr, N_CODES: tl.constexpr, DEC: tl.constexpr):
    """float32 values off the wire: codes decoded, or float32 as they are."""
    if CODES:
        return _decode(tl.load(ptrs, mask=mask, other=0).to(tl.int32), mask, lut_ptr, N_CODES, DEC)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _sum_rows(
    ptrs, stride, n, m, lut_ptr,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
    HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
    CODE_NAN: tl.constexpr,
    MODE: tl.constexpr, KAHAN: tl.constexpr, CODES: tl.constexpr, N_CODES: tl.constexpr, DEC: tl.constexpr,
    HW: tl.constexpr, BLOCK: tl.constexpr,
):
    """The n rows at ptrs, ptrs + stride, ... summed in row (node) order, every add rounded to fmt;
    a NaN sum of a format without NaN is +Inf (as the reference sends it)."""
    s = _load_values(ptrs, m, lut_ptr, CODES, N_CODES, DEC)
    c = tl.zeros([BLOCK], tl.float32)
    for i in range(1, n):
        ptrs += stride  # 64-bit pointer arithmetic
        q = _load_values(ptrs, m, lut_ptr, CODES, N_CODES, DEC)
        if KAHAN:  # y = R(q - c); t = R(s + y); c = R(R(t - s) - y); s = t
            yk = round_to_format(_add_rto(q, _neg(c)), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW,
                                 SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
            t = round_to_format(_add_rto(s, yk), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW,
                                SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
            ts = round_to_format(_add_rto(t, _neg(s)), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW,
                                 SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
            c = round_to_format(_add_rto(ts, _neg(yk)), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW,
                                SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
            s = t
        elif HW != 0:  # a round-to-odd sum, then the hardware's round to nearest (module doc)
            s, _ = _round_hw(_add_rto(s, q), HW)
        else:
            s = round_to_format(_add_rto(s, q), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW,
                                SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
    if CODE_NAN < 0:
        s = tl.where(s != s, float("inf"), s)
    return s


@triton.jit
def _mean_f64(total, s, inv_n, n, N_POW2: tl.constexpr):
    """total * 2**-s / n in float64 (one rounding, as the reference), finite results clamped."""
    t = total.to(tl.float64) * _pow2_f64(-s)
    if N_POW2:
        mean = t * inv_n
    else:
        mean = t / n  # float64 division is div.rn.f64 on NVIDIA GPUs (there is no approximate one)
    fin = tl.abs(mean) < float("inf")
    mean = tl.where(fin, tl.minimum(tl.maximum(mean, -_FMAX), _FMAX), mean)
    return mean.to(tl.float32)


@triton.jit
def _mean_f32(total, k):
    """total * 2**k for -126 <= k <= 127 in float32: the exact product rounded once, as the
    float64 route gives; a finite total that overflows is clamped like there."""
    y = total * ((k.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    big = tl.full(y.shape, _FMAX_BITS, tl.int32).to(tl.float32, bitcast=True)
    ovf = (tl.abs(y) == float("inf")) & (tl.abs(total) < float("inf"))
    return tl.where(ovf, tl.where(y < 0.0, -big, big), y)


@triton.jit
def _mean_store(
    total, offs, inb, out_ptr, state_ptr, starts_ptr, seg_lo, seg_hi, T, inv_n, n,
    APS: tl.constexpr, TOP: tl.constexpr, N_POW2: tl.constexpr, LOG2N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[offs] = total * 2**-s / n (all NaN after a non-finite input); state[T + 1] = 1 if a mean
    is not finite.  [seg_lo, seg_hi]: the tensors of the block's first and last element."""
    if APS:
        if seg_lo == seg_hi:
            s_blk = _shift_of(tl.load(state_ptr + seg_lo), n, TOP)
            k = -s_blk - LOG2N
            if N_POW2:
                if (k >= -126) & (k <= 127):
                    y = _mean_f32(total, k)
                else:
                    y = _mean_f64(total, s_blk, inv_n, n, N_POW2)
            else:
                y = _mean_f64(total, s_blk, inv_n, n, N_POW2)
        else:  # the block straddles tensors: look each element's up
            seg = _seg_in_block(offs, starts_ptr, seg_lo, seg_hi)
            s_vec = _shift_of(tl.load(state_ptr + seg, mask=inb, other=0), n, TOP)
            y = _mean_f64(total, s_vec, inv_n, n, N_POW2)
    elif N_POW2:
        y = _mean_f32(total, tl.zeros([BLOCK], tl.int32) - LOG2N)
    else:
        y = _mean_f64(total, tl.zeros([BLOCK], tl.int64), inv_n, n, N_POW2)
    bad = tl.load(state_ptr + T)
    if bad != 0:  # a non-finite gradient somewhere: the mean is all NaN (the step is skipped)
        y = tl.full([BLOCK], float("nan"), tl.float32)
    else:  # only lanes holding an overflow write the flag (no block-wide reduction)
        nonfin = inb & ~(tl.abs(y) < float("inf"))
        tl.atomic_max(state_ptr + (T + 1) + tl.zeros([BLOCK], tl.int32), 1, mask=nonfin, sem="relaxed")
    tl.store(out_ptr + offs, y, mask=inb)


@triton.jit
def _block_tensors(blk_ptr, b):
    """The tensors of block b's first and last element, from the per-layout table (int32 pairs)."""
    return tl.load(blk_ptr + 2 * b), tl.load(blk_ptr + 2 * b + 1)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n_local", "T"])  # loop bounds: a new value needs no new compile
def _amax_kernel(g_ptr, state_ptr, blk_ptr, starts_ptr, n_local, numel, T, BLOCK: tl.constexpr):
    """state[t] = max |g| over tensor t as float32 bits (relaxed atomic max; NaN/Inf bits sort above
    every finite value); state[T] = 1 if any gradient is not finite.  state must be zero."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < numel
    seg_lo, seg_hi = _block_tensors(blk_ptr, pid)  # issued before the gradient loads they do not need
    a = tl.zeros([BLOCK], tl.int32)
    ptrs = g_ptr + offs
    for r in range(n_local):  # max |g| over the local nodes, as float32 bits (NaN bits sort highest)
        g = tl.load(ptrs, mask=inb, other=0.0)
        a = tl.maximum(a, g.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        ptrs += numel  # next node's row (64-bit pointer arithmetic)
    # relaxed: nothing in this kernel reads the maxima; the next kernel runs after it
    if seg_lo == seg_hi:  # the block lies in one tensor
        m = tl.max(a, axis=0)
        tl.atomic_max(state_ptr + seg_lo, m, mask=m > 0, sem="relaxed")
    else:
        seg = _seg_in_block(offs, starts_ptr, seg_lo, seg_hi)
        m = tl.max(a, axis=0)
        for t in range(seg_lo, seg_hi + 1):
            tl.atomic_max(state_ptr + t, tl.max(tl.where(inb & (seg == t), a, 0), axis=0), sem="relaxed")
    tl.atomic_max(state_ptr + T, 1, mask=m >= 0x7F800000, sem="relaxed")


@triton.jit(do_not_specialize=["n_local", "T", "n"])
def _encode_kernel(
    g_ptr, send_ptr, state_ptr, blk_ptr, starts_ptr, n_local, numel, shard, T, n,
    # -- APS --
    APS: tl.constexpr, TOP: tl.constexpr,
    # -- the format (cast._float_constexprs) --
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, SPECIALS: tl.constexpr, OVERFLOW: tl.constexpr,
    SIGNED: tl.constexpr, HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr,
    CODE_MAX: tl.constexpr, CODE_MIN: tl.constexpr, CODE_INF: tl.constexpr, CODE_NAN: tl.constexpr,
    SIGN_BIT: tl.constexpr, LOW_BASE: tl.constexpr,
    # -- what to do --
    MODE: tl.constexpr, CODES: tl.constexpr, HW: tl.constexpr, BLOCK: tl.constexpr,
):
    # grid (cdiv(shard, BLOCK), world, n_local): column block, destination rank w, local node r
    pid = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1).to(tl.int64)
    r = tl.program_id(2).to(tl.int64)
    p = pid * BLOCK + tl.arange(0, BLOCK)  # position in shard w
    j = w * shard + p  # flat gradient index
    col = p < shard
    inb = col & (j < numel)  # the rest is padding: value 0
    if APS:
        seg_lo, seg_hi = _block_tensors(blk_ptr, w * tl.num_programs(0) + pid)
    g = tl.load(g_ptr + r * numel + j, mask=inb, other=0.0)

    # ---- scale by 2**s exactly (rounded to odd where float32 cannot hold the product) ------------
    if APS:
        if seg_lo == seg_hi:
            s_blk = _shift_of(tl.load(state_ptr + seg_lo), n, TOP)
            if (s_blk >= 0) & (s_blk <= 127):  # one float32 multiply is exact: scaling up, |x| <= 2**top / n
                x = g * ((s_blk.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
            else:
                x = _scale_round_to_odd(g, tl.zeros([BLOCK], tl.int64) + s_blk)
        else:
            seg = _seg_in_block(j, starts_ptr, seg_lo, seg_hi)
            s_vec = _shift_of(tl.load(state_ptr + seg, mask=inb, other=0), n, TOP)
            x = _scale_round_to_odd(g, s_vec)
    else:
        x = g

    # ---- round once to fmt; codes (or values) into the (world, n_local, shard) send layout -------
    if HW != 0:
        y, code = _round_hw(x, HW)
    else:
        y, code = _round_value_code(x, CODES, MODE, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                                    SPECIALS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, CODE_MAX, CODE_MIN,
                                    CODE_INF, CODE_NAN, SIGN_BIT, LOW_BASE)
    dst = send_ptr + (w * n_local + r) * shard + p
    if CODES:  # padding: g = 0 went through the same rounding, as the reference encodes its 0.0
        tl.store(dst, code.to(send_ptr.dtype.element_ty), mask=col)
    else:  # the reference pads the values with 0.0 after rounding
        tl.store(dst, tl.where(inb, y, 0.0), mask=col)


@triton.jit(do_not_specialize=["n"])
def _reduce_kernel(
    recv_ptr, out_ptr, lut_ptr, n, shard,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, SPECIALS: tl.constexpr, OVERFLOW: tl.constexpr,
    SIGNED: tl.constexpr, HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr,
    CODE_MAX: tl.constexpr, CODE_MIN: tl.constexpr, CODE_INF: tl.constexpr, CODE_NAN: tl.constexpr,
    SIGN_BIT: tl.constexpr, LOW_BASE: tl.constexpr,
    MODE: tl.constexpr, KAHAN: tl.constexpr, CODES: tl.constexpr, N_CODES: tl.constexpr, DEC: tl.constexpr,
    HW: tl.constexpr, BLOCK: tl.constexpr,
):
    """Reduce-scatter exchange: recv (n, shard) node rows -> out (shard,) codes or values."""
    pid = tl.program_id(0).to(tl.int64)
    p = pid * BLOCK + tl.arange(0, BLOCK)
    m = p < shard
    s = _sum_rows(recv_ptr + p, shard, n, m, lut_ptr, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                  OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, CODE_NAN, MODE, KAHAN, CODES, N_CODES, DEC,
                  HW, BLOCK)
    if CODES:  # s is a value of fmt (or +-Inf): its nearest code, as the reference's encode
        _, code = _round_value_code(s, True, 0, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, SPECIALS,
                                    OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, CODE_MAX, CODE_MIN, CODE_INF,
                                    CODE_NAN, SIGN_BIT, LOW_BASE)
        tl.store(out_ptr + p, code.to(out_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(out_ptr + p, s, mask=m)


@triton.jit(do_not_specialize=["T", "n"])
def _finish_kernel(
    wire_ptr, out_ptr, lut_ptr, state_ptr, blk_ptr, starts_ptr, numel, T, inv_n, n,
    APS: tl.constexpr, TOP: tl.constexpr, N_POW2: tl.constexpr, LOG2N: tl.constexpr,
    CODES: tl.constexpr, N_CODES: tl.constexpr, DEC: tl.constexpr, BLOCK: tl.constexpr,
):
    """Reduce-scatter exchange: gathered (>= numel,) reduced shards -> the mean (numel,) f32."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < numel
    seg_lo, seg_hi = _block_tensors(blk_ptr, pid)
    total = _load_values(wire_ptr + offs, inb, lut_ptr, CODES, N_CODES, DEC)
    _mean_store(total, offs, inb, out_ptr, state_ptr, starts_ptr, seg_lo, seg_hi, T, inv_n, n, APS, TOP, N_POW2,
                LOG2N, BLOCK)


@triton.jit(do_not_specialize=["T", "n"])
def _reduce_finish_kernel(
    wire_ptr, out_ptr, lut_ptr, state_ptr, blk_ptr, starts_ptr, numel, row, T, inv_n, n,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, SPECIALS: tl.constexpr, OVERFLOW: tl.constexpr,
    SIGNED: tl.constexpr, HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr,
    CODE_MAX: tl.constexpr, CODE_MIN: tl.constexpr, CODE_INF: tl.constexpr, CODE_NAN: tl.constexpr,
    SIGN_BIT: tl.constexpr, LOW_BASE: tl.constexpr,
    APS: tl.constexpr, TOP: tl.constexpr, N_POW2: tl.constexpr, LOG2N: tl.constexpr,
    MODE: tl.constexpr, KAHAN: tl.constexpr, CODES: tl.constexpr, N_CODES: tl.constexpr, DEC: tl.constexpr,
    HW: tl.constexpr, BLOCK: tl.constexpr,
):
    """All-gather exchange: every node's row (n, row) -> the mean (numel,) f32, in one pass."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < numel
    seg_lo, seg_hi = _block_tensors(blk_ptr, pid)
    s = _sum_rows(wire_ptr + offs, row, n, inb, lut_ptr, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                  OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, CODE_NAN, MODE, KAHAN, CODES, N_CODES, DEC,
                  HW, BLOCK)
    # the reference sends S as its nearest code and decodes it: the identity on values of fmt and
    # NaN; +-Inf may come back as NaN (no Inf code) or +-max (saturating), so only blocks holding an
    # Inf take the round trip.  S can hold an Inf only in a format with Inf, or one without NaN
    # (NaN sums become +Inf): for the others (e4m3fn) the check is left out at compile time.
    if CODES and ((SPECIALS == 0) or (CODE_NAN < 0)):
        if tl.max((tl.abs(s) == float("inf")).to(tl.int32), axis=0) > 0:
            _, code = _round_value_code(s, True, 0, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                                        SPECIALS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, CODE_MAX, CODE_MIN,
                                        CODE_INF, CODE_NAN, SIGN_BIT, LOW_BASE)
            s = _decode(code, inb, lut_ptr, N_CODES, DEC)
    _mean_store(s, offs, inb, out_ptr, state_ptr, starts_ptr, seg_lo, seg_hi, T, inv_n, n, APS, TOP, N_POW2,
                LOG2N, BLOCK)


@triton.jit(do_not_specialize=["n", "rank", "t"])
def _ring_step_kernel(
    recv_ptr, prev_ptr, q_ptr, out_ptr, lut_a_ptr, lut_s_ptr, n_local, n, shard, rank, t,
    # -- the format of the partial sums S (the wire format, or acc_format) --
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, SPECIALS: tl.constexpr, OVERFLOW: tl.constexpr,
    SIGNED: tl.constexpr, HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr,
    CODE_MAX: tl.constexpr, CODE_MIN: tl.constexpr, CODE_INF: tl.constexpr, CODE_NAN: tl.constexpr,
    SIGN_BIT: tl.constexpr, LOW_BASE: tl.constexpr,
    # -- what to do --
    MODE: tl.constexpr, KAHAN: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, KO: tl.constexpr,
    CODES: tl.constexpr, N_CODES_A: tl.constexpr, DEC_A: tl.constexpr, N_CODES: tl.constexpr,
    DEC: tl.constexpr, HW: tl.constexpr, BLOCK: tl.constexpr,
):
    """Step t of the ring for this process's nodes k = rank * n_local + r (grid (cdiv(shard, BLOCK),
    n_local)): node k adds its own value of shard (k - t - 1) mod n to the partial it receives from
    node k - 1 (row 0: ``recv``, off the wire; row r > 0: row r - 1 of ``prev``, this launch's
    predecessor), S = R(p + q) (Kahan: y = R(q - c); t = R(p + y); c = R(R(t - p) - y)), and writes
    what it sends next: out (n_local, KO, shard) codes of S (or float32 values).  FIRST (t = 0): the
    partial is the node's own value of shard k - 1 (compensation +0).  LAST: KO = 1 (the partial
    only, to be all-gathered), NaN -> +Inf where S has no NaN (the engine's nan_to_inf)."""
    pid = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    p = pid * BLOCK + tl.arange(0, BLOCK)
    m = p < shard
    k = rank * n_local + r
    j = (k - t - 1 + 2 * n) % n  # the shard node k adds to (t = 0: the shard it starts)
    # q: this node's rounded gradients of shard j, encode's (n, n_local, shard) layout, in the wire format
    q = _load_values(q_ptr + (j * n_local + r) * shard + p, m, lut_a_ptr, CODES, N_CODES_A, DEC_A)
    if FIRST:
        s = q
        c = tl.zeros([BLOCK], tl.float32)
    else:
        if r == 0:
            src = recv_ptr + p
        elif KAHAN:  # the previous step sent two rows per node
            src = prev_ptr + (r - 1) * (2 * shard) + p
        else:
            src = prev_ptr + (r - 1) * shard + p
        ps = _load_values(src, m, lut_s_ptr, CODES, N_CODES, DEC)
        if KAHAN:
            cs = _load_values(src + shard, m, lut_s_ptr, CODES, N_CODES, DEC)
            yk = round_to_format(_add_rto(q, _neg(cs)), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                                 OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
            s = round_to_format(_add_rto(ps, yk), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW,
                                SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
            ts = round_to_format(_add_rto(s, _neg(ps)), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                                 OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
            c = round_to_format(_add_rto(ts, _neg(yk)), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                                OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
        elif HW != 0:  # a round-to-odd sum, then the hardware's round to nearest (module doc)
            s, _ = _round_hw(_add_rto(ps, q), HW)
            c = s
        else:
            s = round_to_format(_add_rto(ps, q), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW,
                                SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
            c = s
    dst = out_ptr + r * (KO * shard) + p
    if CODES:  # what the engine's pack sends: the nearest code (NaN of a format without NaN: +Inf's)
        if CODE_NAN < 0:
            s = tl.where(s != s, float("inf"), s)
        _, code = _round_value_code(s, True, 0, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, SPECIALS,
                                    OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, CODE_MAX, CODE_MIN, CODE_INF,
                                    CODE_NAN, SIGN_BIT, LOW_BASE)
        tl.store(dst, code.to(out_ptr.dtype.element_ty), mask=m)
        if KO == 2:
            if CODE_NAN < 0:
                c = tl.where(c != c, float("inf"), c)
            _, ccode = _round_value_code(c, True, 0, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS,
                                         SPECIALS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, CODE_MAX, CODE_MIN,
                                         CODE_INF, CODE_NAN, SIGN_BIT, LOW_BASE)
            tl.store(dst + shard, ccode.to(out_ptr.dtype.element_ty), mask=m)
    else:  # float32 values travel as they are; the engine's nan_to_inf only before the all-gather
        if LAST and (CODE_NAN < 0):
            s = tl.where(s != s, float("inf"), s)
        tl.store(dst, s, mask=m)
        if KO == 2:
            tl.store(dst + shard, c, mask=m)


@triton.jit(do_not_specialize=["d", "P", "rank"])
def _halving_step_kernel(
    v_ptr, recv_ptr, lut_ptr, L, shard, d, P, rank,
    # -- the format of the partial sums S (the wire format, or acc_format) --
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, SPECIALS: tl.constexpr, OVERFLOW: tl.constexpr,
    SIGNED: tl.constexpr, HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr,
    CODE_MAX: tl.constexpr, CODE_MIN: tl.constexpr, CODE_INF: tl.constexpr, CODE_NAN: tl.constexpr,
    SIGN_BIT: tl.constexpr, LOW_BASE: tl.constexpr,
    # -- what to do --
    MODE: tl.constexpr, FOLD: tl.constexpr, LAST: tl.constexpr, DIST: tl.constexpr, CODES: tl.constexpr,
    N_CODES: tl.constexpr, DEC: tl.constexpr, HW: tl.constexpr, BLOCK: tl.constexpr,
):
    """One combine of recursive halving, in place on the nodes' vectors v (rows of L = P * shard,
    codes of S or float32 values; grid (cdiv(width, BLOCK), rows)).  Level d: node k keeps chunks
    [(k // d) d, (k // d) d + d) and sets them to R(lower + upper), the lower node's values first,
    the other operand being node k ^ d's values there (emulated: its row of v; DIST: ``recv``, one
    row, node ``rank``).  FOLD: node k < N - P adds node k + P's whole vector, its own first.  Rows
    touch disjoint ranges of each other (k writes what k ^ d does not read), so one launch updates
    every emulated node in place.  LAST (d = 1, values): NaN -> +Inf where S has no NaN."""
    pid = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    p = pid * BLOCK + tl.arange(0, BLOCK)
    if DIST:
        k = rank.to(tl.int64)
    else:
        k = row
    if FOLD:
        start = k * 0
        width = L
        other = k + P
        own_low = True
    else:
        start = (k // d) * d * shard
        width = d * shard
        other = k ^ d
        own_low = (k & d) == 0
    m = p < width
    own_ptrs = v_ptr + row * L + start + p
    own = _load_values(own_ptrs, m, lut_ptr, CODES, N_CODES, DEC)
    if DIST:
        oth = _load_values(recv_ptr + p, m, lut_ptr, CODES, N_CODES, DEC)
    else:
        oth = _load_values(v_ptr + other * L + start + p, m, lut_ptr, CODES, N_CODES, DEC)
    lo = tl.where(own_low, own, oth)
    hi = tl.where(own_low, oth, own)
    if HW != 0:  # a round-to-odd sum, then the hardware's round to nearest (module doc)
        s, _ = _round_hw(_add_rto(lo, hi), HW)
    else:
        s = round_to_format(_add_rto(lo, hi), MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, OVERFLOW,
                            SIGNED, HAS_NZ, ZERO, SUBNORMALS, LOW_BASE, MODE)
    if CODES:  # as the engine's pack: NaN of a format without NaN goes as +Inf's code
        if CODE_NAN < 0:
            s = tl.where(s != s, float("inf"), s)
        _, code = _round_value_code(s, True, 0, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, MIN_BITS, SPECIALS,
                                    OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS, CODE_MAX, CODE_MIN, CODE_INF,
                                    CODE_NAN, SIGN_BIT, LOW_BASE)
        tl.store(own_ptrs, code.to(v_ptr.dtype.element_ty), mask=m)
    else:
        if LAST and (CODE_NAN < 0):
            s = tl.where(s != s, float("inf"), s)
        tl.store(own_ptrs, s, mask=m)


# ----------------------------------------------------------------------------------------------
# Launching: compile once through Triton, then call the compiled kernel
# ----------------------------------------------------------------------------------------------


def _spec(a):
    """What Triton specializes an argument on (dtype and 16-byte alignment of a tensor; an integer
    being 1, a multiple of 16, 64-bit), plus a little more: launches that agree share a kernel."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "b", a
    if isinstance(a, int):
        return "i", a == 1, a % 16 == 0, -(1 << 31) <= a < (1 << 31)
    return type(a).__name__


class _Launcher:
    """``fn[grid](*args, **consts)``, with the argument binding done once per specialization.

    The first launch of a specialization goes through Triton (which compiles and caches it); later
    ones call the compiled kernel with the full argument list (constexprs in place), keyed by
    ``ckey`` (the caller's name for the constexprs) and ``_spec`` of each run-time argument.  If
    this Triton's compiled kernels take their arguments differently, the first direct launch
    raises before launching; direct launches are then switched off, with a warning, and every
    launch goes through Triton (the kernels are idempotent, so the retry is harmless)."""

    direct = True

    def __init__(self, fn):
        self.fn, self.cache, self.names = fn, {}, list(fn.arg_names)

    def __call__(self, grid, args: tuple, consts: dict, ckey) -> None:
        grid = tuple(grid) + (1,) * (3 - len(grid))  # a compiled kernel's launcher takes all three
        key = (ckey, NUM_WARPS, tuple(_spec(a) for a in args))
        hit = self.cache.get(key) if _Launcher.direct else None
        if hit is not None:
            ck, template, pos, verified = hit
            full = list(template)
            for i, a in zip(pos, args):
                full[i] = a
            if verified:
                ck[grid](*full)
                return
            try:
                ck[grid](*full)
                self.cache[key] = (ck, template, pos, True)
                return
            except Exception as e:  # noqa: BLE001  (a different launcher convention: see the class doc)
                _Launcher.direct = False
                log.warning("fused all-reduce: launching compiled kernels directly failed (%s: %s); every launch "
                            "goes through Triton's binder from now on (slower on the host)", type(e).__name__, e)
        ck = self.fn[grid](*args, **consts, num_warps=NUM_WARPS)
        if _Launcher.direct and hasattr(ck, "function") and hasattr(ck, "run"):  # compiled (not the interpreter)
            template = [consts.get(name) for name in self.names]
            pos = [i for i, name in enumerate(self.names) if name not in consts]
            if len(pos) == len(args):
                self.cache[key] = (ck, template, pos, False)


_L = {name: _Launcher(fn) for name, fn in (("amax", _amax_kernel), ("encode", _encode_kernel),
                                              ("reduce", _reduce_kernel), ("finish", _finish_kernel),
                                              ("reduce_finish", _reduce_finish_kernel),
                                              ("ring_step", _ring_step_kernel),
                                              ("halving_step", _halving_step_kernel))}


# ----------------------------------------------------------------------------------------------
# Layouts: what depends only on the tensor sizes and the exchange, made once
# ----------------------------------------------------------------------------------------------


def _block_table(starts: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 2) int32: the tensor of each block's first and last element (the largest t with
    starts[t] <= index, as _seg_in_block counts it on the device)."""
    lo = torch.searchsorted(starts, first, right=True) - 1
    hi = torch.searchsorted(starts, last, right=True) - 1
    return torch.stack([lo, hi], 1).to(torch.int32).contiguous()


class Layout:
    """The per-layout constants of one all-reduce shape, made once (``layout`` caches them):
    ``starts`` (T,) int64, the first index of each tensor; ``blocks`` (cdiv(numel, block), 2) int32,
    the tensors of each block over the flat vector (amax, finish, reduce_finish); ``send_blocks``
    (world * cdiv(shard, block), 2) int32, the same for the encoder's blocks, which walk each
    destination rank's shard.  A block whose two tensors agree uses one shift for all its
    elements; only blocks that straddle tensors look elements up (binary search over starts)."""

    def __init__(self, sizes: tuple, numel: int, world: int, shard: int, block: int, device):
        starts = torch.tensor([0] + list(itertools.accumulate(sizes))[:-1], dtype=torch.int64)
        self.T, self.numel, self.world, self.shard, self.block = len(sizes), numel, world, shard, block
        first = torch.arange(0, numel, block, dtype=torch.int64)
        self.blocks = _block_table(starts, first, torch.clamp(first + block, max=numel) - 1).to(device)
        base = (torch.arange(world, dtype=torch.int64)[:, None] * shard
                + torch.arange(0, shard, block, dtype=torch.int64)[None, :])  # (world, cdiv(shard, block))
        end = torch.minimum(base + block, (base // shard + 1) * shard)  # a block ends with its shard
        last = torch.minimum(end, torch.full_like(base, numel)) - 1  # j0 = j1 = numel - 1 for padding only
        self.send_blocks = _block_table(starts, torch.clamp(base, max=numel - 1).reshape(-1),
                                        last.reshape(-1)).to(device)
        self.starts = starts.to(device)


_LAYOUTS: dict = {}


def layout(sizes, numel: int, world: int, shard: int, device, block: int | None = None) -> Layout:
    block = block or BLOCK
    key = (tuple(sizes), numel, world, shard, block, device)
    lay = _LAYOUTS.get(key)
    if lay is None:
        if len(_LAYOUTS) >= 64:
            _LAYOUTS.clear()
        lay = _LAYOUTS[key] = Layout(tuple(sizes), numel, world, shard, block, device)
    return lay


# ----------------------------------------------------------------------------------------------
# Wrappers: check, allocate, launch
# ----------------------------------------------------------------------------------------------


_FMT_CACHE: dict = {}


def _fmt_consts(fmt) -> dict:
    c = _FMT_CACHE.get(fmt)
    if c is None:
        c = _FMT_CACHE[fmt] = _float_constexprs(fmt)
    return c


def _hw_round(fmt, rounding: str, aps: bool, kahan: bool, t: torch.Tensor) -> int:
    """1 / 2: round by cvt.rn to e4m3fn / e5m2 (module doc: exact under APS, nearest, no Kahan, on
    CUDA), 0: the generic rounding."""
    kind = _BITCAST_FORMATS.get(fmt, 0)
    ok = kind in (1, 2) and rounding == "nearest" and aps and not kahan and t.is_cuda
    return kind if ok else 0


def state_buffer(T: int, device) -> torch.Tensor:
    """(T + 2,) int32 zeros: per tensor max |g| bits, the non-finite-input flag, the overflow flag."""
    return torch.zeros(T + 2, dtype=torch.int32, device=device)


def amax(grads: torch.Tensor, lay: Layout, state: torch.Tensor) -> None:
    """grads (n_local, numel) f32 contiguous -> state[:T] = max |g| bits per tensor, state[T] = 1
    if a gradient is not finite (module doc).  ``state`` (T + 2,) int32 must be zero."""
    n_local, numel = grads.shape
    if numel:
        _L["amax"]((lay.blocks.shape[0],), (grads, state, lay.blocks, lay.starts, n_local, numel, lay.T),
                   dict(BLOCK=lay.block), (lay.block, grads.device.index))


def encode(grads: torch.Tensor, lay: Layout, state: torch.Tensor, send: torch.Tensor, fmt, rounding: str,
           aps: bool, top: int, n: int) -> None:
    """grads (n_local, numel) -> send (world, n_local, shard): codes (integer dtype) or f32 values,
    scaled by the APS shift of the all-reduced ``state`` over ``n`` nodes."""
    world, n_local, shard = send.shape
    numel = grads.shape[1]
    codes = not send.dtype.is_floating_point
    hw = _hw_round(fmt, rounding, aps, False, grads)
    consts = dict(APS=aps, TOP=top, **_fmt_consts(fmt), MODE=Rounding(rounding).code, CODES=codes, HW=hw,
                  BLOCK=lay.block)
    _L["encode"]((cdiv(shard, lay.block), world, n_local),
                 (grads, send, state, lay.send_blocks, lay.starts, n_local, numel, shard, lay.T, n),
                 consts, (fmt, aps, top, rounding, codes, hw, lay.block, grads.device.index))


def _sum_consts(fmt, rounding: str, kahan: bool, codes: bool, t: torch.Tensor, aps: bool) -> dict:
    return dict(**_fmt_consts(fmt), MODE=Rounding(rounding).code, KAHAN=kahan, CODES=codes, N_CODES=fmt.n_codes,
                DEC=_BITCAST_FORMATS.get(fmt, 0), HW=_hw_round(fmt, rounding, aps, kahan, t))


def reduce(recv: torch.Tensor, out: torch.Tensor, lut: torch.Tensor, fmt, rounding: str, kahan: bool, aps: bool,
           block: int | None = None) -> None:
    """recv (n, shard) codes or f32 values, node order -> out (shard,) of the same kind."""
    block = block or BLOCK
    n, shard = recv.shape
    codes = not recv.dtype.is_floating_point
    consts = dict(_sum_consts(fmt, rounding, kahan, codes, recv, aps), BLOCK=block)
    _L["reduce"]((cdiv(shard, block),), (recv, out, lut, n, shard), consts,
                 (fmt, rounding, kahan, codes, consts["HW"], block, recv.device.index))


def _mean_consts(n: int, aps: bool, top: int, lay: Layout) -> dict:
    pow2 = n & (n - 1) == 0
    return dict(APS=aps, TOP=top, N_POW2=pow2, LOG2N=n.bit_length() - 1 if pow2 else 0)


def finish(wire: torch.Tensor, out: torch.Tensor, lut: torch.Tensor, lay: Layout, state: torch.Tensor, fmt, n: int,
           aps: bool, top: int) -> None:
    """wire (>= numel,) gathered codes or f32 values -> out (numel,) f32 mean; state[T + 1] = 1 if a
    mean is not finite (and the input was)."""
    numel = out.numel()
    if numel == 0:
        return
    codes = not wire.dtype.is_floating_point
    consts = dict(_mean_consts(n, aps, top, lay), CODES=codes, N_CODES=fmt.n_codes, DEC=_BITCAST_FORMATS.get(fmt, 0),
                  BLOCK=lay.block)
    _L["finish"]((lay.blocks.shape[0],), (wire, out, lut, state, lay.blocks, lay.starts, numel, lay.T, 1.0 / n, n),
                 consts, (fmt, n, aps, top, codes, lay.block, wire.device.index))


def reduce_finish(wire: torch.Tensor, out: torch.Tensor, lut: torch.Tensor, lay: Layout, state: torch.Tensor, fmt,
                  rounding: str, kahan: bool, aps: bool, top: int) -> None:
    """wire (n, row >= numel) every node's codes or f32 values, node order -> out (numel,) f32 mean."""
    n, row = wire.shape
    numel = out.numel()
    if numel == 0:
        return
    codes = not wire.dtype.is_floating_point
    consts = dict(_sum_consts(fmt, rounding, kahan, codes, wire, aps), **_mean_consts(n, aps, top, lay),
                  BLOCK=lay.block)
    _L["reduce_finish"]((lay.blocks.shape[0],),
                        (wire, out, lut, state, lay.blocks, lay.starts, numel, row, lay.T, 1.0 / n, n),
                        consts, (fmt, rounding, kahan, n, aps, top, codes, consts["HW"], lay.block,
                                 wire.device.index))


def ring_step(recv: torch.Tensor, prev: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lut_a: torch.Tensor,
              lut_s: torch.Tensor, fmt, acc, rounding: str, kahan: bool, aps: bool, rank: int, t: int,
              first: bool, last: bool) -> None:
    """One ring step for this process's nodes (``_ring_step_kernel``): q (n, n_local, shard) the
    nodes' own values in ``fmt`` (encode's layout, codes or f32), recv (K, shard) what node
    rank * n_local - 1 sent, prev (n_local, K, shard) what the previous step wrote, out (n_local, KO,
    shard) what this step sends (K = 2 with Kahan: partial and compensation; KO = 1 when ``last``).
    Partial sums are rounded to ``acc`` (the format of recv / prev / out's codes)."""
    n, n_local, shard = q.shape
    ko = out.shape[1]
    codes = not q.dtype.is_floating_point
    consts = dict(**_fmt_consts(acc), MODE=Rounding(rounding).code, KAHAN=kahan, FIRST=first, LAST=last, KO=ko,
                  CODES=codes, N_CODES_A=fmt.n_codes, DEC_A=_BITCAST_FORMATS.get(fmt, 0), N_CODES=acc.n_codes,
                  DEC=_BITCAST_FORMATS.get(acc, 0), HW=_hw_round(acc, rounding, aps, kahan, q), BLOCK=BLOCK)
    _L["ring_step"]((cdiv(shard, BLOCK), n_local), (recv, prev, q, out, lut_a, lut_s, n_local, n, shard, rank, t),
                    consts, (fmt, acc, rounding, kahan, first, last, ko, codes, consts["HW"], BLOCK,
                             q.device.index))


def halving_step(v: torch.Tensor, recv: torch.Tensor, lut_s: torch.Tensor, acc, rounding: str, aps: bool,
                 shard: int, d: int, P: int, rank: int, rows: int, fold: bool, last: bool, dist: bool) -> None:
    """One combine of recursive halving (``_halving_step_kernel``) over ``rows`` rows of v (rows, L)
    in place: codes of ``acc`` or f32 values; ``recv`` the partner's values (``dist``) or unused."""
    L = v.shape[-1]
    width = L if fold else d * shard
    codes = not v.dtype.is_floating_point
    consts = dict(**_fmt_consts(acc), MODE=Rounding(rounding).code, FOLD=fold, LAST=last, DIST=dist, CODES=codes,
                  N_CODES=acc.n_codes, DEC=_BITCAST_FORMATS.get(acc, 0), HW=_hw_round(acc, rounding, aps, False, v),
                  BLOCK=BLOCK)
    _L["halving_step"]((cdiv(width, BLOCK), rows), (v, recv, lut_s, L, shard, d, P, rank), consts,
                       (acc, rounding, fold, last, dist, codes, consts["HW"], BLOCK, v.device.index))
