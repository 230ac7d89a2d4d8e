"""The bit-serial GEMM's residual add (``bmma_gemm(..., residual=)``, bmma_gemm.cu TCP_RES): the float epilogue's
``act(rd(rd(y0) + residual))`` equals its torch statement (``reference_qconv.bmma_gemm_reference``) bit for bit --
every tile family (TMA 64 / 128 wide, cp.async wgmma, mma.sync, the small tile), fp16 / bf16 / fp32 output, ReLU,
LeakyReLU and none, tiles cut by M and N (the checked path beside the 16-byte one), plain GEMMs and the implicit
convolution.  Skipped without a CUDA GPU."""

import pytest
import torch

from tcprec.kernels import reference_qconv as rq
from tcprec.kernels.cuda import loader as L
from tcprec.packing import pack_bitplanes

DEV = "cuda"
TILES = ["", "128x64_w8x1_s5_k1024_wg_tma", "128x128_w8x1_s4_k1024_wg_tma", "128x128_w8x1_s4_k1024_wg",
         "64x64_w2x2_s3_k1024", "32x32_w2x2_s2_k1024"]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _args(M, N, Kbits, out_kind, relu, seed):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    a = pack_bitplanes(torch.randint(0, 4, (M, Kbits), device=DEV, generator=gen, dtype=torch.int32), 2,
                       validate=False)
    w = pack_bitplanes(torch.randint(0, 2, (N, Kbits), device=DEV, generator=gen, dtype=torch.int32), 1,
                       validate=False)
    row_term = -torch.randint(0, 3 * Kbits, (M,), device=DEV, generator=gen, dtype=torch.int32)
    col_scale = torch.rand(N, device=DEV, generator=gen) * 0.02 + 0.005
    bias = torch.randn(N, device=DEV, generator=gen)
    return (a, w, False, False, 2, row_term, None, None, col_scale, bias, relu, out_kind, 1, "unsigned", None)


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
