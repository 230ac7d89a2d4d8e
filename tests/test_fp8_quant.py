"""The one-pass fp8 quantiser (kernels/triton/fp8_quant.py) through TRITON_INTERPRET=1: every memory order of a
4-D tensor (the tile's two contiguous dims coinciding or not), 1- to 3-D tensors, partial tiles, and bad input.
Values here are exactly representable after the scale, because the interpreter's own fp8 rounding is not
round-to-nearest-even (seen: 100 -> 104 in e4m3, 504.8 -> 256 in e5m2); tests/gpu/test_fp8_quant_gpu.py checks
the rounding, the clamp and the specials against torch's path bit for bit on the GPU."""

import itertools

import pytest
import torch

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
fq = pytest.importorskip("tcprec.kernels.triton.fp8_quant")

FMTS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _exact(shape, fmt, scale, dtype, seed=0):
    """Values v * scale where v is an fp8 value of fmt (and exact in dtype), plus the codes to expect."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(fmt)
    v = codes.float()
    v = torch.where(v.isfinite(), v, torch.zeros_like(v))  # (e5m2 has Inf codes: the quantiser saturates)
    if dtype != torch.float32:  # keep the values dtype can hold exactly
        v = torch.where(v.to(dtype).float() == v, v, torch.zeros_like(v))
    return (v * scale).to(dtype), v.to(fmt)


def _empty(shape, order, fmt):
    inv = tuple(order.index(d) for d in range(len(shape)))
    return torch.empty([shape[d] for d in order], dtype=fmt).permute(inv)


@pytest.mark.parametrize("order", list(itertools.permutations(range(4)))[::5] + [(3, 1, 2, 0), (3, 0, 1, 2)])
def test_every_memory_order(order):
    """NHWC source into the given destination order (batch-inner (3, 1, 2, 0) and (C, N, H, W) included); sizes that
    leave partial 64 x 64 tiles."""
    for fmt, dtype in ((torch.float8_e4m3fn, torch.float16), (torch.float8_e5m2, torch.float32)):
        x, want = _exact((3, 5, 70, 66), fmt, 0.25, dtype)
        out = fq.quantize_fp8(x, torch.tensor(0.25), _empty(x.shape, order, fmt))
        assert out.stride() == _empty(x.shape, order, fmt).stride()
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_wide_transpose_tile():
    """NHWC with C >= 128 into batch-inner: the 32 x 128 tile (rows of the destination far apart in the source)."""
    x, want = _exact((3, 4, 5, 130), torch.float8_e4m3fn, 1.0, torch.float32, seed=2)
    assert fq._block(x, 3, 0) == (32, 128, 4)
    out = fq.quantize_fp8(x, torch.tensor(1.0), _empty(x.shape, (3, 1, 2, 0), torch.float8_e4m3fn))
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("shape", [(70,), (9, 130), (2, 65, 3)])
def test_fewer_dims_and_strided_sources(shape):
    x, want = _exact(shape, torch.float8_e4m3fn, 2.0, torch.bfloat16, seed=1)
    out = fq.quantize_fp8(x, torch.tensor(2.0), torch.empty(shape, dtype=torch.float8_e4m3fn))
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    xs = torch.cat([x, x], dim=-1)[..., :shape[-1]]  # a strided view (rows 2x longer)
    out = fq.quantize_fp8(xs, torch.tensor(2.0), torch.empty(shape, dtype=torch.float8_e4m3fn))
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_bad_input():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="out must be torch.float8_e4m3fn or torch.float8_e5m2"):
        fq.quantize_fp8(x, torch.tensor(1.0), torch.empty(2, 3))
    with pytest.raises(ValueError, match="one shape of 1 to 4 dims"):
        fq.quantize_fp8(x, torch.tensor(1.0), torch.empty(3, 2, dtype=torch.float8_e5m2))
    with pytest.raises(ValueError, match="one shape of 1 to 4 dims"):
        fq.quantize_fp8(torch.randn(1, 1, 1, 1, 2), torch.tensor(1.0), torch.empty(1, 1, 1, 1, 2, dtype=FMTS[0]))
    with pytest.raises(ValueError, match="x must be a float16 / bfloat16 / float32"):
        fq.quantize_fp8(torch.ones(2, 3, dtype=torch.int32), torch.tensor(1.0), torch.empty(2, 3, dtype=FMTS[0]))
    with pytest.raises(ValueError, match="scale must be a one-element float32"):
        fq.quantize_fp8(x, torch.tensor([1.0, 2.0]), torch.empty(2, 3, dtype=FMTS[0]))
    assert fq.quantize_fp8(torch.empty(0, 3), torch.tensor(1.0), torch.empty(0, 3, dtype=FMTS[1])).numel() == 0
