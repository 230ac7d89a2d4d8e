"""FP8 layers handing each other float8 codes (tcprec.ops.qconv.conv2d with an e4m3 / e5m2 ``out_fmt``) on the CPU
through TRITON_INTERPRET=1: the one-pass max-pool + quantize (``fp8_quant.pool_quantize_fp8``) and the codes written
by the conv's own epilogue (``conv_fwd`` OUT_MODE 4) give exactly the codes of the previous path -- the same
kernel's float32 output, ``reference_conv_bitserial.pool_nhwc`` and ``quantize_fp8_static`` (torch ops) -- for the FP8 and
INT8 kernels, every pool, both formats, saturating scales; ``explain_conv2d`` names the pass that runs."""

import dataclasses

import pytest
import torch

import tcprec as tp
from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.ops import qconv
from tcprec.ops.qconv import conv2d, explain_conv2d, pack_conv_weight, quantize_fp8_static
from tcprec.qtensor import PerChannel, QTensor, ShiftedInt8

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")

POOLS = [None, ("max", 2, 2), ("max", 2, 1), ("avg", 2, 2)]


def _fp8_layer(seed=0, C=20, K=6):
    gen = torch.Generator().manual_seed(seed)
    qx = quantize_fp8_static(torch.randn(2, 7, 9, C, generator=gen) * 3, torch.tensor([0.05]))
    qw = tp.quantize(torch.randn(K, 3, 3, C, generator=gen), "e4m3", PerChannel(0))
    bias = torch.randn(K, generator=gen)
    return qx, pack_conv_weight(qw), bias


def _int8_layer(seed=0, C=20, K=6):
    gen = torch.Generator().manual_seed(seed)
    qx = tp.quantize(torch.rand(2, 7, 9, C, generator=gen), "uint8", scale=1 / 255)
    qw = tp.quantize(torch.randn(K, 3, 3, C, generator=gen), "int8", PerChannel(0))
    bias = torch.randn(K, generator=gen)
    return qx, pack_conv_weight(qw), bias


def _previous_path(y32: torch.Tensor, pool, o: torch.Tensor, fmt: str) -> QTensor:
    """What conv2d returned before: the kernel's float32, torch's pool, then quantize_fp8_static (torch ops)."""
    return quantize_fp8_static(rq.pool_nhwc(y32, pool), o, fmt)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("layer", ["fp8", "int8"])
def test_chain_codes_equal_previous_path(layer, fmt, pool):
    """Out scales from ample to saturating most values (0.002: |y| / scale far past 448); leaky keeps negatives."""
    qx, pw, bias = (_fp8_layer if layer == "fp8" else _int8_layer)(seed=3)
    geo = dict(padding=1, stride=1, act=("leaky", 0.1), bias=bias, backend=layer)
    y32 = conv2d(qx, pw, **geo)  # the same kernel, float32 out
    assert y32.dtype == torch.float32
    for o in (torch.tensor([0.05]), torch.tensor([0.002]), torch.tensor([3.0])):
        got = conv2d(qx, pw, pool=pool, out_fmt=fmt, out_scale=o, **geo)
        want = _previous_path(y32, pool, o, fmt)
        assert isinstance(got, QTensor) and got.fmt == tp.format(fmt) and got.shape == want.shape
        assert got.codes.dtype == torch.uint8 and got.codes.is_contiguous()
        assert torch.equal(got.codes, want.codes), (o, pool)
        assert torch.equal(got.scale.reshape(-1), o) and got.dequantize().dtype == torch.float32


def test_chain_feeds_the_next_fp8_layer():
    """A YOLO-like chain: conv + leaky + size-halving pool -> e4m3 -> conv + leaky + size-keeping pool -> e4m3 ->
    conv (no pool) -> e4m3 -> float16 head; equal to running the float32 outputs through torch's passes."""
    qx, pw1, b1 = _fp8_layer(seed=11, C=3, K=16)  # a thin stem (gathered windows)
    gen = torch.Generator().manual_seed(12)
    pw2 = pack_conv_weight(tp.quantize(torch.randn(16, 3, 3, 16, generator=gen) / 4, "e4m3", PerChannel(0)))
    pw3 = pack_conv_weight(tp.quantize(torch.randn(8, 3, 3, 16, generator=gen) / 4, "e4m3", PerChannel(0)))
    pw4 = pack_conv_weight(tp.quantize(torch.randn(5, 1, 1, 8, generator=gen), "e4m3", PerChannel(0)))
    s1, s2, s3 = torch.tensor([0.04]), torch.tensor([0.03]), torch.tensor([0.02])
    kw = dict(padding=1, act=("leaky", 0.1), backend="fp8")
    h1 = conv2d(qx, pw1, pool=("max", 2, 2), out_fmt="e4m3", out_scale=s1, **kw)
    h2 = conv2d(h1, pw2, pool=("max", 2, 1), out_fmt="e4m3", out_scale=s2, **kw)
    h3 = conv2d(h2, pw3, out_fmt="e4m3", out_scale=s3, **kw)
    out = conv2d(h3, pw4, out_dtype=torch.float16, backend="fp8")
    r1 = _previous_path(conv2d(qx, pw1, **kw), ("max", 2, 2), s1, "e4m3")
    r2 = _previous_path(conv2d(r1, pw2, **kw), ("max", 2, 1), s2, "e4m3")
    r3 = _previous_path(conv2d(r2, pw3, **kw), None, s3, "e4m3")
    for a, b in ((h1, r1), (h2, r2), (h3, r3)):
        assert torch.equal(a.codes, b.codes)
    assert torch.equal(out, conv2d(r3, pw4, out_dtype=torch.float16, backend="fp8"))


def test_explain_names_the_one_pass():
    qx, pw, _ = _fp8_layer()
    o = torch.tensor([0.1])
    s = explain_conv2d(qx, pw, padding=1, pool=("max", 2, 2), out_fmt="e4m3", out_scale=o, backend="fp8")
    assert "max-pool 2x2 stride 2 + quantize to" in s and "(one Triton kernel)" in s
    s = explain_conv2d(qx, pw, padding=1, out_fmt="e5m2", out_scale=o, backend="fp8")
    assert s.endswith("-> float8_e5m2 QTensor") and "separate pass" not in s  # the epilogue writes the codes
    s = explain_conv2d(qx, pw, padding=1, pool=("avg", 2, 2), out_fmt="e4m3", out_scale=o, backend="fp8")
    assert "avg-pool 2x2 stride 2 (torch, float32)" in s
    plan = qconv.conv2d_plan(qx, pw, padding=1, out_fmt="e4m3", out_scale=o, backend="reference")
    assert plan.finish == "torch"  # the reference backend keeps torch's passes


# -- the dual float + float8 output (out_layout="fp8+float") and cross-kind chains -----------------------------


def _dual_case(layer, dtype=torch.float16):
    qx, pw, bias = (_fp8_layer if layer in ("fp8", "fp8-reference") else _int8_layer)(seed=21, K=8)
    backend = {"fp8-reference": "reference", "int8-reference": "reference"}.get(layer, layer)
    geo = dict(padding=1, bias=bias, backend=backend, out_dtype=dtype)
    branch = conv2d(qx, pw, **geo)
    gen = torch.Generator().manual_seed(22)
    res = (torch.randn(branch.shape, generator=gen) * float(branch.float().abs().max())).to(dtype)
    return qx, pw, geo, res


@pytest.mark.parametrize("layer", ["fp8", "int8", "fp8-reference", "int8-reference"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dual_fp8_output_equals_float_then_quantize(layer, dtype):
    """act(conv + residual) written once as the float (the next residual) and its e4m3 codes (the next FP8 convs):
    the float equals the float-only fused conv, the codes equal quantize_fp8_static of that float, on the INT8 /
    FP8 kernels (OUT_MODE 5) and the reference; the QTensor with hp feeds a conv as x (its codes) like one without."""
    qx, pw, geo, res = _dual_case(layer, dtype)
    y = conv2d(qx, pw, act="relu", residual=res, **geo)
    for o in (torch.tensor([0.05]), torch.tensor([0.001])):
        d = conv2d(qx, pw, act="relu", residual=res, out_fmt="e4m3", out_scale=o, out_layout="fp8+float", **geo)
        assert isinstance(d, QTensor) and d.fmt == tp.format("e4m3") and d.shape == tuple(y.shape)
        assert d.hp.dtype == dtype and torch.equal(d.hp, y)
        want = quantize_fp8_static(y, o, "e4m3")
        assert torch.equal(d.codes, want.codes) and torch.equal(d.scale.reshape(1), o)
        assert torch.equal(d.dequantize(torch.float32), d.codes.view(torch.float8_e4m3fn).float() * o)
        for act in ("relu", ("leaky", 0.1)):  # codes alone (a block output read only by FP8 convs): the same codes
            c = conv2d(qx, pw, act=act, residual=res, out_fmt="e4m3", out_scale=o, **geo)
            assert torch.equal(c.codes, quantize_fp8_static(conv2d(qx, pw, act=act, residual=res, **geo), o).codes)
    nxt = _fp8_layer(seed=23, C=8, K=4)[1]
    kw = dict(padding=1, backend="fp8" if layer in ("fp8", "int8") else "reference")
    assert torch.equal(conv2d(d, nxt, **kw), conv2d(dataclasses.replace(d, hp=None), nxt, **kw))


def test_dual_fp8_explain_and_bad_input():
    qx, pw, geo, res = _dual_case("fp8")
    o = torch.tensor([0.1])
    s = explain_conv2d(qx, pw, residual=res, out_fmt="e4m3", out_scale=o, out_layout="fp8+float", act="relu", **geo)
    assert s.endswith("-> float16 + float8_e4m3fn codes (float8 QTensor with hp)") and "residual" in s
    with pytest.raises(ValueError, match=r"out_layout='fp8\+float' .* needs out_fmt='e4m3' or 'e5m2', got out_fmt=uint8"):
        conv2d(qx, pw, out_fmt="uint8", out_scale=o, out_layout="fp8+float", **geo)
    with pytest.raises(ValueError, match=r"out_layout='int8\+float' writes integer codes .* got out_fmt=float8_e4m3fn"):
        conv2d(qx, pw, out_fmt="e4m3", out_scale=o, out_layout="int8+float", **geo)
    with pytest.raises(ValueError, match=r"out_layout='fp8\+float' cannot be combined with pool"):
        conv2d(qx, pw, out_fmt="e4m3", out_scale=o, out_layout="fp8+float", pool=("max", 2, 2), **geo)
    with pytest.raises(TypeError, match=r"hp must be None or a float tensor of the codes' shape \(2, 7, 9, 20\)"):
        dataclasses.replace(qx, hp=torch.zeros(2, 7, 9, 21))


@pytest.mark.parametrize("pool", [None, ("max", 2, 2), ("max", 2, 1)])
@pytest.mark.parametrize("fmt", ["uint8", "int8"])
def test_fp8_layer_hands_int8_codes(fmt, pool):
    """An FP8 conv -> the next INT8 conv's ShiftedInt8 QTensor (OUT_MODE 2 of the shared epilogue, or the int8
    pool + quantize pass): the codes of its float32 output through quantize_int8_static's torch path."""
    qx, pw, bias = _fp8_layer(seed=31)
    kw = dict(padding=1, act=("leaky", 0.1) if fmt == "int8" else "relu", bias=bias, backend="fp8")
    y32 = conv2d(qx, pw, **kw)
    o = torch.tensor([float(y32.abs().max()) / 200])  # some saturation
    got = conv2d(qx, pw, out_fmt=fmt, out_scale=o, out_layout="int8", pool=pool, **kw)
    want = qconv.quantize_int8_static(y32, fmt, o, pool, backend="reference")
    assert isinstance(got.layout, ShiftedInt8) and got.fmt == tp.format(fmt)
    assert torch.equal(got.data, want.data)
