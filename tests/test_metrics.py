"""tcprec.metrics against hand computations, and the NaN/Inf and shape rules."""

import doctest
import importlib
import math

import pytest
import torch

import tcprec as tp
from tcprec import metrics

REF = torch.tensor([0.0, 1.0, 2.0, 4.0])
X = torch.tensor([0.0, 1.5, 2.0, 3.0])  # errors 0, 0.5, 0, -1


def test_max_abs_error():
    assert metrics.max_abs_error(X, REF) == 1.0


def test_max_rel_error_skips_zero_reference():
    # |0.5| / 1 = 0.5 and |-1| / 4 = 0.25; the ref == 0 entry is skipped
    assert metrics.max_rel_error(X, REF) == 0.5
    x = torch.tensor([0.25, 1.0])
    ref = torch.tensor([0.0, 1.0])
    assert metrics.max_rel_error(x, ref) == 0.0
    assert metrics.max_rel_error(x, ref, floor=0.5) == 0.5  # 0.25 / max(0, 0.5)
    assert math.isnan(metrics.max_rel_error(torch.ones(2), torch.zeros(2)))
    with pytest.raises(ValueError, match="floor"):
        metrics.max_rel_error(x, ref, floor=0.0)


def test_nrmse():
    rmse = math.sqrt((0.25 + 1.0) / 4)
    assert metrics.nrmse(X, REF) == pytest.approx(rmse / 4.0, rel=1e-15)  # range of ref is 4


def test_nrmse_constant_reference():
    ref = torch.full((4,), -2.0)
    x = torch.tensor([-2.0, -2.0, -2.0, -3.0])
    assert metrics.nrmse(x, ref) == pytest.approx(0.5 / 2.0)  # rmse 0.5, divided by max|ref| = 2
    assert metrics.nrmse(torch.zeros(3), torch.zeros(3)) == 0.0
    assert metrics.nrmse(torch.ones(3), torch.zeros(3)) == math.inf


def test_sqnr_db():
    signal = 0 + 1 + 4 + 16
    noise = 0.25 + 1.0
    assert metrics.sqnr_db(X, REF) == pytest.approx(10 * math.log10(signal / noise), rel=1e-15)
    assert metrics.sqnr_db(REF, REF) == math.inf
    assert metrics.sqnr_db(torch.ones(2), torch.zeros(2)) == -math.inf


def test_ulp_error_by_hand():
    # e4m3: man=3, emin=-6. ulp(1.0) = 2**-3, ulp(3.0) = 2**-2, ulp(0) = ulp(2**-8) = 2**-9 (subnormal).
    ref = torch.tensor([1.0, 3.0, 0.0, 2.0**-8])
    x = torch.tensor([1.0625, 3.5, 2.0**-9, 0.0])
    expected = torch.tensor([0.5, 2.0, 1.0, 2.0], dtype=torch.float64)
    assert torch.equal(metrics.ulp_error(x, ref, "e4m3"), expected)
    # integers: the ulp is the distance between values (2 for the odd-integer pm1 code)
    assert torch.equal(metrics.ulp_error(torch.tensor([3.0]), torch.tensor([1.0]), "pm2"),
                       torch.tensor([1.0], dtype=torch.float64))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "fp6", "e2m3", "fp4", "bf16", "e3m4"])
def test_ulp_error_of_nearest_cast_is_at_most_half(fmt):
    g = torch.Generator().manual_seed(0)
    f = tp.format(fmt)
    x = torch.randn(1 << 16, generator=g) * 2.0 ** torch.randint(-12, 4, (1 << 16,), generator=g)
    x = x.clamp(-f.max, f.max)  # overflow is not rounding
    err = metrics.ulp_error(tp.cast(x, f, "nearest"), x, f)
    assert float(err.max()) <= 0.5
    assert float(err.max()) > 0.45  # the bound is reached, so the unit is the right one


def test_nan_and_inf_rule():
    nan, inf = float("nan"), float("inf")
    ref = torch.tensor([nan, inf, -inf, 1.0])
    x = torch.tensor([nan, inf, -inf, 1.5])
    assert metrics.max_abs_error(x, ref) == 0.5  # agreeing NaN/Inf entries are left out
    assert metrics.sqnr_db(x, ref) == pytest.approx(10 * math.log10(1 / 0.25))
    assert torch.equal(metrics.ulp_error(x, ref, "e4m3"), torch.tensor([0, 0, 0, 4.0], dtype=torch.float64))
    # a NaN where ref has a number is never hidden
    bad = torch.tensor([nan, inf, -inf, nan])
    assert math.isnan(metrics.max_abs_error(bad, ref))
    assert math.isnan(metrics.nrmse(bad, ref))
    assert math.isnan(metrics.sqnr_db(bad, ref))
    assert metrics.max_abs_error(torch.tensor([inf]), torch.tensor([1.0])) == inf


@pytest.mark.parametrize("fn", [metrics.nrmse, metrics.sqnr_db, metrics.max_abs_error, metrics.max_rel_error])
def test_shape_mismatch_names_both_shapes(fn):
    with pytest.raises(ValueError, match=r"x.shape=\(2, 3\).*ref.shape=\(6,\)"):
        fn(torch.zeros(2, 3), torch.zeros(6))


def test_ulp_error_rejects_mismatch_and_block_formats():
    with pytest.raises(ValueError, match=r"x.shape=\(2,\).*ref.shape=\(3,\)"):
        metrics.ulp_error(torch.zeros(2), torch.zeros(3), "e4m3")
    with pytest.raises(TypeError, match="element"):
        metrics.ulp_error(torch.zeros(2), torch.zeros(2), "mxfp4")


def test_computed_in_float64():
    # (2**-80)**2 underflows to 0 in float32, which would make the noise vanish (SQNR = inf).
    ref = torch.tensor([2.0**-80], dtype=torch.float32)
    x = torch.tensor([2.0**-79], dtype=torch.float32)
    assert metrics.sqnr_db(x, ref) == 0.0
    assert metrics.max_rel_error(x, ref) == 1.0


@pytest.mark.parametrize("module", ["tcprec.metrics", "tcprec.env", "tcprec.bench.common", "tcprec.data"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0
