"""Device-level rounding of float32 register tensors to any FloatFormat, for kernels that round
*inside* a computation (the emulated-accumulator GEMM), not only on load/store.

``round_to_format(x, ...)`` is the value path of ``cast.py``'s ``_float_round_kernel`` (same
regions, same bit tricks, same constexprs from ``cast._float_constexprs``) as a ``@triton.jit``
function of a register tensor.  PROPOSED REFACTOR (owner of cast.py): make ``_float_round_kernel``'s
``WRITE_CODES=False`` branch call this function so that the logic lives in one place; until then the
two are kept equal by tests (tests/test_emulate.py compares this function with the reference cast on
the cast test's inputs).  The shared helper ``_pow2_scale`` is imported, not copied.

Also here: ``add_round_to_odd`` (TwoSum + round to odd in float32) and ``mul_round_to_odd``
(exact float64 product, rounded to odd float32); see kernels/reference_emulate.py for why rounding
these to a format of <= 21 mantissa bits gives the correctly rounded exact result.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .cast import _float_constexprs, _pow2_scale  # noqa: F401  (re-exported for the GEMM wrappers)

# Deterministic modes only (stochastic rounding inside a GEMM needs a per-(m, n, k) counter: TODO).
MODES = {"nearest": 0, "nearest_away": 1, "toward_zero": 2, "up": 3, "down": 4}


@triton.jit
def round_to_format(
    x,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
    HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
    MODE: tl.constexpr,
):
    """float32 x -> float32 values of the format (MODE 0..4 as in cast._MODES)."""
    bits = x.to(tl.int32, bitcast=True)
    neg = bits < 0
    a = bits & 0x7FFFFFFF
    ax = a.to(tl.float32, bitcast=True)
    S: tl.constexpr = 23 - MAN
    MASK: tl.constexpr = (1 << S) - 1

    # ---- normal range of the target: round the bit pattern at bit S ------------------------
    if S == 0:
        r_norm = a
    else:
        if MODE == 0:
            if MAN == 0:
                lsb = ((a >> 23) + (BIAS + 1)) & 1
            else:
                lsb = (a >> S) & 1
            add = (MASK >> 1) + lsb
        elif MODE == 1:
            add = tl.full(a.shape, 1 << (S - 1), tl.int32)
        elif MODE == 2:
            add = tl.zeros(a.shape, tl.int32)
        elif MODE == 3:
            add = tl.where(neg, 0, MASK)
        else:
            add = tl.where(neg, MASK, 0)
        r_norm = (a + add) & ~MASK

    # ---- below min normal: constant quantum q = 2**QE_LOW ------------------------------------
    below = a < MIN_NORMAL_BITS
    ax = tl.where(below, ax, 0.0)
    if MODE == 0 and ZERO:
        C: tl.constexpr = 2.0 ** (QE_LOW + 23)
        m_low = (ax + C) - C
    else:
        t = _pow2_scale(ax, -QE_LOW)
        fl = tl.floor(t)
        frac = t - fl
        kept_low = fl.to(tl.int32)
        nz = frac > 0
        if MODE == 0:
            if SUBNORMALS:
                odd = ((LOW_BASE + kept_low) & 1) == 1
            else:
                odd = ((LOW_BASE + (kept_low << MAN)) & 1) == 1
            up = (frac > 0.5) | ((frac == 0.5) & odd)
        elif MODE == 1:
            up = frac >= 0.5
        elif MODE == 2:
            up = frac < 0.0
        elif MODE == 3:
            up = nz & ~neg
        else:
            up = nz & neg
        kept_low = kept_low + up.to(tl.int32)
        m_low = _pow2_scale(kept_low.to(tl.float32), QE_LOW)
    mag = tl.where(below, m_low.to(tl.int32, bitcast=True), r_norm)

    # ---- specials ------------------------------------------------------------------------------
    is_nan = a > 0x7F800000
    is_inf = a == 0x7F800000
    is_zero = a == 0
    too_big = (mag > MAX_BITS) | is_inf
    if OVERFLOW == 0:
        to_max = too_big
    elif MODE == 2:
        to_max = too_big & ~is_inf
    elif MODE == 3:
        to_max = too_big & neg & ~is_inf
    elif MODE == 4:
        to_max = too_big & ~neg & ~is_inf
    else:
        to_max = tl.zeros(a.shape, tl.int1)
    to_over = too_big & ~to_max
    to_nan = is_nan
    if OVERFLOW == 2:
        to_nan = to_nan | to_over
    if not SIGNED:
        to_nan = to_nan | (neg & ~is_zero)
    if not ZERO:
        to_nan = to_nan | is_zero
        to_min = (mag == 0) & ~is_zero
    keep_sign = neg
    if not HAS_NZ and ZERO:
        keep_sign = keep_sign & (mag != 0)
    mag = tl.where(to_max, MAX_BITS, mag)
    if not ZERO:
        mag = tl.where(to_min, MIN_BITS, mag)
    mag = tl.where(to_over, 0x7F800000, mag)
    if SIGNED:
        mag = tl.where(keep_sign, mag | (bits ^ a), mag)
    mag = tl.where(to_nan, 0x7FC00000, mag)
    return mag.to(tl.float32, bitcast=True)


@triton.jit
def add_round_to_odd(a, b):
    """a + b in float32, rounded to odd (TwoSum: the exact error decides the sticky last bit)."""
    s = a + b
    bb = s - a
    t = (a - (s - bb)) + (b - bb)
    sb = s.to(tl.int32, bitcast=True)
    fix = (t != 0.0) & ((sb & 1) == 0) & ((sb & 0x7F800000) != 0x7F800000)
    step = tl.where((t < 0.0) == (sb < 0), 1, -1)
    return tl.where(fix, sb + step, sb).to(tl.float32, bitcast=True)


@triton.jit
def mul_round_to_odd(a, b, EXACT: tl.constexpr):
    """a * b rounded to odd float32.  EXACT: the float32 product is known to be exact (narrow
    operand formats), so one multiply does.  Otherwise the float64 product is exact and its float32
    rounding gets the sticky bit from the (exact) float64 difference."""
    if EXACT:
        return a * b
    p64 = a.to(tl.float64) * b.to(tl.float64)
    p = p64.to(tl.float32)
    pb = p.to(tl.int32, bitcast=True)
    d = p64 - p.to(tl.float64)
    fix = (d != 0.0) & ((pb & 1) == 0) & ((pb & 0x7F800000) != 0x7F800000)
    step = tl.where((d < 0.0) == (pb < 0), 1, -1)
    return tl.where(fix, pb + step, pb).to(tl.float32, bitcast=True)


def round_constexprs(fmt) -> dict:
    """The constexprs round_to_format takes, from cast's table (one source of truth)."""
    c = _float_constexprs(fmt)
    keep = ("MAN", "BIAS", "MIN_NORMAL_BITS", "QE_LOW", "MAX_BITS", "MIN_BITS", "OVERFLOW", "SIGNED",
            "HAS_NZ", "ZERO", "SUBNORMALS", "LOW_BASE")
    return {k: c[k] for k in keep}
