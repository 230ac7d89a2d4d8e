"""Fused elementwise cast / encode to any tcprec format, at memory speed.

One read of float32 (fp16/bf16 are widened in registers), one write of float32 values (``cast``)
or of codes (``encode``). The format is baked in as constexprs, so each format compiles once and
the arithmetic folds to a handful of integer ops. The kernel computes the same bits as
``kernels/reference.py`` (tests check it over millions of inputs), but reaches them by cheaper
routes, chosen per region of |x|:

* |x| >= min normal of the target (``a >= MIN_NORMAL_BITS``): the target's quantum sits at a fixed
  bit of the float32 pattern, ``s = 23 - MAN``.  Rounding is ``(a + add) & ~mask`` with
  ``mask = 2**s - 1`` and ``add`` chosen by the mode (nearest-even: ``mask/2 + lsb``; stochastic:
  ``mask ^ (top s random bits)``, so P(carry) = rem / 2**s exactly).  A carry out of the mantissa
  bumps the exponent, which is exactly the next binade.
* below it, the quantum is a constant ``q = 2**QE_LOW``: ``t = |x| / q`` is exact, ``floor(t)`` and
  ``t - floor(t)`` are exact, and the mode decides from that fraction.  For nearest-even the same is
  two float adds: ``(|x| + C) - C`` with ``C = q * 2**23``.

Then the format's specials: NaN, Inf, overflow (saturate / Inf / NaN, IEEE directed-rounding
clamps), -0, unsigned and zero-less formats.  Integer formats use the code-index form of the
reference (``u = (x - offset) / step``) with exact floor/fraction arithmetic.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ...enums import Rounding
from ...formats import FloatFormat, IntFormat
from .. import reference as ref
from ._host import cdiv

# The kernels' MODE values, named after tcprec.Rounding (the one definition of the modes and their codes)
ROUND_NEAREST = tl.constexpr(Rounding.NEAREST.code)
ROUND_NEAREST_AWAY = tl.constexpr(Rounding.NEAREST_AWAY.code)
ROUND_TOWARD_ZERO = tl.constexpr(Rounding.TOWARD_ZERO.code)
ROUND_UP = tl.constexpr(Rounding.UP.code)
ROUND_DOWN = tl.constexpr(Rounding.DOWN.code)
ROUND_STOCHASTIC = tl.constexpr(Rounding.STOCHASTIC.code)
_OVF = {"saturate": 0, "inf": 1, "nan": 2}
_SPEC = {"ieee": 0, "fn": 1, "fnuz": 2, "none": 3}

BLOCK = 2048
NUM_WARPS = 8


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


@triton.jit
def _random31(offs, seed_mix):
    """31 random bits per element: lowbias32(index + seed), identical to reference.random31."""
    offs = offs.to(tl.int64)
    key = (offs & 0xFFFFFFFF) + seed_mix + (offs >> 32) * 0x632BE5AB
    x = (key & 0xFFFFFFFF).to(tl.uint32)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return (x >> 1).to(tl.int32)


@triton.jit
def _flag_nan(flag_ptr, nan):
    """flag[0] = 1 if any lane saw a NaN it cannot encode; one atomic per program, only then."""
    any_nan = tl.max(nan.to(tl.int32), axis=0)
    tl.atomic_max(flag_ptr, any_nan, mask=any_nan > 0)


@triton.jit
def _pow2_scale(v, E: tl.constexpr):
    """v * 2**E, exact for any E in [-300, 300] as long as the result is representable."""
    if E > 100:
        v = v * 2.0**100
        v = v * (2.0 ** (E - 100))
    elif E < -100:
        v = v * 2.0**-100
        v = v * (2.0 ** (E + 100))
    else:
        v = v * (2.0**E)
    return v


@triton.jit
def _round_float(
    x, rnd,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr, HAS_NZ: tl.constexpr,
    ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr, MODE: tl.constexpr,
):
    """Round float32 ``x`` (``rnd``: 31 random bits, MODE 5 only) to the format's grid.  Returns the
    rounded |x| as float32 bits (``mag``, before specials), the pieces the code path needs, and the
    special-value masks; ``_finish_value`` / the kernel's code path turn them into outputs."""
    # ---- decompose -------------------------------------------------------------------------
    bits = x.to(tl.int32, bitcast=True)
    neg = bits < 0
    a = bits & 0x7FFFFFFF  # |x| as bits
    ax = a.to(tl.float32, bitcast=True)
    S: tl.constexpr = 23 - MAN
    MASK: tl.constexpr = (1 << S) - 1

    # ---- normal range of the target: round the bit pattern at bit S ------------------------
    if S == 0:
        r_norm = a
    else:
        if MODE == ROUND_NEAREST:
            if MAN == 0:  # the code's low bit is the exponent's: (E - 127 + BIAS) & 1
                lsb = ((a >> 23) + (BIAS + 1)) & 1
            else:
                lsb = (a >> S) & 1
            add = (MASK >> 1) + lsb
        elif MODE == ROUND_NEAREST_AWAY:
            add = tl.full(a.shape, 1 << (S - 1), tl.int32)
        elif MODE == ROUND_TOWARD_ZERO:
            add = tl.zeros(a.shape, tl.int32)
        elif MODE == ROUND_UP:
            add = tl.where(neg, 0, MASK)
        elif MODE == ROUND_DOWN:
            add = tl.where(neg, MASK, 0)
        else:
            add = MASK ^ (rnd >> (31 - S))
        r_norm = (a + add) & ~MASK

    # ---- below min normal: constant quantum q = 2**QE_LOW ------------------------------------
    below = a < MIN_NORMAL_BITS
    ax = tl.where(below, ax, 0.0)  # keep the unused lanes finite
    if MODE == ROUND_NEAREST and ZERO:
        C: tl.constexpr = 2.0 ** (QE_LOW + 23)
        m_low = (ax + C) - C  # float RNE to a multiple of q; the sum's last bit is the code's
        kept_low = _pow2_scale(m_low, -QE_LOW).to(tl.int32)
    else:
        t = _pow2_scale(ax, -QE_LOW)  # exact; t < 2**(MAN + 1)
        fl = tl.floor(t)
        frac = t - fl
        kept_low = fl.to(tl.int32)
        nz = frac > 0
        if MODE == ROUND_NEAREST:  # ties to the even code; code = LOW_BASE + kept (<< MAN without subnormals)
            if SUBNORMALS:
                odd = ((LOW_BASE + kept_low) & 1) == 1
            else:
                odd = ((LOW_BASE + (kept_low << MAN)) & 1) == 1
            up = (frac > 0.5) | ((frac == 0.5) & odd)
        elif MODE == ROUND_NEAREST_AWAY:
            up = frac >= 0.5
        elif MODE == ROUND_TOWARD_ZERO:
            up = frac < 0.0
        elif MODE == ROUND_UP:
            up = nz & ~neg
        elif MODE == ROUND_DOWN:
            up = nz & neg
        else:
            up = rnd < tl.floor(frac * 2147483648.0).to(tl.int32)
        kept_low = kept_low + up.to(tl.int32)
        m_low = _pow2_scale(kept_low.to(tl.float32), QE_LOW)
    mag = tl.where(below, m_low.to(tl.int32, bitcast=True), r_norm)  # rounded |x| as f32 bits

    # ---- specials ------------------------------------------------------------------------------
    is_nan = a > 0x7F800000
    is_inf = a == 0x7F800000
    is_zero = a == 0
    too_big = (mag > MAX_BITS) | is_inf
    if OVERFLOW == 0:
        to_max = too_big
    elif MODE == ROUND_TOWARD_ZERO:
        to_max = too_big & ~is_inf
    elif MODE == ROUND_UP:
        to_max = too_big & neg & ~is_inf
    elif MODE == ROUND_DOWN:
        to_max = too_big & ~neg & ~is_inf
    else:  # nearest / stochastic: past max is overflow
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
    if not HAS_NZ and ZERO:  # no -0: a zero result drops the sign
        keep_sign = keep_sign & (mag != 0)

    if ZERO:
        to_min = is_zero & ~is_zero  # a format with zero has no "round up to min" case
    return bits, a, neg, mag, kept_low, below, to_max, to_over, to_nan, to_min, keep_sign


@triton.jit
def _finish_value(bits, a, mag, to_max, to_over, to_nan, to_min, keep_sign,
                  MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, SIGNED: tl.constexpr, ZERO: tl.constexpr):
    """Apply the special-value masks to the rounded magnitude and restore the sign: float32 values."""
    mag = tl.where(to_max, MAX_BITS, mag)
    if not ZERO:
        mag = tl.where(to_min, MIN_BITS, mag)
    mag = tl.where(to_over, 0x7F800000, mag)
    if SIGNED:
        mag = tl.where(keep_sign, mag | (bits ^ a), mag)  # bits ^ a: the sign bit alone
    mag = tl.where(to_nan, 0x7FC00000, mag)
    return mag.to(tl.float32, bitcast=True)


@triton.jit
def _finite_code(mag, kept_low, below, to_max, to_over, to_min, keep_sign,
                 MAN: tl.constexpr, BIAS: tl.constexpr, SPECIALS: tl.constexpr, OVERFLOW: tl.constexpr,
                 SIGNED: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, CODE_MAX: tl.constexpr,
                 CODE_MIN: tl.constexpr, CODE_INF: tl.constexpr, SIGN_BIT: tl.constexpr, LOW_BASE: tl.constexpr):
    """The code of a rounded value (``_round_float``'s outputs), NaN excepted (callers differ there):
    normal -> exponent/mantissa fields of the f32 result; below min normal -> kept; saturation, Inf, sign."""
    S: tl.constexpr = 23 - MAN
    code = (((mag >> 23) - (127 - BIAS)) << MAN) | ((mag >> S) & ((1 << MAN) - 1))
    if SUBNORMALS:
        code_low = LOW_BASE + kept_low
    else:
        code_low = LOW_BASE + (kept_low << MAN)
    code = tl.where(below, code_low, code)
    code = tl.where(mag == 0, 0, code)
    code = tl.where(to_max, CODE_MAX, code)
    if not ZERO:
        code = tl.where(to_min, CODE_MIN, code)
    if SPECIALS == 0:
        code = tl.where(to_over & (OVERFLOW == 1), CODE_INF, code)
    if SIGNED:
        code = tl.where(keep_sign, code | SIGN_BIT, code)
    return code


@triton.jit
def round_to_format(
    x,
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, OVERFLOW: tl.constexpr, SIGNED: tl.constexpr,
    HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr, LOW_BASE: tl.constexpr,
    MODE: tl.constexpr,
):
    """Device-level cast of a float32 register tensor (deterministic MODEs 0..4), for kernels that
    round inside a computation (the emulated-accumulator GEMM).  Same code as the cast kernel."""
    bits, a, neg, mag, kept_low, below, to_max, to_over, to_nan, to_min, keep_sign = _round_float(
        x, 0, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS,
        LOW_BASE, MODE)
    return _finish_value(bits, a, mag, to_max, to_over, to_nan, to_min, keep_sign, MAX_BITS, MIN_BITS, SIGNED, ZERO)


@triton.jit(do_not_specialize=["seed_mix"])  # a new seed must not mean a new compile
def _float_round_kernel(
    x_ptr, out_ptr, n, seed_mix, flag_ptr,
    # -- the target format (FloatFormat), folded at compile time --
    MAN: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, QE_LOW: tl.constexpr,
    MAX_BITS: tl.constexpr, MIN_BITS: tl.constexpr, SPECIALS: tl.constexpr, OVERFLOW: tl.constexpr,
    SIGNED: tl.constexpr, HAS_NZ: tl.constexpr, ZERO: tl.constexpr, SUBNORMALS: tl.constexpr,
    CODE_MAX: tl.constexpr, CODE_MIN: tl.constexpr, CODE_INF: tl.constexpr, CODE_NAN: tl.constexpr,
    SIGN_BIT: tl.constexpr, LOW_BASE: tl.constexpr,
    # -- what to do --
    MODE: tl.constexpr, WRITE_CODES: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float32)

    if MODE == ROUND_STOCHASTIC:
        rnd = _random31(offs, seed_mix)
    else:
        rnd = 0
    bits, a, neg, mag, kept_low, below, to_max, to_over, to_nan, to_min, keep_sign = _round_float(
        x, rnd, MAN, BIAS, MIN_NORMAL_BITS, QE_LOW, MAX_BITS, OVERFLOW, SIGNED, HAS_NZ, ZERO, SUBNORMALS,
        LOW_BASE, MODE)

    if WRITE_CODES:
        code = _finite_code(mag, kept_low, below, to_max, to_over, to_min, keep_sign, MAN, BIAS, SPECIALS,
                            OVERFLOW, SIGNED, ZERO, SUBNORMALS, CODE_MAX, CODE_MIN, CODE_INF, SIGN_BIT, LOW_BASE)
        if SPECIALS <= 1:  # ieee / fn: NaN keeps its sign
            nan_code = tl.where(neg & SIGNED, CODE_NAN | SIGN_BIT, CODE_NAN)
        else:
            nan_code = tl.full(code.shape, CODE_NAN, tl.int32)
        code = tl.where(to_nan, nan_code, code)
        tl.store(out_ptr + offs, code.to(out_ptr.dtype.element_ty), mask=inb)
        if CODE_NAN < 0:  # no NaN code: raise a flag (the op layer turns it into an error)
            _flag_nan(flag_ptr, (a > 0x7F800000) & inb)
    else:
        y = _finish_value(bits, a, mag, to_max, to_over, to_nan, to_min, keep_sign, MAX_BITS, MIN_BITS, SIGNED, ZERO)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=inb)


@triton.jit(do_not_specialize=["seed_mix"])
def _int_round_kernel(
    x_ptr, out_ptr, n, seed_mix, flag_ptr,
    OFFSET: tl.constexpr, STEP: tl.constexpr, N_CODES: tl.constexpr, TWOS_MASK: tl.constexpr,
    PARITY_OFFSET: tl.constexpr,
    MODE: tl.constexpr, WRITE_CODES: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    x = tl.load(x_ptr + offs, mask=inb, other=0.0).to(tl.float32)
    is_nan = x != x
    xc = tl.where(is_nan, 0.0, x)
    xc = tl.minimum(tl.maximum(xc, OFFSET - 4.0), OFFSET + STEP * (N_CODES - 1) + 4.0)  # saturates Inf
    n = tl.where(xc < 0, tl.ceil(xc), tl.floor(xc))  # trunc
    g = xc - n  # exact, in (-1, 1); see reference._round_int_core
    gneg = g < 0
    gnz = g != 0
    T = n.to(tl.int32) - OFFSET - gneg.to(tl.int32)
    neg = x.to(tl.int32, bitcast=True) < 0  # the sign bit: -0 rounds like a negative value
    if STEP == 2:  # code index u = T/2 + G/2, G = g + [g < 0]
        u = T >> 1
        odd = (T & 1) == 1
        gt_half = odd & gnz
        eq_half = odd & ~gnz
        nz = odd | gnz
        frac31 = ((T & 1) << 30) + tl.floor(g * 1073741824.0).to(tl.int32) + (gneg.to(tl.int32) << 30)
    else:
        u = T
        gt_half = (g > 0.5) | (gneg & (g > -0.5))
        eq_half = (g == 0.5) | (g == -0.5)
        nz = gnz
        fl31 = tl.floor(g * 2147483648.0).to(tl.int32)  # in [-2**31, 2**31)
        frac31 = tl.where(gneg, (fl31 + 2147483647) + 1, fl31)  # floor(G * 2**31), no overflow
    if MODE == ROUND_NEAREST:  # ties to the even stored code (value parity for twos)
        up = gt_half | (eq_half & (((u + PARITY_OFFSET) & 1) == 1))
    elif MODE == ROUND_NEAREST_AWAY:
        up = gt_half | (eq_half & ~neg)
    elif MODE == ROUND_TOWARD_ZERO:  # the same-signed neighbour nearer zero (pmN has no 0): as the reference
        v_lo = u * STEP + OFFSET
        up = nz & tl.where(neg, v_lo + STEP <= 0, v_lo < 0)
    elif MODE == ROUND_UP:
        up = nz
    elif MODE == ROUND_DOWN:
        up = tl.zeros(nz.shape, tl.int1)
    else:
        up = _random31(offs, seed_mix) < frac31
    u = u + up.to(tl.int32)
    u = tl.minimum(tl.maximum(u, 0), N_CODES - 1)
    if WRITE_CODES:
        if TWOS_MASK != 0:
            u = (u + OFFSET) & TWOS_MASK
        tl.store(out_ptr + offs, u.to(out_ptr.dtype.element_ty), mask=inb)
        _flag_nan(flag_ptr, is_nan & inb)
    else:
        v = (u * STEP + OFFSET).to(tl.float32)
        v = tl.where(is_nan, float("nan"), v)
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=inb)


# ----------------------------------------------------------------------------------------------
# Wrappers: check, allocate, launch
# ----------------------------------------------------------------------------------------------


def _float_constexprs(fmt: FloatFormat) -> dict:
    qe_low = fmt.emin - fmt.man if fmt.subnormals else fmt.emin
    return dict(
        # the bit-pattern route needs a float32-normal input: below 2**-126 use the constant quantum
        MAN=fmt.man, BIAS=fmt.bias, MIN_NORMAL_BITS=max(_f32_bits(fmt.min_normal), 0x00800000), QE_LOW=qe_low,
        MAX_BITS=_f32_bits(fmt.max), MIN_BITS=_f32_bits(fmt.min_subnormal), SPECIALS=_SPEC[fmt.specials],
        OVERFLOW=_OVF[fmt.overflow], SIGNED=fmt.signed, HAS_NZ=fmt.has_negative_zero, ZERO=fmt.zero,
        SUBNORMALS=fmt.subnormals, CODE_MAX=fmt.code_of_max, CODE_MIN=fmt.code_of_min,
        CODE_INF=fmt.code_of_inf or 0, CODE_NAN=fmt.code_of_nan if fmt.code_of_nan is not None else -1,
        SIGN_BIT=fmt.sign_bit - (1 << 32) if fmt.sign_bit >= 1 << 31 else fmt.sign_bit,  # as int32
        LOW_BASE=((1 if fmt.zero else 0) - 1) << fmt.man,
    )


def _launch(x: torch.Tensor, fmt, rounding: str, seed: int | None, out: torch.Tensor, write_codes: bool,
            flag: torch.Tensor | None = None):
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"the Triton cast kernel takes float32/float16/bfloat16, got {x.dtype}")
    xf = x.contiguous().view(-1)
    n = xf.numel()
    if n == 0:
        return out
    mix = ref.seed_mix(seed) if seed is not None else 0
    grid = (cdiv(n, BLOCK),)
    if flag is None:
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    if isinstance(fmt, IntFormat):
        _int_round_kernel[grid](
            xf, out.view(-1), n, mix, flag, OFFSET=fmt.offset, STEP=fmt.step, N_CODES=fmt.n_codes,
            TWOS_MASK=(fmt.n_codes - 1) if fmt.encoding == "twos" else 0,
            PARITY_OFFSET=(fmt.offset & 1) if fmt.encoding == "twos" else 0,
            MODE=Rounding(rounding).code, WRITE_CODES=write_codes, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
    else:
        _float_round_kernel[grid](
            xf, out.view(-1), n, mix, flag, **_float_constexprs(fmt),
            MODE=Rounding(rounding).code, WRITE_CODES=write_codes, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
    return out


def cast(x: torch.Tensor, fmt, rounding: str = "nearest", seed: int | None = None) -> torch.Tensor:
    """Values of ``fmt`` in x's dtype (fp32/fp16/bf16)."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return _launch(x, fmt, rounding, seed, out, write_codes=False)


def encode(x: torch.Tensor, fmt, rounding: str = "nearest", seed: int | None = None,
           out_dtype: torch.dtype = torch.int32, nan_flag: torch.Tensor | None = None) -> torch.Tensor:
    """Codes as bit patterns in ``out_dtype`` (truncated to its width).  For formats without a
    NaN code, ``nan_flag`` (int32, one element, zeroed) is set to 1 if x held a NaN."""
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    return _launch(x, fmt, rounding, seed, out, write_codes=True, flag=nan_flag)
