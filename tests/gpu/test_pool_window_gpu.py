"""``max_pool_quantize`` on the GPU (kernels/triton/pool_window.py) against torch's CUDA max-pool followed by the
quantizer, bit for bit, at ResNet-50's stem-pool size; and a torchvision-like stem inside a converted network."""

import pytest
import torch

from tcprec.ops import qconv as qc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")


@pytest.mark.parametrize("operand, fmt", [("int8", "uint8"), ("planes", "uint2"), ("compact", "uint2"),
                                          ("fp8", "e4m3")])
def test_resnet_stem_pool(operand, fmt):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 112, 112, 64, device="cuda", generator=g).half().relu()  # NHWC, as the stem's ReLU gives
    s = torch.tensor([0.02], device="cuda")
    w = qc.max_pool_window(3, 2, 1)
    a = qc.max_pool_quantize(x, w, operand, fmt, s, with_float=True)
    b = qc.max_pool_quantize(x, w, operand, fmt, s, with_float=True, backend="reference")
    assert a.shape == b.shape == (16, 56, 56, 64) and torch.equal(a.data, b.data) and torch.equal(a.hp, b.hp)
