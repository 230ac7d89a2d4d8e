"""Float -> float8 codes inside Triton kernels (kernels/triton/round.py ``fp8_code``) and the one-pass max-pool +
quantize (kernels/triton/fp8_quant.py ``pool_quantize_fp8``) through TRITON_INTERPRET=1, bit for bit against
torch's path (``quantize_fp8_static`` off CUDA: ``(y / scale).clamp(-max, max).to(float8)`` after
``reference_conv_bitserial.pool_nhwc``): every code, every tie between two neighbouring codes and one float32 ulp either
side, subnormals, overflow, +-Inf, NaN, +-0, e4m3 and e5m2, pool strides 0 / 1 / 2 with odd sizes."""

import pytest
import torch

pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
fq = pytest.importorskip("tcprec.kernels.triton.fp8_quant")

from tcprec.kernels import reference_conv_bitserial as rq  # noqa: E402
from tcprec.ops.qconv import quantize_fp8_static  # noqa: E402

FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
POOLS = {0: None, 1: ("max", 2, 1), 2: ("max", 2, 2)}


def _torch_codes(y: torch.Tensor, scale: torch.Tensor, fmt: str, pool=None) -> torch.Tensor:
    """torch's path: pool_nhwc, then quantize_fp8_static (CPU: torch ops), as uint8 codes."""
    return quantize_fp8_static(rq.pool_nhwc(y.float(), pool), scale, fmt).codes


def _hard_values(dt: torch.dtype) -> torch.Tensor:
    """Every finite code's value, the midpoint of each pair of neighbours (a tie) and the float32 next to it on
    either side, both signs; past the range, +-Inf, NaN, +-0, float32 subnormals."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dt).float()
    pos = torch.sort(v[(v >= 0) & v.isfinite()]).values.unique()  # (e5m2's Inf codes dropped)
    mid = (pos[1:] + pos[:-1]) / 2  # exact in float32 (fp8 values have <= 4 significant bits)
    up = torch.nextafter(mid, torch.tensor(float("inf")))
    down = torch.nextafter(mid, torch.tensor(0.0))
    m = float(torch.finfo(dt).max)
    extra = torch.tensor([m * 1.0625, m * 1.125, m * 2, 1e30, float("inf"), float("nan"), 0.0, 1e-45, 1e-40,
                          2.0**-126, float.fromhex("0x1.fffffep+127")])
    x = torch.cat([pos, mid, up, down, extra])
    return torch.cat([x, -x])


@pytest.mark.parametrize("fmt", list(FMTS))
def test_every_code_and_tie_bit_exact(fmt):
    """Stride 0 (no pool), scale 1: the rounding itself, on ~1.5k values around every code."""
    x = _hard_values(FMTS[fmt])
    n = x.numel()
    K = 16
    y = torch.cat([x, torch.zeros(-n % K)]).reshape(1, 1, -1, K)  # (1, 1, Q, 16)
    one = torch.ones(1)
    got = fq.pool_quantize_fp8(y, one, 0, FMTS[fmt])
    assert got.dtype == FMTS[fmt] and got.shape == y.shape
    assert torch.equal(got.view(torch.uint8), _torch_codes(y, one, fmt))


@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("stride", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pool_strides_and_scale(fmt, stride, dtype):
    """Odd P / Q (stride 2 drops the last row / column, stride 1 clips the window), K not a power of two, a scale
    that is not a power of two (the IEEE division), specials inside the windows (NaN propagates, +-Inf saturate)."""
    g = torch.Generator().manual_seed(7 + stride)
    y = (torch.randn(2, 5, 7, 11, generator=g) * 300).to(dtype)
    flat = y.view(-1)
    flat[[3, 40, 77, 150, 200, 301]] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e5, -1e5],
                                                    dtype=dtype)
    scale = torch.tensor([0.37])
    got = fq.pool_quantize_fp8(y, scale, stride, FMTS[fmt])
    want = _torch_codes(y, scale, fmt, POOLS[stride])
    assert got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want)


def test_signed_zero_windows_follow_torch():
    """A window of -0 and +0: torch's max-pool keeps the first of equal values (``v > m``), so the code's sign is
    the first pixel's, in both orders."""
    y = torch.tensor([-0.0, 0.0, 0.0, -0.0, 0.0, -0.0, -0.0, 0.0]).reshape(1, 2, 4, 1)
    for stride in (1, 2):
        got = fq.pool_quantize_fp8(y, torch.ones(1), stride)
        assert torch.equal(got.view(torch.uint8), _torch_codes(y, torch.ones(1), "e4m3", POOLS[stride]))


def test_strided_source_and_empty():
    y = torch.randn(2, 4, 4, 24)[..., ::2]  # channels with stride 2
    got = fq.pool_quantize_fp8(y, torch.tensor([0.01]), 2, torch.float8_e5m2)
    assert torch.equal(got.view(torch.uint8), _torch_codes(y, torch.tensor([0.01]), "e5m2", POOLS[2]))
    assert fq.pool_quantize_fp8(torch.empty(0, 3, 3, 4), torch.ones(1), 2).shape == (0, 1, 1, 4)


@pytest.mark.parametrize("kw, match", [
    (dict(pool_stride=3), r"pool_stride must be 0 \(no pool\), 1 .* or 2 .*got 3"),
    (dict(dtype=torch.float16), r"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got torch.float16"),
    (dict(scale=torch.ones(2)), r"scale must be a one-element float32 tensor on y's device"),
    (dict(scale=torch.ones(1, dtype=torch.float64)), r"scale must be a one-element float32"),
    (dict(y=torch.ones(2, 3, 4)), r"y must be a float16 / bfloat16 / float32 NHWC tensor \(N, P, Q, K\), got"),
    (dict(y=torch.ones(1, 2, 2, 3, dtype=torch.int32)), r"y must be a float16 / bfloat16 / float32"),
])
def test_bad_input(kw, match):
    args = dict(y=torch.ones(1, 2, 2, 3), scale=torch.ones(1), pool_stride=2, dtype=torch.float8_e4m3fn)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        fq.pool_quantize_fp8(args["y"], args["scale"], args["pool_stride"], args["dtype"])
