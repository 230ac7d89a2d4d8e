"""The bit-serial binary tensor-core GEMM on the GPU: exact for all 64 (p, q) pairs and the three
encodings on the issue's shapes (with the auto-picked tile and with each pair's large tile: the
wgmma tile on sm_90a where one exists, and the mma.sync one), the fused float (ReLU, LeakyReLU)
and packed epilogues against the reference, CUDA-graph capture, torch.compile, and the SASS
(BMMA / BGMMA AND.POPC, no XOR-popc, no IMMA).  Skipped without a CUDA GPU (tests/conftest.py)."""

import itertools
import shutil
import subprocess

import pytest
import torch

import tcprec as tp
from tcprec.formats import IntFormat
from tcprec.kernels.cuda import bmma_gemm as bg
from tcprec.kernels.cuda import runtime as cuda_rt
from tcprec.ops.matmul import explain_matmul, matmul, matmul_packed
from tcprec.qtensor import PerChannel, PerTensor, QTensor

DEV = "cuda"
ENCODINGS = ("twos", "unsigned", "pm1")
MS, KS, NS = (1, 7, 64, 129), (1, 127, 128, 1000, 4096), (1, 8, 255, 1024)
ALL_SHAPES = list(itertools.product(MS, KS, NS))  # 80 shapes
PAIRS = [(p, q) for p in range(1, 9) for q in range(1, 9)]
BIG_SHAPE = (300, 1000, 600)  # (M, K, N): partial tiles in M, N and K with each pair's large tile


def _fmt(bits, enc):
    return IntFormat(bits, encoding=enc)


def _qt(shape, fmt, gen, granularity=None, scale=None):
    codes = torch.randint(0, fmt.n_codes, shape, dtype=torch.uint8, device=DEV, generator=gen)
    g = granularity or PerTensor()
    if scale is None:
        scale = torch.ones(g.scale_shape(shape), device=DEV)
    return QTensor(codes, scale, fmt, g, shape, torch.float32)


def _exact(qa, qw):
    va = tp.decode(qa.codes, qa.fmt).double()  # (..., K) exact values
    vw = tp.decode(qw.codes, qw.fmt).double()
    return (va @ vw.t()).to(torch.int64)  # exact: |C| < 2^31 << 2^53


def _big_tile(p, q, at, wt):
    """The large tile this GPU runs (wgmma on sm_90a where the pair has one)."""
    return bg.pick_tile(p, q, at, wt, 10**6, 10**6)


def _sync_tile(p, q, at, wt):
    """The large mma.sync tile (what GPUs without wgmma run; sm_90a's fallback)."""
    return bg.pick_tile(p, q, at, wt, 10**6, 10**6, arch="sm_80")


WG_TILE = "128x128_w8x1_s4_k1024_wg"  # the cp.async wgmma kernel (no longer a default)
TMA_TILE = "128x128_w8x1_s3_k1024_wg_tma"  # the persistent TMA kernel (the sm_90a defaults)
HAS_WGMMA = cuda_rt.arch_of(torch.cuda.get_device_capability(0)) == "sm_90a" if torch.cuda.is_available() else False


def _case_shapes(idx):
    """Four shapes for combo number idx, cycling through all 80 so every M, K, N value is covered."""
    return [ALL_SHAPES[(4 * idx + s) % len(ALL_SHAPES)] for s in range(4)]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """Compile every variant this module launches, in parallel, before the first test."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    arch = cuda_rt.arch_of(torch.cuda.get_device_capability(0))
    vs = set()
    for (p, q), enc in itertools.product(PAIRS, ENCODINGS):
        t = enc == "twos"
        vs.add(bg.Variant(p, q, t, t, bg.SMALL_TILE, "int32"))
        vs.add(bg.Variant(p, q, t, t, _big_tile(p, q, t, t), "int32"))
        if p * q < 8 and enc != "pm1":
            vs.add(bg.Variant(p, q, t, t, _sync_tile(p, q, t, t), "int32"))
    # epilogue, packed-output and SASS tests
    for od in ("float32", "float16", "bfloat16"):
        for tile in (bg.pick_tile(2, 1, True, False, 300, 600, sms), _big_tile(2, 1, True, False),
                     _sync_tile(2, 1, True, False)):
            vs.add(bg.Variant(2, 1, True, False, tile, "float", od))
    for name in ("uint2", "int4", "binary", "pm2"):
        f = tp.format(name)
        for tile in (bg.pick_tile(2, 1, False, False, 129, 1024, sms), bg.parse_tile("64x256_w2x4_s4"),
                     bg.parse_tile("64x128_w2x4_s4"), bg.parse_tile("64x128_w2x2_s3_k1024")) + (
                         (bg.parse_tile(WG_TILE),) if HAS_WGMMA else ()):
            vs.add(bg.Variant(2, 1, False, False, bg.packed_tile(tile), "packed", out_bits=f.bits,
                                  out_encoding=f.encoding))
    for p, q, t in ((2, 1, False), (1, 1, False), (2, 2, True), (4, 1, False)):
        vs.add(bg.Variant(p, q, t, t, _big_tile(p, q, t, t), "float", "float16"))
        vs.add(bg.Variant(p, q, t, t, _sync_tile(p, q, t, t), "float", "float16"))
    bg.precompile(vs, arch)


@pytest.mark.parametrize("enc", ENCODINGS)
@pytest.mark.parametrize("p,q", PAIRS)
def test_exact_every_pair_and_encoding(p, q, enc):
    gen = torch.Generator(DEV).manual_seed(100 * p + 10 * q + ENCODINGS.index(enc))
    fa, fw = _fmt(p, enc), _fmt(q, enc)
    idx = (PAIRS.index((p, q)) * 3 + ENCODINGS.index(enc))
    for M, K, N in _case_shapes(idx):
        qa, qw = _qt((M, K), fa, gen), _qt((N, K), fw, gen)
        got = matmul(qa, qw, out_dtype=torch.int32, backend="bitserial")
        assert torch.equal(got.long(), _exact(qa, qw)), (p, q, enc, M, K, N)
    # the pair's large tile, partial in every dimension
    M, K, N = BIG_SHAPE
    qa, qw = _qt((M, K), fa, gen), _qt((N, K), fw, gen)
    t = enc == "twos"
    want = _exact(qa, qw)
    got = matmul(qa, qw, out_dtype=torch.int32, backend="bitserial", tile=str(_big_tile(p, q, t, t)))
    assert torch.equal(got.long(), want), (p, q, enc, "big tile", str(_big_tile(p, q, t, t)))
    if p * q < 8 and enc != "pm1":
        got = matmul(qa, qw, out_dtype=torch.int32, backend="bitserial", tile=str(_sync_tile(p, q, t, t)))
        assert torch.equal(got.long(), want), (p, q, enc, "mma.sync big tile")


@pytest.mark.parametrize("M,K,N", ALL_SHAPES)
def test_every_shape_w1a2_mixed_encodings(M, K, N):
    """All 80 shapes for w1a2 with binary (+-1) weights and int2 / uint2 activations."""
    gen = torch.Generator(DEV).manual_seed(M * 7 + K * 3 + N)
    qw = _qt((N, K), _fmt(1, "pm1"), gen)
    for enc in ("twos", "unsigned"):
        qa = _qt((M, K), _fmt(2, enc), gen)
        got = matmul(qa, qw, out_dtype=torch.int32, backend="bitserial")
        assert torch.equal(got.long(), _exact(qa, qw)), (enc, M, K, N)


def test_leading_batch_dims_and_mixed_encodings():
    gen = torch.Generator(DEV).manual_seed(1)
    for ea, ew in itertools.product(ENCODINGS, ENCODINGS):
        qa = _qt((2, 3, 77), _fmt(2, ea), gen)
        qw = _qt((40, 77), _fmt(3, ew), gen)
        got = matmul(qa, qw, out_dtype=torch.int32, backend="bitserial")
        assert got.shape == (2, 3, 40)
        assert torch.equal(got.long(), _exact(qa, qw)), (ea, ew)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("relu", [False, True])
def test_float_epilogue_matches_reference_bitwise(out_dtype, relu):
    gen = torch.Generator(DEV).manual_seed(7)
    M, K, N = 300, 1000, 600
    qa = _qt((M, K), _fmt(2, "twos"), gen, PerChannel(0), torch.rand(M, 1, device=DEV, generator=gen) + 0.1)
    qw = _qt((N, K), _fmt(1, "pm1"), gen, PerChannel(0), torch.rand(N, 1, device=DEV, generator=gen) + 0.1)
    bias = torch.randn(N, device=DEV, generator=gen)
    want = matmul(qa, qw, out_dtype=out_dtype, bias=bias, relu=relu, backend="reference")
    for tile in ("", str(_big_tile(2, 1, True, False)), str(_sync_tile(2, 1, True, False))):
        got = matmul(qa, qw, out_dtype=out_dtype, bias=bias, relu=relu, backend="bitserial", tile=tile)
        assert got.dtype == out_dtype
        assert torch.equal(got, want), tile
    # and against the float math it stands for, to the rounding of the scales
    deq = qa.dequantize().double() @ qw.dequantize().double().t() + bias.double()
    if relu:
        deq = deq.clamp_min(0)
    torch.testing.assert_close(got.double(), deq.to(out_dtype).double(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_leaky_relu_epilogue_matches_torch(out_dtype):
    """relu=True with leaky_slope: y < 0 -> slope * y (one fp32 multiply, as F.leaky_relu), then the cast."""
    from tcprec.ops.matmul import _bitserial, _col_scale, _row_scale

    gen = torch.Generator(DEV).manual_seed(8)
    M, K, N = 300, 1000, 600
    qa = _qt((M, K), _fmt(2, "twos"), gen, PerChannel(0), torch.rand(M, 1, device=DEV, generator=gen) + 0.1)
    qw = _qt((N, K), _fmt(1, "pm1"), gen, PerChannel(0), torch.rand(N, 1, device=DEV, generator=gen) + 0.1)
    bias = torch.randn(N, device=DEV, generator=gen)
    y32 = matmul(qa, qw, out_dtype=torch.float32, bias=bias, backend="reference")
    assert (y32 < 0).any() and (y32 > 0).any()
    want = torch.nn.functional.leaky_relu(y32, 0.1).to(out_dtype)
    for tile in ("", str(_big_tile(2, 1, True, False)), str(_sync_tile(2, 1, True, False))):
        got = _bitserial(qa, qw, M, K, N, qa.fmt, qw.fmt, out_kind={torch.float32: "float32", torch.float16: "float16"}[out_dtype],
                         row_scale=_row_scale(qa, M), col_scale=_col_scale(qw, N), bias=bias, relu=True,
                         tile=tile, leaky_slope=0.1)
        assert torch.equal(got, want), tile
    with pytest.raises(ValueError, match="leaky_slope"):
        _bitserial(qa, qw, M, K, N, qa.fmt, qw.fmt, out_kind="float32", relu=False, leaky_slope=0.1)


@pytest.mark.parametrize("out_name", ["uint2", "int4", "binary", "pm2"])
def test_packed_epilogue_bit_exact(out_name):
    gen = torch.Generator(DEV).manual_seed(11)
    M, K, N = 129, 1000, 1024
    qa = _qt((M, K), _fmt(2, "unsigned"), gen)
    qw = _qt((N, K), _fmt(1, "pm1"), gen, PerChannel(0), torch.rand(N, 1, device=DEV, generator=gen) * 0.1)
    bias = torch.randn(N, device=DEV, generator=gen)
    scale = 0.37
    want = matmul_packed(qa, qw, out_name, scale, bias=bias, relu=out_name == "uint2", backend="reference")
    for tile in ("", "64x256_w2x4_s4", "64x128_w2x4_s4", "64x128_w2x2_s3_k1024") + (
            (WG_TILE, TMA_TILE, "128x128_w8x1_s3_k1024_wg_tma_c2x2") if HAS_WGMMA else ()):
        got = matmul_packed(qa, qw, out_name, scale, bias=bias, relu=out_name == "uint2", backend="bitserial",
                            tile=tile)
        assert got.shape == want.shape
        assert torch.equal(got, want), (out_name, tile)


@pytest.mark.parametrize("bits,enc", [(1, "pm1"), (2, "unsigned"), (3, "twos"), (4, "pm1"), (5, "unsigned"),
                                      (8, "twos")])
def test_packed_epilogue_ties_saturation_and_padding(bits, enc):
    """The packed epilogue counts per-block thresholds of y instead of dividing y by the scale: outputs on
    and a few ulps either side of the rounding ties of y / out_scale, far past the format's range and +-inf
    equal the reference bit for bit; the kernel writes every word of the padded rows (the
    output is not zeroed first: stale allocator memory must not show through)."""
    gen = torch.Generator(DEV).manual_seed(31 + bits)
    M, K, N = 300, 96, 160  # partial tiles in M and N; ldo = 16 words, 11 of them padding
    out_fmt, s = _fmt(bits, enc), 0.37
    half = torch.tensor(s / 2, dtype=torch.float32)
    ulps = torch.arange(-3, 4, dtype=torch.int32)  # y / s lands on, and next to, the half-integers
    cs = (half.view(torch.int32) + ulps).view(torch.float32).repeat(N // 7 + 1)[:N].clone()
    cs[5], cs[6], cs[7] = 3e38, 1e-30, 4.0 * s  # +-inf products, ~0, saturation
    qa = _qt((M, K), _fmt(2, "unsigned"), gen)
    qw = _qt((N, K), _fmt(1, "pm1"), gen, PerChannel(0), cs.to(DEV).reshape(N, 1))
    bias = torch.zeros(N, device=DEV)
    bias[6], bias[7] = float("inf"), -1.5 * s
    for relu in (False, True):
        want = matmul_packed(qa, qw, out_fmt, s, bias=bias, relu=relu, backend="reference")
        for tile in ("", "64x128_w2x4_s4", "32x32_w2x1_s2_k1024") + ((TMA_TILE,) if HAS_WGMMA else ()):
            junk = torch.full(want.shape, -1, dtype=torch.int32, device=DEV)  # the next empty() reuses it
            del junk
            got = matmul_packed(qa, qw, out_fmt, s, bias=bias, relu=relu, backend="bitserial", tile=tile)
            assert torch.equal(got, want), (bits, enc, relu, tile, (got != want).nonzero()[:5].tolist())


@pytest.mark.parametrize("N", [64, 128, 200, 544])
def test_packed_padding_words_zeroed(N):
    """The packed epilogue zeroes the padding words of its rows (ldo a multiple of 16 words) four lanes a row, a head
    of words up to the 16-byte boundary and whole 16-byte chunks after it: N = 64 (2 data words, 14 padding), 128 (no
    head), 200 (a head of 1 word), 544 (15 padding words) -- over stale allocator memory, every word as the reference."""
    gen = torch.Generator(DEV).manual_seed(N)
    M, K = 777, 160
    qa = _qt((M, K), _fmt(2, "unsigned"), gen)
    qw = _qt((N, K), _fmt(1, "pm1"), gen, PerChannel(0), torch.rand(N, 1, device=DEV, generator=gen) + 0.5)
    out_fmt = _fmt(2, "unsigned")
    want = matmul_packed(qa, qw, out_fmt, 0.6, relu=True, backend="reference")
    for tile in ("", "32x32_w2x1_s2_k1024") + ((TMA_TILE,) if HAS_WGMMA else ()):
        junk = torch.full(want.shape, -1, dtype=torch.int32, device=DEV)  # the next empty() reuses it
        del junk
        got = matmul_packed(qa, qw, out_fmt, 0.6, relu=True, backend="bitserial", tile=tile)
        assert torch.equal(got, want), (N, tile, (got != want).nonzero()[:5].tolist())


def _edge_columns(N, gen):
    """Column scales and biases that test the integer-threshold epilogue's conditions: ordinary positive and
    negative scales (a non-increasing column), +-0, tiny and huge scales, +-inf and NaN scales and biases."""
    cs = (torch.rand(N, device=DEV, generator=gen) + 0.05) * 0.2
    cs[1::3] = -cs[1::3]
    bias = torch.randn(N, device=DEV, generator=gen)
    edge = [(0.0, 0.3), (-0.0, -0.2), (1e-30, 0.0), (-1e-30, 1.0), (3e38, 0.0), (-3e38, 0.5), (float("inf"), 0.0),
            (float("-inf"), 0.0), (float("nan"), 0.0), (0.1, float("inf")), (0.1, float("-inf")), (-0.1, float("nan")),
            (2e-9, -1e3)]
    for i, (c, b) in enumerate(edge):
        cs[7 * i + 3], bias[7 * i + 3] = c, b
    return cs, bias


@pytest.mark.parametrize("bits,enc", [(1, "pm1"), (1, "unsigned"), (2, "unsigned"), (2, "twos"), (2, "pm1"),
                                      (3, "twos"), (3, "unsigned"), (4, "unsigned")])
def test_packed_epilogue_integer_thresholds_exact(bits, enc, monkeypatch):
    """The packed epilogue without a row scale (what convolutions run) compares the int32 value with per-column
    integer thresholds (bmma_code_thresholds) where y is monotone in it, and takes the float path for a warp's
    word that holds a column that is not: it equals the float reference bit for bit, with int32 values near both
    ends of the range (row / column terms that wrap), every edge scale and bias, ReLU, LeakyReLU and a negative
    slope, partial tiles and tiles inside M x N, on the TMA, cp.async wgmma and mma.sync kernels; and so does the float
    path that small problems take (bg.INT_THRESHOLD_TILES_PER_SM: forced both ways here)."""
    from tcprec.kernels import reference_gemm as rg
    from tcprec.packing import pack_bitplanes

    gen = torch.Generator(DEV).manual_seed(97 + bits)
    M, K, N = 300, 96, 288  # the edge columns lie in the first 128: 128 x 128 tiles of rows 0..255, columns 128..255
    # are inside M x N with every column on the integer path (the epilogue's one-vote-a-tile fast path)
    fa, fw, out_fmt = _fmt(2, "unsigned"), _fmt(1, "pm1"), _fmt(bits, enc)
    qa, qw = _qt((M, K), fa, gen), _qt((N, K), fw, gen)
    a_planes = pack_bitplanes(qa.codes, 2, backend="reference")
    w_planes = pack_bitplanes(qw.codes, 1, backend="reference")
    big = 2**31 - 200
    row_term = torch.randint(-300, 300, (M,), dtype=torch.int32, device=DEV, generator=gen)
    row_term[::5] += big  # C near INT32_MAX and, past it, wrapped to near INT32_MIN
    row_term[1::5] -= big
    col_term = torch.randint(-50, 50, (N,), dtype=torch.int32, device=DEV, generator=gen)
    cs, bias = _edge_columns(N, gen)
    s = torch.tensor([0.37], device=DEV)
    S = torch.ops.tcprec.bmma_gemm(a_planes, w_planes, False, False, 1, None, None, None, None, None, False, "int32",
                                   1, "unsigned", None, "", 0.0).long()
    C = ((3 * S + row_term.long()[:, None] + col_term.long()[None, :] + 2**31) % 2**32 - 2**31).to(torch.int32)
    tiles = ("", "64x128_w2x4_s4", "32x32_w2x1_s2_k1024") + ((WG_TILE, TMA_TILE) if HAS_WGMMA else ())
    for relu, slope in ((False, 0.0), (True, 0.0), (True, 0.1), (True, -0.25)):
        y = rg.float_epilogue(C, None, cs, bias, False, torch.float32)
        if relu:
            y = torch.where(y < 0, y * slope if slope != 0.0 else torch.zeros_like(y), y)
        y = torch.where(torch.isnan(y), float("-inf"), y)  # NaN takes index 0, as -inf does (bmma_gemm.cu)
        want = rg.pack_output(y, out_fmt, s)
        for tile, per_sm in [(t, 0) for t in tiles] + [("", 10**9)]:
            monkeypatch.setattr(bg, "INT_THRESHOLD_TILES_PER_SM", per_sm)
            got = torch.ops.tcprec.bmma_gemm(a_planes, w_planes, False, False, 3, row_term, col_term, None, cs, bias,
                                             relu, "packed", bits, enc, s, tile, slope)
            assert torch.equal(got, want), (bits, enc, relu, slope, tile, per_sm, (got != want).nonzero()[:5].tolist())


def test_code_threshold_words_mark_only_non_monotone_columns():
    """bmma_code_thresholds: an ordinary column gets f = 0 (scale > 0) or -1 (scale < 0, ~C reverses the order)
    and thresholds whose count is the float path's code at sampled int32 values; a column with a zero, inf or
    NaN scale, an infinite bias, or under a negative LeakyReLU slope is marked (word 0 = 1)."""
    from tcprec.kernels import reference_gemm as rg

    gen = torch.Generator(DEV).manual_seed(5)
    N = 160
    cs, bias = _edge_columns(N, gen)
    s = torch.tensor([0.37], device=DEV)
    v = bg.Variant(2, 1, tile=bg.Tile(64, 128, 2, 4, 4), epilogue="packed", out_bits=2,
                       out_encoding="unsigned")
    thr = bg.code_thresholds(v, cs, bias, s, True, 0.0, N)
    f = thr[:, 0]
    bad = ~torch.isfinite(cs) | ~torch.isfinite(bias) | (cs == 0)
    assert bool((f[bad] == 1).all()), f[bad]
    edge = torch.zeros(N, dtype=torch.bool, device=DEV)
    edge[3:7 * 13:7] = True
    assert bool((f[~edge] != 1).all())  # every ordinary column takes the integer path
    use = f != 1
    plain = ~edge  # (an edge column may be constant: f = 0 whatever the sign)
    assert torch.equal(f[plain], torch.where(cs[plain] > 0, 0, -1).to(torch.int32)), (f[plain], cs[plain])
    Cs = torch.cat([torch.tensor([-2**31, -2**31 + 1, -1, 0, 1, 2**31 - 2, 2**31 - 1]),
                    torch.randint(-2**31, 2**31 - 1, (2000,)), torch.randint(-200, 200, (2000,))]).to(torch.int32)
    Cs = Cs.to(DEV)
    y = rg.float_epilogue(Cs[:, None].expand(-1, N), None, cs, bias, True, torch.float32)
    want = torch.clamp(torch.round(y / s), 0, 3)  # uint2 code; round half to even as encode does
    got = ((Cs[:, None] ^ f[None, :])[:, :, None] >= thr[None, :, 1:]).sum(-1)
    assert torch.equal(got[:, use].float(), want[:, use]), (got[:, use] != want[:, use]).nonzero()[:5]
    neg = bg.code_thresholds(v, cs, bias, s, True, -0.25, N)
    assert bool((neg[:, 0] == 1).all())


def test_cuda_graph_capture_replays_exactly():
    gen = torch.Generator(DEV).manual_seed(3)
    qa, qw = _qt((64, 1024), _fmt(2, "unsigned"), gen), _qt((1024, 1024), _fmt(1, "pm1"), gen)
    want = _exact(qa, qw)
    matmul(qa, qw, out_dtype=torch.int32, backend="bitserial")  # compile + load outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        matmul(qa, qw, out_dtype=torch.int32, backend="bitserial")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = matmul(qa, qw, out_dtype=torch.int32, backend="bitserial")
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.long(), want)


@pytest.mark.skipif(not HAS_WGMMA, reason="the TMA wgmma kernel needs sm_90a")
@pytest.mark.parametrize("tile", ["128x128_w8x1_s4_k1024_wg_tma_c2x1", "128x128_w8x1_s4_k1024_wg_tma_c1x2",
                                  "128x64_w8x1_s4_k1024_wg_tma_c2x2", "128x128_w8x1_s4_k1024_wg_f_tma"])
def test_tma_cluster_and_folded_tiles_exact(tile):
    """Clusters multicast a shared tile to 2-4 blocks and overhang the grid (partner blocks past M or N load
    zeros and store nothing); every shape is partial in M, N and K, K from one word to several tiles."""
    gen = torch.Generator(DEV).manual_seed(21)
    for (M, K, N), (ea, ew) in zip([(300, 1000, 600), (129, 4096, 255), (1, 1, 8), (1000, 3000, 2000), (64, 127, 1)],
                                   [("unsigned", "unsigned"), ("unsigned", "pm1"), ("twos", "unsigned"),
                                    ("unsigned", "unsigned"), ("pm1", "unsigned")]):
        if tile.split("_")[-2:] == ["f", "tma"] and "unsigned" != ea:
            ea = "unsigned"  # a folded tile needs positive plane weights: unsigned activations
        qa, qw = _qt((M, K), _fmt(2, ea), gen), _qt((N, K), _fmt(1, ew), gen)
        got = matmul(qa, qw, out_dtype=torch.int32, backend="bitserial", tile=tile)
        assert torch.equal(got.long(), _exact(qa, qw)), (tile, M, K, N, ea, ew)
    bias = torch.randn(600, device=DEV, generator=gen)
    qa, qw = _qt((300, 1000), _fmt(2, "unsigned"), gen), _qt((600, 1000), _fmt(1, "pm1"), gen)
    want = matmul(qa, qw, out_dtype=torch.float16, bias=bias, relu=True, backend="reference")
    got = matmul(qa, qw, out_dtype=torch.float16, bias=bias, relu=True, backend="bitserial", tile=tile)
    assert torch.equal(got, want), tile


@pytest.mark.skipif(not HAS_WGMMA, reason="the TMA wgmma kernel needs sm_90a")
def test_tma_default_tile_in_cuda_graph_reads_new_data():
    """The default sm_90a tile at 2048 x 2048 (the persistent TMA kernel, tensor maps memoised by address)
    captured in a CUDA graph: replays read what the captured buffers hold now."""
    gen = torch.Generator(DEV).manual_seed(22)
    # unsigned codes: no row / column correction terms, which would belong to the old data
    qa, qw = _qt((2048, 4096), _fmt(2, "unsigned"), gen), _qt((2048, 4096), _fmt(1, "unsigned"), gen)
    assert bg.pick_tile(2, 1, False, False, 2048, 2048).tma
    ap, wp = tp.pack_bitplanes(qa.codes, 2), tp.pack_bitplanes(qw.codes, 1)
    from tcprec.kernels import reference_gemm as rg

    ss, rt, ct = rg.corrections(ap, wp, 4096, qa.fmt, qw.fmt)
    assert rt is None and ct is None

    def f():
        return torch.ops.tcprec.bmma_gemm(ap, wp, False, False, ss, rt, ct, None, None, None, False, "int32", 1,
                                          "unsigned", None, "")

    f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f()
    qa2 = _qt((2048, 4096), _fmt(2, "unsigned"), gen)
    ap.copy_(tp.pack_bitplanes(qa2.codes, 2))
    out.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.long(), _exact(qa2, qw))


@pytest.mark.parametrize("M,K,N1,N2", [(64, 256, 128, 96), (3000, 1024, 512, 200), (20000, 2048, 512, 256)])
def test_chained_gemms_in_a_cuda_graph_with_programmatic_dependent_launch(M, K, N1, N2):
    """bmma_gemm launches with programmatic stream serialization on sm_90+: a kernel may start while the previous
    one runs.  A chain x -> GEMM (packed uint2 planes) -> GEMM (int32), four times in one CUDA graph with new inputs
    copied in by torch between the links, so that each GEMM reads what the kernel before it wrote (RAW) and the
    graph's allocator hands a freed output back to the next link while its last reader was the kernel before
    (WAR): the replay must equal the same chain run eagerly, a link at a time, and the integer reference."""
    from tcprec.packing import packed_words

    gen = torch.Generator(DEV).manual_seed(23)
    words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, device=DEV, generator=gen)  # noqa: E731
    kw1, kw2 = packed_words(K), packed_words(N1)
    w1 = words(1, N1, kw1)
    w1[..., K // 32:] = 0  # K is a multiple of 32: the padding words are zero
    w2 = words(1, N2, kw2)
    w2[..., N1 // 32:] = 0
    cs, bias, osc = torch.rand(N1, device=DEV, generator=gen) + 0.5, torch.randn(N1, device=DEV, generator=gen), \
        torch.tensor([64.0], device=DEV)
    srcs = [words(2, M, kw1) for _ in range(4)]
    for x in srcs:
        x[..., K // 32:] = 0
    G = torch.ops.tcprec.bmma_gemm

    def link(a):
        h = G(a, w1, False, False, 1, None, None, None, cs, bias, True, "packed", 2, "unsigned", osc, "", 0.0)
        return G(h, w2, False, False, 1, None, None, None, None, None, False, "int32", 1, "unsigned", None, "", 0.0)

    def chain(buf):
        outs = []
        for x in srcs:
            buf.copy_(x)
            outs.append(link(buf))
        return outs

    want = [link(x.clone()) for x in srcs]  # eager, one call at a time
    assert not torch.cuda.get_device_capability(0) >= (9, 0) or cuda_rt._pdl_options(0, True)
    buf = torch.empty_like(srcs[0])
    chain(buf)  # compile + load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = chain(buf)
    for _ in range(3):
        for o in outs:
            o.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        for i, (o, w) in enumerate(zip(outs, want)):
            assert torch.equal(o, w), (i, (o != w).sum().item())
    # the second link against the integer reference: its A planes are the first link's packed codes
    from tcprec.kernels import reference_gemm as rg

    h = G(srcs[0], w1, False, False, 1, None, None, None, cs, bias, True, "packed", 2, "unsigned", osc, "", 0.0)
    ref = rg.bitserial_matmul(h, w2, N1, IntFormat(2, encoding="unsigned"), IntFormat(1, encoding="unsigned"))
    assert torch.equal(want[0].long(), ref.long())


def test_torch_compile_sees_the_custom_op():
    gen = torch.Generator(DEV).manual_seed(4)
    qa, qw = _qt((64, 512), _fmt(2, "unsigned"), gen), _qt((256, 512), _fmt(1, "pm1"), gen)
    ap, wp = tp.pack_bitplanes(qa.codes, 2), tp.pack_bitplanes(qw.codes, 1)
    ss, rt, ct = 2, None, None
    from tcprec.kernels import reference_gemm as rg

    ss, rt, ct = rg.corrections(ap, wp, 512, qa.fmt, qw.fmt)
    rt = None if rt is None else rt.int()
    ct = None if ct is None else ct.int()

    def f(ap):
        return torch.ops.tcprec.bmma_gemm(ap, wp, False, False, ss, rt, ct, None, None, None, False, "int32", 1,
                                          "unsigned", None, "") + 1

    got = torch.compile(f, fullgraph=True)(ap)
    assert torch.equal(got.long() - 1, _exact(qa, qw))


def test_auto_backend_choice_and_explanation():
    gen = torch.Generator(DEV).manual_seed(5)
    qa, qw = _qt((64, 256), _fmt(2, "unsigned"), gen), _qt((128, 256), _fmt(1, "pm1"), gen)
    assert explain_matmul(qa, qw).startswith("bitserial:")
    qa4, qw2 = _qt((64, 256), _fmt(4, "twos"), gen), _qt((128, 256), _fmt(2, "twos"), gen)
    assert explain_matmul(qa4, qw2).startswith("int8:")
    assert torch.equal(matmul(qa4, qw2, out_dtype=torch.int32).long(), _exact(qa4, qw2))
    qa8, qw8 = _qt((5, 300), _fmt(8, "unsigned"), gen), _qt((9, 300), _fmt(8, "pm1"), gen)
    assert torch.equal(matmul(qa8, qw8, out_dtype=torch.int32).long(), _exact(qa8, qw8))


def _sass(variant) -> str:
    tool = shutil.which("cuobjdump")
    if tool is None:
        pytest.skip("cuobjdump not found (it ships with the CUDA toolkit)")
    cubin, _ = bg.compile_variant(variant, cuda_rt.arch_of(torch.cuda.get_device_capability(0)))
    path = bg.cubin_path(variant, cuda_rt.arch_of(torch.cuda.get_device_capability(0)))
    assert path.exists()
    return subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("p,q,twos", [(2, 1, False), (1, 1, False), (2, 2, True), (4, 1, False)])
def test_sass_wgmma_is_bgmma_and_popc_only(p, q, twos):
    """The wgmma tile's SASS: BGMMA.64xNx256.AND.POPC (binary warpgroup MMA), nothing else."""
    t = _big_tile(p, q, twos, twos)
    if t.mma != "wgmma":
        pytest.skip(f"this GPU runs mma.sync tiles ({cuda_rt.arch_of(torch.cuda.get_device_capability(0))})")
    sass = _sass(bg.Variant(p, q, twos, twos, t, "float", "float16"))
    gmma = [ln for ln in sass.splitlines() if "GMMA" in ln]
    assert gmma and all("BGMMA" in ln and "AND.POPC" in ln for ln in gmma), gmma[:3]
    assert not any("XOR" in ln for ln in gmma), "XOR+popc is emulated on Hopper"
    assert "IMMA" not in sass and "BMMA" not in sass.replace("BGMMA", ""), "no mma.sync / INT MMA in the wgmma kernel"
    assert all(f"x{t.bn // t.warps_n}x256" in ln for ln in gmma), gmma[:3]
    if t.tma:  # the operands come in by the bulk tensor copy engine, not cp.async
        assert "UTMALDG" in sass and "LDGSTS" not in sass
    # p*q warpgroup MMAs per 256-bit k-step, four k-steps per 1024-bit stage
    assert len(gmma) >= p * q * 4


@pytest.mark.parametrize("p,q,twos", [(2, 1, False), (1, 1, False), (2, 2, True), (4, 1, False)])
def test_sass_is_bmma_and_popc_only(p, q, twos):
    v = bg.Variant(p, q, twos, twos, _sync_tile(p, q, twos, twos), "float", "float16")
    sass = _sass(v)
    bmma = [ln for ln in sass.splitlines() if "BMMA" in ln]
    assert bmma, "no BMMA instruction: the binary tensor cores are not used"
    assert all("AND.POPC" in ln for ln in bmma), [ln for ln in bmma if "AND.POPC" not in ln][:3]
    assert not any("XOR" in ln for ln in bmma), "XOR+popc is emulated on Hopper"
    assert "IMMA" not in sass, "INT MMA (emulated INT4 on Hopper) must not appear"
    # p*q binary MMAs per (MT x NT) warp tile per 256-bit k-step, twice per 512-bit step
    assert len(bmma) >= p * q * 2


def test_cached_tensor_maps_keep_no_tensor_alive():
    """The TMA descriptors are memoised by address; the cache must not hold the tensors (a DLPack view did: every
    eager GEMM's A operand stayed allocated, ~10 GB a forward of a w1a2 VGG at batch 256)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for i in range(4):
        x = torch.full((2, 1 << 18, 32), i, dtype=torch.int32, device="cuda")  # 64 MiB each
        bg.tensor_map(x, 128)
        del x
    assert torch.cuda.memory_allocated() - base < (1 << 20)
