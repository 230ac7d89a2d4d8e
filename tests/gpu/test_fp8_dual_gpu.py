"""FP8 networks with every link chained, on the GPU: ResNet blocks write the float and the next FP8 convs' e4m3
codes in one epilogue (``conv_fwd`` OUT_MODE 5, ``out_layout="fp8+float"``, a float8 QTensor with ``hp``), and the int8
first / last layers of the "fp8" precision exchange codes with their FP8 neighbours (int8 stem -> e4m3 codes, FP8
layer -> int8 codes).  In float32 the chained networks equal the unchained ones bit for bit; in float16 the fused
ResNet equals the one with unfused adds; eagerly and from the compiled CUDA graph."""

import dataclasses

import pytest
import torch

import tcprec as tp
from tcprec.kernels.reference_conv_int8_fp8 import conv2d_fwd_int8 as ref_int8
from tcprec.nn import models as zoo
from tcprec.nn.qmodules import QConv2d
from tcprec.ops import qconv as qc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")
cf = pytest.importorskip("tcprec.kernels.triton.conv_fwd")

DEV = "cuda"
SIZES = {"yolov2-tiny": 128, "alexnet": None, "resnet18": None}


def _net(name, dtype):
    m = zoo.build(name, device=DEV).to(dtype=dtype, memory_format=torch.channels_last)
    c, h, w = zoo.INPUT_SHAPES[name]
    h = w = SIZES[name] or h
    x = torch.randn(2, c, h, w, device=DEV, generator=torch.Generator(DEV).manual_seed(0)).to(dtype)
    return m, x


def _check_graph(q, x, y):
    eng = tp.compile(q, x)
    torch.testing.assert_close(eng(x.cpu()), y.cpu(), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(SIZES))
def test_fp8_networks_chained_equal_unchained_float32(name):
    m, x = _net(name, torch.float32)
    cfg = tp.QuantConfig("fp8")
    qc_ = tp.quantize_model(m, cfg, calibration=x, warn=False)
    qu = tp.quantize_model(m, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    out = {r.name: r.out for r in qc_.tcprec_summary.layers}
    first = qc_.tcprec_summary.layers[0]
    assert first.precision == "w8a8" and "codes float8_e4m3fn -> " in out[first.name]  # the int8 stem chains
    if name == "yolov2-tiny":  # the last FP8 conv hands the int8 head its int8 codes
        assert out["features.27"].startswith("int8 codes ") and out["features.27"].endswith("-> features.30")
    if name == "resnet18":
        assert sum(o.startswith("float32 + codes float8_e4m3fn") for o in out.values()) == 5  # stem, blocks 0,2,4,6
    with torch.no_grad():
        yc, yu = qc_(x), qu(x)
    assert torch.isfinite(yc).all() and torch.equal(yc, yu)
    _check_graph(qc_, x, yc)


def test_fp8_resnet18_fp16_fused_equals_unfused_adds():
    # (the flatten rewrite needs a conv before the flatten, which the unfused graph's add + ReLU is not; the FP8
    # classifier's float accumulation follows its column order, so both networks keep torch.flatten)
    m, x = _net("resnet18", torch.float16)
    cfg = tp.QuantConfig("fp8", fuse_flatten=False)
    qf = tp.quantize_model(m, cfg, calibration=x, warn=False)
    qr = tp.quantize_model(m, dataclasses.replace(cfg, fuse_residual=False), calibration=x, warn=False)
    layouts = [mod.out_layout for mod in qf.modules() if isinstance(mod, QConv2d)]
    assert layouts.count("fp8+float") == 5
    with torch.no_grad():
        yf, yr = qf(x), qr(x)
    assert torch.isfinite(yf).all() and torch.equal(yf, yr)
    _check_graph(qf, x, yf)


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
@pytest.mark.parametrize("layer", ["resnet18.l1", "resnet18.l3"])
def test_int8_and_fp8_kernels_dual_fp8_out(kind, layer):
    """OUT_MODE 5 on the network's shapes: the float equals the float-only output, the codes are
    quantize_fp8_static of that float (the one-pass CUDA quantizer); the int8 kernel against the reference."""
    H, W, C, K, R, S, st, pd = cf.NETWORK_LAYERS[layer]
    g = torch.Generator(DEV).manual_seed(3)
    x8 = torch.randint(-20, 20, (2, H, W, C), device=DEV, generator=g, dtype=torch.int8)
    w8 = torch.randint(-20, 20, (K, R, S, C), device=DEV, generator=g, dtype=torch.int8)
    scale = torch.rand(K, device=DEV, generator=g) * 1e-3
    kw = dict(stride=st, padding=pd, scale=scale, act="relu")
    branch = cf.conv2d_fwd_int8(x8, w8, **kw, out="float16")
    res = (torch.randn(branch.shape, device=DEV, generator=g) * float(branch.abs().max())).half()
    o = (branch.float().abs().amax() / 448).reshape(1)
    y, y8 = cf.conv2d_fwd_int8(x8, w8, **kw, residual=res, out="float16", out_int8=(kind, o))
    ry, ry8 = ref_int8(x8, w8, **kw, residual=res, out="float16", out_int8=(kind, o))
    assert torch.equal(y, ry) and torch.equal(y8.view(torch.uint8), ry8.view(torch.uint8))
    assert torch.equal(y8.view(torch.uint8), qc.quantize_fp8_static(y, o, kind).codes)
    xf = (torch.randn(2, H, W, C, device=DEV, generator=g) * 2).to(torch.float8_e4m3fn)
    wf = (torch.randn(K, R, S, C, device=DEV, generator=g) / 4).to(torch.float8_e4m3fn)
    kf = dict(stride=st, padding=pd, act="relu", residual=res, out="float16", fast_accum=True)
    y_only = cf.conv2d_fwd_fp8(xf, wf, 0.125, scale * 100, **kf)
    y, y8 = cf.conv2d_fwd_fp8(xf, wf, 0.125, scale * 100, **kf, out_int8=(kind, o))
    assert torch.equal(y, y_only) and torch.equal(y8.view(torch.uint8), qc.quantize_fp8_static(y, o, kind).codes)
