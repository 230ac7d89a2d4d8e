"""quantize / QTensor: scales per granularity, error bounds, MX (OCP) scales, errors, reproducibility."""

import math

import pytest
import torch

from tcprec.formats import as_format
from tcprec.ops.cast import decode, encode
from tcprec.ops.quantize import absmax_qmax, quantize
from tcprec.qtensor import Dense, PerChannel, PerGroup, PerTensor, QTensor

INT_FORMATS = ["int2", "int4", "int8", "uint4", "pm2"]
FLOAT_FORMATS = ["e4m3", "e5m2", "fp4"]
ELEMENT_FORMATS = INT_FORMATS + ["binary"] + FLOAT_FORMATS
MX_FORMATS = ["mxfp8", "mxfp4"]
GRANULARITIES = [PerTensor(), PerChannel(0), PerChannel(-1), PerGroup(16), PerGroup(8, axis=0)]


def _x(shape=(24, 64), seed=0, nonneg=False, dtype=torch.float32):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    return (x.abs() if nonneg else x).to(dtype)


def _expected_scale_shape(g, shape):
    if isinstance(g, PerTensor):
        return (1, 1)
    if isinstance(g, PerChannel):
        a = g.axis % 2
        return tuple(n if d == a else 1 for d, n in enumerate(shape))
    a = g.axis % 2
    return tuple(n // g.size if d == a else n for d, n in enumerate(shape))


def _broadcast_scale(qt):
    """The stored scale expanded to the data's shape (independent of qtensor's helpers)."""
    g, s = qt.granularity, qt.scale
    if isinstance(g, PerGroup):
        return s.repeat_interleave(g.size, dim=g.axis)
    return s.expand(qt.shape)


@pytest.mark.parametrize("g", GRANULARITIES, ids=repr)
@pytest.mark.parametrize("name", ELEMENT_FORMATS)
def test_shapes_dtypes_and_finite(name, g):
    fmt = as_format(name)
    x = _x(nonneg=name.startswith("uint"))
    qt = quantize(x, name, g)
    assert isinstance(qt, QTensor)
    assert qt.codes.shape == x.shape and qt.codes.dtype == torch.uint8
    assert qt.scale.dtype == torch.float32
    assert tuple(qt.scale.shape) == _expected_scale_shape(g, x.shape)
    assert qt.fmt == fmt and qt.dtype == torch.float32 and qt.shape == (24, 64)
    assert qt.numel() == x.numel() and qt.device == x.device and qt.layout == Dense()
    assert torch.isfinite(qt.scale).all() and (qt.scale > 0).all()
    y = qt.dequantize()
    assert y.dtype == x.dtype and y.shape == x.shape and torch.isfinite(y).all()
    # codes are exactly encode(x / scale)
    assert torch.equal(qt.codes, encode(x / _broadcast_scale(qt), fmt))


@pytest.mark.parametrize("g", GRANULARITIES, ids=repr)
@pytest.mark.parametrize("name", INT_FORMATS)
def test_int_error_bounded_by_half_step(name, g):
    fmt = as_format(name)
    x = _x(seed=1, nonneg=name.startswith("uint"))
    qt = quantize(x, name, g)
    s = _broadcast_scale(qt)
    # amax maps onto qmax
    amax = (x.abs() / s).max().item()
    assert amax == pytest.approx(absmax_qmax(fmt), rel=1e-6)
    err = (qt.dequantize() - x).abs()
    bound = s * fmt.step / 2 * (1 + 1e-6) + 1e-7
    assert (err <= bound).all(), f"max err / bound {(err / bound).max().item()}"


@pytest.mark.parametrize("name", FLOAT_FORMATS)
def test_float_error_bounded_by_half_ulp(name):
    fmt = as_format(name)
    x = _x(seed=2)
    qt = quantize(x, name, PerChannel(0))
    s = _broadcast_scale(qt)
    # relative half-ulp for normals, half the smallest subnormal (scaled) below
    bound = torch.maximum(x.abs() * fmt.eps / 2, s * fmt.min_subnormal / 2) * (1 + 1e-6)
    assert ((qt.dequantize() - x).abs() <= bound).all()
    assert qt.scale.flatten().tolist() == pytest.approx((x.abs().amax(1) / fmt.max).tolist(), rel=1e-7)


def test_binary_uses_mean_abs_scale_and_sign():
    x = _x(seed=3)
    qt = quantize(x, "binary", PerChannel(0))
    assert torch.allclose(qt.scale.flatten(), x.abs().mean(1), rtol=1e-6, atol=0)
    y = qt.dequantize()
    assert torch.equal(torch.sign(y), torch.sign(x))  # randn has no exact zeros
    assert torch.allclose(y.abs(), qt.scale.expand_as(x))


@pytest.mark.parametrize("name", ELEMENT_FORMATS)
@pytest.mark.parametrize("g", [PerChannel(0), PerGroup(16)], ids=repr)
def test_all_zero_groups(name, g):
    x = _x(seed=4, nonneg=name.startswith("uint"))
    x[3] = 0.0  # an all-zero channel (row 3) -> also all-zero groups of 16
    qt = quantize(x, name, g)
    assert torch.isfinite(qt.scale).all() and (qt.scale > 0).all()
    y = qt.dequantize()
    assert torch.isfinite(y).all()
    fmt = as_format(name)
    if getattr(fmt, "encoding", None) == "pm1":  # no zero value: +-(smallest scale)
        assert (y[3].abs() <= 2**-126 * fmt.max).all()
    else:
        assert (qt.codes[3] == 0).all() and (y[3] == 0).all()
        assert (qt.scale[3] == 1.0).all()
    # the whole tensor zero
    qz = quantize(torch.zeros(4, 32), name, g)
    assert torch.isfinite(qz.dequantize()).all()


@pytest.mark.parametrize("name", MX_FORMATS)
def test_mx_shapes_and_power_of_two_scales(name):
    x = _x(seed=5, shape=(8, 96))
    qt = quantize(x, name)
    assert qt.granularity == PerGroup(32, axis=1)
    assert tuple(qt.scale.shape) == (8, 3)
    m, e = torch.frexp(qt.scale)
    assert (m == 0.5).all(), "MX scales are powers of two"
    elem = as_format(name).element
    # OCP rule on every block
    amax = x.view(8, 3, 32).abs().amax(-1)
    want = torch.exp2(torch.floor(torch.log2(amax)) - elem.emax)
    assert torch.equal(qt.scale, want)
    y = qt.dequantize()
    assert torch.isfinite(y).all() and y.shape == x.shape
    assert torch.equal(qt.codes, encode((x.view(8, 3, 32) / qt.scale[..., None]).clamp(-elem.max, elem.max).view(8, 96), elem))


def test_mx_hand_checked_example():
    # mxfp4 (e2m1, emax_elem = 2): amax 3.0 -> X = 2**(floor(log2 3) - 2) = 2**-1;  3.0 / 0.5 = 6 (max)
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 3.0, -1.0, 0.25, 0.125
    x[1, 0], x[1, 1] = 7.5, 1.0  # amax 7.5 -> X = 2**(2 - 2) = 1; 7.5 saturates to 6 (OCP clamp)
    qt = quantize(x, "mxfp4")
    assert qt.scale.tolist() == [[0.5], [1.0]]
    y = qt.dequantize()
    # 0.25 / 0.5 = 0.5 (an e2m1 subnormal); 0.125 / 0.5 = 0.25, halfway 0 and 0.5 -> ties to even: 0
    assert y[0, :4].tolist() == [3.0, -1.0, 0.25, 0.0]
    assert y[1, :2].tolist() == [6.0, 1.0]
    # mxfp8 (e4m3, emax_elem = 8): amax 0.1 -> floor(log2 0.1) = -4 -> X = 2**-12; 409.6 -> 416
    x8 = torch.zeros(1, 32)
    x8[0, 0] = 0.1
    q8 = quantize(x8, "mxfp8")
    assert q8.scale.item() == 2.0**-12
    assert decode(q8.codes, "e4m3")[0, 0].item() == 416.0
    assert q8.dequantize()[0, 0].item() == 416 * 2.0**-12
    # all-zero block: finite scale, zero codes
    assert qt.dequantize().shape == (2, 32)
    qz = quantize(torch.zeros(1, 64), "mxfp4")
    assert torch.isfinite(qz.scale).all() and (qz.codes == 0).all()


def test_mxint8_block_max_is_not_saturated():
    # OCP MXINT8: emax_elem = 0 with 6 fraction bits, i.e. 6 in integer units -> amax 1.5 uses code 96
    x = torch.linspace(-1.5, 1.5, 32).view(1, 32)
    qt = quantize(x, "mxint8")
    assert qt.scale.item() == 2.0**-6
    assert (qt.dequantize() - x).abs().max().item() <= 2.0**-7


def test_mx_errors():
    with pytest.raises(ValueError, match=r"multiple of the block size 32, got K=40"):
        quantize(torch.randn(4, 40), "mxfp8")
    with pytest.raises(ValueError, match="own granularity"):
        quantize(torch.randn(4, 64), "mxfp4", PerChannel(0))
    assert quantize(torch.randn(4, 64), "mxfp4", PerGroup(32)).granularity == PerGroup(32, 1)
    with pytest.raises(ValueError, match="power of two"):
        quantize(torch.randn(4, 64), "mxfp4", scale=0.3)


def test_given_scale_is_used_as_is():
    x = _x(seed=6)
    qt = quantize(x, "int8", scale=0.05)
    assert (qt.scale == torch.tensor(0.05)).all() and qt.scale.shape == (1, 1)
    assert torch.equal(qt.codes, encode(x / torch.tensor(0.05), "int8"))
    s = torch.rand(24, 1, generator=torch.Generator().manual_seed(0)) + 0.1
    qc = quantize(x, "int4", PerChannel(0), scale=s)
    assert torch.equal(qc.scale, s)
    qg = quantize(x, "e4m3", PerGroup(16), scale=torch.tensor(0.5))  # broadcast to (24, 4)
    assert qg.scale.shape == (24, 4) and (qg.scale == 0.5).all()
    assert torch.equal(quantize(x, "mxfp8", scale=0.25).scale, torch.full((24, 2), 0.25))
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="finite and > 0"):
            quantize(x, "int8", scale=bad)
    with pytest.raises(ValueError, match=r"does not broadcast.*\(24, 1\)"):
        quantize(x, "int8", PerChannel(0), scale=torch.ones(64))


def test_saturates_overflowing_given_scale():
    x = torch.tensor([1000.0, -1000.0, 1.0])
    y = quantize(x, "e4m3", scale=1.0).dequantize()
    assert y.tolist() == [448.0, -448.0, 1.0]  # clamped to +-max, not NaN
    assert quantize(x, "int4", scale=1.0).dequantize().tolist() == [7.0, -8.0, 1.0]


def test_repr():
    qt = quantize(_x(shape=(64, 128)), "int4", PerChannel(0))
    assert repr(qt) == (
        "QTensor(shape=(64, 128), fmt=int4, granularity=PerChannel(axis=0), layout=Dense(), scale=(64, 1) float32, "
        "data=uint8, device=cpu)"
    )
    r = repr(quantize(_x(shape=(4, 64)), "mxfp4"))
    assert "fmt=mxfp4" in r and "PerGroup(size=32, axis=1)" in r and "scale=(4, 2) float32" in r


def test_to_device_and_dtypes():
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        x = _x(seed=7, dtype=dt)
        qt = quantize(x, "int8", PerChannel(0))
        y = qt.dequantize()
        assert y.dtype == dt and qt.dtype == dt
        y32 = decode(qt.codes, "int8") * qt.scale  # float32 dequantization, rounded once to dt
        assert torch.equal(y, y32.to(dt))
        assert ((y32.double() - x.double()).abs() <= qt.scale.double() * (0.5 + 1e-5)).all()
    qt = quantize(_x(), "int4")
    moved = qt.to("cpu")
    assert isinstance(moved, QTensor) and moved.device.type == "cpu"
    assert torch.equal(moved.codes, qt.codes) and torch.equal(moved.scale, qt.scale) and moved.fmt == qt.fmt


def test_stochastic_rounding_reproducible_with_generator():
    x = _x(seed=8)

    def run(seed):
        return quantize(x, "int4", PerGroup(16), rounding="stochastic", generator=torch.Generator().manual_seed(seed))

    a, b, c = run(1234), run(1234), run(99)
    assert torch.equal(a.codes, b.codes)
    assert not torch.equal(a.codes, c.codes)
    near = quantize(x, "int4", PerGroup(16))
    assert not torch.equal(a.codes, near.codes)  # it is not nearest rounding in disguise
    # every stochastic result is one of the two neighbours of x / scale
    assert ((a.dequantize() - x).abs() <= _broadcast_scale(a) * (1 + 1e-6)).all()


def test_granularity_validation():
    with pytest.raises(ValueError, match=r"size must be >= 1.*size=0"):
        PerGroup(0)
    with pytest.raises(ValueError, match=r"size=-4"):
        PerGroup(-4)
    with pytest.raises(TypeError, match="size must be a positive int"):
        PerGroup(32.0)
    with pytest.raises(TypeError, match="axis must be an int"):
        PerChannel("0")
    x = _x()
    with pytest.raises(ValueError, match=r"axis=2 is out of range for a tensor with ndim=2"):
        quantize(x, "int4", PerChannel(2))
    with pytest.raises(ValueError, match=r"axis=-3 .*ndim=2"):
        quantize(x, "int4", PerGroup(8, axis=-3))
    with pytest.raises(ValueError, match=r"PerGroup\(size=48\).*K=64.*pad"):
        quantize(x, "int4", PerGroup(48))
    with pytest.raises(TypeError, match="strings are not accepted"):
        quantize(x, "int4", "per_channel")


def test_bad_inputs():
    with pytest.raises(TypeError, match="dtype=torch.int32"):
        quantize(torch.ones(4, dtype=torch.int32), "int4")
    with pytest.raises(TypeError, match="dtype=torch.complex64"):
        quantize(torch.ones(4, dtype=torch.complex64), "int4")
    with pytest.raises(TypeError, match="torch.Tensor"):
        quantize([1.0, 2.0], "int4")
    with pytest.raises(ValueError, match=r"uint4 is unsigned.*min -2.5.*int4"):
        quantize(torch.tensor([1.0, -2.5, 3.0]), "uint4")
    with pytest.raises(ValueError, match="rounding must be one of"):
        quantize(torch.ones(4), "int4", rounding="round")
    with pytest.raises(ValueError, match="unknown format"):
        quantize(torch.ones(4), "int44")


def test_nan_policy():
    x = torch.tensor([1.0, float("nan"), float("inf"), float("nan"), -2.0])
    for name in ("int4", "fp4", "binary"):
        with pytest.raises(ValueError, match=r"3 non-finite value\(s\) \(2 NaN, 1 Inf\)"):
            quantize(x, name)
    with pytest.raises(ValueError, match="non-finite"):
        quantize(x[None].expand(1, 5).repeat(1, 8)[:, :32], "mxfp4")
    # formats with NaN: the scale comes from the finite values, NaN stays NaN, Inf follows the format
    q = quantize(x, "e4m3")
    assert q.scale.item() == pytest.approx(2.0 / 448)
    y = q.dequantize()
    assert y[0].item() == pytest.approx(1.0, rel=2**-4) and y[4].item() == -2.0
    assert torch.isnan(y[[1, 2, 3]]).all()  # e4m3fn has no Inf: Inf -> NaN
    y5 = quantize(x, "e5m2").dequantize()
    assert torch.isinf(y5[2]) and torch.isnan(y5[1])


def test_qtensor_constructor_checks():
    qt = quantize(_x(), "int4", PerChannel(0))
    with pytest.raises(ValueError, match=r"scale .* must have shape \(24, 1\)"):
        QTensor(qt.codes, qt.scale.view(1, 24), qt.fmt, qt.granularity, qt.shape, qt.dtype)
    with pytest.raises(TypeError, match="uint8"):
        QTensor(qt.codes.int(), qt.scale, qt.fmt, qt.granularity, qt.shape, qt.dtype)
    with pytest.raises(TypeError, match=r"layout must be one of Dense\(\), BitPlanes\(compact=False\|True\), "
                                        r"ShiftedInt8\(\), Float8\(\), got str 'planes'; strings are not accepted"):
        QTensor(qt.codes, qt.scale, qt.fmt, qt.granularity, qt.shape, qt.dtype, layout="planes")
    ok = QTensor(qt.codes, qt.scale, "int4", PerChannel(-2), list(qt.shape), qt.dtype)
    assert ok.granularity == PerChannel(0) and ok.fmt == as_format("int4")
    assert torch.equal(ok.dequantize(), qt.dequantize())


def test_cast_to_block_format_goes_through_quantize():
    from tcprec.ops.cast import cast

    x = _x(seed=9, shape=(4, 64))
    assert torch.equal(cast(x, "mxfp8"), quantize(x, "mxfp8").dequantize())


def test_one_d_and_scalar_tensors():
    v = torch.tensor([0.5, -1.0, 2.0])
    qt = quantize(v, "int8", PerChannel(0))  # every element its own group
    assert torch.allclose(qt.dequantize(), v)
    s = quantize(torch.tensor(3.0), "int8")
    assert s.scale.shape == () and s.dequantize().item() == pytest.approx(3.0)
    assert math.isfinite(quantize(torch.empty(0, 4), "int4", PerChannel(1)).scale.sum().item())
