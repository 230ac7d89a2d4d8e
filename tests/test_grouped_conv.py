"""Grouped / depthwise quantized convolution: the reference is exact (against float64 F.conv2d on the decoded
values and against the integer tap loop), the Triton direct conv equals it bit for bit (TRITON_INTERPRET=1 on the
CPU, set in conftest.py), and QGroupedConv2d / quantize_model put a depthwise MobileNet-style block on it."""

import pytest
import torch
import torch.nn.functional as F

import tcprec as tp
from tcprec.kernels import reference_conv_grouped as rg
from tcprec.kernels.reference_conv_bitserial import decode_values
from tcprec.ops.qconv_grouped import choose_grouped_backend, grouped_conv2d

# (N, H, W, C, K, R, groups, stride, pad4 (top, bottom, left, right), dilation, x format, w format)
CASES = [
    (2, 7, 6, 8, 8, 3, 8, (2, 2), (0, 1, 0, 1), (1, 1), "uint8", "int8"),  # depthwise, TF "same" stride 2
    (1, 5, 5, 6, 12, 3, 3, (1, 1), (1, 1, 2, 0), (1, 2), "int8", "int4"),  # grouped, multiplier 2, dilation
    (1, 6, 4, 4, 4, 5, 4, (1, 2), (2, 2, 2, 2), (1, 1), "uint4", "int8"),  # 5x5 depthwise
    (1, 4, 4, 4, 2, 1, 2, (1, 1), (0, 0, 0, 0), (1, 1), "int2", "int3"),   # pointwise grouped
]


def _operands(case, seed=0):
    N, H, W, C, K, R, g, st, pad4, dil, fx, fw = case
    gen = torch.Generator().manual_seed(seed)
    xs = torch.rand(N, H, W, C, generator=gen)
    x = tp.quantize(xs if fx.startswith("u") else 2 * xs - 1, fx)
    w = tp.quantize(torch.randn(K, R, R, C // g, generator=gen), fw, tp.PerChannel(0))
    return x, w


def _oracle(x, w, g, st, pad4, dil):
    xv = F.pad(decode_values(x.codes, x.fmt).permute(0, 3, 1, 2), (pad4[2], pad4[3], pad4[0], pad4[1]))
    wv = decode_values(w.codes, w.fmt).permute(0, 3, 1, 2)
    return F.conv2d(xv, wv, stride=st, dilation=dil, groups=g).permute(0, 2, 3, 1).round().to(torch.int32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[6]}_k{c[5]}_{c[10]}x{c[11]}")
def test_reference_exact(case):
    x, w = _operands(case)
    _, _, _, _, _, _, g, st, pad4, dil, _, _ = case
    want = _oracle(x, w, g, st, pad4, dil)
    got = grouped_conv2d(x, w, groups=g, stride=st, padding=pad4, dilation=dil, out_dtype=torch.int32,
                         backend="reference")
    assert torch.equal(got, want)
    taps = rg.grouped_conv_int_taps(decode_values(x.codes, x.fmt), decode_values(w.codes, w.fmt), g, st, pad4, dil)
    assert torch.equal(taps.to(torch.int32), want)


def test_reference_beyond_float32_uses_integer_taps():
    """Sums that float32 cannot hold exactly (bound >= 2**24) take the integer path and stay exact."""
    x = torch.full((1, 3, 3, 1), 2 ** 12, dtype=torch.int64)
    w = torch.full((1, 3, 3, 1), 2 ** 12 + 1, dtype=torch.int64)
    y = rg.grouped_conv_int(x, w, 1)
    assert y.item() == 9 * 2 ** 12 * (2 ** 12 + 1)


@pytest.mark.parametrize("case", CASES[:2], ids=lambda c: f"g{c[6]}_k{c[5]}_{c[10]}x{c[11]}")
def test_triton_equals_reference(case):
    pytest.importorskip("triton", reason="triton is a Linux dependency of tcprec")
    x, w = _operands(case, seed=1)
    _, _, _, _, K, _, g, st, pad4, dil, _, _ = case
    kw = dict(groups=g, stride=st, padding=pad4, dilation=dil)
    ref = grouped_conv2d(x, w, out_dtype=torch.int32, backend="reference", **kw)
    assert torch.equal(grouped_conv2d(x, w, out_dtype=torch.int32, backend="triton", **kw), ref)
    gen = torch.Generator().manual_seed(2)
    bias, scale = torch.randn(K, generator=gen), torch.rand(K, generator=gen) + 0.5
    for act in (None, "relu", ("clamp", 0.0, 6.0), ("leaky", 0.125), "hardswish"):
        a = grouped_conv2d(x, w, scale=scale, bias=bias, act=act, backend="reference", **kw)
        b = grouped_conv2d(x, w, scale=scale, bias=bias, act=act, backend="triton", **kw)
        assert torch.equal(a, b), act  # the interpreter does not contract into FMAs (1 ulp on a GPU)


def test_planner_says_why_and_refuses_silently_nothing():
    name, why = choose_grouped_backend(torch.device("cpu"))
    assert name == "reference" and "reference" in why
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_grouped_backend(torch.device("cpu"), "int8")
    x, w = _operands(CASES[0])
    with pytest.raises(ValueError, match="groups=3 does not fit"):
        grouped_conv2d(x, w, groups=3)
    with pytest.raises(ValueError, match="act must be None or one of"):
        grouped_conv2d(x, w, groups=8, act="gelu")


class _Block(torch.nn.Module):
    """MobileNetV2 / EfficientNet-Lite style: expand 1x1 -> BN -> ReLU6 -> depthwise 3x3 -> BN -> ReLU6 -> project."""

    def __init__(self, c=8, e=16, act=torch.nn.ReLU6):
        super().__init__()
        self.expand = torch.nn.Conv2d(c, e, 1, bias=False)
        self.bn0, self.a0 = torch.nn.BatchNorm2d(e), act()
        self.dw = torch.nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False)
        self.bn1, self.a1 = torch.nn.BatchNorm2d(e), act()
        self.project = torch.nn.Conv2d(e, c, 1, bias=False)

    def forward(self, x):
        return self.project(self.a1(self.bn1(self.dw(self.a0(self.bn0(self.expand(x))))))) + x


def _randomize_bn(m):
    g = torch.Generator().manual_seed(3)
    for bn in m.modules():
        if isinstance(bn, torch.nn.BatchNorm2d):
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=g) * 0.1)
            bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
    return m.eval()


@pytest.mark.parametrize("act,fused", [(torch.nn.ReLU6, "clamp(0,6)"), (torch.nn.Hardswish, "hardswish"),
                                       (torch.nn.SiLU, "silu")])
def test_depthwise_block_quantized_with_bn_and_act_fused(act, fused):
    torch.manual_seed(0)
    m = _randomize_bn(_Block(act=act))
    x = torch.randn(4, 8, 6, 6)
    q = tp.quantize_model(m, "int8", calibration=x, warn=False)
    rec = {r.name: r for r in q.tcprec_summary.layers}
    assert rec["dw"].precision == "w8a8" and rec["dw"].fused == ("bn", fused) and rec["dw"].backend == "reference"
    assert not q.tcprec_summary.float_layers
    assert type(q.dw).__name__ == "QGroupedConv2d"
    with torch.no_grad():
        y, yq = m(x), q(x)
    assert ((yq - y).norm() / y.norm()).item() < 0.05  # int8 end to end: a few 1e-2 at most


def test_depthwise_layer_equals_its_integer_math():
    """QGroupedConv2d's output is the epilogue of the exact integer sums of its own codes."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)
    x = torch.rand(2, 4, 5, 5)
    q = tp.nn.qgrouped.QGroupedConv2d.from_float(conv, "int8", in_absmax=1.0, signed_input=False,
                                                 act=("clamp", 0.0, 6.0))
    xq = tp.quantize(x.permute(0, 2, 3, 1), "uint8", scale=q.in_scale)
    wv = decode_values(q.w_codes, q.w_fmt).permute(0, 3, 1, 2)
    C = F.conv2d(decode_values(xq.codes, xq.fmt).permute(0, 3, 1, 2), wv, padding=1, groups=4)
    col = q.in_scale * q.w_scale
    want = (C.float() * col[None, :, None, None] + conv.bias.detach()[None, :, None, None]).clamp(0, 6)
    assert torch.equal(q(x), want)
