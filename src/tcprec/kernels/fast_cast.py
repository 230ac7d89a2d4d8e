"""The reference backend's float32 cast: the Triton cast kernel's algorithm (``triton/cast.py``) in
plain torch int32 / float32 ops, so it runs at memory-bound speed on any device torch supports.

``reference.py`` states the rounding once, for float32 and float64, in int64 / float64 arithmetic
on a per-element shift: the specification, and slow (70-750 ms for 2**20 elements on a CPU core).
Here a float32 input is rounded on its own bit pattern, by region of ``|x|``:

* ``|x| >= min normal`` of the target: the quantum sits at the fixed bit ``S = 23 - man`` of the
  pattern, so ``r = (a + add) & ~(2**S - 1)`` with ``add`` chosen by the mode (nearest-even:
  ``mask/2 + lsb``; stochastic: ``mask ^ (top S random bits)``).  A carry out of the mantissa bumps
  the exponent: the next binade, exactly.
* below it the quantum is the constant ``q = 2**QE_LOW``; ``t = |x| / q``, ``floor(t)`` and its
  fraction are exact in float32 and the mode decides from the fraction.

then the format's specials (NaN, Inf, overflow, -0, unsigned, zero-less).  Integer formats use the
code index ``u = (x - offset) / step`` with exact float32 trunc / fraction arithmetic.  Same bits as
``reference.py``: tests compare the two on every float16 pattern and millions of float32 patterns,
every mode.  ``supports(fmt)`` says which formats take this route; the others (more than 23
mantissa bits, quanta below float32's normal range) stay on ``reference.py``.
"""

from __future__ import annotations

import struct

import torch

from ..formats import FloatFormat, IntFormat
from . import reference as ref

__all__ = ["supports", "cast", "encode"]

_F32_MIN_NORMAL_BITS = 0x00800000
_F32_INF_BITS = 0x7F800000
_F32_QNAN_BITS = 0x7FC00000


def _f32_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


def _qe_low(fmt: FloatFormat) -> int:
    return fmt.emin - fmt.man if fmt.subnormals else fmt.emin


def supports(fmt) -> str | None:
    """None if fmt takes the int32 route, else the reason it stays on the int64 reference."""
    if isinstance(fmt, IntFormat):
        return None
    if fmt.man > 23:
        return f"{fmt} has {fmt.man} mantissa bits, more than float32's 23"
    if _qe_low(fmt) + 23 < -126 or fmt.max > torch.finfo(torch.float32).max:
        return f"{fmt}'s range reaches past float32's normal range"
    return None


# Formats torch converts to natively, round to nearest-even with the same specials as the spec
# (tests/test_fast_cast.py checks each against reference.py on every float16 pattern and more).
# Not float8_e4m3fn: torch 2.13 saturates its overflow at 448 where the format (and ml_dtypes) give NaN.
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float8_e5m2": torch.float8_e5m2, "float8_e4m3fnuz": torch.float8_e4m3fnuz,
                 "float8_e5m2fnuz": torch.float8_e5m2fnuz}


def _pow2_scale(v: torch.Tensor, e: int) -> torch.Tensor:
    """v * 2**e in float32, exact while the result is representable (two steps beyond 2**+-100)."""
    while e > 100:
        v, e = v * 2.0**100, e - 100
    while e < -100:
        v, e = v * 2.0**-100, e + 100
    return v * 2.0**e


def _random31(x: torch.Tensor, seed: int) -> torch.Tensor:
    """``reference.random31`` in int32 (x's shape): lowbias32 with wrapping multiplies and logical
    shifts written as arithmetic shift + mask.  Fewer than 2**31 elements (else: the int64 form)."""
    n = x.numel()
    if n >= 1 << 31:
        return ref.random31(n, seed, x.device).to(torch.int32).view(x.shape)
    h = torch.arange(n, dtype=torch.int32, device=x.device)
    h += ref.seed_mix(seed)  # the key (index + mix) mod 2**32, as int32
    h ^= (h >> 16) & 0xFFFF
    h *= 0x7FEB352D
    h ^= (h >> 15) & 0x1FFFF
    h *= 0x846CA68B - (1 << 32)  # the same multiplier mod 2**32
    h ^= (h >> 16) & 0xFFFF
    return ((h >> 1) & 0x7FFFFFFF).view(x.shape)


# ------------------------------------------------------------------------------------------------
# Float formats
# ------------------------------------------------------------------------------------------------


def _round_float(x: torch.Tensor, fmt: FloatFormat, rounding: str, rnd: torch.Tensor | None):
    """Round float32 ``x`` (``rnd``: its 31 random bits, stochastic only), every region and special:
    the rounded |x| as float32 bits (``mag``) and the masks the outputs need."""
    man, S = fmt.man, 23 - fmt.man
    mask = (1 << S) - 1
    qe_low = _qe_low(fmt)
    bits = x.contiguous().view(torch.int32)  # (*shape) int32, the float32 pattern
    neg = bits < 0
    a = bits & 0x7FFFFFFF  # |x| as bits

    # ---- normal range of the target: round the bit pattern at bit S ------------------------------
    if S == 0:
        r_norm = a
    else:
        if rounding == "nearest":
            if man == 0:  # the code's low bit is the exponent's: (E - 127 + bias) & 1
                lsb = ((a >> 23) + (fmt.bias + 1)) & 1
            else:
                lsb = (a >> S) & 1
            add = lsb + (mask >> 1)
        elif rounding == "nearest_away":
            add = 1 << (S - 1)
        elif rounding == "toward_zero":
            add = 0
        elif rounding == "up":
            add = torch.where(neg, 0, mask).to(torch.int32)
        elif rounding == "down":
            add = torch.where(neg, mask, 0).to(torch.int32)
        else:
            add = mask ^ (rnd >> (31 - S))
        r_norm = (a + add) & ~mask

    # ---- below min normal: constant quantum q = 2**qe_low ----------------------------------------
    below = a < max(_f32_bits(fmt.min_normal), _F32_MIN_NORMAL_BITS)
    ax = torch.where(below, a, 0).view(torch.float32)  # keep the unused lanes finite
    if rounding == "nearest" and fmt.zero:
        c = 2.0 ** (qe_low + 23)
        m_low = (ax + c) - c  # float RNE to a multiple of q; the sum's last bit is the code's
        kept_low = _pow2_scale(m_low, -qe_low).to(torch.int32)
    else:
        t = _pow2_scale(ax, -qe_low)  # exact; t < 2**(man + 1)
        fl = torch.floor(t)
        frac = t - fl
        kept_low = fl.to(torch.int32)
        if rounding == "nearest":  # zero-less formats: ties to the even code
            low_base = ((1 if fmt.zero else 0) - 1) << man
            lowcode = low_base + (kept_low if fmt.subnormals else kept_low << man)
            up = (frac > 0.5) | ((frac == 0.5) & ((lowcode & 1) == 1))
        elif rounding == "nearest_away":
            up = frac >= 0.5
        elif rounding == "toward_zero":
            up = None
        elif rounding == "up":
            up = (frac > 0) & ~neg
        elif rounding == "down":
            up = (frac > 0) & neg
        else:
            up = rnd < torch.floor(frac * 2147483648.0).to(torch.int32)
        if up is not None:
            kept_low = kept_low + up.to(torch.int32)
        m_low = _pow2_scale(kept_low.to(torch.float32), qe_low)
    mag = torch.where(below, m_low.view(torch.int32), r_norm)  # rounded |x| as float32 bits

    # ---- specials ----------------------------------------------------------------------------------
    is_nan = a > _F32_INF_BITS
    is_inf = a == _F32_INF_BITS
    is_zero = a == 0
    too_big = (mag > _f32_bits(fmt.max)) | is_inf
    if fmt.overflow == "saturate":
        to_max = too_big
    elif rounding == "toward_zero":  # IEEE: directed rounding never rounds a finite value past max
        to_max = too_big & ~is_inf
    elif rounding == "up":
        to_max = too_big & neg & ~is_inf
    elif rounding == "down":
        to_max = too_big & ~neg & ~is_inf
    else:  # nearest / stochastic: past max is overflow
        to_max = torch.zeros_like(too_big)
    to_over = too_big & ~to_max
    to_nan = is_nan
    if fmt.overflow == "nan":
        to_nan = to_nan | to_over
    if not fmt.signed:
        to_nan = to_nan | (neg & ~is_zero)
    to_min = None
    if not fmt.zero:
        to_nan = to_nan | is_zero  # ml_dtypes: 0 -> NaN in e8m0
        to_min = (mag == 0) & ~is_zero  # nonzero values below min: nearest is min
    keep_sign = neg
    if not fmt.has_negative_zero and fmt.zero:  # no -0: a zero result drops the sign
        keep_sign = keep_sign & (mag != 0)
    return bits, a, neg, mag, kept_low, below, to_max, to_over, to_nan, to_min, keep_sign


def _cast_float(x: torch.Tensor, fmt: FloatFormat, rounding: str, rnd: torch.Tensor | None) -> torch.Tensor:
    bits, a, _, mag, _, _, to_max, to_over, to_nan, to_min, keep_sign = _round_float(x, fmt, rounding, rnd)
    mag = torch.where(to_max, _f32_bits(fmt.max), mag)
    if to_min is not None:
        mag = torch.where(to_min, _f32_bits(fmt.min_subnormal), mag)
    mag = torch.where(to_over, _F32_INF_BITS, mag)
    if fmt.signed:
        mag = torch.where(keep_sign, mag | (bits ^ a), mag)  # bits ^ a: the sign bit alone
    mag = torch.where(to_nan, _F32_QNAN_BITS, mag)
    return mag.view(torch.float32)


def _encode_float(x: torch.Tensor, fmt: FloatFormat, rounding: str, rnd: torch.Tensor | None) -> torch.Tensor:
    """int32 codes (bit patterns; 32-bit formats wrapped into int32), -1 for NaN without a NaN code."""
    _, _, neg, mag, kept_low, below, to_max, to_over, to_nan, to_min, keep_sign = _round_float(
        x, fmt, rounding, rnd)
    man, S = fmt.man, 23 - fmt.man
    code = (((mag >> 23) - (127 - fmt.bias)) << man) | ((mag >> S) & ((1 << man) - 1))
    low_base = ((1 if fmt.zero else 0) - 1) << man
    code_low = low_base + (kept_low if fmt.subnormals else kept_low << man)
    code = torch.where(below, code_low, code)
    code = torch.where(mag == 0, 0, code)
    code = torch.where(to_max, fmt.code_of_max, code)
    if to_min is not None:
        code = torch.where(to_min, fmt.code_of_min, code)
    if fmt.has_inf:
        code = torch.where(to_over, fmt.code_of_inf, code)
    sign_bit = fmt.sign_bit - (1 << 32) if fmt.sign_bit >= 1 << 31 else fmt.sign_bit  # as int32
    if fmt.signed:
        code = torch.where(keep_sign, code | sign_bit, code)
    if fmt.code_of_nan is None:
        nan_code = -1
    elif fmt.specials in ("ieee", "fn") and fmt.signed:  # NaN keeps its sign
        nan_code = torch.where(neg, fmt.code_of_nan | sign_bit, fmt.code_of_nan).to(torch.int32)
    else:
        nan_code = fmt.code_of_nan
    return torch.where(to_nan, nan_code, code)


def _float(x: torch.Tensor, fmt: FloatFormat, rounding: str, seed: int | None, codes: bool) -> torch.Tensor:
    """The common case in a dozen in-place int32 ops: every lane rounded at bit S as a normal of the
    target; the few lanes where that is wrong (below min normal, past max, NaN / Inf, negative into
    an unsigned format) are gathered and redone by ``_round_float``'s full case analysis.  Two int32
    and two bool buffers in all: on a CPU a fresh buffer per op costs more than the op."""
    shape = x.shape
    xf = x.contiguous().view(-1)
    if not codes and rounding == "nearest" and str(fmt) in _TORCH_DTYPES:
        return xf.to(_TORCH_DTYPES[str(fmt)]).to(torch.float32).view(shape)  # torch's own RNE conversion
    bits = xf.view(torch.int32)  # (n,) int32, the float32 pattern (x's memory: never written)
    rnd = _random31(bits, seed) if rounding == "stochastic" else None
    man, S = fmt.man, 23 - fmt.man
    mask = (1 << S) - 1
    a = bits & 0x7FFFFFFF  # |x| as bits
    if S == 0:
        r = a.clone()
    else:
        if rounding == "nearest":  # add = mask/2 + the code's low bit
            if man == 0:  # ... which is the exponent's: (E - 127 + bias) & 1
                r = torch.bitwise_right_shift(a, 23).add_(fmt.bias + 1).bitwise_and_(1)
            else:
                r = torch.bitwise_right_shift(a, S).bitwise_and_(1)
            r.add_(mask >> 1)
        elif rounding in ("nearest_away", "toward_zero"):
            r = torch.full_like(a, (1 << (S - 1)) if rounding == "nearest_away" else 0)
        elif rounding == "up":
            r = torch.bitwise_right_shift(bits, 31).bitwise_not_().bitwise_and_(mask)  # mask where x >= 0
        elif rounding == "down":
            r = torch.bitwise_right_shift(bits, 31).bitwise_and_(mask)  # mask where x < 0
        else:
            r = torch.bitwise_right_shift(rnd, 31 - S).bitwise_xor_(mask)
        r.add_(a).bitwise_and_(~mask)  # (a + add) & ~mask; NaNs with a large payload may wrap: caught below
    min_normal_bits = max(_f32_bits(fmt.min_normal), _F32_MIN_NORMAL_BITS)
    below = None
    if rounding == "nearest" and fmt.zero and fmt.has_negative_zero and fmt.signed:
        # below min normal the quantum is q = 2**qe_low: RNE to a multiple of q is (|x| + C) - C in
        # float32 (the sum's last bit is kept's), as in the Triton kernel; fp4 has most of randn here
        below = torch.lt(a, min_normal_bits)
        qe_low = _qe_low(fmt)
        c = 2.0 ** (qe_low + 23)
        m_low = torch.where(below, a, 0).view(torch.float32).add_(c).sub_(c)
        low = m_low.view(torch.int32)
        if codes:  # back into the normal lanes' code form, ((E << man) | mantissa) << S, undone below
            kept = _pow2_scale(m_low, -qe_low).to(torch.int32)
            code_low = kept if fmt.subnormals else kept << man  # formats with zero: no code offset
            low = (code_low + ((127 - fmt.bias) << man)) << S
        r = torch.where(below, low, r)
        ex = torch.gt(r, _f32_bits(fmt.max))  # past max, Inf, NaN (wrapped or not)
        ex.bitwise_or_(torch.ge(a, _F32_INF_BITS))
    else:
        # exceptions; unsigned formats: negative patterns are < min normal as int32, so they are caught too
        ex = torch.lt(a if fmt.signed else bits, min_normal_bits)
        tmp = torch.gt(r, _f32_bits(fmt.max))
        ex.bitwise_or_(tmp)
        ex.bitwise_or_(torch.lt(r, 0, out=tmp))
    sign = a  # a is spent: reuse it
    if codes:
        out = r.bitwise_right_shift_(S).sub_((127 - fmt.bias) << man)  # (E << man | mantissa), fmt's bias
        if fmt.signed:
            sb = fmt.sign_bit - (1 << 32) if fmt.sign_bit >= 1 << 31 else fmt.sign_bit  # as int32
            out.bitwise_or_(torch.bitwise_right_shift(bits, 31, out=sign).bitwise_and_(sb))
    else:
        out = r if not fmt.signed else r.bitwise_or_(torch.bitwise_and(bits, -(1 << 31), out=sign))
    n_ex = int(ex.sum())
    if n_ex > bits.numel() // 4:  # mostly exceptions (|x| below min normal of fp4, ...): no gather
        return (_encode_float(xf, fmt, rounding, rnd) if codes else _cast_float(xf, fmt, rounding, rnd)).view(shape)
    if n_ex:
        idx = ex.nonzero().squeeze(1)  # (k,) the exception lanes, usually few
        re = None if rnd is None else rnd[idx]
        xe = xf[idx]
        out[idx] = _encode_float(xe, fmt, rounding, re) if codes else _cast_float(xe, fmt, rounding, re).view(torch.int32)
    out = out.view(shape)
    return out if codes else out.view(torch.float32)


# ------------------------------------------------------------------------------------------------
# Integer formats
# ------------------------------------------------------------------------------------------------


def _round_int(x: torch.Tensor, fmt: IntFormat, rounding: str, seed: int | None):
    """Code index u in 0..2**bits-1 (int32; value = offset + step * u) and the NaN mask."""
    step, offset = fmt.step, fmt.offset
    is_nan = torch.isnan(x)
    xc = torch.where(is_nan, 0.0, x).clamp(offset - 4.0, offset + step * (fmt.n_codes - 1) + 4.0)  # saturates Inf
    n = torch.trunc(xc)
    g = xc - n  # exact, in (-1, 1); see reference._round_int_core
    gneg = g < 0
    gnz = g != 0
    T = n.to(torch.int32) - offset - gneg.to(torch.int32)
    neg = x.view(torch.int32) < 0  # the sign bit: -0 rounds like a negative value
    if step == 2:  # u = T/2 + G/2, G = g + [g < 0]
        u = T >> 1
        odd = (T & 1) == 1
        gt_half = odd & gnz
        eq_half = odd & ~gnz
        nz = odd | gnz
    else:
        u = T
        gt_half = (g > 0.5) | (gneg & (g > -0.5))
        eq_half = g.abs() == 0.5
        nz = gnz
    if rounding == "nearest":  # ties to the even stored code (value parity for twos)
        parity = (offset & 1) if fmt.encoding == "twos" else 0
        up = gt_half | (eq_half & (((u + parity) & 1) == 1))
    elif rounding == "nearest_away":
        up = gt_half | (eq_half & ~neg)
    elif rounding == "toward_zero":  # the same-signed neighbour nearer zero (pmN has no 0)
        v_lo = u * step + offset
        up = nz & torch.where(neg, v_lo + step <= 0, v_lo < 0)
    elif rounding == "up":
        up = nz
    elif rounding == "down":
        up = None
    else:
        if step == 2:
            frac31 = ((T & 1) << 30) + torch.floor(g * 1073741824.0).to(torch.int32) + (gneg.to(torch.int32) << 30)
        else:
            fl31 = torch.floor(g * 2147483648.0).to(torch.int32)  # in [-2**31, 2**31)
            frac31 = torch.where(gneg, (fl31 + 2147483647) + 1, fl31)  # floor(G * 2**31), no overflow
        up = _random31(x, seed) < frac31
    if up is not None:
        u = u + up.to(torch.int32)
    return u.clamp_(0, fmt.n_codes - 1), is_nan


# ------------------------------------------------------------------------------------------------
# Entry points (float32 x; the op layer widens float16 / bfloat16 and keeps float64 on the reference)
# ------------------------------------------------------------------------------------------------


_STEP1 = {"nearest": torch.round, "toward_zero": torch.trunc, "up": torch.ceil, "down": torch.floor}


def _int_step1(x: torch.Tensor, fmt: IntFormat, rounding: str) -> torch.Tensor:
    """Consecutive integers (twos, unsigned), deterministic modes but nearest_away: one float32
    rounding op (torch.round is half-to-even, and the even value is the even code here) and a
    clamp, exact for every float32.  NaN stays NaN; -0 becomes +0 (the integer 0)."""
    v = _STEP1[rounding](x).clamp_(fmt.min, fmt.max)
    return v.add_(0.0)  # -0 + 0 = +0


def cast(x: torch.Tensor, fmt, rounding: str = "nearest", seed: int | None = None) -> torch.Tensor:
    """float32 ``x`` rounded to ``fmt``, as float32 values (the bits of ``reference.cast_*``)."""
    if isinstance(fmt, IntFormat) and fmt.step == 1 and rounding in _STEP1:
        return _int_step1(x, fmt, rounding)
    if isinstance(fmt, IntFormat):
        u, is_nan = _round_int(x, fmt, rounding, seed)
        v = (u * fmt.step + fmt.offset).to(torch.float32)
        return torch.where(is_nan, float("nan"), v)
    return _float(x, fmt, rounding, seed, codes=False)


def encode(x: torch.Tensor, fmt, rounding: str = "nearest", seed: int | None = None) -> torch.Tensor:
    """Codes of float32 ``x`` as int32 (the bits of ``reference.encode_*``; -1: NaN without a code)."""
    if isinstance(fmt, IntFormat) and fmt.step == 1 and rounding in _STEP1:
        v = _int_step1(x, fmt, rounding)
        nan = torch.isnan(v)
        c = v.nan_to_num_(0.0).to(torch.int32)
        c = c.bitwise_and_(fmt.n_codes - 1) if fmt.encoding == "twos" else c.sub_(fmt.offset)
        return c.masked_fill_(nan, -1)
    if isinstance(fmt, IntFormat):
        u, is_nan = _round_int(x, fmt, rounding, seed)
        if fmt.encoding == "twos":
            u = (u + fmt.offset) & (fmt.n_codes - 1)
        return torch.where(is_nan, -1, u)
    return _float(x, fmt, rounding, seed, codes=True)
