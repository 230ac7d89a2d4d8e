"""kernels/cuda/stem_conv.cu through tcprec.ops.qconv.conv2d on the GPU: a thin 8-bit stem (C <= 4) that writes the
next bit-serial layer's planes equals the float64 reference's planes bit for bit, and one that writes its 16-bit float
(and the planes of it) the reference's float (float64 integers, float32 epilogue) bit for bit -- the four networks' stems, odd
sizes, dilation, C = 1 and 4, K > 128 (two channel blocks), int8 and uint8 (shifted) inputs, 1..3-bit outputs of
every encoding, none / ReLU / LeakyReLU, negative and zero column scales (the float path), with and without the
2x2 pool, padded and compact rows, inside a CUDA graph; the threshold words follow in-place changes of the
buffers they come from.  Skipped without a CUDA GPU (tests/conftest.py)."""

import pytest
import torch

import tcprec as tp
from tcprec.kernels.cuda import stem_conv as sc
from tcprec.ops.qconv import conv2d, explain_conv2d, pack_conv_weight
from tcprec.qtensor import BitPlanes, PerChannel, PerTensor, QTensor

DEV = "cuda"
POOL = ("max", 2, 2)

# name, (N, H, W, C), (K, R, S), stride, padding, dilation, pool
STEMS = [
    ("vgg", (2, 224, 224, 3), (96, 3, 3), 2, 1, 1, POOL),
    ("alexnet", (2, 224, 224, 3), (64, 11, 11), 4, 2, 1, POOL),
    ("yolo", (1, 416, 416, 3), (16, 3, 3), 1, 1, 1, POOL),
    ("resnet", (2, 224, 224, 3), (64, 7, 7), 4, 3, 1, None),
    ("odd_dilated_c1", (3, 37, 29, 1), (40, 5, 3), (2, 1), (2, 0), (1, 2), POOL),
    ("c4_two_blocks", (2, 30, 30, 4), (160, 3, 3), 1, 1, 1, None),
    ("odd_floor_pool", (2, 33, 35, 3), (24, 3, 3), 1, 0, 1, POOL),
    ("odd_k", (2, 31, 27, 3), (37, 5, 5), 2, 2, 1, None),
]
NO_POOL = [i for i, st in enumerate(STEMS) if st[6] is None]
# (input format, output format, act)
CASES = [("int8", "uint2", "relu"), ("uint8", "int2", None), ("int8", "uint1", ("leaky", 0.1)),
         ("uint8", "int3", "relu"), ("int8", "binary", None), ("int8", "uint3", ("leaky", 0.25))]


def _qt(shape, fmt, gen, granularity=None):
    fmt = tp.format(fmt)
    codes = torch.randint(0, fmt.n_codes, shape, dtype=torch.uint8, device=DEV, generator=gen)
    g = granularity or PerTensor()
    scale = (torch.rand(g.scale_shape(shape), device=DEV, generator=gen) + 0.5).to(torch.float32)
    return QTensor(codes, scale, fmt, g, shape, torch.float32)


def _stem(i, fa, seed=0):
    name, xs, (K, R, S), st, pd, dl, pool = STEMS[i]
    gen = torch.Generator(DEV).manual_seed(seed + 17 * i)
    qx = _qt(xs, fa, gen)
    qw = _qt((K, R, S, xs[3]), "int8", gen, PerChannel(0))
    scale = (torch.rand(K, device=DEV, generator=gen) + 0.5) * 1e-3
    scale[::5] *= -1  # negative columns: pooled by their smallest sum
    bias = torch.randn(K, device=DEV, generator=gen)
    return qx, pack_conv_weight(qw), dict(stride=st, padding=pd, dilation=dl, pool=pool, scale=scale, bias=bias)


def _check(qx, pw, kw, label):
    assert "stem_conv" in explain_conv2d(qx, pw, backend="int8", **kw), label
    want = conv2d(qx, pw, backend="reference", **kw).to_layout(BitPlanes()).data
    got = conv2d(qx, pw, backend="int8", **kw)
    assert got.to_layout(BitPlanes()).data.shape == want.shape, label
    bad = int((got.to_layout(BitPlanes()).data != want).sum())
    assert bad == 0, f"{label}: {bad} of {want.numel()} words differ"
    return got


@pytest.mark.parametrize("i", range(len(STEMS)), ids=[s[0] for s in STEMS])
@pytest.mark.parametrize("c", range(len(CASES)), ids=[f"{a}-{o}-{t}" for a, o, t in CASES])
def test_stem_planes_equal_reference(i, c):
    fa, fo, act = CASES[c]
    qx, pw, kw = _stem(i, fa, seed=c)
    label = f"{STEMS[i][0]} {fa}->{fo} act={act}"
    _check(qx, pw, dict(kw, act=act, out_fmt=fo, out_scale=0.37), label)
    if c == 0:  # compact rows (what a gathering consumer reads)
        got = _check(qx, pw, dict(kw, act=act, out_fmt=fo, out_scale=0.37, out_layout="compact"), label + " compact")
        assert got.data.shape[2] == -(-pw.qw.shape[0] // 32)


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("i", NO_POOL, ids=[STEMS[i][0] for i in NO_POOL])
def test_stem_float_and_dual_outputs_equal_reference(i, dt):
    """Without a pool stem_conv.cu writes the 16-bit float output (what the reference's float32 epilogue gives, bit for
    bit) and, for ``out_layout="planes+float"`` (ResNet-18's stem: the first block's shortcut and its conv1's input),
    that float and the planes of it (what a quantize pass over the float gives)."""
    for c, (fa, fo, act) in enumerate(CASES):
        qx, pw, kw = _stem(i, fa, seed=30 + c)
        kw = dict(kw, act=act, out_dtype=dt)
        label = f"{STEMS[i][0]} {fa} {dt} act={act}"
        dual = dict(kw, out_fmt=fo, out_scale=0.37, out_layout="planes+float")
        assert "stem_conv" in explain_conv2d(qx, pw, backend="int8", **kw), label
        assert "stem_conv" in explain_conv2d(qx, pw, backend="int8", **dual), label
        y = conv2d(qx, pw, backend="int8", **kw)
        pa = conv2d(qx, pw, backend="int8", **dual)
        ref = conv2d(qx, pw, backend="reference", **dual)  # (the float64 conv's integers, float32 epilogue)
        want = ref.hp
        assert y.dtype == dt and y.shape == want.shape and want.abs().max() > 1, label
        bad = int((_bits(y) != _bits(want)).sum())
        assert bad == 0, f"{label}: {bad} of {y.numel()} floats differ"
        assert torch.equal(_bits(pa.hp), _bits(want)), label
        assert pa.layout.compact, label
        assert torch.equal(pa.codes, ref.codes), label


def test_float_path_for_marked_columns():
    """A zero column scale (a dead BN channel: the code never reaches the top) marks the column, so its block takes
    the float path -- the same planes as the reference, for the marked and the other columns."""
    for i in (0, 4):
        qx, pw, kw = _stem(i, "int8", seed=9)
        kw["scale"][3] = 0.0
        kw["scale"][7] = -0.0
        _check(qx, pw, dict(kw, act="relu", out_fmt="uint2", out_scale=0.37), f"{STEMS[i][0]} marked")
        _check(qx, pw, dict(kw, act=None, out_fmt="int2", out_scale=0.37), f"{STEMS[i][0]} marked, no act")


def test_dual_output_in_a_graph():
    qx, pw, kw = _stem(3, "int8", seed=5)
    kw = dict(kw, act="relu", out_dtype=torch.float16, out_fmt="uint2", out_scale=torch.tensor([0.37], device=DEV),
              out_layout="planes+float")
    first = conv2d(qx, pw, backend="int8", **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = conv2d(qx, pw, backend="int8", **kw)
    out.data.zero_()
    out.hp.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.data, first.data) and torch.equal(_bits(out.hp), _bits(first.hp))


def test_graph_capture_and_thresholds_follow_buffers():
    qx, pw, kw = _stem(0, "uint8", seed=4)
    kw = dict(kw, act="relu", out_fmt="uint2", out_scale=torch.tensor([0.37], device=DEV))
    first = _check(qx, pw, kw, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = conv2d(qx, pw, backend="int8", **kw)
    out.data.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.data, first.data)
    kw["bias"].add_(0.5)  # in place: the remembered threshold words must be derived again
    kw["out_scale"].mul_(1.5)
    second = _check(qx, pw, kw, "after in-place changes")
    assert not torch.equal(second.data, first.data)


def test_route_rules():
    """Stems with a 16-channel input, a 4-bit output, a pooled or float32 float output, or a residual keep the Triton
    route."""
    qx, pw, kw = _stem(0, "int8")
    assert "stem_conv" not in explain_conv2d(qx, pw, backend="int8", **dict(kw, out_fmt="uint4", out_scale=0.3))
    assert "stem_conv" not in explain_conv2d(qx, pw, backend="int8", **kw)
    assert "stem_conv" not in explain_conv2d(qx, pw, backend="int8", **dict(kw, out_dtype=torch.float16))
    qr, pr, kr = _stem(3, "int8")
    assert "stem_conv" in explain_conv2d(qr, pr, backend="int8", **dict(kr, out_dtype=torch.float16))
    assert "stem_conv" not in explain_conv2d(qr, pr, backend="int8", **kr)  # float32
    res = torch.zeros((2, 56, 56, 64), dtype=torch.float16, device=DEV)
    assert "stem_conv" not in explain_conv2d(qr, pr, backend="int8", **dict(kr, out_dtype=torch.float16, residual=res))
    assert "stem_conv" not in explain_conv2d(qr, pr, backend="int8", **dict(kr, out_dtype=torch.float16, out_fmt="uint4",
                                                                          out_scale=0.3, out_layout="planes+float"))
    gen = torch.Generator(DEV).manual_seed(1)
    qx16 = _qt((1, 20, 20, 5), "int8", gen)
    pw16 = pack_conv_weight(_qt((32, 3, 3, 5), "int8", gen, PerChannel(0)))
    assert "stem_conv" not in explain_conv2d(qx16, pw16, backend="int8", out_fmt="uint2", out_scale=0.3)


def test_kernel_bad_input():
    gen = torch.Generator(DEV).manual_seed(2)
    x8 = torch.randint(-128, 128, (1, 16, 16, 3), dtype=torch.int8, device=DEV, generator=gen)
    w8 = torch.randint(-128, 128, (32, 3, 3, 3), dtype=torch.int8, device=DEV, generator=gen)
    wq = sc.stem_weight_words(w8)
    ones = torch.ones(32, device=DEV)
    s = torch.ones(1, device=DEV)
    kw = dict(col_scale=ones, bias=None, out_scale=s)
    with pytest.raises(ValueError, match=r"stem_conv act must be None, 'relu' or \('leaky', slope >= 0\)"):
        sc.conv_planes(x8, wq, 32, 3, 3, act=("leaky", -0.1), **kw)
    with pytest.raises(ValueError, match=r"wq must be stem_weight_words\(w8\) of shape \(1, 512\)"):
        sc.conv_planes(x8, wq[:, :4].contiguous(), 32, 3, 3, **kw)
    with pytest.raises(ValueError, match=r"ldo=0 is less than the 1 words of 32 channels"):
        sc.conv_planes(x8, wq, 32, 3, 3, ldo=0, **kw)
