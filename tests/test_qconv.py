"""tcprec.ops.qconv.conv2d on the CPU: the integer convolution equals F.conv2d on decoded codes (float64)
for kernel sizes 1, 3, 5, 7, 11, strides 1, 2, 4, padding, dilation 2, odd sizes and channel counts, a
spread of (p, q) and the three encodings -- on the reference backend and through the whole bit-serial
pipeline (the Triton im2col over packed planes under TRITON_INTERPRET=1, then the bmma_gemm contract
emulated in torch); the INT8 path; the float / packed epilogues, activations and pooling; packed
chaining; bad input."""

import pytest
import torch
import torch.nn.functional as F

import tcprec as tp
from tcprec.formats import IntFormat
from tcprec.kernels import reference_gemm as rg
from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.kernels.conv_geometry import ConvGeometry
from tcprec.packing import pack_bitplanes
from tcprec.ops import qconv
from tcprec.ops.quantize import quantize_static
from tcprec.ops.qconv import conv2d, explain_conv2d, pack_activation, pack_conv_weight
from tcprec.qtensor import BitPlanes, Dense, PerChannel, PerGroup, PerTensor, QTensor, ShiftedInt8, int8_affine, int8_codes

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
ENC = ("twos", "unsigned", "pm1")

# (R, stride, padding, dilation, N, H, W, C, K, p, enc_a, q, enc_w): every kernel size, stride, odd sizes
CASES = [
    (1, 1, 0, 1, 2, 5, 7, 3, 4, 2, "unsigned", 1, "pm1"),  # pointwise: no im2col
    (1, 2, 0, 1, 1, 9, 7, 33, 5, 1, "pm1", 2, "twos"),  # ResNet downsample 1x1 s2, pm1 activations
    (3, 1, 1, 1, 1, 7, 9, 5, 6, 2, "unsigned", 1, "pm1"),  # VGG / YOLO 3x3
    (3, 2, 1, 1, 2, 9, 9, 17, 3, 3, "twos", 2, "unsigned"),
    (3, 1, 2, 2, 1, 11, 7, 7, 5, 2, "twos", 2, "pm1"),  # dilation 2
    (5, 1, 2, 1, 1, 9, 11, 31, 4, 4, "unsigned", 1, "twos"),
    (5, 2, 0, 1, 1, 13, 9, 3, 7, 1, "pm1", 1, "pm1"),  # pm1 x pm1, no padding
    (7, 4, 3, 1, 1, 17, 19, 3, 5, 2, "unsigned", 2, "twos"),  # ResNet stem 7x7 s4
    (7, 2, 0, 2, 1, 19, 17, 6, 3, 5, "twos", 3, "pm1"),
    (11, 4, 2, 1, 1, 23, 27, 3, 4, 8, "unsigned", 1, "pm1"),  # AlexNet stem 11x11 s4
    (11, 4, 0, 1, 1, 15, 15, 65, 2, 1, "twos", 8, "twos"),
    (3, (2, 1), (0, 1), (1, 2), 1, 8, 9, 40, 3, 6, "unsigned", 7, "unsigned"),  # pairs
]


def _qt(shape, fmt, gen, granularity=None):
    codes = torch.randint(0, fmt.n_codes, shape, dtype=torch.uint8, generator=gen)
    g = granularity or PerTensor()
    scale = (torch.rand(g.scale_shape(shape), generator=gen) + 0.5).to(torch.float32)
    return QTensor(codes, scale, fmt, g, shape, torch.float32)


def _exact(qx, qw, stride=1, padding=0, dilation=1):
    """F.conv2d on the decoded codes in float64 (tcprec.decode: independent of reference_conv_bitserial)."""
    x = tp.decode(qx.codes, qx.fmt).double().permute(0, 3, 1, 2)
    w = tp.decode(qw.codes, qw.fmt).double().permute(0, 3, 1, 2)
    return F.conv2d(x, w, stride=stride, padding=padding, dilation=dilation).permute(0, 2, 3, 1).round().long()


def _case(i):
    R, st, pd, dl, N, H, W, C, K, p, ea, q, ew = CASES[i]
    gen = torch.Generator().manual_seed(1000 + i)
    qx = _qt((N, H, W, C), IntFormat(p, encoding=ea), gen)
    qw = _qt((K, R, R, C), IntFormat(q, encoding=ew), gen, PerChannel(0))
    return qx, qw, dict(stride=st, padding=pd, dilation=dl)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_integer_conv_exact_reference_and_bitserial_pipeline(i):
    qx, qw, geo = _case(i)
    want = _exact(qx, qw, **geo)
    ref = conv2d(qx, qw, out_dtype=torch.int32, **geo)
    assert ref.dtype == torch.int32 and ref.shape == want.shape
    assert torch.equal(ref.long(), want)
    bs = qconv._conv2d_impl(qx, qw, out_dtype=torch.int32, _gemm=rq.bmma_gemm_reference, **geo)
    assert torch.equal(bs.long(), want)


@pytest.mark.parametrize("i", [0, 2, 4, 7])
def test_int8_path_exact(i):
    qx, qw, geo = _case(i)
    got = conv2d(qx, qw, out_dtype=torch.int32, backend="int8", **geo)
    assert torch.equal(got.long(), _exact(qx, qw, **geo))


@pytest.mark.parametrize("enc", ENC)
@pytest.mark.parametrize("p,q", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 4), (8, 8)])
def test_every_encoding_and_width(p, q, enc):
    """Both operands of one encoding (pm1 activations unpadded), 3x3 stride 2 on odd sizes."""
    gen = torch.Generator().manual_seed(7 * p + q)
    qx = _qt((1, 7, 5, 35), IntFormat(p, encoding=enc), gen)
    qw = _qt((3, 3, 3, 35), IntFormat(q, encoding=enc), gen)
    geo = dict(stride=2, padding=0 if enc == "pm1" else 1)
    want = _exact(qx, qw, **geo)
    assert torch.equal(conv2d(qx, qw, out_dtype=torch.int32, **geo).long(), want)
    assert torch.equal(qconv._conv2d_impl(qx, qw, out_dtype=torch.int32, _gemm=rq.bmma_gemm_reference, **geo).long(),
                       want)


def test_triton_im2col_equals_reference_and_row_correction():
    """The word gather and the fused pm1 row correction, against the torch gather + reference_gemm.corrections."""
    from tcprec.kernels.triton.im2col_bits import im2col_bits

    gen = torch.Generator().manual_seed(3)
    for fa, (R, st, pd, dl, C) in [(IntFormat(2, signed=True), (3, 2, 1, 2, 45)),
                                   (IntFormat(3, signed=False), (5, 1, 2, 1, 3)),
                                   (IntFormat(1, encoding="pm1"), (3, 1, 0, 1, 70))]:
        N, H, W, K = 2, 9, 7, 3
        codes = torch.randint(0, fa.n_codes, (N, H, W, C), dtype=torch.uint8, generator=gen)
        g = ConvGeometry(N, H, W, C, K, R, R, (st, st), (pd, pd), (dl, dl))
        planes = tp.pack_bitplanes(codes.reshape(N * H * W, C), fa.bits)
        fw = IntFormat(1, encoding="pm1")
        oa, sa = rg.affine(fa)
        ow, sw = rg.affine(fw)
        Kt = R * R * C
        cols, row = im2col_bits(planes, g, twos=fa.encoding == "twos", rowsum=True, row_mul=sa * ow,
                                row_add=Kt * oa * ow)
        ref = rq.im2col_bits(planes, g)
        assert torch.equal(cols, ref)
        w_planes = torch.zeros(1, 1, ref.shape[-1], dtype=torch.int32)
        _, row_ref, _ = rg.corrections(ref, w_planes, Kt, fa, fw)
        assert torch.equal(row.long(), row_ref)


def test_float_epilogue_scale_bias_acts():
    qx, qw, geo = _case(2)
    gen = torch.Generator().manual_seed(5)
    scale, bias = torch.rand(6, generator=gen) + 0.5, torch.randn(6, generator=gen)
    C = _exact(qx, qw, **geo)
    col = (qx.scale.reshape(1) * qw.scale.reshape(-1)) * scale  # float32, the documented order
    y = C.to(torch.float32) * col + bias
    for act, want in [(None, y), ("relu", torch.clamp(y, min=0)), (("leaky", 0.1), torch.where(y < 0, y * 0.1, y))]:
        for impl in (conv2d, lambda *a, **k: qconv._conv2d_impl(*a, _gemm=rq.bmma_gemm_reference, **k)):
            got = impl(qx, qw, scale=scale, bias=bias, act=act, **geo)
            assert got.dtype == torch.float32 and torch.equal(got, want), act
    h = conv2d(qx, qw, scale=scale, bias=bias, act="relu", out_dtype=torch.float16, **geo)
    assert torch.equal(h, torch.clamp(y, min=0).half())


@pytest.mark.parametrize("pool", [("max", 2, 2), ("avg", 2, 2), ("max", 2, 1)])
def test_pooling_vs_torch(pool):
    qx, qw, geo = _case(3)  # output 5x5: odd, so 2x2/2 drops a row and a column
    bias = torch.randn(3, generator=torch.Generator().manual_seed(1))
    y = conv2d(qx, qw, bias=bias, act="relu", **geo).permute(0, 3, 1, 2)  # (N, K, P, Q)
    if pool == ("max", 2, 1):  # darknet: replicate the last row / column, then 2x2 stride 1 keeps the size
        want = F.max_pool2d(F.pad(y, (0, 1, 0, 1), mode="replicate"), 2, 1)
        assert want.shape[-2:] == y.shape[-2:]
    elif pool[0] == "max":
        want = F.max_pool2d(y, 2, 2)
    else:
        want = F.avg_pool2d(y, 2, 2)
    want = want.permute(0, 2, 3, 1)
    got = conv2d(qx, qw, bias=bias, act="relu", pool=pool, **geo)
    assert torch.equal(got, want)
    bs = qconv._conv2d_impl(qx, qw, bias=bias, act="relu", pool=pool, _gemm=rq.bmma_gemm_reference, **geo)
    assert torch.equal(bs, want)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and dtypes, NaN where the other has NaN, every other element bit for bit (so -0 != +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    iv = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(na, nb) and torch.equal(a[~na].view(iv), b[~nb].view(iv))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("stride", [2, 1])
def test_pool_cast_equals_torch_pool(dtype, stride):
    """pack.pool_cast (the max-pool of a float output in its own dtype) equals torch's pool of the float32 values
    rounded to the dtype: odd sizes, NaN, +-inf, -0 / +0 ties, a strided (NCHW-memory) input."""
    from tcprec.kernels.triton.pack import pool_cast

    g = torch.Generator().manual_seed(stride)
    y = torch.randn(2, 9, 7, 5, generator=g) * 3
    y[0, 0, 0, 0], y[1, 3, 4, 2], y[0, 5, 5, 1] = float("nan"), float("inf"), float("-inf")
    y[0, 2:4, 2:4, 3] = torch.tensor([[0.0, -0.0], [-0.0, 0.0]])  # a window of zeros: the first one stays
    y[1, 6:8, 0:2, 4] = torch.tensor([[-0.0, 0.0], [0.0, -0.0]])
    yd = y.to(dtype)
    want = rq.pool_nhwc(yd.float(), ("max", 2, stride)).to(dtype)
    assert _same_bits(pool_cast(yd, stride), want)
    nchw = yd.permute(0, 3, 1, 2).contiguous().permute(0, 2, 3, 1)  # NHWC view of NCHW memory
    assert _same_bits(pool_cast(nchw, stride), want)
    with pytest.raises(ValueError, match="pool_stride must be 1"):
        pool_cast(yd, 3)
    with pytest.raises(ValueError, match="float16 / bfloat16 / float32 NHWC"):
        pool_cast(yd.to(torch.int32), 2)


@pytest.mark.parametrize("backend", ["bitserial", "int8"])
def test_pooled_float_output_in_its_dtype(backend):
    """A max-pooled float output: the kernel writes fp16 / bf16 at full size and one pass pools it -- equal, bit for
    bit, to the reference backend's float32 pool and cast; avg-pool keeps the float32 path."""
    if backend == "bitserial":
        qx, qw, geo = _case(3)
        run = lambda **k: qconv._conv2d_impl(qx, qw, _gemm=rq.bmma_gemm_reference, **k)  # noqa: E731
    else:
        qx, qw, geo = _int8_case(0, seed=3)
        pw = pack_conv_weight(qw)
        run = lambda **k: conv2d(qx, pw, backend="int8", **k)  # noqa: E731
    bias = torch.randn(qw.shape[0], generator=torch.Generator().manual_seed(1))
    # (Triton's interpreter casts float32 to bfloat16 by truncation, so the INT8 kernel's bf16 output is checked on
    # the GPU: tests/gpu/test_qconv_gpu.py)
    for dt in (torch.float16, torch.bfloat16) if backend == "bitserial" else (torch.float16,):
        for pool in (("max", 2, 2), ("max", 2, 1), ("avg", 2, 2)):
            kw = dict(bias=bias, act=("leaky", 0.1), pool=pool, out_dtype=dt, **geo)
            want = conv2d(qx, qw, backend="reference", **kw)
            got = run(**kw)
            assert got.dtype == dt and _same_bits(got, want), (dt, pool)
    if backend == "int8":  # (explain plans the bit-serial backend on CUDA tensors only)
        s = explain_conv2d(qx, pw, backend="int8", pool=("max", 2, 2), out_dtype=torch.float16, **geo)
        assert "max-pool 2x2 stride 2 on the float16 output (one Triton kernel)" in s, s


@pytest.mark.parametrize("out", ["uint2", "int3", "pm2"])
def test_packed_output_bit_exact_and_chaining(out):
    qx, qw, geo = _case(2)
    ofmt = tp.format(out)
    bias = torch.randn(6, generator=torch.Generator().manual_seed(2))
    for act, pool in [("relu", None), (("leaky", 0.1), ("max", 2, 2)), ("relu", ("max", 2, 1))]:
        y = conv2d(qx, qw, bias=bias, act=act, pool=pool, **geo)  # float32 NHWC
        v = torch.clamp(y / 0.75, ofmt.min, ofmt.max)
        codes = tp.encode(v, ofmt)  # the library's one rounding rule
        want = tp.pack_bitplanes(codes.reshape(-1, y.shape[-1]), ofmt.bits)
        for impl in (conv2d, lambda *a, **k: qconv._conv2d_impl(*a, _gemm=rq.bmma_gemm_reference, **k)):
            pa = impl(qx, qw, bias=bias, act=act, pool=pool, out_fmt=out, out_scale=0.75, **geo)
            assert isinstance(pa.layout, BitPlanes) and pa.shape == tuple(y.shape) and pa.fmt == ofmt
            assert torch.equal(pa.data, want), (act, pool)
            assert torch.equal(pa.dequantize(), tp.decode(codes, ofmt) * 0.75)
    # chaining: the packed output is the next layer's input, equal to feeding its codes as a QTensor
    pa = conv2d(qx, qw, bias=bias, act="relu", out_fmt=out, out_scale=0.75, **geo)
    gen = torch.Generator().manual_seed(9)
    qw2 = _qt((4, 3, 3, 6), IntFormat(1, encoding="pm1"), gen, PerChannel(0))
    pad = 0 if ofmt.encoding == "pm1" else 1
    want2 = _exact(pa.to_layout(Dense()), qw2, 1, pad, 1)
    got2 = qconv._conv2d_impl(pa, qw2, padding=pad, out_dtype=torch.int32, _gemm=rq.bmma_gemm_reference)
    assert torch.equal(got2.long(), want2)
    assert torch.equal(conv2d(pa, qw2, padding=pad, out_dtype=torch.int32).long(), want2)
    f2 = conv2d(pa, pack_conv_weight(qw2), padding=pad)  # pre-packed weight, float out with both scales
    assert torch.equal(f2, want2.float() * (pa.scale * qw2.scale.reshape(-1)))


@pytest.mark.parametrize("K", [6, 96])
def test_compact_packed_output(K):
    """out_layout="compact": the epilogue's planes without the padding words (rows of ceil(K / 32)), the same codes
    as the padded ones, also after a max-pool on the codes; a gathering conv reads them as it reads padded planes."""
    gen = torch.Generator().manual_seed(K)
    qx = _qt((2, 7, 6, 5), IntFormat(2), gen)
    qw = _qt((K, 3, 3, 5), IntFormat(1, encoding="pm1"), gen, PerChannel(0))
    bias = torch.randn(K, generator=gen)
    impl = lambda **k: qconv._conv2d_impl(qx, qw, padding=1, bias=bias, act="relu", out_fmt="uint2",  # noqa: E731
                                          out_scale=0.75, _gemm=rq.bmma_gemm_reference, **k)
    for pool in (None, ("max", 2, 2), ("max", 2, 1)):
        full, comp = impl(pool=pool), impl(pool=pool, out_layout="compact")
        assert not full.layout.compact and comp.layout.compact and comp.data.shape[2] == -(-K // 32), pool
        assert comp.shape == full.shape and torch.equal(comp.codes, full.codes), pool
        assert torch.equal(comp.to_layout(BitPlanes()).data, full.data), pool
    qw2 = _qt((4, 3, 3, K), IntFormat(1, encoding="pm1"), gen, PerChannel(0))
    want = qconv._conv2d_impl(full, qw2, padding=1, out_dtype=torch.int32, _gemm=rq.bmma_gemm_reference)
    got = qconv._conv2d_impl(comp, qw2, padding=1, out_dtype=torch.int32, _gemm=rq.bmma_gemm_reference)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="out_layout must be one of"):
        impl(out_layout="packed")


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_planes_plus_float_output(dt):
    """out_layout="planes+float": the float output and its planes (a BitPlanes QTensor with hp) from one epilogue --
    the float equals the float-only call, the planes are the float's codes (what the next layer's quantize_pack of
    it gives), with and without the residual; the reference backend writes the same codes."""
    gen = torch.Generator().manual_seed(11)
    qx = _qt((2, 7, 6, 5), IntFormat(2), gen)
    qw = _qt((40, 3, 3, 5), IntFormat(1, encoding="pm1"), gen, PerChannel(0))
    bias = torch.randn(40, generator=gen)
    res = (torch.randn(2, 7, 6, 40, generator=gen) * 2).to(dt)
    for r in (None, res):
        kw = dict(padding=1, bias=bias, act="relu", out_dtype=dt, residual=r)
        y = qconv._conv2d_impl(qx, qw, _gemm=rq.bmma_gemm_reference, **kw)
        pa = qconv._conv2d_impl(qx, qw, out_fmt="uint2", out_scale=0.6, out_layout="planes+float",
                                _gemm=rq.bmma_gemm_reference, **kw)
        assert isinstance(pa.layout, BitPlanes) and pa.hp is not None and torch.equal(pa.hp, y)
        assert pa.layout.compact and pa.shape == tuple(y.shape) and pa.fmt == tp.format("uint2")
        want = tp.quantize(y.float(), "uint2", scale=0.6).codes
        assert torch.equal(pa.codes, want)
        ref = conv2d(qx, qw, backend="reference", out_fmt="uint2", out_scale=0.6, out_layout="planes+float", **kw)
        assert torch.equal(ref.hp, y) and torch.equal(ref.codes, want)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_int8_planes_plus_float_output(dt):
    """The INT8 backend writes out_layout="planes+float" too (a ResNet stem read by the first block's conv1 and its
    add): the float is the float-only call's, the planes its codes, with and without a residual, on thin layers
    (C = 5 / 6: the window-gather route, a 7x7 stride 4 among them) and a wide one; equal to the reference backend's.
    (On an sm_90 GPU a thin stem runs stem_conv.cu's dual epilogue: tests/gpu/test_stem_conv_gpu.py.)"""
    for i in (0, 6, 7):
        qx, qw, geo = _int8_case(i, seed=70)
        gen = torch.Generator().manual_seed(5 + i)
        K = qw.shape[0]
        bias = torch.randn(K, generator=gen)
        scale = torch.rand(K, generator=gen) * 1e-3  # (fp16's range)
        y0 = conv2d(qx, qw, backend="reference", out_dtype=dt, bias=bias, scale=scale, **geo)
        assert y0.float().abs().max() > 1
        for r in (None, (torch.randn(y0.shape, generator=gen) * 2).to(dt)):
            kw = dict(geo, bias=bias, scale=scale, act="relu", out_dtype=dt, residual=r)
            y = conv2d(qx, qw, backend="int8", **kw)
            pa = conv2d(qx, qw, backend="int8", out_fmt="uint2", out_scale=0.6, out_layout="planes+float", **kw)
            assert isinstance(pa.layout, BitPlanes) and torch.equal(pa.hp.view(torch.int16), y.view(torch.int16))
            assert pa.shape == tuple(y.shape) and pa.fmt == tp.format("uint2")
            assert torch.equal(pa.codes, tp.quantize(y.float(), "uint2", scale=0.6).codes)
            ref = conv2d(qx, qw, backend="reference", out_fmt="uint2", out_scale=0.6, out_layout="planes+float", **kw)
            if dt == torch.float16 or not qconv.interpreting():  # (Triton's interpreter casts float32 to bfloat16
                # by truncation, the GPU to nearest: bfloat16 values from the interpreted kernel differ in the last bit)
                assert torch.equal(ref.hp, y) and torch.equal(ref.codes, pa.codes)
            assert "planes" in explain_conv2d(qx, qw, backend="int8", out_fmt="uint2", out_scale=0.6,
                                              out_layout="planes+float", **kw)


def test_pack_activation_roundtrip():
    x = torch.rand(2, 3, 5, 37)
    pa = pack_activation(x, "uint4", 1 / 15)
    qx = tp.quantize(x, "uint4", PerTensor(), scale=1 / 15)
    assert torch.equal(pa.codes, qx.codes)
    assert torch.equal(pa.dequantize(), qx.dequantize())
    assert pa.data.shape == (4, 30, 16)


def test_explain_names_passes():
    qx, qw, geo = _case(2)
    s = explain_conv2d(qx, qw, act=("leaky", 0.1), pool=("max", 2, 2), **geo)
    assert s.startswith("reference:") and "F.conv2d" in s and "M=63 N=6 K=45" in s
    assert qconv.choose_conv2d_backend(qx, qw, **geo)[0] == "reference"
    assert explain_conv2d(qx, qw, backend="int8", **geo).startswith("int8:")


def test_bad_input():
    qx, qw, geo = _case(2)
    with pytest.raises(ValueError, match="NHWC"):
        conv2d(tp.quantize(torch.rand(7, 9, 5), "uint2"), qw)
    with pytest.raises(ValueError, match="KRSC"):
        conv2d(qx, tp.quantize(torch.randn(6, 45), "binary"))
    with pytest.raises(ValueError, match="C mismatch.*C=5.*C=4"):
        conv2d(qx, tp.quantize(torch.randn(6, 3, 3, 4), "binary"))
    with pytest.raises(ValueError, match="pm1.*padding"):
        conv2d(tp.quantize(torch.randn(1, 7, 9, 5), "binary"), qw, padding=1)
    with pytest.raises(TypeError, match="integer format"):
        conv2d(tp.quantize(torch.rand(1, 7, 9, 5), "e4m3"), qw)
    with pytest.raises(TypeError, match="integer format"):
        conv2d(qx, tp.quantize(torch.randn(6, 3, 3, 5), "e4m3"))
    with pytest.raises(TypeError, match="QTensor"):
        conv2d(torch.rand(1, 7, 9, 5), qw)
    with pytest.raises(ValueError, match="pool must be one of"):
        conv2d(qx, qw, pool=("max", 3, 2))
    with pytest.raises(ValueError, match="act must be"):
        conv2d(qx, qw, act="tanh")
    with pytest.raises(ValueError, match="stride and dilation"):
        conv2d(qx, qw, stride=0)
    with pytest.raises(ValueError, match="does not fit"):
        conv2d(qx, qw, dilation=5)
    with pytest.raises(ValueError, match="out_scale"):
        conv2d(qx, qw, out_fmt="uint2")
    with pytest.raises(ValueError, match="out_scale must be"):
        conv2d(qx, qw, out_fmt="uint2", out_scale=-1.0)
    with pytest.raises(ValueError, match="raw integer"):
        conv2d(qx, qw, out_dtype=torch.int32, act="relu")
    with pytest.raises(ValueError, match="backend must be one of"):
        conv2d(qx, qw, backend="cudnn")
    with pytest.raises(RuntimeError, match="bitserial"):
        conv2d(qx, qw, backend="bitserial")
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        conv2d(qx, qw, bias=torch.zeros(5))
    with pytest.raises(ValueError, match="PerTensor"):
        conv2d(tp.quantize(torch.rand(1, 7, 9, 5), "uint2", PerChannel(3)), qw)
    with pytest.raises(ValueError, match="PerChannel\\(0\\)"):
        conv2d(qx, tp.quantize(torch.randn(6, 3, 3, 5), "binary", PerChannel(3)))
    with pytest.raises(ValueError, match=r"planes .* must be \(bits, N\*H\*W, packed_words\(C\)\) = \(2, 9, 16\) or "
                                         r"compact \(bits, N\*H\*W, ceil\(C / 32\)\) = \(2, 9, 1\), got \(2, 10, 16\)"):
        qconv.planes_qtensor(torch.zeros(2, 10, 16, dtype=torch.int32), "uint2", 1.0, (1, 3, 3, 5))
    with pytest.raises(ValueError, match="2\\^31"):
        conv2d(tp.quantize(torch.rand(1, 11, 11, 2048), "uint8"), tp.quantize(torch.randn(1, 11, 11, 2048), "int8"))


# ------------------------------------------------------------------------------------------------
# INT8 backend on the Triton implicit-GEMM conv (interpreter here), FP8 operands
# ------------------------------------------------------------------------------------------------

# (fa, fw, N, H, W, C, K, R, stride, padding, dilation): every affine rule of the int8 operand
INT8_KERNEL_CASES = [
    ("uint8", "int8", 2, 7, 9, 5, 6, 3, 2, 1, 1),  # shifted activations (code - 128), padded border
    ("uint8", "int3", 1, 9, 8, 7, 5, 3, 1, 2, 2),  # padding 2, dilation 2: the border table, not a vector
    ("uint8", "pm3", 1, 6, 7, 40, 3, 5, 1, 2, 1),  # 5x5 border, pm weights as values
    ("pm8", "int8", 1, 7, 9, 5, 6, 3, 1, 0, 1),  # pm8 = 1 + 2 * x8: acc_mul 2, per-channel vector
    ("uint8", "int8", 1, 8, 7, 3, 4, 1, 2, 0, 1),  # 1x1 stride 2: the vector again
    ("int4", "pm4", 2, 7, 9, 5, 6, 3, 1, 1, 1),  # twos sign-extended, pm values: no correction
    ("uint5", "int8", 1, 9, 7, 6, 3, 7, 4, 3, 1),  # unsigned <= 7 bits as is; 7x7 s4
    ("int8", "int8", 1, 5, 6, 17, 4, 3, 1, 1, 1),  # int8 codes viewed as int8 (no copy)
]


def _int8_case(i, seed=0):
    fa, fw, N, H, W, C, K, R, st, pd, dl = INT8_KERNEL_CASES[i]
    gen = torch.Generator().manual_seed(seed + i)
    qx = _qt((N, H, W, C), tp.format(fa), gen)
    qw = _qt((K, R, R, C), tp.format(fw), gen, PerChannel(0))
    qx.codes[0, 0, 0, :] = qx.fmt.n_codes - 1  # the extreme code at a padded corner
    return qx, qw, dict(stride=st, padding=pd, dilation=dl)


@pytest.mark.parametrize("i", range(len(INT8_KERNEL_CASES)), ids=[f"{c[0]}x{c[1]}" for c in INT8_KERNEL_CASES])
def test_int8_kernel_route_exact(i):
    """The Triton INT8 conv (shift + in-image correction) equals F.conv2d on the decoded codes, raw and
    through the fused epilogue (bit-exact against the reference backend's float32 epilogue)."""
    qx, qw, geo = _int8_case(i)
    pw = pack_conv_weight(qw)
    s = explain_conv2d(qx, pw, backend="int8", **geo)
    assert s.startswith("int8:") and "Triton implicit-GEMM INT8 conv" in s and "_int_mm" not in s.split("passes:")[1]
    g = qconv._geometry(qconv._check_x(qx), qw.shape, **geo)
    assert ("thin layer" in s) == (g.C < qconv.THIN_C and g.R * g.S > 1)  # C < 16 stems: gathered, then 1x1
    want = _exact(qx, qw, **geo)
    got = conv2d(qx, pw, out_dtype=torch.int32, backend="int8", **geo)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert torch.equal(conv2d(qx, pw, out_dtype=torch.int32, backend="int8", **geo), got)  # cached correction
    K = qw.shape[0]
    gen = torch.Generator().manual_seed(11)
    scale, bias = (torch.rand(K, generator=gen) + 0.5) * 1e-3, torch.randn(K, generator=gen)  # |y| < 65504
    for act, dt in [("relu", torch.float32), (("leaky", 0.1), torch.float16), (None, torch.float32)]:
        kw = dict(scale=scale, bias=bias, act=act, out_dtype=dt, **geo)
        assert torch.equal(conv2d(qx, pw, backend="int8", **kw), conv2d(qx, qw, backend="reference", **kw)), act
    # bfloat16: the interpreter's fp32 -> bf16 cast is not round-to-nearest-even (the GPU's is: tests/gpu)
    kw = dict(scale=scale, bias=bias, out_dtype=torch.bfloat16, **geo)
    a, b = conv2d(qx, pw, backend="int8", **kw).float(), conv2d(qx, qw, backend="reference", **kw).float()
    assert ((a - b).abs() <= 2.0**-7 * b.abs()).all()


def test_int8_kernel_route_uint8_edge_values():
    """uint8 activations of all 255 / all 0 with padding: the padding stays value 0 (not 128)."""
    gen = torch.Generator().manual_seed(4)
    qw = _qt((5, 3, 3, 9), tp.format("int8"), gen, PerChannel(0))
    for code in (0, 128, 255):
        qx = QTensor(torch.full((1, 4, 5, 9), code, dtype=torch.uint8), torch.ones(1, 1, 1, 1), "uint8", PerTensor(),
                     (1, 4, 5, 9), torch.float32)
        for geo in (dict(padding=1), dict(padding=(2, 0), stride=(1, 2))):
            got = conv2d(qx, pack_conv_weight(qw), out_dtype=torch.int32, backend="int8", **geo)
            assert torch.equal(got.long(), _exact(qx, qw, **geo)), (code, geo)


def test_int8_kernel_route_pool_and_packed_out():
    qx, qw, geo = _int8_case(0, seed=3)
    pw = pack_conv_weight(qw)
    bias = torch.randn(qw.shape[0], generator=torch.Generator().manual_seed(1)) * 100
    for pool in (("max", 2, 2), ("avg", 2, 2), ("max", 2, 1)):
        kw = dict(bias=bias, act="relu", pool=pool, **geo)
        assert torch.equal(conv2d(qx, pw, backend="int8", **kw), conv2d(qx, qw, backend="reference", **kw))
        a = conv2d(qx, pw, backend="int8", out_fmt="uint3", out_scale=40.0, **kw)
        b = conv2d(qx, qw, backend="reference", out_fmt="uint3", out_scale=40.0, **kw)
        assert isinstance(a.layout, BitPlanes) and torch.equal(a.data, b.data)
    assert "separate pass" in explain_conv2d(qx, pw, backend="int8", pool=("max", 2, 2), **geo)
    # packed planes, no pool or a 2x2 stride-2 max-pool: the kernel's epilogue writes them (no float32, no pass)
    for pool in (None, ("max", 2, 2)):
        s = explain_conv2d(qx, pw, backend="int8", out_fmt="uint3", out_scale=40.0, pool=pool, **geo)
        assert "quantize + pack -> uint3 bit planes (no float output)" in s and "separate pass" not in s, s
        assert ("max-pool 2x2 stride 2 + quantize" in s) == (pool is not None), s
    s = explain_conv2d(qx, pw, backend="int8", out_fmt="uint3", out_scale=40.0, pool=("max", 2, 1), **geo)
    assert "separate pass: max-pool 2x2 stride 1 + re-quantize + pack (one Triton kernel)" in s, s


@pytest.mark.parametrize("layout", ["planes", "compact"])
@pytest.mark.parametrize("out_fmt, x_fmt", [("uint2", "int8"), ("pm1", "uint8")])
def test_int8_thin_stem_writes_pooled_planes(layout, out_fmt, x_fmt):
    """A binary network's stem (C = 3, 3x3 stride 2, ReLU, 2x2 max-pool, 2-bit / pm1 planes for the next layer, odd
    output for the floor pool; a uint8 input stored shifted: the border's per-pixel correction; per-channel scales
    of both signs): the INT8 kernel's epilogue pools, quantizes and packs; the planes equal the reference backend's,
    compact rows as the padded rows' first ceil(K / 32) words."""
    gen = torch.Generator().manual_seed(21)
    qx = _qt((2, 15, 13, 3), tp.format(x_fmt), gen)
    qw = _qt((40, 3, 3, 3), tp.format("int8"), gen, PerChannel(0))
    pw = pack_conv_weight(qw)
    bias = torch.randn(40, generator=gen) * 300
    scale = torch.rand(40, generator=gen) + 0.5
    scale[::3] *= -1
    kw = dict(stride=2, padding=1, bias=bias, scale=scale, act="relu", pool=("max", 2, 2), out_fmt=out_fmt,
              out_scale=900.0)
    a = conv2d(qx, pw, backend="int8", out_layout=layout, **kw)
    b = conv2d(qx, qw, backend="reference", **kw)
    assert isinstance(a.layout, BitPlanes) and a.shape == b.shape == (2, 4, 3, 40)
    assert a.layout.compact == (layout == "compact")
    assert torch.equal(a.data, b.data[..., :a.data.shape[-1]]) and torch.equal(a.codes, b.codes)
    assert len(torch.unique(b.codes)) == 2 ** b.fmt.bits
    assert "thin layer (C = 3 < 16)" in explain_conv2d(qx, pw, backend="int8", out_layout=layout, **kw)


# -- the INT8 layers' own operand: a ShiftedInt8 QTensor (quantizer, conv input, epilogue output) ----------------

INT8_ACT_FMTS = ("uint8", "uint4", "uint2", "int8", "int5", "int2", "pm3")


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (2, 7, 5, 3), (1, 3, 3, 1), (3, 5, 5, 15)])
def test_thin_contiguous_inputs_quantize_as_flat_rows(shape):
    """A contiguous input with few channels (a network's RGB image) is quantized as wide flat rows (the pass is
    elementwise): the same int8 and float8 codes as the reference, for sizes that give rows of 128, 2 and 1."""
    from tcprec.kernels.triton.fp8_quant import pool_quantize_fp8
    from tcprec.kernels.triton.quant_bytes import flat_rows

    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(*shape, generator=gen) * 3).round() / 2  # ties at .5
    x.view(-1)[0], x.view(-1)[-1] = float("nan"), 1e9
    flat = flat_rows(x, 0)
    n = x.numel()
    if 1 < shape[3] < 16:
        assert flat is not None and flat.shape[3] == {384: 128, 210: 2, 1125: 1}[n] and flat.data_ptr() == x.data_ptr()
    else:
        assert flat is None
    assert flat_rows(x, 2) is None and flat_rows(x.permute(0, 2, 1, 3), 0) is None  # pooled / strided: tiled as is
    s = torch.tensor([0.5])
    for fmt in ("uint8", "int8", "int3"):
        a = qconv.quantize_int8_static(x, tp.format(fmt), s)
        b = qconv.quantize_int8_static(x, tp.format(fmt), s, backend="reference")
        assert a.data.shape == x.shape and torch.equal(a.data, b.data), fmt
    for dt in (torch.float8_e4m3fn, torch.float8_e5m2):
        want = torch.clamp(x / 0.5, -torch.finfo(dt).max, torch.finfo(dt).max).to(dt).view(torch.uint8)
        got = pool_quantize_fp8(x, s, 0, dt).view(torch.uint8)
        nan = torch.isnan(x)
        assert got.shape == x.shape and torch.equal(got[~nan], want[~nan]) and bool((got[nan] & 0x7F == 0x7F).all())


@pytest.mark.parametrize("fmt", INT8_ACT_FMTS)
@pytest.mark.parametrize("pool", [None, ("max", 2, 2), ("max", 2, 1), ("avg", 2, 2)])
def test_quantize_int8_static_equals_reference(fmt, pool):
    """The one-pass Triton quantizer (interpreter) = the torch path = quantize_static's codes, for every
    encoding, with the fused max-pools; odd sizes, ties, saturation, a strided (NCHW-memory) input, NaN -> 0."""
    gen = torch.Generator().manual_seed(21)
    f = tp.format(fmt)
    x = (torch.randn(2, 7, 5, 3, 6, generator=gen) * 3).round() / 2  # many ties at .5
    x = x.permute(0, 4, 1, 2, 3).reshape(2, 6, 7, 15).permute(0, 2, 3, 1)  # (N, H, W, C) view, C strided
    x[0, 0, 0, 0] = float("nan")
    x[1, 2, 3, 4] = 1e9  # saturates
    s = torch.tensor([0.5])
    a = qconv.quantize_int8_static(x, f, s, pool)
    b = qconv.quantize_int8_static(x, f, s, pool, backend="reference")
    y = rq.pool_nhwc(torch.nan_to_num(x, nan=0.0), pool) if pool else torch.nan_to_num(x, nan=0.0)
    want = quantize_static(y.contiguous(), f, s).codes
    keep = torch.ones_like(want, dtype=torch.bool)
    if pool is not None and pool[0] == "max":  # a NaN in a max-pool window: the kernel's max skips it
        keep[0, 0, 0, 0] = False
    assert a.data.dtype == torch.int8 and a.data.is_contiguous()
    assert torch.equal(a.data[keep], b.data[keep]) and torch.equal(a.codes[keep], want[keep])
    assert len(torch.unique(want)) >= min(f.n_codes, 4)  # many codes, not only saturation
    assert float(tp.decode(a.codes, f).max()) == f.max  # 1e9 saturates to the top value
    off, step = int8_affine(a.fmt)
    assert torch.equal(a.dequantize(), tp.decode(a.codes, f).float() * 0.5)
    assert (off, step) == int8_codes(want, f)[1:]


def test_int8_activation_in_and_out():
    """A conv reads a ShiftedInt8 QTensor exactly like the QTensor of the same codes, and with
    out_layout="int8" writes the next layer's codes: from the INT8 kernel's epilogue (no pool), after a
    pooling pass, and from a bit-serial layer -- all equal to the reference backend's."""
    qx, qw, geo = _int8_case(0, seed=5)
    pw = pack_conv_weight(qw)
    xi = qconv.int8_qtensor(int8_codes(qx.codes, qx.fmt)[0].contiguous(), qx.fmt, qx.scale.reshape(1))
    assert torch.equal(xi.data, qx.to_layout(ShiftedInt8()).data)  # quantize(layout=ShiftedInt8()) stores the same
    assert torch.equal(xi.codes, qx.codes)
    assert torch.equal(conv2d(xi, pw, out_dtype=torch.int32, backend="int8", **geo),
                       conv2d(qx, pw, out_dtype=torch.int32, backend="int8", **geo))
    bias = torch.randn(qw.shape[0], generator=torch.Generator().manual_seed(2)) * 100
    for fmt in ("uint8", "int8", "uint4"):
        for pool in (None, ("max", 2, 2), ("avg", 2, 2)):
            kw = dict(bias=bias, act="relu", pool=pool, out_fmt=fmt, out_scale=40.0, out_layout="int8", **geo)
            a = conv2d(xi, pw, backend="int8", **kw)
            b = conv2d(qx, qw, backend="reference", **kw)
            assert isinstance(a.layout, ShiftedInt8) and a.fmt == tp.format(fmt)
            assert torch.equal(a.data, b.data), (fmt, pool)
            assert int(a.codes.max()) > 0 and torch.equal(a.codes, b.codes)
            want = conv2d(qx, qw, backend="reference", **dict(kw, out_layout="planes"))  # the same codes as planes
            assert torch.equal(a.codes, want.codes)
    s = explain_conv2d(xi, pw, backend="int8", out_fmt="uint8", out_scale=4.0, out_layout="int8", **geo)
    assert "ShiftedInt8 QTensor" in s and "separate pass" not in s
    # a bit-serial producer: its float result goes through the one-pass quantizer
    qb, wb, gb = _case(2)
    a = qconv._conv2d_impl(qb, wb, out_fmt="uint8", out_scale=0.25, out_layout="int8", act="relu", _gemm=rq.bmma_gemm_reference,
                           **gb)
    b = conv2d(qb, wb, out_fmt="uint8", out_scale=0.25, out_layout="int8", act="relu", backend="reference", **gb)
    assert isinstance(a.layout, ShiftedInt8) and torch.equal(a.data, b.data) and int(a.codes.max()) > 0


def test_int8_layout_bad_input():
    qx, qw, geo = _int8_case(0, seed=5)
    with pytest.raises(ValueError, match="out_layout must be one of"):
        conv2d(qx, qw, out_fmt="uint8", out_scale=1.0, out_layout="bytes", **geo)
    with pytest.raises(ValueError, match="needs an integer out_fmt"):
        conv2d(qx, qw, out_layout="int8", **geo)
    with pytest.raises(TypeError, match="contiguous int8 NHWC"):
        qconv.int8_qtensor(torch.zeros(1, 2, 2, 3, dtype=torch.uint8), "uint8", 1.0)
    with pytest.raises(TypeError, match="integer format"):
        qconv.int8_qtensor(torch.zeros(1, 2, 2, 3, dtype=torch.int8), "e4m3", 1.0)
    with pytest.raises(ValueError, match="NHWC"):
        qconv.quantize_int8_static(torch.zeros(3, 4), "uint8", torch.ones(1))
    with pytest.raises(ValueError, match="pool must be one of"):
        qconv.quantize_int8_static(torch.zeros(1, 2, 2, 3), "uint8", torch.ones(1), ("max", 3, 3))


@pytest.mark.parametrize("geo", [(1, 9, 11, 3, 3, 3, (2, 2), (1, 1), (1, 1)), (2, 13, 12, 3, 7, 7, (4, 4), (3, 3), (1, 1)),
                                 (1, 15, 13, 5, 5, 5, (2, 1), (2, 0), (2, 1))], ids=["vgg", "resnet", "dilated"])
def test_thin_stem_gather_kernel_equals_torch(geo):
    """The Triton window gather (interpreter) = the torch gather: window in (r, s, c) order, 0 in the padding
    and the tail."""
    from tcprec.kernels.triton.quant_bytes import im2col_rows

    N, H, W, C, R, S, st, pd, dl = geo
    g = ConvGeometry(N, H, W, C, 4, R, S, st, pd, dl)
    x8 = torch.randint(-128, 128, (N, H, W, C), dtype=torch.int8, generator=torch.Generator().manual_seed(3))
    kp = qconv._stem_kp(g)
    got = im2col_rows(x8, R, S, st, pd, dl, g.P, g.Q, kp)
    rsc = R * S * C
    want = torch.zeros((N, g.P, g.Q, kp), dtype=torch.int8)
    want[..., :rsc] = qconv._im2col_codes(x8.view(torch.uint8), g).view(torch.int8).view(N, g.P, g.Q, rsc)
    assert torch.equal(got, want)


def test_int8_shifted_weights_keep_im2col():
    gen = torch.Generator().manual_seed(6)
    qx = _qt((1, 6, 7, 5), tp.format("uint4"), gen)
    qw = _qt((3, 3, 3, 5), tp.format("uint8"), gen)
    assert "im2col on codes" in explain_conv2d(qx, qw, backend="int8", padding=1)
    assert torch.equal(conv2d(qx, qw, backend="int8", padding=1, out_dtype=torch.int32).long(),
                       _exact(qx, qw, padding=1))


def test_int8_operand_rule_matches_matmul():
    """qconv's shape-keeping int8 form equals ops.matmul's (the one affine rule)."""
    from tcprec.ops.matmul import _int8_operand

    for name in ("int2", "int8", "uint7", "uint8", "pm1", "pm5", "pm8"):
        fmt = tp.format(name)
        codes = torch.arange(fmt.n_codes, dtype=torch.uint8).reshape(1, -1)
        qt = QTensor(codes, torch.ones(1, 1), fmt, PerTensor(), tuple(codes.shape), torch.float32)
        a = int8_codes(codes, fmt)
        b = _int8_operand(qt, 1, fmt.n_codes)
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:], name
        assert torch.equal(a[1] + a[2] * a[0].long(), tp.decode(codes, fmt).long()), name


U32 = 2.0**-24


def _fp8_case(seed=0, C=20, padding=1, stride=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 9, C, generator=gen) * 3
    w = torch.randn(6, 3, 3, C, generator=gen)
    qx = qconv.quantize_fp8_static(x, torch.tensor([0.05]))
    qw = tp.quantize(w, "e4m3", PerChannel(0))
    return qx, qw, dict(stride=stride, padding=padding)


def test_quantize_fp8_static_equals_quantize():
    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(2)) * 100
    x[0, :4] = torch.tensor([1e9, -1e9, 449.0 * 0.5, 0.0])
    s = torch.tensor([0.5])
    q = qconv.quantize_fp8_static(x, s)
    assert torch.equal(q.codes, tp.quantize(x, "e4m3", scale=0.5).codes)
    assert q.fmt == tp.format("e4m3") and torch.equal(q.dequantize(), tp.quantize(x, "e4m3", scale=0.5).dequantize())
    assert torch.isnan(qconv.quantize_fp8_static(torch.tensor([float("nan")]), s).dequantize()).all()
    q5 = qconv.quantize_fp8_static(x, s, "e5m2")
    assert torch.equal(q5.codes, tp.quantize(x, "e5m2", scale=0.5).codes)
    with pytest.raises(TypeError, match="float8"):
        qconv.quantize_fp8_static(x, s, "int8")
    with pytest.raises(TypeError, match="one-element float32"):
        qconv.quantize_fp8_static(x, 0.5)


@pytest.mark.parametrize("fast,C", [(True, 20), (False, 20), (True, 3), (False, 5)])
def test_fp8_route_within_bound(fast, C):
    """fp8 kernel (interpreter) vs float64 F.conv2d on the decoded values: |err| <= the fp32 summation
    bound of tests/test_conv_fwd.py, scaled by the epilogue's column scale, plus its roundings.  C = 3 / 5:
    the thin-stem route (gathered windows, run as a 1x1 conv)."""
    from tcprec.kernels import reference_conv_int8_fp8 as rf

    qx, qw, geo = _fp8_case(C=C)
    assert ("thin layer" in explain_conv2d(qx, qw, backend="fp8", **geo)) == (C < qconv.THIN_C)
    pw = pack_conv_weight(qw)
    assert pw.planes is None and pw.w8.dtype == torch.float8_e4m3fn
    K = qw.shape[0]
    gen = torch.Generator().manual_seed(3)
    scale, bias = torch.rand(K, generator=gen) + 0.5, torch.randn(K, generator=gen)
    s = explain_conv2d(qx, pw, backend="fp8", fp8_fast_accum=fast, **geo)
    assert s.startswith("fp8:") and "conv2d_fwd_fp8" in s and ("fast_accum" in s) == fast
    y = conv2d(qx, pw, scale=scale, bias=bias, act=("leaky", 0.1), backend="fp8", fp8_fast_accum=fast, **geo)
    x8, w8 = qx.codes.view(torch.float8_e4m3fn), pw.w8
    col = ((qx.scale.reshape(1) * pw.w_scale) * scale).double()
    exact = rf.conv_acc(x8, w8, **geo) * col + bias.double()
    exact = torch.where(exact < 0, exact * 0.1, exact)
    red = 3 * 3 * qw.shape[3]
    absacc = rf.abs_conv_acc(x8, w8, **geo) * col
    bound = 1.01 * red * U32 * absacc + 4 * U32 * (absacc + bias.double().abs()) + 1e-30
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape and (err <= bound).all(), float((err / bound).max())
    yr = conv2d(qx, qw, scale=scale, bias=bias, act=("leaky", 0.1), backend="reference", **geo)
    assert ((yr.double() - exact).abs() <= bound).all()
    assert explain_conv2d(qx, qw, **geo).startswith("reference:")  # auto off CUDA


def test_fp8_route_pool_and_fp8_out_chain():
    qx, qw, geo = _fp8_case(seed=5, padding=1, stride=1)
    pw = pack_conv_weight(qw)
    o = torch.tensor([0.25])
    a = conv2d(qx, pw, act="relu", pool=("max", 2, 2), out_fmt="e4m3", out_scale=o, backend="fp8", **geo)
    b = conv2d(qx, pw, act="relu", pool=("max", 2, 2), out_fmt="e4m3", out_scale=o, backend="reference", **geo)
    assert isinstance(a, QTensor) and a.fmt == tp.format("e4m3") and a.shape == (2, 3, 4, 6)
    d = (a.dequantize() - b.dequantize()).abs()
    assert (d <= 2.0**-3 * b.dequantize().abs() + 1e-6).all()  # at most one e4m3 step where the sums straddle a tie
    qw2 = tp.quantize(torch.randn(4, 3, 3, 6, generator=torch.Generator().manual_seed(1)), "e4m3", PerChannel(0))
    y = conv2d(b, pack_conv_weight(qw2), padding=1, out_dtype=torch.float16, backend="fp8")
    y_ref = conv2d(b, qw2, padding=1, out_dtype=torch.float16, backend="reference")
    assert y.dtype == torch.float16 and torch.allclose(y.float(), y_ref.float(), rtol=2e-3, atol=1e-3)


def test_fp8_bad_input():
    qx, qw, geo = _fp8_case()
    qi = tp.quantize(torch.rand(2, 7, 9, 20), "uint8")
    with pytest.raises(TypeError, match="two float8 formats"):
        conv2d(qi, qw)
    with pytest.raises(ValueError, match="integer formats"):
        conv2d(qx, qw, backend="int8")
    with pytest.raises(ValueError, match="float8 operands"):
        conv2d(qi, tp.quantize(torch.randn(6, 3, 3, 20), "int8"), backend="fp8")
    with pytest.raises(ValueError, match="int32"):
        conv2d(qx, qw, out_dtype=torch.int32)
    with pytest.raises(TypeError, match="e4m3"):
        conv2d(qx, tp.quantize(torch.randn(6, 3, 3, 20), "fp16"))


@pytest.mark.parametrize("C", [5, 64, 70])
def test_compact_activation_equals_padded(C):
    """A compact BitPlanes QTensor (rows without their padding words, what QConv2d hands a layer that reads its
    input through an im2col) gives the same codes and the same convolution -- 3x3, and 1x1 pointwise (which
    pads it back for the GEMM) -- as the padded one."""
    from tcprec.ops.quantize import quantize_pack

    g = torch.Generator().manual_seed(C)
    x = torch.rand(2, 6, 7, C, generator=g)
    s = torch.tensor([1 / 3])
    full = qconv.planes_qtensor(quantize_pack(x.reshape(-1, C), "uint2", s), "uint2", s, (2, 6, 7, C))
    comp = qconv.planes_qtensor(quantize_pack(x.reshape(-1, C), "uint2", s, compact=True), "uint2", s, (2, 6, 7, C))
    assert comp.layout.compact and not full.layout.compact and comp.data.shape[2] == -(-C // 32)
    assert torch.equal(comp.to_layout(BitPlanes()).data, full.data) and torch.equal(comp.codes, full.codes)
    for ksize, pad in ((3, 1), (1, 0)):
        qw = _qt((4, ksize, ksize, C), IntFormat(1, encoding="pm1"), g, PerChannel(0))
        for impl in (conv2d, lambda *a, **k: qconv._conv2d_impl(*a, _gemm=rq.bmma_gemm_reference, **k)):
            want = impl(full, qw, padding=pad, out_dtype=torch.int32)
            assert torch.equal(impl(comp, qw, padding=pad, out_dtype=torch.int32), want), (ksize, C)


# ------------------------------------------------------------------------------------------------
# Residual blocks: act(conv(x) + residual) in the epilogue, and the dual (float + int8 codes) output
# ------------------------------------------------------------------------------------------------


def _unfused(qx, qw, res, act, geo, **kw):
    """The unfused graph: the conv in the residual's dtype, then torch's add and activation."""
    y = conv2d(qx, qw, backend="reference", out_dtype=res.dtype, **kw, **geo)
    s = y + res  # the network's dtype, as nn.Module code adds
    return torch.relu(s) if act == "relu" else F.leaky_relu(s, 0.1) if act else s


@pytest.mark.parametrize("i", [0, 4, 7], ids=["uint8-padded", "1x1-s2", "int8-C17"])
@pytest.mark.parametrize("dt", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_residual_and_dual_output_bit_exact(i, dt):
    """INT8 kernel (interpreter) = reference = the unfused graph, for the float output, the int8 codes and the
    dual output (the codes of the float it returns, as quantize_int8_static gives them)."""
    qx, qw, geo = _int8_case(i, seed=60)
    pw = pack_conv_weight(qw)
    K = qw.shape[0]
    gen = torch.Generator().manual_seed(61)
    scale, bias = (torch.rand(K, generator=gen) + 0.5) * 1e-3, torch.randn(K, generator=gen)
    y0 = conv2d(qx, qw, backend="reference", scale=scale, bias=bias, **geo)
    res = (torch.randn(y0.shape, generator=gen) * y0.abs().max()).to(dt)
    act = "relu" if i != 4 else ("leaky", 0.1)
    kw = dict(scale=scale, bias=bias, act=act, out_dtype=dt, residual=res, **geo)
    want = _unfused(qx, qw, res, act, geo, scale=scale, bias=bias)
    for backend, w in (("int8", pw), ("reference", qw)):
        assert torch.equal(conv2d(qx, w, backend=backend, **kw), want), backend
    fmt = "uint8" if act == "relu" else "int8"
    s_out = (want.float().abs().max() / (tp.format(fmt).max * 1.25)).reshape(1)  # values above 80% of max saturate
    codes = qconv.quantize_int8_static(want, fmt, s_out)
    for backend, w in (("int8", pw), ("reference", qw)):
        a = conv2d(qx, w, backend=backend, out_fmt=fmt, out_scale=s_out, out_layout="int8", **kw)
        assert isinstance(a.layout, ShiftedInt8) and a.hp is None and torch.equal(a.data, codes.data), backend
        d = conv2d(qx, w, backend=backend, out_fmt=fmt, out_scale=s_out, out_layout="int8+float", **kw)
        assert d.hp.dtype == dt and d.hp.shape == d.data.shape and torch.equal(d.hp, want), backend
        assert torch.equal(d.data, codes.data) and torch.equal(d.scale.reshape(1), s_out), backend
    assert int(codes.data.max()) == 127 and len(torch.unique(codes.data)) > 10  # the top code (uint8: 255 - 128)
    s = explain_conv2d(qx, pw, backend="int8", out_fmt=fmt, out_scale=s_out, out_layout="int8+float", **kw)
    assert f"fused epilogue (scale, bias, residual, act={act})" in s and "ShiftedInt8 QTensor with hp" in s
    assert "separate pass" not in s
    # the dual output is a conv's input (its codes) like any ShiftedInt8 QTensor
    nxt = _qt((5, 1, 1, K), tp.format("int8"), gen, PerChannel(0))
    assert torch.equal(conv2d(d, nxt, out_dtype=torch.int32, backend="int8"),
                       conv2d(codes, nxt, out_dtype=torch.int32, backend="int8"))


def test_residual_on_the_torch_epilogues():
    """The INT8 im2col route (uint8 weights) and float8 operands (kernel and reference) take a residual too."""
    gen = torch.Generator().manual_seed(62)
    qx = _qt((1, 6, 7, 5), tp.format("uint4"), gen)
    qw = _qt((3, 3, 3, 5), tp.format("uint8"), gen)
    res = torch.randn(1, 6, 7, 3, generator=gen).half() * 50
    kw = dict(padding=1, act="relu", out_dtype=torch.float16, residual=res)
    assert "im2col on codes" in explain_conv2d(qx, qw, backend="int8", **kw)
    assert "residual" in explain_conv2d(qx, qw, backend="int8", **kw)
    assert torch.equal(conv2d(qx, qw, backend="int8", **kw), _unfused(qx, qw, res, "relu", dict(padding=1)))
    fx, fw, geo = _fp8_case(seed=63)
    pf = pack_conv_weight(fw)
    for backend, w in (("fp8", pf), ("reference", fw)):
        y = conv2d(fx, w, backend=backend, out_dtype=torch.float16, **geo)
        r = torch.randn(y.shape, generator=gen).half() * y.abs().max()
        got = conv2d(fx, w, backend=backend, out_dtype=torch.float16, act="relu", residual=r, **geo)
        assert torch.equal(got, torch.relu(y + r)), backend


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("act", [None, "relu", ("leaky", 0.1)])
def test_bitserial_residual_equals_the_unfused_add(dtype, act):
    """The bit-serial route adds a residual in its float epilogue with the unfused graph's roundings:
    act(rd(rd(conv) + r)) equals conv, then the add in ``dtype``, then the activation -- through the reference
    GEMM (the kernel's contract; tests/gpu runs the kernel against it)."""
    qx, qw, geo = _case(2)
    gen = torch.Generator().manual_seed(11)
    impl = lambda **k: qconv._conv2d_impl(qx, qw, _gemm=rq.bmma_gemm_reference, out_dtype=dtype,  # noqa: E731
                                          **dict(geo, **k))
    y = impl()
    r = (torch.randn(y.shape, generator=gen) * y.float().abs().max()).to(dtype)
    s = (y.float() + r.float()).to(dtype).float()
    want = rq.apply_act(s, act).to(dtype)
    got = impl(act=act, residual=r)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(got, conv2d(qx, qw, backend="reference", out_dtype=dtype, act=act, residual=r, **geo))


def test_residual_bad_input():
    qx, qw, geo = _int8_case(0, seed=64)
    y = conv2d(qx, qw, backend="reference", **geo)  # (N, P, Q, K) float32
    N, P, Q, K = y.shape
    cases = [
        (dict(residual=y.permute(0, 3, 1, 2)), ValueError,
         rf"residual must have the output's NHWC shape \(N, P, Q, K\) = \({N}, {P}, {Q}, {K}\), got \({N}, {K}, {P}, "
         rf"{Q}\); an NCHW tensor is residual.permute\(0, 2, 3, 1\)"),
        (dict(residual=y.half()), ValueError,
         r"residual must have the output's dtype out_dtype=torch.float32 .*got residual.dtype=torch.float16; pass "
         r"residual.to\(torch.float32\) or out_dtype=torch.float16"),
        (dict(residual=torch.empty(y.shape, device="meta")), ValueError,
         r"residual is on meta but the operands are on cpu; move it there"),
        (dict(residual=y.numpy()), TypeError, "residual must be a float NHWC torch.Tensor"),
        (dict(residual=y.int(), out_dtype=torch.int32), ValueError,
         r"residual is added in the float epilogue: out_dtype must be one of"),
        (dict(residual=y, pool=("max", 2, 2)), ValueError, r"residual= cannot be combined with pool"),
        (dict(residual=y, out_fmt="uint4", out_scale=1.0), ValueError,
         r"out_fmt=uint4 with out_layout='planes' is not one of them; .*out_layout in \('int8', 'int8\+float', "
         r"'planes\+float'\)"),
        (dict(out_fmt="e4m3", out_scale=1.0, out_layout="planes+float"), ValueError,
         r"out_layout='planes\+float' .* needs an integer out_fmt"),
        (dict(out_fmt="uint8", out_scale=1.0, out_layout="int8+float", pool=("max", 2, 2)), ValueError,
         r"out_layout='int8\+float' cannot be combined with pool"),
        (dict(out_layout="int8+float"), ValueError, r"out_layout='int8\+float' .* needs an integer out_fmt"),
    ]
    for kw, exc, match in cases:
        for backend in ("int8", "reference"):
            with pytest.raises(exc, match=match):
                conv2d(qx, qw, backend=backend, **dict(geo, **kw))
    # the bit-serial GEMM adds a residual into a float output only: codes with it (or the dual output) raise,
    # naming the backends that write them, never a silent fallback
    qb, wb, gb = _case(2)
    yb = conv2d(qb, wb, backend="reference", **gb)
    for kw in (dict(residual=yb, out_fmt="uint8", out_scale=1.0, out_layout="int8"),
               dict(out_fmt="uint8", out_scale=1.0, out_layout="int8+float"),
               dict(out_fmt="uint8", out_scale=1.0, out_layout="planes+float", out_dtype=torch.float16),
               dict(out_fmt="uint2", out_scale=1.0, out_layout="planes+float")):  # (float32 out)
        with pytest.raises(ValueError, match=r"backend 'bitserial' .* adds a residual into a float output "
                                             r"\(out_fmt=None\), or writes it with its planes \(out_layout="
                                             r"'planes\+float', out_fmt of <= 3 bits, out_dtype float16 / bfloat16\), "
                                             r"not out_fmt=uint.* backends that write other codes with it: 'int8', "
                                             r"'fp8', 'reference'"):
            qconv._conv2d_impl(qb, wb, _gemm=rq.bmma_gemm_reference, **dict(gb, **kw))
    fx, fw, fgeo = _fp8_case(3)
    with pytest.raises(ValueError, match=r"out_layout='planes\+float' .* is written by the 'bitserial', 'int8' and "
                                         r"'reference' backends, not 'fp8'; an FP8 layer writes its float and float8 "
                                         r"codes with out_layout='fp8\+float'"):
        conv2d(fx, fw, backend="fp8", out_fmt="uint2", out_scale=1.0, out_layout="planes+float", **fgeo)
    with pytest.raises(TypeError, match=r"hp must be None or a float tensor of the codes' shape \(1, 2, 2, 3\)"):
        qconv.planes_qtensor(torch.zeros(2, 4, 16, dtype=torch.int32), "uint2", 1.0, (1, 2, 2, 3),
                             hp=torch.zeros(1, 3, 2, 2))
    with pytest.raises(TypeError, match=r"hp must be None or a float tensor of the codes' shape \(1, 2, 2, 3\)"):
        qconv.int8_qtensor(torch.zeros(1, 2, 2, 3, dtype=torch.int8), "uint8", 1.0, hp=torch.zeros(1, 3, 2, 2))


def test_scale_tensor_is_checked_once_per_version(monkeypatch):
    """A calibrated scale buffer is read back (a host sync on CUDA) once, not on every call; an in-place change
    is checked again, and a bad scale is never remembered as checked."""
    calls = []
    real = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(1) or real(t))
    s = torch.tensor([0.5])
    for _ in range(3):
        assert qconv._scale_tensor(s, s.device, "scale").item() == 0.5
    assert len(calls) == 1
    assert qconv._scale_checked(s)
    s.fill_(float("nan"))  # in place: the version moves on
    assert not qconv._scale_checked(s)
    with pytest.raises(ValueError, match="finite positive"):
        qconv._scale_tensor(s, s.device, "scale")
    t = torch.tensor([-1.0])
    for _ in range(2):
        with pytest.raises(ValueError, match="finite positive"):
            qconv._scale_tensor(t, t.device, "scale")
    assert not qconv._scale_checked(t) and not qconv._scale_checked(s)
    with torch.inference_mode():  # no version counter: checked every time, never remembered (once crashed here)
        u = torch.tensor([0.25])
        assert qconv._scale_tensor(u, u.device, "scale").item() == 0.25 and not qconv._scale_checked(u)


def test_column_scale_is_computed_once_per_version_of_its_buffers():
    """x_scale * w_scale * scale (two kernel launches a layer on CUDA) is made once for the same calibrated buffers and
    again after an in-place change of any of them; a view of a buffer shares its entry; new tensors get new values;
    inference tensors and tensors that need grad are never remembered."""
    xs_scale, w_scale, ch = torch.tensor([0.5]), torch.tensor([1.0, 2.0, 4.0]), torch.tensor([3.0, 1.0, 0.5])
    xs = qconv._X(IntFormat(2, encoding="unsigned"), xs_scale, (1, 1, 1, 3), xs_scale.device, None)
    col = qconv._col_scale(xs, w_scale, ch)
    assert col.tolist() == [1.5, 1.0, 1.0]
    assert qconv._col_scale(xs, w_scale, ch) is col
    xv = qconv._X(xs.fmt, xs_scale.reshape(1, 1).reshape(1), xs.shape, xs.device, None)  # a view of x's scale
    assert qconv._col_scale(xv, w_scale, ch) is col
    ch.mul_(2)  # in place (e.g. load_state_dict): computed again
    again = qconv._col_scale(xs, w_scale, ch)
    assert again is not col and again.tolist() == [3.0, 2.0, 2.0]
    xs_scale.fill_(1.0)
    assert qconv._col_scale(xs, w_scale, ch).tolist() == [6.0, 4.0, 4.0]
    for k in range(3):  # a fresh tensor a call (maybe at a freed one's address): its own values
        assert qconv._col_scale(xs, w_scale, torch.full((3,), float(k))).tolist() == [0.0 * k + w * k for w in
                                                                                       (1.0, 2.0, 4.0)]
    with torch.inference_mode():
        s_inf = torch.tensor([2.0, 2.0, 2.0])
        assert qconv._col_scale(xs, w_scale, s_inf).tolist() == [2.0, 4.0, 8.0]
    g = torch.ones(3, requires_grad=True)
    y = qconv._col_scale(xs, w_scale, g)
    assert y.requires_grad and qconv._col_scale(xs, w_scale, g) is not y
    # end to end: a QConv2d whose folded scale changes in place gives the new result
    conv = torch.nn.Conv2d(4, 3, 1, bias=False)
    bn = torch.nn.BatchNorm2d(3).eval()
    m = tp.nn.QConv2d.from_float(conv, "w1a2", in_absmax=1.0, signed_input=False, bn=bn, backend="reference")
    x = torch.rand(1, 4, 2, 2)
    y1 = m(x).clone()
    m.ch_bias.zero_()
    m.ch_scale.mul_(2)
    assert torch.allclose(m(x), 2 * y1)


# ---- the implicit-GEMM route (bmma_gemm with conv=): its torch statement, the route choice, bad input ----


def test_implicit_conv_rows_are_the_im2col_rows_when_taps_are_whole_chunks():
    """With ceil(C / 32) even the implicit GEMM's K layout is the im2col layout itself, so the same weight planes
    serve both; otherwise each tap is padded to an even number of words (zeros) and the products agree."""
    gen = torch.Generator().manual_seed(3)
    for C, K in ((128, 5), (64, 3), (37, 6), (96, 4)):
        g = ConvGeometry(2, 7, 6, C, K, 3, 2, (2, 1), (1, 1), (1, 2))
        x = torch.randint(0, 4, (g.N * g.H * g.W, C), generator=gen)
        w = torch.randint(0, 2, (K, g.R, g.S, C), generator=gen)
        a = pack_bitplanes(x, 2, validate=False)
        cwt = rq.conv_tap_words(C)
        wp = rq.pack_weight_planes(w, 1, tap_words=cwt)
        conv = [g.H, g.W, g.P, g.Q, g.R, g.S, *g.stride, *g.padding, *g.dilation, cwt]
        rows = rq.implicit_conv_rows(a, wp, conv)
        assert rows.shape == (2, g.N * g.P * g.Q, wp.shape[2])
        cols, w_old = rq.im2col_bits(a, g), rq.pack_weight_planes(w, 1)
        if C in (128, 64, 37):
            assert cwt == -(-C // 32) + (-(-C // 32)) % 2 and torch.equal(wp, w_old) and torch.equal(rows, cols)
        else:  # 3 words a tap padded to 4
            assert cwt == 4 and not torch.equal(wp, w_old)
        args = (False, False, 1, None, None, None, None, None, False, "int32", 1, "unsigned", None)
        assert torch.equal(rq.bmma_gemm_reference(a, wp, *args, conv=conv), rq.bmma_gemm_reference(cols, w_old, *args))


def test_implicit_conv_route_choice_and_bad_geometry():
    from tcprec.kernels.cuda import bmma_gemm as L

    g = ConvGeometry(1, 8, 8, 64, 8, 3, 3, (1, 1), (1, 1), (1, 1))
    # only taps without padding words (ceil(C / 32) even) and, where the GEMM runs the large wgmma tiles (as many as
    # the SMs), at most two column tiles of them (w1a2: 128 wide)
    assert qconv.implicit_conv(g, 16) and qconv.implicit_conv(g, 2)  # C = 64: padded / compact rows
    geo = lambda C, K, R=3, N=256, H=14: ConvGeometry(N, H, H, C, K, R, R, (1, 1), (R // 2,) * 2, (1, 1))  # noqa: E731
    assert qconv.implicit_conv(geo(256, 256), 8) and qconv.implicit_conv(geo(128, 100, H=28), 4)
    assert qconv.implicit_conv(geo(384, 256, 5), 12) and qconv.implicit_conv(geo(192, 384, N=8), 6)
    assert not qconv.implicit_conv(geo(256, 384), 8) and not qconv.implicit_conv(geo(512, 512), 16)  # 3, 4 tiles
    assert not qconv.implicit_conv(geo(96, 256), 16) and not qconv.implicit_conv(geo(256, 256, 1), 8)  # pad; 1x1
    assert not qconv.implicit_conv(geo(96, 256), 3)  # compact rows of 3 words: not whole 8-byte taps
    assert not qconv.implicit_conv(geo(256, 256), 8, 2, 2)  # w2a2: 64-wide tiles, 4 of them
    # fewer wgmma tiles than SMs (mma.sync tiles): any number of column tiles -- 8 x 14 x 14 rows = 13 x 4 tiles
    assert qconv.implicit_conv(geo(512, 512, N=8), 16) and not qconv.implicit_conv(geo(512, 512, N=8), 16, sm_count=50)
    assert not qconv.implicit_conv(ConvGeometry(1, 8, 8, 64, 8, 1, 1, (1, 1), (0, 0), (1, 1)), 16)  # pointwise
    a = torch.zeros(2, 64, 16, dtype=torch.int32)
    w = torch.zeros(1, 8, 48, dtype=torch.int32)
    conv = [8, 8, 8, 8, 3, 3, 1, 1, 1, 1, 1, 1, 4]
    L.check_conv(a, w, conv)  # fine
    with pytest.raises(ValueError, match="Kin"):
        L.check_conv(a[..., :2], w, conv)  # rows of 2 words, taps of 4
    with pytest.raises(ValueError, match="Kin"):
        L.check_conv(a[..., :3], w, conv[:-1] + [2])  # rows of 3 words: not whole 8-byte copies
    with pytest.raises(ValueError, match="R\\*S\\*CWT"):
        L.check_conv(a, w[..., :16], conv)
    with pytest.raises(ValueError, match="whole H x W"):
        L.check_conv(a[:, :60], w, conv)
    with pytest.raises(ValueError, match="conv must be"):
        L.check_conv(a, w, conv[:4])
    with pytest.raises(ValueError, match="no cluster"):
        L.Variant(2, 1, tile=L.parse_tile("128x128_w8x1_s4_k1024_wg_tma_c2x1"), epilogue="int32", conv=True)
    assert str(L.Variant(2, 1, conv=True)).endswith("_conv") and "TCP_CONV=1" in L.Variant(2, 1, conv=True).defines()


@pytest.mark.parametrize("geo", [dict(stride=1, padding=1), dict(stride=2, padding=2, dilation=2),
                                 dict(stride=(2, 1), padding=(0, 1))])
@pytest.mark.parametrize("C", [64, 128, 37, 96])
def test_bitserial_routes_equal_exact(geo, C):
    """The bit-serial convolution on the implicit GEMM (C = 64, 128, 37: taps without padding words) hands the GEMM
    its input planes and the geometry (conv=) instead of im2col'd rows, and the reference GEMM gathers them
    explicitly; C = 96 (a tap of 3 words padded to 4) takes the im2col route.  Both give the integer reference's
    int32 product (pm1 weights: the implicit route's row correction is row_affine, the sums of the gathered rows,
    computed by the GEMM itself; no row_term is passed)."""
    gen = torch.Generator().manual_seed(C)
    qx = _qt((2, 9, 8, C), tp.format("uint2"), gen)
    qw = _qt((7, 3, 3, C), tp.format("binary"), gen)
    on = C != 96
    seen = []
    gemm = lambda *a, **k: seen.append(("conv" in k, k.get("row_affine") is not None, a[5] is None)) \
        or rq.bmma_gemm_reference(*a, **k)  # noqa: E731
    y = qconv._conv2d_impl(qx, qw, out_dtype=torch.int32, _gemm=gemm, **geo)
    assert seen == [(on, on, on)]
    assert torch.equal(y.long(), _exact(qx, qw, **geo).long())
