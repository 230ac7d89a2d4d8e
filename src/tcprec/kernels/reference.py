"""Pure-torch reference kernels: the ground truth for every fast kernel, and the backend on machines
without a GPU.  They run on any device torch supports and use only integer arithmetic on the
input's bit pattern, so they are exact and identical on CPU and GPU.

Float cast (one rounding, from the float32 or float64 bit pattern)
-----------------------------------------------------------------
Write a finite input as ``|x| = sig * 2**(Eu - SM)`` (``sig`` the significand with its implicit
bit, ``SM`` the source mantissa width: 23 or 52).  The target's quantum at ``x`` is ``2**qe`` with::

    qe = Eu - man            if Eu >= emin          (normal binade of the target)
    qe = emin - man          if subnormals           (target subnormal range)
    qe = emin                otherwise               (only 0 and min normal are near)

so ``shift = qe - (Eu - SM) >= 0`` source bits are dropped: ``kept = sig >> shift``, ``rem`` the
dropped bits.  The rounding mode decides whether ``kept`` goes up by one (ties-to-even looks at the
parity of the code, which is ``kept``'s low bit, or the exponent's for man=0 formats, as in gfloat).
The result ``kept * 2**qe`` is exact in the source type.  Overflow, NaN, Inf, -0 and unsigned
formats are applied after, by the format's ``specials``/``overflow`` rules.  The exponent is never
bounded above during rounding, so overflow happens exactly where IEEE 754 says it does.

Stochastic rounding rounds up with probability ``rem / 2**shift``, using a 31-bit counter-based
hash of (seed, element index): exact for shift <= 31, to 2**-31 otherwise.  The same hash runs in
the Triton kernel, so CPU and GPU give the same bits for the same seed.

Integer cast
------------
The value is mapped to a code index ``u = (x - fmt.offset) / fmt.step`` (step 2 for pm1), rounded
to an integer with the same modes, and clamped to ``0 .. 2**bits - 1`` (integers saturate).
``trunc(x)`` and ``x - trunc(x)`` are exact, so no rounding error creeps in before the one rounding.
"""

from __future__ import annotations

import torch

from ..formats import FloatFormat, IntFormat, ROUNDING_MODES

_M32 = 0xFFFFFFFF



def code_dtype(fmt) -> torch.dtype:
    """Storage dtype of codes: uint8 up to 8 bits, int16 up to 16, int32 above (bit patterns)."""
    bits = fmt.bits
    return torch.uint8 if bits <= 8 else torch.int16 if bits <= 16 else torch.int32

# Source float layouts: (mantissa bits, exponent bias, exponent bits)
_SRC = {torch.float32: (23, 127, 8), torch.float64: (52, 1023, 11)}


# ------------------------------------------------------------------------------------------------
# Random bits for stochastic rounding
# ------------------------------------------------------------------------------------------------


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 integer hash on uint32 values held in int64 (a bijection)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def seed_mix(seed: int) -> int:
    """Host-side mix of a user seed into the key offset both backends use (31 bits, so the
    kernel argument is always an int32)."""
    return int(hash32(torch.tensor([seed & _M32], dtype=torch.int64)).item()) >> 1


def random31(numel: int, seed: int, device, offset: int = 0) -> torch.Tensor:
    """31 uniform random bits per element, a pure function of (seed, element index)."""
    idx = torch.arange(offset, offset + numel, device=device, dtype=torch.int64)
    key = ((idx & _M32) + seed_mix(seed) + (idx >> 32) * 0x632BE5AB) & _M32
    return hash32(key) >> 1


# ------------------------------------------------------------------------------------------------
# Float formats
# ------------------------------------------------------------------------------------------------


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2**e in float64 for integer e in [-1022, 1023] (built from the exponent bits)."""
    return ((e + 1023) << 52).view(torch.float64)


def _round_float_core(x: torch.Tensor, fmt: FloatFormat, rounding: str, seed: int | None):
    """Round x (float32 or float64) to fmt's grid; returns the pieces cast and encode need."""
    SM, SB, SE = _SRC[x.dtype]
    nbits = SE + SM
    ibits = x.contiguous().view(torch.int32 if x.dtype == torch.float32 else torch.int64).to(torch.int64)
    if x.dtype == torch.float32:
        ibits = ibits & _M32
    neg = (ibits >> nbits) & 1
    a = ibits & ((1 << nbits) - 1)
    inf_bits = ((1 << SE) - 1) << SM
    is_nan = a > inf_bits
    is_inf = a == inf_bits
    E = a >> SM
    sig = torch.where(E > 0, (a & ((1 << SM) - 1)) | (1 << SM), a & ((1 << SM) - 1))
    ue = torch.clamp(E, min=1) - SB - SM  # |x| = sig * 2**ue
    # Eu = floor(log2|x|); for source subnormals sig < 2**SM, so take the true leading bit
    lead = torch.frexp(sig.to(torch.float64))[1].to(torch.int64) - 1
    Eu = torch.where(E > 0, E - SB, ue + lead)
    m, emin = fmt.man, fmt.emin
    qe_low = emin - m if fmt.subnormals else emin
    qe = torch.where(Eu >= emin, Eu - m, torch.full_like(Eu, qe_low))
    qe = torch.maximum(qe, ue)  # a target finer than the source here: nothing to round
    shift = qe - ue
    shift_c = torch.clamp(shift, max=SM + 2)  # beyond SM + 1 every bit is dropped and rem < half
    kept = sig >> shift_c
    rem = sig & ((1 << shift_c) - 1)
    half = (1 << shift_c) >> 1
    nonzero_rem = rem != 0
    if m > 0:
        odd = (kept & 1) == 1
    else:  # man = 0: the code's low bit is the exponent's (gfloat, P3109)
        odd = (kept != 0) & (((qe + fmt.bias) & 1) == 1)
    if rounding == "nearest":
        up = (rem > half) | ((rem == half) & odd & nonzero_rem)
    elif rounding == "nearest_away":
        up = (rem >= half) & nonzero_rem
    elif rounding == "toward_zero":
        up = torch.zeros_like(nonzero_rem)
    elif rounding == "up":
        up = nonzero_rem & (neg == 0)
    elif rounding == "down":
        up = nonzero_rem & (neg == 1)
    elif rounding == "stochastic":
        r = random31(x.numel(), seed, x.device).view(x.shape)
        # P(up) = rem / 2**shift: compare the top `shift` of 31 random bits with rem
        sh = torch.clamp(shift, max=62)
        thresh_hi = r >> torch.clamp(31 - sh, min=0)  # uniform in [0, 2**sh) when sh <= 31
        up_lo = thresh_hi < rem
        up_hi = r < (rem >> torch.clamp(sh - 31, min=0, max=62))
        up = torch.where(sh <= 31, up_lo, up_hi)
    else:  # pragma: no cover - validated by the op
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    kept = kept + up.to(torch.int64)
    mag = kept.to(torch.float64) * _pow2(qe)  # exact: kept <= 2**24, qe within float64's range
    return neg, mag, kept, qe, is_nan, is_inf, a == 0, (Eu < emin) & (sig != 0)


def _specials(fmt: FloatFormat, rounding: str, neg, mag, is_nan, is_inf, is_zero):
    """Masks for the values that leave the grid: overflow to max / Inf / NaN, unsigned, no-zero."""
    too_big = (mag > fmt.max) | is_inf
    if fmt.overflow == "saturate":
        to_max = too_big
    else:  # IEEE: directed rounding never rounds a finite value past max
        if rounding == "toward_zero":
            clamp_dir = torch.ones_like(too_big)
        elif rounding == "up":
            clamp_dir = neg == 1
        elif rounding == "down":
            clamp_dir = neg == 0
        else:
            clamp_dir = torch.zeros_like(too_big)
        to_max = too_big & clamp_dir & ~is_inf
    to_over = too_big & ~to_max  # -> Inf (overflow="inf") or NaN (overflow="nan")
    to_nan = is_nan.clone()
    if fmt.overflow == "nan":
        to_nan |= to_over
        to_over = torch.zeros_like(to_over)
    if not fmt.signed:
        to_nan |= (neg == 1) & ~is_zero  # negative values have no code
    to_min = torch.zeros_like(too_big)
    if not fmt.zero:
        to_nan |= is_zero  # ml_dtypes: 0 -> NaN in e8m0
        to_min = (mag == 0) & ~is_zero & ~to_nan  # nonzero values below min: nearest is min
    return to_max, to_over, to_nan, to_min


def cast_float(x: torch.Tensor, fmt: FloatFormat, rounding: str = "nearest", seed: int | None = None) -> torch.Tensor:
    """Round float32/float64 ``x`` to ``fmt``; returns values of x's dtype."""
    neg, mag, kept, qe, is_nan, is_inf, is_zero, _ = _round_float_core(x, fmt, rounding, seed)
    to_max, to_over, to_nan, to_min = _specials(fmt, rounding, neg, mag, is_nan, is_inf, is_zero)
    mag = torch.where(to_max, torch.full_like(mag, fmt.max), mag)
    mag = torch.where(to_min, torch.full_like(mag, fmt.min_subnormal), mag)
    mag = torch.where(to_over, torch.full_like(mag, float("inf")), mag)
    keep_sign = (neg == 1) & (fmt.has_negative_zero | (not fmt.zero) | (mag != 0)) & fmt.signed
    out = torch.where(keep_sign, -mag, mag)
    out = torch.where(to_nan, torch.full_like(out, float("nan")), out)
    return out.to(x.dtype)


def encode_float(x: torch.Tensor, fmt: FloatFormat, rounding: str = "nearest", seed: int | None = None) -> torch.Tensor:
    """Round float32/float64 ``x`` to ``fmt`` and return the codes as int64 (bit patterns).

    NaN inputs for a format without a NaN code are mapped to the NaN code sentinel -1; the op
    layer turns that into an error.
    """
    neg, mag, kept, qe, is_nan, is_inf, is_zero, below = _round_float_core(x, fmt, rounding, seed)
    to_max, to_over, to_nan, to_min = _specials(fmt, rounding, neg, mag, is_nan, is_inf, is_zero)
    m = fmt.man
    if not fmt.subnormals:  # below min normal, kept is 0 or 1 at qe = emin: restate at qe = emin - man
        kept = torch.where(below, kept << m, kept)
        qe = torch.where(below, qe - m, qe)
    # The code of a magnitude kept * 2**qe, uniformly for subnormals, normals and carries:
    # ((qe + man + bias - 1) << man) + kept   (see module docstring; valid for zero=False too)
    code = ((qe + m + fmt.bias - 1) << m) + kept
    code = torch.where(kept == 0, torch.zeros_like(code), code)
    code = torch.where(to_max, torch.full_like(code, fmt.code_of_max), code)
    code = torch.where(to_min, torch.full_like(code, fmt.code_of_min), code)
    if fmt.has_inf:
        code = torch.where(to_over, torch.full_like(code, fmt.code_of_inf), code)
    keep_sign = (neg == 1) & fmt.signed & (fmt.has_negative_zero | (not fmt.zero) | (code != 0))
    code = code | torch.where(keep_sign, fmt.sign_bit, 0)
    nan_code = -1 if fmt.code_of_nan is None else fmt.code_of_nan
    if fmt.specials in ("ieee", "fn") and fmt.has_nan:  # NaN keeps its sign
        nan_code = torch.where(neg == 1, nan_code | fmt.sign_bit, nan_code)
    code = torch.where(to_nan, nan_code, code)
    return code


def decode_float(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Codes (any integer dtype, bit patterns) -> float32 values."""
    c = codes.to(torch.int64) & (fmt.n_codes - 1)
    m = fmt.man
    neg = (c & fmt.sign_bit) != 0 if fmt.signed else torch.zeros_like(c, dtype=torch.bool)
    e = (c >> m) & fmt.exp_all_ones
    mf = c & fmt.man_all_ones
    if fmt.zero:
        sub = e == 0
        kept = torch.where(sub, mf if fmt.subnormals else torch.zeros_like(mf), mf | (1 << m))
        qe = torch.where(sub, torch.full_like(e, fmt.emin - m), e - fmt.bias - m)
    else:
        kept, qe = mf | (1 << m), e - fmt.bias - m
    v = kept.to(torch.float64) * _pow2(qe)
    if fmt.specials == "ieee":
        top = e == fmt.exp_all_ones
        v = torch.where(top & (mf == 0), torch.full_like(v, float("inf")), v)
        v = torch.where(top & (mf != 0), torch.full_like(v, float("nan")), v)
    elif fmt.specials == "fn":
        v = torch.where((c & ~fmt.sign_bit) == fmt.code_of_nan, torch.full_like(v, float("nan")), v)
    elif fmt.specials == "fnuz":
        v = torch.where(c == fmt.code_of_nan, torch.full_like(v, float("nan")), v)
    v = torch.where(neg, -v, v)
    return v.to(torch.float32)


# ------------------------------------------------------------------------------------------------
# Integer formats
# ------------------------------------------------------------------------------------------------


def _round_int_core(x: torch.Tensor, fmt: IntFormat, rounding: str, seed: int | None):
    """Code index u in 0..2**bits-1 (value = offset + step * u) and the NaN mask.

    ``x = n + g`` with ``n = trunc(x)`` and ``g = x - n`` is exact (``x - floor(x)`` is not, for
    tiny negative x).  Then ``(x - offset) / step = (T + G) / step`` with the integer
    ``T = n - offset - [g < 0]`` and ``G = g + [g < 0]`` in [0, 1); G is never formed, only compared.
    """
    xd = x.to(torch.float64)  # exact for float32 and smaller
    is_nan = torch.isnan(xd)
    xd = torch.where(is_nan, torch.zeros_like(xd), xd)
    xd = torch.clamp(xd, min=float(fmt.min) - 4.0, max=float(fmt.max) + 4.0)  # saturates Inf too
    n = torch.trunc(xd)
    g = xd - n  # exact, in (-1, 1), sign of x
    gneg = g < 0
    T = n.to(torch.int64) - fmt.offset - gneg.to(torch.int64)
    gnz = g != 0
    if fmt.step == 2:  # u = T/2 + G/2
        u_int = T >> 1
        odd = (T & 1) == 1
        frac_gt_half = odd & gnz
        frac_eq_half = odd & ~gnz
        frac_nonzero = odd | gnz
        frac31 = ((T & 1) << 30) + torch.floor(g * 2.0**30).to(torch.int64) + (gneg.to(torch.int64) << 30)
    else:
        u_int = T
        frac_gt_half = (g > 0.5) | (gneg & (g > -0.5))
        frac_eq_half = g.abs() == 0.5
        frac_nonzero = gnz
        frac31 = torch.floor(g * 2.0**31).to(torch.int64) + (gneg.to(torch.int64) << 31)
    neg = torch.signbit(xd)  # -0 rounds like a negative value in the directed modes
    # ties to the even stored code: the value's parity for twos (int1's index parity differs)
    parity = (u_int + (fmt.offset if fmt.encoding == "twos" else 0)) & 1
    if rounding == "nearest":
        up = frac_gt_half | (frac_eq_half & (parity == 1))
    elif rounding == "nearest_away":  # away from zero in value space
        up = frac_gt_half | (frac_eq_half & ~neg)
    elif rounding == "toward_zero":  # the same-signed neighbour nearer zero: a pmN grid has no 0,
        v_lo = u_int * fmt.step + fmt.offset  # so (-1, 1) goes to the sign's +-1, never across 0
        up = frac_nonzero & torch.where(neg, v_lo + fmt.step <= 0, v_lo < 0)
    elif rounding == "up":
        up = frac_nonzero
    elif rounding == "down":
        up = torch.zeros_like(frac_nonzero)
    elif rounding == "stochastic":  # P(up) = G, to 2**-31
        r = random31(x.numel(), seed, x.device).view(x.shape)
        up = r < frac31
    else:  # pragma: no cover
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    u = torch.clamp(u_int + up.to(torch.int64), 0, fmt.n_codes - 1)
    return u, is_nan


def cast_int(x: torch.Tensor, fmt: IntFormat, rounding: str = "nearest", seed: int | None = None) -> torch.Tensor:
    u, is_nan = _round_int_core(x, fmt, rounding, seed)
    v = (u * fmt.step + fmt.offset).to(x.dtype)
    return torch.where(is_nan, torch.full_like(v, float("nan")), v)


def encode_int(x: torch.Tensor, fmt: IntFormat, rounding: str = "nearest", seed: int | None = None) -> torch.Tensor:
    """Codes as int64: b-bit two's complement patterns (twos) or the code index (unsigned, pm1);
    -1 marks NaN inputs (no integer code)."""
    u, is_nan = _round_int_core(x, fmt, rounding, seed)
    if fmt.encoding == "twos":
        u = (u + fmt.offset) & (fmt.n_codes - 1)
    return torch.where(is_nan, torch.full_like(u, -1), u)


def decode_int(codes: torch.Tensor, fmt: IntFormat) -> torch.Tensor:
    c = codes.to(torch.int64) & (fmt.n_codes - 1)
    if fmt.encoding == "twos":
        return (c - ((c >> (fmt.bits - 1)) << fmt.bits)).to(torch.float32)
    return (c * fmt.step + fmt.offset).to(torch.float32)
