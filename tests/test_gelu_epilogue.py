"""act="gelu" in the INT8 / FP8 conv kernels' epilogue (kernels/triton/conv_fwd.py) through TRITON_INTERPRET=1:
bit for bit the reference's erf GELU (reference_conv_int8_fp8.gelu_f32) on the float32 and the re-quantized int8
output, the FP8 kernel within its accumulation bound, gelu_f32 within a few ulp of F.gelu, and the refusals (a
pooled epilogue, the bit-serial backend).  tests/gpu/test_gelu_epilogue_gpu.py repeats them on the GPU."""

import pytest
import torch
import torch.nn.functional as F

import tcprec as tp
import tcprec.ops.qconv as qc
from tcprec.kernels import reference_conv_int8_fp8 as rf

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
cf = pytest.importorskip("tcprec.kernels.triton.conv_fwd")

# a linear as the kernels run it: (M, 1, 1, K_in) x (N, 1, 1, K_in), M not a multiple of the tile, K_in of 2 blocks
M, K_IN, N_OUT = 70, 64, 40


def _operands(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, (M, 1, 1, K_IN), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (N_OUT, 1, 1, K_IN), generator=gen, dtype=torch.int8)
    scale = torch.rand(N_OUT, generator=gen) * 2e-4 + 1e-5  # y spans about [-6, 6]: GELU's curved part
    bias = torch.randn(N_OUT, generator=gen)
    return x, w, scale, bias


def test_gelu_f32_is_the_erf_gelu_within_a_few_ulp():
    y = torch.linspace(-8, 8, 4001)
    g = rf.gelu_f32(y)
    assert g.dtype == torch.float32
    exact = F.gelu(y.double())
    # (1 + erf) cancels for y < -1: one rounding of a number near 1 (2^-24) scaled by y / 2, plus the final ulps
    err = (g.double() - exact).abs()
    assert (err <= 2.0**-24 * y.abs().double() + 4 * 2.0**-24 * exact.abs() + 1e-30).all(), float(err.max())
    assert (g - F.gelu(y, approximate="tanh")).abs().max() > 1e-4  # the erf form, not the tanh one


@pytest.mark.parametrize("out", ["float32", "float16"])
def test_int8_gelu_float_out_bit_exact(out):
    x, w, scale, bias = _operands()
    y = cf.conv2d_fwd_int8(x, w, scale=scale, bias=bias, act="gelu", out=out)
    ref = rf.conv2d_fwd_int8(x, w, scale=scale, bias=bias, act="gelu", out=out)
    assert y.dtype == ref.dtype == getattr(torch, out)
    assert torch.equal(y, ref)
    assert (ref.float() < -0.1).any() and (ref.float() > 1).any()  # both of GELU's sides are exercised


@pytest.mark.parametrize("codes", [(-128, 127, 0), (0, 255, 128)], ids=["int8", "uint8-shifted"])
def test_int8_gelu_requantized_out_bit_exact(codes):
    """The next INT8 layer's codes straight from the epilogue (what a chained linear2 reads)."""
    x, w, scale, bias = _operands(seed=1)
    y_fp = rf.conv2d_fwd_int8(x, w, scale=scale, bias=bias, act="gelu", out="float32")
    out = ("int8", float(y_fp.abs().max()) / 100, codes)
    y = cf.conv2d_fwd_int8(x, w, scale=scale, bias=bias, act="gelu", out=out)
    ref = rf.conv2d_fwd_int8(x, w, scale=scale, bias=bias, act="gelu", out=out)
    assert y.dtype == torch.int8 and torch.equal(y, ref)
    assert len(torch.unique(ref)) > 50


def test_fp8_gelu_epilogue():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(M, 1, 1, K_IN, generator=gen) * 2).to(torch.float8_e4m3fn)
    w = (torch.randn(N_OUT, 1, 1, K_IN, generator=gen) * 2).to(torch.float8_e4m3fn)
    xs, ws, bias = torch.tensor([0.05]), torch.rand(N_OUT, generator=gen) * 0.1 + 0.02, torch.randn(N_OUT,
                                                                                                    generator=gen)
    y = cf.conv2d_fwd_fp8(x, w, xs, ws, bias=bias, act="gelu", out="float32")
    ref = rf.conv2d_fwd_fp8(x, w, xs, ws, bias=bias, act="gelu", out="float32")
    # the kernel's fp32 sum against the exact one: GELU's slope is below 1.13, so the bound of the sum carries over
    bound = 1.13 * K_IN * 2.0**-23 * rf.abs_conv_acc(x, w) * (xs * ws).reshape(1, 1, 1, -1) + 1e-6
    assert ((y.double() - ref.double()).abs() <= bound).all()


def test_gelu_refused_where_it_is_not_fused():
    x, w, scale, bias = _operands()
    spec = cf.PlanesOut(0.1, 2, 0, 3, 0, 0, pool=2)
    with pytest.raises(ValueError, match="GELU is not monotone"):
        cf.conv2d_fwd_int8(x.reshape(2, 5, 7, K_IN), w, scale=scale, bias=bias, act="gelu", out=spec)
    qx, qw = tp.quantize(torch.rand(1, 4, 4, 32), "uint2"), tp.quantize(torch.randn(8, 1, 1, 32), "binary")
    with pytest.raises(ValueError, match="act='gelu'.*bit-serial"):
        qc._prepare(qx, qw, act="gelu", out_dtype=torch.float16, force_bitserial=True)
    assert qc._prepare(qx, qw, act="relu", out_dtype=torch.float16, force_bitserial=True)[2].backend == "bitserial"
    with pytest.raises(ValueError, match="act='gelu'.*pool"):
        qc.conv2d_plan(tp.quantize(torch.randn(1, 4, 4, 32), "int8"), tp.quantize(torch.randn(8, 1, 1, 32), "int8"),
                       act="gelu", pool=("max", 2, 2))
