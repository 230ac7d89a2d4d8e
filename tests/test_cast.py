"""cast / encode / decode through the pure-torch reference: bit-exact against ml_dtypes (RNE) and
gfloat (custom formats, directed modes, float64 inputs); stochastic rounding statistics; specials;
bad input.  The Triton kernel is checked against this reference in test_cast_triton.py."""

import math

import numpy as np
import pytest
import torch

import tcprec as tp
from tcprec.formats import FloatFormat, IntFormat, format
from tcprec.ops.cast import choose_cast_backend

from _oracles import ML_FLOATS, gfloat_round, int_round, grid_inputs, ml_codes, ml_dtype, random_bits, same_float

REF = dict(backend="reference")


def _check_vs_ml(name: str, x32: np.ndarray):
    fmt = format(name)
    x = torch.from_numpy(x32)
    want_codes = ml_codes(x32, name, fmt.bits)
    want_vals = x32.astype(ml_dtype(name)).astype(np.float32)
    nan_in = np.isnan(x32)
    if fmt.has_nan:  # NaN -> a NaN code (ml_dtypes keeps float16 NaN payloads; we write the canonical one)
        assert torch.isnan(tp.decode(tp.encode(x[nan_in], fmt, **REF), fmt)).all()
    # NaN without a NaN code: encode refuses it, cast keeps it (test_specials)
    x, x32, want_codes, want_vals = x[~nan_in], x32[~nan_in], want_codes[~nan_in], want_vals[~nan_in]
    got_codes = tp.encode(x, fmt, **REF).numpy().astype(np.int64) & (fmt.n_codes - 1)
    bad = np.flatnonzero(got_codes != want_codes)
    assert bad.size == 0, f"{name}: {bad.size} code mismatches, e.g. x={x32[bad[:4]]} ours={got_codes[bad[:4]]} ml={want_codes[bad[:4]]}"
    got_vals = tp.cast(x, fmt, **REF).numpy()
    ok = same_float(got_vals, want_vals)
    assert ok.all(), f"{name}: value mismatch at x={x32[~ok][:4]}"


@pytest.mark.parametrize("name", ML_FLOATS)
def test_nearest_matches_ml_dtypes_random_bits(name):
    """2**22 uniformly random float32 bit patterns plus 2**20 normal draws scaled to the format."""
    fmt = format(name)
    rng = np.random.default_rng(1)
    scaled = (rng.standard_normal(1 << 20) * fmt.max / 4).astype(np.float32)
    small = (rng.standard_normal(1 << 20) * fmt.min_normal * 4).astype(np.float32)
    _check_vs_ml(name, np.concatenate([random_bits(1 << 22, seed=hash(name) % 2**32), scaled, small]))


@pytest.mark.parametrize("name", ML_FLOATS)
def test_nearest_matches_ml_dtypes_every_tie_and_boundary(name):
    x32 = grid_inputs(format(name))
    assert x32.size > 6 * 2 ** (format(name).bits - 1)  # every value, midpoint and neighbour
    _check_vs_ml(name, x32)


def test_e8m0_differs_from_ml_dtypes_only_at_ties_and_float32_subnormals():
    """Two documented differences, everywhere else bit-exact:
    * ties (1.5 * 2**k): ml_dtypes always rounds up; we round to the even code, as gfloat and P3109
      do for man=0 formats (the code's low bit is the exponent's);
    * float32 subnormals in [2**-127, 2**-126): ml_dtypes rounds with a 2**-126 quantum although
      2**-127 is an e8m0 value; we round to the nearest value."""
    name, fmt = "float8_e8m0fnu", format("e8m0")
    x32 = np.abs(random_bits(1 << 20, seed=5))
    x32 = x32[~np.isnan(x32)]
    tie = (x32.view(np.uint32) & 0x7FFFFF) == 0x400000
    fp32_sub = x32 < 2.0**-126
    _check_vs_ml(name, x32[~fp32_sub & ~tie])
    x = np.float32(1.2 * 2.0**-127)
    assert tp.cast(torch.tensor([x]), fmt).item() == 2.0**-127  # |x - 2**-127| < |x - 2**-126|
    assert np.float32(x).astype(ml_dtype(name)).astype(np.float32) == 2.0**-126
    ties = torch.tensor([3.0, 6.0, 1.5 * 2.0**47])  # 3 = 1.5 * 2: codes 128 (even) and 129
    assert tp.cast(ties, fmt).tolist() == [2.0, 8.0, 2.0**47]  # codes 128, 130, 174: even
    assert np.array([3.0, 6.0], np.float32).astype(ml_dtype(name)).astype(np.float32).tolist() == [4.0, 8.0]


def _gfloat_formats():
    for exp in range(2, 9):
        for man in range(0, 11):
            for specials in ("ieee", "fn"):
                for sat in (False, True):
                    try:
                        yield FloatFormat(exp, man, specials=specials, overflow="saturate" if sat else None)
                    except ValueError:
                        pass  # no finite positive value (e2m0 fn)


GFLOAT_FORMATS = list(_gfloat_formats())


@pytest.mark.parametrize("exp", range(2, 9))
def test_nearest_matches_gfloat_every_code_midpoint_and_random(exp):
    """Every exp 2..8, man 0..10, ieee and fn, saturating and not: every code point, every
    midpoint, one float32 ulp either side of each, and 10**5 random inputs, against gfloat."""
    rng = np.random.default_rng(exp)
    fmts = [f for f in GFLOAT_FORMATS if f.exp == exp]
    assert len(fmts) >= 20  # e8 fn formats reach past float32 and are refused
    for fmt in fmts:
        rand = (rng.standard_normal(10**5) * 2.0 ** rng.integers(fmt.emin - fmt.man - 2, fmt.emax + 2, 10**5))
        x32 = np.concatenate([grid_inputs(fmt), rand.astype(np.float32)])
        x32 = x32[np.isfinite(x32) | fmt.has_inf | (fmt.overflow == "saturate")]  # gfloat raises otherwise
        want = gfloat_round(fmt, x32)
        got = tp.cast(torch.from_numpy(x32), fmt, **REF).numpy()
        ok = same_float(got, want)
        assert ok.all(), f"{fmt}: x={x32[~ok][:4]} ours={got[~ok][:4]} gfloat={want[~ok][:4]}"


@pytest.mark.parametrize("rounding", ["nearest_away", "toward_zero", "up", "down"])
def test_directed_modes_match_gfloat(rounding):
    for fmt in [f for f in GFLOAT_FORMATS if f.exp in (2, 4, 5, 8) and f.man in (0, 1, 3, 7)]:
        x32 = grid_inputs(fmt)
        x32 = x32[np.isfinite(x32) | fmt.has_inf | (fmt.overflow == "saturate")]
        want = gfloat_round(fmt, x32, rounding)
        got = tp.cast(torch.from_numpy(x32), fmt, rounding, **REF).numpy()
        ok = same_float(got, want)
        assert ok.all(), f"{fmt} {rounding}: x={x32[~ok][:4]} ours={got[~ok][:4]} gfloat={want[~ok][:4]}"


def test_float64_inputs_round_once():
    """From float64 bits: no double rounding through float32 (ml_dtypes' float64 path has it)."""
    fmt = format("e4m3")
    # just above a tie by less than a float32 ulp: float32 would land on the tie and round to even
    x = np.array([1.0625 + 2.0**-40, 1.1875 - 2.0**-40, -(1.0625 + 2.0**-40)], dtype=np.float64)
    got = tp.cast(torch.from_numpy(x), fmt).numpy()
    assert got.dtype == np.float64
    assert list(got) == [1.125, 1.125, -1.125]
    assert tp.cast(torch.from_numpy(x.astype(np.float32)), fmt).tolist()[0] == 1.0  # the double rounding
    rng = np.random.default_rng(3)
    for fmt in (format("e5m2"), FloatFormat(3, 4), FloatFormat(6, 9, specials="fn")):
        x = rng.standard_normal(10**5) * 2.0 ** rng.integers(fmt.emin - fmt.man, fmt.emax, 10**5)
        assert same_float(tp.cast(torch.from_numpy(x), fmt).numpy(), gfloat_round(fmt, x)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_equal_float32_path(dtype):
    x = torch.randn(4096).to(dtype) * 30
    for name in ("e4m3", "e5m2", "fp4", "int4"):
        y = tp.cast(x, name)
        assert y.dtype == dtype
        assert torch.equal(y.float(), tp.cast(x.float(), name))


def test_stochastic_rounding_statistics():
    fmt = format("e4m3")
    g = torch.Generator().manual_seed(0)
    for v in (1.0 + 0.3 * 0.125, -(2.0**-7) * 1.7, 300.0, 0.0041):  # normal, subnormal, large, tiny
        x = torch.full((10**5,), v)
        y = tp.cast(x, fmt, "stochastic", generator=g)
        lo, hi = tp.cast(torch.tensor([v]), fmt, "down").item(), tp.cast(torch.tensor([v]), fmt, "up").item()
        assert set(y.unique().tolist()) <= {lo, hi}  # never leaves the two neighbours
        p = (v - lo) / (hi - lo)
        se = (hi - lo) * math.sqrt(p * (1 - p) / x.numel())
        assert abs(y.double().mean().item() - v) <= 4 * se, (v, y.mean().item())
    x = torch.randn(10**5)
    a = tp.cast(x, "fp6", "stochastic", generator=torch.Generator().manual_seed(7))
    b = tp.cast(x, "fp6", "stochastic", generator=torch.Generator().manual_seed(7))
    c = tp.cast(x, "fp6", "stochastic", generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.manual_seed(11)
    d = tp.cast(x, "fp6", "stochastic")
    torch.manual_seed(11)
    assert torch.equal(d, tp.cast(x, "fp6", "stochastic"))


def test_stochastic_rounding_int_formats():
    g = torch.Generator().manual_seed(1)
    for name, v in (("int4", 2.3), ("int4", -2.3), ("pm2", 0.4), ("uint2", 1.75), ("binary", -0.2)):
        fmt = format(name)
        y = tp.cast(torch.full((10**5,), v), fmt, "stochastic", generator=g)
        lo, hi = tp.cast(torch.tensor([v]), fmt, "down").item(), tp.cast(torch.tensor([v]), fmt, "up").item()
        assert set(y.unique().tolist()) <= {lo, hi}
        p = (v - lo) / (hi - lo)
        se = (hi - lo) * math.sqrt(p * (1 - p) / 10**5)
        assert abs(y.double().mean().item() - v) <= 4 * se, (name, v)


@pytest.mark.parametrize("name", ["int1", "int2", "int4", "int8", "uint1", "uint3", "binary", "pm2", "pm3"])
@pytest.mark.parametrize("rounding", ["nearest", "nearest_away", "toward_zero", "up", "down"])
def test_int_rounding_matches_brute_force(name, rounding):
    fmt = format(name)
    lo, hi = fmt.min - 3, fmt.max + 3
    v = np.concatenate([np.arange(lo * 8, hi * 8 + 1) / 8.0, [-0.0, -2.0**-30, 2.0**-30, 0.5 - 2.0**-30, -0.5 - 2.0**-30]])
    x = torch.tensor(v, dtype=torch.float32)
    got = tp.cast(x, fmt, rounding).tolist()
    want = [int_round(float(t), fmt, rounding) for t in x.tolist()]
    assert got == want
    codes = tp.encode(x, fmt, rounding)
    assert codes.dtype == torch.uint8
    assert torch.equal(tp.decode(codes, fmt), torch.tensor(want))


def test_specials():
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([nan, inf, -inf, -0.0, 1e9, -1e9])
    e4m3 = tp.cast(x, "e4m3").tolist()  # fn: no Inf; overflow -> NaN
    assert all(math.isnan(v) for v in e4m3[:3]) and math.copysign(1, e4m3[3]) == -1
    assert math.isnan(e4m3[4]) and math.isnan(e4m3[5])
    e5m2 = tp.cast(x, "e5m2").tolist()  # ieee
    assert math.isnan(e5m2[0]) and e5m2[1:3] == [inf, -inf] and e5m2[4:] == [inf, -inf]
    sat = tp.cast(x, "e5m2_sat").tolist()
    assert sat[1:3] == [57344.0, -57344.0] and sat[4:] == [57344.0, -57344.0]
    fp4 = tp.cast(x, "fp4").tolist()  # no specials at all: saturate, NaN kept by cast
    assert math.isnan(fp4[0]) and fp4[1:3] == [6.0, -6.0] and fp4[4:] == [6.0, -6.0]
    fnuz = tp.cast(torch.tensor([-0.0, -1e-30]), "e4m3fnuz")
    assert not torch.signbit(fnuz).any()  # no -0 in fnuz
    assert torch.signbit(tp.cast(torch.tensor([-0.0, -1e-30]), "e4m3")).all()
    nosub = FloatFormat(4, 3, subnormals=False)  # min normal 2**-6; below it: 0 or min normal
    y = tp.cast(torch.tensor([2.0**-7 * 0.99, 2.0**-7 * 1.01, -(2.0**-7) * 0.5, 2.0**-7]), nosub).tolist()
    assert y[0] == 0.0 and y[1] == 2.0**-6 and y[2] == 0.0 and math.copysign(1, y[2]) == -1 and y[3] == 0.0
    # directed modes never round a finite value past max (IEEE)
    assert tp.cast(torch.tensor([1e9]), "e5m2", "toward_zero").item() == 57344.0
    assert tp.cast(torch.tensor([-1e9]), "e5m2", "up").item() == -57344.0


def _roundtrip_formats():
    names = ML_FLOATS + ["float8_e3m4", "float8_e4m3", "float8_e8m0fnu", "e3m4_fn", "e6m9", "e5m3_nosub",
                         "e4m3_fnuz", "e2m1_nospecials"]
    return [format(n) for n in names] + [IntFormat(b, encoding=e) for b in (1, 3, 8) for e in ("twos", "unsigned", "pm1")]


@pytest.mark.parametrize("fmt", _roundtrip_formats(), ids=str)
def test_encode_decode_round_trips_every_code(fmt):
    codes = torch.arange(fmt.n_codes, dtype=torch.int64)
    vals = tp.decode(codes, fmt)
    if isinstance(fmt, FloatFormat):
        expect = torch.tensor([fmt.value_of(c) for c in range(fmt.n_codes)], dtype=torch.float64)
        assert same_float(vals.numpy(), expect.numpy()).all()
        keep = ~torch.isnan(vals)
        if not fmt.subnormals:  # unused codes (exponent 0, mantissa != 0) read as zero
            keep &= ~(((codes >> fmt.man) & fmt.exp_all_ones) == 0) | ((codes & fmt.man_all_ones) == 0)
    else:
        keep = torch.ones_like(vals, dtype=torch.bool)
    back = tp.encode(vals[keep], fmt).to(torch.int64) & (fmt.n_codes - 1)
    assert torch.equal(back, codes[keep])
    if isinstance(fmt, FloatFormat) and fmt.has_nan:
        assert torch.isnan(tp.decode(tp.encode(torch.tensor([float("nan")]), fmt), fmt)).all()


def test_code_dtypes():
    x = torch.randn(8)
    assert tp.encode(x, "e4m3").dtype == torch.uint8
    assert tp.encode(x, "int3").dtype == torch.uint8
    assert tp.encode(x, "bf16").dtype == torch.int16
    assert tp.encode(x, "tf32").dtype == torch.int32
    assert torch.equal(tp.encode(x, "bf16"), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(tp.encode(x, "fp32"), x.view(torch.int32))


def test_backend_choice_is_explained():
    name, why = choose_cast_backend(torch.zeros(2))
    assert name == "reference" and "reference" in why
    with pytest.raises(ValueError, match="backend must be one of"):
        tp.cast(torch.zeros(2), "e4m3", backend="fast")


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: tp.cast(torch.arange(4), "e4m3"), TypeError, "dtype=torch.int64"),
        (lambda: tp.cast(torch.zeros(2, dtype=torch.complex64), "e4m3"), TypeError, "complex64"),
        (lambda: tp.cast([1.0], "e4m3"), TypeError, "torch.Tensor"),
        (lambda: tp.cast(torch.zeros(2), "e4m3", rounding="nearst"), ValueError, "rounding must be one of"),
        (lambda: tp.cast(torch.zeros(2), "e9m3"), ValueError, "exp must be 1..8"),
        (lambda: tp.cast(torch.zeros(2), "flaot16"), ValueError, "did you mean"),
        (lambda: tp.cast(torch.zeros(2), "e4m3", "stochastic", generator=3), TypeError, "generator"),
        (lambda: tp.cast(torch.zeros(2, dtype=torch.float16), "bf16"), ValueError, "beyond torch.float16"),
        (lambda: tp.encode(torch.tensor([float("nan")]), "fp4"), ValueError, "has no NaN code"),
        (lambda: tp.encode(torch.tensor([float("nan")]), "int4"), ValueError, "has no NaN code"),
        (lambda: tp.encode(torch.zeros(2), "mxfp8"), TypeError, "tcprec.quantize"),
        (lambda: tp.decode(torch.zeros(2), "e4m3"), TypeError, "integer codes"),
    ],
)
def test_bad_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
