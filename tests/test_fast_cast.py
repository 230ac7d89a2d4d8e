"""The reference backend's float32 route (kernels/fast_cast.py: int32 bit manipulation) against the
int64 / float64 specification (kernels/reference.py), bit for bit: every float16 pattern (widened,
so every float16 subnormal, normal, Inf and NaN), random float32 patterns and every code point /
midpoint / one-ulp neighbour of the target (grid_inputs), every rounding mode, stochastic included
(same seed, same bits)."""

import numpy as np
import pytest
import torch

from tcprec.formats import FloatFormat, IntFormat, format
from tcprec.kernels import fast_cast, reference as ref

from _oracles import grid_inputs, random_bits

MODES = ["nearest", "nearest_away", "toward_zero", "up", "down", "stochastic"]
FORMATS = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e4m3b11fnuz", "bfloat16",
           "float16", "float6_e3m2fn", "float4_e2m1fn", "float8_e8m0fnu", "e5m3_nosub", "e2m1_nospecials", "tf32",
           "fp32", "int1", "int4", "int8", "uint1", "uint3", "binary", "pm2", "pm3"]

_F16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16).float()  # every pattern


def _inputs(fmt) -> torch.Tensor:
    parts = [_F16, torch.from_numpy(random_bits(1 << 14, seed=fmt.bits))]
    if isinstance(fmt, FloatFormat) and fmt.bits <= 12:  # wider grids: float16's patterns cover them
        parts.append(torch.from_numpy(grid_inputs(fmt)))
    return torch.cat(parts)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.view(torch.int32) == b.view(torch.int32)) | (torch.isnan(a) & torch.isnan(b))


@pytest.mark.parametrize("name", FORMATS)
def test_fast_route_equals_the_specification(name):
    fmt = format(name)
    assert fast_cast.supports(fmt) is None
    x = _inputs(fmt)
    x_before = x.clone()
    spec_cast = ref.cast_int if isinstance(fmt, IntFormat) else ref.cast_float
    spec_encode = ref.encode_int if isinstance(fmt, IntFormat) else ref.encode_float
    mask = (1 << fmt.bits) - 1
    for mode in MODES:
        seed = 987654321 if mode == "stochastic" else None
        got, want = fast_cast.cast(x, fmt, mode, seed), spec_cast(x, fmt, mode, seed)
        ok = _same_bits(got, want)
        assert ok.all(), (mode, x[~ok][:4].tolist(), got[~ok][:4].tolist(), want[~ok][:4].tolist())
        codes, want_codes = fast_cast.encode(x, fmt, mode, seed).to(torch.int64), spec_encode(x, fmt, mode, seed)
        ok = (codes & mask) == (want_codes & mask)
        assert ok.all(), (mode, x[~ok][:4].tolist(), codes[~ok][:4].tolist(), want_codes[~ok][:4].tolist())
    assert torch.equal(x.view(torch.int32), x_before.view(torch.int32))  # the input is never written


def test_random31_int32_equals_the_int64_hash():
    for seed in (0, 1, 2**62 - 5):
        for n in (1, 1000, 70001):
            assert torch.equal(fast_cast._random31(torch.empty(n), seed).to(torch.int64), ref.random31(n, seed, "cpu"))


def test_non_contiguous_and_shaped_inputs():
    x = torch.randn(64, 48)[:, ::3]  # (64, 16), strided
    fmt = format("e4m3")
    assert torch.equal(fast_cast.cast(x, fmt), ref.cast_float(x.contiguous(), fmt))
    assert fast_cast.cast(x, fmt).shape == x.shape


def test_formats_past_float32_stay_on_the_specification():
    wide = FloatFormat(8, 30) if _constructs(8, 30) else None
    if wide is not None:
        assert "mantissa bits" in fast_cast.supports(wide)
    assert fast_cast.supports(format("e4m3")) is None


def _constructs(exp, man) -> bool:
    try:
        FloatFormat(exp, man)
        return True
    except ValueError:
        return False
