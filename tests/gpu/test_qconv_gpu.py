"""tcprec.ops.qconv.conv2d on the GPU: the bit-serial backend (Triton im2col over packed planes +
the binary tensor-core GEMM) and the INT8 backend equal the float64 reference bit for bit on a spread
of shapes including the four models' layer shapes (AlexNet 11x11 s4 / 5x5, VGG 3x3, ResNet 7x7 s4 /
1x1 s2 / 3x3 s2, YOLOv2-tiny 3x3 and 1x1) at small batch; fused float / packed epilogues, LeakyReLU,
pooling; chaining; CUDA-graph capture.  Skipped without a CUDA GPU (tests/conftest.py)."""

import pytest
import torch

import tcprec as tp
from tcprec.formats import IntFormat
from tcprec.ops.qconv import PackedActivation, conv2d, explain_conv2d, pack_conv_weight
from tcprec.qtensor import PerChannel, PerTensor, QTensor

DEV = "cuda"

# name, (N, H, W, C), (K, R, S), stride, padding
MODEL_LAYERS = [
    ("alexnet1", (2, 224, 224, 3), (64, 11, 11), 4, 2),
    ("alexnet2", (2, 27, 27, 64), (192, 5, 5), 1, 2),
    ("vgg1", (2, 224, 224, 3), (96, 3, 3), 2, 1),
    ("vgg56", (2, 56, 56, 96), (256, 3, 3), 1, 1),
    ("vgg14", (2, 14, 14, 512), (512, 3, 3), 1, 1),
    ("resnet_stem", (2, 224, 224, 3), (64, 7, 7), 4, 3),
    ("resnet_down1x1", (2, 56, 56, 64), (128, 1, 1), 2, 0),
    ("resnet_s2", (2, 56, 56, 64), (128, 3, 3), 2, 1),
    ("resnet_1x1", (2, 7, 7, 512), (512, 1, 1), 1, 0),
    ("yolo1", (1, 416, 416, 3), (16, 3, 3), 1, 1),
    ("yolo13", (1, 13, 13, 512), (1024, 3, 3), 1, 1),
    ("yolo_head", (1, 13, 13, 1024), (125, 1, 1), 1, 0),
    ("odd", (3, 17, 13, 37), (29, 5, 3), (2, 1), (1, 2)),
]
PAIRS = [("uint2", "binary"), ("int2", "int2"), ("uint1", "binary"), ("uint3", "int2"), ("uint4", "int4")]


def _qt(shape, fmt, gen, granularity=None):
    fmt = tp.format(fmt) if isinstance(fmt, str) else fmt
    codes = torch.randint(0, fmt.n_codes, shape, dtype=torch.uint8, device=DEV, generator=gen)
    g = granularity or PerTensor()
    scale = (torch.rand(g.scale_shape(shape), device=DEV, generator=gen) + 0.5).to(torch.float32)
    return QTensor(codes, scale, fmt, g, shape, torch.float32)


def _layer(i, fa, fw, seed=0):
    name, xs, (K, R, S), st, pd = MODEL_LAYERS[i]
    gen = torch.Generator(DEV).manual_seed(seed + i)
    qx = _qt(xs, fa, gen)
    qw = _qt((K, R, S, xs[3]), fw, gen, PerChannel(0))
    return qx, qw, dict(stride=st, padding=pd)


@pytest.mark.parametrize("i", range(len(MODEL_LAYERS)), ids=[m[0] for m in MODEL_LAYERS])
def test_bitserial_and_int8_equal_reference_on_model_layers(i):
    fa, fw = PAIRS[i % len(PAIRS)]
    qx, qw, geo = _layer(i, fa, fw)
    want = conv2d(qx, qw, out_dtype=torch.int32, backend="reference", **geo)
    got = conv2d(qx, qw, out_dtype=torch.int32, backend="bitserial", **geo)
    assert torch.equal(got, want), f"{MODEL_LAYERS[i][0]} {fa}x{fw}: {int((got != want).sum())} wrong"
    got8 = conv2d(qx, qw, out_dtype=torch.int32, backend="int8", **geo)
    assert torch.equal(got8, want)


@pytest.mark.parametrize("i", [1, 4, 6, 10, 12])
def test_w1a2_fused_epilogues_equal_reference(i):
    qx, qw, geo = _layer(i, "uint2", "binary", seed=100)
    K = qw.shape[0]
    gen = torch.Generator(DEV).manual_seed(7)
    scale = torch.rand(K, device=DEV, generator=gen) + 0.5
    bias = torch.randn(K, device=DEV, generator=gen) * 4
    for act in (None, "relu", ("leaky", 0.1)):
        for pool in (None, ("max", 2, 2), ("avg", 2, 2), ("max", 2, 1)):
            kw = dict(scale=scale, bias=bias, act=act, pool=pool, **geo)
            for dt in (torch.float32, torch.float16):
                want = conv2d(qx, qw, out_dtype=dt, backend="reference", **kw)
                got = conv2d(qx, qw, out_dtype=dt, backend="bitserial", **kw)
                assert torch.equal(got, want), (act, pool, dt)
            want = conv2d(qx, qw, out_fmt="uint2", out_scale=0.8, backend="reference", **kw)
            got = conv2d(qx, qw, out_fmt="uint2", out_scale=0.8, backend="bitserial", **kw)
            assert torch.equal(got.planes, want.planes), (act, pool, "packed")


def test_pm1_activations_and_chaining():
    """pm1 x pm1 (no padding) and a two-layer chain on packed planes, against the reference."""
    gen = torch.Generator(DEV).manual_seed(3)
    qx = _qt((2, 15, 15, 70), "binary", gen)
    qw = _qt((64, 3, 3, 70), "binary", gen, PerChannel(0))
    want = conv2d(qx, qw, out_dtype=torch.int32, backend="reference", stride=2)
    assert torch.equal(conv2d(qx, qw, out_dtype=torch.int32, backend="bitserial", stride=2), want)
    qw2 = _qt((48, 3, 3, 64), "binary", gen, PerChannel(0))
    bias = torch.randn(64, device=DEV, generator=gen)
    for be in ("bitserial", "reference"):
        h = conv2d(qx, qw, bias=bias, act="relu", out_fmt="uint2", out_scale=2.0, backend=be)
        assert isinstance(h, PackedActivation)
        y = conv2d(h, pack_conv_weight(qw2), padding=1, act=("leaky", 0.1), pool=("max", 2, 2), backend=be)
        if be == "bitserial":
            got_h, got_y = h, y
    assert torch.equal(got_h.planes, h.planes) and torch.equal(got_y, y)


def test_auto_picks_bitserial_for_w1a2_and_int8_for_w4a4():
    qx, qw, geo = _layer(4, "uint2", "binary")
    assert explain_conv2d(qx, qw, **geo).startswith("bitserial:")
    qx, qw, geo = _layer(4, "uint4", "int4")
    assert explain_conv2d(qx, qw, **geo).startswith("int8:")


def test_cuda_graph_capture():
    qx, qw, geo = _layer(4, "uint2", "binary", seed=5)
    pw = pack_conv_weight(qw)
    bias = torch.randn(qw.shape[0], device=DEV)
    h = conv2d(qx, pw, bias=bias, act="relu", out_fmt="uint2", out_scale=1.5, backend="bitserial", **geo)

    def step():
        a = conv2d(qx, pw, bias=bias, act="relu", out_fmt="uint2", out_scale=1.5, **geo)
        return conv2d(a, pw, bias=bias, act=("leaky", 0.1), pool=("max", 2, 1), out_dtype=torch.float16, **geo)

    want = step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    ref = conv2d(h, qw, bias=bias, act=("leaky", 0.1), pool=("max", 2, 1), out_dtype=torch.float16,
                 backend="reference", **geo)
    assert torch.equal(out, ref)
