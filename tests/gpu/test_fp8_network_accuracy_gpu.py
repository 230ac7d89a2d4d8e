"""FP8 networks against their exact reference (issue 40; docs/numerics.md, "FP8 layers").

Each FP8 layer of a quantized ResNet-18, called on the inputs it saw in the network (the same input codes on both
sides), stays within the accumulation bound of its mode: fast (``fp8_accum="fast"``, the default), the narrow
accumulator over the whole reduction; promoted (``"fp32"``), fp32 adds plus Hopper's narrow accumulator inside each
BLOCK_K <= 128 chunk (tests/gpu/test_qconv_gpu.py states the same bounds on single layers).  The whole network's
divergence from its reference copy is a measurement, not a bound (`tcprec bench fp8-accuracy`,
docs/decisions/0040)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import tcprec as tp
from tcprec.nn import models as zoo
from tcprec.nn.qmodules import QConv2d, QLinear
from tcprec.ops import qconv as qc

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/gpu)")


def _net_and_input():
    m = zoo.build("resnet18", device="cuda").to(dtype=torch.float16, memory_format=torch.channels_last)
    x = torch.randn(2, 3, 224, 224, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).half()
    return m, x


def _unit(m, x):
    """sum |x_q| |w_q| |scale| of each output of QConv2d m (pooled like its output), float64."""
    xq = qc.quantize_fp8_static(x.permute(0, 2, 3, 1), m.in_scale).dequantize().double().abs().permute(0, 3, 1, 2)
    wq = m.weight.qw.dequantize().permute(0, 3, 1, 2).double().abs()
    a = F.conv2d(xq, wq, stride=m.stride, padding=m.padding, dilation=m.dilation)
    if m.ch_scale is not None:
        a = a * m.ch_scale.double().abs().view(1, -1, 1, 1)
    return F.max_pool2d(a, 2, 2) if m.pool is not None else a


def test_quantize_model_keeps_the_fast_fp8_accumulator_by_default():
    m, x = _net_and_input()
    q = tp.quantize_model(m, "fp8", calibration=x, warn=False)
    fp8 = [mod for mod in q.modules() if isinstance(mod, (QConv2d, QLinear)) and mod.precision.fp8]
    assert fp8 and all(mod.fp8_fast_accum for mod in fp8)
    q = tp.quantize_model(m, tp.QuantConfig("fp8", fp8_accum="fp32"), calibration=x, warn=False)
    assert not any(mod.fp8_fast_accum for mod in q.modules() if isinstance(mod, QConv2d) and mod.precision.fp8)


@pytest.mark.parametrize("mode", ["fp32", "fast"])
@torch.no_grad()
def test_every_fp8_layer_within_its_accumulation_bound_on_the_networks_inputs(mode):
    m, x = _net_and_input()
    q = tp.quantize_model(m, tp.QuantConfig("fp8", first_last="float", chain=False, fp8_accum=mode), calibration=x,
                          warn=False)
    calls = []
    hooks = [mod.register_forward_pre_hook(lambda mod, args: calls.append((mod, args)))
             for mod in q.modules() if isinstance(mod, QConv2d) and mod.precision.fp8]
    q(x)
    for h in hooks:
        h.remove()
    assert len(calls) >= 15
    for mod, args in calls:
        args32 = tuple(a.float() for a in args)
        mod.out_dtype = torch.float32  # only the accumulation differs between the two sides
        y = mod(*args32).double()
        mod.backend = "reference"
        exact = mod(*args32).double()
        red = mod.in_channels * mod.kernel_size[0] * mod.kernel_size[1]
        # promoted: fp32 adds plus the narrow accumulator within each BLOCK_K <= 128 chunk; fast: ~2^-13 an add
        u = 1.01 * red * 2.0**-13 if mode == "fast" else 1.01 * red * 2.0**-24 + 128 * 2.0**-13
        a = _unit(mod, args32[0])
        extra = (mod.ch_bias.double().abs().view(1, -1, 1, 1) if mod.ch_bias is not None else 0.0)
        if mod.has_residual:
            extra = extra + args32[1].double().abs()
        bound = u * a + 4 * 2.0**-24 * (a + extra) + 1e-30  # + the float32 epilogue's roundings
        err = (y - exact).abs()
        assert bool((err <= bound).all()), f"{mod}: worst err / bound {float((err / bound).max()):.3g}"
