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
