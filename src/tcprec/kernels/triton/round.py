"""Device-level rounding of float32 register tensors to any FloatFormat, for kernels that round
*inside* a computation (the emulated-accumulator GEMM), not only on load/store.

``round_to_format(x, ...)`` lives in ``cast.py``: the cast kernel and this device-level rounding are
one piece of code (``_round_float`` + ``_finish_value``), with the constexprs of
``cast._float_constexprs``; it is re-exported here for the GEMM kernels.

Also here: ``add_round_to_odd`` (TwoSum + round to odd in float32) and ``mul_round_to_odd``
(exact float64 product, rounded to odd float32); see kernels/reference_emulate.py for why rounding
these to a format of <= 21 mantissa bits gives the correctly rounded exact result.  And
``div_by_scalar``: IEEE float32 division by one scale, without a division per element.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...enums import DETERMINISTIC_ROUNDINGS
from .cast import (  # noqa: F401  (re-exported for the kernels that round inside a computation)
    ROUND_DOWN,
    ROUND_NEAREST,
    ROUND_NEAREST_AWAY,
    ROUND_TOWARD_ZERO,
    ROUND_UP,
    _float_constexprs,
    round_to_format,
)

# The modes a kernel can round with inside a computation: the deterministic ones (stochastic rounding
# inside a GEMM needs a per-(m, n, k) counter: TODO).  Their MODE value is ``tcprec.Rounding(r).code``.
MODES = DETERMINISTIC_ROUNDINGS


_SIGN_BIT = tl.constexpr(-(1 << 31))  # 0x80000000 as an int32


@triton.jit
def neg(x):
    """-x for float32 by flipping the sign bit.  Not the unary minus: Triton up to 3.6 compiles a
    float ``-x`` as ``0 - x``, which turns -(+0) into +0 (a Kahan sum of -0's then ends +0 on the
    GPU while the reference, and Triton 3.9's interpreter, give -0)."""
    return (x.to(tl.int32, bitcast=True) ^ _SIGN_BIT).to(tl.float32, bitcast=True)


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


@triton.jit
def div_by_scalar(x, s):
    """``x / s`` for float32 ``x`` and a float32 *scalar* ``s``, rounded exactly as IEEE division (torch's
    ``x / s``, ``div_rn``), as ``RN32(x * RN64(1 / s))`` in float64: one float64 division a thread instead of a
    float32 ``div_rn`` (a ~20-instruction sequence) per element, which bounded the int8-output conv epilogue
    (vgg.conv3 at batch 256: 1.81 ms against 0.86 ms with a plain multiply, H200).

    Why it is exact: the float64 product is y/s (1 + d), |d| <= 2^-52.  A float32 midpoint m (25 significant
    bits) and y/s = m + (y - m s) / s with y - m s a nonzero multiple of 2^(exponent of m s's last bit), so
    |y/s - m| >= 2^-49 |m| (y/s is never a float32 midpoint: an odd 25-bit m times s cannot fit 24 bits).  The
    product therefore lies on the same side of every midpoint as y/s, and rounds to the same float32; zeros,
    infinities, NaN and powers of two behave as the division does (tests/test_div_by_scalar.py checks the
    identity on ~10^7 values built around the midpoints and the kernel through the interpreter; a one-off run
    of the same construction on 4.9 x 10^8 values found no difference)."""
    inv = 1.0 / s.to(tl.float64)  # float64 '/' is div.rn.f64 (only float32 '/' is approximate in Triton)
    return (x.to(tl.float64) * inv).to(tl.float32)


@triton.jit
def div_for_codes(x, s):
    """``x / s`` for a quantizer (float32 ``x``, float32 *scalar* ``s``): the IEEE quotient wherever
    ``|x / s| < 2**30``, and beyond that a quotient of the right sign whose magnitude is at least ~2**30 (every code
    saturates there; +-inf and NaN stay themselves).  All float32 arithmetic: :func:`div_by_scalar`'s two float64
    conversions an element run on the SM's conversion pipe (16 lanes a cycle); the LayerNorm-codes kernel went from
    17.9 to 16.6 us a call with this (H200, docs/decisions/0168).

    Markstein's correction (i8_gemm.cu's code_of_rcp): with ``r = RN(1 / s)``, ``q0 = RN(x r)`` is within an ulp or
    so of ``x / s``, ``rem = x - s q0`` is exact (one fma), and ``RN(q0 + rem r)`` is ``RN(x / s)`` for ``s`` within
    ``2**-64 .. 2**64`` (``r`` normal, no underflow in ``rem``) and ``|q0| < 2**30``; quotients below 2**-100 or so
    may be an ulp off, which no code can see (they round to 0), and -0 / s comes back +0 (the correction's sum; no int8
    code tells them apart, so this is for int8 codes only; the fp8 quantizers keep :func:`div_by_scalar`: a sign-keeping
    version in every quantizer measured slower on the H200, docs/decisions/0170).  Other scales take
    :func:`div_by_scalar` (a scalar branch: one path runs)."""
    a = tl.abs(s)
    if (a >= 5.421010862427522e-20) & (a <= 1.8446744073709552e19):
        r = tl.div_rn(1.0, s)
        q0 = x * r
        q1 = tl.fma(tl.fma(-s, q0, x), r, q0)
        q = tl.where(tl.abs(q0) < 1073741824.0, q1, q0)
    else:
        q = div_by_scalar(x, s)
    return q


def fp8_constexprs(dtype) -> dict:
    """The constexprs of :func:`fp8_code` for ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, computed from the
    format (mantissa bits, bias, the float32 bit patterns of its largest finite value and its smallest normal)."""
    import struct

    import torch

    man, bias = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}[dtype]

    def f32_bits(v: float) -> int:
        return struct.unpack("<i", struct.pack("<f", v))[0]

    return {"F8_MAN": man, "F8_BIAS": bias, "F8_MAX_BITS": f32_bits(float(torch.finfo(dtype).max)),
            "F8_MIN_NORMAL_BITS": f32_bits(2.0 ** (1 - bias)), "F8_SUB_SCALE": 2.0 ** (bias + man - 1)}


@triton.jit
def fp8_code(y, F8_MAN: tl.constexpr, F8_BIAS: tl.constexpr, F8_MAX_BITS: tl.constexpr,
             F8_MIN_NORMAL_BITS: tl.constexpr, F8_SUB_SCALE: tl.constexpr):
    """float32 ``y`` -> the int32 code (0..255) that torch's ``y.clamp(-max, max).to(float8)`` stores
    (``ops.qconv.quantize_fp8_static``'s semantics): saturate to +-max (+-Inf too), round to nearest even
    (subnormals included), -0 kept, NaN -> sign | 0x7F (a NaN in both e4m3fn and e5m2).

    Integer arithmetic on the float32 pattern, not ``.to(tl.float8e4nv)``: Triton's interpreter rounds that
    conversion its own way (100 -> 104 in e4m3, NaN -> 384), so only this form is testable bit for bit on the
    CPU; on the GPU it is a dozen integer ops an element, in kernels bound by memory."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF  # |y|'s pattern: ordered as the magnitudes
    nan = a > 0x7F800000
    a = tl.minimum(a, F8_MAX_BITS)  # saturate (NaN is handled apart)
    # normal: keep F8_MAN significand bits, ties to even (add half - 1 + the kept lsb), rebias the exponent
    sh = 23 - F8_MAN
    normal = ((a + ((1 << (sh - 1)) - 1) + ((a >> sh) & 1)) >> sh) - ((127 - F8_BIAS) << F8_MAN)
    # subnormal: |y| / (the subnormal step 2^(1 - bias - man)) is exact in float32; rounded to an integer
    # (ties to even: the 1.5 * 2^23 trick, exact below 2^22); 2^MAN is the smallest normal's code.  The min keeps
    # the unused lanes (normal values) small too, so their float -> int conversion stays in range
    t = tl.minimum(a, F8_MIN_NORMAL_BITS).to(tl.float32, bitcast=True) * F8_SUB_SCALE
    sub = ((t + 12582912.0) - 12582912.0).to(tl.int32)
    mag = tl.where(a < F8_MIN_NORMAL_BITS, sub, normal)
    return tl.where(nan, sign | 0x7F, sign | mag)
