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


@pytest.mark.parametrize("compact", [False, True])
def test_resnet_stem_pool_of_planes(compact):
    """``max_pool_planes`` at ResNet-50's stem-pool size: the max of the planes' codes equals the codes of torch's
    pooled float, bit for bit (docs/decisions/0172)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(16, 112, 112, 64, device="cuda", generator=g).half().relu()
    s = torch.tensor([0.02], device="cuda")
    w = qc.max_pool_window(3, 2, 1)
    planes = qc.max_pool_quantize(x, qc.max_pool_window(1, 1, 0), "compact", "uint2", s)  # the codes of x
    got = qc.max_pool_planes(planes, w, compact=compact)
    want = qc.max_pool_quantize(x, w, "compact" if compact else "planes", "uint2", s, backend="reference")
    assert got.shape == want.shape == (16, 56, 56, 64) and torch.equal(got.data, want.data)


def test_stem_writes_planes_the_pool_pools_them():
    """A ResNet front converted at w1a2 (INT8 stem, sm_90: stem_conv.cu writes the readers' 2-bit planes; the pool
    takes the max of the codes; conv1 and the shortcut read them): equal to the unchained network (the stem's float,
    the pool of the float, each reader quantizing) bit for bit, float32."""
    import dataclasses

    import tcprec as tp
    from torch import nn

    class Front(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            self.a = nn.Sequential(nn.Conv2d(64, 64, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
            self.b = nn.Sequential(nn.Conv2d(64, 256, 1, bias=False), nn.BatchNorm2d(256))
            self.c = nn.Sequential(nn.Conv2d(64, 256, 1, bias=False), nn.BatchNorm2d(256))
            self.fc = nn.Linear(256, 10)  # (the last layer: int8 with first_last="int8")

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            return self.fc(torch.relu(self.c(self.a(x)) + self.b(x)).mean((2, 3)))

    torch.manual_seed(0)
    net = Front().eval().cuda().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 64, 64, device="cuda").contiguous(memory_format=torch.channels_last)
    cfg = tp.QuantConfig("w1a2", first_last="int8")
    q = tp.quantize_model(net, cfg, calibration=x, warn=False)
    assert q.get_submodule("maxpool").planes_in and q.get_submodule("conv1").out_layout == "compact"
    u = tp.quantize_model(net, dataclasses.replace(cfg, chain=False), calibration=x, warn=False)
    with torch.no_grad():
        assert torch.equal(q(x), u(x))
