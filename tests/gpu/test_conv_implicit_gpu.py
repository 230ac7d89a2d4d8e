"""The bit-serial GEMM's implicit-GEMM convolution (``torch.ops.tcprec.bmma_gemm`` with ``conv=``, bmma_gemm.cu
TCP_CONV) equals its torch statement (``reference_conv_bitserial.bmma_gemm_reference`` with ``conv=``: the windows gathered
explicitly) bit for bit: kernel sizes 1..7, strides 1..4, padding, dilation, odd sizes and channel counts, padded
and compact input rows, every tile family (TMA with the gathering producer warpgroup, cp.async wgmma, mma.sync,
the small tile), int32 / float16 / packed epilogues, two's complement operands.  Skipped without a CUDA GPU."""

import pytest
import torch

from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.kernels.cuda import bmma_gemm as L
from tcprec.kernels.cuda import runtime as R
from tcprec.packing import pack_bitplanes

DEV = "cuda"

# (N, H, W, C), (K, R, S), stride, padding, dilation
GEOMS = [
    ((2, 9, 11, 64), (64, 3, 3), 1, 1, 1),
    ((3, 17, 13, 37), (29, 5, 3), (2, 1), (1, 2), 1),
    ((2, 14, 14, 256), (128, 3, 3), 1, 1, 1),
    ((2, 27, 27, 64), (192, 5, 5), 1, 2, 1),
    ((1, 20, 20, 96), (64, 3, 3), 1, 2, 2),
    ((2, 28, 28, 64), (128, 3, 3), 2, 1, 1),
    ((1, 15, 15, 130), (40, 7, 7), 4, 3, 1),
    ((2, 8, 8, 512), (256, 3, 3), 1, 1, 1),
    ((1, 6, 7, 200), (48, 1, 1), 2, 0, 1),
]
TILES = ["", "128x128_w8x1_s4_k1024_wg_tma", "128x64_w8x1_s3_k1024_wg_tma", "192x64_w12x1_s3_k1024_wg_tma",
         "128x128_w8x1_s4_k1024_wg", "64x64_w2x2_s3_k1024", "32x32_w2x2_s2_k1024", "64x128_w2x2_s3"]


def _case(geom, p, q, a_twos, w_twos, compact=False, seed=0):
    (N, H, W, C), (K, R, S), st, pd, dl = geom
    pair = lambda v: (v, v) if isinstance(v, int) else v  # noqa: E731
    (sh, sw), (ph, pw), (dh, dw) = pair(st), pair(pd), pair(dl)
    P = (H + 2 * ph - dh * (R - 1) - 1) // sh + 1
    Q = (W + 2 * pw - dw * (S - 1) - 1) // sw + 1
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randint(0, 1 << p, (N * H * W, C), device=DEV, generator=gen, dtype=torch.int32)
    w = torch.randint(0, 1 << q, (K, R, S, C), device=DEV, generator=gen, dtype=torch.int32)
    a = pack_bitplanes(x, p, validate=False)  # (p, NHW, packed_words(C)), zero words past C
    if compact:
        a = a[..., : -(-C // 32)].contiguous()
    cwt = rq.conv_tap_words(C)
    wp = rq.pack_weight_planes(w, q, tap_words=cwt)
    conv = [H, W, P, Q, R, S, sh, sw, ph, pw, dh, dw, cwt]
    return a, wp, conv, N * P * Q, K


def _both(a, wp, conv, M, K, a_twos, w_twos, out_kind, tile, out_bits=2):
    gen = torch.Generator(device=DEV).manual_seed(1)
    row_term = torch.randint(-50, 50, (M,), device=DEV, generator=gen, dtype=torch.int32)
    col_term = torch.randint(-50, 50, (K,), device=DEV, generator=gen, dtype=torch.int32)
    col_scale = torch.rand(K, device=DEV, generator=gen) * 0.05 + 0.01
    bias = torch.randn(K, device=DEV, generator=gen)
    out_scale = torch.tensor([0.7], device=DEV)
    args = (a, wp, a_twos, w_twos, 3, row_term, col_term, None, col_scale if out_kind != "int32" else None,
            bias if out_kind != "int32" else None, out_kind != "int32", out_kind, out_bits, "unsigned",
            out_scale if out_kind == "packed" else None, tile)
    got = L._bmma_gemm(*args, conv=conv)
    want = rq.bmma_gemm_reference(*args, conv=conv)
    return got, want


@pytest.mark.parametrize("gi", range(len(GEOMS)))
@pytest.mark.parametrize("tile", TILES, ids=[t or "default" for t in TILES])
def test_implicit_conv_int32_equals_reference(gi, tile):
    a, wp, conv, M, K = _case(GEOMS[gi], 2, 1, False, False, seed=gi)
    got, want = _both(a, wp, conv, M, K, False, False, "int32", tile)
    assert got.shape == (M, K)
    assert torch.equal(got, want), (GEOMS[gi], tile, (got != want).sum().item())


@pytest.mark.parametrize("gi", [0, 2, 3, 4, 7])
@pytest.mark.parametrize("out_kind", ["packed", "float16"])
@pytest.mark.parametrize("tile", ["", "128x128_w8x1_s4_k1024_wg_tma", "64x64_w2x2_s3_k1024"])
def test_implicit_conv_epilogues_equal_reference(gi, out_kind, tile):
    a, wp, conv, M, K = _case(GEOMS[gi], 2, 1, False, False, seed=10 + gi)
    got, want = _both(a, wp, conv, M, K, False, False, out_kind, tile)
    assert torch.equal(got, want), (GEOMS[gi], tile, out_kind)


@pytest.mark.parametrize("p, q, a_twos, w_twos", [(1, 1, False, False), (2, 2, True, True), (3, 2, False, True),
                                                  (4, 1, True, False), (8, 1, False, False)])
def test_implicit_conv_widths_and_signs(p, q, a_twos, w_twos):
    for gi in (1, 2, 6):
        a, wp, conv, M, K = _case(GEOMS[gi], p, q, a_twos, w_twos, seed=20 + gi)
        got, want = _both(a, wp, conv, M, K, a_twos, w_twos, "int32", "")
        assert torch.equal(got, want), (GEOMS[gi], p, q)


def test_implicit_conv_compact_rows_and_large_batch():
    """Compact rows (C = 256: 8 words a pixel, a multiple of 4) equal padded ones; a batch large enough for the
    persistent TMA tile walks several tiles a block (the producer's LAG flush across tiles)."""
    geom = ((16, 28, 28, 256), (256, 3, 3), 1, 1, 1)
    a, wp, conv, M, K = _case(geom, 2, 1, False, False, seed=5)
    ac, *_ = _case(geom, 2, 1, False, False, compact=True, seed=5)
    assert ac.shape[2] == 8
    got, want = _both(a, wp, conv, M, K, False, False, "packed", "")
    got_c, _ = _both(ac, wp, conv, M, K, False, False, "packed", "")
    assert L._variant_for(2, 1, False, False, M, K, "packed", 2, "unsigned", "", *R.sm_count(a.device), wp.shape[2],
                          True).tile.tma
    assert torch.equal(got, want) and torch.equal(got_c, want)


def test_implicit_conv_in_cuda_graph():
    a, wp, conv, M, K = _case(GEOMS[3], 2, 1, False, False, seed=3)
    _, want = _both(a, wp, conv, M, K, False, False, "int32", "")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _both(a, wp, conv, M, K, False, False, "int32", "")  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = L._bmma_gemm(a, wp, False, False, 3, None, None, None, None, None, False, "int32", 2, "unsigned", None,
                           "", conv=conv)
    g.replay()
    torch.cuda.synchronize()
    ref = rq.bmma_gemm_reference(a, wp, False, False, 3, None, None, None, None, None, False, "int32", 2, "unsigned",
                                 None, "", conv=conv)
    assert torch.equal(got, ref)
    assert want.shape == got.shape


def test_implicit_conv_bad_geometry_raises():
    a, wp, conv, M, K = _case(GEOMS[0], 2, 1, False, False)
    with pytest.raises(ValueError, match="Kin"):  # rows of 3 words: not whole 8-byte copies
        L._bmma_gemm(a[..., :3].contiguous(), wp, False, False, 1, None, None, None, None, None, False, "int32", 2,
                     "unsigned", None, "", conv=conv)
    with pytest.raises(ValueError, match="conv must be"):
        L._bmma_gemm(a, wp, False, False, 1, None, None, None, None, None, False, "int32", 2, "unsigned", None, "",
                     conv=conv[:5])
    with pytest.raises(ValueError, match="no cluster"):
        L._bmma_gemm(a, wp, False, False, 1, None, None, None, None, None, False, "int32", 2, "unsigned", None,
                     "128x128_w8x1_s4_k1024_wg_tma_c2x1", conv=conv)


@pytest.mark.parametrize("layer", [((2, 56, 56, 96), (256, 3, 3), 1, 1), ((2, 27, 27, 64), (192, 5, 5), 1, 2),
                                   ((2, 56, 56, 64), (128, 3, 3), 2, 1), ((3, 17, 13, 37), (29, 5, 3), (2, 1), (1, 2))],
                         ids=["vgg56", "alexnet2", "resnet_s2", "odd"])
def test_qconv_bitserial_routes_equal_reference(layer):
    """qconv.conv2d's bit-serial route as ``implicit_conv`` picks it (the implicit GEMM, where the kernel gathers the
    windows, for C = 64 / 37; the im2col route for C = 96, whose taps have a padding word) equals the reference bit
    for bit: w1a2 (pm1 weights: the rowsum-only pass), packed and float16 outputs."""
    import tcprec as tp
    from tcprec.ops import qconv
    from tcprec.qtensor import BitPlanes, PerChannel, PerTensor, QTensor

    (N, H, W, C), (K, R, S), st, pd = layer
    gen = torch.Generator(device=DEV).manual_seed(7)
    fa, fw = tp.format("uint2"), tp.format("binary")
    qx = QTensor(torch.randint(0, 4, (N, H, W, C), dtype=torch.uint8, device=DEV, generator=gen),
                 torch.full((1, 1, 1, 1), 0.5, device=DEV), fa, PerTensor(), (N, H, W, C), torch.float32)
    qw = QTensor(torch.randint(0, 2, (K, R, S, C), dtype=torch.uint8, device=DEV, generator=gen),
                 torch.rand(K, 1, 1, 1, device=DEV, generator=gen) + 0.5, fw, PerChannel(0), (K, R, S, C), torch.float32)
    bias = torch.randn(K, device=DEV, generator=gen)
    kw = dict(stride=st, padding=pd, bias=bias, act="relu")
    implicit = "implicit GEMM" in qconv.explain_conv2d(qx, qw, out_dtype=torch.float16, **kw)
    assert implicit == (C != 96), qconv.explain_conv2d(qx, qw, out_dtype=torch.float16, **kw)
    y16 = qconv.conv2d(qx, qw, out_dtype=torch.float16, **kw)
    assert torch.equal(y16, qconv.conv2d(qx, qw, out_dtype=torch.float16, backend="reference", **kw))
    yp = qconv.conv2d(qx, qw, out_fmt="uint2", out_scale=0.25, **kw)
    want = qconv.conv2d(qx, qw, out_fmt="uint2", out_scale=0.25, backend="reference", **kw)
    assert torch.equal(yp.to_layout(BitPlanes()).data, want.to_layout(BitPlanes()).data)


def _row_affine_pair(a, wp, conv, M, K, a_twos, w_twos, out_kind, tile, row_affine, residual=None, dual=False):
    """(kernel with the row term from in-kernel row sums, reference with it) of one call."""
    gen = torch.Generator(device=DEV).manual_seed(2)
    col_term = torch.randint(-50, 50, (K,), device=DEV, generator=gen, dtype=torch.int32)
    col_scale = torch.rand(K, device=DEV, generator=gen) * 0.05 + 0.01
    bias = torch.randn(K, device=DEV, generator=gen)
    out_scale = torch.tensor([0.7], device=DEV)
    fl = out_kind != "int32"
    args = (a, wp, a_twos, w_twos, 2, None, col_term, None, col_scale if fl else None, bias if fl else None, fl,
            out_kind, 2, "unsigned", out_scale if out_kind == "packed" or dual else None, tile)
    kw = dict(conv=conv, row_affine=row_affine, residual=residual)
    if dual:
        outs = []
        for f in (L._bmma_gemm, rq.bmma_gemm_reference):
            d = torch.empty((2, M, -(-K // 32)), dtype=torch.int32, device=DEV)
            outs.append((f(*args, dual_out=d, **kw), d))
        return outs
    return L._bmma_gemm(*args, **kw), rq.bmma_gemm_reference(*args, **kw)


ROWSUM_TILES = ["", "128x128_w8x1_s4_k1024_wg_tma", "128x64_w8x1_s3_k1024_wg_tma", "192x64_w12x1_s3_k1024_wg_tma",
                "128x128_w8x1_s4_k1024_wg", "64x128_w4x1_s4_k1024_wg", "64x64_w2x2_s3_k1024", "32x64_w2x2_s3_k1024", "32x32_w2x2_s2_k1024",
                "64x128_w2x2_s3"]


@pytest.mark.parametrize("gi", [0, 1, 2, 4, 6])
@pytest.mark.parametrize("tile", ROWSUM_TILES, ids=[t or "default" for t in ROWSUM_TILES])
def test_in_kernel_row_sums_equal_reference(gi, tile):
    """row_affine=(row_mul, row_add): the row term from the tensor cores' row sums of the gathered windows (padding
    taps add nothing) equals the reference's explicit one, int32 epilogue, every tile family."""
    a, wp, conv, M, K = _case(GEOMS[gi], 2, 1, False, False, seed=30 + gi)
    got, want = _row_affine_pair(a, wp, conv, M, K, False, False, "int32", tile, (-3, 11 * gi - 7))
    assert torch.equal(got, want), (GEOMS[gi], tile, (got != want).sum().item())


@pytest.mark.parametrize("out_kind", ["packed", "float16"])
@pytest.mark.parametrize("tile", ["", "128x128_w8x1_s4_k1024_wg_tma", "32x64_w2x2_s3_k1024", "64x64_w2x2_s3_k1024"])
def test_in_kernel_row_sums_epilogues(out_kind, tile):
    a, wp, conv, M, K = _case(GEOMS[2], 2, 1, False, False, seed=40)
    got, want = _row_affine_pair(a, wp, conv, M, K, False, False, out_kind, tile, (-1, 4608))
    assert torch.equal(got, want), (tile, out_kind)


@pytest.mark.parametrize("p, q, a_twos, w_twos", [(1, 1, False, False), (3, 2, True, False), (4, 1, True, True),
                                                  (8, 1, False, False)])
def test_in_kernel_row_sums_widths_and_signs(p, q, a_twos, w_twos):
    """Plane weights of the row sums: unsigned 2^i, two's complement's negative top plane."""
    for gi in (1, 2):
        a, wp, conv, M, K = _case(GEOMS[gi], p, q, a_twos, w_twos, seed=50 + gi)
        for tile in ("", "32x32_w2x2_s2_k1024"):
            got, want = _row_affine_pair(a, wp, conv, M, K, a_twos, w_twos, "int32", tile, (-(2**q - 1), 5))
            assert torch.equal(got, want), (GEOMS[gi], p, q, a_twos, tile)


def test_in_kernel_row_sums_plain_gemm_residual_and_dual():
    """Without a convolution (a 1x1 layer's planes as A), with a fused residual, and with the dual planes output."""
    gen = torch.Generator(device=DEV).manual_seed(9)
    M, K, C = 300, 128, 200
    a = pack_bitplanes(torch.randint(0, 4, (M, C), device=DEV, generator=gen, dtype=torch.int32), 2, validate=False)
    wp = pack_bitplanes(torch.randint(0, 2, (K, C), device=DEV, generator=gen, dtype=torch.int32), 1, validate=False)
    for tile in ("", "128x128_w8x1_s4_k1024_wg_tma", "32x64_w2x2_s3_k1024"):
        got, want = _row_affine_pair(a, wp, None, M, K, False, False, "int32", tile, (-1, 0))
        assert torch.equal(got, want), tile
        res = torch.randn(M, K, device=DEV, generator=gen).half()
        got, want = _row_affine_pair(a, wp, None, M, K, False, False, "float16", tile, (-1, 0), residual=res)
        assert torch.equal(got, want), tile
        (g16, gp), (w16, wpl) = _row_affine_pair(a, wp, None, M, K, False, False, "float16", tile, (-1, 0), dual=True)
        assert torch.equal(g16, w16) and torch.equal(gp, wpl), tile


def test_in_kernel_row_sums_bad_input():
    a, wp, conv, M, K = _case(GEOMS[0], 2, 1, False, False)
    rt = torch.zeros(M, dtype=torch.int32, device=DEV)
    base = (a, wp, False, False, 2)
    rest = (None, None, None, None, False, "int32", 2, "unsigned", None, "")
    with pytest.raises(ValueError, match="not both"):
        L._bmma_gemm(*base, rt, *rest, conv=conv, row_affine=(1, 0))
    with pytest.raises(ValueError, match="two int32 integers"):
        L._bmma_gemm(*base, None, *rest, conv=conv, row_affine=(1,))
    with pytest.raises(ValueError, match="two int32 integers"):
        L._bmma_gemm(*base, None, *rest, conv=conv, row_affine=(2**31, 0))
    plain_a = pack_bitplanes(torch.ones(64, 2048, dtype=torch.int32, device=DEV), 2, validate=False)
    plain_w = pack_bitplanes(torch.ones(32, 2048, dtype=torch.int32, device=DEV), 1, validate=False)
    with pytest.raises(ValueError, match="split-K"):
        L._bmma_gemm(plain_a, plain_w, False, False, 2, None, None, None, None, None, False, "int32", 2, "unsigned",
                     None, "32x32_w2x2_s2_k1024_sk2", row_affine=(1, 0))


@pytest.mark.parametrize("geom", [GEOMS[0], GEOMS[3], GEOMS[5], ((2, 13, 13, 192), (96, 3, 3), 1, 1, 1),
                                  ((1, 9, 10, 37), (16, 3, 3), 2, 1, 1)], ids=["c64", "c64k5", "c64s2", "c192", "c37"])
@pytest.mark.parametrize("tile", ["", "128x64_w8x1_s3_k1024_wg_tma", "192x64_w12x1_s3_k1024_wg_tma",
                                  "128x128_w8x1_s4_k1024_wg", "32x64_w2x2_s3_k1024"])
def test_implicit_conv_8_byte_taps_on_compact_rows(geom, tile):
    """Taps of 2 mod 4 words (C = 64: 2, C = 192: 6) are gathered with 8-byte copies, from compact rows (2 / 6 words
    a pixel) as from padded ones, with the row sums in the kernel: equal to the reference."""
    C = geom[0][3]
    a, wp, conv, M, K = _case(geom, 2, 1, False, False, compact=True, seed=60 + C)
    assert a.shape[2] == -(-C // 32) and conv[-1] == -(-C // 64) * 2
    ap, *_ = _case(geom, 2, 1, False, False, seed=60 + C)
    for out_kind in ("int32", "packed"):
        got, want = _row_affine_pair(a, wp, conv, M, K, False, False, out_kind, tile, (-1, 9 * C))
        got_p, _ = _row_affine_pair(ap, wp, conv, M, K, False, False, out_kind, tile, (-1, 9 * C))
        assert torch.equal(got, want) and torch.equal(got_p, want), (geom, tile, out_kind)


def test_three_warpgroup_tile_is_the_default_for_wide_64_column_convs():
    """A 64 -> 64 3x3 conv with >= 2 tiles an SM at bm = 192 (ResNet-18's stage 0 at a large batch) runs three MMA
    warpgroups by default (bg.conv_wgmma_tile), with the row sums, a fused residual and both outputs, several
    tiles a block: equal to the reference.  A smaller batch keeps the two-warpgroup tile."""
    sms = R.sm_count(torch.device(DEV))[0]
    n = -(-(2 * sms * 192) // (56 * 56))  # images of 56 x 56 for 2 tiles an SM
    geom = ((n, 56, 56, 64), (64, 3, 3), 1, 1, 1)
    a, wp, conv, M, K = _case(geom, 2, 1, False, False, compact=True, seed=77)
    v = L._variant_for(2, 1, False, False, M, K, "packed", 2, "unsigned", "", *R.sm_count(a.device), wp.shape[2],
                       True, False, False, True)
    assert (v.tile.bm, v.tile.tma) == (192, True), str(v)
    small = L._variant_for(2, 1, False, False, 8 * 56 * 56, K, "packed", 2, "unsigned", "", *R.sm_count(a.device),
                           wp.shape[2], True, False, False, True)
    assert small.tile.bm == 128, str(small)
    got, want = _row_affine_pair(a, wp, conv, M, K, False, False, "packed", "", (-1, 576))
    assert torch.equal(got, want)
    res = torch.randn(M, K, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)).half()
    (g16, gp), (w16, wpl) = _row_affine_pair(a, wp, conv, M, K, False, False, "float16", "", (-1, 576),
                                             residual=res, dual=True)
    assert torch.equal(g16, w16) and torch.equal(gp, wpl)
