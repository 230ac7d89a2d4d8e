"""The bit-serial GEMM's residual add (``bmma_gemm(..., residual=)``, bmma_gemm.cu TCP_RES): the float epilogue's
``act(rd(rd(y0) + residual))`` equals its torch statement (``reference_conv_bitserial.bmma_gemm_reference``) bit for bit --
every tile family (TMA 64 / 128 wide, cp.async wgmma, mma.sync, the small tile), fp16 / bf16 / fp32 output, ReLU,
LeakyReLU and none, tiles cut by M and N (the checked path beside the 16-byte one), plain GEMMs and the implicit
convolution.  Skipped without a CUDA GPU."""

import pytest
import torch

from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.kernels.cuda import bmma_gemm as L
from tcprec.packing import pack_bitplanes

from bmma_cases import gemm_args  # tests/gpu/bmma_cases.py

DEV = "cuda"
TILES = ["", "128x64_w8x1_s5_k1024_wg_tma", "128x128_w8x1_s4_k1024_wg_tma", "128x128_w8x1_s4_k1024_wg",
         "64x64_w2x2_s3_k1024", "32x32_w2x2_s2_k1024"]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _args(M, N, Kbits, out_kind, relu, seed):
    return gemm_args(M, N, Kbits, out_kind, seed, relu=relu)


def _residual(M, N, out_kind, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed + 100)
    return (torch.randn(M, N, device=DEV, generator=gen) * 3).to(DTYPES[out_kind])


@pytest.mark.parametrize("tile", TILES, ids=[t or "default" for t in TILES])
@pytest.mark.parametrize("out_kind", list(DTYPES))
@pytest.mark.parametrize("act", ["none", "relu", "leaky"])
def test_gemm_residual_equals_reference(tile, out_kind, act):
    for seed, (M, N, Kbits) in enumerate([(1000, 64, 576), (777, 200, 1100), (4096, 128, 2304)]):
        args = list(_args(M, N, Kbits, out_kind, act != "none", seed))
        slope = 0.1 if act == "leaky" else 0.0
        r = _residual(M, N, out_kind, seed)
        got = L._bmma_gemm(*args, tile, slope, residual=r)
        want = rq.bmma_gemm_reference(*args, tile, slope, residual=r)
        assert got.dtype == DTYPES[out_kind] and torch.equal(got, want), (tile, out_kind, act, M, N)
        # and it is the unfused add: the branch in the output dtype, the sum rounded, then the activation
        args[10] = False
        y = rq.bmma_gemm_reference(*args, tile, 0.0).float()
        s = (y + r.float()).to(r.dtype).float()
        s = torch.where(s < 0, s * slope, s) if act != "none" else s
        assert torch.equal(got, s.to(r.dtype))


@pytest.mark.parametrize("tile", ["", "128x128_w8x1_s4_k1024_wg_tma", "64x64_w2x2_s3_k1024"])
def test_implicit_conv_residual_equals_reference(tile):
    (N, H, W, C), K = (2, 14, 14, 256), 128
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randint(0, 4, (N * H * W, C), device=DEV, generator=gen, dtype=torch.int32)
    w = torch.randint(0, 2, (K, 3, 3, C), device=DEV, generator=gen, dtype=torch.int32)
    a = pack_bitplanes(x, 2, validate=False)
    cwt = rq.conv_tap_words(C)
    wp = rq.pack_weight_planes(w, 1, tap_words=cwt)
    conv = [H, W, H, W, 3, 3, 1, 1, 1, 1, 1, 1, cwt]
    M = N * H * W
    args = (a, wp, False, False, 2, None, None, None, torch.rand(K, device=DEV, generator=gen) * 0.01,
            torch.randn(K, device=DEV, generator=gen), True, "float16", 1, "unsigned", None, tile)
    r = _residual(M, K, "float16", 3)
    got = L._bmma_gemm(*args, conv=conv, residual=r)
    assert torch.equal(got, rq.bmma_gemm_reference(*args, conv=conv, residual=r))


def test_residual_views_and_bad_input():
    args = _args(300, 64, 512, "float16", True, 0)
    r = _residual(300, 128, "float16", 0)[:, 32:96]  # a strided view: copied once, same result
    assert torch.equal(L._bmma_gemm(*args, "", residual=r), rq.bmma_gemm_reference(*args, "", residual=r))
    with pytest.raises(ValueError, match=r"residual must be a torch.float16 tensor of the output's shape \(300, 64\)"):
        L._bmma_gemm(*args, "", residual=r.float())
    with pytest.raises(ValueError, match=r"residual must be a torch.float16 tensor of the output's shape"):
        L._bmma_gemm(*args, "", residual=r[:10])
    packed = list(args)
    packed[11], packed[14] = "packed", torch.tensor([0.5], device=DEV)
    with pytest.raises(ValueError, match="out_kind must be float32, float16 or bfloat16, got 'packed'"):
        L._bmma_gemm(*packed, "", residual=r)
    with pytest.raises(ValueError, match="residual is on cpu but the operands are on cuda"):
        L._bmma_gemm(*args, "", residual=r.cpu())


# -- the dual output: the 16-bit float and its bit planes from one epilogue (bmma_gemm.cu TCP_DUAL) ---------------

DUAL_TILES = ["", "128x64_w8x1_s5_k1024_wg_tma", "128x128_w8x1_s4_k1024_wg_tma", "64x64_w2x2_s3_k1024",
              "32x32_w2x1_s2_k1024"]


@pytest.mark.parametrize("tile", DUAL_TILES, ids=[t or "default" for t in DUAL_TILES])
@pytest.mark.parametrize("out_kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", [(2, "unsigned"), (1, "unsigned"), (3, "twos"), (2, "pm1")])
def test_dual_output_equals_quantize_pack_of_the_float(tile, out_kind, fmt):
    """With dual_out the epilogue also writes the planes of the stored float values (compact rows), equal to
    packing the float output with the planes' format and scale -- with and without the residual, tiles cut by M and
    N (the recomputing path) and whole ones (the 16-byte path)."""
    bits, enc = fmt
    scale = torch.tensor([0.37], device=DEV)
    for seed, (M, N, Kbits) in enumerate([(1000, 64, 576), (777, 200, 1100), (4096, 128, 2304)]):
        args = list(_args(M, N, Kbits, out_kind, True, seed))
        args[12], args[13], args[14] = bits, enc, scale
        for r in (None, _residual(M, N, out_kind, seed)):
            planes = torch.full((bits, M, -(-N // 32)), -1, dtype=torch.int32, device=DEV)  # every word written
            got = L._bmma_gemm(*args, tile, 0.0, residual=r, dual_out=planes)
            want = rq.bmma_gemm_reference(*args, tile, 0.0, residual=r)
            assert torch.equal(got, want), (tile, M, N, r is None)
            from tcprec.formats import IntFormat
            full = rq.requant_pack(want.float(), IntFormat(bits, encoding=enc), scale)
            assert torch.equal(planes, full[:, :, :planes.shape[2]]), (tile, out_kind, fmt, M, N, r is None)


def test_dual_output_bad_input():
    args = list(_args(300, 64, 512, "float16", True, 0))
    args[14] = torch.tensor([0.5], device=DEV)
    good = torch.empty((1, 300, 2), dtype=torch.int32, device=DEV)
    for bad, match in ((torch.empty((1, 300, 16), dtype=torch.int32, device=DEV), r"dual_out must be a contiguous "
                        r"int32 tensor \(out_bits, M, ceil\(N / 32\)\) = \(1, 300, 2\)"),
                       (good.float(), "dual_out must be a contiguous int32"),
                       (torch.empty((1, 2, 300), dtype=torch.int32, device=DEV).transpose(1, 2), "contiguous")):
        with pytest.raises(ValueError, match=match):
            L._bmma_gemm(*args, "", dual_out=bad)
    args32 = list(args)
    args32[11] = "float32"
    with pytest.raises(ValueError, match=r"dual_out .* needs out_kind 'float16' or 'bfloat16' and out_bits 1..3"):
        L._bmma_gemm(*args32, "", dual_out=good)
    args[14] = None
    with pytest.raises(ValueError, match=r"dual_out needs out_scale"):
        L._bmma_gemm(*args, "", dual_out=good)


def test_dual_custom_op_returns_the_planes():
    """torch.ops.tcprec.bmma_gemm_dual (what torch.compile records for a call with dual_out) returns the output and
    the planes the eager call writes into dual_out; torch.ops.tcprec.bmma_gemm takes no dual_out."""
    args = list(_args(777, 200, 1100, "float16", True, 5))
    args[12], args[13], args[14] = 2, "unsigned", torch.tensor([0.4], device=DEV)
    r = _residual(777, 200, "float16", 5)
    planes = torch.empty((2, 777, 7), dtype=torch.int32, device=DEV)
    want = L._bmma_gemm(*args, "", 0.0, residual=r, dual_out=planes)
    got, got_planes = torch.ops.tcprec.bmma_gemm_dual(*args, "", 0.0, residual=r)
    assert torch.equal(got, want) and torch.equal(got_planes, planes)
    with pytest.raises(Exception):
        torch.ops.tcprec.bmma_gemm(*args, "", 0.0, residual=r, dual_out=planes)


def _same_bits(got, want) -> bool:
    """Bit for bit (so -0 != +0), NaN where the other has NaN (whatever its payload)."""
    gn, wn = torch.isnan(got), torch.isnan(want)
    bits = torch.int16 if got.element_size() == 2 else torch.int32
    return torch.equal(gn, wn) and torch.equal(got.view(bits)[~gn], want.view(bits)[~gn])


@pytest.mark.parametrize("tile", ["", "128x64_w8x1_s5_k1024_wg_tma", "64x64_w2x2_s3_k1024"])
@pytest.mark.parametrize("out_kind", ["float16", "bfloat16"])
@pytest.mark.parametrize("act", ["none", "relu", "leaky"])
def test_residual_and_dual_special_values(tile, out_kind, act):
    """The 16-byte fp16 path adds, rectifies and codes two outputs at a time in fp16x2 (add.rn.f16x2, set.lt / set.ge
    masks against the thresholds rounded up to fp16): the same bits as the float path's roundings on the values where
    such shortcuts break -- signed zeros, subnormals, overflow to inf, inf, NaN, sums one ulp either side of a code
    threshold -- for fp16 (that path) and bf16 / LeakyReLU (the float path), and the planes of the stored values."""
    M, N, Kbits = 4096, 128, 576
    args = list(_args(M, N, Kbits, out_kind, act != "none", 7))
    gen = torch.Generator(device=DEV).manual_seed(11)
    cs = args[8].clone()
    bias = args[9].clone()
    q = N // 8
    cs[:q], bias[:q] = 0.0, -0.0  # y0 = +-0 (-0 where C < 0): the sum is the residual (the thresholds' neighbours)
    cs[q:2 * q] = 1e-9  # y0 rounds to fp16 subnormals and zeros
    cs[2 * q:3 * q] = 1e3  # |y0| overflows to inf
    cs[3 * q] = float("inf")  # inf, or NaN where C = 0
    cs[3 * q + 1] = float("nan")
    args[8], args[9] = cs, bias
    scale = 0.37
    args[12], args[13], args[14] = 2, "unsigned", torch.tensor([scale], device=DEV)
    dt = DTYPES[out_kind]
    edges = torch.tensor([scale * (i + 0.5) for i in range(3)], dtype=dt)
    ebits = edges.view(torch.int16)
    near = torch.cat([ebits - 1, ebits, ebits + 1]).view(dt)
    special = torch.tensor([0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 3 * 2.0 ** -24, 2.0 ** -15, -(2.0 ** -15), 65504.0,
                            -65504.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.0, 2.5, 1e4, -1e4, 0.25],
                           dtype=dt)
    vals = torch.cat([near, special]).to(DEV)
    r = vals[torch.randint(0, len(vals), (M, N), device=DEV, generator=gen)]
    slope = 0.1 if act == "leaky" else 0.0
    planes = torch.full((2, M, N // 32), -1, dtype=torch.int32, device=DEV)
    got = L._bmma_gemm(*args, tile, slope, residual=r, dual_out=planes)
    want = rq.bmma_gemm_reference(*args, tile, slope, residual=r)
    assert _same_bits(got, want), (tile, out_kind, act)
    assert bool(torch.isnan(want).any()) and bool((want.view(torch.int16) == -32768).any())  # the cases occurred
    from tcprec.formats import IntFormat
    full = rq.requant_pack(torch.nan_to_num(want.float(), nan=0.0), IntFormat(2, encoding="unsigned"),
                           args[14])
    assert torch.equal(planes, full[:, :, :planes.shape[2]]), (tile, out_kind, act)


@pytest.mark.parametrize("tile", ["", "128x64_w8x1_s5_k1024_wg_tma", "192x64_w12x1_s3_k1024_wg_tma",
                                  "128x128_w8x1_s4_k1024_wg_tma"])
def test_short_a_rows_on_tma_tiles(tile):
    """Compact A rows (ceil(K / 32) words, a multiple of 4: a block's dual planes) against full W rows: a TMA tile reads
    them as they are (its box reads past the row as zeros) and gives the padded rows' result bit for bit, with the
    residual, the dual planes and the in-kernel row sums (the pointwise route's call); short_rows_ok says so, and a
    non-TMA tile refuses them."""
    seen_default = 0
    for seed, (M, N, Kbits) in enumerate([(20000, 64, 256), (777, 256, 128), (4096, 128, 640)]):
        args = list(_args(M, N, Kbits, "float16", True, seed))
        kw = -(-Kbits // 32)
        short = args[0][:, :, :kw].contiguous()
        assert short.shape[2] % 4 == 0 and short.shape[2] < args[0].shape[2]
        args[5] = None  # the row term from the kernel's row sums
        r = _residual(M, N, "float16", seed)
        scale = torch.tensor([0.4], device=DEV)
        args[12], args[14] = 2, scale

        def run(a):
            d = torch.empty((2, M, -(-N // 32)), dtype=torch.int32, device=DEV)
            return L._bmma_gemm(a, *args[1:], tile, 0.0, residual=r, dual_out=d, row_affine=[-1, 3]), d

        ok = L.short_rows_ok(short, args[1], False, False, "float16", 2, residual=True, dual=True, rowsum=True)
        if not tile and not ok:  # (a small problem: the default tile is not a TMA one)
            with pytest.raises(ValueError, match="read by the TMA tiles only"):
                run(short)
            continue
        seen_default += not tile
        (y0, d0), (y1, d1) = run(args[0]), run(short)
        assert torch.equal(y0, y1) and torch.equal(d0, d1), (tile, M, N, Kbits)
    assert tile or seen_default == 1  # the large problem's default tile is a TMA one
    with pytest.raises(ValueError, match="read by the TMA tiles only"):
        L._bmma_gemm(short, *args[1:12], 1, "unsigned", None, "64x64_w2x2_s3_k1024", 0.0)
