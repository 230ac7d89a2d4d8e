"""Formats: computed properties against ml_dtypes and gfloat, names, round trips, bad parameters."""

import math

import ml_dtypes
import numpy as np
import pytest

import tcprec as tp
from tcprec.formats import BlockFormat, FloatFormat, IntFormat, format, presets

from _oracles import ML_FLOATS, gfloat_info, ml_dtype

ALL_ML_FLOATS = ML_FLOATS + ["float8_e3m4", "float8_e4m3", "float8_e8m0fnu"]


@pytest.mark.parametrize("name", ALL_ML_FLOATS)
def test_properties_match_ml_dtypes(name):
    fmt, fi = format(name), ml_dtypes.finfo(ml_dtype(name))
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.min_subnormal == float(fi.smallest_subnormal)
    assert fmt.bits == fi.bits
    if fmt.man > 0:
        assert fmt.eps == float(fi.eps)


@pytest.mark.parametrize("name", ALL_ML_FLOATS)
def test_value_of_every_code_matches_ml_dtypes(name):
    fmt, dt = format(name), ml_dtype(name)
    codes = np.arange(fmt.n_codes, dtype=np.uint16 if fmt.bits > 8 else np.uint8)
    want = codes.view(dt).astype(np.float64)
    got = np.array([fmt.value_of(int(c)) for c in codes])
    same = (got == want) & (np.signbit(got) == np.signbit(want))
    assert np.all(same | (np.isnan(got) & np.isnan(want)))
    assert fmt.n_finite == int(np.isfinite(want).sum())
    if fmt.code_of_nan is not None:
        assert math.isnan(fmt.value_of(fmt.code_of_nan))


@pytest.mark.parametrize("specials", ["ieee", "fn"])
@pytest.mark.parametrize("exp", range(2, 9))
def test_properties_match_gfloat(exp, specials):
    for man in range(0, 11):
        try:
            fmt = FloatFormat(exp, man, specials=specials)
        except ValueError:  # e.g. e2m0 fn has no finite positive value; gfloat agrees it is degenerate
            continue
        fi = gfloat_info(fmt)
        assert fmt.max == fi.max, (fmt, fi.max)
        assert fmt.min_normal == fi.smallest_normal
        assert fmt.min_subnormal == fi.smallest_subnormal
        assert fmt.code_of_max == fi.code_of_max
        assert fmt.has_nan == (fi.num_nans > 0)


def test_int_formats():
    assert tp.IntFormat(3, signed=True).values() == [-4, -3, -2, -1, 0, 1, 2, 3]
    assert tp.IntFormat(2, signed=False).values() == [0, 1, 2, 3]
    assert format("binary").values() == [-1, 1]
    assert format("pm2").values() == [-3, -1, 1, 3]
    assert format("int4").min == -8 and format("int4").max == 7
    assert format("int1").values() == [-1, 0]
    assert IntFormat(3, encoding="twos").code_of(-1) == 0b111
    assert format("pm2").code_of(1) == 2
    with pytest.raises(ValueError, match="not a value"):
        format("pm2").code_of(0)


def test_aliases_resolve_to_presets():
    assert format("e4m3") is format("float8_e4m3fn")
    assert format("fp4") == FloatFormat(2, 1, specials="none")
    assert format("fp6") == format("float6_e3m2fn")
    assert format("bf16") == FloatFormat(8, 7)
    assert format("tf32") == FloatFormat(8, 10)
    assert format("uint2") == IntFormat(2, signed=False)
    assert format("binary") == IntFormat(1, encoding="pm1")
    assert format("e5m10") == format("fp16")  # a bare eXmY is IEEE-style
    assert format("e3m4").specials == "ieee"
    import torch

    assert format(torch.float8_e4m3fn) is format("e4m3")
    assert isinstance(format("mxfp4"), BlockFormat) and format("mxfp4").element == format("fp4")


def _custom_formats():
    out = []
    for exp in (2, 3, 5, 8):
        for man in (0, 2, 7):
            for kw in ({}, {"specials": "fn"}, {"specials": "fnuz"}, {"specials": "none"}, {"subnormals": False},
                       {"overflow": "saturate"}, {"bias": 3}, {"specials": "fn", "overflow": "saturate"}):
                try:
                    out.append(FloatFormat(exp, man, **kw))
                except ValueError:
                    pass
    return out


def test_str_round_trips():
    every = list(presets().values()) + _custom_formats() + [FloatFormat(4, 3), FloatFormat(3, 2)]
    assert len(every) > 100
    for fmt in every:
        assert format(str(fmt)) == fmt, (str(fmt), fmt)
    assert str(FloatFormat(4, 3)) == "float8_e4m3"  # ml_dtypes' IEEE-style e4m3
    assert str(FloatFormat(3, 4, specials="fn")) == "e3m4_fn"
    assert str(FloatFormat(2, 3)) == "e2m3_ieee"  # bare "e2m3" means OCP fp6 e2m3fn


def test_block_formats():
    mx = format("mxfp8")
    assert mx.element == format("e4m3") and mx.block == 32 and mx.scale == format("e8m0")
    assert mx.bits == 8 + 8 / 32
    assert format("mxint8").element_emax == 6  # OCP: MXINT8 has emax_elem 0 with 6 fraction bits
    assert format("mxfp4").element_emax == 2
    assert format(str(BlockFormat("int4", block=16))) == BlockFormat("int4", block=16)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: IntFormat(0), "bits must be 1..8 for IntFormat, got bits=0"),
        (lambda: IntFormat(9), "bits must be 1..8 for IntFormat, got bits=9"),
        (lambda: IntFormat(4, encoding="ones"), "encoding must be one of"),
        (lambda: IntFormat(4, signed=False, encoding="pm1"), "contradicts itself"),
        (lambda: FloatFormat(0, 3), "exp must be 1..8 for FloatFormat, got exp=0"),
        (lambda: FloatFormat(9, 3), "exp must be 1..8 for FloatFormat, got exp=9"),
        (lambda: FloatFormat(4, 24), "man must be 0..23 for FloatFormat, got man=24"),
        (lambda: FloatFormat(4, 3, specials="weird"), "specials must be one of"),
        (lambda: FloatFormat(4, 3, specials="fn", overflow="inf"), "overflow='inf' needs specials='ieee'"),
        (lambda: FloatFormat(3, 2, specials="none", overflow="nan"), "needs a NaN code"),
        (lambda: FloatFormat(8, 3, bias=100), "beyond float32"),
        (lambda: FloatFormat(1, 0, specials="ieee"), "no positive finite value"),
        (lambda: BlockFormat("int4", block=0), "block must be"),
        (lambda: format("float8_e4m3fm"), "did you mean 'float8_e4m3fn'"),
        (lambda: format("e4m3_sta"), "unknown suffix 'sta'"),
        (lambda: format("nonsense"), "unknown format 'nonsense'"),
    ],
)
def test_bad_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_types():
    with pytest.raises(TypeError, match="bits must be an int"):
        IntFormat(2.5)
    with pytest.raises(TypeError, match="format\\(\\) takes a name"):
        format(3.14)
