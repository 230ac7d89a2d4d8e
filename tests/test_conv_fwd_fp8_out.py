"""The conv epilogue's float8 output (kernels/triton/conv_fwd.py OUT_MODE 4, ``out=("e4m3" | "e5m2", out_scale)``)
through TRITON_INTERPRET=1: the INT8 kernel (exact accumulator) bit for bit against reference_conv_int8_fp8, the FP8 kernel
against its own float32 output quantized by torch (``quantize_fp8_static``'s ops); ties (integer sums halfway
between two e4m3 / e5m2 codes), saturation, +-Inf and NaN (from the bias), a residual, both formats, flat and
per-tap modes, a device scale; bad input."""

import pytest
import torch

from tcprec.kernels import reference_conv_int8_fp8 as rf

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
cf = pytest.importorskip("tcprec.kernels.triton.conv_fwd")

TAP = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32, "FLAT": False, "num_warps": 4, "num_stages": 1}
F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _torch_fp8(y: torch.Tensor, s: float, kind: str) -> torch.Tensor:
    """quantize_fp8_static's torch ops on a float output: clamp(y / s, -max, max).to(float8), as uint8 codes."""
    m = float(torch.finfo(F8[kind]).max)
    return torch.clamp(y.float() / torch.tensor(s), -m, m).to(F8[kind]).view(torch.uint8)


def _int8_case(C=5, K=12, seed=0, small=True):
    gen = torch.Generator().manual_seed(seed)
    hi = 4 if small else 128  # small codes: sums in the tens to hundreds, where e4m3 / e5m2 steps are 2..32
    x = torch.randint(-hi, hi, (2, 7, 9, C), generator=gen, dtype=torch.int8)
    w = torch.randint(-hi, hi, (K, 3, 3, C), generator=gen, dtype=torch.int8)
    return x, w, dict(stride=1, padding=1)


@pytest.mark.parametrize("kind", list(F8))
@pytest.mark.parametrize("config", [None, "tap"])
def test_int8_kernel_fp8_out_bit_exact_with_ties_and_specials(kind, config):
    """scale 1: y = the integer sum + bias (0 in most channels), so odd sums in [16, 32) etc. are exact ties;
    bias channels of +-Inf / NaN / a huge value saturate or stay NaN; out scales 1 (ties), 0.25 and 0.3."""
    C = 64 if config else 5
    x, w, geo = _int8_case(C=C, seed=1)
    K = w.shape[0]
    bias = torch.zeros(K)
    bias[:4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e6])
    bias[4] = 0.5  # halfway values below 16 in e4m3 (8.5, 9.5 ...: ties of step 1)
    cfg = TAP if config else None
    y32 = cf.conv2d_fwd_int8(x, w, **geo, bias=bias, act=("leaky", 0.5), out="float32", config=cfg)
    for s in (1.0, 0.25, 0.3):
        out = (kind, s)
        got = cf.conv2d_fwd_int8(x, w, **geo, bias=bias, act=("leaky", 0.5), out=out, config=cfg)
        ref = rf.conv2d_fwd_int8(x, w, **geo, bias=bias, act=("leaky", 0.5), out=out)
        assert got.dtype == F8[kind] and ref.dtype == F8[kind] and got.shape == y32.shape
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
        assert torch.equal(got.view(torch.uint8), _torch_fp8(y32, s, kind))
    a = y32[..., 5:].abs()  # the test meets ties: in [16, 32) e4m3's step is 2, e5m2's 4
    st = 2.0 if kind == "e4m3" else 4.0
    assert int(((a >= 16) & (a < 32) & (a.remainder(st) == st / 2)).sum()) > 5
    codes = cf.conv2d_fwd_int8(x, w, **geo, bias=bias, act=("leaky", 0.5), out=(kind, 1.0), config=cfg)
    v = codes.float()
    assert v[..., 2].isnan().all() and (v[..., 0] == torch.finfo(F8[kind]).max).all()
    assert (v[..., 1] == -torch.finfo(F8[kind]).max).all() and (v[..., 3] == torch.finfo(F8[kind]).max).all()


def test_int8_kernel_fp8_out_with_residual_device_scale():
    """A residual (fp16): the codes of the sum rounded to fp16, as the unfused graph quantizes it; a one-element
    float32 device tensor as the out scale."""
    x, w, geo = _int8_case(seed=2, small=False)
    K = w.shape[0]
    scale = torch.rand(K, generator=torch.Generator().manual_seed(3)) * 1e-3
    branch = rf.conv2d_fwd_int8(x, w, **geo, scale=scale, out="float16")
    res = (torch.randn(branch.shape, generator=torch.Generator().manual_seed(4)) * 10).half()
    o = torch.tensor([0.01])
    kw = dict(**geo, scale=scale, act="relu", residual=res, out=("e4m3", o))
    got = cf.conv2d_fwd_int8(x, w, **kw)
    assert torch.equal(got.view(torch.uint8), rf.conv2d_fwd_int8(x, w, **kw).view(torch.uint8))
    y16 = cf.conv2d_fwd_int8(x, w, **geo, scale=scale, act="relu", residual=res, out="float16")
    assert torch.equal(got.view(torch.uint8), _torch_fp8(y16, 0.01, "e4m3"))


@pytest.mark.parametrize("kind", list(F8))
@pytest.mark.parametrize("C, config", [(20, None), (64, TAP), (3, None)])
def test_fp8_kernel_fp8_out_equals_its_float32_quantized(kind, C, config):
    """The FP8 kernel's codes are those of its own float32 output (the same accumulation) through torch's quantizer."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(2, 7, 9, C, generator=gen) * 4).to(torch.float8_e4m3fn)
    w = torch.randn(6, 3, 3, C, generator=gen).to(torch.float8_e4m3fn)
    ws = torch.rand(6, generator=gen) + 0.5
    bias = torch.randn(6, generator=gen)
    bias[0] = float("nan")
    geo = dict(stride=1, padding=1, bias=bias, act=("leaky", 0.1), config=config)
    y32 = cf.conv2d_fwd_fp8(x, w, 0.25, ws, **geo, out="float32")
    for s in (0.05, 0.001):
        got = cf.conv2d_fwd_fp8(x, w, 0.25, ws, **geo, out=(kind, s))
        assert got.dtype == F8[kind] and torch.equal(got.view(torch.uint8), _torch_fp8(y32, s, kind))


@pytest.mark.parametrize("out, match", [
    (("e4m3", 0.0), r"out=\('e4m3', out_scale\) needs a finite out_scale > 0"),
    (("e5m2", float("inf")), r"needs a finite out_scale > 0"),
    (("e4m3", torch.ones(2)), r"a tensor out_scale must be one float32 element"),
    (("e4m3", 1.0, (0, 1, 2)), r"out must be one of .*\('e4m3', out_scale\).*got"),
    ("e4m3", r"out must be one of .*\('e5m2', out_scale\)"),
    (("e4m4", 1.0), r"out must be one of"),
])
def test_bad_fp8_out(out, match):
    x, w, geo = _int8_case()
    with pytest.raises(ValueError, match=match):
        cf.conv2d_fwd_int8(x, w, **geo, out=out)
    with pytest.raises(ValueError, match=match):
        rf.conv2d_fwd_int8(x, w, **geo, out=out)


def test_fp8_out_not_beside_dual():
    x, w, geo = _int8_case()
    with pytest.raises(ValueError, match="out_int8 writes int8 / float8 codes beside a float output"):
        cf.conv2d_fwd_int8(x, w, **geo, out=("e4m3", 1.0), out_int8=("int8", 1.0))
    with pytest.raises(ValueError, match="out_int8 writes int8 / float8 codes beside a float output"):
        cf.conv2d_fwd_fp8(x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), **geo, out=("e4m3", 1.0),
                          out_int8=("e4m3", 1.0))
    with pytest.raises(ValueError, match=r"out=\('e4m3', out_scale\) needs a finite out_scale > 0"):
        cf.conv2d_fwd_int8(x, w, **geo, out="float16", out_int8=("e4m3", 0.0))
    with pytest.raises(ValueError, match=r"out must be one of .*\('e5m2', out_scale\).*got \('e4m4', 1.0\)"):
        cf.conv2d_fwd_int8(x, w, **geo, out="float16", out_int8=("e4m4", 1.0))


# -- the dual float + float8 output (OUT_MODE 5): a ResNet block's output for the next residual and FP8 convs --


@pytest.mark.parametrize("kind", list(F8))
@pytest.mark.parametrize("rdt, config", [(torch.float16, None), (torch.float32, "tap")])
def test_int8_kernel_dual_fp8_bit_exact(kind, rdt, config):
    """The float output (with a residual, act) equals the float-only output, and the codes are those of that
    stored float through torch's quantizer; the reference epilogue agrees bit for bit; NaN / +-Inf channels."""
    C = 64 if config else 5
    x, w, geo = _int8_case(C=C, seed=6, small=False)
    K = w.shape[0]
    scale = torch.rand(K, generator=torch.Generator().manual_seed(7)) * 1e-3
    bias = torch.zeros(K)
    bias[:3] = torch.tensor([float("inf"), -float("inf"), float("nan")])
    cfg = TAP if config else None
    branch = cf.conv2d_fwd_int8(x, w, **geo, scale=scale, out="float32", config=cfg)
    res = (torch.randn(branch.shape, generator=torch.Generator().manual_seed(8)) * 0.3).to(rdt)
    dt = str(rdt).removeprefix("torch.")
    kw = dict(**geo, scale=scale, bias=bias, act="relu", residual=res, out=dt)
    y_only = cf.conv2d_fwd_int8(x, w, **kw, config=cfg)
    for s in (0.01, 0.0005):  # the second saturates most values
        y, y8 = cf.conv2d_fwd_int8(x, w, **kw, out_int8=(kind, torch.tensor([s])), config=cfg)
        ry, ry8 = rf.conv2d_fwd_int8(x, w, **kw, out_int8=(kind, torch.tensor([s])))
        assert y.dtype == rdt and y8.dtype == F8[kind] and ry8.dtype == F8[kind]
        torch.testing.assert_close(y, y_only, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(y, ry, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(y8.view(torch.uint8), ry8.view(torch.uint8))
        assert torch.equal(y8.view(torch.uint8), _torch_fp8(y, s, kind))
        # the codes of the fused residual alone (OUT_MODE 4) are the same: both quantize the sum in rdt
        c4 = cf.conv2d_fwd_int8(x, w, **{**kw, "out": (kind, s)}, config=cfg)
        assert torch.equal(c4.view(torch.uint8), y8.view(torch.uint8))


@pytest.mark.parametrize("C, config", [(20, None), (64, TAP)])
def test_fp8_kernel_dual_fp8_equals_float_then_quantize(C, config):
    gen = torch.Generator().manual_seed(9)
    x = (torch.randn(2, 7, 9, C, generator=gen) * 4).to(torch.float8_e4m3fn)
    w = torch.randn(6, 3, 3, C, generator=gen).to(torch.float8_e4m3fn)
    ws = torch.rand(6, generator=gen) + 0.5
    geo = dict(stride=1, padding=1, bias=torch.randn(6, generator=gen), config=config)
    branch = cf.conv2d_fwd_fp8(x, w, 0.25, ws, **geo, out="float16")
    res = (torch.randn(branch.shape, generator=gen) * float(branch.abs().max())).half()
    y, y8 = cf.conv2d_fwd_fp8(x, w, 0.25, ws, **geo, act="relu", residual=res, out="float16",
                              out_int8=("e4m3", 0.02))
    assert torch.equal(y, torch.relu(branch.float() + res.float()).half())
    assert y8.dtype == torch.float8_e4m3fn and torch.equal(y8.view(torch.uint8), _torch_fp8(y, 0.02, "e4m3"))
