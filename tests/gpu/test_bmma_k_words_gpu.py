"""The bit-serial GEMM's ``k_words`` (bmma_gemm.cu ``kw_data``): with the words of a row past the first ``k_words``
zero in both operands, the kernel fetches (TMA) and multiplies (every path) only the 256-bit slices that reach into
the data -- and the result is the same bits as without it, and as the torch reference's: every tile family (TMA
64 / 128 / 192 rows, cp.async wgmma, mma.sync 1024- and 512-bit steps), int32 / fp16 with a residual and the dual
planes / packed outputs, row term given or from the in-kernel row sums, K of one slice up to several steps.
Skipped without a CUDA GPU."""

import pytest
import torch

from tcprec.kernels import reference_conv_bitserial as rq
from tcprec.kernels.cuda import bmma_gemm as L

from bmma_cases import gemm_args  # tests/gpu/bmma_cases.py

DEV = "cuda"
TILES = ["", "128x64_w8x1_s5_k1024_wg_tma", "128x128_w8x1_s4_k1024_wg_tma", "192x64_w12x1_s3_k1024_wg_tma",
         "128x128_w8x1_s4_k1024_wg", "64x64_w2x2_s3_k1024", "64x64_w2x2_s3"]
SCALE = 0.37


def _call(fn, args, tile, out_kind, M, N, k_words, rowsum, seed):
    args = list(args)
    extra = {}
    if rowsum:  # the pointwise route's form: the row term from the kernel's row sums of A
        args[5] = None
        extra["row_affine"] = [-1, 5]
    if out_kind == "float16":
        gen = torch.Generator(device=DEV).manual_seed(seed + 7)
        extra["residual"] = (torch.randn(M, N, device=DEV, generator=gen) * 2).half()
        extra["dual_out"] = torch.empty((2, M, -(-N // 32)), dtype=torch.int32, device=DEV)
    out = fn(*args, tile, 0.0, k_words=k_words, **extra)
    return out, extra.get("dual_out")


@pytest.mark.parametrize("tile", TILES, ids=[t or "default" for t in TILES])
@pytest.mark.parametrize("out_kind", ["int32", "float16", "packed"])
@pytest.mark.parametrize("rowsum", [False, True], ids=["row_term", "row_sums"])
def test_k_words_changes_nothing(tile, out_kind, rowsum):
    out_scale = torch.tensor([SCALE], device=DEV)
    cases = [(1000, 64, 64), (777, 256, 200), (2048, 128, 256), (640, 192, 300), (513, 64, 1100), (1024, 256, 2304)]
    for seed, (M, N, Kbits) in enumerate(cases):
        if "192x" in tile and N % 64:
            continue
        args = gemm_args(M, N, Kbits, out_kind, seed, out_bits=2,
                         out_scale=out_scale if out_kind != "int32" else None)
        if out_kind == "float16":
            args[14] = out_scale  # the dual planes' scale
        kw = -(-Kbits // 32)
        assert args[0].shape[2] > kw or Kbits % 512 == 0  # (the promise: the padding words are zero)
        got, got_d = _call(L._bmma_gemm, args, tile, out_kind, M, N, kw, rowsum, seed)
        full, full_d = _call(L._bmma_gemm, args, tile, out_kind, M, N, None, rowsum, seed)
        want, want_d = _call(rq.bmma_gemm_reference, args, tile, out_kind, M, N, kw, rowsum, seed)
        where = (tile, out_kind, rowsum, M, N, Kbits)
        assert torch.equal(got, full) and torch.equal(got, want), where
        if got_d is not None:
            assert torch.equal(got_d, full_d) and torch.equal(got_d, want_d), where


def test_k_words_is_checked():
    args = gemm_args(256, 64, 64, "int32", 0)
    for bad in (0, 17, 2.0):
        with pytest.raises(ValueError, match="k_words must be an int in 1..Kw"):
            L._bmma_gemm(*args, "", 0.0, k_words=bad)
    args[0][:, :, 5] = 1  # a set bit past word 2: the reference refuses the broken promise
    with pytest.raises(ValueError, match="hold set bits past word 2"):
        rq.bmma_gemm_reference(*args, "", 0.0, k_words=2)
