"""tcprec.ops.qconv.conv2d on the GPU: the bit-serial backend (Triton im2col over packed planes +
the binary tensor-core GEMM) and the INT8 backend equal the float64 reference bit for bit on a spread
of shapes including the four models' layer shapes (AlexNet 11x11 s4 / 5x5, VGG 3x3, ResNet 7x7 s4 /
1x1 s2 / 3x3 s2, YOLOv2-tiny 3x3 and 1x1) at small batch; fused float / packed epilogues, LeakyReLU,
pooling; chaining; CUDA-graph capture.  The INT8 backend's Triton implicit-GEMM route (uint8 shifted and
corrected) bit-exact, the FP8 route within the summation bound, both inside a CUDA graph.  Skipped without a CUDA GPU (tests/conftest.py)."""

import pytest
import torch

import tcprec as tp
from tcprec.formats import IntFormat
from tcprec.ops import qconv
from tcprec.ops.qconv import conv2d, explain_conv2d, pack_conv_weight
from tcprec.qtensor import BitPlanes, PerChannel, PerTensor, QTensor

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
            for dt in (torch.float32, torch.float16, torch.bfloat16):  # (a max-pool pools the output dtype)
                want = conv2d(qx, qw, out_dtype=dt, backend="reference", **kw)
                got = conv2d(qx, qw, out_dtype=dt, backend="bitserial", **kw)
                assert torch.equal(got, want), (act, pool, dt)
            want = conv2d(qx, qw, out_fmt="uint2", out_scale=0.8, backend="reference", **kw)
            got = conv2d(qx, qw, out_fmt="uint2", out_scale=0.8, backend="bitserial", **kw)
            assert torch.equal(got.data, want.data), (act, pool, "packed")
            # compact rows (ceil(K / 32) words) where the epilogue writes the planes (no pool, or a max-pool on the
            # codes); after an avg-pool pass, padded rows (either is a valid input)
            got = conv2d(qx, qw, out_fmt="uint2", out_scale=0.8, backend="bitserial", out_layout="compact", **kw)
            if pool is None or pool[0] == "max":
                assert got.data.shape[2] == -(-K // 32), (act, pool)
            assert torch.equal(got.to_layout(BitPlanes()).data, want.data), (act, pool, "compact")


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
        assert isinstance(h.layout, BitPlanes)
        y = conv2d(h, pack_conv_weight(qw2), padding=1, act=("leaky", 0.1), pool=("max", 2, 2), backend=be)
        if be == "bitserial":
            got_h, got_y = h, y
    assert torch.equal(got_h.data, h.data) and torch.equal(got_y, y)


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


# ------------------------------------------------------------------------------------------------
# INT8 backend on the Triton implicit-GEMM conv; FP8 operands
# ------------------------------------------------------------------------------------------------

INT8_PAIRS = [("uint8", "int8"), ("int8", "int8"), ("uint8", "int4"), ("uint4", "int4"), ("pm8", "int8")]


@pytest.mark.parametrize("i", range(len(MODEL_LAYERS)), ids=[m[0] for m in MODEL_LAYERS])
def test_int8_kernel_route_equals_reference_on_model_layers(i):
    """uint8 (shifted, corrected over the in-image taps) and the other int8 forms, raw and fused."""
    fa, fw = INT8_PAIRS[i % len(INT8_PAIRS)]
    qx, qw, geo = _layer(i, fa, fw, seed=50)
    if fa == "pm8":
        geo = dict(geo, padding=0)  # pm activations have no zero for padding
    pw = pack_conv_weight(qw)
    assert "Triton implicit-GEMM INT8 conv" in explain_conv2d(qx, pw, backend="int8", **geo)
    want = conv2d(qx, qw, out_dtype=torch.int32, backend="reference", **geo)
    got = conv2d(qx, pw, out_dtype=torch.int32, backend="int8", **geo)
    assert torch.equal(got, want), f"{MODEL_LAYERS[i][0]} {fa}x{fw}: {int((got != want).sum())} wrong"
    K = qw.shape[0]
    gen = torch.Generator(DEV).manual_seed(9)
    scale = (torch.rand(K, device=DEV, generator=gen) + 0.5) * 1e-4
    bias = torch.randn(K, device=DEV, generator=gen)
    for act, dt in ((None, torch.float32), ("relu", torch.float16), (("leaky", 0.1), torch.bfloat16)):
        kw = dict(scale=scale, bias=bias, act=act, out_dtype=dt, **geo)
        assert torch.equal(conv2d(qx, pw, backend="int8", **kw), conv2d(qx, qw, backend="reference", **kw)), (act, dt)
        if dt != torch.float32:  # a max-pooled half output: the kernel writes dt at full size, one pass pools it
            for pool in (("max", 2, 2), ("max", 2, 1)):
                kp = dict(kw, pool=pool)
                assert torch.equal(conv2d(qx, pw, backend="int8", **kp),
                                   conv2d(qx, qw, backend="reference", **kp)), (act, dt, pool)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape, dtype", [((4, 16, 9, 7), torch.float16), ((2, 3, 11, 13), torch.float16),
                                          ((3, 5, 6, 4), torch.float32), ((37, 5), torch.bfloat16)])
def test_quantize_fp8_static_triton_pass_equals_torch_ops(fmt, shape, dtype):
    """On CUDA the FP8 activation quantizer is one Triton pass; its codes equal the torch ops it replaced (run on
    the CPU copy): saturation to +-max, round to nearest even, NaN stays NaN; the fp16 NHWC view of a channels_last
    tensor QConv2d passes (3 channels: a network's input), float32, a 2-D bfloat16 tensor."""
    gen = torch.Generator(DEV).manual_seed(5)
    x = (torch.randn(*shape, device=DEV, generator=gen) * 300).to(dtype)
    x.view(-1)[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 65504.0, -0.0, 1e-7], device=DEV)
    xn = x.to(memory_format=torch.channels_last).permute(0, 2, 3, 1) if x.dim() == 4 else x
    scale = torch.tensor([0.37], device=DEV)
    got = qconv.quantize_fp8_static(xn, scale, fmt)
    want = qconv.quantize_fp8_static(xn.cpu(), scale.cpu(), fmt)
    assert got.codes.shape == want.codes.shape == xn.shape
    f8 = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    g, w = got.codes.cpu().view(f8).float(), want.codes.view(f8).float()
    assert torch.equal(g.isnan(), w.isnan())
    assert torch.equal(got.codes.cpu()[~w.isnan()], want.codes[~w.isnan()])


def _fp8_layer(i, seed=0):
    name, xs, (K, R, S), st, pd = MODEL_LAYERS[i]
    gen = torch.Generator(DEV).manual_seed(seed + i)
    x = torch.randn(xs, device=DEV, generator=gen)
    w = torch.randn((K, R, S, xs[3]), device=DEV, generator=gen) / (R * S * xs[3]) ** 0.5
    qx = qconv.quantize_fp8_static(x, (x.abs().amax() / 448).reshape(1))
    qw = tp.quantize(w, "e4m3", PerChannel(0))
    return qx, qw, dict(stride=st, padding=pd)


@pytest.mark.parametrize("fast", [True, False], ids=["fast_accum", "promoted"])
@pytest.mark.parametrize("i", [0, 1, 4, 6, 8, 10, 12], ids=[MODEL_LAYERS[j][0] for j in (0, 1, 4, 6, 8, 10, 12)])
def test_fp8_route_within_bound_on_model_layers(i, fast):
    """|y - exact| within the summation bound: u = 2^-24 per add promoted; Hopper's fast fp8 accumulator
    keeps fewer bits (~2^-13 per add taken here, a loose bound), plus the float32 epilogue roundings."""
    from tcprec.kernels import reference_conv_int8_fp8 as rf

    qx, qw, geo = _fp8_layer(i)
    pw = pack_conv_weight(qw)
    K = qw.shape[0]
    bias = torch.randn(K, device=DEV, generator=torch.Generator(DEV).manual_seed(1)) * 0.1
    assert explain_conv2d(qx, pw, **geo).startswith("fp8:")
    y = conv2d(qx, pw, bias=bias, act="relu", fp8_fast_accum=fast, **geo)
    x8, w8 = qx.codes.view(torch.float8_e4m3fn), pw.w8
    col = (qx.scale.reshape(1) * pw.w_scale).double()
    acc = rf.conv_acc(x8, w8, **geo)
    exact = torch.relu(acc * col + bias.double())
    red = qw.shape[1] * qw.shape[2] * qw.shape[3]
    # promoted: fp32 adds, plus the narrow accumulator within each BLOCK_K <= 128 chunk (test_conv_fwd_gpu.py)
    u = 1.01 * red * 2.0**-13 if fast else 1.01 * red * 2.0**-24 + 128 * 2.0**-13
    absacc = rf.abs_conv_acc(x8, w8, **geo) * col
    bound = u * absacc + 4 * 2.0**-24 * (absacc + bias.double().abs()) + 1e-30
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"worst err/bound {float((err / bound).max()):.3g}"
    assert float(err.norm() / exact.norm()) < (1e-2 if fast else 5e-3)


def test_int8_and_fp8_routes_in_cuda_graph():
    """uint8 (padded: the cached correction table) and fp8 layers, chained, captured and replayed."""
    qx, qw, geo = _layer(4, "uint8", "int8", seed=21)  # vgg14: 3x3 padded
    pw = pack_conv_weight(qw)
    K = qw.shape[0]
    bias = torch.randn(K, device=DEV)
    scale = torch.full((K,), 1e-4, device=DEV)
    qf = tp.quantize(torch.randn(K, 3, 3, K, device=DEV) / 48, "e4m3", PerChannel(0))
    pf = pack_conv_weight(qf)
    s_mid = torch.tensor([0.05], device=DEV)

    def step():
        h = conv2d(qx, pw, scale=scale, bias=bias, act="relu", out_fmt="e4m3", out_scale=s_mid, backend="int8", **geo)
        return conv2d(h, pf, act=("leaky", 0.1), pool=("max", 2, 2), out_dtype=torch.float16, **geo), h

    want, h_want = step()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        step()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, h = step()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(h.codes, h_want.codes)
    h_ref = conv2d(qx, qw, scale=scale, bias=bias, act="relu", out_fmt="e4m3", out_scale=s_mid, backend="reference",
                   **geo)
    assert torch.equal(h.codes, h_ref.codes)  # int8 part exact, the same float32 epilogue and fp8 rounding
    # a fresh weight whose correction is first computed inside the capture is not cached
    pw2 = pack_conv_weight(qw)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        out2 = conv2d(qx, pw2, out_dtype=torch.int32, backend="int8", **geo)
    g2.replay()
    torch.cuda.synchronize()
    assert not pw2.corr
    assert torch.equal(out2, conv2d(qx, qw, out_dtype=torch.int32, backend="reference", **geo))


@pytest.mark.parametrize("i", [6, 7, 8], ids=[MODEL_LAYERS[j][0] for j in (6, 7, 8)])
def test_int8_residual_and_dual_output_equal_reference(i):
    """A ResNet block's last conv with its shortcut add and ReLU fused (ops.qconv.conv2d(residual=)): the INT8
    kernel route equals the reference backend bit for bit -- fp16 / bf16 float output, the next layer's uint8
    codes, and both at once (a ShiftedInt8 QTensor with hp) -- and equals the unfused conv + torch add + ReLU; in a CUDA graph."""
    qx, qw, geo = _layer(i, "uint8", "int8", seed=70)
    pw = pack_conv_weight(qw)
    K = qw.shape[0]
    gen = torch.Generator(DEV).manual_seed(71)
    scale = (torch.rand(K, device=DEV, generator=gen) + 0.5) * 1e-4
    bias = torch.randn(K, device=DEV, generator=gen)
    for dt in (torch.float16, torch.bfloat16):
        y0 = conv2d(qx, qw, scale=scale, bias=bias, out_dtype=dt, backend="reference", **geo)
        res = (torch.randn(y0.shape, device=DEV, generator=gen) * y0.float().abs().amax()).to(dt)
        unfused = torch.relu(y0 + res)
        s_out = (unfused.float().amax() / 300).reshape(1)  # the top 15% saturate at code 255
        kw = dict(scale=scale, bias=bias, act="relu", out_dtype=dt, residual=res, **geo)
        assert "residual" in explain_conv2d(qx, pw, backend="int8", **kw)
        assert torch.equal(conv2d(qx, pw, backend="int8", **kw), unfused)
        assert torch.equal(conv2d(qx, qw, backend="reference", **kw), unfused)
        want = qconv.quantize_int8_static(unfused, "uint8", s_out)
        for layout in ("int8", "int8+float"):
            okw = dict(kw, out_fmt="uint8", out_scale=s_out, out_layout=layout)
            a, b = conv2d(qx, pw, backend="int8", **okw), conv2d(qx, qw, backend="reference", **okw)
            assert torch.equal(a.data, want.data) and torch.equal(b.data, want.data), (dt, layout)
            assert int(a.data.max()) == 127  # code 255, stored shifted
            if layout == "int8+float":
                assert torch.equal(a.hp, unfused) and torch.equal(b.hp, unfused)
    okw = dict(kw, out_fmt="uint8", out_scale=s_out, out_layout="int8+float")
    d = conv2d(qx, pw, backend="int8", **okw)  # compiled and the correction cached outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g = conv2d(qx, pw, backend="int8", **okw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g.data, d.data) and torch.equal(g.hp, d.hp)
