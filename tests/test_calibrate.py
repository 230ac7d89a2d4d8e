"""Calibration methods against closed-form cases (nn/calibrate.py), and QuantConfig's validation."""

import math

import numpy as np
import pytest
import torch

import tcprec as tp
from tcprec.formats import as_format
from tcprec.nn import calibrate as cal
from tcprec.nn.convert import plan_layers

BINS = 2048


def _hist(x: torch.Tensor):
    a = float(x.abs().max())
    return torch.histc(x.abs(), BINS, 0.0, a).double().numpy(), a


def test_absmax_is_the_max():
    x = torch.tensor([0.5, -3.0, 2.0])
    h, a = _hist(x)
    assert cal.clip_from_histogram(h, a, "absmax", 255) == 3.0


@pytest.mark.parametrize("p", [99.0, 99.9])
def test_percentile_of_laplace(p):
    """|X| for X ~ Laplace(0, b) is Exponential(b): the p-th percentile is -b ln(1 - p/100)."""
    g = torch.Generator().manual_seed(0)
    b = 0.7
    x = b * torch.log(torch.rand(400_000, generator=g)) * torch.sign(torch.rand(400_000, generator=g) - 0.5)
    h, a = _hist(x)
    want = -b * math.log(1 - p / 100)
    got = cal.clip_from_histogram(h, a, "percentile", 255, percentile=p)
    assert abs(got - want) / want < 0.03


@pytest.mark.parametrize("qmax", [15.0, 7.0, 3.0])
def test_mse_clip_of_uniform(qmax):
    """U[0, 1] with n = qmax steps: rounding error c^3 / (12 n^2) plus clipping error (1 - c)^3 / 3 is smallest at
    c = 2n / (2n + 1) (d/dc: c^2 / (4 n^2) = (1 - c)^2)."""
    x = torch.rand(1_000_000, generator=torch.Generator().manual_seed(1))
    h, a = _hist(x)
    want = 2 * qmax / (2 * qmax + 1)
    got = cal.clip_from_histogram(h, a, "mse", qmax)
    assert abs(got - want) < 3 / BINS + 2e-3, (got, want)


def test_mse_clip_of_laplace_matches_aciq():
    """Laplace(0, b), symmetric grid of qmax steps: E(c) = 2 b^2 exp(-c / b) + c^2 / (12 qmax^2) (ACIQ); the optimum
    is the root of dE/dc = -2 b exp(-c / b) + c / (6 qmax^2)."""
    g = torch.Generator().manual_seed(2)
    b, qmax = 1.0, 7.0
    n = 2_000_000
    x = b * torch.log(torch.rand(n, generator=g)) * torch.sign(torch.rand(n, generator=g) - 0.5)
    h, a = _hist(x)
    lo, hi = 0.1, 30.0
    for _ in range(100):  # bisection on dE/dc
        c = (lo + hi) / 2
        (lo, hi) = (c, hi) if -2 * b * math.exp(-c / b) + c / (6 * qmax ** 2) < 0 else (lo, c)
    got = cal.clip_from_histogram(h, a, "mse", qmax)
    assert abs(got - c) / c < 0.04, (got, c)
    assert got < 0.5 * a  # far below the absmax


def test_entropy_ignores_rare_outliers():
    """TensorRT's entropy calibration on U[0, 1] with 0.005% outliers at 4: the threshold stays near 1, where absmax
    would be 4 (and flat data alone keeps its full range).  (Thresholds start at 128 bins, as TensorRT's: outliers
    so far out that the data fills fewer bins cannot be clipped closer than 128 bins.)"""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.rand(200_000, generator=g), torch.full((10,), 4.0)])
    h, a = _hist(x)
    got = cal.clip_from_histogram(h, a, "entropy", 127)
    assert 0.9 < got < 1.3, got
    h2, a2 = _hist(torch.rand(200_000, generator=g))
    assert cal.clip_from_histogram(h2, a2, "entropy", 127) > 0.95 * a2


def test_weight_clip_search_finds_the_best_ratio():
    """A channel of evenly spread weights plus one outlier: the best int4 clip is below the outlier; the chosen
    ratio's error is no worse than any other ratio on the grid (absmax included)."""
    w = torch.cat([torch.linspace(-1, 1, 63), torch.tensor([8.0])])[None].repeat(2, 1)
    w[1] = torch.linspace(-1, 1, 64)  # no outlier: keep (nearly) the full range
    r = cal.weight_clip_ratio(w, "int4")
    assert r[0] < 0.95 and r[1] > 0.8

    def err(ratio, row):
        s = ratio * w[row].abs().max() / 7
        return ((torch.round(w[row] / s).clamp(-8, 7) * s - w[row]) ** 2).sum()
    for ratio in torch.linspace(0.2, 1.0, 100):
        assert err(r[0], 0) <= err(ratio, 0) + 1e-6


def test_pm_grid_uses_every_code():
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    q = tp.quantize(w, cal.weight_format_for(3, "pm"), tp.PerChannel(0))
    assert q.codes.unique().numel() == 8  # pm3: 8 odd levels -7..7, all used
    q2 = tp.quantize(w, cal.weight_format_for(3, "twos"), tp.PerChannel(0))
    assert q2.codes.unique().numel() <= 7  # int3 symmetric: -4 never used


def test_bias_correction_removes_the_mean_output_error():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 4)
    x = torch.randn(256, 16) + 1.0  # non-zero mean inputs: a weight error shifts the mean output
    m = torch.nn.Sequential(lin).eval()
    q0 = tp.quantize_model(m, tp.QuantConfig("w2a8", first_last=None), calibration=x, warn=False)
    q1 = tp.quantize_model(m, tp.QuantConfig("w2a8", first_last=None, bias_correction=True), calibration=x, warn=False)
    with torch.no_grad():
        e0, e1 = (q0(x) - m(x)).mean(0).abs(), (q1(x) - m(x)).mean(0).abs()
    assert e1.max() < 0.25 * e0.max()


def test_config_validation_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"Observer method must be one of .*'kl'"):
        tp.QuantConfig("int8", activation_observer="kl")
    with pytest.raises(ValueError, match="percentile must be in"):
        cal.Observer("percentile", percentile=0.5)
    with pytest.raises(ValueError, match="weight_clip must be one of"):
        tp.QuantConfig("int8", weight_clip="l1")
    with pytest.raises(ValueError, match="weight_grid must be one of"):
        tp.QuantConfig("int8", weight_grid="odd")
    with pytest.raises(TypeError, match="activation_observer must be"):
        tp.QuantConfig("int8", activation_observer=3)
    assert tp.QuantConfig("int8", activation_observer="mse").activation_observer == cal.Observer("mse")


@pytest.mark.parametrize("method", ["percentile", "mse", "entropy", "auto"])
def test_observers_run_through_quantize_model(method):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.nn.ReLU6(),
                            torch.nn.Conv2d(8, 4, 1)).eval()
    x = torch.randn(8, 3, 6, 6)
    q = tp.quantize_model(m, tp.QuantConfig("int8", activation_observer=method), calibration=x, warn=False)
    qa = tp.quantize_model(m, "int8", calibration=x, warn=False)
    assert float(q.get_submodule("2").in_scale) <= float(qa.get_submodule("2").in_scale)  # a clip, never wider
    with torch.no_grad():
        assert ((q(x) - m(x)).norm() / m(x).norm()).item() < 0.1


def test_auto_observer_picks_the_clip_with_the_smallest_output_error():
    """A linear layer with the identity weight (output error = input rounding error): U[-1, 1] with a few outliers at
    60 -- absmax (60) rounds the bulk to 0, so "auto" clips, and its clip's output error is the smallest of the four
    methods' clips, recomputed here by brute force."""
    g = torch.Generator().manual_seed(5)
    x = torch.cat([torch.rand(20_000, 16, generator=g) * 2 - 1, torch.full((1, 16), 60.0)])
    lin = torch.nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(16))
    m = torch.nn.Sequential(lin).eval()
    fmt = tp.as_format("int8")
    clips = cal.activation_clips(m, ["0"], [x], {"0": 60.0}, cal.Observer("auto"), lambda n: fmt)

    def err(c):
        s = c / 127
        return float(((torch.round(x / s).clamp(-128, 127) * s - x) ** 2).sum())
    h = torch.histc(x.abs().flatten(), 2048, 0.0, 60.0).double().numpy()
    cands = [cal.clip_from_histogram(h, 60.0, mth, 127) for mth in ("absmax", "percentile", "mse", "entropy")]
    assert clips["0"] < 60.0
    assert err(clips["0"]) <= min(err(c) for c in cands) * (1 + 1e-9)


@pytest.mark.parametrize("fmt", ["int4", "pm3"])
def test_adaround_on_orthonormal_inputs_is_nearest(fmt):
    """Inputs that are the unit vectors: the output error is ||w_round - w||^2, whose minimum is nearest rounding
    (weights away from ties)."""
    g = torch.Generator().manual_seed(6)
    f = tp.as_format(fmt)
    step, off, _, _ = cal._grid(f)
    scale = torch.full((1, 4, 1), 0.1)
    k = torch.randint(-2, 2, (1, 4, 16), generator=g).float()
    frac = torch.where(torch.rand(1, 4, 16, generator=g) < 0.5, 0.2, 0.8)
    w = scale * (step * (k + frac) + off)  # (G=1, Kg=4, I=16)
    x = torch.eye(16)[:, None, :]  # (P=16, G=1, I=16)
    got = cal.adaround_layer(w, scale, f, x, torch.einsum("pgi,gki->pgk", x, w), cal.AdaRound(iters=200))
    want = scale * (step * torch.round((w / scale - off) / step) + off)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["int4", "pm3"])
def test_adaround_cancels_the_rounding_error_of_a_sum(fmt):
    """One input position of all ones: the output is the sum of the weights.  Every weight sits 0.15..0.45 steps
    above a grid point, so nearest rounding (all down) is off by ~0.3 steps per weight (~12 steps for 40 weights);
    rounding ~12 of them up instead makes the sum exact to within half a step (the optimum).  AdaRound (300 steps)
    closes at least a third of that gap (all-equal inputs are its hardest case: every choice sees the same gradient
    and only the regulariser tells them apart), on the grid, with the channel's extreme code (its scale) kept."""
    f = tp.as_format(fmt)
    step, off, kmin, kmax = cal._grid(f)
    s = 0.05
    k = (torch.arange(40) % 5 - 3).float()
    w = s * (step * (k + torch.linspace(0.15, 0.45, 40)) + off)
    w[0] = s * (step * kmax + off)  # the extreme code: it fixes the scale
    w = w.view(1, 1, 40)
    x = torch.ones(8, 1, 40)
    t = torch.einsum("pgi,gki->pgk", x, w)
    got = cal.adaround_layer(w, torch.full((1, 1, 1), s), f, x, t, cal.AdaRound(iters=300))
    codes = (got / s - off) / step
    assert torch.equal(codes, codes.round()) and codes.min() >= kmin and codes.max() <= kmax
    assert codes[0, 0, 0] == kmax
    nearest = s * (step * torch.round((w / s - off) / step) + off)
    e_near, e_ada = abs(float((nearest - w).sum())), abs(float((got - w).sum()))
    assert e_near > 10 * step * s
    assert e_ada - 0.5 * step * s <= (2 / 3) * (e_near - 0.5 * step * s)


def test_adaround_through_quantize_model_keeps_the_scales_and_lowers_the_error():
    """w4a8 conv on the calibration batch: the AdaRound model's weight scales are nearest rounding's (the extreme
    codes kept), some codes differ, and the output error on the calibration data is lower."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1)).eval()
    x = torch.randn(4, 8, 8, 8) + 0.5
    cfg = dict(first_last=None)
    q0 = tp.quantize_model(m, tp.QuantConfig("w4a8", **cfg), calibration=x, warn=False)
    q1 = tp.quantize_model(m, tp.QuantConfig("w4a8", weight_rounding=cal.AdaRound(iters=200), **cfg),
                           calibration=x, warn=False)
    w0, w1 = q0.get_submodule("0").weight.qw, q1.get_submodule("0").weight.qw
    assert torch.equal(w0.scale, w1.scale)
    assert not torch.equal(w0.codes, w1.codes)
    with torch.no_grad():
        assert (q1(x) - m(x)).pow(2).mean() < (q0(x) - m(x)).pow(2).mean()


def _e4m3_values() -> torch.Tensor:
    """Every finite e4m3 value, ascending (the 256 codes decoded by torch, NaNs and -0 dropped): the grid oracle."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(v[torch.isfinite(v)])


def test_adaround_on_the_e4m3_grid_with_orthonormal_inputs_is_nearest():
    """fp8 weights: each sits 0.2 or 0.8 of the way between two adjacent e4m3 values (any binade, subnormals, both
    signs; the grid from torch's decoding of all 256 codes); unit-vector inputs make the output error
    ||w_round - w||^2, whose minimum is nearest rounding -- torch's float8 cast."""
    g = torch.Generator().manual_seed(7)
    vals = _e4m3_values()
    i = torch.randint(0, len(vals) - 1, (1, 4, 16), generator=g)
    frac = torch.where(torch.rand(1, 4, 16, generator=g) < 0.5, 0.2, 0.8)
    scale = torch.full((1, 4, 1), 0.1)
    w = scale * (vals[i] + frac * (vals[i + 1] - vals[i]))
    x = torch.eye(16)[:, None, :]
    got = cal.adaround_layer(w, scale, tp.as_format("e4m3"), x, torch.einsum("pgi,gki->pgk", x, w),
                             cal.AdaRound(iters=200, max_bits=8))
    assert torch.equal(got, scale * (w / scale).to(torch.float8_e4m3fn).float())


def test_adaround_on_the_e4m3_grid_cancels_the_rounding_error_of_a_sum():
    """The sum case of the integer grids on e4m3's binade [64, 128) (spacing 8): 40 weights 0.15..0.45 of a spacing
    above a grid value, one input of all ones.  AdaRound's weights are e4m3 values, each one of its weight's two
    neighbours, the extreme (448, the scale) kept, and it closes at least a third of nearest rounding's gap to the
    optimum (half a spacing)."""
    vals = _e4m3_values()
    s, gap = 0.0625, 8.0  # (a power of two: got / s is exact)
    w = s * (64 + gap * (torch.arange(40) % 8) + gap * torch.linspace(0.15, 0.45, 40))
    w[0] = s * 448.0
    w = w.view(1, 1, 40)
    x = torch.ones(8, 1, 40)
    got = cal.adaround_layer(w, torch.full((1, 1, 1), s), tp.as_format("e4m3"), x, torch.einsum("pgi,gki->pgk", x, w),
                             cal.AdaRound(iters=300, max_bits=8))
    codes = got / s
    assert torch.isin(codes, vals).all() and codes[0, 0, 0] == 448.0
    lo = vals[torch.searchsorted(vals, w / s, right=True) - 1]
    assert ((codes == lo) | (codes == lo + gap)).all()
    nearest = s * (w / s).to(torch.float8_e4m3fn).float()
    e_near, e_ada = abs(float((nearest - w).sum())), abs(float((got - w).sum()))
    assert e_near > 10 * gap * s
    assert e_ada - 0.5 * gap * s <= (2 / 3) * (e_near - 0.5 * gap * s)


def test_adaround_of_8_bits_rounds_fp8_weights_through_quantize_model():
    """An fp8 conv: ``AdaRound(max_bits=8)`` (fp8 weights are 8-bit) keeps the per-channel scales, changes some
    e4m3 codes and lowers the output error on the calibration batch; ``max_bits=4`` leaves them nearest."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1)).eval()
    x = torch.randn(4, 8, 8, 8) + 0.5
    q0, q4, q8 = (tp.quantize_model(m, tp.QuantConfig("fp8", first_last=None, **kw), calibration=x, warn=False)
                  for kw in ({}, {"weight_rounding": cal.AdaRound(iters=200)},
                             {"weight_rounding": cal.AdaRound(iters=200, max_bits=8)}))
    w0, w4, w8 = (q.get_submodule("0").weight.qw for q in (q0, q4, q8))
    assert torch.equal(w0.scale, w8.scale)
    assert torch.equal(w0.dequantize(), w4.dequantize()) and not torch.equal(w0.dequantize(), w8.dequantize())
    with torch.no_grad():
        assert (q8(x) - m(x)).pow(2).mean() < (q0(x) - m(x)).pow(2).mean()


def test_weight_rounding_validation():
    with pytest.raises(ValueError, match=r"weight_rounding must be one of \('nearest', 'adaround'\)"):
        tp.QuantConfig("w4a8", weight_rounding="stochastic")
    with pytest.raises(ValueError, match="AdaRound iters must be an int in 1..100000, got 0"):
        cal.AdaRound(iters=0)
    with pytest.raises(ValueError, match="AdaRound max_bits must be an int in 2..8"):
        cal.AdaRound(max_bits=1)
    assert cal.as_rounding("adaround") == cal.AdaRound() and cal.as_rounding("nearest") is None


def test_grouped_sets_the_precision_of_every_grouped_conv():
    """``grouped="int8"`` in a w4a8 model: the depthwise and the grouped conv take int8, the dense convs keep w4a8,
    ``first_last`` and ``overrides`` win; the quantized depthwise weight is the 8-bit one (255 levels per channel)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.nn.ReLU6(),
                            torch.nn.Conv2d(8, 8, 1), torch.nn.ReLU(),
                            torch.nn.Conv2d(8, 8, 3, padding=1, groups=2), torch.nn.ReLU(),
                            torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.nn.ReLU(),
                            torch.nn.Flatten(), torch.nn.Linear(8 * 16, 4)).eval()
    x = torch.randn(4, 3, 4, 4)
    cfg = tp.QuantConfig("w4a8", grouped="int8", overrides={"8": "w4a8"})
    q = tp.quantize_model(m, cfg, calibration=x, warn=False)
    got = {r.name: r.precision for r in q.tcprec_summary.layers}
    assert got == {"0": "w8a8", "2": "w8a8", "4": "w4a8", "6": "w8a8", "8": "w4a8", "11": "w8a8"}
    assert q.get_submodule("2").w_fmt == as_format("int8")  # the depthwise conv's codes are 8-bit
    assert q.get_submodule("8").w_fmt == as_format("int4")
    plain = {r.name: r.precision for r in tp.quantize_model(m, "w4a8", calibration=x, warn=False).tcprec_summary.layers}
    assert plain["2"] == plain["6"] == "w4a8"
    with pytest.raises(ValueError, match="int9"):
        tp.QuantConfig("w4a8", grouped="int9")


def test_auto_observer_and_bias_correction_on_a_half_precision_model():
    """The "auto" observer's trial convolutions run in float32 on the float32 copy of the calibration input: an fp16
    model's weights are cast to it (they used to meet as Float and Half and raise)."""
    torch.manual_seed(0)
    nn = torch.nn
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                      nn.Flatten(), nn.Linear(8 * 6 * 6, 4)).half().eval()
    x = torch.randn(4, 3, 6, 6).half()
    q = tp.quantize_model(m, tp.QuantConfig("int8", first_last=None, activation_observer="auto", bias_correction=True),
                       calibration=x, warn=False)
    assert [r.precision for r in q.tcprec_summary.layers] == ["w8a8"] * 3
    with torch.no_grad():
        y, ref = q(x).float(), m(x).float()
    assert torch.isfinite(y).all() and float((y - ref).norm() / ref.norm()) < 0.1


class _F6(torch.nn.Module):
    """Functional clamps in a forward: F.hardtanh, F.relu6, torch.clamp then Tensor.clamp with constant bounds (each
    in front of a linear), and torch.clamp with only a lower bound (not a clamp activation: unbounded above)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.d, self.e = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        y = self.c(torch.nn.functional.relu6(self.b(torch.nn.functional.hardtanh(self.a(x), -1.0, 1.0))))
        return self.e(torch.clamp(self.d(torch.clamp(y, -3.0, 3.0).clamp(max=2.0, min=-2.0)), min=0.0))


def test_clamped_inputs_sets_the_precision_of_layers_reading_a_clamp():
    """``clamped_inputs="int8"`` in an fp8 model: exactly the layers whose input is a ReLU6 / Hardtanh output (module
    or functional) take int8 -- the depthwise conv after the stem's ReLU6, the 1x1 conv after ReLU6 -- and the one
    after a ReLU keeps fp8; ``overrides`` / ``first_last`` / ``grouped`` win; plan_layers (QAT) agrees."""
    torch.manual_seed(0)
    nn = torch.nn
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU6(),
                      nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Hardtanh(-2.0, 2.0),
                      nn.Conv2d(8, 8, 1), nn.ReLU(),
                      nn.Conv2d(8, 8, 1), nn.ReLU6(),
                      nn.Conv2d(8, 8, 1), nn.ReLU6(),
                      nn.Flatten(), nn.Linear(8 * 16, 4)).eval()
    x = torch.randn(4, 3, 4, 4)
    cfg = tp.QuantConfig("fp8", clamped_inputs="int8", overrides={"8": "fp8"})
    q = tp.quantize_model(m, cfg, calibration=x, warn=False)
    got = {r.name: r.precision for r in q.tcprec_summary.layers}
    assert got == {"0": "w8a8", "2": "w8a8", "4": "w8a8", "6": "fp8", "8": "fp8", "11": "w8a8"}
    assert q.get_submodule("4").w_fmt == as_format("int8") and q.get_submodule("6").w_fmt == as_format("e4m3")
    assert q.get_submodule("8").a_fmt == as_format("e4m3")  # (the override)
    plans = {p.name: p.precision and str(p.precision) for p in plan_layers(m, cfg)[0]}
    assert plans["4"] == "w8a8" and plans["6"] == "fp8"
    g = {r.name: r.precision for r in tp.quantize_model(m, tp.QuantConfig("fp8", clamped_inputs="int8", grouped="fp8"),
                                                         calibration=x, warn=False).tcprec_summary.layers}
    assert g["2"] == "fp8" and g["4"] == "w8a8"  # grouped wins over clamped_inputs
    f = {r.name: r.precision for r in tp.quantize_model(_F6().eval(), tp.QuantConfig("fp8", first_last=None,
                                                                                      clamped_inputs="int8"),
                                                         calibration=torch.randn(8, 16), warn=False).tcprec_summary.layers}
    assert f == {"a": "fp8", "b": "w8a8", "c": "w8a8", "d": "w8a8", "e": "fp8"}
    plain = {r.name: r.precision for r in tp.quantize_model(m, "fp8", calibration=x, warn=False).tcprec_summary.layers}
    assert plain["4"] == plain["8"] == "fp8"
    with pytest.raises(ValueError, match="int9"):
        tp.QuantConfig("fp8", clamped_inputs="int9")


def test_clamped_inputs_int8_is_closer_than_e4m3_on_a_relu6_output():
    """Closed form: ReLU6 outputs spread over [0, 6] (the clamp hit, so absmax = 6) into a 1x1 conv, the only
    quantized layer.  At int8 its input is uint8 on the scale 6/255 (a uniform grid: error <= 3/255 per value); at
    e4m3 on the scale 6/448, where the values in [3.4, 6] sit on a grid of step 32 * 6/448 = 0.43 (3 mantissa bits):
    the output error is several times larger."""
    torch.manual_seed(0)
    nn = torch.nn
    m = nn.Sequential(nn.Conv2d(16, 16, 1), nn.ReLU6(), nn.Conv2d(16, 16, 1, bias=False), nn.ReLU(),
                      nn.Conv2d(16, 4, 1)).eval()
    with torch.no_grad():
        m[0].weight.copy_(torch.eye(16)[:, :, None, None])
        m[0].bias.zero_()
    x = torch.rand(8, 16, 4, 4) * 7.0  # after the ReLU6: uniform on [0, 6] and 1/7 of it at 6
    over = {"0": "float", "4": "float"}
    qs = {k: tp.quantize_model(m, tp.QuantConfig("fp8", first_last=None, overrides=over, clamped_inputs=v),
                               calibration=x, warn=False) for k, v in (("int8", "int8"), ("fp8", None))}
    assert [r.precision for r in qs["int8"].tcprec_summary.layers] == ["float", "w8a8", "float"]
    assert [r.precision for r in qs["fp8"].tcprec_summary.layers] == ["float", "fp8", "float"]
    q8 = qs["int8"].get_submodule("2")
    assert q8.a_fmt == as_format("uint8") and float(q8.in_scale) == pytest.approx(6.0 / 255, rel=1e-6)
    assert float(qs["fp8"].get_submodule("2").in_scale) == pytest.approx(6.0 / 448, rel=1e-6)
    with torch.no_grad():
        ref = m(x)
        err = {k: float((q(x).float() - ref).norm() / ref.norm()) for k, q in qs.items()}
    assert err["int8"] * 4 < err["fp8"], err


def test_clamped_inputs_on_an_untraced_model_is_said():
    """A model that does not trace: no layer's input is known, so the rule does nothing -- and the summary says so."""

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

        def forward(self, x):
            y = torch.nn.functional.relu6(self.a(x))
            return self.b(y) if float(y.sum()) > -1 else -self.b(y)  # data-dependent control flow

    q = tp.quantize_model(Branchy().eval(), tp.QuantConfig("fp8", first_last=None, clamped_inputs="int8"),
                          calibration=torch.randn(4, 8), warn=False)
    assert [r.precision for r in q.tcprec_summary.layers] == ["fp8", "fp8"]
    assert any("clamped_inputs='int8' not applied" in n for n in q.tcprec_summary.notes)


def test_adaround_on_quantized_inputs_solves_each_layer_on_its_quantized_predecessors_output():
    """``AdaRound(inputs="quantized")`` on linear -> ReLU -> linear, both 4-bit, bias-corrected: the first layer is
    solved as with float inputs (its input is the model's, quantized); the second on the quantized first layer's
    output -- built here by hand: input quantized, the rounded weight, the bias less bias_deltas' correction, ReLU,
    quantized again -- against the float model's output.  It equals adaround_weights given that input, and differs
    from the float-input solution (the predecessor's error is what it corrects)."""
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 6)).eval()
    x = torch.randn(64, 8) + 0.3
    f4 = tp.as_format("int4")
    w_of = lambda n: m.get_submodule(n).weight.detach()  # noqa: E731
    sc = {"0": float(x.abs().max()) / 127, "2": float(torch.relu(m[0](x)).detach().abs().max()) / 127}
    a_quant = lambda n, t: torch.round(t / sc[n]).clamp(-128, 127) * sc[n]  # noqa: E731
    opts = cal.AdaRound(iters=100, inputs="quantized")
    got, deltas = cal.adaround_lockstep(m, ["0", "2"], {"0", "2"}, [x], w_of, None, lambda n: f4, a_quant, opts,
                                        bias_correction=True)
    w0 = cal.adaround_weights(m, ["0"], [x], w_of, lambda n: f4, a_quant, opts)["0"]
    d0 = cal.bias_deltas(m, ["0"], [x], lambda n: w0)["0"]
    assert torch.equal(got["0"], w0) and torch.equal(deltas["0"], d0)
    with torch.no_grad():
        x2 = a_quant("2", torch.relu(torch.nn.functional.linear(a_quant("0", x), w0, m[0].bias - d0)))
    want = cal.adaround_weights(m, ["2"], [x], w_of, lambda n: f4, lambda n, t: x2, opts)["2"]
    assert torch.equal(got["2"], want)
    assert torch.equal(deltas["2"], cal.bias_deltas(m, ["2"], [x], lambda n: want)["2"])
    floats = cal.adaround_weights(m, ["2"], [x], w_of, lambda n: f4, a_quant, opts)["2"]
    assert not torch.equal(floats, want)
    with pytest.raises(ValueError, match="AdaRound inputs must be one of"):
        cal.AdaRound(inputs="sequential")
    with pytest.raises(ValueError, match="needs tensor calibration batches"):
        cal.adaround_lockstep(m, ["0"], {"0"}, [{"input": x}], w_of, None, lambda n: f4, a_quant, opts, False)


def test_adaround_on_quantized_inputs_refuses_a_sequence_first_model():
    """The lockstep forward stacks the float and quantized halves along dim 0; a batch_first=False attention (or RNN)
    mixes positions along dim 0, so the halves would leak into each other: refused, naming the module and the fix,
    while the same model with batch_first=True converts."""
    torch.manual_seed(0)
    cfg = tp.QuantConfig("w4a8", first_last=None, weight_rounding=cal.AdaRound(iters=5, inputs="quantized"))
    seq_first = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False).eval()
    with pytest.raises(ValueError, match=r"batch_first=False.*AdaRound\(inputs='float'\)"):
        tp.quantize_model(seq_first, cfg, calibration=torch.randn(5, 4, 16), warn=False)
    batch_first = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    q = tp.quantize_model(batch_first, cfg, calibration=torch.randn(4, 5, 16), warn=False)
    assert any(r.precision == "w4a8" for r in q.tcprec_summary.layers)


def test_adaround_on_quantized_inputs_of_a_single_layer_is_adaround_on_float_inputs():
    """One quantized layer: its quantized model's input is the float input quantized, so quantize_model gives the
    same codes, scales and bias-corrected output either way (the lockstep path's wiring of weights and deltas)."""
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Conv2d(6, 12, 3, padding=1)).eval()
    x = torch.randn(3, 6, 6, 6) + 0.4
    qs = [tp.quantize_model(m, tp.QuantConfig("w4a8", first_last=None, bias_correction=True,
                                              weight_rounding=cal.AdaRound(iters=50, inputs=i)),
                            calibration=x, warn=False) for i in cal.ADAROUND_INPUTS]
    wf, wq = (q.get_submodule("0").weight.qw for q in qs)
    assert torch.equal(wf.codes, wq.codes) and torch.equal(wf.scale, wq.scale)
    with torch.no_grad():
        torch.testing.assert_close(qs[0](x), qs[1](x), rtol=0, atol=1e-6)
