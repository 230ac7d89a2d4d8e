"""quantize_model on CUDA fuses ReLU6 / hardswish / SiLU into dense INT8 / FP8 QConv2d layers (decision 0154): the
summary names the fused activation, no activation is left as a float op after such a layer, each fused layer equals
the same layer on the reference backend ( the same codes, sums and epilogue; the GPU's FMA contraction and SiLU's
``ex2.approx`` within the bound below), and the network stays near the float model.  Skipped without a CUDA GPU."""

import copy

import pytest
import torch
from torch import nn

import tcprec as tp
from tcprec.qtensor import QTensor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")

DEV = "cuda"
ACTS = [(nn.ReLU6, "clamp(0,6)"), (nn.Hardswish, "hardswish"), (nn.SiLU, "silu")]


def _net(act: type) -> nn.Sequential:
    """stem conv -> BN -> act, two dense 3x3 / 1x1 conv -> BN -> act pairs, pooled linear head."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), act(),
        nn.Conv2d(32, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), act(),
        nn.Conv2d(64, 64, 1, bias=False), nn.BatchNorm2d(64), act(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    for bn in net.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 2.0)
    return net.eval()


@pytest.mark.parametrize("prec,bound", [("int8", 0.03), ("fp8", 0.08)])
@pytest.mark.parametrize("act,name", ACTS, ids=[a.__name__ for a, _ in ACTS])
def test_dense_conv_act_fused_on_gpu_equals_reference_layer(act, name, prec, bound):
    net = _net(act).to(DEV)
    x = torch.randn(16, 3, 32, 32, device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    q = tp.quantize_model(net, tp.QuantConfig(prec, first_last=prec), calibration=x, warn=False)
    convs = [r for r in q.tcprec_summary.layers if r.kind == "conv"]
    assert len(convs) == 3 and all(r.precision != "float" and name in r.fused for r in convs), convs
    assert not any(isinstance(m, act) for m in q.modules()), "an activation was left as a float op"
    with torch.no_grad():
        y, yq = net(x), q(x)
        assert ((yq - y).norm() / y.norm()).item() < bound
        for r in convs[1:]:  # the layer against itself on the reference backend, on float input
            m = q.get_submodule(r.name)
            xin = torch.randn(2, m.in_channels, 16, 16, device=DEV, generator=torch.Generator(DEV).manual_seed(3))
            ref_m = copy.deepcopy(m)
            ref_m.backend = "reference"  # torch's integer sums and the epilogue's float32 operations
            out, ref = m(xin), ref_m(xin)
            if isinstance(out, QTensor):  # chained to the next layer: its codes; a value within float32 rounding of
                # a rounding tie may round the other way (FMA contraction, SiLU's ex2.approx), by one code step
                assert (out.data != ref.data).float().mean().item() < 0.01
                out, ref = out.dequantize(torch.float32), ref.dequantize(torch.float32)
                torch.testing.assert_close(out, ref, rtol=2.0**-3, atol=float(ref_m.out_scale))
            else:  # float16 output: one rounding of values within (|y| + 8) * 2^-23 of each other (decision 0154)
                torch.testing.assert_close(out.float(), ref.float(), rtol=2.0**-10, atol=1e-3)
