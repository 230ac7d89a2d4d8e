"""The one-pass fp8 quantiser (kernels/triton/fp8_quant.py) on the GPU: the same bits as torch's path
(``(x.float() / scale).clamp(-max, max).to(fp8)``, round to nearest even) for random values, exact ties, values
past the range (saturated), subnormals, signed zeros and NaN, from fp16 / bf16 / fp32 sources into the memory
orders ``ops.conv`` uses; ``ops.conv.to_fp8`` on CUDA equals its CPU (torch) result."""

import pytest
import torch

from tcprec.ops import conv as opc

fq = pytest.importorskip("tcprec.kernels.triton.fp8_quant")

DEV = "cuda"
ORDERS = [(0, 1, 2, 3), (3, 1, 2, 0), (3, 0, 1, 2), (1, 2, 3, 0)]


def _values(shape, dtype, seed):
    g = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(shape, device=DEV, generator=g) * 200
    flat = x.view(-1)
    specials = torch.tensor([100.0, 104.0, 98.0, 99.0, 460.0, 1e6, -1e6, 2.0**-10, 3 * 2.0**-11, -0.0, 0.0,
                             float("nan"), float("inf"), -float("inf"), 57344.0, 61440.0, 2.0**-17, 1.5 * 2.0**-16],
                            device=DEV)
    flat[:specials.numel()] = specials  # e4m3 ties (100: 96|104, 99 ...), overflow, subnormals, zeros, NaN, Inf
    return x.to(dtype)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_same_bits_as_torch(fmt, dtype):
    dt = opc.FP8_DTYPES[fmt]
    x = _values((6, 9, 11, 72), dtype, seed=3)
    scale = torch.tensor(0.5, device=DEV)
    fmax = torch.finfo(dt).max
    want = (x.float() / scale).clamp(-fmax, fmax).to(dt).view(torch.uint8)
    for order in ORDERS:
        inv = tuple(order.index(d) for d in range(4))
        out = torch.empty([x.shape[d] for d in order], dtype=dt, device=DEV).permute(inv)
        fq.quantize_fp8(x, scale, out)
        got = out.view(torch.uint8)
        nan = (x.float() / scale).isnan()
        assert torch.equal(got[~nan], want[~nan]), f"{fmt} {dtype} order {order}"
        assert out.float()[nan].isnan().all()


def test_to_fp8_on_cuda_matches_the_cpu_path():
    x = torch.randn(16, 7, 7, 48) * 30
    for fmt in ("e4m3", "e5m2"):
        for order in (None, (3, 1, 2, 0)):
            g = opc.to_fp8(x.to(DEV), fmt, memory_order=order)
            assert torch.allclose(g.scale.cpu(), opc.to_fp8(x, fmt).scale, rtol=1e-6, atol=0)  # amax / max(fmt)
            c = opc.to_fp8(x, fmt, memory_order=order, scale=g.scale.cpu())  # the CPU path, the same scale
            assert g.data.stride() == c.data.stride()
            assert torch.equal(g.data.cpu().view(torch.uint8), c.data.view(torch.uint8))
