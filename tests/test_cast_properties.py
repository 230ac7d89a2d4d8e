"""Property tests (hypothesis) over random custom formats: idempotence, monotonicity, the nearest
value really is nearest, and directed modes bracket the input."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tcprec as tp
from tcprec.formats import FloatFormat


@st.composite
def float_formats(draw):
    exp = draw(st.integers(2, 8))
    man = draw(st.integers(0, 12))
    specials = draw(st.sampled_from(["ieee", "fn", "fnuz", "none"]))
    try:
        return FloatFormat(exp, man, specials=specials, subnormals=draw(st.booleans()),
                           overflow="saturate" if draw(st.booleans()) else None)
    except ValueError:
        return FloatFormat(exp, man)


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None)
@given(fmt=float_formats(), xs=st.lists(finite32, min_size=1, max_size=64))
def test_nearest_is_idempotent_monotone_and_nearest(fmt, xs):
    x = torch.tensor(sorted(xs), dtype=torch.float32)
    y = tp.cast(x, fmt)
    assert torch.equal(tp.cast(y, fmt).nan_to_num(7.0), y.nan_to_num(7.0))  # idempotent
    fin = torch.isfinite(y)
    yf = y[fin]
    assert bool((yf[1:] >= yf[:-1]).all())  # monotone on the finite part
    lo, hi = tp.cast(x, fmt, "down"), tp.cast(x, fmt, "up")
    for xv, yv, l, h in zip(x.tolist(), y.tolist(), lo.tolist(), hi.tolist()):
        if math.isfinite(yv) and math.isfinite(l) and math.isfinite(h) and abs(xv) <= fmt.max:
            assert l <= xv <= h  # directed modes bracket x
            assert abs(yv - xv) <= min(xv - l, h - xv)  # nearest is one of the two closest


@settings(max_examples=100, deadline=None)
@given(bits=st.integers(1, 8), enc=st.sampled_from(["twos", "unsigned", "pm1"]),
       xs=st.lists(st.floats(-300, 300, width=32), min_size=1, max_size=64))
def test_int_cast_lands_on_the_grid(bits, enc, xs):
    fmt = tp.IntFormat(bits, encoding=enc)
    y = tp.cast(torch.tensor(xs, dtype=torch.float32), fmt)
    assert set(y.tolist()) <= set(float(v) for v in fmt.values())


# ------------------------------------------------------------------------------------------------
# Against the oracles (gfloat, ml_dtypes, brute force over the value list): every rounding mode,
# random formats.  Inputs are drawn near the format's grid (codes, midpoints, quarter points, one
# float32 ulp off) as well as anywhere, so the ties and boundaries are hit, not only the easy cases.
# ------------------------------------------------------------------------------------------------

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from _oracles import ML_FLOATS, gfloat_round, int_round, ml_codes, ml_dtype, same_float  # noqa: E402
from tcprec.formats import IntFormat, format as format_named  # noqa: E402
from tcprec.ops.quantize import absmax_qmax  # noqa: E402

DIRECTED = ["nearest", "nearest_away", "toward_zero", "up", "down"]


@st.composite
def gfloat_formats(draw):
    """ieee- and fn-style formats, the ones gfloat models (signed, with zero)."""
    exp = draw(st.integers(2, 8))
    man = draw(st.integers(0, 10))
    specials = draw(st.sampled_from(["ieee", "fn"]))
    # subnormals only: gfloat 0.17's has_subnormals=False returns inputs below min normal unrounded
    # (e3m1: 1e-45 -> 1e-45); formats without subnormals are checked by the bracketing tests above
    try:
        return FloatFormat(exp, man, specials=specials,
                           overflow="saturate" if draw(st.booleans()) else None)
    except ValueError:  # combinations the record refuses (e.g. fn with man=0 and exp=2)
        return FloatFormat(exp, man)


def _near_grid(draw, vals: np.ndarray, n: int) -> np.ndarray:
    """n float32 inputs at, between and just off the finite values vals (float64, sorted)."""
    idx = np.array(draw(st.lists(st.integers(0, len(vals) - 2), min_size=n, max_size=n)))
    t = np.array(draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), min_size=n, max_size=n)))
    x = (vals[idx] + t * (vals[idx + 1] - vals[idx])).astype(np.float32)
    nudge = np.array(draw(st.lists(st.sampled_from([-1, 0, 0, 1]), min_size=n, max_size=n)))
    with np.errstate(over="ignore"):
        x = np.where(nudge > 0, np.nextafter(x, np.float32(np.inf)),
                     np.where(nudge < 0, np.nextafter(x, np.float32(-np.inf)), x))
    sign = np.array(draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=n, max_size=n)), dtype=np.float32)
    return x * sign


@settings(max_examples=60, deadline=None)
@given(fmt=gfloat_formats(), rounding=st.sampled_from(DIRECTED), data=st.data(),
       anywhere=st.lists(finite32, min_size=0, max_size=16))
def test_float_cast_and_encode_match_gfloat(fmt, rounding, data, anywhere):
    vals = np.unique(tp.decode(torch.arange(fmt.n_codes), fmt).double().numpy())
    vals = vals[np.isfinite(vals)]
    vals = np.append(vals, vals[-1] * 2)  # past max: the overflow rule
    x32 = np.concatenate([_near_grid(data.draw, vals, 48), np.array(anywhere, dtype=np.float32)])
    x32 = x32[np.isfinite(x32)]
    got = tp.cast(torch.from_numpy(x32), fmt, rounding).numpy()
    want = gfloat_round(fmt, x32, rounding)
    ok = same_float(got, want)
    assert ok.all(), f"{fmt} {rounding}: x={x32[~ok][:4]} ours={got[~ok][:4]} gfloat={want[~ok][:4]}"
    # encode is the same rounding: its codes decode to cast's values
    back = tp.decode(tp.encode(torch.from_numpy(x32), fmt, rounding), fmt).numpy()
    assert same_float(back, got).all()


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(ML_FLOATS), bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_nearest_codes_match_ml_dtypes_on_random_bit_patterns(name, bits):
    fmt = format_named(name)
    x32 = np.array(bits, dtype=np.uint64).astype(np.uint32).view(np.float32)
    if not fmt.has_nan:
        x32 = x32[~np.isnan(x32)]
    if not fmt.has_nan and not fmt.has_inf:
        x32 = x32[np.isfinite(x32)]
    with np.errstate(over="ignore", invalid="ignore"):
        want_vals = x32.astype(ml_dtype(name)).astype(np.float64)
        want = ml_codes(x32, name, fmt.bits)
    got = tp.encode(torch.from_numpy(x32), fmt).to(torch.int64).numpy() & (fmt.n_codes - 1)
    nan = np.isnan(want_vals)  # NaN payload / sign: ml_dtypes' NaN code differs by format; values suffice
    assert (got[~nan] == want[~nan]).all(), (name, x32[~nan][got[~nan] != want[~nan]][:4])
    assert np.isnan(tp.cast(torch.from_numpy(x32[nan]), fmt).numpy()).all()


int_formats = st.builds(IntFormat, bits=st.integers(1, 8), encoding=st.sampled_from(["twos", "unsigned", "pm1"]))


@settings(max_examples=80, deadline=None)
@given(fmt=int_formats, rounding=st.sampled_from(DIRECTED), data=st.data())
def test_int_cast_and_encode_match_brute_force(fmt, rounding, data):
    vals = np.array(fmt.values() + [fmt.max + fmt.step], dtype=np.float64)
    vals = np.concatenate([[fmt.min - fmt.step], vals])  # beyond both ends: saturation
    x32 = np.concatenate([_near_grid(data.draw, vals, 48), np.array([0.0, -0.0, 0.5, -0.5], dtype=np.float32)])
    x = torch.from_numpy(x32)
    got = tp.cast(x, fmt, rounding).tolist()
    want = [int_round(float(v), fmt, rounding) for v in x.tolist()]
    assert got == want, [(v, g, w) for v, g, w in zip(x.tolist(), got, want) if g != w][:4]
    assert tp.decode(tp.encode(x, fmt, rounding), fmt).tolist() == want


@settings(max_examples=40, deadline=None)
@given(fmt=st.one_of(float_formats(), int_formats), seed=st.integers(0, 2**31),
       xs=st.lists(st.floats(-1e3, 1e3, width=32), min_size=1, max_size=64))
def test_stochastic_lands_on_a_bracketing_neighbour_and_encode_agrees(fmt, seed, xs):
    x = torch.tensor(xs, dtype=torch.float32)
    y = tp.cast(x, fmt, "stochastic", generator=torch.Generator().manual_seed(seed))
    lo, hi = tp.cast(x, fmt, "down"), tp.cast(x, fmt, "up")
    assert bool(((y == lo) | (y == hi) | (torch.isnan(y) & (torch.isnan(lo) | torch.isnan(hi)))).all())
    if fmt.has_nan or not bool(torch.isnan(y).any()):
        codes = tp.encode(x, fmt, "stochastic", generator=torch.Generator().manual_seed(seed))
        assert same_float(tp.decode(codes, fmt).numpy(), y.numpy()).all()


@settings(max_examples=60, deadline=None)
@given(fmt=st.one_of(float_formats(), int_formats), data=st.data())
def test_decode_takes_exactly_the_formats_codes(fmt, data):
    c = data.draw(st.integers(0, fmt.n_codes - 1))
    v = tp.decode(torch.tensor([c]), fmt).item()
    want = fmt.value_of(c) if isinstance(fmt, FloatFormat) else float(fmt.values()[
        (c - fmt.offset) & (fmt.n_codes - 1) if fmt.encoding == "twos" else c])
    assert same_float(np.array([v]), np.array([want], dtype=np.float64)).all()
    bad = data.draw(st.one_of(st.integers(fmt.n_codes, fmt.n_codes + 1000), st.integers(-1000, -1)))
    with pytest.raises(ValueError, match=rf"code {bad} is outside .*0\.\.{fmt.n_codes - 1}"):
        tp.decode(torch.tensor([c, bad]), fmt)


@settings(max_examples=60, deadline=None)
@given(fmt=st.one_of(gfloat_formats(), int_formats), rounding=st.sampled_from(DIRECTED),
       scale=st.floats(2.0**-20, 2.0**20, width=32),
       xs=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=32))
def test_quantize_with_a_given_scale_is_saturate_then_cast(fmt, rounding, scale, xs):
    """quantize(x, fmt, scale=s).dequantize() == s * round(clamp(x / s, -max, max)) with the
    oracle's rounding (float32 x / s, as quantize divides)."""
    if isinstance(fmt, IntFormat) and fmt.encoding == "unsigned":
        xs = [abs(v) for v in xs]
    x32 = np.array(xs, dtype=np.float32)
    q = tp.quantize(torch.from_numpy(x32), fmt, scale=scale, rounding=rounding)
    s32 = np.float32(scale)
    xs32 = x32 / s32
    if isinstance(fmt, IntFormat):
        xs32 = np.clip(xs32, fmt.min, fmt.max)
        r = np.array([int_round(float(v), fmt, rounding) for v in xs32])
    else:
        xs32 = np.clip(xs32, -fmt.max, fmt.max).astype(np.float32)
        r = gfloat_round(fmt, xs32, rounding)
    want = (r.astype(np.float32) * s32).astype(np.float32)
    got = q.dequantize().numpy()
    assert same_float(got, want).all(), (x32[:4], got[:4], want[:4])


@settings(max_examples=40, deadline=None)
@given(fmt=st.one_of(gfloat_formats(), int_formats), rounding=st.sampled_from(DIRECTED + ["stochastic"]),
       xs=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=32))
def test_quantize_absmax_scale_and_codes_on_the_grid(fmt, rounding, xs):
    if isinstance(fmt, IntFormat) and fmt.encoding == "unsigned":
        xs = [abs(v) for v in xs]
    x = torch.tensor(xs, dtype=torch.float32)
    q = tp.quantize(x, fmt, rounding=rounding, generator=torch.Generator().manual_seed(0))
    amax = float(x.abs().max())
    if amax > 0 and not (isinstance(fmt, IntFormat) and fmt.encoding == "pm1" and fmt.bits == 1):
        qmax = absmax_qmax(fmt)
        want = max(float(np.float32(amax) / np.float32(qmax)), 2.0**-126)
        assert q.scale.item() == want
    vals = tp.decode(q.codes.reshape(-1), fmt)  # every code is one of fmt's finite values
    assert bool(torch.isfinite(vals).all())
