"""Independent oracles (ml_dtypes, gfloat) and the structured inputs every cast test feeds them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

if TYPE_CHECKING:  # annotations only: the all-2**32 test's pool workers import this module without torch
    from tcprec.formats import FloatFormat

# The formats the issue requires bit-exact against ml_dtypes (RNE), by ml_dtypes name.
ML_FLOATS = [
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz",
    "float6_e3m2fn", "float6_e2m3fn", "float4_e2m1fn", "bfloat16", "float16",
]

_RND = {  # tcprec rounding -> gfloat.RoundMode member (gfloat is imported where it is used)
    "nearest": "TiesToEven", "nearest_away": "TiesToAway", "toward_zero": "TowardZero",
    "up": "TowardPositive", "down": "TowardNegative",
}


def ml_dtype(name: str):
    return np.float16 if name == "float16" else getattr(ml_dtypes, name)


def ml_codes(x32: np.ndarray, name: str, bits: int) -> np.ndarray:
    """ml_dtypes' RNE codes of float32 inputs (never float64: ml_dtypes double-rounds those)."""
    assert x32.dtype == np.float32
    return x32.astype(ml_dtype(name)).view(np.uint16 if bits > 8 else np.uint8).astype(np.int64)


def gfloat_info(fmt: FloatFormat):
    """The gfloat record of an ieee- or fn-style tcprec FloatFormat."""
    import gfloat

    assert fmt.specials in ("ieee", "fn") and fmt.signed and fmt.zero
    ieee = fmt.specials == "ieee"
    return gfloat.FormatInfo(
        name=str(fmt), k=fmt.bits, precision=fmt.man + 1, bias=fmt.bias, is_signed=True,
        domain=gfloat.Domain.Extended if ieee else gfloat.Domain.Finite, has_nz=True,
        num_high_nans=(1 << fmt.man) - 1 if ieee else 1, has_subnormals=fmt.subnormals,
        is_twos_complement=False,
    )


def gfloat_round(fmt: FloatFormat, x: np.ndarray, rounding: str = "nearest") -> np.ndarray:
    """gfloat's rounding of the (exact, float64) values of x, as float64."""
    import gfloat

    sat = fmt.overflow == "saturate"
    rnd = getattr(gfloat.RoundMode, _RND[rounding])
    return gfloat.round_ndarray(gfloat_info(fmt), x.astype(np.float64), rnd, sat=sat)


def grid_inputs(fmt: FloatFormat) -> np.ndarray:
    """float32 inputs that probe every decision of a cast to fmt: every finite value, every
    midpoint between neighbours (the ties), the overflow threshold, one float32 ulp either side of
    each, both signs, and the specials."""
    import torch

    from tcprec.ops.cast import decode  # decode is checked against value_of and ml_dtypes on its own

    vals = decode(torch.arange(fmt.n_codes), fmt).double().numpy()
    vals = np.unique(np.abs(vals[np.isfinite(vals)]))
    up = np.append(vals[1:], vals[-1] + (vals[-1] - vals[-2]))  # next grid point, past max too
    mids = (vals + up) / 2
    pts = np.concatenate([vals, mids, [fmt.min_subnormal / 2, fmt.min_subnormal / 4]]).astype(np.float32)
    with np.errstate(over="ignore"):
        pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    specials = np.array([0.0, np.inf, np.nan, np.finfo(np.float32).max, np.finfo(np.float32).smallest_subnormal,
                         np.finfo(np.float32).smallest_normal], dtype=np.float32)
    pts = np.concatenate([pts, specials])
    return np.concatenate([pts, -pts])


def int_round(v: float, fmt, rounding: str) -> float:
    """fmt's value for v by brute force over the value list (v finite; saturating at the ends)."""
    import math

    values = fmt.values()
    below = max([w for w in values if w <= v], default=values[0])
    above = min([w for w in values if w >= v], default=values[-1])
    if below == above or v <= values[0] or v >= values[-1]:
        return float(min(max(v, values[0]), values[-1]) if below != above else below)
    positive = math.copysign(1.0, v) > 0  # +0 rounds like a positive value, -0 like a negative one
    if rounding == "toward_zero":  # the neighbour of v's sign nearer zero (pmN has no 0: -1 / +1)
        if positive:
            return float(below if below >= 0 else above)
        return float(above if above <= 0 else below)
    if rounding == "up":
        return float(above)
    if rounding == "down":
        return float(below)
    from fractions import Fraction

    lo, hi = Fraction(v) - Fraction(below), Fraction(above) - Fraction(v)  # exact: float64 differences can tie
    if lo != hi:
        return float(below if lo < hi else above)
    if rounding == "nearest_away":
        return float(above if positive else below)
    return float(below if fmt.code_of(below) % 2 == 0 else above)  # ties to the even code


def random_bits(n: int, seed: int) -> np.ndarray:
    """n float32 values with uniformly random bit patterns (all exponents, NaNs, Infs, subnormals)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32).view(np.float32)


def same_float(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise: equal values with equal sign bits, or both NaN."""
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return ((a == b) & (np.signbit(a) == np.signbit(b))) | (np.isnan(a) & np.isnan(b))


def ml_codes_into_shared(shm_name: str, name: str, bits: int, start: int, count: int, base: int = 0) -> None:
    """Worker (for a process pool): ml_dtypes codes of the float32 bit patterns start..start+count,
    written into a shared-memory array indexed by pattern - base.  Used by the all-2**32 GPU test."""
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=shm_name)
    try:
        dt = np.dtype(np.uint16 if bits > 8 else np.uint8)
        out = np.ndarray((count,), dtype=dt, buffer=shm.buf, offset=(start - base) * dt.itemsize)
        pat = np.arange(count, dtype=np.uint32)
        pat += np.uint32(start)  # the patterns start..start+count-1 < 2**32, in uint32 (no 8-byte temporaries)
        with np.errstate(all="ignore"):
            out[:] = pat.view(np.float32).astype(ml_dtype(name)).view(dt)
    finally:
        shm.close()
